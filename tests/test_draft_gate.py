"""`EngineConfig.draft_gate`: per batch-size bucket, steps draft the number of tokens (0 included)
estimated to emit the most tokens per second from what earlier steps measured; outputs never change."""

from __future__ import annotations

import math
import time

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from helpers import tiny_llama
from specdec import EngineConfig, SamplingParams, SpecEngine
from specdec.draft_gate import DraftGate, GateStep, bucket_label, bucket_of, draft_lengths
from specdec.drafters import Draft, Drafter, NullDrafter, SuffixAutomatonDrafter
from specdec.drafters.block import BlockDrafterConfig, BlockDrafterNet, init_weights
from specdec.drafters.dflash import DFlashDrafter, DSparkDrafter
from specdec.drafters.training import target_hidden_states
from specdec.errors import ConfigError


# -- the gate alone ------------------------------------------------------------------------------
@given(st.integers(1, 10_000))
def test_buckets_are_powers_of_two(batch):
    k = bucket_of(batch)
    assert 2 ** k >= batch and (k == 0 or 2 ** (k - 1) < batch)
    label = bucket_label(k)
    lo, _, hi = label.partition("-")
    assert int(lo) <= batch <= int(hi or lo)


def test_bucket_of_rejects_an_empty_batch():
    with pytest.raises(ValueError, match="batch"):
        bucket_of(0)


@given(st.integers(1, 64))
def test_lengths_are_none_powers_of_two_and_the_most(max_draft):
    lengths = draft_lengths(max_draft)
    assert lengths[0] == 0 and lengths[-1] == max_draft and list(lengths) == sorted(set(lengths))
    assert all(n & (n - 1) == 0 for n in lengths[1:-1])
    with pytest.raises(ValueError, match="max_draft"):
        draft_lengths(0)


