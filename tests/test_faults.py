"""Drafter faults stay inside one request; a failed step leaves every request as it was; engines
give their memory back. All on the tiny random target (the behaviour does not depend on the model)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import SamplingParams, SpecEngine
from specdec.drafters import Draft, SuffixAutomatonDrafter
from specdec.errors import EngineClosedError

PROMPTS = {"a": [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3], "b": [7, 8, 9, 7, 8, 9, 7, 8],
           "c": [10, 11, 12, 13, 10, 11, 12, 13, 10]}
GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)


def solo(target, req: str, params=GREEDY) -> tuple[int, ...]:
    """The request's output alone, with the null drafter (what every other run must equal)."""
    return SpecEngine(target).generate([PROMPTS[req]], params)[0].token_ids


def run_staggered(engine: SpecEngine, params=GREEDY) -> dict[str, tuple[int, ...]]:
    """'a' runs one step alone, then 'b' and 'c' join: the step that admits them also drafts for 'a'."""
    engine.add_request(PROMPTS["a"], params, req_id="a")
    engine.step()
    engine.add_request(PROMPTS["b"], params, req_id="b")
    engine.add_request(PROMPTS["c"], params, req_id="c")
    while engine.has_unfinished():
        engine.step()
    return {r: engine.output(r).token_ids for r in "abc"}


