"""How many tokens a step drafts, none included: the length with the most tokens per second, from
what this batch size's steps measured.

A drafter pays for itself when a drafting step emits more tokens per second of its time (the
propose, the wider verify, the drafter's bookkeeping) than a plain step. That depends on the batch
size: on a small target a learned drafter's propose costs about a target step, which accepted
tokens repay at batch 1 but not at batch 32, where the target's step is already efficient and
each drafted token adds a verified row per request (on the H100, SmolLM2-135M, round-7 DFlash:
1.66x the null drafter's tokens/s at batch 1, 0.75x at batch 32; BENCHMARKS.md). The best length
moves too: a draft's last tokens are accepted least often, and the rows they add cost most where
the batch is large. A serving engine's batch moves all day, and a long ``generate`` ends with a
shrinking batch.

:class:`DraftGate` chooses among ``0, 1, 2, 4, ..., max`` draft tokens (0: a plain step, with no
propose) per batch-size bucket (1, 2, 3-4, 5-8, ...). For a length ``L`` it estimates its steps'
tokens per second as ``(1 + A(L)) / c(L)`` (tokens per request over seconds per request):

- ``c(L)``, a step's seconds per request at length ``L``: the mean of its last
  :data:`~DraftGate.WINDOW` measured steps, without those over :data:`~DraftGate.OUTLIER` times
  their median (a one-off compile or capture; :data:`~DraftGate.PLAIN_OUTLIER` for plain steps),
  each moved to the batch being decided: a bucket spans up to 2x in batch, and a step's time grows
  as ``batch ** e`` with ``e`` fitted from this bucket's and a neighbour's steps (0 to 1; 1, seconds
  per request as measured, until two buckets have measured). On a GPU ``e`` is 0.1-0.5: plain steps
  of 17 requests, taken as a generate's batch shrank, cost nearly twice as much per request as at
  32, and priced as measured they lost to drafting steps measured at 32 that they beat there.
  A length not measured yet is interpolated from the measured ones
  around it (a step's cost grows about linearly with its rows), so only lengths that could win are
  measured.
- ``A(L)``, the drafted tokens a request gets accepted with at most ``L`` drafted, as a sum of
  increments: for each length ``L_j <= L``, the mean of ``min(a, L_j) - min(a, L_j-1)`` over the
  request-steps that drafted at least ``L_j`` (``a``: the tokens they had accepted; a shorter draft
  is a prefix of the longer one, so ``min(a, L)`` is what ``L`` would have had), each weighted by
  half every :data:`~DraftGate.ACCEPT_HALF_LIFE` steps since. The short lengths' increments come
  from nearly every step; a long draft measured only in probes adds only its own increment's noise,
  and ``A`` never falls as ``L`` grows. Every step that drafts tells about
  every shorter length, and a whole batch of requests at once: far fewer steps are needed than to
  time each length's tokens per second directly (a draft is often all accepted or none).
  ``A`` is one estimate for every bucket: how much of a draft the target accepts is a matter of
  the drafter and the text, not of how many requests share the step (cost is what the batch
  changes). A bucket the batch has just reached (a ``generate`` whose batch shrinks as requests
  finish) then decides from every step so far, not from its own first few.

The choice reads ``A`` raised by half a standard error (:data:`~DraftGate.OPTIMISM`; an
approximate one, from the spread of ``min(a, L)`` over the request-steps that drafted ``L`` or
more and how many they amount to, older ones weighing less): a
length known from few request-steps, such as a probe's four at batch 1, is tried where it could
win, and its own steps then settle it, where a low first estimate would have kept the gate away
from it until the next probe.

A new bucket first measures the cost of the length its nearest measured bucket chose (the longest
where there is none: what the engine does without the gate) and of no draft,
:data:`~DraftGate.WARMUP` steps each, then of any length whose estimate leads while its cost is
still interpolated; then it takes the leader. Every :data:`~DraftGate.PROBE_EVERY` steps it
measures, in turn, the longest draft (fresh acceptance for every length) and no draft (only while
its estimate is within :data:`~DraftGate.NO_DRAFT_PROBE_WITHIN` of the chosen length's),
:data:`~DraftGate.PROBE_STEPS` steps, so a change (longer contexts, text the drafter suits) is
followed (where it holds no draft, every probe is of the longest); a probe waits longer where its
steps would take over :data:`~DraftGate.PROBE_SHARE` of
the time since the last, or where the tokens they would lose (their time, times how far the probed
length's estimate is behind the chosen one's) would come to over :data:`~DraftGate.PROBE_LOSS` of
it: a learned drafter at batch 32, its longest draft at 40 % of plain steps' rate, is probed a third
as often as one near the lead.

Where the engine chains plain steps (an overlapped engine launches a plain step before the last
one's tokens reach the host, on :meth:`DraftGate.plain_next`), a chained plain step costs less than
one that is not: its host work hides behind the GPU's. A plain regime is nearly all chained steps,
but the first after a drafting step, every warm-up's and probe's first, cannot be. A probe that
falls due on a step whose successor was already promised plain waits that one step (the promise
holds), and the next step is not promised: one unchained plain step a probe, not a run of them
held back in case a probe might start. The gate keeps
the two apart (``record(..., ahead=True)``) and prices no draft at the chained steps' cost, mixed
with the unchained steps' in the share of its last promised plain steps the engine declined (a
request's last token, requests waiting, a preemption): a few declines barely move the price; an
engine that declines half of them or more is priced at the unchained cost alone.

How much of a draft is accepted is a matter of the text, which changes with the requests: when
one or two requests join the batch and make up half of it or more (a batch of 1 to 4;
:meth:`DraftGate.joined`, told by the engine as they emit their first tokens), a bucket that holds
no draft probes the longest once :data:`~DraftGate.JOIN_PROBE_AFTER` more plain steps are past
(where it could pay, within :data:`~DraftGate.JOIN_PROBE_SHARE` of the plain time since the last
probe). At batch 1 a request's text is the whole batch: a gate that stopped drafting on one answer
would otherwise carry that answer's acceptance into the next, and wait a probe's interval to see it.
The acceptance measured before a join keeps its weight, and the probe waits, because an answer's
first steps are a poor guide to the rest (:meth:`DraftGate.joined`).

Lossless whatever it decides: a shorter draft is a prefix of the drafter's, a plain step is the
null drafter's step, and the drafter keeps hearing every accepted token (``on_accepted``,
``on_contexts``), so it drafts from the right context when it is asked again. Only steps without
prompt tokens are measured (a prompt chunk's compute would swamp the comparison).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import NamedTuple, Sequence

__all__ = ["DraftGate", "GateStep", "bucket_label", "bucket_of", "draft_lengths"]


class GateStep(NamedTuple):
    """One measured step, as :meth:`DraftGate.record` heard it (kept with :meth:`DraftGate.keep_history`)."""

    batch: int  #: requests in the step
    length: int  #: the most tokens each drafted (0: a plain step)
    ahead: bool  #: a plain step launched ahead of the last (chained)
    seconds: float  #: the step's wall time
    accepted: int  #: drafted tokens accepted, over its requests
    chosen: int  #: the length the bucket chose after it (its best estimate then)


def bucket_of(batch: int) -> int:
    """The bucket of a batch size: 0 for 1, 1 for 2, 2 for 3-4, 3 for 5-8, ... (``ceil(log2)``)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return (batch - 1).bit_length()