def _load_gate_sim():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "gate_sim.py"
    spec = importlib.util.spec_from_file_location("gate_sim", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GATE_SIM = _load_gate_sim()  # bench/gate_sim.py: the gate against this model, case by case
#: A drafter and target in numbers: each drafted token is accepted with probability ``p`` given the
#: ones before it were (spread over a step's requests by a low-discrepancy sequence: deterministic,
#: close to the distribution); a step costs ``plain * batch + fixed + per_row * batch * L`` seconds,
#: ``fixed`` only where it drafts (the propose). ``rate(batch, L)``: the true tokens per second.
_Env = GATE_SIM.Model


def _drive(gate: DraftGate, steps: int, env, batch: int = 8, spike_at: int | None = None,
           achieved: list | None = None) -> list[int]:
    """``steps`` decisions, each recorded as ``env`` says; the lengths chosen. ``achieved`` collects
    each step's (tokens, seconds)."""
    out = []
    for i in range(steps):
        n = gate.draft_length(batch)
        seconds = env.seconds(batch, n) * (100.0 if i == spike_at else 1.0)
        accepted = env.accepted(batch, n)
        gate.record(batch, n, accepted, seconds)
        out.append(n)
        if achieved is not None:
            achieved.append((batch + sum(accepted), seconds))
    return out


def _true_best(env, lengths, batch: int = 8) -> int:
    return max(lengths, key=lambda n: env.rate(batch, n))


W, E, P = DraftGate.WARMUP, DraftGate.PROBE_EVERY, DraftGate.PROBE_STEPS
J = DraftGate.JOIN_PROBE_AFTER


def test_a_new_bucket_measures_the_longest_and_no_draft_then_takes_the_best_estimate():
    gate = DraftGate(8)  # lengths 0, 1, 2, 4, 8
    env = _Env(p=0.8, fixed=0.005, per_row=0.003)
    rates = {n: env.rate(8, n) for n in gate.lengths}
    assert max(rates, key=rates.get) not in (0, 8)  # the peak is inside: costs there are interpolated first
    seq = _drive(gate, 2 * W + 60, env)
    assert seq[:2 * W] == [8] * W + [0] * W
    stats = gate.stats()["5-8"]
    assert rates[stats["draft_length"]] >= 0.98 * max(rates.values()) and seq[-20:] == [stats["draft_length"]] * 20
    for n, a in stats["accepted"].items():  # every length's acceptance, from the steps that drafted more
        assert a == pytest.approx(sum(0.8 ** j for j in range(1, n + 1)), rel=0.05)
    accepted = [stats["accepted"][n] for n in sorted(stats["accepted"])]
    assert accepted == sorted(accepted)  # a longer draft never has fewer accepted tokens


def test_a_drafter_that_never_pays_goes_to_plain_steps_and_is_probed():
    gate = DraftGate(8)
    env = _Env(p=0.3, fixed=0.5, per_row=0.01)  # a propose that costs six plain steps
    seq = _drive(gate, 2 * W + 7000, env)
    assert seq[:2 * W] == [8] * W + [0] * W
    rest = seq[2 * W:]
    assert gate.stats()["5-8"]["draft_length"] == 0
    # probes of the longest draft (each 4 steps of 1.22 s at a tenth of plain steps' tokens/s) wait
    # until they would lose at most PROBE_LOSS of the time since the last: 90x their own time (5,500
    # plain steps), not PROBE_SHARE's 20x (1,220); a length or two may be tried
    drafted = [k for k, n in enumerate(rest) if n]
    assert P <= len(drafted) <= 2 * P + 2 * W and drafted[0] > 5000
    lost = sum(env.seconds(8, n) * (1 - env.rate(8, n) / env.rate(8, 0)) for n in rest if n)
    assert lost <= DraftGate.PROBE_LOSS * sum(env.seconds(8, n) for n in rest)


def test_probes_follow_acceptance_that_rises():
    gate = DraftGate(8)
    env = _Env(p=0.3, fixed=0.03, per_row=0.004)
    seq = _drive(gate, 300, env)
    assert _true_best(env, gate.lengths) == 0 and seq[-30:].count(0) >= 30 - P
    env.p = 0.97  # text the drafter suits: the longest draft now wins
    # its probe (at 31 % of plain steps' rate before) comes once it would lose at most PROBE_LOSS of
    # the time since the last: after about 70x its own time (1,250 plain steps)
    seq = _drive(gate, 1100, env)
    assert gate.stats()["5-8"]["draft_length"] == 8 == _true_best(env, gate.lengths)
    assert seq[-50:].count(8) >= 50 - P


def _gate_holding_no_draft(batch: int) -> tuple[DraftGate, _Env]:
    """A gate at ``batch`` that stopped drafting on text the drafter does not suit (acceptance 0.2 a
    token; a drafting step 1.6x a plain one at batch 1, 1.8x at 32)."""
    gate, env = DraftGate(8), _Env(p=0.2, fixed=0.006 if batch == 1 else 0.2, per_row=0.0001 if batch == 1 else 0.0015)
    _drive(gate, 300, env, batch=batch)
    assert gate.stats()[bucket_label(bucket_of(batch))]["draft_length"] == 0
    return gate, env


def _plain_for(gate: DraftGate, env, seconds: float, batch: int = 1) -> None:
    """Drive plain steps until they add up to ``seconds`` since the bucket's last probe."""
    b = gate._buckets[bucket_of(batch)]
    for _ in range(2000):
        if b.run_s >= seconds:
            return
        assert _drive(gate, 1, env, batch=batch) == [0]
    raise AssertionError("no plain run that long")


def test_a_request_joining_a_batch_of_one_is_probed_where_the_gate_holds_no_draft():
    gates = []
    for _ in range(2):  # the same gate twice: told of the next request, and not
        gate, env = _gate_holding_no_draft(1)
        _plain_for(gate, env, 0.5)  # the probe's 4 steps (67 ms) come to under JOIN_PROBE_SHARE of it
        gates.append(gate)
    told, untold = gates
    env.p = 0.9  # the next request: text the drafter suits, the longest draft 3.7x plain steps' rate
    told.joined(1, 1)
    seq = _drive(told, 40, env, batch=1)
    assert seq[:J + P] == [0] * J + [8] * P and seq[-20:] == [8] * 20  # probed past its first steps, then drafting
    # not told, the gate carries the last request's acceptance: plain steps until a probe falls due
    assert _drive(untold, 40, env, batch=1) == [0] * 40


def test_a_join_probe_is_held_to_the_probes_budget_and_to_drafts_that_could_pay():
    gate, env = _gate_holding_no_draft(1)
    _plain_for(gate, env, 0.5)
    gate.joined(1, 1)
    assert _drive(gate, J + P + 20, env, batch=1) == [0] * J + [8] * P + [0] * 20  # probed, then plain (p = 0.2)
    gate.joined(1, 1)  # the next request after 20 plain steps: its probe would take over a fifth of their time
    assert _drive(gate, J + 20, env, batch=1) == [0] * (J + 20)
    dear = DraftGate(8)  # a propose that costs 50 plain steps: not even every token accepted would pay
    denv = _Env(p=0.9, fixed=0.5, per_row=0.0001)
    _drive(dear, 300, denv, batch=1)
    _plain_for(dear, denv, 11.0)  # the probe's time (2 s) within JOIN_PROBE_SHARE: only what it could pay stops it
    dear.joined(1, 1)
    assert _drive(dear, J + 10, denv, batch=1) == [0] * (J + 10)


def test_a_drafting_gate_keeps_drafting_through_a_new_answer_s_harder_start():
    """Answers the drafter suits (each token accepted at 0.85), each starting with eight steps at
    0.4 (an answer's first steps accept least: GATE_SIM.NoisyModel); told of each, the gate drafts
    through them: the acceptance before a join keeps its weight. Weighed a tenth at each join and
    probed at once (the first form, bench/gate_sim.py's FirstFormGate), the first steps' draws decided
    and the gate fell to plain steps."""

    def drafted(cls, tell: bool) -> float:  # the share of drafting steps after the first five answers
        gate = cls(8)
        gate.keep_history(100_000)
        env = GATE_SIM.NoisyModel(0.85, 0.018, 0.0001, seed=3, start_steps=8, start_factor=0.4 / 0.85)
        for r in range(30):
            if r == 5:
                mark = len(gate.history)
            env.new_request(0.85)
            GATE_SIM._one_request(gate, env, 96, tell)
        later = list(gate.history)[mark:]
        return sum(s.length > 0 for s in later) / len(later)

    told, untold, first = drafted(DraftGate, True), drafted(DraftGate, False), drafted(GATE_SIM.FirstFormGate, True)
    # untold, it falls to plain steps at some starts too, and only a probe's interval later drafts again
    assert told >= 0.9 and untold < told and first < told - 0.1, (told, untold, first)


def test_a_join_probe_waits_past_an_answer_s_first_steps():
    """A gate holding no draft; the next answer suits the drafter (0.9 a token) but its first eight
    steps do not (0.15). Told of it, the gate probes once JOIN_PROBE_AFTER plain steps are past,
    and drafts; a gate that probes at once (a subclass, as an earlier version did) measures the
    start and stays plain."""

    class Eager(DraftGate):
        def joined(self, batch, n):
            super().joined(batch, n)
            b = self._buckets.get(bucket_of(batch))
            if b is not None and b.join_wait:
                b.join_wait = 0
                self._join_probe(b, batch)

    runs = {}
    for cls in (DraftGate, Eager):
        gate = cls(8)
        plain_env = _Env(p=0.2, fixed=0.006, per_row=0.0001)
        _drive(gate, 300, plain_env, batch=1)
        _plain_for(gate, plain_env, 0.5)
        assert gate.stats()["1"]["draft_length"] == 0
        env = GATE_SIM.NoisyModel(0.9, 0.006, 0.0001, seed=5, start_steps=8, start_factor=0.15 / 0.9)
        env.new_request(0.9)
        gate.joined(1, 1)
        runs[cls.__name__] = _drive(gate, 60, env, batch=1)
    assert runs["DraftGate"][:J + P] == [0] * J + [8] * P and min(runs["DraftGate"][-20:]) > 0, runs
    assert runs["Eager"][:P] == [8] * P and runs["Eager"][-20:] == [0] * 20, runs


def test_a_request_joining_a_large_batch_starts_no_probe_and_keeps_the_estimates():
    gate, env = _gate_holding_no_draft(32)
    before = gate.stats()["17-32"]
    gate.joined(32, 1)
    after = gate.stats()["17-32"]
    assert after["accepted"] == pytest.approx(before["accepted"]) and after["draft_length"] == 0
    assert _drive(gate, 20, env, batch=32) == [0] * 20  # a 32nd of the batch is new: no probe
    gate.joined(32, 20)  # most of the batch at once: their acceptance averages as the last twenty's did
    assert _drive(gate, 20, env, batch=32) == [0] * 20
    small, env = _gate_holding_no_draft(4)
    _plain_for(small, env, 6.0, batch=4)
    small.joined(4, 2)  # two of a batch of four
    assert _drive(small, J + P, env, batch=4) == [0] * J + [8] * P


def test_join_probes_that_leave_the_gate_plain_come_less_often():
    """A drafter that suits no request's text: each join probe that leaves the bucket holding no
    draft halves the share of plain time the next may take (a fifth, a tenth, then PROBE_SHARE's
    twentieth); one after which it drafts restores it."""
    gate, env = _gate_holding_no_draft(1)
    env.p = 0.02
    b = gate._buckets[0]
    for misses in range(3):
        assert b.join_misses == misses
        _plain_for(gate, env, 0.5)  # enough for a fifth (the probe: 67 ms), not for a tenth
        gate.joined(1, 1)
        probed = _drive(gate, J + P, env, batch=1)[J:] == [8] * P
        assert probed == (misses == 0), misses
        if not probed:
            break
        _drive(gate, 5, env, batch=1)
    _plain_for(gate, env, 0.8)  # a tenth of this is over the probe's time
    gate.joined(1, 1)
    assert _drive(gate, J + P, env, batch=1)[J:] == [8] * P and b.join_misses == 2
    env.p = 0.95  # a text the drafter suits: the next join probe makes it draft
    _plain_for(gate, env, 1.4)
    gate.joined(1, 1)
    _drive(gate, J + P + 10, env, batch=1)
    assert b.join_misses == 0 and gate.stats()["1"]["draft_length"] > 0


def test_a_bucket_still_measuring_or_probing_or_drafting_is_not_probed_on_a_join():
    gate, env = DraftGate(8), _Env(p=0.2, fixed=0.006, per_row=0.0001)
    gate.joined(1, 1)  # nothing measured yet: the first measurements as usual
    assert _drive(gate, W + 2, env, batch=1) == [8] * W + [0] * 2
    gate.joined(1, 1)  # mid-way through no draft's first measurement: it goes on
    assert _drive(gate, W - 2, env, batch=1) == [0] * (W - 2)
    gate.joined(4, 3)  # a bucket never seen: nothing to probe, nothing made
    assert "3-4" not in gate.stats()
    _plain_for(gate, env, 0.5)
    gate.joined(1, 1)
    assert _drive(gate, J + 2, env, batch=1) == [0] * J + [8, 8]
    probes = gate._buckets[0].probes
    gate.joined(1, 1)  # mid-probe: the probe runs its course, no second one
    assert _drive(gate, P - 2, env, batch=1) == [8] * (P - 2)
    assert gate._buckets[0].probing is None and gate._buckets[0].probes == probes
    drafting, denv = DraftGate(8), _Env(p=0.9, fixed=0.006, per_row=0.0001)
    _drive(drafting, 300, denv, batch=1)
    before = drafting.stats()["1"]["steps"]
    drafting.joined(1, 1)  # drafting already: no probe (its own steps measure the new text)
    assert drafting._buckets[0].probing is None and drafting.stats()["1"]["steps"] == before
    assert _drive(drafting, 1, denv, batch=1) == [8] and drafting._buckets[0].join_wait == 0  # nor later


def test_a_bucket_s_costs_follow_the_batch_it_is_asked_about():
    gate, env = DraftGate(8), GATE_SIM.LatencyModel(0.6)
    _drive(gate, 200, env, batch=12)
    _drive(gate, 200, env, batch=32)
    b = gate._buckets[5]
    at_32 = b.step_cost(0)
    b.at(17)
    at_17 = b.step_cost(0)
    e = gate._exponent(5, 0)
    assert at_17 == pytest.approx(at_32 * (32 / 17) ** (1 - e), rel=1e-9) and at_17 > 1.5 * at_32


@pytest.mark.parametrize("batch,n", [(1, 2), (0, 0), (True, 1), (2, 1.0), ("1", 1), (4, -1)])
def test_joined_refuses_what_cannot_be_a_batch(batch, n):
    gate = DraftGate(4)
    if (batch, n) == (0, 0):
        gate.joined(0, 0)  # nobody joined: nothing to do
        return
    with pytest.raises(ValueError):
        gate.joined(batch, n)


def test_a_gate_holding_no_draft_probes_only_the_longest():
    """Probes alternate the longest draft and no draft; where no draft is what the gate holds, a probe
    of it measures nothing new, and every probe is of the longest."""
    gate, env = DraftGate(8), _Env(p=0.3, fixed=0.012, per_row=0.0001)  # drafts at 65 % of plain steps' rate
    seq = _drive(gate, 3000, env, batch=1)
    assert gate.stats()["1"]["draft_length"] == 0
    runs = [k for k in range(2 * W + 1, len(seq)) if seq[k] and not seq[k - 1]]  # a probe begins
    assert len(runs) >= 6 and gate.stats()["1"]["probes"] <= len(runs) + 1


def test_steps_measured_as_the_batch_shrank_are_priced_at_the_batch_being_decided():
    """Latency-bound steps (a GPU): a plain step of 17 requests takes about what one of 32 takes, so
    its seconds per request are nearly twice as many. A bucket whose plain steps were last measured
    as a generate's batch shrank to 17, asked about 32 again (the next generate), must not prefer
    drafting steps measured at 32 to them: each step's cost is moved to the batch being decided
    (the step time's growth with the batch from this bucket's and its neighbour's steps). Priced per
    request as measured, the gate drafts 4 tokens at 32 at 75 % of plain steps' rate."""
    runs = {}
    as_measured = type("Gate", (DraftGate,), {"_exponent": lambda self, key, i: 1.0})
    for name, cls in (("moved", DraftGate), ("as measured", as_measured)):
        gate, env = cls(8), GATE_SIM.LatencyModel(0.6)
        _drive(gate, 200, env, batch=12)
        _drive(gate, 200, env, batch=32)
        _drive(gate, 40, env, batch=17)
        runs[name] = _drive(gate, 20, env, batch=32)
    assert _true_best(GATE_SIM.LatencyModel(0.6), DraftGate(8).lengths, batch=32) == 0
    assert runs["moved"] == [0] * 20
    assert runs["as measured"].count(0) < 10, runs  # the test can fail: the gate before this drafted here


def test_the_exponent_of_a_step_s_growth_with_the_batch_is_fitted_and_clamped():
    gate, env = DraftGate(8), GATE_SIM.LatencyModel(0.6)
    assert gate._exponent(5, 0) == 1.0  # nothing measured: seconds per request as measured
    _drive(gate, 100, env, batch=12)
    assert gate._exponent(4, 0) == 1.0  # one bucket only
    _drive(gate, 100, env, batch=32)
    e = gate._exponent(5, 0)
    assert 0 < e < 0.3  # (0.81 / 0.71 ms) over (32 / 12 requests): about 0.13
    assert e == pytest.approx(math.log(env.seconds(32, 0) / env.seconds(12, 0)) / math.log(32 / 12), abs=0.02)
    steep = DraftGate(8)
    _drive(steep, 100, _Env(p=0.6, fixed=0.001, per_row=0.0001), batch=12)  # seconds linear in the batch
    _drive(steep, 100, _Env(p=0.6, fixed=0.001, per_row=0.0001), batch=32)
    assert 0.9 < steep._exponent(5, 0) <= 1.0  # and never past 1


def test_no_draft_far_behind_is_not_probed_and_comes_back_when_drafts_stop_paying():
    gate = DraftGate(8)
    env = _Env(p=0.9, fixed=0.001, per_row=0.0002)  # drafting pays about 4x
    seq = _drive(gate, 2 * W + 10 * E, env)
    assert env.rate(8, 0) < DraftGate.NO_DRAFT_PROBE_WITHIN * env.rate(8, 8)
    assert seq[2 * W:].count(0) == 0  # no token spent re-measuring a plain step
    env.p, env.fixed = 0.05, 0.05  # the drafter stops paying: its own steps show it
    seq = _drive(gate, 300, env)
    assert gate.stats()["5-8"]["draft_length"] == 0 == _true_best(env, gate.lengths)
    assert seq[-30:].count(0) >= 30 - P


def test_buckets_decide_apart_and_a_new_one_starts_from_its_nearest():
    gate = DraftGate(8)
    small = _Env(p=0.8, fixed=0.001, per_row=0.0001)  # batch 1: drafting is nearly free
    large = _Env(p=0.8, fixed=0.3, per_row=0.01)  # batch 32: the same drafts never pay
    for _ in range(60):
        for batch, env in ((1, small), (32, large)):
            n = gate.draft_length(batch)
            gate.record(batch, n, env.accepted(batch, n), env.seconds(batch, n))
    stats = gate.stats()
    assert stats["1"]["draft_length"] == 8 and stats["17-32"]["draft_length"] == 0
    assert gate.draft_length(24) == 0 and gate.draft_length(64) == 0  # 33-64: starts where 17-32 settled
    assert gate.draft_length(2) == 8  # 2: starts where 1 settled


def test_a_bucket_the_batch_shrinks_into_decides_from_every_step_so_far():
    """Acceptance is one estimate over every bucket: a few unlucky first steps at a new batch size
    (here none of their drafts accepted) do not turn the drafter off there."""
    gate = DraftGate(8)
    env = _Env(p=0.9, fixed=0.002, per_row=0.0005)
    _drive(gate, 200, env, batch=8)
    assert gate.stats()["5-8"]["draft_length"] == 8
    for _ in range(2 * W):  # batch 3: its warm-up (the length 5-8 chose, then no draft), all rejected
        n = gate.draft_length(3)
        gate.record(3, n, [0, 0, 0], env.seconds(3, n))
    stats = gate.stats()["3-4"]
    assert set(stats["steps"]) == {0, 8}
    assert stats["draft_length"] == 8 == _true_best(env, gate.lengths, batch=3)
    assert stats["accepted"] == gate.stats()["5-8"]["accepted"]


def test_one_slow_step_does_not_decide():
    """A one-off (a graph capture, a compile) in the longest draft's first steps: its median cost ignores it."""
    gate = DraftGate(8)
    env = _Env(p=0.95, fixed=0.001, per_row=0.0001)
    seq = _drive(gate, 40, env, spike_at=0)
    assert seq[2 * W:] == [8] * (40 - 2 * W)


def test_a_drafter_that_often_drafts_nothing_is_priced_by_all_its_steps():
    """Two steps in five have a draft, all 8 tokens accepted, at ten times a plain step's cost; the
    others have none (a plain step's cost). Drafting: 4.2 tokens per 4.6 plain steps' time, below
    plain steps' 1: no draft wins, though the typical (median) drafting step costs a plain one."""
    gate = DraftGate(8)
    i = 0
    for _ in range(300):
        n = gate.draft_length(1)
        hit = n > 0 and i % 5 in (0, 3)
        i += n > 0
        gate.record(1, n, [n if hit else 0], 10.0 if hit else 1.0)
    assert gate.stats()["1"]["draft_length"] == 0, gate.stats()


@settings(max_examples=80, deadline=None)
@given(max_draft=st.integers(1, 16), p=st.floats(0.05, 0.98), fixed=st.floats(0.0, 0.5),
       per_row=st.floats(0.0001, 0.02), batch=st.sampled_from([1, 3, 8, 24, 64]))
# batch 1, 5-token drafts 1.12x plain steps: a probe's four request-steps once estimated 0.81 accepted
# tokens against the true 1.08, and the gate kept to plain steps for 600 steps (0.89x the best)
@example(max_draft=5, p=0.53125, fixed=0.008167890448615435, per_row=0.0001, batch=1)
def test_after_its_first_measurements_it_runs_within_a_tenth_of_the_best_length(max_draft, p, fixed, per_row,
                                                                              batch):
    """Tokens per second over the steps after the first 100, against the best fixed length's (probes
    and all)."""
    gate = DraftGate(max_draft)
    env = _Env(p, fixed, per_row)
    achieved = []
    _drive(gate, 700, env, batch=batch, achieved=achieved)
    best = max(env.rate(batch, n) for n in gate.lengths)
    got = sum(t for t, _ in achieved[100:]) / sum(s for _, s in achieved[100:])
    assert got >= 0.9 * best, (got, {n: env.rate(batch, n) for n in gate.lengths}, gate.stats())


def test_its_history_keeps_the_last_measured_steps_as_recorded():
    gate = DraftGate(4)
    assert gate.history is None
    gate.record(8, 4, [1] * 8, 0.01)  # not kept: no history asked for yet
    gate.keep_history(3)
    env = _Env(0.6, 0.002, 0.0005)
    taken = _drive(gate, 5, env, batch=8)
    gate.record(8, 0, [0] * 8, 0.004, ahead=True)
    gate.record(8, 0, [0] * 8, 0.0)  # not measured: not kept either
    assert len(gate.history) == 3 and all(isinstance(s, GateStep) for s in gate.history)
    *_, last = gate.history
    b = gate._buckets[bucket_of(8)]
    assert last == GateStep(8, 0, True, 0.004, 0, gate.lengths[b.best()])
    assert [s.length for s in gate.history][:2] == taken[-2:]
    gate.keep_history(10)  # a longer window keeps what it had
    assert len(gate.history) == 3
    gate.keep_history(0)
    assert gate.history is None
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="steps"):
            gate.keep_history(bad)