def assert_no_leak(engine: SpecEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.manager.num_free_pages == engine.manager.num_pages


class RaisesFor(SuffixAutomatonDrafter):
    """The issue's reproduction: ``propose`` raises whenever request 'a' is in the batch."""

    def propose(self, req_ids, max_tokens):
        if "a" in req_ids:
            raise RuntimeError("drafter bug")
        return super().propose(req_ids, max_tokens)


class BadDraftFor(SuffixAutomatonDrafter):
    """Returns ``bad`` as request 'a''s draft, good drafts for the others."""

    def __init__(self, bad):
        super().__init__()
        self.bad = bad

    def propose(self, req_ids, max_tokens):
        good = super().propose(req_ids, max_tokens)
        return [self.bad if r == "a" else d for r, d in zip(req_ids, good)]


def test_propose_that_raises_costs_only_that_request_its_drafts(tiny):
    engine = SpecEngine(tiny, RaisesFor())
    with pytest.warns(RuntimeWarning, match="drafter RaisesFor for request 'a'.*propose raised.*drafter bug"):
        outs = run_staggered(engine)
    assert outs == {r: solo(tiny, r) for r in "abc"}
    a, b, c = (engine.output(r).stats for r in "abc")
    assert a.drafted == 0 and a.drafter_faults == len(a.accepted_lengths) - 1  # every step but the last asks
    assert b.drafted > 0 and c.drafted > 0 and b.drafter_faults == c.drafter_faults == 0  # retried one by one
    assert engine.fault_stats["drafter_errors"] == a.drafter_faults
    assert_no_leak(engine)


def test_the_issues_reproduction_no_longer_breaks_the_engine(tiny):
    engine = SpecEngine(tiny, RaisesFor())
    engine.add_request(PROMPTS["a"], SamplingParams(max_new_tokens=8), req_id="a")
    engine.step()
    engine.add_request(PROMPTS["b"], SamplingParams(max_new_tokens=8), req_id="b")
    with pytest.warns(RuntimeWarning):
        engine.step()
    engine.abort("a")
    while engine.has_unfinished():
        engine.step()
    assert engine.output("b").token_ids == solo(tiny, "b", SamplingParams(max_new_tokens=8))
    assert_no_leak(engine)


@pytest.mark.parametrize("bad,why", [
    (Draft((64, 1)), r"in \[0, 64\)"),  # out of vocabulary: used to reach the target's embedding
    (Draft((-7,)), r"in \[0, 64\)"),  # negative: used to reach a sampled request's output
    (Draft((1, 2), probs=torch.full((2, 63), 1 / 63)), "probs"),  # q over the wrong vocabulary
    (Draft(tuple(range(30))), "asked for at most"),  # longer than asked
    (Draft((1.0, 2.0)), "integers"),
    ((1, 2), "must be a Draft"),
    (Draft(None), "has no len"),
])
def test_invalid_draft_is_dropped_for_that_request_only(tiny, bad, why):
    engine = SpecEngine(tiny, BadDraftFor(bad))
    with pytest.warns(RuntimeWarning, match=f"request 'a'.*invalid draft.*{why}"):
        outs = run_staggered(engine)
    assert outs == {r: solo(tiny, r) for r in "abc"}
    a = engine.output("a").stats
    assert a.drafted == 0 and a.drafter_faults > 0 and engine.fault_stats["invalid_drafts"] == a.drafter_faults
    assert engine.output("b").stats.drafted > 0
    assert_no_leak(engine)


def test_a_drafter_that_builds_a_tree_costs_only_its_request_its_drafts(tiny):
    """``Draft`` has no tree field: a drafter that passes one raises in ``propose``, a contained fault."""
    class Trees(SuffixAutomatonDrafter):
        def propose(self, req_ids, max_tokens):
            return [Draft(d.token_ids, parents=tuple(range(-1, len(d) - 1))) if r == "a" else d
                    for r, d in zip(req_ids, super().propose(req_ids, max_tokens))]

    engine = SpecEngine(tiny, Trees())
    with pytest.warns(RuntimeWarning, match="request 'a'.*propose raised.*parents"):
        assert run_staggered(engine) == {r: solo(tiny, r) for r in "abc"}
    assert engine.output("a").stats.drafted == 0 and engine.fault_stats["drafter_errors"] > 0
    assert engine.output("b").stats.accepted > 0
    assert_no_leak(engine)


def test_negative_draft_ids_never_reach_a_sampled_output(tiny):
    """The seeded sampled request loses every draft, so it decodes exactly as with the null drafter."""
    params = SamplingParams(max_new_tokens=24, temperature=1.0, seed=5, ignore_eos=True)
    engine = SpecEngine(tiny, BadDraftFor(Draft((-7, -7))))
    with pytest.warns(RuntimeWarning, match="invalid draft"):
        outs = run_staggered(engine, params)
    assert all(0 <= t < 64 for out in outs.values() for t in out)
    assert outs["a"] == solo(tiny, "a", params)
    engine.output("a")  # decodable (no tokenizer here; the bug raised OverflowError in the tokenizer)
    assert_no_leak(engine)


def test_propose_returning_a_wrong_number_of_drafts_is_retried_per_request(tiny):
    class OneShort(SuffixAutomatonDrafter):
        def propose(self, req_ids, max_tokens):
            return super().propose(req_ids, max_tokens)[:-1] if len(req_ids) > 1 else super().propose(req_ids, max_tokens)

    engine = SpecEngine(tiny, OneShort())
    assert run_staggered(engine) == {r: solo(tiny, r) for r in "abc"}
    assert engine.fault_stats == {"drafter_errors": 0, "invalid_drafts": 0}  # the retry found no culprit
    assert all(engine.output(r).stats.drafted > 0 for r in "abc")


@pytest.mark.parametrize("hook", ["start_request", "on_accepted"])
def test_lifecycle_hook_that_raises_stops_drafts_for_that_request(tiny, hook):
    class HookRaises(SuffixAutomatonDrafter):
        pass

    def broken(self, req_id, *args):
        if req_id == "a":
            raise ValueError(f"{hook} bug")
        return getattr(SuffixAutomatonDrafter, hook)(self, req_id, *args)

    setattr(HookRaises, hook, broken)
    engine = SpecEngine(tiny, HookRaises())
    with pytest.warns(RuntimeWarning, match=f"request 'a'.*{hook} raised.*no more drafts"):
        outs = run_staggered(engine)
    assert outs == {r: solo(tiny, r) for r in "abc"}
    assert engine.output("a").stats.drafted == 0 and engine.output("a").stats.drafter_faults == 1
    assert engine.output("b").stats.drafted > 0
    assert_no_leak(engine)


@pytest.mark.parametrize("where", ["propose", "overlap"])
def test_failed_step_leaves_every_request_as_it_was(tiny, where):
    """An interrupt in the step that admits 'b' and 'c' (before the forward, or while it runs):
    the step raises, then the engine goes on as if it had not happened."""

    class InterruptOnce(SuffixAutomatonDrafter):
        armed = False

        def propose(self, req_ids, max_tokens):
            if where == "propose" and self.armed:
                self.armed = False
                raise KeyboardInterrupt
            return super().propose(req_ids, max_tokens)

        def overlap(self):
            if where == "overlap" and self.armed:
                self.armed = False
                raise KeyboardInterrupt
            super().overlap()

    drafter = InterruptOnce()
    engine = SpecEngine(tiny, drafter)
    engine.add_request(PROMPTS["a"], GREEDY, req_id="a")
    engine.step()
    before = (list(engine.output("a").token_ids), engine.manager.num_free_pages)
    engine.add_request(PROMPTS["b"], GREEDY, req_id="b")
    engine.add_request(PROMPTS["c"], GREEDY, req_id="c")
    drafter.armed = True
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert (list(engine.output("a").token_ids), engine.manager.num_free_pages) == before
    assert [s.req_id for s in engine.scheduler.waiting] == ["b", "c"]
    while engine.has_unfinished():
        engine.step()
    assert {r: engine.output(r).token_ids for r in "abc"} == {r: solo(tiny, r) for r in "abc"}
    assert_no_leak(engine)


def test_dropped_engine_frees_its_kv_cache_without_the_cycle_collector(tiny):
    gc.collect()
    gc.disable()
    try:
        engine = SpecEngine(tiny, RaisesFor(), kv_cache_bytes=32 << 20)
        with pytest.warns(RuntimeWarning):
            run_staggered(engine)
        pool_k, alive = weakref.ref(engine.pool.k[0]), weakref.ref(engine)
        assert pool_k() is not None
        del engine
        assert alive() is None and pool_k() is None
    finally:
        gc.enable()


def test_close_and_context_manager_release_the_pool(tiny):
    with SpecEngine(tiny, SuffixAutomatonDrafter()) as engine:
        rid = engine.add_request(PROMPTS["a"], GREEDY)
        engine.step()
        pool_k = weakref.ref(engine.pool.k[0])
    assert pool_k() is None  # freed although the engine object is still referenced here
    out = engine.output(rid)
    assert out.finish_reason == "abort" and len(out.token_ids) == 1
    with pytest.raises(EngineClosedError):
        engine.step()
    with pytest.raises(EngineClosedError):
        engine.generate([[1, 2]])
    engine.close()  # twice: nothing happens
    assert engine.graph_stats["graphs_captured"] == 0  # still readable


def test_default_kv_size_follows_the_model_and_max_num_seqs(tiny):
    # 96 positions = 6 pages of 16 tokens per request, plus one scratch page
    assert SpecEngine(tiny).pool.num_pages == 64 * 6 + 1
    small = SpecEngine(tiny, max_num_seqs=2)
    assert small.pool.num_pages == 2 * 6 + 1
    assert small.pool.num_pages * 16 * small.pool.bytes_per_token < 1 << 20  # not 1 GiB for a toy
    assert SpecEngine(tiny, kv_cache_bytes=small.pool.bytes_per_token * 16 * 3).pool.num_pages == 3


# -- the batched draft check against the one-by-one check -------------------------------------------
_BAD_ID = st.one_of(st.integers(-3, -1), st.integers(64, 70), st.booleans(), st.floats(0, 63), st.just(np.int64(5)))
_BAD_CONF = st.one_of(st.floats(-0.5, -1e-9), st.floats(1 + 1e-9, 1.5), st.just(float("nan")), st.integers(0, 1),
                      st.just(np.float32(0.5)))


@st.composite
def _drafts(draw):
    """Lists of well-formed drafts (the fast path's case), and lists where one draft has one flaw;
    with whether there is a flaw."""
    out = []
    n = draw(st.integers(0, 5))
    flawed = draw(st.integers(-1, n - 1))  # the draft with a flaw (-1: none)
    for i in range(n):
        ids = draw(st.lists(st.integers(0, 63), min_size=1 if i == flawed else 0, max_size=10))
        conf = draw(st.one_of(st.none(), st.lists(st.floats(0, 1), min_size=len(ids), max_size=len(ids))))
        flaw = draw(st.sampled_from(["id", "conf", "conf_len", "list", "notadraft", "probs"])) if i == flawed else ""
        if flaw == "id":
            ids[draw(st.integers(0, len(ids) - 1))] = draw(_BAD_ID)
        elif flaw == "conf":
            conf = conf or [0.5] * len(ids)
            conf[draw(st.integers(0, len(conf) - 1))] = draw(_BAD_CONF)
        elif flaw == "conf_len":
            conf = (conf or []) + [0.5]
        if flaw == "notadraft":
            out.append(tuple(ids))
        elif flaw == "probs":
            out.append(Draft(tuple(ids), probs=torch.full((len(ids), 64), 1 / 64)))
        else:
            wrap = list if flaw == "list" else tuple
            out.append(Draft(wrap(ids), confidence=None if conf is None else wrap(conf)))
    return out, flawed >= 0


@settings(max_examples=400, deadline=None)
@given(_drafts(), st.integers(0, 12), st.data())
def test_the_batched_draft_check_agrees_with_the_one_by_one_check(drafts, k, data):
    """``_valid_drafts_fast`` (the engine's common case, all drafts at once) takes every list of
    well-formed drafts within the asked length, and returns exactly what ``_valid_draft`` returns
    for each draft; it declines (``None``) the rest, and never accepts a draft that the one-by-one
    check rejects."""
    from specdec.engine import _valid_draft, _valid_drafts_fast

    drafts, flawed = drafts
    budgets = [data.draw(st.integers(0, k)) for _ in drafts]
    fast = _valid_drafts_fast(drafts, k, budgets, 64)
    assert fast is not None or flawed or any(len(d) > k for d in drafts)
    one = []
    for d, b in zip(drafts, budgets):
        try:
            one.append(_valid_draft(d, k, b, 64))
        except (TypeError, ValueError):
            one.append(None)
    if fast is None:
        return
    assert None not in one
    for f, o in zip(fast, one):
        assert (f.token_ids, f.confidence, f.probs) == (o.token_ids, o.confidence, o.probs)
        assert all(type(t) is int for t in f.token_ids)
        assert f.confidence is None or all(type(c) is float for c in f.confidence)


def test_the_batched_draft_check_takes_the_suffix_drafters_drafts():
    """The common case is the suffix drafter's own drafts (else the fast path would never run)."""
    from specdec.engine import _valid_drafts_fast

    d = SuffixAutomatonDrafter()
    for r, p in PROMPTS.items():
        d.start_request(r, p)
    drafts = d.propose(list(PROMPTS), 4)
    assert any(len(x) for x in drafts)
    fast = _valid_drafts_fast(drafts, 4, [2, 4, 4], 64)
    assert fast is not None and [len(x) for x in fast] == [min(len(x), b) for x, b in zip(drafts, [2, 4, 4])]
