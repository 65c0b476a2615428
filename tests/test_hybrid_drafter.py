"""The hybrid drafter: per request, the draft (learned or suffix) with more expected accepted
tokens; its choice as a pure function, its lifecycle forwarded to both, and lossless end to end."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from specdec import SamplingParams, SpecEngine
from specdec.drafters import Draft, Drafter, HybridDrafter, NullDrafter, SuffixAutomatonDrafter, make_drafter
from specdec.drafters.hybrid import expected_accepted
from specdec.errors import ConfigError

confidences = hst.lists(hst.floats(0, 1), max_size=8)


@settings(max_examples=200, deadline=None)
@given(conf=confidences)
def test_expected_accepted_is_the_expectation(conf):
    """Brute force: every accept/reject pattern of the k tokens, weighted by its probability
    (token i accepted with probability c_i given the ones before were); a chain stops at the
    first rejection, so its accepted count is the length of the leading run of accepts."""
    k, want = len(conf), 0.0
    for pattern in itertools.product([True, False], repeat=k):
        p = math.prod(c if ok else 1 - c for c, ok in zip(conf, pattern))
        run = next((i for i, ok in enumerate(pattern) if not ok), k)
        want += p * run
    got = expected_accepted(Draft(tuple(range(k)), confidence=tuple(conf)), default=0.0)
    assert got == pytest.approx(want, abs=1e-9)


@given(k=hst.integers(0, 8), c=hst.floats(0, 1))
def test_a_draft_without_confidences_counts_each_token_at_the_default(k, c):
    assert expected_accepted(Draft(tuple(range(k))), c) == pytest.approx(
        expected_accepted(Draft(tuple(range(k)), confidence=(c,) * k), 0.0))


class _Scripted(Drafter):
    """Proposes the drafts it is given, per request; logs which requests it was asked for."""

    def __init__(self, drafts: dict[str, Draft], target_layer_ids: tuple[int, ...] = ()) -> None:
        self.drafts, self.target_layer_ids, self.asked = drafts, target_layer_ids, []

    def propose(self, req_ids, max_tokens):
        self.asked.append(list(req_ids))
        return [self.drafts[r] for r in req_ids]


def _chain(*conf: float) -> Draft:
    return Draft(tuple(range(len(conf))), confidence=conf)


def test_the_learned_drafter_is_asked_only_where_it_could_win():
    """Every request asks it until a learned draft has scored; then a request whose suffix draft
    scores at least the best learned score so far takes the suffix draft without asking it, and
    a step where no request needs it does not call it."""
    learned = _Scripted({"a": _chain(0.9, 0.9), "b": _chain(0.5), "c": _chain(0.8, 0.8, 0.8)}, (1,))
    suffix = _Scripted({"a": _chain(0.99, 0.99, 0.99, 0.99), "b": _chain(0.3), "c": _chain(0.6)})
    h = HybridDrafter(learned=learned, suffix=suffix, cost_aware=False)
    assert h.learned_best is None
    out = h.propose(["a", "b"], 8)
    assert learned.asked == [["a", "b"]] and h.stats["learned_skipped"] == 0
    assert out == [suffix.drafts["a"], learned.drafts["b"]]  # 3.88 > 1.71; 0.5 > 0.3
    assert h.learned_best == pytest.approx(0.9 + 0.81)
    out = h.propose(["a", "b", "c"], 8)  # "a" scores 3.88 >= 1.71: not asked
    assert learned.asked[-1] == ["b", "c"] and h.stats["learned_skipped"] == 1
    assert out == [suffix.drafts["a"], learned.drafts["b"], learned.drafts["c"]]
    assert h.learned_best == pytest.approx(0.8 + 0.64 + 0.512)
    h.propose(["a"], 8)
    assert len(learned.asked) == 2 and h.stats["learned_skipped"] == 2  # not called at all
    assert h.stats == {**h.stats, "learned": 3, "suffix": 3, "none": 0}


def test_bad_arguments_are_config_errors():
    with pytest.raises(ConfigError, match="learned"):
        HybridDrafter(learned=SuffixAutomatonDrafter())
    with pytest.raises(ConfigError, match="default_confidence"):
        HybridDrafter(default_confidence=1.5)
    with pytest.raises(ConfigError, match="suffix"):
        HybridDrafter(suffix=make_drafter("dspark"))
    with pytest.raises(ConfigError, match="torch_compile"):
        HybridDrafter(torch_compile="yes")
    assert make_drafter("hybrid", torch_compile=True).learned.torch_compile is True


def test_hooks_are_the_learned_drafters():
    h = HybridDrafter()
    d = h.learned
    assert h.target_layer_ids == d.target_layer_ids and h.shift_label == d.shift_label == 1
    assert h.kv_layer_specs() == d.kv_layer_specs()
    assert h.reads_managed_ctx_pages(16) == d.reads_managed_ctx_pages(16)
    assert h.reads_helix_sharded_ctx_pages == d.reads_helix_sharded_ctx_pages
    assert make_drafter("hybrid").learned.config == d.config


@pytest.mark.slow
def test_hybrid_is_lossless_and_takes_both_drafts(smollm2):
    """Real SmolLM2 in fp32 with the shipped DSpark and the suffix drafter: every output equals
    the null drafter's, at batch 1 and 4; both drafters' drafts are taken; the request state of
    both is freed when requests finish."""
    prompts = ["def add(a, b):\n    return a + b\n\ndef add3(a, b, c):", "Write a haiku about caches.",
               "List the first ten prime numbers, one per line, then repeat the list.",
               "Explain what a hash map is in two sentences.", "def fib(n):"]
    params = SamplingParams(max_new_tokens=40)
    base = [o.token_ids for o in SpecEngine(smollm2, NullDrafter(), tokens_per_block=16).generate(prompts, params)]
    for batch in (1, 4):
        h = HybridDrafter()
        engine = SpecEngine(smollm2, h, max_draft_tokens=7, tokens_per_block=16)
        outs = []
        for i in range(0, len(prompts), batch):
            outs += [o.token_ids for o in engine.generate(prompts[i:i + batch], params)]
        assert outs == base, batch
        assert h.stats["learned"] > 0 and h.stats["suffix"] > 0, h.stats
        assert h.learned_best is not None and 0 < h.learned_best <= 7
        assert not h.suffix._requests and not h.learned._tokens


def _bound_hybrid(smollm2):
    h = HybridDrafter()
    engine = SpecEngine(smollm2, h, max_draft_tokens=7, tokens_per_block=16)
    return h, engine


@pytest.mark.slow
def test_a_learned_drafter_fault_leaves_the_suffix_drafts(smollm2, monkeypatch):
    """The learned drafter raises in every propose: the hybrid warns once, counts it, drafts from
    the suffix automaton, and outputs stay the null drafter's."""
    prompt = "List the first ten prime numbers, one per line, then repeat the list."
    params = SamplingParams(max_new_tokens=48)
    want = SpecEngine(smollm2, NullDrafter(), tokens_per_block=16).generate([prompt], params)[0].token_ids
    h, engine = _bound_hybrid(smollm2)

    def broken(*a, **k):
        raise RuntimeError("drafter network failed")

    # set in (and undone by deleting from) the instance's __dict__: setattr's undo would leave the
    # original bound method there, a reference cycle keeping the drafter and the engine's KV pool
    # alive until the next full garbage collection
    monkeypatch.setitem(vars(h.learned), "propose", broken)
    with pytest.warns(RuntimeWarning, match="learned drafter"):
        out = engine.generate([prompt], params)[0]
    assert out.token_ids == want
    assert h.stats["learned_errors"] > 1 and h.stats["suffix"] > 0 and h.stats["learned"] == 0
    assert out.stats.accepted > 0