def test_the_engine_s_gate_keeps_the_steps_it_measured(tiny):
    engine = SpecEngine(tiny, _Slow(), max_num_seqs=8, draft_gate=True)
    engine.draft_gate.keep_history(1000)
    engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=10, ignore_eos=True), chat=False)
    hist = list(engine.draft_gate.history)
    assert hist and all(s.batch in (1, 2) and s.seconds > 0 for s in hist)
    # every generation step is measured (the prompt steps are not)
    assert len(hist) == engine.timings["steps"] - 1
    assert SpecEngine(tiny, _Slow()).draft_gate is None


@pytest.mark.parametrize("max_num_seqs,chunk,tokens", [(1, None, 6), (8, None, 6), (8, 4, 6), (8, None, 1)])
def test_the_engine_tells_its_gate_of_each_request_that_begins_generating(tiny, max_num_seqs, chunk, tokens):
    """Once per request as its prompt finishes (its last chunk where prompts are chunked); not for a
    request whose only token came with its prompt (it never generates beside the others)."""
    engine = SpecEngine(tiny, _Slow(), max_num_seqs=max_num_seqs, draft_gate=True, max_prefill_tokens=chunk)
    calls, real = [], engine.draft_gate.joined
    engine.draft_gate.joined = lambda batch, n: (calls.append((batch, n)), real(batch, n))
    engine.generate(PROMPTS[:3], SamplingParams(max_new_tokens=tokens, ignore_eos=True), chat=False)
    assert sum(n for _, n in calls) == (3 if tokens > 1 else 0)
    assert all(1 <= n <= batch <= max_num_seqs for batch, n in calls)
    if max_num_seqs == 1:  # one at a time: each the whole batch
        assert calls == [(1, 1)] * 3


