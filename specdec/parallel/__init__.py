"""Parallel execution across ranks: Helix context parallelism (docs/design.md §7)."""

from specdec.parallel.helix import (
    HelixKVManager,
    HelixLayout,
    HelixShard,
    ShardPlan,
    combine_partials,
    exchange_heads,
    gather_heads,
    helix_attention,
    latent_attention_lse,
    merge_over_ranks,
    mla_attention_lse,
    plan_shard,
    shard_attention,
)
from specdec.parallel.runtime import HelixPageManager, helix_shard, init_process_group

__all__ = [
    "HelixPageManager",
    "helix_shard",
    "init_process_group",
    "HelixKVManager",
    "HelixLayout",
    "HelixShard",
    "ShardPlan",
    "combine_partials",
    "exchange_heads",
    "gather_heads",
    "helix_attention",
    "latent_attention_lse",
    "merge_over_ranks",
    "mla_attention_lse",
    "plan_shard",
    "shard_attention",
]
