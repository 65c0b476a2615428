"""Helix context parallelism for absorbed-MLA decode and verify (docs/design.md §7).

A request's latent KV is sharded across ``cp`` ranks. Every rank holds the
queries of all heads, attends them over the positions it owns and produces a
partial output in the latent space with its log-sum-exp (LSE) per (row, head).
One ``all_to_all`` over the head axis hands rank ``j`` the partials of head
slice ``j`` from every rank, and an exact LSE rescale combines them. What
crosses the wire is ``[num_tokens, num_heads, kv_lora_rank + 1]`` per rank
whatever the context length (Hooper et al., "Helix Parallelism", 2025).

Ownership is by page, round-robin: logical page ``p`` of a request belongs to
rank ``p mod cp`` (:class:`HelixLayout`). This is the Helix paper's round-robin
append in fixed chunks with the chunk equal to the page size, chosen because

- ownership is a pure function of the position: no history to keep, and
  rollback (truncate to ``L``) is a per-rank truncation to the rank's share of
  ``L`` that releases exactly the rank-local pages past it;
- a rank-local page is filled by one rank only, so each rank keeps an ordinary
  :class:`~specdec.kvcache.KVCacheManager` over its own pool and the paged
  kernels read rank-local page tables unchanged;
- load stays balanced to within one page per rank.

A verify step's ``1 + k`` rows may straddle a page boundary, so their K/V land
on two ranks; every rank still attends every row (causality is by absolute
position), so nothing else changes.

The pure attention (:func:`mla_attention_lse`) is dense over gathered rows with
their absolute positions; :func:`plan_shard` / :func:`shard_attention` gather a
rank's rows from its paged cache. Both are references in plain PyTorch: slow,
obviously right, the yardstick for kernels.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specdec.errors import ConfigError, InvalidRequestError
from specdec.kvcache.manager import KVCacheManager, pages_for

# Padding rows of a gathered shard sit at this position: past every query, so causality masks them.
_PAD_POS = torch.iinfo(torch.long).max


# -- ownership ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class HelixLayout:
    """Page-round-robin ownership of positions across ``cp`` ranks.

    Position ``pos`` is on logical page ``pos // tokens_per_block``; page ``p`` is
    owned by rank ``p % cp`` and is that rank's local page ``p // cp``. A rank's
    *local position* counts only the positions it owns, in order.

    Attributes:
        cp: context-parallel ranks.
        tokens_per_block: page size in tokens (the round-robin chunk).
    """

    cp: int
    tokens_per_block: int

    def __post_init__(self) -> None:
        if self.cp < 1:
            raise ConfigError(f"HelixLayout.cp must be >= 1, got {self.cp}")
        if self.tokens_per_block < 1:
            raise ConfigError(f"HelixLayout.tokens_per_block must be >= 1, got {self.tokens_per_block}")

    def owner(self, pos: int) -> tuple[int, int]:
        """``(rank, local position)`` of global position ``pos``."""
        if pos < 0:
            raise InvalidRequestError(f"position must be >= 0, got {pos}")
        page, offset = divmod(pos, self.tokens_per_block)
        return page % self.cp, (page // self.cp) * self.tokens_per_block + offset

    def global_position(self, rank: int, local_pos: int) -> int:
        """Inverse of :meth:`owner`: the global position of ``rank``'s ``local_pos``."""
        self._check_rank(rank)
        local_page, offset = divmod(local_pos, self.tokens_per_block)
        return (local_page * self.cp + rank) * self.tokens_per_block + offset

    def local_length(self, length: int, rank: int) -> int:
        """How many of positions ``[0, length)`` ``rank`` owns."""
        self._check_rank(rank)
        full, rem = divmod(length, self.tokens_per_block)
        owned_full = max(0, -(-(full - rank) // self.cp))  # pages p < full with p % cp == rank
        return owned_full * self.tokens_per_block + (rem if full % self.cp == rank else 0)

    def owned_runs(self, start: int, stop: int, rank: int) -> list[tuple[int, int]]:
        """The positions of ``[start, stop)`` that ``rank`` owns, as contiguous ``(begin, end)`` runs."""
        self._check_rank(rank)
        tpb, runs = self.tokens_per_block, []
        page = start // tpb
        while page * tpb < stop:
            if page % self.cp == rank:
                runs.append((max(start, page * tpb), min(stop, (page + 1) * tpb)))
            page += 1
        return runs

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.cp:
            raise InvalidRequestError(f"rank must be in [0, {self.cp}), got {rank}")


@dataclass(frozen=True, slots=True)
class HelixShard:
    """This rank's part in Helix: the ownership rule, its rank and the context-parallel group.

    Attention metadata, KV views and drafters carry it so that whatever reads a request's
    pages knows they hold only this rank's share and whom to merge partials with.

    With attention tensor parallelism (``tp > 1``) the ``tp * cp`` processes form a grid: process
    ``tp_rank * cp + rank`` computes the queries and attention of heads ``[tp_rank * H / tp,
    (tp_rank + 1) * H / tp)`` over context shard ``rank``. The ``cp`` processes of one ``tp_rank``
    form its context-parallel ``group`` (they exchange partials by head); the ``tp`` processes of
    one ``rank`` hold the same shard (MLA's latent cache serves every head).

    Attributes:
        layout: the ownership rule shared by all ranks.
        rank: this process's context shard, in ``[0, layout.cp)``.
        group: the ``torch.distributed`` group of the ``cp`` processes sharing this ``tp_rank``
            (``None``: the default group, when ``tp == 1``).
        tp: attention tensor-parallel degree (1: every process computes every head).
        tp_rank: this process's head group, in ``[0, tp)``.
        world_group: the group of all ``tp * cp`` processes, over which the head-parallel output
            projection is summed and the pool size agreed (``None``: the default group).
    """

    layout: HelixLayout
    rank: int
    group: object = None
    tp: int = 1
    tp_rank: int = 0
    world_group: object = None

    def __post_init__(self) -> None:
        self.layout._check_rank(self.rank)
        if type(self.tp) is not int or type(self.tp_rank) is not int or self.tp < 1 or not 0 <= self.tp_rank < self.tp:
            raise ConfigError(f"tp must be an integer >= 1 and tp_rank in [0, tp), got tp={self.tp!r}, "
                              f"tp_rank={self.tp_rank!r}")

    @property
    def cp(self) -> int:
        return self.layout.cp

    def tp_heads(self, num_heads: int) -> slice:
        """The heads this process computes queries and attention for: all of them with ``tp == 1``."""
        per = num_heads // self.tp
        return slice(self.tp_rank * per, (self.tp_rank + 1) * per)

    def exchanged_heads(self, num_heads: int) -> slice:
        """The heads the exchange by head leaves this process, over the whole context: ``num_heads /
        (tp * cp)`` of them, inside :meth:`tp_heads`."""
        per = num_heads // (self.tp * self.layout.cp)
        first = (self.tp_rank * self.layout.cp + self.rank) * per
        return slice(first, first + per)


class HelixKVManager:
    """One rank's page tables under Helix: global lengths in, rank-local pages out.

    Wraps a :class:`~specdec.kvcache.KVCacheManager` over this rank's pool; every
    lifecycle call takes the request's *global* length and keeps exactly the
    pages holding the rank's share of it. Rollback (:meth:`truncate`) therefore
    releases exactly the rank-local pages past ``L``.

    Every rank must see the same sequence of calls. A ``PoolExhaustedError`` on one
    rank leaves that rank unchanged; the caller agrees across ranks before growing
    (``can_grow`` on each rank, then an all-reduce) so ranks never diverge.

    Args:
        layout: the ownership rule shared by all ranks.
        rank: this rank, in ``[0, layout.cp)``.
        num_pages: pages in this rank's pool.
    """

    def __init__(self, layout: HelixLayout, rank: int, num_pages: int):
        layout._check_rank(rank)
        self.layout, self.rank = layout, rank
        self.local = KVCacheManager(num_pages, layout.tokens_per_block)
        self._lengths: dict[Hashable, int] = {}

    def __contains__(self, req_id: Hashable) -> bool:
        return req_id in self._lengths

    @property
    def num_free_pages(self) -> int:
        return self.local.num_free_pages

    def length(self, req_id: Hashable) -> int:
        """Global tokens of ``req_id`` (all ranks together)."""
        return self._lengths[self._known(req_id)]

    def local_length(self, req_id: Hashable) -> int:
        """Tokens of ``req_id`` this rank holds."""
        return self.local.length(self._known(req_id))

    def page_table(self, req_id: Hashable) -> list[int]:
        """This rank's physical pages of ``req_id``, local page order (a copy)."""
        return self.local.page_table(self._known(req_id))

    def allocation(self, req_id: Hashable) -> int:
        """:meth:`KVCacheManager.allocation` of this rank's pages of ``req_id``."""
        return self.local.allocation(self._known(req_id))

    def can_grow(self, req_id: Hashable | None, num_tokens: int) -> bool:
        """Whether this rank has room for ``num_tokens`` more global tokens of ``req_id``."""
        have = self._lengths.get(req_id, 0)
        need = self.layout.local_length(have + num_tokens, self.rank) - self.layout.local_length(have, self.rank)
        return self.local.can_grow(req_id if req_id in self._lengths else None, need)

    def slot(self, req_id: Hashable, pos: int) -> int:
        """Local cache slot of global position ``pos``.

        Raises:
            InvalidRequestError: another rank owns ``pos``.
            IndexError: ``pos`` is past the request's length.
        """
        rank, local_pos = self.layout.owner(pos)
        if rank != self.rank:
            raise InvalidRequestError(f"position {pos} of request {req_id!r} is owned by rank {rank}, not {self.rank}")
        if pos >= self.length(req_id):
            raise IndexError(f"position {pos} outside request {req_id!r} of length {self.length(req_id)}")
        return self.local.slots(req_id, local_pos, local_pos + 1)[0]

    def owned_slots(self, req_id: Hashable, start: int, stop: int) -> tuple[list[int], list[int]]:
        """The positions of ``[start, stop)`` this rank owns and their local slots (for K/V writes).

        Returns:
            ``(indices, slots)``: ``indices`` into ``range(start, stop)`` (rows of the step's
            K/V to write here) and the local slot of each.
        """
        if not 0 <= start <= stop <= self.length(req_id):
            raise IndexError(f"positions [{start}, {stop}) outside request {req_id!r} of length {self.length(req_id)}")
        owned = [p for p in range(start, stop) if self.layout.owner(p)[0] == self.rank]
        return [p - start for p in owned], [self.slot(req_id, p) for p in owned]

    def allocate(self, req_id: Hashable, num_tokens: int) -> None:
        """Start ``req_id`` at global length ``num_tokens`` (this rank takes its share of pages)."""
        self.local.allocate(req_id, self.layout.local_length(num_tokens, self.rank))
        self._lengths[req_id] = num_tokens

    def append(self, req_id: Hashable, num_tokens: int) -> None:
        """Grow ``req_id`` by ``num_tokens`` global tokens; unchanged if this rank's pool is exhausted."""
        if num_tokens < 0:
            raise InvalidRequestError(f"num_tokens must be >= 0, got {num_tokens}")
        new_len = self.length(req_id) + num_tokens
        self.local.append(req_id, self.layout.local_length(new_len, self.rank) - self.local.length(req_id))
        self._lengths[req_id] = new_len

    def truncate(self, req_id: Hashable, new_length: int) -> None:
        """Roll ``req_id`` back to global length ``new_length``; local pages past its share are freed."""
        if not 0 <= new_length <= self.length(req_id):
            raise InvalidRequestError(
                f"new_length must be in [0, {self.length(req_id)}] for request {req_id!r}, got {new_length}"
            )
        self.local.truncate(req_id, self.layout.local_length(new_length, self.rank))
        self._lengths[req_id] = new_length

    def free(self, req_id: Hashable) -> None:
        """Release every local page of ``req_id`` and forget it."""
        self.local.free(self._known(req_id))
        del self._lengths[req_id]

    def _known(self, req_id: Hashable) -> Hashable:
        if req_id not in self._lengths:
            raise InvalidRequestError(f"request {req_id!r} holds no pages")
        return req_id


# -- attention over one shard ---------------------------------------------------------------------
def mla_attention_lse(
    q: torch.Tensor, kv: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor, scale: float, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed-MLA attention over some latent rows, with its log-sum-exp.

    Row ``i`` of the queries attends to the latent rows at positions
    ``kv_pos <= q_pos[i]`` (causal by absolute position, so rows held elsewhere
    simply do not appear). K is the whole latent row, V its first
    ``v_head_dim`` values.

    Args:
        q: queries, ``[B, Q, H, D]`` (``D = kv_lora_rank + rope``).
        kv: latent rows, ``[B, S, D]``.
        q_pos: absolute position of each query, ``[B, Q]``.
        kv_pos: absolute position of each latent row, ``[B, S]`` (padding: a
            position past every query).
        scale: softmax scale.
        v_head_dim: output width (``kv_lora_rank``).

    Returns:
        ``(out, lse)``: ``out`` ``[B, Q, H, v_head_dim]`` fp32, normalised over the visible
        rows (fp32 so partials combine without a rounding step), ``lse`` ``[B, Q, H]`` fp32
        log-sum-exp of the scaled scores. A row that
        sees nothing has ``out = 0`` and ``lse = -inf``.
    """
    return latent_attention_lse(q, kv, kv_pos[:, None, :] <= q_pos[:, :, None], scale, v_head_dim)


def latent_attention_lse(
    q: torch.Tensor, kv: torch.Tensor, visible: torch.Tensor, scale: float, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`mla_attention_lse` with an explicit mask instead of positions.

    Args:
        q: ``[B, Q, H, D]``.
        kv: ``[B, S, D]`` (K is the whole row, V its first ``v_head_dim`` values).
        visible: ``[B, Q, S]`` or broadcastable (e.g. ``[B, 1, S]``), True = attend.
        scale: softmax scale.
        v_head_dim: output width.

    Returns:
        ``(out, lse)``, ``[B, Q, H, v_head_dim]`` and ``[B, Q, H]`` fp32; ``0`` and ``-inf``
        for a query that sees nothing.
    """
    return attention_lse(q, kv[:, :, None], kv[:, :, None, :v_head_dim], visible, scale)


def attention_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention with its log-sum-exp from explicit fp32 scores, for any number of KV heads (the
    reference the kernels' and ``torch_ref``'s LSE outputs rest on).

    Args:
        q: ``[B, Q, H, D]``.
        k: ``[B, S, Hkv, D]``; query head ``h`` reads KV head ``h // (H / Hkv)``.
        v: ``[B, S, Hkv, Dv]``.
        visible: ``[B, Q, S]`` or broadcastable, True = attend; ``None``: every key.
        scale: softmax scale.

    Returns:
        ``(out, lse)``, ``[B, Q, H, Dv]`` and ``[B, Q, H]`` fp32; ``0`` and ``-inf`` for a query
        that sees nothing.
    """
    B, Q, H, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    qg = q.float().reshape(B, Q, Hkv, H // Hkv, D)  # heads grouped by the KV head they read
    scores = torch.einsum("bqkgd,bskd->bkgqs", qg, k.float()).reshape(B, H, Q, S) * scale
    if visible is not None:
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, Q]
    # exp(-inf - 0) = 0 for rows that see nothing, instead of exp(-inf + inf) = nan.
    p = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])  # [B, H, Q, S]
    out = torch.einsum("bkgqs,bskr->bqkgr", p.view(B, Hkv, H // Hkv, Q, S), v.float())
    return out.reshape(B, Q, H, -1), lse.transpose(1, 2)  # [B, Q, H, Dv], [B, Q, H]


def combine_partials(out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact combine of attention over disjoint shards of the KV.

    ``out = sum_i exp(lse_i - m) * out_i / sum_i exp(lse_i - m)`` with ``m = max_i lse_i``;
    a shard with ``lse = -inf`` (it saw nothing) weighs 0; when every shard saw
    nothing the result is 0 with ``lse = -inf``.

    Args:
        out: partial outputs, ``[N, ..., Dv]`` (``N`` shards, each normalised over its rows).
        lse: their log-sum-exps, ``[N, ...]``.

    Returns:
        ``(out, lse)``: ``[..., Dv]`` and ``[...]``, as if attention ran over the union.
    """
    m = lse.max(dim=0).values  # [...]
    m_safe = m.masked_fill(torch.isinf(m), 0.0)
    w = torch.exp(lse - m_safe)  # [N, ...]; 0 for empty shards
    total = w.sum(dim=0)  # [...]
    combined = (w[..., None] * out.float()).sum(dim=0) / total.clamp_min(torch.finfo(total.dtype).tiny)[..., None]
    return combined.to(out.dtype), m_safe + torch.log(total)  # log(0) = -inf when all are empty


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """What one rank gathers from its paged cache for one phase (planned once per step).

    Attributes:
        gather: local slot ids of each request's owned rows, ``[num_seqs, max_rows]``
            (padding reads slot 0 and is masked by ``kv_pos``).
        kv_pos: absolute position of each gathered row, ``[num_seqs, max_rows]``.
        q_index: packed query row of each padded query, ``[num_seqs, max_q]`` (padding → ``num_tokens``).
        q_pos: absolute position of each padded query, ``[num_seqs, max_q]``.
        out_index: row of the flattened padded output for each packed query, ``[num_tokens]``.
        num_tokens: packed query rows.
    """

    gather: torch.Tensor
    kv_pos: torch.Tensor
    q_index: torch.Tensor
    q_pos: torch.Tensor
    out_index: torch.Tensor
    num_tokens: int


def plan_shard(
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    local_page_tables: Sequence[Sequence[int]],
    layout: HelixLayout,
    rank: int,
    device: torch.device | str = "cpu",
) -> ShardPlan:
    """Plan one rank's gather for a phase of packed requests (decode, verify or context).

    Request ``i`` has ``q_lens[i]`` query rows at positions ``kv_lens[i] - q_lens[i] ...
    kv_lens[i] - 1`` (their K/V already written on their owners).

    Args:
        q_lens: query rows per request, ``[num_seqs]``.
        kv_lens: global cached tokens per request after this step's writes, ``[num_seqs]``.
        local_page_tables: this rank's pages of each request (``HelixKVManager.page_table``).
        layout: the ownership rule.
        rank: this rank.
        device: where the plan's tensors go.
    """
    tpb = layout.tokens_per_block
    num_seqs, max_q = len(q_lens), max(q_lens)
    local_lens = [layout.local_length(n, rank) for n in kv_lens]
    max_rows = max(1, *local_lens)  # one padding row keeps shapes valid when this rank owns nothing
    gather = torch.zeros(num_seqs, max_rows, dtype=torch.long)
    kv_pos = torch.full((num_seqs, max_rows), _PAD_POS, dtype=torch.long)
    q_index = torch.full((num_seqs, max_q), sum(q_lens), dtype=torch.long)
    q_pos = torch.zeros(num_seqs, max_q, dtype=torch.long)
    out_index = torch.empty(sum(q_lens), dtype=torch.long)
    offsets = torch.arange(tpb)
    start = 0
    for i, (q_len, kv_len, n_local, table) in enumerate(zip(q_lens, kv_lens, local_lens, local_page_tables)):
        if n_local:
            pages = torch.tensor(list(table[: pages_for(n_local, tpb)]), dtype=torch.long)  # [local_pages]
            gather[i, :n_local] = (pages[:, None] * tpb + offsets).flatten()[:n_local]
            local_page = torch.arange(len(pages))[:, None]
            kv_pos[i, :n_local] = ((local_page * layout.cp + rank) * tpb + offsets).flatten()[:n_local]
        q_index[i, :q_len] = torch.arange(start, start + q_len)
        q_pos[i, :q_len] = torch.arange(kv_len - q_len, kv_len)
        out_index[start : start + q_len] = torch.arange(i * max_q, i * max_q + q_len)
        start += q_len
    return ShardPlan(gather.to(device), kv_pos.to(device), q_index.to(device), q_pos.to(device),
                     out_index.to(device), start)


def shard_attention(
    plan: ShardPlan, q: torch.Tensor, k_cache: torch.Tensor, scale: float, v_head_dim: int, kv_scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed-MLA attention of packed queries over this rank's shard of the paged latent cache.

    Args:
        plan: from :func:`plan_shard`.
        q: ``[num_tokens, H, D]``.
        k_cache: this rank's latent cache, ``[num_slots, 1, D]`` (an FP8 cache holds ``value / kv_scale``).
        scale: softmax scale.
        v_head_dim: output width (``kv_lora_rank``).
        kv_scale: dequantisation scale of an FP8 cache (1.0 otherwise).

    Returns:
        ``(out, lse)``: ``[num_tokens, H, v_head_dim]`` in latent space and ``[num_tokens, H]``, both fp32.
    """
    q_pad = torch.cat([q, q.new_zeros(1, *q.shape[1:])])[plan.q_index]  # [B, max_q, H, D]
    if k_cache.element_size() == 1 and k_cache.is_floating_point():  # no CPU float8 index kernel: gather bytes
        kv = k_cache.view(torch.uint8)[plan.gather].view(k_cache.dtype)[:, :, 0].to(q.dtype)  # [B, max_rows, D]
    else:
        kv = k_cache[plan.gather][:, :, 0].to(q.dtype)  # [B, max_rows, D]
    if kv_scale != 1.0:
        kv = kv * kv_scale
    out, lse = mla_attention_lse(q_pad, kv, plan.q_pos, plan.kv_pos, scale, v_head_dim)
    num_heads = q.shape[1]
    out = out.reshape(-1, num_heads, v_head_dim)[plan.out_index]  # [num_tokens, H, Dv]
    return out, lse.reshape(-1, num_heads)[plan.out_index]


# -- the distributed step -------------------------------------------------------------------------
def helix_attention(
    plan: ShardPlan,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    scale: float,
    v_head_dim: int,
    group: dist.ProcessGroup | None = None,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """One Helix attention step: attend the local shard, exchange by head, combine.

    Every rank of ``group`` calls this with the queries of all ``H`` heads and its
    own shard. Partial outputs and their LSEs travel together in one
    ``all_to_all_single`` of ``[cp, num_tokens, H / cp, v_head_dim + 1]`` values per
    rank (independent of context length); rank ``j`` then holds every shard's
    partials of heads ``[j * H / cp, (j + 1) * H / cp)`` and combines them exactly.

    Args:
        plan: this rank's :func:`plan_shard`.
        q: ``[num_tokens, H, D]``, the same on every rank; ``H`` divisible by the group size.
        k_cache: this rank's latent cache, ``[num_slots, 1, D]``.
        scale: softmax scale.
        v_head_dim: output width (``kv_lora_rank``).
        group: the context-parallel group (default: the world).
        kv_scale: dequantisation scale of an FP8 cache (1.0 otherwise).

    Returns:
        This rank's head slice of the attention over the whole context, ``[num_tokens, H / cp, v_head_dim]``
        in latent space.

    Raises:
        ConfigError: ``H`` is not divisible by the group size.
    """
    cp, H = dist.get_world_size(group), q.shape[1]
    if H % cp:
        raise ConfigError(f"Helix needs num_heads ({H}) divisible by cp ({cp})")
    out, lse = shard_attention(plan, q, k_cache, scale, v_head_dim, kv_scale)  # [T, H, Dv], [T, H]
    return exchange_heads(out, lse, group).to(q.dtype)  # [T, H/cp, Dv]


def exchange_heads(out: torch.Tensor, lse: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The exchange and combine of :func:`helix_attention`, from this rank's partials (any kernel's).

    Every rank of ``group`` calls it with its partials of all ``H`` heads; one
    ``all_to_all_single`` of ``[cp, T, H / cp, Dv + 1]`` fp32 values hands rank ``j`` every
    rank's partials of heads ``[j * H / cp, (j + 1) * H / cp)``, which :func:`combine_partials`
    combines exactly.

    Args:
        out: this rank's partial output, ``[T, H, Dv]`` (normalised over its keys).
        lse: its natural-log log-sum-exp, ``[T, H]`` (``-inf`` where it saw nothing).
        group: the context-parallel group (default: the world).

    Returns:
        This rank's head slice over the whole context, ``[T, H / cp, Dv]`` fp32.

    Raises:
        ConfigError: ``H`` is not divisible by the group size.
    """
    cp = dist.get_world_size(group)
    T, H, Dv = out.shape
    if H % cp:
        raise ConfigError(f"Helix needs num_heads ({H}) divisible by cp ({cp})")
    # The LSE rides as one more channel in fp32 so a single collective moves both.
    packed = torch.cat([out.float(), lse.float()[..., None]], dim=-1)  # [T, H, Dv + 1]
    send = packed.view(T, cp, H // cp, Dv + 1).transpose(0, 1).contiguous()  # [cp, T, H/cp, Dv + 1]
    recv = torch.empty_like(send)  # [cp (source rank), T, H/cp, Dv + 1]
    dist.all_to_all_single(recv, send, group=group)
    combined, _ = combine_partials(recv[..., :Dv], recv[..., Dv])
    return combined  # [T, H/cp, Dv]


def gather_heads(head_slice: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All heads on every rank from each rank's slice (checks and the example; a model's
    head-parallel output projection does not need it).

    Args:
        head_slice: ``[num_tokens, H / cp, Dv]`` from :func:`helix_attention`.

    Returns:
        ``[num_tokens, H, Dv]``, heads in rank order.
    """
    parts = [torch.empty_like(head_slice) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, head_slice.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def merge_over_ranks(out: torch.Tensor, lse: torch.Tensor, group: dist.ProcessGroup | None = None,
                     extra: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Every rank's partial attention combined on every rank (all heads), by one ``all_gather``.

    For small attention layers (a drafter's few heads, a handful of block rows) where splitting
    heads across ranks buys nothing: each rank sends its ``[..., Dv + 1]`` partials and combines
    all of them with :func:`combine_partials`. ``extra`` is one more partial every rank holds
    alike (e.g. attention over keys every rank has), merged in the same combine.

    Args:
        out: this rank's partial output, ``[..., Dv]`` fp32 (normalised over its keys).
        lse: its log-sum-exp, ``[...]`` (``-inf`` where it saw nothing).
        group: the context-parallel group (default: the world).
        extra: ``(out, lse)`` of the same shapes, or ``None``.

    Returns:
        ``[..., Dv]`` fp32, attention over the union of every rank's keys (and ``extra``'s).
    """
    packed = torch.cat([out.float(), lse.float()[..., None]], dim=-1).contiguous()  # [..., Dv + 1]
    parts = [torch.empty_like(packed) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, packed, group=group)
    if extra is not None:
        parts.append(torch.cat([extra[0].float(), extra[1].float()[..., None]], dim=-1))
    stacked = torch.stack(parts)  # [N, ..., Dv + 1]
    combined, _ = combine_partials(stacked[..., :-1], stacked[..., -1])
    return combined