def test_a_preempted_request_computed_again_is_no_new_request_to_the_gate(tiny):
    """A pool of 12 pages of 4 tokens cannot hold four requests of 40 tokens: the newest is preempted
    and its context computed again when readmitted; its text is the same, so the gate hears of four
    joins, one each."""
    engine = SpecEngine(tiny, _Slow(), max_num_seqs=4, draft_gate=True, tokens_per_block=4, num_pages=12)
    calls, real = [], engine.draft_gate.joined
    engine.draft_gate.joined = lambda batch, n: (calls.append((batch, n)), real(batch, n))
    plans, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda *a, **k: plans.append(schedule(*a, **k)) or plans[-1]
    engine.generate(PROMPTS[:4], SamplingParams(max_new_tokens=32, ignore_eos=True), chat=False)
    assert any(p.preempted for p in plans if p)  # the test can fail: preemptions happened
    assert sum(n for _, n in calls) == 4


def test_the_standard_error_of_accepted_tokens_follows_their_spread_and_count():
    from specdec.draft_gate import _Acceptance

    lengths = draft_lengths(8)
    flat = _Acceptance(lengths, keep=1.0)  # no ageing: plain sample statistics
    for _ in range(10):
        flat.add(4, [3, 3, 3, 3])
    assert flat.mean(4) == pytest.approx(3.0) and flat.stderr(4) == 0.0  # no spread
    spread = _Acceptance(lengths, keep=1.0)
    values = [0, 8, 2, 8, 5, 1, 8, 0]
    for v in values:
        spread.add(4, [v])  # drafted 8: min(a, L) for L = 1, 2, 4, 8 all known
    for i, length in enumerate(lengths[1:], 1):
        m = [min(v, length) for v in values]
        mu = sum(m) / len(m)
        sd = math.sqrt(sum((x - mu) ** 2 for x in m) / len(m))
        assert spread.mean(i) == pytest.approx(mu)
        assert spread.stderr(i) == pytest.approx(sd / math.sqrt(len(m)))
    assert spread.stderr(0) == 0.0
    aged = _Acceptance(lengths, keep=0.5)  # older steps weigh less: fewer request-steps' worth
    for v in values:
        aged.add(4, [v])
    w = [0.5 ** (len(values) - 1 - k) for k in range(len(values))]  # the last step weighs 1
    mu = sum(wk * v for wk, v in zip(w, values)) / sum(w)
    var = sum(wk * (v - mu) ** 2 for wk, v in zip(w, values)) / sum(w)
    assert aged.stderr(4) == pytest.approx(math.sqrt(var * sum(wk * wk for wk in w)) / sum(w))
    assert aged.stderr(4) > spread.stderr(4)
    one = _Acceptance(lengths, keep=1.0)
    one.add(4, [5])
    assert one.stderr(4) == 0.0  # a single request-step: no spread to read


