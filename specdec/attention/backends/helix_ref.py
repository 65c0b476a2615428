"""Helix reference backend: absorbed-MLA attention over a context sharded across ranks.

Under Helix (docs/design.md §7) a rank's page tables hold only the pages it owns, so
attention over them alone is a partial result. This backend computes, in plain
PyTorch, each query's partial output and log-sum-exp over the rank's shard
(:func:`~specdec.parallel.helix.plan_shard`, :func:`~specdec.parallel.helix.shard_attention`),
exchanges them by head with one all-to-all, combines them exactly
(:func:`~specdec.parallel.helix.helix_attention`) and gathers the heads back, so a
layer gets ``[num_tokens, H, v_head_dim]`` as from any other backend.

It runs every Helix MLA shape: decode, verify and context phases, mixed batches,
any page size, any dtype (FP8 caches dequantised on read). Its limits are the ones
of the head exchange: ``num_heads`` divisible by ``helix_cp``, and a K-only latent
whose value is the first ``v_head_dim`` values of the key. Every rank of the group
must run the same phases in the same order (the exchange is a collective).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.attention.backends.base import AttentionBackend, PhaseBatch
from specdec.attention.shapes import YES, AttnShape, Verdict, no
from specdec.errors import ConfigError
from specdec.parallel.helix import HelixShard, ShardPlan, gather_heads, helix_attention, plan_shard


@dataclass(frozen=True, slots=True)
class HelixPlan:
    shard: HelixShard
    plan: ShardPlan  # this rank's gather of its owned rows for the phase


class HelixRefBackend(AttentionBackend):
    """Helix attention in plain PyTorch: shard partials, all-to-all by head, exact LSE combine."""

    name = "helix_ref"

    def supports(self, shape: AttnShape) -> Verdict:
        if shape.helix_cp < 2:
            return no(f"helix_ref merges partials across Helix ranks: needs helix_cp > 1, got {shape.helix_cp} "
                      "(unsharded pages: torch_ref)")
        if shape.kind != "mla":
            return no(f"Helix attention is absorbed MLA over a K-only latent: kind must be 'mla', got {shape.kind!r}")
        if shape.num_heads % shape.helix_cp:
            return no(f"the all-to-all splits heads across ranks: num_heads ({shape.num_heads}) must be divisible "
                      f"by helix_cp ({shape.helix_cp})")
        if shape.v_head_dim > shape.head_dim:
            return no(f"V is the first v_head_dim values of the latent key: v_head_dim ({shape.v_head_dim}) must be "
                      f"<= head_dim ({shape.head_dim})")
        return YES

    def cost(self, shape: AttnShape) -> float:
        # Correct, not fast: like torch_ref, chosen only where nothing faster supports the shape.
        return 100.0

    def plan(self, batch: PhaseBatch) -> HelixPlan:
        shard = batch.shard
        if not isinstance(shard, HelixShard):
            raise ConfigError("helix_ref needs PhaseBatch.shard (this rank's HelixShard); "
                              f"got {type(shard).__name__}")
        plan = plan_shard(batch.q_lens, batch.kv_lens, batch.page_tables, shard.layout, shard.rank, batch.device)
        return HelixPlan(shard, plan)

    def run(self, plan: HelixPlan, q, k_cache, v_cache, scale: float, v_head_dim: int, *,
            kv_scale: float = 1.0, local_heads: bool = False) -> torch.Tensor:
        """See :meth:`AttentionBackend.run`; ``local_heads``: return only this rank's head slice
        ``[T, H / cp, Dv]`` (for a head-parallel output projection), not every head gathered back."""
        if v_cache is not None:
            raise ConfigError("helix_ref reads K-only latent layers (v_cache must be None)")
        group = plan.shard.group
        head_slice = helix_attention(plan.plan, q, k_cache, scale, v_head_dim, group, kv_scale)  # [T, H/cp, Dv]
        return head_slice if local_heads else gather_heads(head_slice, group)  # [T, H/cp or H, Dv]
