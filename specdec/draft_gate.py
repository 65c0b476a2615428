"""How many tokens a step drafts, none included: the length with the most measured tokens per
second at this batch size.

A drafter pays for itself when a drafting step emits more tokens per second of its time (the
propose, the wider verify, the drafter's bookkeeping) than a plain step. That depends on the batch
size: on a small target a learned drafter's propose costs about a target step, which accepted
tokens repay at batch 1 but not at batch 32, where the target's step is already efficient and
each drafted token adds a verified row per request (on the H100, SmolLM2-135M, round-7 DFlash:
1.66x the null drafter's tokens/s at batch 1, 0.75x at batch 32; BENCHMARKS.md). The best length
moves too: a row's last drafted tokens are accepted least often, and the rows they add cost most
where the batch is large. A serving engine's batch moves all day, and a long ``generate`` ends
with a shrinking batch.

:class:`DraftGate` treats it as a choice among draft lengths (``0, 1, 2, 4, ..., max``; 0 is a
plain step, with no propose) per batch-size bucket (1, 2, 3-4, 5-8, ...), made by climbing:

- it keeps the last :data:`~DraftGate.WINDOW` measured steps of each length and takes the length
  whose steps emitted the most tokens per second of their time (tokens over seconds: a step's
  tokens vary a lot, a suffix draft is often all accepted or none; a step slower than
  :data:`~DraftGate.OUTLIER` times the window's median, a graph capture or a compile, is left out);
- a new bucket measures :data:`~DraftGate.WARMUP` steps of the length its nearest measured bucket
  chose (the longest where there is none: what the engine does without the gate), then of the two
  ends, no draft and the longest (a propose's cost is mostly fixed: no draft often differs most
  from any drafting length), then of each unmeasured neighbour (the next shorter or longer length)
  of whichever length leads, until the leader's neighbours are measured;
- every :data:`~DraftGate.PROBE_EVERY` steps of the chosen length, its neighbours and, in turn, the
  longest draft or no draft are measured afresh over :data:`~DraftGate.PROBE_STEPS` steps each, so
  a change (longer contexts, text the drafter suits) is followed.

Lossless whatever it decides: a shorter draft is a prefix of the drafter's, a plain step is the
null drafter's step, and the drafter keeps hearing every accepted token (``on_accepted``,
``on_contexts``), so it drafts from the right context when it is asked again. Only steps without
prompt tokens are measured (a prompt chunk's compute would swamp the comparison).
"""

from __future__ import annotations

import statistics
from collections import deque

__all__ = ["DraftGate", "bucket_label", "bucket_of", "draft_lengths"]


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


class _Bucket:
    """One batch-size bucket's measurements: per length (an index into the gate's lengths)."""

    def __init__(self, n: int, start: int) -> None:
        self.samples = [deque(maxlen=DraftGate.WINDOW) for _ in range(n)]  # (tokens, seconds) per step
        self.steps = [0] * n
        self.start = start  # the length measured first
        self.leader = start  # the length that led at the last measured step
        self.run = 0  # measured steps of the leader since it took the lead or was last probed around
        self.probing: list[int] = []  # lengths still to measure afresh, in order
        self.probe_left = 0  # steps of the first of them still to measure
        self.probes = 0

    def rate(self, i: int) -> float | None:
        """Length ``i``'s tokens per second over its window: tokens over seconds, without the steps
        that took over :data:`DraftGate.OUTLIER` times the window's median step time (a compile,
        a capture); ``None`` before it was measured."""
        window = self.samples[i]
        if not window:
            return None
        cut = DraftGate.OUTLIER * statistics.median(t for _, t in window)
        kept = [(n, t) for n, t in window if t <= cut]
        return sum(n for n, _ in kept) / sum(t for _, t in kept)

    def best(self) -> int:
        """The measured length with the highest rate (the longer on a tie); ``start`` before any."""
        measured = [i for i, w in enumerate(self.samples) if w]
        if not measured:
            return self.start
        return max(measured, key=lambda i: (self.rate(i), i))


