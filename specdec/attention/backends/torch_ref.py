"""Torch reference backend: every unsharded shape, every phase, on any device.

It gathers each request's context from the pages into a padded batch and calls
``scaled_dot_product_attention`` with an explicit causal mask over absolute
positions, so context, single-token decode, multi-token verify and mixed
batches are one code path. Slow but obviously right; other backends are
tested against it. Under Helix (``helix_cp > 1``) a rank's pages hold only its share
of the context, so attention over them alone is not the answer: those shapes go
to ``helix_ref`` (or ``triton_mla``), which merge the ranks' partials.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.attention.backends.base import AttentionBackend, PhaseBatch
from specdec.attention.shapes import YES, AttnShape, Verdict, no
from specdec.parallel.helix import attention_lse


@dataclass(frozen=True, slots=True)
class RefPlan:
    gather: torch.Tensor  # [num_seqs, max_kv] slot ids (padding reads slot 0, masked out)
    mask: torch.Tensor | None  # [num_seqs, 1, max_q, max_kv] True = attend; None when not needed
    q_index: torch.Tensor  # [num_seqs, max_q] rows of the packed queries (padding -> row num_tokens)
    out_index: torch.Tensor  # [num_tokens] rows of the flattened padded output
    num_tokens: int


class TorchRefBackend(AttentionBackend):
    """Reference attention in plain PyTorch."""

    name = "torch_ref"

    def supports(self, shape: AttnShape) -> Verdict:
        if shape.helix_cp != 1:
            return no(f"reads only the pages it is given, with no merge across ranks: helix_cp must be 1, "
                      f"got {shape.helix_cp} (Helix: helix_ref)")
        return YES

    def cost(self, shape: AttnShape) -> float:
        # Always correct, never fast: the last resort of automatic selection.
        return 100.0

    def plan(self, batch: PhaseBatch) -> RefPlan:
        dev, tpb = batch.device, batch.tokens_per_block
        num_seqs, max_q, max_kv = len(batch.q_lens), max(batch.q_lens), max(batch.kv_lens)
        gather = torch.zeros(num_seqs, max_kv, dtype=torch.long)
        q_index = torch.full((num_seqs, max_q), batch.num_tokens, dtype=torch.long)
        q_pos = torch.zeros(num_seqs, max_q, dtype=torch.long)
        out_index = torch.empty(batch.num_tokens, dtype=torch.long)
        offsets = torch.arange(tpb)
        start = 0
        for i, (q_len, kv_len, table) in enumerate(zip(batch.q_lens, batch.kv_lens, batch.page_tables)):
            pages = torch.tensor(table[: -(-kv_len // tpb)], dtype=torch.long)
            gather[i, :kv_len] = (pages[:, None] * tpb + offsets).flatten()[:kv_len]
            q_index[i, :q_len] = torch.arange(start, start + q_len)
            q_pos[i, :q_len] = torch.arange(kv_len - q_len, kv_len)
            out_index[start : start + q_len] = torch.arange(i * max_q, i * max_q + q_len)
            start += q_len
        needs_mask = max_q > 1 or min(batch.kv_lens) != max_kv
        mask = (torch.arange(max_kv)[None, None, :] <= q_pos[:, :, None]).unsqueeze(1) if needs_mask else None
        return RefPlan(
            gather=gather.to(dev),
            mask=None if mask is None else mask.to(dev),
            q_index=q_index.to(dev),
            out_index=out_index.to(dev),
            num_tokens=batch.num_tokens,
        )

    def run(
        self, plan: RefPlan, q, k_cache, v_cache, scale: float, v_head_dim: int, *, kv_scale: float = 1.0,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`AttentionBackend.run`.

        Args:
            return_lse: also return each row's natural-log log-sum-exp of its scaled scores,
                ``[num_tokens, H]`` fp32, as ``TritonMLABackend.attend(..., return_lse=True)`` does
                (:func:`~specdec.parallel.helix.attention_lse`; the quantity Helix's combine
                merges partials by, :func:`~specdec.parallel.helix.combine_partials`); the output
                then comes from explicit scores in fp32 rather than ``scaled_dot_product_attention``.
        """
        num_heads = q.shape[1]
        q_pad = torch.cat([q, q.new_zeros(1, *q.shape[1:])])[plan.q_index]  # [B, max_q, H, D]
        k = _gather(k_cache, plan.gather)  # [B, max_kv, Hkv, D]
        v = (_gather(v_cache, plan.gather) if v_cache is not None else k[..., :v_head_dim])  # [B, max_kv, Hkv, Dv]
        k, v = k.to(q.dtype), v.to(q.dtype)
        if kv_scale != 1.0:  # dequantise an FP8 cache (per-tensor scale)
            k, v = k * kv_scale, v * kv_scale
        if return_lse:
            out, lse = attention_lse(q_pad, k, v, None if plan.mask is None else plan.mask[:, 0], scale)
            B, max_q = q_pad.shape[:2]
            return (out.reshape(B * max_q, num_heads, -1)[plan.out_index].to(q.dtype),
                    lse.reshape(B * max_q, num_heads)[plan.out_index])
        if k.shape[2] == 1 and num_heads > 1:
            # One KV head (MLA's latent): fold the heads into the query rows instead of letting
            # enable_gqa copy K and V once per head. The same attention, row by row.
            B, max_q = q_pad.shape[:2]
            mask = None if plan.mask is None else plan.mask.expand(B, 1, max_q, -1).repeat_interleave(num_heads, 2)
            out = F.scaled_dot_product_attention(
                q_pad.reshape(B, 1, max_q * num_heads, -1), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=mask, scale=scale,
            )  # [B, 1, max_q * H, Dv], rows in (query, head) order
            return out.reshape(-1, num_heads, v_head_dim)[plan.out_index]
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=plan.mask,
            scale=scale,
            enable_gqa=k.shape[2] != num_heads,
        )  # [B, H, max_q, Dv]
        out = out.transpose(1, 2).reshape(-1, num_heads, v_head_dim)  # [B * max_q, H, Dv]
        return out[plan.out_index]


def _gather(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``cache[index]``; 1-byte float8 caches are gathered as bytes (no CPU float8 index kernel)."""
    if cache.element_size() == 1 and cache.is_floating_point():
        return cache.view(torch.uint8)[index].view(cache.dtype)
    return cache[index]