def bucket_label(bucket: int) -> str:
    """The batch sizes of ``bucket``, e.g. ``"5-8"``."""
    hi = 1 << bucket
    lo = hi // 2 + 1 if bucket else 1
    return str(hi) if lo == hi else f"{lo}-{hi}"


def draft_lengths(max_draft: int) -> tuple[int, ...]:
    """The lengths the gate chooses among: 0, the powers of two below ``max_draft``, and ``max_draft``."""
    if max_draft < 1:
        raise ValueError(f"max_draft must be >= 1, got {max_draft}")
    return (0, *[1 << i for i in range(max_draft.bit_length()) if 1 << i < max_draft], max_draft)


class _Acceptance:
    """Accepted drafted tokens per request, per length (an index into the gate's lengths), from
    every measured step whatever its batch size."""

    def __init__(self, lengths: tuple[int, ...], keep: float) -> None:
        self.lengths = lengths
        self.keep = keep  # an older step's weight, per step
        # per length L_j: min(a, L_j) - min(a, L_j-1) summed over the request-steps that drafted at
        # least L_j, and those request-steps, each weighted by 1/2 per ACCEPT_HALF_LIFE steps since
        self.sum = [0.0] * len(lengths)
        self.n = [0.0] * len(lengths)
        # per length L_i: min(a, L_i) squared, summed as above, and the weights squared (how many
        # request-steps the weighted ones amount to): the estimate's standard error (stderr)
        self.sq = [0.0] * len(lengths)
        self.tot = [0.0] * len(lengths)
        self.w2 = [0.0] * len(lengths)

    def add(self, i: int, accepted: Sequence[int]) -> None:
        """A step drafted at most ``lengths[i]`` tokens and its requests had ``accepted`` accepted."""
        length = self.lengths[i]
        at_least = [0] * (length + 2)  # first each count of a, then the requests with a >= t
        for a in accepted:
            at_least[min(a, length)] += 1
        for t in range(length - 1, -1, -1):
            at_least[t] += at_least[t + 1]
        upto = [0] * (length + 1)  # upto[L]: min(a, L) summed over the requests
        sq_upto = [0] * (length + 1)  # and min(a, L) squared
        for t in range(1, length + 1):
            upto[t] = upto[t - 1] + at_least[t]
            sq_upto[t] = sq_upto[t - 1] + (2 * t - 1) * at_least[t]
        keep, keep2 = self.keep, self.keep * self.keep
        for j in range(1, len(self.lengths)):
            self.sum[j] *= keep
            self.n[j] *= keep
            self.sq[j] *= keep
            self.tot[j] *= keep
            self.w2[j] *= keep2
            if j <= i:  # this step tells what every length up to its own would have had accepted
                self.sum[j] += upto[self.lengths[j]] - upto[self.lengths[j - 1]]
                self.n[j] += len(accepted)
                self.tot[j] += upto[self.lengths[j]]
                self.sq[j] += sq_upto[self.lengths[j]]
                self.w2[j] += len(accepted)

    def mean(self, i: int) -> float | None:
        """Drafted tokens a request gets accepted with at most ``lengths[i]`` drafted (0 for no
        draft); ``None`` before a step drafted that many."""
        total = 0.0
        for j in range(1, i + 1):  # A(L_i) = sum of the increments: each from the steps that drafted L_j
            if self.n[j] <= 1e-9:
                return None
            total += self.sum[j] / self.n[j]
        return total

    def stderr(self, i: int) -> float:
        """The standard error of :meth:`mean` at length ``i``, approximately: the spread of
        ``min(a, lengths[i])`` over the request-steps that drafted at least ``lengths[i]`` and how
        many they amount to (weights considered), where :meth:`mean` sums increments each from all
        the steps that drafted that far (so this one errs high for a length drafted mostly in
        probes, which only makes it tried sooner); 0 without two of them."""
        n, w2 = self.n[i], self.w2[i]
        if i == 0 or n <= 1e-9 or w2 <= 1e-12 or n * n / w2 < 2.0:
            return 0.0
        mean = self.tot[i] / n
        var = max(0.0, self.sq[i] / n - mean * mean)
        return math.sqrt(var * w2) / n