@pytest.mark.slow
def test_abort_and_stop_reach_both_drafters_even_if_one_raises(smollm2, monkeypatch):
    h, engine = _bound_hybrid(smollm2)
    engine.add_request("def fib(n):", SamplingParams(max_new_tokens=30), req_id="a")
    engine.add_request("Write a haiku about caches.", SamplingParams(max_new_tokens=30), req_id="b")
    engine.step()
    engine.abort("a")
    assert "a" not in h.suffix._requests and "a" not in h.learned._tokens

    def broken(req_id):
        raise RuntimeError("stop failed")

    monkeypatch.setitem(vars(h.learned), "stop_request", broken)  # as above
    with pytest.raises(RuntimeError, match="stop failed"):
        h.stop_request("b")
    assert "b" not in h.suffix._requests  # the suffix drafter forgot it all the same


def test_settings_and_figures_are_the_two_drafters():
    h = HybridDrafter()
    assert h.cost_aware and not HybridDrafter(cost_aware=False).cost_aware  # cost-aware by default (measured)
    h.cuda_graphs = False
    h.torch_compile = True
    assert h.learned.cuda_graphs is False and h.learned.torch_compile is True
    assert h.cuda_graphs is False and h.torch_compile is True
    assert h.global_tokens == h.suffix.global_tokens and h.global_rebuilds == h.suffix.global_rebuilds


