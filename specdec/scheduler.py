"""Which requests run each step, the step's plan, and where every cached layer lives.

The scheduler owns the KV page manager and every request's length. Each step it
admits waiting requests while the pool has room, reserves KV for each running
request's next forward (the prompt for a context request, ``1 + k`` tokens for a
generation request), and preempts the newest request when the pool runs dry. It
never overwrites another request's pages: the manager raises instead, and the
scheduler waits or preempts. Once the drafter has proposed, :meth:`Scheduler.pack`
gives back the reserved slots the drafts did not use and lays the step out as a
:class:`StepPlan`; after verification :meth:`Scheduler.commit` keeps exactly the
accepted tokens' cache (rollback), and :meth:`Scheduler.undo` reverts a failed step.

It also makes the one KV-sharing decision of docs/design.md §3 from a drafter's
declared hooks alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specdec.drafters.base import EMPTY_DRAFT, Draft, on_device
from specdec.errors import ConfigError, PoolExhaustedError
from specdec.kvcache.manager import KVCacheManager
from specdec.kvcache.pool import LayerSpec
from specdec.model_runner import StepInput, StepResult
from specdec.sampling import RowSampling, request_key
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
class StepPlan:
    """One engine step, laid out once by the scheduler and read by every later part of the step.

    It is built in two stages. :meth:`Scheduler.schedule` picks the requests and reserves
    their KV (``context``, ``generation``, ``budgets``, ``preempted``); once the drafter has
    proposed, :meth:`Scheduler.pack` cuts each reservation to its draft and fills in the rest.
    The runner reads ``inputs``, verification reads ``drafts`` and ``row_starts``, the commit
    reads ``token_starts`` (the drafter's hidden rows); nobody recomputes the packing.

    Requests are packed context requests first, then generation requests; ``requests`` is
    that order, and every per-request list below follows it (``[R]``, ``R = len(requests)``).

    Attributes:
        context: requests admitted this step; their prompt (or recomputed context) runs now.
        generation: running requests; each feeds its last token and verifies its draft.
        budgets: ``[len(generation)]`` the most draft tokens each may verify; KV was reserved
            for ``1 + budget`` tokens.
        preempted: requests sent back to the queue while scheduling (they do not run).
        drafts: ``[R]`` each request's draft after :meth:`Scheduler.pack` (empty for context
            requests and for requests the drafter gave nothing).
        fed: ``[R]`` tokens each request feeds: its uncached tokens plus its draft.
        token_starts: ``[R]`` the request's first row among the step's tokens (``inputs.input_ids``).
        row_starts: ``[R]`` the request's first row among the verified rows (``inputs.rows``);
            it has ``len(drafts[i]) + 1`` of them.
        inputs: the runner's packed input (tokens, positions, slots, page tables, verified rows,
            sampled rows); ``None`` until packed.
        result: the forward's result once launched (:meth:`ModelRunner.launch`).
    """

    context: list[Sequence] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)  # prompt tokens each context request feeds this step
    generation: list[Sequence] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    drafts: list[Draft] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)
    token_starts: list[int] = field(default_factory=list)
    row_starts: list[int] = field(default_factory=list)
    inputs: StepInput | None = None
    result: StepResult | None = None

    @property
    def requests(self) -> list[Sequence]:
        """Every request of the step, in packing order (context, then generation)."""
        return self.context + self.generation

    def __bool__(self) -> bool:
        return bool(self.context or self.generation)


class Scheduler:
    """FCFS admission over a paged pool, with preemption by recomputation; the owner of KV.

    Every change of a request's cached length (``Sequence.num_cached``) and of its pages
    happens here: admission, reservation, packing, commit, preemption, undo and removal.

    With ``max_prefill_tokens``, prompts are fed in chunks: a step's context requests feed at most
    that many prompt tokens in all (decoding requests first, then the prompts already begun, then
    new ones), and a prompt that does not fit is continued by the next steps. Only the step that
    feeds a prompt's last token emits its first output token; until then the request is running
    and its fed chunks are cached (:meth:`commit_chunk`).

    Args:
        manager: the KV page manager.
        max_num_seqs: most running requests.
        max_prefill_tokens: most prompt tokens fed in one step; ``None``: whole prompts.
    """

    def __init__(self, manager: KVCacheManager, max_num_seqs: int, max_prefill_tokens: int | None = None):
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
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

    def schedule(self, draft_budget) -> StepPlan:
        """Admit, reserve KV and return this step's plan (not yet packed: see :meth:`pack`).

        Args:
            draft_budget: ``(seq) -> int``, the most drafts a running request may verify.
        """
        plan = StepPlan()
        prefilling = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            if len(seq.tokens) - seq.num_cached > 1:  # a prompt begun in an earlier step
                prefilling.append(seq)
                continue
            budget = draft_budget(seq)
            if budget and self._reserve(seq, 1 + budget, plan, preempt=False):
                plan.generation.append(seq)
                plan.budgets.append(budget)
            elif self._reserve(seq, 1, plan, preempt=True):
                plan.generation.append(seq)
                plan.budgets.append(0)
        left = self.max_prefill_tokens if self.max_prefill_tokens is not None else float("inf")
        for seq in prefilling:  # then the prompts already begun, in arrival order
            if left <= 0:
                break
            if seq.status is not Status.RUNNING:  # preempted by a request before it
                continue
            chunk = int(min(len(seq.tokens) - seq.num_cached, left))
            if self._reserve(seq, chunk, plan, preempt=True):
                plan.context.append(seq)
                plan.chunks.append(chunk)
                left -= chunk
        while self.waiting and len(self.running) < self.max_num_seqs and left > 0:
            seq = self.waiting[0]
            need = len(seq.tokens)
            if not self.manager.can_grow(None, need + 1 + draft_budget(seq)) and self.running:
                break  # wait for pages; an empty engine admits if the prompt alone fits
            chunk = int(min(need, left))
            try:
                self.manager.allocate(seq.req_id, chunk)
            except PoolExhaustedError:
                break
            self.waiting.popleft()
            seq.num_cached = 0
            seq.start()
            self.running.append(seq)
            plan.context.append(seq)
            plan.chunks.append(chunk)
            left -= chunk
        return plan

    def pack(self, plan: StepPlan, drafts: list[Draft]) -> StepPlan:
        """Give back the reserved slots the drafts do not use, and lay the step out.

        Args:
            plan: a plan from :meth:`schedule`.
            drafts: one per generation request, each at most its budget.

        Returns:
            ``plan``, packed: ``drafts``, ``fed``, ``token_starts``, ``row_starts`` and ``inputs``.
        """
        if len(drafts) != len(plan.generation):
            raise ValueError(f"pack needs one draft per generation request ({len(plan.generation)}), "
                             f"got {len(drafts)}")
        for seq, d, budget in zip(plan.generation, drafts, plan.budgets):
            if len(d) > budget:
                raise ValueError(f"request {seq.req_id!r}: a draft of {len(d)} tokens, {budget} reserved")
            if len(d) < budget:
                self.manager.truncate(seq.req_id, seq.num_cached + 1 + len(d))
        plan.drafts = [EMPTY_DRAFT] * len(plan.context) + list(drafts)
        ids, positions, slots, ctx, gen, rows = [], [], [], [], [], []
        sampling = RowSampling()  # the sampled rows; greedy rows take the argmax
        source = None  # drafts left on the device (one propose's): the step reads them there
        for i, (seq, draft) in enumerate(zip(plan.requests, plan.drafts)):
            src = on_device(draft)
            if src is not None and not src.fetched and source in (None, src) and seq.params.greedy:
                # -1 - i stands for the propose's i-th token (StepInput.draft_source)
                source, at = src, draft.token_ids.start
                fed = seq.tokens[seq.num_cached:] + [-1 - j for j in range(at, at + len(draft))]
            elif i < len(plan.context):  # a prompt, or its next chunk
                fed = seq.tokens[seq.num_cached:seq.num_cached + plan.chunks[i]]
            else:
                fed = seq.tokens[seq.num_cached:] + list(draft.token_ids)
            start, stop = seq.num_cached, seq.num_cached + len(fed)
            plan.fed.append(len(fed))
            plan.token_starts.append(len(ids))
            plan.row_starts.append(len(rows))
            # verified rows: the request's last token and each draft; they predict positions len(tokens) ..
            if not seq.params.greedy:
                sampling.add(len(rows), seq.params, request_key(seq.seed), len(seq.tokens),
                             draft if i >= len(plan.context) else None)
            rows += range(len(ids) + len(fed) - 1 - len(draft), len(ids) + len(fed))
            ids += fed
            positions += range(start, stop)
            slots += self.manager.slots(seq.req_id, start, stop)
            (ctx if i < len(plan.context) else gen).append((len(fed), stop, self.manager.page_tuple(seq.req_id)))
        plan.inputs = StepInput(ids, positions, slots, ctx, gen, rows, sampling or None,
                                None if source is None else source.flat)
        return plan

    def plan_ahead(self, plan: StepPlan) -> StepPlan | None:
        """The decode step after ``plan``, for every request of it, laid out before ``plan``'s
        tokens are known (they are its input tokens, copied on the device).

        Each request takes one more cache slot, for the position after the one ``plan`` fed
        (the cache then holds one slot beyond what ``plan``'s commit keeps; see :meth:`commit`).
        ``None`` (nothing reserved) when the pool cannot give every request its slot.
        """
        seqs = plan.generation
        taken = []
        try:
            for seq in seqs:
                self.manager.append(seq.req_id, 1)
                taken.append(seq)
        except PoolExhaustedError:
            for seq in taken:
                self.manager.truncate(seq.req_id, self.manager.length(seq.req_id) - 1)
            return None
        n = len(seqs)
        positions = [seq.num_cached + 1 for seq in seqs]  # plan fed position num_cached
        slots = [self.manager.slots(seq.req_id, p, p + 1)[0] for seq, p in zip(seqs, positions)]
        gen = [(1, p + 1, tuple(self.manager.page_table(seq.req_id))) for seq, p in zip(seqs, positions)]
        sampling = RowSampling()  # sampled requests draw by seed and position: known before plan's tokens are
        for i, seq in enumerate(seqs):
            if not seq.params.greedy:  # plan predicts position len(tokens); this step the one after
                sampling.add(i, seq.params, request_key(seq.seed), len(seq.tokens) + 1, None)
        return StepPlan(generation=list(seqs), budgets=[0] * n, drafts=[EMPTY_DRAFT] * n, fed=[1] * n,
                        token_starts=list(range(n)), row_starts=list(range(n)),
                        inputs=StepInput([0] * n, positions, slots, [], gen, list(range(n)), sampling or None))

    def commit(self, seq: Sequence, ahead: bool = False) -> None:
        """After verification: the cache keeps every token of ``seq`` but its last (the next
        step feeds it), and rejected drafts' slots are released.

        Args:
            seq: a request still running after its new tokens were appended.
            ahead: a decode step launched ahead already holds the slot after the last token.
        """
        seq.num_cached = len(seq.tokens) - 1
        self.manager.truncate(seq.req_id, seq.num_cached + ahead)

    def commit_chunk(self, seq: Sequence, num_tokens: int) -> None:
        """After a step that fed ``num_tokens`` of ``seq``'s prompt but not its last token: they
        stay cached, and the next steps feed the rest."""
        seq.num_cached += num_tokens
        self.manager.truncate(seq.req_id, seq.num_cached)

    def prompt_done(self, plan: StepPlan, i: int) -> bool:
        """Whether context request ``i`` of packed ``plan`` fed its prompt's last token this step
        (then it emits its first token; else only its chunk is cached)."""
        seq = plan.context[i]
        return seq.num_cached + plan.chunks[i] >= len(seq.tokens)

    def undo(self, plan: StepPlan) -> None:
        """Give back what :meth:`schedule` (and :meth:`pack`) did for ``plan`` after its step failed.

        Requests it admitted wait again at the head of the queue (their pages freed, to be
        prefilled again); running ones, prompts begun earlier among them, keep only their cached
        tokens' slots. Preemptions stand: a preempted request is a consistent waiting one.
        Finished requests are left alone.
        """
        for seq in reversed(plan.context):
            if seq in self.running and seq.num_cached and seq.status is Status.RUNNING:  # begun earlier
                self.manager.truncate(seq.req_id, min(seq.num_cached, self.manager.length(seq.req_id)))
            elif seq in self.running:
                self.running.remove(seq)
                if seq.req_id in self.manager:
                    self.manager.free(seq.req_id)
                seq.status, seq.num_cached = Status.WAITING, 0
                self.waiting.appendleft(seq)
        for seq in plan.generation:
            if seq.status is Status.RUNNING and seq.req_id in self.manager:
                self.manager.truncate(seq.req_id, min(seq.num_cached, self.manager.length(seq.req_id)))

    def _reserve(self, seq: Sequence, num_tokens: int, plan: StepPlan, preempt: bool) -> bool:
        """Grow ``seq`` by ``num_tokens`` new tokens; with ``preempt``, evict newer requests
        (``seq`` itself last) until it fits. Returns whether ``seq`` runs this step."""
        while True:
            try:
                self.manager.resize(seq.req_id, seq.num_cached + num_tokens)
                return True
            except PoolExhaustedError:
                self.manager.truncate(seq.req_id, seq.num_cached)  # holds its cached tokens' slots only
                if not preempt:
                    return False
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is seq:
                    return False

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        self.manager.free(seq.req_id)
        seq.status, seq.num_cached = Status.WAITING, 0
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)
        if seq in plan.generation:
            i = plan.generation.index(seq)
            del plan.generation[i], plan.budgets[i]
        if seq in plan.context:  # a prompt begun earlier, given its chunk before this preemption
            i = plan.context.index(seq)
            del plan.context[i], plan.chunks[i]
