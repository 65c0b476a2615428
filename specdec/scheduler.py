"""Which requests run each step, and where every cached layer lives.

The scheduler admits waiting requests while the pool has room, reserves KV
for each running request's next forward (the prompt for a context request,
``1 + k`` tokens for a generation request), and preempts the newest request
when the pool runs dry. It never overwrites another request's pages: the
manager raises instead, and the scheduler waits or preempts.

It also makes the one KV-sharing decision of docs/design.md §3 from a drafter's
declared hooks alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specdec.errors import ConfigError, PoolExhaustedError
from specdec.kvcache.manager import KVCacheManager
from specdec.kvcache.pool import LayerSpec
from specdec.sequence import Sequence, Status


@dataclass(frozen=True, slots=True)
class KVLayoutDecision:
    """Where a drafter's KV layers live, and why.

    Attributes:
        shared: the drafter's layers are appended to the target's pool.
        reason: the rule of docs/design.md §3 that decided.
        draft_tokens_per_block: page size of a separate draft pool (``None`` when shared or no layers).
        sharded: the drafter's layers are Helix-sharded like the target's (appended to its pool
            under Helix); False: they hold the whole context.
    """

    shared: bool
    reason: str
    draft_tokens_per_block: int | None = None
    sharded: bool = False


def decide_kv_sharing(
    draft_specs: tuple[LayerSpec, ...],
    reads_managed_ctx_pages,
    reads_helix_sharded_ctx_pages: bool,
    target_tokens_per_block: int,
    target_accepts_appended_layers: bool = True,
    helix_cp: int = 1,
    candidate_page_sizes: tuple[int, ...] = (16, 32, 64, 128, 8, 256, 4, 2, 1),
) -> KVLayoutDecision:
    """The one KV-sharing decision (docs/design.md §3), from declarations only.

    Args:
        draft_specs: the drafter's ``kv_layer_specs()``.
        reads_managed_ctx_pages: the drafter's hook, ``(tokens_per_block) -> bool``.
        reads_helix_sharded_ctx_pages: the drafter's hook.
        target_tokens_per_block: the target pool's page size.
        target_accepts_appended_layers: whether the target's manager takes draft layers.
        helix_cp: Helix context-parallel ranks of the target (1 = off).
        candidate_page_sizes: page sizes to try, in order, for a separate pool.

    Returns:
        The decision and its reason.
    """
    if not draft_specs:
        return KVLayoutDecision(False, "the drafter has no KV layers: nothing to share")

    def own_pool(reason: str, sharded: bool = False) -> KVLayoutDecision:
        # Prefer the target's page size when the drafter reads it, else the first size it reads.
        sizes = [p for p in (target_tokens_per_block, *candidate_page_sizes) if reads_managed_ctx_pages(p)]
        if not sizes:
            raise ConfigError(
                f"drafter hook reads_managed_ctx_pages is false for every page size tried "
                f"{sorted({target_tokens_per_block, *candidate_page_sizes})}: it can read no KV pool")
        return KVLayoutDecision(False, reason, sizes[0], sharded)

    if not target_accepts_appended_layers:
        return own_pool("the target's KV manager does not accept appended draft layers: separate pool")
    if not reads_managed_ctx_pages(target_tokens_per_block):
        return own_pool(
            f"the drafter does not read managed pages of {target_tokens_per_block} tokens: "
            "separate pool with a page size it reads"
        )
    if helix_cp > 1 and not reads_helix_sharded_ctx_pages:
        return own_pool(f"the target runs Helix (cp={helix_cp}) and the drafter does not read sharded pages: "
                        "separate, unsharded pool")
    if helix_cp > 1 and any(s.has_v for s in draft_specs):
        return own_pool(f"under Helix (cp={helix_cp}) only K-only draft layers may be appended; "
                        "the drafter has K/V layers: separate pool", sharded=False)
    sharded = f", sharded across the {helix_cp} Helix ranks like the target's" if helix_cp > 1 else ""
    return KVLayoutDecision(True, f"draft layers appended to the target pool ({target_tokens_per_block}-token pages"
                                  f"{sharded})", sharded=helix_cp > 1)


@dataclass(slots=True)
class ScheduledBatch:
    """The requests of one step; context requests first, then generation requests.

    ``budgets[i]`` is how many draft tokens ``generation[i]`` may verify.
    """

    context: list[Sequence] = field(default_factory=list)
    generation: list[Sequence] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.context or self.generation)


class Scheduler:
    """FCFS admission over a paged pool, with preemption by recomputation.

    Args:
        manager: the KV page manager.
        max_num_seqs: most running requests.
    """

    def __init__(self, manager: KVCacheManager, max_num_seqs: int):
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted request and free its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.req_id in self.manager:
            self.manager.free(seq.req_id)

    def schedule(self, draft_budget) -> ScheduledBatch:
        """Admit, reserve KV and return this step's batch.

        Args:
            draft_budget: ``(seq) -> int``, the most drafts a running request may verify.
        """
        batch = ScheduledBatch()
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            budget = draft_budget(seq)
            if budget and self._reserve(seq, 1 + budget, batch, preempt=False):
                batch.generation.append(seq)
                batch.budgets.append(budget)
            elif self._reserve(seq, 1, batch, preempt=True):
                batch.generation.append(seq)
                batch.budgets.append(0)
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            need = len(seq.tokens)
            if not self.manager.can_grow(None, need + 1 + draft_budget(seq)) and self.running:
                break  # wait for pages; an empty engine admits if the prompt alone fits
            try:
                self.manager.allocate(seq.req_id, need)
            except PoolExhaustedError:
                break
            self.waiting.popleft()
            seq.num_cached = 0
            seq.start()
            self.running.append(seq)
            batch.context.append(seq)
        return batch

    def undo(self, batch: ScheduledBatch) -> None:
        """Give back what :meth:`schedule` did for ``batch`` after its step failed.

        Requests it admitted wait again at the head of the queue (their pages freed, to be
        prefilled again); running ones keep only their cached tokens' slots. Preemptions stand:
        a preempted request is a consistent waiting one. Finished requests are left alone.
        """
        for seq in reversed(batch.context):
            if seq in self.running:
                self.running.remove(seq)
                if seq.req_id in self.manager:
                    self.manager.free(seq.req_id)
                seq.status, seq.num_cached = Status.WAITING, 0
                self.waiting.appendleft(seq)
        for seq in batch.generation:
            if seq.status is Status.RUNNING and seq.req_id in self.manager:
                self.manager.truncate(seq.req_id, min(seq.num_cached, self.manager.length(seq.req_id)))

    def _reserve(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch, preempt: bool) -> bool:
        """Grow ``seq`` by ``num_tokens`` new tokens; with ``preempt``, evict newer requests
        (``seq`` itself last) until it fits. Returns whether ``seq`` runs this step."""
        self.manager.truncate(seq.req_id, seq.num_cached)
        while True:
            try:
                self.manager.append(seq.req_id, num_tokens)
                return True
            except PoolExhaustedError:
                if not preempt:
                    return False
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    return False

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.manager.free(seq.req_id)
        seq.status, seq.num_cached = Status.WAITING, 0
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        if seq in batch.generation:
            i = batch.generation.index(seq)
            del batch.generation[i], batch.budgets[i]
