"""Attention metadata for one step, planned once and passed to every layer.

Tokens of a step are packed context requests first, then generation requests.
Each phase has its own backend (chosen by the selector) and its own plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specdec.attention.backends.base import AttentionBackend, PhaseBatch
from specdec.attention.selector import select
from specdec.attention.shapes import AttnShape


@dataclass(frozen=True, slots=True)
class PhasePlan:
    """One phase of a step: query rows ``[start, stop)``, its backend and plan."""

    shape: AttnShape
    start: int
    stop: int
    backend: AttentionBackend
    plan: Any


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Everything a layer needs to write and read the paged cache this step.

    Attributes:
        slot_mapping: cache slot of each token of the step. ``[num_tokens]``
        phases: context phase (if any) then generation phase (if any).
    """

    slot_mapping: torch.Tensor
    phases: tuple[PhasePlan, ...]

    @property
    def backends(self) -> dict[str, str]:
        """Phase name → backend name, for stats and ``engine.attention_backends``."""
        return {p.shape.phase: p.backend.name for p in self.phases}

    def attend(self, q, k, v, k_cache, v_cache, scale: float, v_head_dim: int) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend each phase.

        Args:
            q: ``[num_tokens, num_heads, head_dim]``.
            k: ``[num_tokens, num_kv_heads, head_dim]``.
            v: ``[num_tokens, num_kv_heads, v_head_dim]`` or ``None`` (K-only layer).
            k_cache, v_cache: the layer's pool tensors (``v_cache`` None when K-only).

        Returns:
            ``[num_tokens, num_heads, v_head_dim]``.
        """
        k_cache.index_copy_(0, self.slot_mapping, k.to(k_cache.dtype))
        if v_cache is not None:
            v_cache.index_copy_(0, self.slot_mapping, v.to(v_cache.dtype))
        if len(self.phases) == 1:
            p = self.phases[0]
            return p.backend.run(p.plan, q, k_cache, v_cache, scale, v_head_dim)
        out = q.new_empty(q.shape[0], q.shape[1], v_head_dim)
        for p in self.phases:
            out[p.start : p.stop] = p.backend.run(p.plan, q[p.start : p.stop], k_cache, v_cache, scale, v_head_dim)
        return out


def plan_step(
    context: list[tuple[int, int, tuple[int, ...]]],
    generation: list[tuple[int, int, tuple[int, ...]]],
    slot_mapping: torch.Tensor,
    shape_of,
    tokens_per_block: int,
    requested: str | None = None,
) -> AttentionMetadata:
    """Plan a step's attention.

    Args:
        context: ``(q_len, kv_len, page_table)`` of each context request.
        generation: the same for each generation request.
        slot_mapping: ``[num_tokens]`` cache slots, context tokens first.
        shape_of: ``(phase, max_q_len, mixed) -> AttnShape`` for this model and cache.
        tokens_per_block: page size.
        requested: a backend name the user forced, or ``None``.

    Raises:
        UnsupportedShapeError: the requested backend cannot run a phase.
    """
    phases, start, mixed = [], 0, bool(context) and bool(generation)
    for phase, seqs in (("context", context), ("generation", generation)):
        if not seqs:
            continue
        q_lens = tuple(s[0] for s in seqs)
        shape = shape_of(phase, max(q_lens), mixed and phase == "generation")
        backend = select(shape, requested)
        batch = PhaseBatch(q_lens, tuple(s[1] for s in seqs), tuple(s[2] for s in seqs), tokens_per_block, slot_mapping.device)
        stop = start + batch.num_tokens
        phases.append(PhasePlan(shape, start, stop, backend, backend.plan(batch)))
        start = stop
    return AttentionMetadata(slot_mapping, tuple(phases))
