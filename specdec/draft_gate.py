"""Whether a step drafts at all: the arm with more measured tokens per second at this batch size.

A drafter pays for itself when a drafting step emits more tokens per second of its time (the
propose, the wider verify, the drafter's bookkeeping) than a plain step. That depends on the batch
size: on a small target a learned drafter's propose costs about a target step, which accepted
tokens repay at batch 1 but not at batch 32, where the target's step is already efficient and the
propose grows with the batch (on the H100, SmolLM2-135M, round-7 DFlash: 1.66x the null drafter's
tokens/s at batch 1, 0.75x at batch 32; BENCHMARKS.md). A serving engine's batch moves between
those all day, and a long ``generate`` ends with a shrinking batch.

:class:`DraftGate` treats it as a two-armed choice per batch-size bucket (1, 2, 3-4, 5-8, ...):
it keeps the tokens per second of the last :data:`~DraftGate.WINDOW` measured steps of each arm
(drafting, plain) and takes the arm whose median is higher. A new bucket measures each arm
:data:`~DraftGate.WARMUP` steps first (drafting first); afterwards, every
:data:`~DraftGate.PROBE_EVERY` steps of the chosen arm, the other one is measured afresh over
:data:`~DraftGate.PROBE_STEPS` steps, so a change (longer contexts, text the drafter suits) is
seen. Medians keep a one-off (a graph capture, a compile, the context a block drafter writes at
its first propose after plain steps) from deciding.

Lossless whatever it decides: a plain step is the null drafter's step, and the drafter keeps
hearing every accepted token (``on_accepted``, ``on_contexts``), so it drafts from the right
context when it is asked again. Only steps without prompt tokens are measured (a prompt chunk's
compute would swamp the comparison).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

__all__ = ["DraftGate", "bucket_label", "bucket_of"]


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


@dataclass
class _Bucket:
    rates: dict = field(default_factory=lambda: {True: deque(maxlen=DraftGate.WINDOW),
                                                 False: deque(maxlen=DraftGate.WINDOW)})
    steps: dict = field(default_factory=lambda: {True: 0, False: 0})
    run: int = 0  # measured steps of the chosen arm since the other was last measured
    probing: bool | None = None  # the arm being measured afresh (a probe), if any
    probe_left: int = 0  # its steps still to measure
    probes: int = 0

    def median(self, arm: bool) -> float | None:
        return statistics.median(self.rates[arm]) if self.rates[arm] else None

    def best(self) -> bool:
        """The arm with the higher median rate (drafting on a tie)."""
        return self.median(True) >= self.median(False)


class DraftGate:
    """Per batch-size bucket, whether drafting steps or plain steps emit more tokens per second.

    The engine asks :meth:`wants_draft` before it schedules a step (a plain step reserves and
    verifies no draft slots and skips the propose) and reports the step with :meth:`record` when
    it ran no prompt tokens.
    """

    #: measured steps per arm whose median decides
    WINDOW = 8
    #: steps each arm is measured in a new bucket before the medians decide
    WARMUP = 3
    #: steps of the chosen arm between two measurements of the other
    PROBE_EVERY = 64
    #: steps of the other arm each such measurement takes (its window starts afresh)
    PROBE_STEPS = 3

    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}

    def wants_draft(self, batch: int) -> bool:
        """Whether a step of ``batch`` generating requests should draft."""
        b = self._buckets.get(bucket_of(batch))
        if b is None or b.steps[True] < self.WARMUP:
            return True
        if b.steps[False] < self.WARMUP:
            return False
        return b.probing if b.probing is not None else b.best()

    def record(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A measured step: ``batch`` requests, whether it drafted, the tokens it emitted and its
        wall time."""
        if not seconds > 0 or tokens < 0:
            return
        b = self._buckets.setdefault(bucket_of(batch), _Bucket())
        warm = b.steps[True] >= self.WARMUP and b.steps[False] >= self.WARMUP
        b.steps[drafted] += 1
        if b.probing is not None and drafted == b.probing:
            if b.probe_left == self.PROBE_STEPS:  # the probe's first step: this arm is measured afresh
                b.rates[drafted].clear()
            b.rates[drafted].append(tokens / seconds)
            b.probe_left -= 1
            if not b.probe_left:
                b.probing = None
            return
        b.rates[drafted].append(tokens / seconds)
        if warm and drafted == b.best():
            b.run += 1
            if b.run >= self.PROBE_EVERY:
                b.run, b.probing, b.probe_left = 0, not drafted, self.PROBE_STEPS
                b.probes += 1

    def stats(self) -> dict:
        """Per bucket (keyed by its batch sizes, e.g. ``"5-8"``): measured drafting and plain steps,
        each arm's median tokens/s (``None`` until measured), the arm chosen now, and the probes."""
        out = {}
        for k in sorted(self._buckets):
            b = self._buckets[k]
            out[bucket_label(k)] = {"drafted_steps": b.steps[True], "plain_steps": b.steps[False],
                                    "draft_tok_s": b.median(True), "plain_tok_s": b.median(False),
                                    "drafting": (b.best() if b.rates[True] and b.rates[False] else True),
                                    "probes": b.probes}
        return out
