"""Attention metadata for one step, planned once and passed to every layer.

Tokens of a step are packed context requests first, then generation requests.
Each phase has its own backend (chosen by the selector) and its own plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from specdec.attention.backends.base import AttentionBackend, PhaseBatch
from specdec.attention.fp8 import E4M3, prepare_kv, prepare_q
from specdec.attention.selector import available_backends, select
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
        write_rows: under Helix, the rows of the step whose K/V this rank owns and stores
            (``slot_mapping`` is negative elsewhere). ``[num_owned]``; ``None``: every row.
        shard: under Helix, this rank's :class:`~specdec.parallel.helix.HelixShard`; ``None``: unsharded.
    """

    slot_mapping: torch.Tensor
    phases: tuple[PhasePlan, ...]
    write_rows: torch.Tensor | None = None
    shard: Any = None

    def local_heads(self, num_heads: int) -> slice:
        """The heads (of the layer's ``num_heads``) :meth:`attend` returns with ``local_heads=True``:
        under Helix the ``num_heads / (tp * cp)`` the exchange by head leaves this process
        (:meth:`~specdec.parallel.helix.HelixShard.exchanged_heads`), else all of them."""
        if self.shard is None:
            return slice(0, num_heads)
        return self.shard.exchanged_heads(num_heads)

    @property
    def backends(self) -> dict[str, str]:
        """Phase name → backend name, for stats and ``engine.attention_backends``."""
        return {p.shape.phase: p.backend.name for p in self.phases}

    def attend(self, q, k, v, k_cache, v_cache, scale: float, v_head_dim: int, *, kv_scale: float = 1.0,
               q_scale: float | None = None, compute_dtype: torch.dtype | None = None,
               local_heads: bool = False) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend each phase.

        Args:
            q: ``[num_tokens, num_heads, head_dim]`` (E4M3 allowed with ``q_scale``).
            k: ``[num_tokens, num_kv_heads, head_dim]``; E4M3 (already divided by
                ``kv_scale``) is written as is into an E4M3 cache. ``None``: the caller
                already stored this step's K/V at ``slot_mapping`` (a fused kernel).
            v: ``[num_tokens, num_kv_heads, v_head_dim]`` or ``None`` (K-only layer).
            k_cache, v_cache: the layer's pool tensors (``v_cache`` None when K-only).
            kv_scale: per-tensor scale of an FP8 cache (1.0 otherwise).
            q_scale: scale of an E4M3 ``q``, or of the internal quantization of a float ``q``.
            compute_dtype: dtype attention computes in (default: ``q``'s, bf16 for an E4M3 ``q``).
            local_heads: under Helix, return only this rank's heads (:meth:`local_heads`), the
                slice the exchange by head leaves it, for a head-parallel output projection;
                without Helix every head.

        Returns:
            ``[num_tokens, num_heads, v_head_dim]`` (with ``local_heads`` under Helix:
            ``[num_tokens, num_heads / cp, v_head_dim]``).

        Raises:
            FP8InputError: K and V of different dtypes, or E4M3 inputs for a non-FP8 cache.
        """
        if k is not None:
            k, v = prepare_kv(k, v, k_cache.dtype, kv_scale)
            slots = self.slot_mapping
            if self.write_rows is not None:  # Helix: only the positions this rank owns
                slots, k = slots[self.write_rows], k[self.write_rows]
                v = None if v is None else v[self.write_rows]
            _write(k_cache, slots, k)
            if v_cache is not None:
                _write(v_cache, slots, v)
        if q.dtype == E4M3 or q_scale is not None:
            q = prepare_q(q, q_scale, compute_dtype or (torch.bfloat16 if q.dtype == E4M3 else q.dtype))
        extra = {"kv_scale": kv_scale} if kv_scale != 1.0 else {}
        heads = q.shape[1]
        if local_heads and self.shard is not None:  # Helix backends return the exchanged head slice
            extra["local_heads"] = True
            heads //= self.shard.cp
        if len(self.phases) == 1:
            p = self.phases[0]
            return p.backend.run(p.plan, q, k_cache, v_cache, scale, v_head_dim, **extra)
        out = q.new_empty(q.shape[0], heads, v_head_dim)
        for p in self.phases:
            out[p.start : p.stop] = p.backend.run(p.plan, q[p.start : p.stop], k_cache, v_cache, scale, v_head_dim, **extra)
        return out


def _write(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """``cache[slots] = x``; FP8 is copied as bytes (no CPU kernel copies float8 by index)."""
    if cache.dtype == E4M3:
        cache, x = cache.view(torch.uint8), x.view(torch.uint8)
    cache.index_copy_(0, slots, x)


def plan_step(
    context: list[tuple[int, int, tuple[int, ...]]],
    generation: list[tuple[int, int, tuple[int, ...]]],
    slot_mapping: torch.Tensor,
    shape_of,
    tokens_per_block: int,
    requested: str | None = None,
    shard=None,
    backends: Sequence[AttentionBackend] | None = None,
) -> AttentionMetadata:
    """Plan a step's attention.

    Args:
        context: ``(q_len, kv_len, page_table)`` of each context request.
        generation: the same for each generation request.
        slot_mapping: ``[num_tokens]`` cache slots, context tokens first.
        shape_of: ``(phase, max_q_len, mixed) -> AttnShape`` for this model and cache.
        tokens_per_block: page size.
        requested: a backend name the user forced, or ``None``.
        shard: under Helix, this rank's :class:`~specdec.parallel.helix.HelixShard`: page tables
            are rank-local and ``slot_mapping`` is negative for positions another rank owns
            (this rank writes only its own). ``None``: unsharded.
        backends: the candidates of every phase (an engine's own set); ``None``: a new set of
            every registered backend with default options (:func:`~specdec.attention.selector.available_backends`).

    Raises:
        ConfigError: ``requested`` names no candidate.
        UnsupportedShapeError: the requested backend cannot run a phase.
    """
    if backends is None:
        backends = available_backends()
    phases, start, mixed = [], 0, bool(context) and bool(generation)
    for phase, seqs in (("context", context), ("generation", generation)):
        if not seqs:
            continue
        q_lens = tuple(s[0] for s in seqs)
        shape = shape_of(phase, max(q_lens), mixed and phase == "generation")
        backend = select(shape, requested, backends)
        batch = PhaseBatch(q_lens, tuple(s[1] for s in seqs), tuple(s[2] for s in seqs), tokens_per_block,
                           slot_mapping.device, shard)
        stop = start + batch.num_tokens
        phases.append(PhasePlan(shape, start, stop, backend, backend.plan(batch)))
        start = stop
    write_rows = None if shard is None else torch.nonzero(slot_mapping >= 0).flatten()  # [num_owned]
    return AttentionMetadata(slot_mapping, tuple(phases), write_rows, shard)
