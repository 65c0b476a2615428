"""`EngineConfig.draft_gate`: steps draft only where drafting has been measured to emit more tokens
per second than plain steps, per batch-size bucket; outputs never change."""

from __future__ import annotations

import time

import pytest
import torch
import transformers
from hypothesis import given, settings, strategies as st

from specdec import EngineConfig, SamplingParams, SpecEngine
from specdec.draft_gate import DraftGate, bucket_label, bucket_of, draft_lengths
from specdec.drafters import Draft, Drafter, NullDrafter, SuffixAutomatonDrafter
from specdec.drafters.block import BlockDrafterConfig, BlockDrafterNet, init_weights
from specdec.drafters.dflash import DFlashDrafter, DSparkDrafter
from specdec.errors import ConfigError
from specdec.target import load_target
from specdec.drafters.training import target_hidden_states


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


def _drive(gate: DraftGate, steps: int, rate, batch: int = 8) -> list[int]:
    """``steps`` decisions, each recorded at ``rate(length, i)`` tokens/s; the lengths chosen."""
    out = []
    for i in range(steps):
        n = gate.draft_length(batch)
        gate.record(batch, n, 10, 10 / rate(n, i))
        out.append(n)
    return out


def _peaked(at: int):
    """Tokens/s that rise to a peak at draft length ``at`` and fall after it."""
    return lambda n, i: 100.0 / (1.0 + abs(n - at))


W, E, P = DraftGate.WARMUP, DraftGate.PROBE_EVERY, DraftGate.PROBE_STEPS


def test_a_new_bucket_measures_both_ends_then_climbs_to_the_peak():
    gate = DraftGate(8)  # lengths 0, 1, 2, 4, 8
    seq = _drive(gate, 5 * W + 10, _peaked(2))
    # the longest (where it starts), no draft; 0 leads: its neighbour 1, then 2, whose neighbour 4 is worse
    assert seq[:5 * W] == [8] * W + [0] * W + [1] * W + [2] * W + [4] * W
    assert seq[5 * W:] == [2] * 10
    stats = gate.stats()["5-8"]
    assert stats["draft_length"] == 2 and stats["steps"] == {0: W, 1: W, 2: W + 10, 4: W, 8: W}


def test_a_drafter_that_never_pays_goes_to_plain_steps_and_probes_drafting():
    gate = DraftGate(8)
    seq = _drive(gate, 3 * W + 2 * E, lambda n, i: 100.0 if n == 0 else 50.0 / n)
    assert seq[:3 * W] == [8] * W + [0] * W + [1] * W
    rest = seq[3 * W:]  # plain steps, about E of them in all (with 0's first W), then a probe: 1 (0's
    first = rest.index(1)  # neighbour and the best drafting length) and the longest
    assert E - W <= first <= E and rest[:first] == [0] * first
    assert rest[first:first + 2 * P + 1] == [1] * P + [8] * P + [0]
    assert gate.stats()["5-8"]["draft_length"] == 0


def test_probes_follow_a_peak_that_moves():
    gate = DraftGate(8)
    switch = 200
    seq = _drive(gate, 1200, lambda n, i: _peaked(1 if i < switch else 8)(n, i))
    assert seq[switch - 20:switch] == [1] * 20
    tail = seq[-4 * E:]  # climbed back up through 2 and 4, a probe at a time; now 8 but for probes
    assert sum(n != 8 for n in tail) <= 4 * 2 * P
    assert gate.stats()["5-8"]["draft_length"] == 8


def test_buckets_decide_apart_and_a_new_one_starts_from_its_nearest():
    gate = DraftGate(8)
    for _ in range(60):
        for batch, peak in ((1, 8), (32, 0)):
            n = gate.draft_length(batch)
            gate.record(batch, n, 10, 10 / _peaked(peak)(n, 0))
    stats = gate.stats()
    assert stats["1"]["draft_length"] == 8 and stats["17-32"]["draft_length"] == 0
    assert gate.draft_length(24) == 0 and gate.draft_length(64) == 0  # 33-64: starts where 17-32 settled
    assert gate.draft_length(2) == 8  # 2: starts where 1 settled


def test_one_slow_step_does_not_decide():
    """A one-off (a graph capture, a compile) in the first measured steps: the median ignores it."""
    gate = DraftGate(8)
    seq = _drive(gate, 40, lambda n, i: 0.5 if i == 0 else (300.0 if n == 8 else 100.0))
    assert seq[:3 * W] == [8] * W + [0] * W + [4] * W and seq[3 * W:] == [8] * (40 - 3 * W)


def test_steps_of_all_or_nothing_are_weighed_by_their_tokens_not_their_typical_step():
    """Drafting 8 emits 13 tokens in two steps of five and 1 in the others, each step 3 s: 1.93 tokens/s,
    though its typical (median) step gives 0.33; drafting 2 emits 2 tokens in 1.2 s every step (1.67)."""
    gate = DraftGate(8)
    per_step = {0: (1, 1.0), 1: (1.5, 1.1), 2: (2, 1.2), 4: (1.5, 1.0)}
    chosen = []
    for i in range(400):
        n = gate.draft_length(8)
        tokens, seconds = (13 if i % 5 in (0, 3) else 1, 3.0) if n == 8 else per_step[n]
        gate.record(8, n, tokens, seconds)
        chosen.append(n)
    assert gate.stats()["5-8"]["draft_length"] == 8
    assert chosen[-100:].count(8) >= 100 - 3 * P