class _Clock:
    """A clock the test moves: each propose of a drafter that holds it advances it by that drafter's cost."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Timed(_Scripted):
    def __init__(self, drafts, clock: _Clock, cost: float, target_layer_ids=()) -> None:
        super().__init__(drafts, target_layer_ids)
        self.clock, self.cost = clock, cost

    def propose(self, req_ids, max_tokens):
        self.clock.t += self.cost
        return super().propose(req_ids, max_tokens)


@pytest.mark.parametrize(("learned_cost", "asked_after_warmup"), [(0.9, False), (0.1, True)])
def test_cost_aware_asks_only_when_the_learned_drafts_pay_for_their_time(learned_cost, asked_after_warmup):
    """Steps of 1.0 s without the learned propose; the learned drafts score 2.0, the suffix drafts
    1.0 (of 2 tokens a step, the learned ones would add 1: +50 %). A learned propose of 0.9 s (+90 %
    time) is declined once the warm-up has measured it; one of 0.1 s (+10 %) is always asked."""
    clock = _Clock()
    learned = _Timed({"a": _chain(1.0, 1.0)}, clock, learned_cost, (1,))
    suffix = _Scripted({"a": _chain(1.0, 0.0)})
    h = HybridDrafter(learned=learned, suffix=suffix, cost_aware=True, clock=clock)
    for step in range(HybridDrafter.WARMUP_STEPS + 5):
        h.learned_best = 10.0  # below it every request could win: the rule that decides is the cost
        out = h.propose(["a"], 4)
        asked = len(learned.asked) == step + 1
        if step < HybridDrafter.WARMUP_STEPS:
            assert asked  # measuring
        else:
            assert asked == asked_after_warmup, (step, h.step_s, h.learned_s, h.learned_mean)
        assert out == [learned.drafts["a"] if asked else suffix.drafts["a"]]
        clock.t += 1.0  # the rest of the step: the target's forward, verification
    assert h.step_s == pytest.approx(1.0) and h.learned_s == pytest.approx(learned_cost)
    assert h.learned_mean == pytest.approx(2.0)
    assert h.stats["learned_declined"] == (0 if asked_after_warmup else 5)


def test_cost_aware_must_be_a_bool():
    with pytest.raises(ConfigError, match="cost_aware"):
        HybridDrafter(cost_aware="yes")


@pytest.mark.slow
def test_cost_aware_hybrid_is_lossless(smollm2):
    """The cost-aware rule changes which drafts are proposed, never the output: equal to null's at batch 2."""
    prompts = ["def add(a, b):\n    return a + b\n\ndef add3(a, b, c):", "Write a haiku about caches."]
    params = SamplingParams(max_new_tokens=32)
    base = [o.token_ids for o in SpecEngine(smollm2, NullDrafter(), tokens_per_block=16).generate(prompts, params)]
    h = HybridDrafter(cost_aware=True)
    outs = SpecEngine(smollm2, h, max_draft_tokens=7, tokens_per_block=16).generate(prompts, params)
    assert [o.token_ids for o in outs] == base
    assert h.step_s is not None and h.learned_s is not None and h.learned_mean is not None


def test_cost_aware_measures_again_after_a_slow_first_propose_and_ignores_idle_gaps():
    """A learned propose whose first call takes 5 s (a capture, say) and later ones 0.1 s: declined
    after the warm-up, then asked again by the probe after PROBE_EVERY declined steps, and from then
    on. An idle minute between two proposes does not count as a step."""
    clock = _Clock()
    learned = _Timed({"a": _chain(1.0, 1.0)}, clock, 5.0, (1,))
    suffix = _Scripted({"a": _chain(1.0, 0.0)})
    h = HybridDrafter(learned=learned, suffix=suffix, cost_aware=True, clock=clock)
    asked = []
    for step in range(HybridDrafter.WARMUP_STEPS + HybridDrafter.PROBE_EVERY + 10):
        h.learned_best = 10.0
        before = len(learned.asked)
        h.propose(["a"], 4)
        asked.append(len(learned.asked) > before)
        learned.cost = 0.1
        clock.t += 1.0
        if step == 3:
            clock.t += 60.0  # idle
    w, p = HybridDrafter.WARMUP_STEPS, HybridDrafter.PROBE_EVERY
    assert all(asked[:w]) and not any(asked[w:w + p]) and all(asked[w + p:]), asked
    assert h.step_s == pytest.approx(1.0) and h.learned_s == pytest.approx(0.1)
