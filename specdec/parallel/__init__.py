"""Parallel execution across ranks: Helix context parallelism (docs/design.md §7)."""

from specdec.parallel.helix import (
    HelixKVManager,
    HelixLayout,
    HelixShard,
    ShardPlan,
    combine_partials,
    gather_heads,
    helix_attention,
    merge_over_ranks,
    mla_attention_lse,
    plan_shard,
    shard_attention,
)

__all__ = [
    "HelixKVManager",
    "HelixLayout",
    "HelixShard",
    "ShardPlan",
    "combine_partials",
    "gather_heads",
    "helix_attention",
    "merge_over_ranks",
    "mla_attention_lse",
    "plan_shard",
    "shard_attention",
]
