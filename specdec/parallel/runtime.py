"""The engine's Helix plumbing: checking a ``helix_cp`` setup and the rank's page manager.

An engine with ``EngineConfig(helix_cp=N)`` runs as one process per rank, launched by
``torchrun --nproc-per-node N`` (docs/design.md §7). Every rank runs the same engine
over the same requests: the same schedule, the same drafts, the same verification.
What differs is the KV: each rank's pool holds only the pages it owns, its page tables
are rank-local (:class:`HelixPageManager`), each step writes only the positions the rank
owns, and attention merges the ranks' partials (``helix_ref``, or ``triton_mla`` for the
decode and verify shapes it supports). Every rank ends each step
with the same tokens; rank 0's outputs are the answer.

This module keeps those pieces out of :mod:`specdec.engine`: :func:`helix_shard` checks
the setup and returns the rank's :class:`~specdec.parallel.helix.HelixShard` (or ``None``
for ``helix_cp == 1``), :func:`page_manager` gives the page manager for either case.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.distributed as dist

from specdec.errors import HelixConfigError, InvalidRequestError, PoolExhaustedError
from specdec.kvcache.manager import KVCacheManager, pages_for
from specdec.parallel.helix import HelixKVManager, HelixLayout, HelixShard


def init_process_group(device: torch.device | str = "cpu") -> tuple[int, int]:
    """Join the process group ``torchrun`` describes (gloo on CPU, NCCL on CUDA), if not yet joined.

    Args:
        device: where the target runs; on CUDA this rank's device is ``cuda:LOCAL_RANK``.

    Returns:
        ``(rank, world_size)``.
    """
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.device(device).type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def helix_shard(helix_cp: int, target, tokens_per_block: int, attention_tp: int = 1) -> HelixShard | None:
    """This process's Helix part for an engine with ``helix_cp`` context ranks, each of
    ``attention_tp`` processes (attention tensor parallelism), after checking the setup.

    Process ``r`` of the ``attention_tp * helix_cp`` takes context shard ``r % helix_cp`` and head
    group ``r // helix_cp`` (see :class:`~specdec.parallel.helix.HelixShard`). With
    ``attention_tp > 1`` every process creates the ``attention_tp`` context-parallel subgroups, in
    the same order (``torch.distributed.new_group`` is collective).

    Args:
        helix_cp: ``EngineConfig.helix_cp``.
        target: the engine's target (its attention shape says whether it is MLA and how many heads).
        tokens_per_block: the KV page size (the ownership chunk).
        attention_tp: ``EngineConfig.attention_tp``.

    Returns:
        ``None`` for ``helix_cp == 1``; otherwise this process's shard.

    Raises:
        HelixConfigError: the target is not MLA (Helix shards a K-only latent cache), its heads do
            not split evenly across ``attention_tp * helix_cp``, no process group is initialized,
            its size is not ``attention_tp * helix_cp``, or ``attention_tp > 1`` without Helix.
    """
    if helix_cp == 1:
        if attention_tp != 1:
            raise HelixConfigError(f"attention_tp={attention_tp} splits the heads of Helix's context ranks: it needs "
                                   "helix_cp > 1 (attention tensor parallelism alone is not offered)")
        return None
    n = helix_cp * attention_tp
    what = f"helix_cp={helix_cp}" + (f" with attention_tp={attention_tp}" if attention_tp > 1 else "")
    shape = target.attn_shape("generation", 1, tokens_per_block)
    if shape.kind != "mla":
        raise HelixConfigError(f"{what} needs an MLA target (Helix shards its K-only latent cache); "
                               f"target {getattr(target, 'name', type(target).__name__)!r} has {shape.kind!r} "
                               "attention: use helix_cp=1")
    if shape.num_heads % n:
        raise HelixConfigError(f"helix_cp * attention_tp ({n}) must divide the target's attention heads "
                               f"({shape.num_heads}): the all-to-all splits each head group across the context "
                               f"ranks; got {what}")
    if not dist.is_available() or not dist.is_initialized():
        raise HelixConfigError(f"{what} needs a torch.distributed process group of {n} ranks: "
                               f"launch with `torchrun --nproc-per-node {n} ...` and call "
                               "specdec.parallel.init_process_group() (gloo on CPU, nccl on GPU) first")
    world = dist.get_world_size()
    if world != n:
        raise HelixConfigError(f"helix_cp * attention_tp must equal the process group's size ({world}), got {what}")
    rank = dist.get_rank()
    group = None
    if attention_tp > 1:
        group = _head_group_subgroups(helix_cp, attention_tp)[rank // helix_cp]
    return HelixShard(HelixLayout(helix_cp, tokens_per_block), rank % helix_cp, group, attention_tp,
                      rank // helix_cp, None)


_SUBGROUPS: dict = {}  # (default group, cp, tp) -> the tp context-parallel subgroups


def _head_group_subgroups(cp: int, tp: int) -> list:
    """The ``tp`` subgroups of ``cp`` consecutive ranks (one per head group), made once per default
    process group: every process creates every one, in order (``new_group`` is collective), and
    engines built later reuse them instead of making (and holding communicators for) new ones."""
    key = (dist.group.WORLD, cp, tp)
    if key not in _SUBGROUPS:
        _SUBGROUPS[key] = [dist.new_group(list(range(t * cp, (t + 1) * cp))) for t in range(tp)]
    return _SUBGROUPS[key]


def local_num_pages(num_pages: int, shard: HelixShard | None) -> int:
    """Pages of this rank's pool: ``num_pages``, or under Helix the least any rank asked for, so
    every rank has the same pool (each rank may size its default from its own free memory)."""
    if shard is None:
        return num_pages
    n = torch.tensor([num_pages], dtype=torch.long)
    dist.all_reduce(n, op=dist.ReduceOp.MIN, group=shard.world_group)
    return int(n.item())


def page_manager(num_pages: int, tokens_per_block: int, shard: HelixShard | None):
    """The engine's page manager over its pool of ``num_pages`` pages: a plain
    :class:`~specdec.kvcache.KVCacheManager`, or under Helix a :class:`HelixPageManager`."""
    if shard is None:
        return KVCacheManager(num_pages, tokens_per_block)
    return HelixPageManager(shard, num_pages)


class HelixPageManager:
    """The engine's page manager on one Helix rank: global lengths in, rank-local pages out.

    It answers the scheduler as a :class:`~specdec.kvcache.KVCacheManager` does (``allocate``,
    ``append``, ``truncate``, ``free``, ``can_grow``, ``length``), in *global* tokens, while
    this rank's :class:`~specdec.parallel.helix.HelixKVManager` keeps only its own pages:
    ``page_table`` is rank-local and ``slots`` gives ``-1`` for positions another rank owns
    (the step does not write them here). Rolling a request back to ``L`` tokens releases
    exactly the rank-local pages past the rank's share of ``L``.

    Ranks never disagree about room: rank 0 owns page 0 of every request and so holds at
    least as many pages of each request as any other rank; with equal pools, whatever fits
    on rank 0 fits everywhere. Every rank therefore decides from rank 0's count, computed
    from the lengths alone, without a collective, and raises :class:`PoolExhaustedError`
    at the same call.

    Args:
        shard: this rank's Helix part.
        local_pages: pages in this rank's pool (the same on every rank).
    """

    def __init__(self, shard: HelixShard, local_pages: int):
        self.shard, self.layout = shard, shard.layout
        self.helix = HelixKVManager(shard.layout, shard.rank, local_pages)
        self.local_pages = local_pages
        self.tokens_per_block = shard.layout.tokens_per_block
        self._rank0_used = 0  # pages rank 0 holds: the most loaded rank for every request

    # -- queries (global view) ----------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        """Logical pages the ranks hold together: a request of ``n`` pages fits iff ``n <= num_pages``."""
        return self.local_pages * self.layout.cp

    @property
    def num_free_pages(self) -> int:
        """Logical pages still free, counted on the most loaded rank (rank 0)."""
        return (self.local_pages - self._rank0_used) * self.layout.cp

    def __contains__(self, req_id: Hashable) -> bool:
        return req_id in self.helix

    def length(self, req_id: Hashable) -> int:
        """Global tokens of ``req_id``."""
        return self.helix.length(req_id)

    def local_length(self, req_id: Hashable) -> int:
        """Tokens of ``req_id`` this rank holds."""
        return self.helix.local_length(req_id)

    def page_table(self, req_id: Hashable) -> list[int]:
        """This rank's physical pages of ``req_id``, local order (a copy)."""
        return self.helix.page_table(req_id)

    def page_tuple(self, req_id: Hashable) -> tuple[int, ...]:
        """:meth:`page_table` as a tuple (the step plan's form)."""
        return tuple(self.helix.page_table(req_id))

    def allocation(self, req_id: Hashable) -> int:
        """:meth:`KVCacheManager.allocation` of this rank's pages of ``req_id``."""
        return self.helix.allocation(req_id)

    def slots(self, req_id: Hashable, start: int, stop: int) -> list[int]:
        """Local slot of each global position of ``[start, stop)``; ``-1`` where another rank owns it."""
        if not 0 <= start <= stop <= self.length(req_id):
            raise IndexError(f"positions [{start}, {stop}) outside request {req_id!r} of length "
                             f"{self.length(req_id)}")
        out = [-1] * (stop - start)
        for a, b in self.layout.owned_runs(start, stop, self.shard.rank):
            local_start = self.layout.owner(a)[1]
            out[a - start:b - start] = self.helix.local.slots(req_id, local_start, local_start + b - a)
        return out

    def can_grow(self, req_id: Hashable | None, num_tokens: int) -> bool:
        """Whether ``num_tokens`` more global tokens of ``req_id`` fit on every rank."""
        have = self.helix.length(req_id) if req_id is not None and req_id in self.helix else 0
        return self._rank0_pages(have + num_tokens) - self._rank0_pages(have) <= self.local_pages - self._rank0_used

    # -- lifecycle (global lengths) -----------------------------------------------------------
    def allocate(self, req_id: Hashable, num_tokens: int) -> None:
        """Start ``req_id`` at ``num_tokens`` global tokens.

        Raises:
            InvalidRequestError: ``req_id`` already holds pages, or ``num_tokens < 0``.
            PoolExhaustedError: it does not fit on every rank (nothing changes on any rank).
        """
        if req_id in self.helix:
            raise InvalidRequestError(f"request {req_id!r} is already allocated")
        if num_tokens < 0:
            raise InvalidRequestError(f"num_tokens must be >= 0, got {num_tokens}")
        self._check_room(req_id, None, num_tokens)
        self.helix.allocate(req_id, num_tokens)
        self._rank0_used += self._rank0_pages(num_tokens)

    def append(self, req_id: Hashable, num_tokens: int) -> None:
        """Grow ``req_id`` by ``num_tokens`` global tokens.

        Raises:
            PoolExhaustedError: they do not fit on every rank (the request is unchanged everywhere).
        """
        if num_tokens < 0:
            raise InvalidRequestError(f"num_tokens must be >= 0, got {num_tokens}")
        have = self.length(req_id)
        self._check_room(req_id, req_id, num_tokens)
        self.helix.append(req_id, num_tokens)
        self._rank0_used += self._rank0_pages(have + num_tokens) - self._rank0_pages(have)

    def truncate(self, req_id: Hashable, new_length: int) -> None:
        """Roll ``req_id`` back to ``new_length`` global tokens; rank-local pages past its share are freed."""
        have = self.length(req_id)
        self.helix.truncate(req_id, new_length)
        self._rank0_used -= self._rank0_pages(have) - self._rank0_pages(new_length)

    def resize(self, req_id: Hashable, new_length: int) -> None:
        """Set ``req_id`` to ``new_length`` global tokens (:meth:`append` or :meth:`truncate`).

        Raises:
            InvalidRequestError: ``new_length < 0``.
            PoolExhaustedError: growing does not fit on every rank (the request is unchanged everywhere).
        """
        if new_length < 0:
            raise InvalidRequestError(f"new_length must be >= 0 for request {req_id!r}, got {new_length}")
        have = self.length(req_id)
        if new_length >= have:
            self.append(req_id, new_length - have)
        else:
            self.truncate(req_id, new_length)

    def free(self, req_id: Hashable) -> None:
        """Release every page of ``req_id`` on this rank and forget it."""
        have = self.length(req_id)
        self.helix.free(req_id)
        self._rank0_used -= self._rank0_pages(have)

    def _rank0_pages(self, length: int) -> int:
        return pages_for(self.layout.local_length(length, 0), self.tokens_per_block)

    def _check_room(self, req_id: Hashable, grow: Hashable | None, num_tokens: int) -> None:
        if not self.can_grow(grow, num_tokens):
            raise PoolExhaustedError(
                f"request {req_id!r} needs {num_tokens} more token(s): rank 0 (the most loaded) has "
                f"{self.local_pages - self._rank0_used} free page(s) of {self.local_pages}")
