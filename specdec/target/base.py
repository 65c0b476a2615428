"""The :class:`Target` protocol: what the engine needs from the model it reproduces."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch

if TYPE_CHECKING:
    from specdec.attention.metadata import AttentionMetadata
    from specdec.attention.shapes import AttnShape
    from specdec.kvcache.pool import KVPool, LayerSpec


class Target(Protocol):
    """A causal LM running on specdec's paged KV cache and attention backends.

    Attributes:
        name: a human-readable name (model name or path).
        vocab_size: logits width.
        max_context: most tokens (prompt + generated) a request may hold.
        eos_token_ids: tokens that end generation.
        num_layers: decoder layers.
        hidden_size: width of hidden states.
        tokenizer: a ``transformers`` tokenizer, or ``None``.
        device, dtype: where and in what precision it computes.
    """

    name: str
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    num_layers: int
    hidden_size: int
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype

    def layer_specs(self, kv_dtype: torch.dtype | None = None, kv_scale: float = 1.0) -> tuple["LayerSpec", ...]:
        """KV layers the target keeps in the pool, one per decoder layer.

        Args:
            kv_dtype: storage dtype of the cache (``None``: the compute dtype;
                ``torch.float8_e4m3fn`` for an FP8 cache).
            kv_scale: per-tensor scale of an FP8 cache, carried by every spec;
                ``forward`` passes ``pool.specs[i].kv_scale`` to attention.
        """
        ...

    def attn_shape(self, phase: str, max_q_len: int, tokens_per_block: int, mixed: bool = False,
                   kv_dtype: torch.dtype | None = None) -> "AttnShape":
        """The attention shape of one phase of a step on this target, over a cache of ``kv_dtype``
        (``None``: the compute dtype)."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: "AttentionMetadata",
        pool: "KVPool",
        hidden_layer_ids: Sequence[int] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run the decoder over a packed step.

        Args:
            input_ids: ``[num_tokens]``.
            positions: ``[num_tokens]`` absolute positions.
            attn: this step's attention metadata.
            pool: the KV pool (target layers at indices ``0..num_layers-1``).
            hidden_layer_ids: layers whose outputs to return too.

        Returns:
            final hidden states ``[num_tokens, hidden_size]`` (before the final
            norm is applied by :meth:`compute_logits`), and ``{layer: [num_tokens, hidden_size]}``.
        """
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` → fp32 logits ``[n, vocab_size]``."""
        ...