class DraftGate:
    """Per batch-size bucket, the draft length (0: a plain step) with the most tokens per second.

    The engine asks :meth:`draft_length` before it schedules a step (its requests draft at most that
    many tokens; at 0 the step reserves and verifies no draft slots and skips the propose) and
    reports the step with :meth:`record` when it ran no prompt tokens.

    Args:
        max_draft: the longest draft (the engine's ``max_draft_tokens``), >= 1.
    """

    #: measured steps per length whose tokens over seconds decide (a step's tokens vary a lot: a
    #: suffix draft is often all accepted or none)
    WINDOW = 16
    #: a step that took this many times its window's median time is a one-off, left out
    OUTLIER = 4.0
    #: steps a length is measured before it competes, the first time
    WARMUP = 4
    #: steps of the chosen length between two probes (:meth:`_probed`)
    PROBE_EVERY = 96
    #: steps each probed length is measured afresh (its window starts anew)
    PROBE_STEPS = 4

    def __init__(self, max_draft: int) -> None:
        self.lengths = draft_lengths(max_draft)
        self._buckets: dict[int, _Bucket] = {}

    def _bucket(self, key: int) -> _Bucket:
        b = self._buckets.get(key)
        if b is None:  # start where the nearest measured bucket settled (the longest draft if none)
            measured = [k for k, m in self._buckets.items() if any(m.steps)]
            near = min(measured, key=lambda k: (abs(k - key), k), default=None)
            start = self._buckets[near].best() if near is not None else len(self.lengths) - 1
            b = self._buckets[key] = _Bucket(len(self.lengths), start)
        return b

    def _next(self, b: _Bucket) -> int:
        """The length the bucket's next step takes (an index)."""
        if b.probing:
            return b.probing[0]
        begun = [i for i, n in enumerate(b.steps) if 0 < n < self.WARMUP]
        if begun:  # a length whose first measurement is under way: finish it
            return begun[0]
        for first in (b.start, 0, len(self.lengths) - 1):  # where it starts, then the two ends
            if b.steps[first] < self.WARMUP:
                return first
        best = b.best()
        for n in (best - 1, best + 1):  # then climb: an unmeasured neighbour of the best
            if 0 <= n < len(self.lengths) and b.steps[n] < self.WARMUP:
                return n
        return best

    def _probed(self, b: _Bucket, best: int) -> list[int]:
        """The lengths measured afresh in a probe: the best's neighbours and, in turn, the longest
        draft or no draft (a length measured once long ago is not left out for good); from no
        draft, also the best drafting length."""
        last = len(self.lengths) - 1
        want = [best - 1, best + 1, last if b.probes % 2 == 0 else 0]
        if not best:
            drafting = [i for i in range(1, len(self.lengths)) if b.samples[i]]
            want.append(max(drafting, key=lambda i: (b.rate(i), i), default=1))
        return [n for n in dict.fromkeys(want) if 0 <= n <= last and n != best]

    def draft_length(self, batch: int) -> int:
        """The most tokens each request of a step of ``batch`` generating requests drafts (0: none)."""
        return self.lengths[self._next(self._bucket(bucket_of(batch)))]

    def record(self, batch: int, length: int, tokens: int, seconds: float) -> None:
        """A measured step: ``batch`` requests, the draft length it was given (from
        :meth:`draft_length`), the tokens it emitted and its wall time."""
        if not seconds > 0 or tokens < 0 or length not in self.lengths:
            return
        b = self._bucket(bucket_of(batch))
        i = self.lengths.index(length)
        b.steps[i] += 1
        if b.probing and i == b.probing[0]:
            if b.probe_left == self.PROBE_STEPS:  # the probe's first step: this length is measured afresh
                b.samples[i].clear()
            b.samples[i].append((tokens, seconds))
            b.probe_left -= 1
            if not b.probe_left:
                b.probing.pop(0)
                b.probe_left = self.PROBE_STEPS if b.probing else 0
            return
        b.samples[i].append((tokens, seconds))
        best = b.best()
        if best != b.leader:  # a new leader: its probes count from now
            b.leader, b.run = best, 0
        if i == best and self._next(b) == best:  # exploiting: count towards the next probe
            b.run += 1
            if b.run >= self.PROBE_EVERY:
                b.run = 0
                b.probing = self._probed(b, best)
                b.probe_left = self.PROBE_STEPS
                b.probes += 1

    def stats(self) -> dict:
        """Per bucket (keyed by its batch sizes, e.g. ``"5-8"``): ``draft_length``, the length its
        steps take now; ``steps`` and ``tok_s``, per length measured, the steps and the tokens per
        second of its window (:meth:`_Bucket.rate`); ``probes``, the probes so far."""
        out = {}
        for k in sorted(self._buckets):
            b = self._buckets[k]
            if not any(b.steps):  # asked, never measured (its steps ran prompt tokens)
                continue
            out[bucket_label(k)] = {
                "draft_length": self.lengths[b.best()],
                "steps": {n: s for n, s in zip(self.lengths, b.steps) if s},
                "tok_s": {n: b.rate(i) for i, n in enumerate(self.lengths) if b.samples[i]},
                "probes": b.probes}
        return out