def test_optimism_is_a_finite_number_at_least_zero():
    assert DraftGate(4).optimism == DraftGate.OPTIMISM and DraftGate(4, optimism=0).optimism == 0.0
    for bad in (-0.5, math.inf, math.nan, "1", True):
        with pytest.raises(ValueError, match="optimism must be"):
            DraftGate(4, optimism=bad)


def test_steps_without_a_measurement_are_ignored():
    gate = DraftGate(8)
    gate.record(4, 8, [1, 2], 0.0)
    gate.record(4, 8, [1, 2], float("nan"))
    gate.record(4, 3, [1, 2], 1.0)  # not one of its lengths
    gate.record(4, 8, [], 1.0)  # no request
    assert gate.stats() == {}


# -- in the engine -------------------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(p=st.floats(0.05, 0.95), fixed=st.floats(0.0, 1.0), per_row=st.floats(0.0, 0.02),
       steps=st.integers(10, 600), batch=st.sampled_from([1, 3, 8, 32]))
def test_a_plain_step_it_promises_is_the_step_it_then_takes(p, fixed, per_row, steps, batch):
    """``plain_next`` (an overlapped engine launches the next step ahead on it) never promises a plain
    step the gate would not take once the current one is recorded."""
    gate, env = DraftGate(8), _Env(p, fixed, per_row)
    for _ in range(steps):
        n = gate.draft_length(batch)
        promised = gate.plain_next(batch)
        assert not promised or n == 0
        gate.record(batch, n, env.accepted(batch, n), env.seconds(batch, n))
        if promised:
            assert gate.draft_length(batch) == 0


def test_a_gate_that_holds_no_draft_promises_nearly_every_next_plain_step():
    gate = DraftGate(8)
    env = _Env(p=0.3, fixed=0.5, per_row=0.01)  # a propose that costs six plain steps: plain steps win
    plain = promised = 0
    for _ in range(2 * W + 1500):
        n = gate.draft_length(8)
        if n == 0:
            plain += 1
            promised += gate.plain_next(8)
        gate.record(8, n, env.accepted(8, n), env.seconds(8, n))
    assert gate.stats()["5-8"]["draft_length"] == 0
    assert promised >= 0.9 * plain, (promised, plain)


def test_no_plain_step_is_promised_where_drafting_leads():
    gate = DraftGate(8)
    env = _Env(p=0.9, fixed=0.001, per_row=0.0005)
    for _ in range(2 * W + 200):
        n = gate.draft_length(8)
        if n:
            assert not gate.plain_next(8)
        gate.record(8, n, env.accepted(8, n), env.seconds(8, n))
    assert gate.stats()["5-8"]["draft_length"] == 8


class _Chaining(_Env):
    """:class:`_Env` in an engine that chains: a plain step launched ahead of the last costs
    ``chained`` times a plain step that is not (its host work hides behind the GPU's)."""

    def __init__(self, p: float, fixed: float, per_row: float, chained: float, plain: float = 0.01):
        super().__init__(p, fixed, per_row, plain)
        self.chained = chained

    def step_seconds(self, batch: int, length: int, ahead: bool) -> float:
        return self.seconds(batch, length) * (self.chained if ahead else 1.0)


def _drive_chaining(gate: DraftGate, steps: int, env: _Chaining, batch: int = 8, tell: bool = True,
                    check_promises: bool = False, chains: bool = True, decline_every: int = 0) -> list[int]:
    """As an overlapped engine runs the gate: a step is launched ahead (chained) when the gate
    promised it plain during the last one (``chains=False``: never, as an engine that declines;
    ``decline_every=N``: every N-th promise declined, as at a request's last token);
    ``tell``: the gate hears which were (``ahead``)."""
    out, ahead, promises = [], False, 0
    for _ in range(steps):
        n = 0 if ahead else gate.draft_length(batch)
        promised = n == 0 and gate.plain_next(batch) and chains
        if promised and decline_every:
            promises += 1
            promised = promises % decline_every != 0
        gate.record(batch, n, env.accepted(batch, n), env.step_seconds(batch, n, ahead), **({"ahead": ahead} if tell else {}))
        if check_promises and promised:
            assert gate.draft_length(batch) == 0
        out.append(n)
        ahead = promised
    return out


def test_chained_plain_steps_are_priced_apart_from_the_first_of_a_run():
    """Chained plain steps cost 0.4 of an unchained one; drafting 8 tokens lies between the two.
    Told which steps were chained, the gate settles on plain steps, nearly all chained; mixing both
    kinds into one cost (the first of every run of plain steps is unchained), it keeps drafting."""
    env = _Chaining(p=0.8, fixed=0.06, per_row=0.0005, chained=0.4)
    plain_u = env.rate(8, 0)  # an unchained plain step's tokens/s, and a chained one's, against 8 drafts
    assert plain_u < max(env.rate(8, n) for n in (1, 2, 4, 8)) == env.rate(8, 8) < plain_u / 0.4
    told = _drive_chaining(DraftGate(8), 2 * W + 600, env)
    mixed = _drive_chaining(DraftGate(8), 2 * W + 600, _Chaining(p=0.8, fixed=0.06, per_row=0.0005, chained=0.4),
                            tell=False)
    assert told[-300:].count(0) > 0.9 * 300, told[-300:]
    assert mixed[-300:].count(0) < 0.2 * 300, mixed[-300:]


def test_one_slow_chained_step_does_not_start_drafting():
    """A pause in one chained plain step (a collector, the host descheduled: 15x its cost) is left out
    of the chained price, where a 16x cut let it double the window's mean and drafting, at 0.6x
    plain steps' rate, took over (H100, Spec-Bench at batch 32)."""
    gate = DraftGate(8)
    env = _Chaining(p=0.5, fixed=0.02, per_row=0.0005, chained=0.4)
    _drive_chaining(gate, 2 * W + 60, env, batch=32)
    b = gate._buckets[bucket_of(32)]
    assert b.chaining and gate.draft_length(32) == 0
    drafting = max(b.rate(j) for j in range(1, len(gate.lengths)))
    assert drafting < 0.75 * b.plain_rate() < 2 * drafting  # a doubled plain price would flip it
    assert gate.plain_next(32)
    gate.record(32, 0, env.accepted(32, 0), 15 * env.step_seconds(32, 0, True), ahead=True)
    assert gate.draft_length(32) == 0
    seq = _drive_chaining(gate, 50, env, batch=32)
    assert seq.count(0) == 50


