"""How steps follow each other on the device: one after the other, or overlapped.

The engine's step is the same whichever strategy runs it (schedule, propose, run, verify,
commit; :meth:`specdec.engine.SpecEngine.step`). A strategy only decides two things:

- whether the step was already launched by the step before it (:meth:`take_launched`);
- what to launch before waiting for this step's tokens (:meth:`launched`).

:class:`PlainExecutor` launches nothing ahead. :class:`OverlapExecutor` launches the next
decode step before the current one's tokens reach the host, its input tokens copied on the
device, so the host's work between steps overlaps the GPU. Only plain steps chain (no
request drafts in either step): the next step's input is this step's one token per request.
So it needs an engine whose plain steps come in runs: a drafter that never drafts
(``Drafter.never_drafts``, or ``max_draft_tokens=0``), or the draft gate
(``EngineConfig.draft_gate``), while it holds a batch size at no draft;
:func:`overlap_wanted` refuses any other with the reason.
"""

from __future__ import annotations

import time

import torch

from specdec.errors import ConfigError
from specdec.scheduler import Scheduler, StepPlan
from specdec.sequence import Status


class PlainExecutor:
    """Each step is scheduled, launched and finished before the next one starts."""

    name = "plain"

    def take_launched(self) -> StepPlan | None:
        """The step launched by the previous one, if any (never, here)."""
        return None

    def launched(self, plan: StepPlan) -> None:
        """Called once ``plan``'s forward is queued, before the host waits for it."""

    def ahead_ids(self) -> frozenset[str]:
        """Requests that hold a cache slot for a step launched ahead (none here)."""
        return frozenset()

    def settle(self) -> None:
        """Called after the step's commit."""

    def reset(self) -> None:
        """Forget any step in flight (after a failed step, or on close)."""

    @property
    def in_flight(self) -> bool:
        """Whether a step launched ahead is in flight."""
        return False