class _Bucket:
    """One batch-size bucket's measurements, per length (an index into the gate's lengths)."""

    def __init__(self, lengths: tuple[int, ...], start: int, acceptance: _Acceptance, optimism: float,
                 exponent) -> None:
        self.lengths = lengths
        self.optimism = optimism  # standard errors added to accepted tokens where the gate chooses
        self.cost = [deque(maxlen=DraftGate.WINDOW) for _ in lengths]  # seconds per request of each step
        self.cost_batch = [deque(maxlen=DraftGate.WINDOW) for _ in lengths]  # and its requests
        # the batch the bucket's estimates are for (the step being decided), and how a length's step
        # time grows with the batch (DraftGate._exponent: t ~ batch ** e; 1 where unknown)
        self.batch: int | None = None
        self.exponent = exponent
        # plain steps launched ahead of the last (chained: their host work hides behind the GPU's);
        # cost[0] holds the plain steps that were not (the first after a drafting step, or any where
        # the engine does not chain)
        self.chained = deque(maxlen=DraftGate.WINDOW)
        self.chained_batch = deque(maxlen=DraftGate.WINDOW)
        self._chained_cost: tuple | None = None  # chained_cost's _window_cost, until the window changes
        # what became of the last plain steps the gate promised (DraftGate.plain_next): True, chained;
        # False, declined (an unchained plain step after one the gate would have promised: requests
        # waiting, a preemption, a request's last token). Their share prices a plain regime's steps
        self.promises = deque(maxlen=DraftGate.WINDOW)
        self.would_promise = False  # plain_next's answer during the last recorded step
        # DraftGate.plain_next said yes since the last recorded step: that step's successor is plain
        # whatever the record decides, so a probe falling due then waits a step
        self.promised = False
        self.acceptance = acceptance  # shared by every bucket
        self.steps = [0] * len(lengths)
        self.chained_steps = 0  # of steps[0]: the plain steps launched ahead of the last
        self.start = start  # the length measured first
        self.run = 0  # steps of the chosen length since the last probe
        self.run_s = 0.0  # and their seconds
        self.probing: int | None = None  # the length a probe under way measures
        self.probe_left = 0  # its steps still to measure
        self.probes = 0
        self.join_probe = False  # the probe under way was started by a join (DraftGate.joined)
        self.join_wait = 0  # plain steps until a join's probe starts (0: none waiting)
        self.join_misses = 0  # join probes in a row after which the bucket still held no draft
        # measured_cost: _window_cost's (exponent, M, k), until the window changes
        self._cost: list[tuple | None] = [None] * len(lengths)
        self._best: int | None = None  # best(), until the next measured step (of any bucket) or batch
        self._rates: dict[tuple[int, bool], float | None] = {}  # rate()'s, as long as _best
        self._times: dict[tuple[int, bool], tuple | None] = {}  # step_time()'s, until the window changes

    def stale(self) -> None:
        """Something the estimates read changed (a measured step, in any bucket; the batch)."""
        self._best = None
        self._rates.clear()

    def at(self, batch: int) -> None:
        """Estimate for steps of ``batch`` requests from now on."""
        if batch != self.batch:
            self.batch = batch
            self.stale()

    def _window_cost(self, costs, batches, i: int, outlier: float, cached: tuple | None) -> tuple:
        """The mean seconds per request of a window's steps, each moved to the bucket's batch, without
        those over ``outlier`` times their median, as ``(exponent, M, k)`` with the cost ``M * B ** -k``
        (reused from ``cached`` while the exponent is the same: a batch change costs one power).

        A step of ``b`` requests that took ``t`` takes ``t * (B / b) ** e`` at ``B`` (``e``:
        :attr:`exponent`), so its cost per request is ``c * (b / B) ** k`` with ``k = 1 - e``: the
        same factor ``B ** -k`` for every step, so which are outliers does not depend on ``B``.
        Within a bucket (up to 2x in batch) a latency-bound GPU step barely grows with the batch, and
        its seconds per request halve from 17 requests to 32: priced as measured, plain steps taken
        as the batch shrank (17) lose to drafting steps measured at 32 that they beat there."""
        e = self.exponent(i)
        if cached is not None and cached[0] == e:
            return cached
        k = 1.0 - e
        moved = [c * b ** k for c, b in zip(costs, batches)]
        cut = outlier * statistics.median(moved)
        kept = [m for m in moved if m <= cut]
        return e, sum(kept) / len(kept), k

    def _at_batch(self, cost: tuple) -> float:
        """A :meth:`_window_cost` at the bucket's batch (as measured before any batch is set)."""
        _, m, k = cost
        return m * (self.batch or 1) ** -k if k else m

    def measured(self, i: int, cost: float, ahead: bool, batch: int) -> None:
        """A step of ``batch`` requests at length ``i`` cost ``cost`` seconds per request (``ahead``: a
        plain step launched ahead of the last, chained): the caches are stale."""
        if i == 0 and ahead:
            self.chained.append(cost)
            self.chained_batch.append(batch)
            self.promises.append(True)
            self._chained_cost = None
            self._times.clear()
            self.stale()
        else:
            self.cost[i].append(cost)
            self.cost_batch[i].append(batch)
            self._cost[i] = None
            self._times.clear()
            self.stale()
            if i == 0 and self.would_promise:  # promised, yet not chained: the engine declined
                self.promises.append(False)

    def declined(self) -> float:
        """The share of the last promised plain steps the engine did not chain (0 before any)."""
        return self.promises.count(False) / len(self.promises) if self.promises else 0.0

    @property
    def chaining(self) -> bool:
        """Whether the engine chains this bucket's plain steps now: a chained one was measured and
        it declined under half of the last promised ones."""
        return bool(self.chained) and self.declined() < 0.5

    def chained_cost(self) -> float | None:
        """Seconds per request of a chained plain step at the bucket's batch (the mean of its window,
        each step moved to the batch and outliers left out as in :meth:`measured_cost`); ``None``
        before one."""
        if not self.chained:
            return None
        self._chained_cost = self._window_cost(self.chained, self.chained_batch, 0, DraftGate.PLAIN_OUTLIER,
                                               self._chained_cost)
        return self._at_batch(self._chained_cost)

    def step_time(self, i: int, chained: bool = False) -> tuple[float, float] | None:
        """The median batch and median seconds of length ``i``'s measured steps (``chained``: the
        chained plain ones), or ``None`` before any."""
        key = (i, chained)
        if key not in self._times:
            costs, batches = (self.chained, self.chained_batch) if chained else (self.cost[i], self.cost_batch[i])
            self._times[key] = (statistics.median(batches), statistics.median(c * b for c, b in zip(costs, batches))) \
                if costs else None
        return self._times[key]

    def measured_cost(self, i: int) -> float:
        """The mean of length ``i``'s window at the bucket's batch (:meth:`_window_cost`), without the
        steps slower than :data:`DraftGate.OUTLIER`
        times its median (a compile, a capture; :data:`DraftGate.PLAIN_OUTLIER` for plain steps).
        A mean, not a median: a drafter that often drafts nothing (the suffix drafter without a
        match) makes most steps plain-priced and the others dear, and both count."""
        self._cost[i] = self._window_cost(self.cost[i], self.cost_batch[i], i,
                                          DraftGate.PLAIN_OUTLIER if i == 0 else DraftGate.OUTLIER, self._cost[i])
        return self._at_batch(self._cost[i])

    def step_cost(self, i: int) -> float | None:
        """Seconds per request of a step at length ``i``: measured, else interpolated (linearly in
        the length) from the nearest measured lengths around it, else ``None``."""
        if self.cost[i]:
            return self.measured_cost(i)
        if i == 0 and self.chained:  # only chained plain steps so far (a bucket a chained step began)
            return self.chained_cost()
        measured = [j for j in range(len(self.lengths)) if self.cost[j] or (j == 0 and self.chained)]
        below = [j for j in measured if j < i]
        above = [j for j in measured if j > i]
        if not below and not above:
            return None
        if not below or not above:  # outside what was measured: the nearest measured cost
            return self.step_cost((below or above)[-1 if below else 0])
        lo, hi = below[-1], above[0]
        c_lo, c_hi = self.step_cost(lo), self.step_cost(hi)
        f = (self.lengths[i] - self.lengths[lo]) / (self.lengths[hi] - self.lengths[lo])
        return c_lo + f * (c_hi - c_lo)

    def rate(self, i: int, optimistic: bool = True) -> float | None:
        """Tokens per second per request at length ``i``: ``(1 + A) / c``; ``None`` where either part
        is unknown. No draft (``i = 0``): :meth:`plain_rate`. ``optimistic`` (what the choices read):
        ``A`` raised by the gate's ``optimism`` standard errors, so that a length known from a
        few request-steps (a batch of 1 probing it) is tried until its steps say otherwise."""
        key = (i, optimistic)
        if key not in self._rates:
            self._rates[key] = self._rate(i, optimistic)
        return self._rates[key]

    def _rate(self, i: int, optimistic: bool) -> float | None:
        if i == 0:
            return self.plain_rate()
        c, a = self.step_cost(i), self.acceptance.mean(i)
        if c is None or a is None or c <= 0:
            return None
        if optimistic:
            a = min(a + self.optimism * self.acceptance.stderr(i), float(self.lengths[i]))
        return (1.0 + a) / c

    def plain_rate(self) -> float | None:
        """Tokens per second per request of the plain steps the gate would run. Where the engine
        chains them (:attr:`chaining`: a chained one measured, under half of the last promised ones
        declined), a plain regime is chained steps but where the engine declines a promised one
        (:meth:`declined`: a request's last token, requests waiting, a preemption): each step costs
        ``d`` times an unchained one and ``1 - d`` times a chained one (:meth:`DraftGate.plain_next`
        promises the next step plain while no draft leads at all, once chained, so the first of a
        run is the only other). A few declines (requests ending) barely move it. Else (an engine
        that declines half its promises or more; plain steps may then not be promised at all, and
        the share would stop moving) the cost of the steps that were not chained."""
        chained = self.chained_cost()
        if self.chaining and chained is not None and chained > 0:
            d = self.declined()
            if d and self.cost[0]:
                chained = d * self.measured_cost(0) + (1.0 - d) * chained
            return 1.0 / chained
        c = self.step_cost(0)
        return None if c is None or c <= 0 else 1.0 / c

    def best(self) -> int:
        """The length with the highest estimated rate (the longer on a tie); ``start`` before any.
        Computed once per measured step or batch change (the engine asks at every step)."""
        if self._best is None:
            rates = [(r, i) for i in range(len(self.lengths)) if (r := self.rate(i)) is not None]
            self._best = max(rates)[1] if rates else self.start
        return self._best


