"""A learned block drafter and the suffix drafter side by side: each step, each request takes
the draft with more expected accepted tokens.

The two fail in different places. The suffix drafter is right where the text repeats (code that
echoes its prompt, lists, quotes) and proposes nothing elsewhere; a block drafter proposes
everywhere but, conditioned only on the target's hidden states, is less sure of long spans.
Both give each drafted token a confidence, the probability that it is accepted given that the
ones before it were: DSpark's confidence head (trained jointly with the drafter) and the suffix
drafter's :func:`~specdec.drafters.suffix_automaton.token_confidence` (a logistic model of the
match length and continuation counts, fitted on training data). The expected number of accepted
tokens of a chain with confidences ``c_1 .. c_k`` is ``c_1 + c_1 c_2 + ... + c_1 ... c_k``;
:func:`expected_accepted` computes it and :class:`HybridDrafter` keeps, per request, the draft
where it is larger by the drafters' own estimates (the learned one on ties). The rule was fixed
before any measurement, not tuned.

The learned propose costs about as much as a target step on a small target, so it is asked only
for requests whose suffix draft it could beat: where the suffix draft's expected accepted tokens
are below the most any learned draft has scored so far (repetitive text, where the suffix draft is
long and sure, never pays for it). A request left out keeps its context positions staged for the
learned drafter's next propose (:mod:`specdec.drafters.dflash`), so leaving it out costs no
extra write until the positions outgrow what that propose writes in its graph.

Lossless whatever it picks: the target verifies every draft. The KV and hidden-state hooks are
the learned drafter's (the suffix drafter has no KV layers and reads only token ids).
"""

from __future__ import annotations

import time
import warnings
from typing import Callable, Sequence

from specdec.drafters.base import Draft, Drafter, register_drafter
from specdec.errors import ConfigError


def expected_accepted(draft: Draft, default: float) -> float:
    """Expected accepted tokens of a chain draft: ``sum_i prod_{j <= i} c_j``.

    Args:
        draft: the draft; its ``confidence`` (``[k]`` in [0, 1]) or, where it has none,
            ``default`` for every token.
        default: the per-token confidence assumed for a draft without one.
    """
    conf = draft.confidence if draft.confidence is not None else (default,) * len(draft)
    total, p = 0.0, 1.0
    for c in conf:
        p *= c
        total += p
    return total


def _forwarded(drafter: str, name: str, default=None) -> property:
    """The attribute ``name`` of ``self.<drafter>``: read (``default`` where it has none) and, for a
    setting (no default), written through."""
    def get(self):
        return getattr(getattr(self, drafter), name, default)

    def set_(self, value) -> None:
        setattr(getattr(self, drafter), name, value)

    return property(get, set_ if default is None else None, doc=f"``{drafter}.{name}``")