class OverlapExecutor(PlainExecutor):
    """Launch the next decode step before the current one's tokens reach the host.

    Only when nothing but this step's tokens could change the next step: a plain
    generation-only step (no request drafted) of every running request, the gate (if any)
    leaving the next one plain too, none waiting to be admitted, none preempted, and none that
    ends at this step by its length limits (an end of sequence or a stop string is seen only
    afterwards: the next step's token for that request is then dropped). Each request takes
    one more cache slot (:meth:`Scheduler.plan_ahead`); its input token is this step's token
    (argmax or seeded sample), copied on the device. Sampled requests overlap too: their
    noise is drawn from their seed and the position (:mod:`specdec.sampling`), both known
    before this step's tokens are.

    A drafter that reads the target's hidden states (``on_contexts``) still hears every step:
    the step's hidden states are copied on the device before the next step is queued (a graph
    replays into the same output buffer), and its commit hands the copy on.

    Args:
        scheduler: the engine's scheduler (it lays the step out and reserves its slots).
        runner: the engine's model runner (it launches the step).
        max_context: the target's context limit.
        timings: the engine's timing counters (``host_s``, ``forward_s``, ``overlapped_steps``).
        gate: the engine's draft gate (:class:`specdec.draft_gate.DraftGate`), or ``None`` (a
            drafter that never drafts): a step is launched ahead only where the gate leaves it
            plain (:meth:`~specdec.draft_gate.DraftGate.plain_next`).
    """

    name = "overlap"

    def __init__(self, scheduler: Scheduler, runner, max_context: int, timings: dict, gate=None):
        self.scheduler, self.runner, self.max_context, self.timings = scheduler, runner, max_context, timings
        self.gate = gate
        self._ahead: StepPlan | None = None

    def take_launched(self) -> StepPlan | None:
        """The decode step launched by the previous step, without the requests that ended since
        (aborted, or ended by that step: their rows are dropped once it is finished); ``None``
        when there is none or none of its requests still runs."""
        plan, self._ahead = self._ahead, None
        if plan is None:
            return None
        keep = [i for i, s in enumerate(plan.generation) if s.status is Status.RUNNING]
        if len(keep) == len(plan.generation):
            return plan
        result = self.runner.finish(plan.result)
        if not keep:
            return None
        result.argmax = [result.argmax[i] for i in keep]
        seqs = [plan.generation[i] for i in keep]
        n = len(seqs)
        # token_starts keep indexing the launched step's tokens (its hidden rows); verified rows are the kept ones
        return StepPlan(generation=seqs, budgets=[0] * n, drafts=[plan.drafts[i] for i in keep], fed=[1] * n,
                        token_starts=[plan.token_starts[i] for i in keep], row_starts=list(range(n)),
                        inputs=plan.inputs, result=result)

    def launched(self, plan: StepPlan) -> None:
        """Launch the decode step after ``plan`` now, where nothing but ``plan``'s tokens could change it."""
        result, seqs = plan.result, plan.generation
        if (plan.context or not seqs or self.scheduler.waiting or plan.preempted or any(plan.budgets)
                or len(seqs) != len(self.scheduler.running)  # a request left out now would wait while steps chain
                or not isinstance(result.argmax, torch.Tensor) or len(result.argmax) != len(seqs)):
            return
        for seq in seqs:
            if seq.num_output + 1 >= seq.params.max_new_tokens or len(seq.tokens) + 2 > self.max_context:
                return
        if self.gate is not None and not self.gate.plain_next(len(seqs)):
            return
        t0 = time.perf_counter()
        ahead = self.scheduler.plan_ahead(plan)
        t1 = time.perf_counter()
        self.timings["host_s"] += t1 - t0
        if ahead is None:
            return
        if result.hidden is not None:  # the drafter reads them at this step's commit, after the next is queued
            result.hidden = result.hidden.clone()
        ahead.result = self.runner.launch(ahead.inputs, ids_from=result.argmax)
        self.timings["forward_s"] += time.perf_counter() - t1
        self.timings["overlapped_steps"] += 1
        self._ahead = ahead

    def ahead_ids(self) -> frozenset[str]:
        return frozenset(s.req_id for s in self._ahead.generation) if self._ahead is not None else frozenset()

    def settle(self) -> None:
        """Drop the step launched ahead if every request of it ended at this step (nothing reads it)."""
        if self._ahead is not None and not any(s.status is Status.RUNNING for s in self._ahead.generation):
            self.runner.finish(self._ahead.result)
            self._ahead = None

    def reset(self) -> None:
        """Forget the step in flight, after waiting for it (its graphs and buffers may be released
        next); an error from that step is not raised again here."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.result is not None:
            try:
                self.runner.finish(ahead.result)
            except Exception:
                pass

    @property
    def in_flight(self) -> bool:
        return self._ahead is not None


def overlap_wanted(overlap_steps: bool | None, never_drafts: bool, device_type: str, drafter_name: str,
                   max_draft_tokens: int, helix_cp: int = 1, draft_gate: bool = False) -> bool:
    """Whether ``EngineConfig.overlap_steps`` asks for :class:`OverlapExecutor` (else :class:`PlainExecutor`).

    Args:
        overlap_steps: ``True`` (required), ``False`` (off) or ``None`` (where it helps: on CUDA,
            with a drafter that never drafts or with the draft gate; on the CPU a forward runs
            synchronously anyway).
        never_drafts: the drafter never proposes a token (or ``max_draft_tokens`` is 0).
        device_type: the target's device type.
        drafter_name, max_draft_tokens: named in the error.
        helix_cp: Helix ranks; overlapped steps are not offered under Helix (its steps run
            eagerly, with collectives in every layer; chaining them is untested).
        draft_gate: the engine has a draft gate (``EngineConfig.draft_gate`` with a drafter that
            drafts): the steps it leaves plain chain.

    Raises:
        ConfigError: ``overlap_steps=True`` with a drafter that drafts and no draft gate (its
            proposals need each step's accepted tokens, so the next step cannot be launched before
            they are known), or with ``helix_cp > 1``.
    """
    if overlap_steps and helix_cp > 1:
        raise ConfigError(f"overlap_steps=True is not supported with helix_cp={helix_cp} (Helix steps run eagerly, "
                          "with collectives in every layer); use overlap_steps=None or False")
    if overlap_steps and not (never_drafts or draft_gate):
        raise ConfigError("overlap_steps=True needs a drafter that never drafts (the null drafter or "
                          f"max_draft_tokens=0) or draft_gate=True; got {drafter_name} with "
                          f"max_draft_tokens={max_draft_tokens}: its proposals need each step's accepted tokens")
    auto = overlap_steps is None and device_type == "cuda" and helix_cp == 1
    return bool(overlap_steps or auto) and (never_drafts or draft_gate)