def test_when_the_engine_stops_chaining_no_draft_is_priced_unchained_again():
    """An engine that declines to chain (requests waiting, a preemption) runs plain steps unchained:
    its declines soon outnumber the chained steps, no draft is priced at their cost again, and the
    gate goes back to drafting."""
    gate = DraftGate(8)
    env = _Chaining(p=0.8, fixed=0.06, per_row=0.0005, chained=0.4)
    chained = _drive_chaining(gate, 2 * W + 400, env)
    assert chained[-200:].count(0) > 0.9 * 200
    declined = _drive_chaining(gate, 400, env, chains=False)
    assert declined[-300:].count(0) < 0.1 * 300, declined[-300:]


def test_a_few_declined_chains_do_not_unprice_the_chained_plain_steps():
    """Requests that end decline a chained step now and then (one promise in 12 here): the plain
    regime stays chained but for those, and the gate stays in it."""
    gate = DraftGate(8)
    env = _Chaining(p=0.8, fixed=0.06, per_row=0.0005, chained=0.4)
    taken = _drive_chaining(gate, 2 * W + 800, env, decline_every=12)
    assert taken[-400:].count(0) > 0.9 * 400, taken[-400:]
    b = gate._buckets[bucket_of(8)]
    assert 0 < b.declined() < 0.2 and b.chaining
    # priced between the two costs, near the chained one
    chained, unchained = b.chained_cost(), b.measured_cost(0)
    assert chained < 1 / b.plain_rate() < chained + 0.2 * (unchained - chained)


def test_a_chain_declined_at_the_end_of_a_generate_leaves_the_plain_regime_priced_chained():
    """A request's last token declines a chained step; when that is the bucket's last step (the batch
    then ends or leaves the bucket), the next step in the bucket, a new ``generate``'s, still finds
    the plain regime priced as chained and takes it (a latch cleared by one decline sent it back to
    drafting for good: its plain steps were never promised again)."""
    gate = DraftGate(8)
    env = _Chaining(p=0.8, fixed=0.06, per_row=0.0005, chained=0.4)
    _drive_chaining(gate, 2 * W + 100, env)
    assert gate.plain_next(8)
    gate.record(8, 0, env.accepted(8, 0), env.step_seconds(8, 0, False))  # promised, not chained
    assert gate.draft_length(8) == 0 and gate.plain_next(8)


def test_an_engine_that_stops_chaining_is_not_left_with_a_half_chained_price():
    """Where no draft leads by under the chaining margin once the engine declines half its promises,
    no plain step is promised any more and the declined share stops moving: the plain steps are then
    priced as what they are, unchained, and the gate goes back to drafting."""
    for fixed in (0.135, 0.15, 0.165, 0.18, 0.195):
        gate = DraftGate(8)
        env = _Chaining(p=0.8, fixed=fixed, per_row=0.0005, chained=0.4)
        _drive_chaining(gate, 2 * W + 400, env)
        declined = _drive_chaining(gate, 600, env, chains=False)
        assert declined[-300:].count(0) < 0.1 * 300, (fixed, declined[-300:].count(0))


def test_a_bucket_begun_by_chained_steps_still_prices_drafts():
    """The batch changes while plain steps chain: the new bucket's first plain steps are all chained,
    and its drafting lengths are still priced (interpolated from the chained cost) and measured."""
    gate = DraftGate(8)
    env = _Chaining(p=0.8, fixed=0.06, per_row=0.0005, chained=0.4)
    _drive_chaining(gate, 2 * W + 100, env, batch=8)
    b = gate._buckets[bucket_of(8)]
    assert b.chaining and gate.plain_next(8)
    ahead = True  # the step launched ahead now runs 3 requests (5 of them finished)
    gate.record(3, 0, env.accepted(3, 0), env.step_seconds(3, 0, ahead), ahead=ahead)
    small = gate._buckets[bucket_of(3)]
    assert not small.cost[0] and small.chained
    assert all(small.step_cost(j) is not None for j in range(len(gate.lengths)))
    _drive_chaining(gate, 2 * W + 200, env, batch=3)
    assert small.cost[gate.lengths.index(8)], "the longest draft was measured"


@settings(max_examples=60, deadline=None)
@given(p=st.floats(0.05, 0.95), fixed=st.floats(0.0, 1.0), per_row=st.floats(0.0, 0.02),
       chained=st.floats(0.2, 1.0), steps=st.integers(10, 500), batch=st.sampled_from([1, 3, 8, 32]))
def test_a_chaining_engine_is_promised_only_plain_steps_the_gate_takes(p, fixed, per_row, chained, steps, batch):
    """The promise property (above) where promised steps are chained and cheaper."""
    _drive_chaining(DraftGate(8), steps, _Chaining(p, fixed, per_row, chained), batch, check_promises=True)


def test_draft_gate_must_be_a_bool_or_none():
    with pytest.raises(ConfigError, match="draft_gate must be True, False or None"):
        EngineConfig(draft_gate="yes")
    assert EngineConfig().draft_gate is None
    for multi_rank in ({"helix_cp": 2}, {"attention_tp": 2}):  # each rank would decide from its own step times
        with pytest.raises(ConfigError, match="draft_gate=True is not supported with helix_cp > 1"):
            EngineConfig(draft_gate=True, **multi_rank)
        assert EngineConfig(draft_gate=False, **multi_rank).draft_gate is False


class _Slow(SuffixAutomatonDrafter):
    """The suffix drafter with a propose that costs 20 ms: drafting can never pay on the tiny target."""

    def __init__(self):
        super().__init__()
        self.proposes = 0

    def propose(self, req_ids, max_tokens):
        self.proposes += 1
        time.sleep(0.02)
        return super().propose(req_ids, max_tokens)


class _Oracle(Drafter):
    """Proposes the known continuation of each prompt: drafting emits up to k + 1 tokens a step."""

    def __init__(self, truth: dict[tuple, list[int]]):
        self.truth, self.req, self.pos = truth, {}, {}

    def start_request(self, req_id, prompt_token_ids):
        self.req[req_id], self.pos[req_id] = tuple(prompt_token_ids), 0

    def propose(self, req_ids, max_tokens):
        return [Draft(tuple(self.truth[self.req[r]][self.pos[r]:self.pos[r] + max_tokens])) for r in req_ids]

    def on_accepted(self, req_id, token_ids):
        self.pos[req_id] += len(token_ids)