@settings(max_examples=60, deadline=None)
@given(max_draft=st.integers(1, 16), peak=st.integers(0, 16), scale=st.floats(1.0, 1e5),
       steps=st.integers(300, 1500), data=st.data())
def test_after_the_climb_the_peak_takes_all_but_the_probes(max_draft, peak, scale, steps, data):
    gate = DraftGate(max_draft)
    lengths = gate.lengths
    best = min(lengths, key=lambda n: abs(n - peak))
    rate = {n: scale / (1.0 + abs(n - best)) for n in lengths}
    seq = _drive(gate, steps, lambda n, i: rate[n])
    climb = W * len(lengths)  # at most every length measured once on the way
    off = sum(n != best for n in seq[climb:])
    assert off <= 4 * P * (steps // E + 1), (off, seq[:climb + 10])  # a probe: up to four lengths
    assert gate.stats()["5-8"]["draft_length"] == best


def test_unmeasurable_steps_and_unknown_lengths_are_ignored():
    gate = DraftGate(8)
    gate.record(4, 8, 10, 0.0)
    gate.record(4, 8, 10, float("nan"))
    gate.record(4, 3, 10, 1.0)  # not one of its lengths
    assert gate.stats() == {}


# -- in the engine -------------------------------------------------------------------------------
def test_draft_gate_must_be_a_bool():
    with pytest.raises(ConfigError, match="draft_gate"):
        EngineConfig(draft_gate="yes")


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
def test_a_drafter_that_cannot_pay_is_left_out_and_outputs_stay_the_null_drafters(tiny, seeded):
    params = (SamplingParams(max_new_tokens=60, ignore_eos=True, temperature=0.8, seed=3) if seeded
              else SamplingParams(max_new_tokens=60, ignore_eos=True))
    base = SpecEngine(tiny, NullDrafter(), max_num_seqs=8).generate(PROMPTS, params, chat=False)
    drafter = _Slow()
    engine = SpecEngine(tiny, drafter, max_num_seqs=8, draft_gate=True)
    outs = engine.generate(PROMPTS, params, chat=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    stats = engine.draft_gate_stats["5-8"]
    assert stats["draft_length"] == 0
    drafted = sum(n for k, n in stats["steps"].items() if k)
    assert stats["steps"][0] > 2 * drafted, stats
    assert drafter.proposes <= drafted + 2  # a plain step does not call propose


def test_a_drafter_that_pays_keeps_drafting(tiny):
    params = SamplingParams(max_new_tokens=80, ignore_eos=True)
    base = SpecEngine(tiny, NullDrafter(), max_num_seqs=8).generate(PROMPTS, params, chat=False)
    truth = {tuple(p): list(o.token_ids) for p, o in zip(PROMPTS, base)}
    engine = SpecEngine(tiny, _Oracle(truth), max_num_seqs=8, max_draft_tokens=8, draft_gate=True)
    outs = engine.generate(PROMPTS, params, chat=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    stats = engine.draft_gate_stats["5-8"]
    assert stats["draft_length"] >= 4 and stats["tok_s"][8] > stats["tok_s"][4], stats


def test_without_the_gate_every_step_drafts_and_there_are_no_stats(tiny):
    drafter = _Slow()
    engine = SpecEngine(tiny, drafter, max_num_seqs=8)
    engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=10, ignore_eos=True), chat=False)
    assert engine.draft_gate_stats is None
    # every step but the prompts' and the last (one token left: nothing to draft)
    assert drafter.proposes == engine.timings["steps"] - 2


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


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny3")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=160,
                                   initializer_range=0.3)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return load_target(path)


def _block_cfg(shift: int) -> BlockDrafterConfig:
    return BlockDrafterConfig(block_size=4, shift_label=shift, target_layer_ids=(0, 2), target_hidden_size=32,
                              vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                              intermediate_size=64)


@pytest.mark.parametrize("cls,shift", [(DFlashDrafter, 0), (DSparkDrafter, 1)])
@pytest.mark.parametrize("off", [1, 7])  # 7: past the steps a propose's staged context writes can wait
def test_a_block_drafter_left_out_of_steps_keeps_every_accepted_position(tiny3, cls, shift, off):
    prompts = [[1, 2, 3, 4, 5, 6, 1, 2, 3, 4], [7, 8, 9], list(range(10, 40))]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    base = SpecEngine(tiny3, NullDrafter()).generate(prompts, params, chat=False)
    drafter = cls(init_weights(BlockDrafterNet(_block_cfg(shift)), seed=1))
    engine = SpecEngine(tiny3, drafter, max_draft_tokens=4, draft_gate=True)
    engine._gate = gate = _Scripted(4, on=2, off=off)
    rid = engine.add_request(prompts[0], params, chat=False)
    others = [engine.add_request(p, params, chat=False) for p in prompts[1:]]
    while engine.has_unfinished():
        engine.step()
        seq = engine._seqs[rid]
        if seq.num_output == 24:  # mid-generation, after plain steps: a propose brings the context up to date
            n = seq.num_cached
            drafter.propose([rid], 1)
            hidden = target_hidden_states(tiny3, seq.tokens[:n], drafter.target_layer_ids)
            with torch.inference_mode():
                k, _ = drafter.net.context_kv(0, drafter.net.project_context(hidden), torch.arange(n))
            torch.testing.assert_close(engine.draft_kv.k(0)[engine.draft_kv.slots(rid, 0, n)], k,
                                       rtol=1e-4, atol=1e-5)
    outs = [engine.release(r) for r in [rid, *others]]
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert gate.asked > 10 and sum(o.stats.drafted for o in outs) > 0
