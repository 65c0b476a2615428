"""Host-side helpers of the paged MLA decode kernels: row packing, KV splits, the LSE merge.

A generation phase of an absorbed-MLA layer has, per request, ``q_len`` query tokens of
``H`` heads. The kernels pack them token-major into ``q_len * H`` query rows (row ``r`` is
token ``r // H``, head ``r % H``: a contiguous slab of ``q.view(-1, D)``), process them in
blocks of ``block_m`` rows, and cut the request's keys into ``num_splits`` chunks of whole
tiles. Each (row block, split) computes a partial output normalised over its keys and the
log-sum-exp of its scores; :func:`merge_partials` combines the splits exactly.

:func:`emulate_blocks` runs that decomposition in plain PyTorch (same blocks, splits, tiles,
causal bounds, and the zeroing of a page's tail past the context; FP8 caches and Helix page
tables as the kernel reads them), so the index arithmetic the CuTe kernel (``cute_mla``)
implements is testable on a CPU against ``torch_ref`` and ``helix_ref``.

Under Helix a rank's page tables hold only the pages it owns (page ``p`` of a request belongs
to rank ``p % cp``): key ``k`` is the ``k``-th position the rank owns, and every bound on
positions (the request's length, a row's causal bound) becomes a count of owned positions
(:func:`owned_keys`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclass(frozen=True, slots=True)
class MLAPlan:
    """Device metadata of one generation phase of a paged MLA kernel (``triton_mla``, ``cute_mla``), built once per step.

    Attributes:
        page_table: physical pages, zero-padded. ``[num_seqs, max_pages]`` int32
        kv_lens: ``[num_seqs]`` int32
        q_start: first query row of each request in the phase. ``[num_seqs]`` int32
        q_lens: ``[num_seqs]`` int32
        num_seqs, num_tokens, max_q_len: host copies for the launch.
        max_kv_len: most keys one request reads here (under Helix: positions this rank owns).
        tokens_per_block: page size.
        num_sms: SMs of the device (a backend's own value off CUDA).
        shard: under Helix, this rank's :class:`~specdec.parallel.helix.HelixShard` (page tables
            hold its pages only, ``kv_lens`` stay global); ``None``: unsharded.
    """

    page_table: torch.Tensor
    kv_lens: torch.Tensor
    q_start: torch.Tensor
    q_lens: torch.Tensor
    num_seqs: int
    num_tokens: int
    max_q_len: int
    max_kv_len: int
    tokens_per_block: int
    num_sms: int
    shard: Any = None


def sm_count(device: torch.device, off_cuda: int) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (read once per device), or ``off_cuda`` elsewhere."""
    if device.type != "cuda":
        return off_cuda
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def padded_page_tables(name: str, q_lens, kv_lens, keys, page_tables, tokens_per_block: int,
                       device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A phase's page tables as one padded int32 tensor, with its query lengths and starts.

    Args:
        name: the backend, named in errors.
        q_lens, kv_lens: query tokens and (global) cached tokens per request.
        keys: the keys each request's pages hold here (``kv_lens``, or under Helix this rank's share).
        page_tables: each request's pages, at least ``ceil(keys / tokens_per_block)`` of them.
        tokens_per_block: page size.
        device: where the tensors go.

    Returns:
        ``(page_table [num_seqs, max_pages], q_lens [num_seqs], q_start [num_seqs])``, int32 on ``device``
        (rows padded with page 0, which no key past ``keys`` reads).

    Raises:
        ValueError: a request with ``q_len`` outside ``[1, kv_len]`` or too few pages.
    """
    pages = [-(-n // tokens_per_block) for n in keys]
    max_pages = max(1, *pages)
    rows = []
    for i, (q_len, kv_len, n, pt) in enumerate(zip(q_lens, kv_lens, pages, page_tables)):
        if not 1 <= q_len <= kv_len or len(pt) < n:
            raise ValueError(f"{name}: request {i} has q_len={q_len}, kv_len={kv_len}, {len(pt)} pages")
        rows.append(list(pt[:n]) + [0] * (max_pages - n))
    lens = torch.tensor(q_lens, dtype=torch.int32)
    start = torch.cumsum(lens, 0, dtype=torch.int32) - lens
    return torch.tensor(rows, dtype=torch.int32).to(device), lens.to(device), start.to(device)


def row_blocks(q_len: int, num_heads: int, block_m: int = 64) -> int:
    """Row blocks of one request: ``ceil(q_len * H / block_m)`` (no padding beyond the last block)."""
    return -(-(q_len * num_heads) // block_m)


def split_chunk(kv_len: int, num_splits: int, block_n: int) -> int:
    """Keys per split: ``ceil(kv_len / num_splits)`` rounded up to whole tiles of ``block_n``."""
    return -(-(-(-kv_len // num_splits)) // block_n) * block_n


def owned_keys(n: int, cp: int, rank: int, tokens_per_block: int) -> int:
    """Keys of positions ``[0, n)`` in rank ``rank``'s page table (page ``p`` -> rank ``p % cp``);
    ``n`` for ``cp == 1``: :meth:`HelixLayout.local_length <specdec.parallel.helix.HelixLayout.local_length>`,
    the arithmetic the kernel does on the device."""
    from specdec.parallel.helix import HelixLayout

    return n if cp == 1 else HelixLayout(cp, tokens_per_block).local_length(n, rank)


@dataclass(frozen=True, slots=True)
class BlockKeys:
    """The keys one (row block, split) of a request reads: ``[lo, hi)``, in ``n_tiles`` tiles."""

    lo: int
    hi: int
    n_tiles: int


def block_keys(q_len: int, kv_len: int, num_heads: int, mblk: int, split: int, num_splits: int, block_n: int,
               block_m: int = 64, *, cp: int = 1, rank: int = 0, tokens_per_block: int = 1) -> BlockKeys:
    """The key range of row block ``mblk``, split ``split`` (the kernel's arithmetic, host copy).

    The block's last row is token ``min((mblk * block_m + block_m - 1) // H, q_len - 1)``; no row
    of the block sees a position past ``kv_len - q_len + that token``, so the range stops there.
    Under Helix (``cp > 1``) keys are rank ``rank``'s: the splits cut its ``owned_keys(kv_len)``
    keys and the stop is the count of its positions up to that bound.
    """
    last_tok = min((mblk * block_m + block_m - 1) // num_heads, q_len - 1)
    n_keys = owned_keys(kv_len, cp, rank, tokens_per_block)
    stop = owned_keys(kv_len - q_len + last_tok + 1, cp, rank, tokens_per_block)
    chunk = split_chunk(n_keys, num_splits, block_n)
    lo = split * chunk
    hi = min(lo + chunk, n_keys, stop)
    return BlockKeys(lo, hi, max(-(-(hi - lo) // block_n), 0))


def choose_splits(num_ctas: int, max_kv_len: int, slots: int, *, block_n: int, min_split_tokens: int = 256,
                  max_splits: int = 64, overhead_tokens: int = 128) -> int:
    """Split count minimising the modelled makespan (whole waves of ``slots`` resident CTAs).

    ``num_ctas`` CTAs per split (row blocks x requests); a split of ``c`` keys costs
    ``c + overhead_tokens``. Ties go to fewer splits (less merge traffic).
    """
    cap = max(1, min(max_splits, max_kv_len // min_split_tokens))
    best, best_cost = 1, None
    for s in range(1, cap + 1):
        cost = -(-(num_ctas * s) // slots) * (split_chunk(max_kv_len, s, block_n) + overhead_tokens)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def merge_partials(o_part: torch.Tensor, lse2_part: torch.Tensor, out_dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine per-split partials exactly.

    Args:
        o_part: ``[rows, splits, Dv]`` fp32, each split normalised over its own keys.
        lse2_part: ``[rows, splits]`` fp32 log-sum-exp in log2 units (``-inf``: the split saw no key).
        out_dtype: dtype of the merged output.

    Returns:
        ``(out [rows, Dv] out_dtype, lse [rows] fp32 natural log)``; a row no split saw has
        ``out = 0`` and ``lse = -inf``.
    """
    m = lse2_part.max(dim=1, keepdim=True).values  # [rows, 1]
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp2(lse2_part - m_safe)  # [rows, splits]; -inf -> 0
    total = w.sum(dim=1, keepdim=True)
    empty = total == 0
    out = (w.unsqueeze(-1) * torch.nan_to_num(o_part)).sum(dim=1) / torch.where(empty, torch.ones_like(total), total)
    lse = torch.where(empty, torch.full_like(total, -math.inf), (m_safe + torch.log2(total)) * LN2)
    return out.to(out_dtype), lse.squeeze(1)


def emulate_blocks(q: torch.Tensor, cache: torch.Tensor, page_tables, q_lens, kv_lens, *, tokens_per_block: int,
                   scale: float, v_head_dim: int, num_splits: int, block_n: int, block_m: int = 64,
                   kv_scale: float = 1.0, p_dtype: torch.dtype | None = None, cp: int = 1,
                   rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's decomposition in PyTorch, fp32: per-split partials ``(o_part, lse2_part)``.

    Args:
        q: ``[T, H, D]`` (its values are used as given: round them first to model bf16 queries).
        cache: ``[slots, 1, D]``, float or FP8 E4M3 holding ``value / kv_scale``: read as it is
            stored (e4m3 -> fp32 is exact, as the kernel's e4m3 -> bf16), with ``kv_scale`` folded
            into the score scale and into the output, as the kernel does.
        page_tables, q_lens, kv_lens: the phase (under Helix: rank ``rank``'s page tables, global lengths).
        tokens_per_block, scale, v_head_dim, num_splits, block_n, block_m: the launch.
        kv_scale: the cache's per-tensor dequantisation scale.
        p_dtype: the probabilities' dtype in ``P V`` (the kernel's bf16); ``None``: fp32.
        cp, rank: Helix ranks and this one (``cp = 1``: unsharded).

    Returns:
        ``o_part [T * H, splits, Dv]`` and ``lse2_part [T * H, splits]`` as :func:`merge_partials`
        takes them. Rows never written keep ``o = 0, lse = -inf`` (the kernel leaves them
        unwritten: only real rows are read back).
    """
    if tokens_per_block % block_n:
        raise ValueError(f"block_n ({block_n}) must divide tokens_per_block ({tokens_per_block})")
    num_tokens, num_heads, d = q.shape
    rows_q = q.reshape(num_tokens * num_heads, d).float()
    o_part = torch.zeros(num_tokens * num_heads, num_splits, v_head_dim)
    lse2 = torch.full((num_tokens * num_heads, num_splits), -math.inf)
    q_start = 0
    for q_len, kv_len, table in zip(q_lens, kv_lens, page_tables):
        rows = q_len * num_heads
        n_keys = owned_keys(kv_len, cp, rank, tokens_per_block)
        for mblk in range(row_blocks(q_len, num_heads, block_m)):
            r_lo, r_hi = mblk * block_m, min(mblk * block_m + block_m, rows)  # real rows of the block
            local = torch.arange(r_lo, r_hi)
            row_end = torch.tensor([owned_keys(kv_len - q_len + tok + 1, cp, rank, tokens_per_block)
                                    for tok in (local // num_heads).tolist()])  # causal bound per row, in keys
            qb = rows_q[q_start * num_heads + r_lo: q_start * num_heads + r_hi]
            for split in range(num_splits):
                keys = block_keys(q_len, kv_len, num_heads, mblk, split, num_splits, block_n, block_m, cp=cp,
                                  rank=rank, tokens_per_block=tokens_per_block)
                m_i = torch.full((r_hi - r_lo,), -math.inf)
                l_i = torch.zeros(r_hi - r_lo)
                acc = torch.zeros(r_hi - r_lo, v_head_dim)
                for t in range(keys.n_tiles):
                    key0 = keys.lo + t * block_n
                    page = table[key0 // tokens_per_block]
                    slot0 = page * tokens_per_block + key0 % tokens_per_block
                    tile = cache[slot0: slot0 + block_n, 0].to(torch.float32, copy=True)  # one page: contiguous slots
                    valid = n_keys - key0
                    if valid < block_n:  # the page's tail past the keys: zeroed before use
                        tile[valid:] = 0.0
                    s = (qb @ tile.T) * (scale * kv_scale * LOG2E)
                    key = key0 + torch.arange(block_n)
                    s = torch.where(key[None, :] < row_end[:, None], s, torch.full_like(s, -math.inf))
                    m_new = torch.maximum(m_i, s.max(dim=1).values)
                    m_safe = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
                    alpha = torch.exp2(m_i - m_safe)
                    p = torch.exp2(s - m_safe[:, None])
                    l_i = l_i * alpha + p.sum(dim=1)
                    p_v = p if p_dtype is None else p.to(p_dtype).float()
                    acc = acc * alpha[:, None] + p_v @ tile[:, :v_head_dim]
                    m_i = m_new
                empty = l_i == 0
                out_rows = q_start * num_heads + local
                o_part[out_rows, split] = torch.where(empty[:, None], torch.zeros_like(acc),
                                                      acc * (kv_scale / torch.where(empty, 1.0, l_i))[:, None])
                lse2[out_rows, split] = torch.where(empty, torch.full_like(l_i, -math.inf),
                                                    m_i + torch.log2(torch.where(empty, 1.0, l_i)))
        q_start += q_len
    return o_part, lse2