class DraftGate:
    """Per batch-size bucket, the draft length (0: a plain step) with the most tokens per second.

    The engine asks :meth:`draft_length` before it schedules a step (its requests draft at most that
    many tokens; at 0 the step reserves and verifies no draft slots and skips the propose) and
    reports the step with :meth:`record` when it ran no prompt tokens. An overlapped engine asks
    :meth:`plain_next` during a plain step instead, and on a yes launches the next step, plain,
    without asking :meth:`draft_length` for it (that step is recorded at length 0).

    Args:
        max_draft: the longest draft (the engine's ``max_draft_tokens``), >= 1.
        optimism: standard errors added to a length's accepted tokens where the gate chooses
            (default :data:`OPTIMISM`; 0: the estimate as it is).
    """

    #: steps per length whose mean seconds per request is its cost
    WINDOW = 16
    #: a step slower than this many times its window's median is a one-off (a compile, a graph
    #: capture: hundreds of steps), left out of the cost
    OUTLIER = 16.0
    #: the same for plain steps (chained or not), whose cost has one mode (no draft that may or may
    #: not come) and moves within a bucket only with the batch: one at this many times the median is
    #: a pause (a collector, a capture, the host descheduled). One chained step of 13 ms among 0.8 ms
    #: ones, let in at 16x, doubled a window's mean and made drafting look faster for 170 steps
    #: (H100, Spec-Bench at batch 32)
    PLAIN_OUTLIER = 3.0
    #: a request-step's weight in a length's mean accepted tokens halves every this many steps of its
    #: bucket (a length measured only in probes is judged on its latest)
    ACCEPT_HALF_LIFE = 48
    #: steps a length is measured the first time
    WARMUP = 4
    #: steps of the chosen length between two probes
    PROBE_EVERY = 96
    #: steps each probe takes (the longest draft and no draft, in turn; the longest only where the
    #: bucket holds no draft, and on a join, :meth:`joined`)
    PROBE_STEPS = 4
    #: most of the time probes take: a probe waits until its steps' estimated time is at most this
    #: share of the time since the last (a slow length is probed less often)
    PROBE_SHARE = 0.05
    #: most of the tokens probes lose: a probe also waits until its steps' estimated time, times
    #: ``1 - `` its length's estimated tokens/s over the chosen length's, is at most this share of the
    #: time since the last (a length near the lead is probed every :data:`PROBE_SHARE`; one far behind
    #: less often)
    PROBE_LOSS = 0.01
    #: one or two requests joining at once that make up at least this share of the batch (a batch of
    #: 1 to 4) start a probe of the longest draft where the bucket holds no draft: the acceptance that
    #: made it stop drafting was another text's (on the H100 at batch 1, Spec-Bench, a gate that
    #: stopped drafting on one answer stayed plain through later ones the drafter suits). More
    #: requests' acceptance averages over their texts, as the last ones' did: no probe
    JOIN_PROBE = 0.5
    #: the most requests joining at once that start such a probe
    JOIN_PROBE_REQUESTS = 2
    #: plain steps a join's probe waits: an answer's first steps accept least (:meth:`joined`)
    JOIN_PROBE_AFTER = 8
    #: most of the time join probes take: one waits until its steps' estimated time is at most this
    #: share of the plain steps' since the last probe (looser than :data:`PROBE_SHARE`, whose
    #: probes come every 150-250 plain steps at batch 1 on the H100: most answers of 256 tokens
    #: would have seen one shortly before they joined), halved for each join probe in a row that
    #: left the bucket holding no draft, down to PROBE_SHARE: a drafter that suits no request's text
    #: soon costs what regular probes do
    JOIN_PROBE_SHARE = 0.2
    #: no draft is probed only while its estimated tokens/s is at least this share of the chosen
    #: length's (far behind, its steps would only cost tokens: 4 of 96 at 40 % of the rate is 2.5 %)
    NO_DRAFT_PROBE_WITHIN = 0.75
    #: plain steps start to be launched ahead only where no draft leads every other length by this
    #: factor; once they chain, while it leads at all (:meth:`plain_next`)
    CHAIN_MARGIN = 1.02
    #: standard errors added to a length's accepted tokens where the gate chooses (:meth:`_Bucket.rate`):
    #: the default of ``optimism``
    OPTIMISM = 0.5

    def __init__(self, max_draft: int, optimism: float | None = None) -> None:
        if optimism is None:
            optimism = self.OPTIMISM
        if isinstance(optimism, bool) or not isinstance(optimism, (int, float)) or not 0 <= optimism < math.inf:
            raise ValueError(f"optimism must be a finite number >= 0 (standard errors), got {optimism!r}")
        self.optimism = float(optimism)
        self.lengths = draft_lengths(max_draft)
        self._buckets: dict[int, _Bucket] = {}
        # _exponent's: until a step is measured into a window not yet full, or every WINDOW steps
        self._exponents: dict[tuple[int, int], float] = {}
        self._recorded = 0  # measured steps
        self._acceptance = _Acceptance(self.lengths, 0.5 ** (1.0 / self.ACCEPT_HALF_LIFE))
        #: the last measured steps (:class:`GateStep`), oldest first, once :meth:`keep_history` asked
        #: for them; ``None`` before
        self.history: deque[GateStep] | None = None

    def keep_history(self, steps: int) -> None:
        """From now on keep the last ``steps`` measured steps in :attr:`history` (each step's batch,
        length, whether it was chained, wall time, accepted tokens and the length chosen after it):
        what a benchmark reads to see why the gate chose as it did. ``0`` stops keeping them."""
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise ValueError(f"steps must be an int >= 0, got {steps!r}")
        self.history = deque(self.history or (), maxlen=steps) if steps else None

    def _bucket(self, key: int) -> _Bucket:
        b = self._buckets.get(key)
        if b is None:  # start where the nearest measured bucket settled (the longest draft if none)
            measured = [k for k, m in self._buckets.items() if any(m.steps)]
            near = min(measured, key=lambda k: (abs(k - key), k), default=None)
            start = self._buckets[near].best() if near is not None else len(self.lengths) - 1
            b = self._buckets[key] = _Bucket(self.lengths, start, self._acceptance, self.optimism,
                                             exponent=lambda i, key=key: self._exponent(key, i))
        return b

    def _at(self, batch: int) -> _Bucket:
        """The bucket of ``batch``, its estimates for steps of ``batch`` requests."""
        b = self._bucket(bucket_of(batch))
        b.at(batch)
        return b

    def _exponent(self, key: int, i: int) -> float:
        """How length ``i``'s step time grows with the batch around bucket ``key``: ``e`` in
        ``t ~ batch ** e`` (0 to 1), from the median steps of this bucket and a neighbour
        (:meth:`_fit`); a drafting length measured in one bucket only takes no draft's; 1 (seconds
        per request as measured) where neither is known. Kept until a step is measured into a window
        not yet full, or for :data:`WINDOW` steps."""
        e = self._exponents.get((key, i))
        if e is None:
            fit = self._fit(key, i)
            if fit is None and i:
                fit = self._fit(key, 0)
            e = self._exponents[(key, i)] = 1.0 if fit is None else fit
        return e

    def _fit(self, key: int, i: int) -> float | None:
        """``log(t / t') / log(b / b')`` between bucket ``key``'s median step of length ``i`` and its
        lower (else upper) neighbour's, clamped to 0..1; plain steps compare chained with chained
        where both have them, else the unchained ones. ``None`` where no neighbour has that length."""
        b = self._buckets.get(key)
        if b is None:
            return None
        for k in (key - 1, key + 1):
            n = self._buckets.get(k)
            if n is None:
                continue
            for chained in ((True, False) if i == 0 else (False,)):
                own, other = b.step_time(i, chained), n.step_time(i, chained)
                if own and other and own[0] != other[0] and own[1] > 0 and other[1] > 0:
                    return min(1.0, max(0.0, math.log(own[1] / other[1]) / math.log(own[0] / other[0])))
        return None

    def _next(self, b: _Bucket) -> int:
        """The length the bucket's next step takes (an index)."""
        if b.probing is not None:
            return b.probing
        begun = [i for i, n in enumerate(b.steps) if 0 < n < self.WARMUP]
        if begun:  # a length whose first measurement is under way: finish it
            return begun[0]
        for first in (b.start, 0):  # where it starts, then no draft
            if b.steps[first] < self.WARMUP:
                return first
        return b.best()  # a leader whose cost is still interpolated is measured by taking it

    def joined(self, batch: int, n: int) -> None:
        """``n`` requests began generating (their first tokens out) in a batch now of ``batch``.

        Where they are at most :data:`JOIN_PROBE_REQUESTS` and make up at least :data:`JOIN_PROBE` of
        the batch, the longest draft is probed (:data:`PROBE_STEPS` steps) after
        :data:`JOIN_PROBE_AFTER` more plain steps of the bucket, if it then holds no draft after its
        first measurements and took no drafting step meanwhile (that step measured the new text): a
        plain regime measures no acceptance, and the one it was chosen on may be another text's.

        Why after, and why the acceptance measured so far keeps its weight: an answer's first steps
        accept less than its later ones and vary most (on the H100, Spec-Bench at batch 1, DFlash:
        1.0 drafted tokens accepted a step in an answer's first four steps, 1.4 after them; none on
        the first step in half the answers). Probed at once and weighed over the answers before
        (a tenth, in an earlier version), they stopped the gate on answers DFlash drafts at 1.4-2.6x
        plain steps' speed: 1.02x the null drafter against 1.11x with no joins told, in one run.
        """
        if isinstance(batch, bool) or isinstance(n, bool) or not isinstance(batch, int) or not isinstance(n, int):
            raise ValueError(f"batch and n must be ints, got {batch!r} and {n!r}")
        if n < 0 or batch < n:
            raise ValueError(f"{n} requests cannot join a batch of {batch}")
        if n == 0:
            return
        b = self._buckets.get(bucket_of(batch))
        if b is None or n > self.JOIN_PROBE_REQUESTS or n / batch < self.JOIN_PROBE or not self._settled(b):
            return
        b.join_wait = self.JOIN_PROBE_AFTER  # a new text: a probe once its first steps are past

    def _settled(self, b: _Bucket) -> bool:
        """Whether bucket ``b`` is past its first measurements and not probing."""
        return b.probing is None and b.steps[0] >= self.WARMUP and b.steps[b.start] >= self.WARMUP

    def _join_probe(self, b: _Bucket, batch: int) -> None:
        """The probe a join asked for, its wait over: the longest draft, where the bucket holds no
        draft after its first measurements, no probe is under way and it could pay."""
        if not self._settled(b) or self._next(b) != 0 or not self._join_probe_pays(b, batch):
            return
        b.probing, b.probe_left, b.join_probe = len(self.lengths) - 1, self.PROBE_STEPS, True
        b.run, b.run_s, b.probes = 0, 0.0, b.probes + 1

    def _join_probe_pays(self, b: _Bucket, batch: int) -> bool:
        """Whether a probe of the longest draft on a join could pay: its length, every drafted token
        accepted, beats the plain steps' estimate, and its steps' estimated time is at most
        :data:`JOIN_PROBE_SHARE` of the plain steps' since the last probe, halved for each join probe
        in a row after which the bucket still held no draft, down to :data:`PROBE_SHARE` (short
        requests, a propose that costs many plain steps, a drafter that suits no request's text are
        probed less often)."""
        longest = len(self.lengths) - 1
        c, plain = b.step_cost(longest), b.rate(0)
        if c is None or c <= 0 or plain is None:
            return False
        if (1 + self.lengths[longest]) / c <= plain:
            return False
        share = max(self.PROBE_SHARE, self.JOIN_PROBE_SHARE / 2 ** b.join_misses)
        return self.PROBE_STEPS * c * batch <= share * b.run_s

    def draft_length(self, batch: int) -> int:
        """The most tokens each request of a step of ``batch`` generating requests drafts (0: none)."""
        return self.lengths[self._next(self._at(batch))]

    def plain_next(self, batch: int) -> bool:
        """Whether the step after the current one, of ``batch`` requests, will be plain too (no
        draft), the current step being plain and not recorded yet: an overlapped engine then
        launches it before the current one's tokens are known
        (:class:`specdec.executor.OverlapExecutor`).

        A best effort, not a binding promise. It says ``False`` where recording the current step
        is known to be able to change the choice: a probe's or first measurement's last step, a
        probe that fell due and waited on the step promised before this one, no draft
        leading by under :data:`CHAIN_MARGIN` while plain steps do not chain yet (one more
        measured plain step moves its cost; once they chain, a lead of any size will do). A
        wrong yes costs one plain step where the gate would have drafted (outputs never change);
        the step after it asks :meth:`draft_length` again.

        A yes is remembered until the current step is recorded: a probe that falls due then waits
        one step (the promised one), and this method says no on that step, so the probe starts
        after it."""
        b = self._at(batch)
        b.promised = self._plain_next(b, batch)
        return b.promised

    def _plain_next(self, b: _Bucket, batch: int) -> bool:
        """:meth:`plain_next`'s answer for bucket ``b``, remembering nothing."""
        i = self._next(b)
        if i != 0:
            return False
        if b.probing == 0:
            return b.probe_left > 1
        if b.join_wait == 1:  # recording the current step may start a join's probe
            return False
        if b.steps[0] < self.WARMUP:  # its first measurement: plain until its last step
            return b.steps[0] + 1 < self.WARMUP
        if self._due_probe(b, b.run, b.run_s, batch) not in (None, 0):  # a probe of drafts waited on a promise
            return False
        plain = b.rate(0)
        others = [r for j in range(1, len(self.lengths)) if (r := b.rate(j)) is not None]
        if plain is None:
            return False
        if b.chaining:  # chained already: while no draft leads at all (a noisy step does not stop a chain)
            return all(r < plain for r in others)
        return all(r * self.CHAIN_MARGIN <= plain for r in others)

    def record(self, batch: int, length: int, accepted: Sequence[int], seconds: float, ahead: bool = False) -> None:
        """A measured step of ``batch`` requests at draft ``length`` (from :meth:`draft_length`, or 0
        for a step launched ahead on :meth:`plain_next`): each request's accepted drafted tokens, the
        step's wall time, and whether it was launched ahead of the last (``ahead``: chained; its
        cost is kept apart, see :meth:`_Bucket.plain_rate`)."""
        if not seconds > 0 or length not in self.lengths or not accepted:
            return
        b = self._at(batch)
        i = self.lengths.index(length)
        # what an overlapped engine heard during this step (needed only to see it decline a chain)
        would = i == 0 and bool(b.chained) and self._plain_next(b, batch)
        promised, b.promised = b.promised, False
        b.steps[i] += 1
        b.chained_steps += ahead and i == 0
        b.measured(i, seconds / len(accepted), ahead and i == 0, len(accepted))
        self._recorded += 1
        window = b.chained if ahead and i == 0 else b.cost[i]
        if len(window) < self.WINDOW or self._recorded % self.WINDOW == 0:  # medians of full windows move slowly
            self._exponents.clear()
        b.would_promise = would
        self._acceptance.add(i, accepted)
        for other in self._buckets.values():  # every bucket's estimates read the new acceptance
            other.stale()
        if self.history is not None:
            self.history.append(GateStep(batch, length, bool(ahead and i == 0), seconds, sum(accepted),
                                         self.lengths[b.best()]))
        if i == b.probing:
            b.probe_left -= 1
            if not b.probe_left:
                b.probing = None
                if b.join_probe:  # did the joined text make drafting pay?
                    b.join_probe = False
                    b.join_misses = 0 if b.best() != 0 else b.join_misses + 1
            return
        if i:  # a drafting step measured the joined text: no probe needed for it
            b.join_wait = 0
        elif b.join_wait:
            b.join_wait -= 1
            if not b.join_wait:
                self._join_probe(b, batch)
                if b.probing is not None:
                    return
        if self._next(b) == i:  # exploiting: count towards the next probe
            b.run += 1
            b.run_s += seconds
            want = self._due_probe(b, b.run, b.run_s, len(accepted))
            if want is not None and not (promised and want != i):  # a promised plain step comes first
                b.run, b.run_s, b.probes = 0, 0.0, b.probes + 1
                if want != i and not (want == 0 and self._far_behind(b, i)):
                    b.probing, b.probe_left = want, self.PROBE_STEPS

    def _due_probe(self, b: _Bucket, run: int, run_s: float, n: int) -> int | None:
        """The length (an index) the bucket's next probe measures, the longest and no draft in turn
        (the longest always where the bucket holds no draft), if one is due after ``run`` steps of
        the chosen length that took ``run_s`` seconds (``n``
        requests a step); ``None`` while none is: before :data:`PROBE_EVERY` steps, and until the
        probe's estimated time is at most :data:`PROBE_SHARE` of ``run_s`` and its estimated loss
        (that time, times how far its length's estimate is behind the chosen one's) at most
        :data:`PROBE_LOSS` of it."""
        longest = len(self.lengths) - 1
        want = longest if b.probes % 2 == 0 or b.best() == 0 else 0  # holding no draft: no use probing it
        if run < self.PROBE_EVERY:
            return None
        probe_s = self.PROBE_STEPS * (b.step_cost(want) or 0.0) * n
        if run_s * self.PROBE_SHARE < probe_s:
            return None
        probed, chosen = b.rate(want), b.rate(b.best())
        behind = 1.0 - probed / chosen if probed is not None and chosen else 1.0
        return want if run_s * self.PROBE_LOSS >= probe_s * max(0.0, behind) else None

    def _far_behind(self, b: _Bucket, i: int) -> bool:
        """Whether no draft's estimate is under :data:`NO_DRAFT_PROBE_WITHIN` of length ``i``'s: a
        plain step accepts nothing by definition and its cost barely moves, so a probe of it would
        only cost tokens. If the drafter's acceptance falls, length ``i``'s own steps show it and the
        estimates meet again."""
        plain, chosen = b.rate(0), b.rate(i)
        return plain is not None and chosen is not None and plain < self.NO_DRAFT_PROBE_WITHIN * chosen

    def stats(self) -> dict:
        """Per bucket (keyed by its batch sizes, e.g. ``"5-8"``): ``draft_length``, the length its
        steps take now; per length measured, ``steps`` and ``tok_s`` (its estimated tokens per
        second, ``(1 + A) / c``: tokens per request over seconds per request; for no draft, that of
        the plain steps the gate would run, :meth:`_Bucket.plain_rate`; without the optimism its
        choice adds, so a length known from few request-steps may be chosen over a higher figure
        here); per length with acceptance
        measured, ``accepted`` (``A``, accepted drafted tokens per request, the same in every bucket:
        it is measured over all of them); ``chained``, the plain steps launched ahead of the last;
        ``probes``, the probes so far."""
        out = {}
        for k in sorted(self._buckets):
            b = self._buckets[k]
            if not any(b.steps):  # asked, never measured (its steps ran prompt tokens)
                continue
            rates = {n: b.rate(i, optimistic=False) for i, n in enumerate(self.lengths) if b.steps[i]}
            out[bucket_label(k)] = {
                "draft_length": self.lengths[b.best()],
                "steps": {n: s for n, s in zip(self.lengths, b.steps) if s},
                "tok_s": {n: r for n, r in rates.items() if r is not None},
                "accepted": {n: a for i, n in enumerate(self.lengths)
                             if i and (a := self._acceptance.mean(i)) is not None},
                "chained": b.chained_steps,
                "probes": b.probes}
        return out