PROMPTS = [[1 + i, 2, 3, 4, 1 + i, 2, 3] for i in range(8)]


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("overlap", [False, True])  # True: the plain steps it takes are chained
def test_a_drafter_that_cannot_pay_is_left_out_and_outputs_stay_the_null_drafters(tiny, seeded, overlap):
    params = (SamplingParams(max_new_tokens=60, ignore_eos=True, temperature=0.8, seed=3) if seeded
              else SamplingParams(max_new_tokens=60, ignore_eos=True))
    base = SpecEngine(tiny, NullDrafter(), max_num_seqs=8).generate(PROMPTS, params, chat=False)
    drafter = _Slow()
    engine = SpecEngine(tiny, drafter, max_num_seqs=8, draft_gate=True, overlap_steps=overlap)
    outs = engine.generate(PROMPTS, params, chat=False)
    assert (engine.timings["overlapped_steps"] > 20) == overlap, engine.timings
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    stats = engine.draft_gate_stats["5-8"]
    assert stats["draft_length"] == 0
    drafted = sum(n for k, n in stats["steps"].items() if k)
    assert stats["steps"][0] > 2 * drafted, stats
    assert drafter.proposes <= drafted + 2  # a plain step does not call propose
    # the engine tells the gate which plain steps were launched ahead of the last
    assert (stats["chained"] > stats["steps"][0] // 2) if overlap else stats["chained"] == 0, stats


def test_a_drafter_that_pays_keeps_drafting(tiny):
    params = SamplingParams(max_new_tokens=80, ignore_eos=True)
    base = SpecEngine(tiny, NullDrafter(), max_num_seqs=8).generate(PROMPTS, params, chat=False)
    truth = {tuple(p): list(o.token_ids) for p, o in zip(PROMPTS, base)}
    engine = SpecEngine(tiny, _Oracle(truth), max_num_seqs=8, max_draft_tokens=8, draft_gate=True)
    outs = engine.generate(PROMPTS, params, chat=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    stats = engine.draft_gate_stats["5-8"]
    assert stats["draft_length"] == 8 and stats["tok_s"][8] > 2 * stats["tok_s"][0], stats
    assert stats["accepted"][8] > 6, stats  # the oracle's drafts are all accepted but near the end


def test_chained_steps_behind_the_gate_end_and_admit_requests_as_plain_steps_do(tiny):
    """End of sequence, length limits and late arrivals (3 slots for 6 requests) while the plain
    steps the gate takes are chained: the null drafter's outputs, nothing leaked."""
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [5], [40, 41], [3, 3, 3, 3]]
    params = [SamplingParams(max_new_tokens=n) for n in (30, 1, 12, 2, 45, 20)]  # EOS may end any of them
    base = SpecEngine(tiny, NullDrafter(), max_num_seqs=3).generate(prompts, params, chat=False)
    engine = SpecEngine(tiny, _Slow(), max_num_seqs=3, draft_gate=True, overlap_steps=True)
    outs = engine.generate(prompts, params, chat=False)
    assert [(o.token_ids, o.finish_reason) for o in outs] == [(o.token_ids, o.finish_reason) for o in base]
    assert engine.timings["overlapped_steps"] > 5, engine.timings
    assert engine.manager.num_free_pages == engine.manager.num_pages and not engine.executor.in_flight


def test_without_the_gate_every_step_drafts_and_there_are_no_stats(tiny):
    drafter = _Slow()
    engine = SpecEngine(tiny, drafter, max_num_seqs=8)
    engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=10, ignore_eos=True), chat=False)
    assert engine.draft_gate_stats is None
    # every step but the prompts' and the last (one token left: nothing to draft)
    assert drafter.proposes == engine.timings["steps"] - 2


@pytest.mark.parametrize("setting", [None, True, False])
def test_by_default_block_drafters_are_gated_and_the_suffix_drafter_is_not(tiny3, setting):
    """``draft_gate=None`` (the default) follows the drafter's ``gated_by_default``; True or False
    overrides it either way."""
    block = DFlashDrafter(init_weights(BlockDrafterNet(_block_cfg(0)), seed=1))
    for drafter, declared in ((block, True), (SuffixAutomatonDrafter(), False)):
        assert type(drafter).gated_by_default is declared
        engine = SpecEngine(tiny3, drafter, max_num_seqs=4, draft_gate=setting)
        engine.generate([[1, 2, 3, 4, 1, 2, 3]], SamplingParams(max_new_tokens=12, ignore_eos=True), chat=False)
        gated = declared if setting is None else setting
        assert (engine.draft_gate is not None) is gated
        assert (engine.draft_gate_stats is not None) is gated


def test_the_null_drafter_has_no_gate(tiny):
    engine = SpecEngine(tiny, NullDrafter(), draft_gate=True)
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4), chat=False)
    assert engine.draft_gate_stats is None


# -- a block drafter left out of steps keeps its context ------------------------------------------
class _Scripted(DraftGate):
    """Drafts ``max_draft`` tokens in runs of ``on`` steps, then leaves ``off`` steps plain, whatever is measured."""

    def __init__(self, max_draft: int, on: int, off: int):
        super().__init__(max_draft)
        self.on, self.off, self.asked = on, off, 0

    def draft_length(self, batch: int) -> int:
        self.asked += 1
        return self.lengths[-1] if (self.asked - 1) % (self.on + self.off) < self.on else 0

    def plain_next(self, batch: int) -> bool:  # the next step, launched ahead, takes its turn
        if self.asked % (self.on + self.off) >= self.on:
            self.asked += 1
            return True
        return False


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory):
    """The tiny Llama with 3 layers (the block drafters read layers 0 and 2) and a usable logit scale."""
    return tiny_llama(tmp_path_factory.mktemp("tiny3"), "cpu", num_hidden_layers=3, max_position_embeddings=160,
                      initializer_range=0.3)


def _block_cfg(shift: int) -> BlockDrafterConfig:
    return BlockDrafterConfig(block_size=4, shift_label=shift, target_layer_ids=(0, 2), target_hidden_size=32,
                              vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                              intermediate_size=64)


@pytest.mark.parametrize("cls,shift", [(DFlashDrafter, 0), (DSparkDrafter, 1)])
@pytest.mark.parametrize("off", [1, 7, 25])  # 7, 25: more staged positions than a propose writes in its graph
@pytest.mark.parametrize("overlap", [False, True])  # True: the plain steps are launched ahead, chained
@pytest.mark.parametrize("stage", [False, True])  # True: context writes staged for the proposes, as on CUDA
def test_a_block_drafter_left_out_of_steps_keeps_every_accepted_position(tiny3, cls, shift, off, overlap, stage):
    engine = _left_out_of_steps(tiny3, cls(init_weights(BlockDrafterNet(_block_cfg(shift)), seed=1)), off, overlap,
                                one_buffer=overlap, stage=stage)  # as a CUDA graph's replay writes its output buffer
    chained = engine.timings["overlapped_steps"]
    assert (chained >= 4 if overlap and off >= 7 else chained == 0), chained  # off=1: no two plain steps in a row


@pytest.mark.parametrize("overlap", [False, True])
def test_a_block_drafter_s_staging_ring_coming_round_in_plain_steps_loses_nothing(tiny3, overlap):
    """A staging ring of 7 rows (3 requests accepting one token a plain step): it comes round every
    other plain step, writing whatever is staged; context K/V and outputs as before."""
    drafter = DFlashDrafter(init_weights(BlockDrafterNet(_block_cfg(0)), seed=1))
    writes = []
    engine = _left_out_of_steps(tiny3, drafter, 25, overlap, one_buffer=overlap, stage=True, ring=7, writes=writes)
    assert len(writes) >= 8 and engine.timings["overlapped_steps"] >= (4 if overlap else 0)


