"""The backend contract: ``supports`` (correctness), ``cost`` (speed), ``plan`` / ``run``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from specdec.attention.shapes import AttnShape, Verdict
from specdec.config import AttentionConfig


@dataclass(frozen=True, slots=True)
class PhaseBatch:
    """The requests of one phase of a step, planned once and reused by every layer.

    Queries of the phase are packed: request ``i`` owns query rows
    ``q_start[i] : q_start[i] + q_lens[i]`` of the phase's slice, at positions
    ``kv_lens[i] - q_lens[i] ... kv_lens[i] - 1`` (their K/V are already in the
    cache when attention runs).

    Attributes:
        q_lens: query tokens per request. ``[num_seqs]``
        kv_lens: cached tokens per request after this step's writes. ``[num_seqs]``
        page_tables: physical pages per request, logical order.
        tokens_per_block: page size.
        device: where the plan's tensors go.
        shard: under Helix, this rank's :class:`~specdec.parallel.helix.HelixShard`: the page
            tables then hold only the pages this rank owns (``kv_lens`` stay global). ``None``:
            the pages hold the whole context.
    """

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    page_tables: tuple[tuple[int, ...], ...]
    tokens_per_block: int
    device: torch.device
    shard: Any = None

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)


class AttentionBackend:
    """Base class of attention backends over the paged pool.

    The selector's registry holds backend classes; each engine builds its own instances with
    :meth:`from_config`, so one engine's options never reach another's backends.
    """

    name: ClassVar[str] = ""

    @classmethod
    def from_config(cls, config: AttentionConfig) -> AttentionBackend:
        """An instance built with the options of ``config`` that apply to this backend (default:
        none, ``cls()``)."""
        return cls()

    def supports(self, shape: AttnShape) -> Verdict:  # pragma: no cover - abstract
        """Whether this backend computes ``shape`` correctly (never a speed judgement)."""
        raise NotImplementedError

    def cost(self, shape: AttnShape) -> float:
        """Relative expected time; lower is preferred by automatic selection."""
        return 1.0

    def plan(self, batch: PhaseBatch) -> Any:  # pragma: no cover - abstract
        """Turn a phase's requests into this backend's metadata (once per step)."""
        raise NotImplementedError

    def run(
        self,
        plan: Any,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        scale: float,
        v_head_dim: int,
        *,
        kv_scale: float = 1.0,
    ) -> torch.Tensor:  # pragma: no cover - abstract
        """Attend the phase's queries over the cache.

        Args:
            plan: from :meth:`plan`.
            q: ``[num_tokens, num_heads, head_dim]``.
            k_cache: ``[num_slots, num_kv_heads, head_dim]``.
            v_cache: ``[num_slots, num_kv_heads, v_head_dim]``, or ``None`` for a
                K-only (MLA latent) layer, whose V is ``K[..., :v_head_dim]``.
            scale: softmax scale, always explicit.
            v_head_dim: output width per head.
            kv_scale: per-tensor dequantisation scale of the cache, K and V alike
                (an FP8 cache holds ``value / kv_scale``); 1.0 for bf16/fp32 caches.

        A backend that runs Helix shapes (``helix_cp > 1``) also takes ``local_heads: bool``
        (passed only under Helix, by :meth:`AttentionMetadata.attend`): return this rank's head
        slice after the exchange by head, ``[num_tokens, num_heads / cp, v_head_dim]``, instead of
        every head gathered back.

        Returns:
            ``[num_tokens, num_heads, v_head_dim]``.
        """
        raise NotImplementedError