@register_drafter("hybrid")
class HybridDrafter(Drafter):
    """DSpark (or any block drafter) beside the suffix drafter; per request and step, the draft
    with more expected accepted tokens (:func:`expected_accepted`) is proposed.

    Args:
        learned: the block drafter (default: the shipped DSpark, whose confidence head scores
            its drafts). Its hooks (KV layers, hidden states, ``shift_label``) are this drafter's.
        suffix: the suffix drafter (default: ``SuffixAutomatonDrafter()``).
        default_confidence: per-token confidence assumed for a draft that carries none (a
            learned drafter without a confidence head, e.g. DFlash), in ``[0, 1]``.
        torch_compile: set the learned drafter's ``torch_compile`` (its propose compiled, see
            :class:`~specdec.drafters.dflash.BlockDrafter`); ``None`` leaves it as it is.
        device_drafts: set the learned drafter's ``device_drafts`` (its drafts left on the device,
            see :class:`~specdec.drafters.dflash.BlockDrafter`); ``None`` leaves it as it is.
        cost_aware: ask the learned drafter only in steps where the tokens it is expected to add
            pay for its time (:meth:`worth_asking`), instead of wherever it could win. On by default:
            on the GPU it ran 1.06x (batch 1) and 1.18x (batch 8) the tokens/s of ``cost_aware=False``
            (BENCHMARKS.md); ``False`` asks wherever the learned draft could win.
        clock: the clock ``cost_aware`` times steps and proposes with (seconds; tests pass their own).

    ``stats`` counts the drafts taken from each (``"learned"``, ``"suffix"``), the requests for
    which neither drafted (``"none"``), the requests whose suffix draft scored at least
    :attr:`learned_best` so the learned drafter was not asked (``"learned_skipped"``), and the
    proposes in which it raised
    (``"learned_errors"``: those steps take the suffix drafts, with a warning the first time).
    ``cuda_graphs`` and ``torch_compile`` are the learned drafter's settings; ``global_tokens`` and
    ``global_rebuilds`` the suffix drafter's figures. With ``cost_aware``, ``"learned_declined"``
    counts the requests of steps where asking was judged not worth its time.

    Raises:
        ConfigError: ``learned`` reads no target hidden states, ``suffix`` has KV layers, or
            ``default_confidence`` is outside ``[0, 1]``, or ``torch_compile`` is given for a
            learned drafter that has no such setting.
    """

    #: steps whose time and learned drafts :attr:`cost_aware` measures before it starts to decline
    WARMUP_STEPS = 8
    #: weight of the newest measurement in the running averages of ``cost_aware``
    SMOOTHING = 0.1
    #: after this many declined steps in a row the learned drafter is asked anyway (its figures are
    #: measured afresh: a slow first propose, or a change of batch, must not shut it out for good)
    PROBE_EVERY = 32
    #: a gap between proposes longer than this many average steps is idle time, not a step: not counted
    IDLE_FACTOR = 10.0

    def __init__(self, learned: Drafter | None = None, suffix: Drafter | None = None,
                 default_confidence: float = 0.6, torch_compile: bool | None = None, cost_aware: bool = True,
                 clock: Callable[[], float] = time.perf_counter, device_drafts: bool | None = None):
        from specdec.drafters.dflash import DSparkDrafter
        from specdec.drafters.suffix_automaton import SuffixAutomatonDrafter

        learned = DSparkDrafter() if learned is None else learned
        suffix = SuffixAutomatonDrafter() if suffix is None else suffix
        if not learned.target_layer_ids:
            raise ConfigError(f"learned must be a drafter conditioned on the target (a block drafter), "
                              f"got {type(learned).__name__}")
        if suffix.kv_layer_specs() or suffix.target_layer_ids:
            raise ConfigError(f"suffix must be a model-free drafter (no KV layers, no hidden states), "
                              f"got {type(suffix).__name__}")
        if not isinstance(default_confidence, (int, float)) or not 0.0 <= default_confidence <= 1.0:
            raise ConfigError(f"default_confidence must be a float in [0, 1], got {default_confidence!r}")
        if torch_compile is not None:
            if not hasattr(learned, "torch_compile"):
                raise ConfigError(f"torch_compile: {type(learned).__name__} has no compiled propose")
            learned.torch_compile = torch_compile
        if device_drafts is not None:
            if not hasattr(learned, "device_drafts"):
                raise ConfigError(f"device_drafts: {type(learned).__name__} has no such setting")
            learned.device_drafts = device_drafts
        self.learned, self.suffix, self.default_confidence = learned, suffix, float(default_confidence)
        self.shift_label = learned.shift_label
        self.reads_helix_sharded_ctx_pages = learned.reads_helix_sharded_ctx_pages
        self.vocab_size = learned.vocab_size
        self.target_layer_ids = learned.target_layer_ids
        if not isinstance(cost_aware, bool):
            raise ConfigError(f"cost_aware must be True or False, got {cost_aware!r}")
        self.cost_aware, self._clock = cost_aware, clock
        self.stats = {"learned": 0, "suffix": 0, "none": 0, "learned_errors": 0, "learned_skipped": 0,
                      "learned_declined": 0}
        #: running averages (only with ``cost_aware``): seconds of a step without the learned propose,
        #: seconds of the learned propose, expected accepted tokens of a learned draft; ``None`` until measured
        self.step_s: float | None = None
        self.learned_s: float | None = None
        self.learned_mean: float | None = None
        self._last_call: float | None = None  # when the previous propose began
        self._last_learned_s = 0.0  # the learned propose's time within the previous call
        self._steps = 0  # proposes so far
        self._declined_run = 0  # steps declined in a row
        self._idle_run = 0  # gaps between proposes in a row too long to be steps
        #: the most expected accepted tokens any learned draft has scored (``None``: none drafted
        #: yet, so every request asks the learned drafter); a suffix draft scoring at least this
        #: is taken without asking it
        self.learned_best: float | None = None

    # -- settings and figures of the two drafters -------------------------------------
    cuda_graphs = _forwarded("learned", "cuda_graphs")
    torch_compile = _forwarded("learned", "torch_compile")
    device_drafts = _forwarded("learned", "device_drafts")
    global_tokens = _forwarded("suffix", "global_tokens", 0)
    global_rebuilds = _forwarded("suffix", "global_rebuilds", 0)

    # -- hooks: the learned drafter's ---------------------------------------------
    def kv_layer_specs(self):
        return self.learned.kv_layer_specs()

    def reads_managed_ctx_pages(self, tokens_per_block: int) -> bool:
        return self.learned.reads_managed_ctx_pages(tokens_per_block)

    # -- lifecycle: both ------------------------------------------------------------
    def bind(self, target, kv) -> None:
        self.learned.bind(target, kv)
        self.suffix.bind(target, None)

    def start_request(self, req_id: str, prompt_token_ids: Sequence[int]) -> None:
        self.learned.start_request(req_id, prompt_token_ids)
        self.suffix.start_request(req_id, prompt_token_ids)

    def on_context(self, req_id: str, start: int, hidden) -> None:
        self.learned.on_context(req_id, start, hidden)

    def on_contexts(self, spans, hidden) -> None:
        self.learned.on_contexts(spans, hidden)

    def on_accepted(self, req_id: str, token_ids: Sequence[int]) -> None:
        self.learned.on_accepted(req_id, token_ids)
        self.suffix.on_accepted(req_id, token_ids)

    def stop_request(self, req_id: str) -> None:
        try:
            self.learned.stop_request(req_id)
        finally:  # the suffix drafter forgets it (and indexes its response) whatever the other did
            self.suffix.stop_request(req_id)

    def abort_request(self, req_id: str) -> None:
        try:
            self.learned.abort_request(req_id)
        finally:
            self.suffix.abort_request(req_id)

    def overlap(self) -> None:
        self.learned.overlap()
        self.suffix.overlap()

    def capture_graphs(self, max_requests: int, max_context: int) -> int:
        return self.learned.capture_graphs(max_requests, max_context)

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.SMOOTHING * (new - old)

    def _time_step(self) -> None:
        """``cost_aware``: the time since the previous propose, less its learned propose, into
        :attr:`step_s` (a gap of over ``IDLE_FACTOR`` steps is idle time, unless three come in a row)."""
        now = self._clock()
        if self._last_call is not None:
            spent = self._last_learned_s
            if spent:  # drafts left on the device: the propose cost the step its device time (done by now)
                spent = max(spent, self._learned_device_s())
            gap = max(now - self._last_call - spent, 0.0)
            if self.step_s is None or gap <= self.IDLE_FACTOR * self.step_s:
                self.step_s, self._idle_run = self._average(self.step_s, gap), 0
            else:
                self._idle_run += 1
                if self._idle_run >= 3:  # not idle: the steps themselves got longer
                    self.step_s, self._idle_run = gap, 0
        self._last_call, self._last_learned_s = now, 0.0
        self._steps += 1

    def _learned_device_s(self) -> float:
        """The learned drafter's latest finished propose's device seconds, where it leaves its
        drafts on the device and times them (``propose_device_s``), else 0."""
        return getattr(self.learned, "propose_device_s", None) or 0.0

    def _one_off_seconds(self) -> float:
        """Seconds the learned drafter has spent so far capturing graphs and compiling (its ``stats``)."""
        stats = getattr(self.learned, "stats", None) or {}
        return float(stats.get("capture_s", 0.0)) + float(stats.get("compile_s", 0.0))

    def worth_asking(self, suffix_scores: Sequence[float], candidates: Sequence[int]) -> bool:
        """Whether the learned propose pays for itself this step (``cost_aware``).

        A step without it emits ``sum(1 + s_i)`` tokens (``s_i``: each request's suffix draft's
        expected accepted tokens) in :attr:`step_s`; asking adds :attr:`learned_s` and, per
        candidate (a request whose suffix score is below :attr:`learned_mean`), ``learned_mean -
        s_i`` tokens. Ask when the tokens per second are higher that way:
        ``gain / tokens > learned_s / step_s``. Until :data:`WARMUP_STEPS` steps are measured, ask;
        after :data:`PROBE_EVERY` declined steps in a row, ask once (to measure afresh).
        """
        if self._steps <= self.WARMUP_STEPS or None in (self.step_s, self.learned_s, self.learned_mean):
            return True
        if self._declined_run >= self.PROBE_EVERY:  # a probe: measured afresh (propose replaces the averages)
            return True
        tokens = sum(1.0 + e for e in suffix_scores)
        gain = sum(self.learned_mean - suffix_scores[i] for i in candidates)
        return gain * self.step_s > self.learned_s * tokens

    def propose(self, req_ids: Sequence[str], max_tokens: int) -> list[Draft]:
        """Both drafters' drafts; per request the one with more expected accepted tokens.

        The suffix drafter proposes first. A request whose suffix draft scores at least
        :attr:`learned_best` (the most any learned draft has scored so far) takes it without asking
        the learned drafter, and when every request of the step does, the learned propose is
        skipped (``stats["learned_skipped"]`` counts those requests). With ``cost_aware`` the rest
        ask it only when :meth:`worth_asking` says so. If the learned drafter raises, the step takes
        the suffix drafts (its fault stays inside it).
        """
        if self.cost_aware:
            self._time_step()
        suffix = self.suffix.propose(req_ids, max_tokens)
        scores = [expected_accepted(b, self.default_confidence) for b in suffix]
        best = self.learned_best
        ask = [i for i, e in enumerate(scores) if best is None or e < best]
        self.stats["learned_skipped"] += len(req_ids) - len(ask)
        probe = False
        if ask and self.cost_aware:
            mean = self.learned_mean
            probe = self._declined_run >= self.PROBE_EVERY
            if self.worth_asking(scores, [i for i in ask if mean is None or scores[i] < mean]):
                self._declined_run = 0
            else:
                self.stats["learned_declined"] += len(ask)
                self._declined_run += 1
                ask = []
        learned = [Draft() for _ in req_ids]
        learned_scores = [0.0] * len(req_ids)
        if ask:
            t0, spent = (self._clock(), self._one_off_seconds()) if self.cost_aware else (0.0, 0.0)
            try:
                drafts = self.learned.propose([req_ids[i] for i in ask], max_tokens)
            except Exception as e:  # noqa: BLE001 - contained: the suffix drafts still stand
                if self.cost_aware:
                    self._last_learned_s = self._clock() - t0
                if not self.stats["learned_errors"]:
                    warnings.warn(f"HybridDrafter: the learned drafter's propose raised ({type(e).__name__}: {e}); "
                                  "this step uses the suffix drafts", RuntimeWarning, stacklevel=2)
                self.stats["learned_errors"] += 1
            else:
                for i, d in zip(ask, drafts):
                    learned[i], learned_scores[i] = d, expected_accepted(d, self.default_confidence)
                if self.cost_aware:
                    self._last_learned_s = self._clock() - t0
                    # a graph capture or a compile inside the call is a one-off, not the propose's cost
                    took = max(self._last_learned_s - (self._one_off_seconds() - spent), 0.0)
                    # drafts left on the device: the call returns before its device work is done,
                    # which costs the step that much (the latest finished propose's, a step behind)
                    took = max(took, self._learned_device_s())
                    self.learned_s = took if probe else self._average(self.learned_s, took)
                    mean = sum(learned_scores[i] for i in ask) / len(ask)
                    self.learned_mean = mean if probe else self._average(self.learned_mean, mean)
                if any(len(d) for d in drafts):
                    top = max(learned_scores[i] for i in ask)
                    self.learned_best = top if self.learned_best is None else max(self.learned_best, top)
        out = []
        for a, b, e, ea in zip(learned, suffix, scores, learned_scores):
            if not len(a) and not len(b):
                self.stats["none"] += 1
                out.append(a)
            elif e > ea:
                self.stats["suffix"] += 1
                out.append(b)
            else:
                self.stats["learned"] += 1
                out.append(a)
        return out
