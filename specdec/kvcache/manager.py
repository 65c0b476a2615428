"""Page tables per request over a free list of pages.

The manager owns the only mapping from pages to requests. A page is handed to
at most one request; exhaustion raises :class:`PoolExhaustedError` and changes
nothing, so the scheduler can queue or preempt instead of overwriting.
Rollback of rejected drafts is :meth:`KVCacheManager.truncate`.
"""

from __future__ import annotations

from collections.abc import Hashable

from specdec.errors import InvalidRequestError, PoolExhaustedError


def pages_for(num_tokens: int, tokens_per_block: int) -> int:
    """Pages needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // tokens_per_block)


class KVCacheManager:
    """Allocate / append / truncate / free for requests over ``num_pages`` pages.

    Args:
        num_pages: pages in the pool.
        tokens_per_block: tokens per page.
    """

    def __init__(self, num_pages: int, tokens_per_block: int):
        if num_pages < 0:
            raise InvalidRequestError(f"num_pages must be >= 0, got {num_pages}")
        if tokens_per_block < 1:
            raise InvalidRequestError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        self.num_pages = num_pages
        self.tokens_per_block = tokens_per_block
        # Pop from the end: low page ids are handed out first.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._tables: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}
        self._allocations: dict[Hashable, int] = {}
        self._next_allocation = 0

    # -- queries -----------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def __contains__(self, req_id: Hashable) -> bool:
        return req_id in self._tables

    def length(self, req_id: Hashable) -> int:
        """Tokens currently held for ``req_id``."""
        return self._lengths[self._known(req_id)]

    def allocation(self, req_id: Hashable) -> int:
        """An id of ``req_id``'s current allocation: the same while it holds pages (append and
        truncate keep it), a new one once it is freed and allocated again (e.g. after preemption),
        so a slot computed earlier is still the request's exactly when the id is unchanged and the
        position was not truncated away."""
        return self._allocations[self._known(req_id)]

    def page_table(self, req_id: Hashable) -> list[int]:
        """Physical pages of ``req_id``, logical page order (a copy)."""
        return list(self._tables[self._known(req_id)])

    def page_tuple(self, req_id: Hashable) -> tuple[int, ...]:
        """Physical pages of ``req_id``, logical page order, as a tuple (the step plan's form)."""
        return tuple(self._tables[self._known(req_id)])

    def resize(self, req_id: Hashable, new_length: int) -> None:
        """Set ``req_id``'s length to ``new_length`` tokens, taking or returning pages as needed
        (the one place pages move: :meth:`append` and :meth:`truncate` call it; the scheduler's
        reservation calls it directly, growing or shrinking in one call).

        Raises:
            InvalidRequestError: ``new_length < 0``.
            PoolExhaustedError: not enough free pages to grow (the request is unchanged).
        """
        table, free = self._tables[self._known(req_id)], self._free
        if new_length < 0:
            raise InvalidRequestError(f"new_length must be >= 0 for request {req_id!r}, got {new_length}")
        keep = pages_for(new_length, self.tokens_per_block)
        need = keep - len(table)
        if need > len(free):
            raise PoolExhaustedError(
                f"request {req_id!r} needs {need} more page(s) of {self.tokens_per_block} tokens, "
                f"{len(free)} free of {self.num_pages}"
            )
        for _ in range(need):
            table.append(free.pop())
        while len(table) > keep:
            free.append(table.pop())
        self._lengths[req_id] = new_length

    def can_grow(self, req_id: Hashable | None, num_tokens: int) -> bool:
        """Whether ``num_tokens`` more tokens fit for ``req_id`` (``None``: a new request)."""
        have = self._lengths.get(req_id, 0)
        pages = len(self._tables.get(req_id, ()))
        return pages_for(have + num_tokens, self.tokens_per_block) - pages <= len(self._free)

    def slots(self, req_id: Hashable, start: int, stop: int) -> list[int]:
        """Flat slot ids (``page * tokens_per_block + offset``) of positions ``[start, stop)``."""
        table, tpb = self._tables[self._known(req_id)], self.tokens_per_block
        if not 0 <= start <= stop <= self._lengths[req_id]:
            raise IndexError(f"positions [{start}, {stop}) outside request {req_id!r} of length {self._lengths[req_id]}")
        return [table[p // tpb] * tpb + p % tpb for p in range(start, stop)]

    # -- lifecycle ---------------------------------------------------------
    def allocate(self, req_id: Hashable, num_tokens: int) -> None:
        """Start ``req_id`` with room for ``num_tokens`` tokens.

        Raises:
            InvalidRequestError: ``req_id`` already holds pages, or ``num_tokens < 0``.
            PoolExhaustedError: not enough free pages (nothing is allocated).
        """
        if req_id in self._tables:
            raise InvalidRequestError(f"request {req_id!r} is already allocated")
        if num_tokens < 0:
            raise InvalidRequestError(f"num_tokens must be >= 0, got {num_tokens}")
        self._tables[req_id] = []
        self._lengths[req_id] = 0
        try:
            self.append(req_id, num_tokens)
        except PoolExhaustedError:
            del self._tables[req_id], self._lengths[req_id]
            raise
        self._allocations[req_id], self._next_allocation = self._next_allocation, self._next_allocation + 1

    def append(self, req_id: Hashable, num_tokens: int) -> None:
        """Grow ``req_id`` by ``num_tokens`` tokens, taking pages as needed.

        Raises:
            PoolExhaustedError: not enough free pages (the request is unchanged).
        """
        self._known(req_id)
        if num_tokens < 0:
            raise InvalidRequestError(f"num_tokens must be >= 0, got {num_tokens}")
        self.resize(req_id, self._lengths[req_id] + num_tokens)

    def truncate(self, req_id: Hashable, new_length: int) -> None:
        """Shrink ``req_id`` to ``new_length`` tokens; pages past it return to the free list."""
        self._known(req_id)
        if not 0 <= new_length <= self._lengths[req_id]:
            raise InvalidRequestError(
                f"new_length must be in [0, {self._lengths[req_id]}] for request {req_id!r}, got {new_length}"
            )
        self.resize(req_id, new_length)

    def free(self, req_id: Hashable) -> None:
        """Release every page of ``req_id`` and forget it."""
        self.truncate(req_id, 0)
        del self._tables[req_id], self._lengths[req_id], self._allocations[req_id]

    def _known(self, req_id: Hashable) -> Hashable:
        if req_id not in self._tables:
            raise InvalidRequestError(f"request {req_id!r} holds no pages")
        return req_id