def _left_out_of_steps(target, drafter, off: int, overlap: bool, one_buffer: bool = False,
                       tokens_per_block: int | None = None, stage: bool = False, ring: int | None = None,
                       writes: list | None = None):
    """Generate beside the null drafter under a gate that drafts 2 steps in every ``2 + off``; mid-way,
    the drafter's context K/V of one request must equal its projection of the target's hidden states
    recomputed, and every output must equal null's. ``one_buffer``: the runner's eager steps return
    their hidden states in one buffer every step overwrites (:func:`_hidden_in_one_buffer`). ``stage``:
    the block drafter stages its context writes for its proposes, as on CUDA (a scratch slot is made for
    it); ``ring``: its staging ring cut to that many rows; ``writes``: its eager writes are listed there."""
    prompts = [[1, 2, 3, 4, 5, 6, 1, 2, 3, 4], [7, 8, 9], list(range(10, 40))]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    kw = {} if tokens_per_block is None else {"tokens_per_block": tokens_per_block}
    base = SpecEngine(target, NullDrafter(), **kw).generate(prompts, params, chat=False)
    engine = SpecEngine(target, drafter, max_draft_tokens=4, draft_gate=True, overlap_steps=overlap, **kw)
    assert engine.executor.name == ("overlap" if overlap else "plain")
    engine._gate = engine.executor.gate = gate = _Scripted(4, on=2, off=off)
    if one_buffer:
        _hidden_in_one_buffer(engine.runner)
    if stage and not drafter._defer:  # staged context writes as on CUDA: the drafter's KV needs a scratch slot
        kv = drafter.kv
        if kv.shared:
            kv.manager.allocate("scratch", 1)
            kv.scratch_slot = kv.manager.slots("scratch", 0, 1)[0]
        else:
            kv.scratch_slot = kv.manager.num_pages * kv.tokens_per_block
        drafter.bind(target, kv)
        assert drafter._defer
    if ring is not None:
        drafter._ctx_stage = drafter._ctx_stage[:ring]
    if writes is not None:
        real_write = drafter._write
        drafter._write = lambda hidden, runs: (writes.append(runs), real_write(hidden, runs))
    rid = engine.add_request(prompts[0], params, chat=False)
    others = [engine.add_request(p, params, chat=False) for p in prompts[1:]]
    checked = False
    while engine.has_unfinished():
        engine.step()
        seq = engine._seqs[rid]
        if not checked and seq.num_output >= 24:  # mid-generation, after plain steps: a propose brings it up to date
            checked = True
            n = seq.num_cached
            drafter.propose([rid], 1)
            hidden = target_hidden_states(target, seq.tokens[:n], drafter.target_layer_ids)
            with torch.inference_mode():
                k, _ = drafter.net.context_kv(0, drafter.net.project_context(hidden), torch.arange(n, device=hidden.device))
            torch.testing.assert_close(engine.draft_kv.k(0)[engine.draft_kv.slots(rid, 0, n)], k,
                                       rtol=1e-4, atol=1e-5)
    outs = [engine.release(r) for r in [rid, *others]]
    assert checked and [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert gate.asked > 10 and sum(o.stats.drafted for o in outs) > 0
    return engine


def _hidden_in_one_buffer(runner) -> None:
    """Make ``runner``'s eager steps return their hidden states in one buffer that every step
    overwrites, as a CUDA graph's replay writes its output buffer: a drafter that read them after the
    next step was queued would read the next step's."""
    eager, buf = runner._eager, {}

    def run(step, ids_from=None):
        r = eager(step, ids_from)
        if r.hidden is not None:
            n, width = r.hidden.shape
            b = buf.get(width)
            if b is None or b.shape[0] < n:
                b = buf[width] = r.hidden.new_empty(max(n, 256), width)
            b[:n].copy_(r.hidden)
            r.hidden = b[:n]
        return r

    runner._eager = run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (graph replays reuse their output "
                    "buffers; the CPU twin, test_a_block_drafter_left_out_of_steps_keeps_every_accepted_position "
                    "with overlap=True, emulates that with one buffer)")
@pytest.mark.parametrize("cls,shift", [(DFlashDrafter, 0), (DSparkDrafter, 1)])
def test_chained_plain_steps_on_the_gpu_hand_the_drafter_each_step_s_own_hidden_states(tmp_path, cls, shift):
    """With CUDA graphs the step launched ahead replays into the buffer the current step's hidden
    states sit in: the drafter must still get the current step's. Its context K/V, checked mid-way
    against the target's hidden states recomputed, and every output equal null's (fp32)."""
    # the shapes the GPU's graph tests use (head_dim 16)
    target = tiny_llama(tmp_path, "cuda", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2, num_hidden_layers=3, max_position_embeddings=1024,
                        initializer_range=0.3)
    cfg = BlockDrafterConfig(block_size=4, shift_label=shift, target_layer_ids=(0, 2), target_hidden_size=64,
                             vocab_size=64, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                             intermediate_size=96)
    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        drafter = cls(init_weights(BlockDrafterNet(cfg), seed=1))
        engine = _left_out_of_steps(target, drafter, off=7, overlap=True, tokens_per_block=16)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert engine.runner.stats["graph_steps"] > 0 and drafter.stats["graph_proposes"] > 0
    assert engine.timings["overlapped_steps"] >= 4


def test_the_gate_simulation_bench_runs(tmp_path):
    """``bench/gate_sim.py`` (the gate against the model above, with and without its optimism): two
    cases of each set, its table and JSON written."""
    import json

    sim = GATE_SIM
    assert sim.main(["--cases", "2", "--steps", "150", "--seed", "3", "--request-cases", "2", "--batch-cases", "2",
                     "--unsuited-requests", "3", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "gate_sim.md").read_text()
    assert table.count("| broad (2) |") == 2 and table.count("| near (2) |") == 2
    assert "| streaks, noisy | told (the default) |" in table and "| independent | not told of new requests |" in table
    data = json.loads((tmp_path / "gate_sim.json").read_text())
    fixed = {k: r for k, r in data["ratios"].items() if "/" in k and k.split("/")[0] in ("broad", "near")}
    moves = {k: r for k, r in data["ratios"].items() if k.startswith("batch_moves/")}
    assert len(moves) == 3 and all(len(r) == 2 and all(0 < x <= 1.0001 for x in r) for r in moves.values())
    assert "| gate |" in table and "| gate-per-request |" in table
    unsuited = {k: r for k, r in data["ratios"].items() if k.startswith("unsuited/")}
    assert len(unsuited) == 2 and all(len(r) == 3 and all(0 < a <= 1.01 and 0 < b <= 1.01 for a, b in r)
                                      for r in unsuited.values())
    runs = {k: r for k, r in data["ratios"].items() if k.startswith("requests/")}
    assert len(fixed) == 4 and all(len(r) == 2 and all(0 < x <= 1.5 for x in r) for r in fixed.values())
    # per run: over the best fixed length (may beat it: requests differ), over each request's best (<= 1)
    # (noisy runs' draws may be luckier than their expected rates: a little over each request's best)
    assert len(runs) == 12 and all(len(r) == 2 and all(0 < a <= 2 and 0 < b <= (1.05 if "noisy" in k else 1.0001)
                                                      for a, b in r) for k, r in runs.items())
    assert DraftGate.OPTIMISM == 0.5  # each case builds its gate with its own optimism; the default stays
