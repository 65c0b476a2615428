"""`EngineConfig.draft_gate`: steps draft only where drafting has been measured to emit more tokens
per second than plain steps, per batch-size bucket; outputs never change."""

from __future__ import annotations

import time

import pytest
import torch
import transformers
from hypothesis import given, settings, strategies as st

from specdec import EngineConfig, SamplingParams, SpecEngine
from specdec.draft_gate import DraftGate, bucket_label, bucket_of
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


def _drive(gate: DraftGate, steps: int, rate, batch: int = 8) -> str:
    """``steps`` decisions, each recorded at ``rate(drafted, i)`` tokens/s; ``D`` drafted, ``.`` plain."""
    out = []
    for i in range(steps):
        d = gate.wants_draft(batch)
        gate.record(batch, d, 10, 10 / rate(d, i))
        out.append("D" if d else ".")
    return "".join(out)


def test_warm_up_measures_both_arms_then_keeps_the_faster_and_probes_the_other():
    W, E, P = DraftGate.WARMUP, DraftGate.PROBE_EVERY, DraftGate.PROBE_STEPS
    gate = DraftGate()
    seq = _drive(gate, 2 * W + 2 * (E + P), lambda d, i: 50.0 if d else 100.0)
    assert seq[:2 * W] == "D" * W + "." * W
    rest = seq[2 * W:]
    assert rest == ("." * E + "D" * P) * 2  # plain is faster: drafting is measured afresh every E steps
    stats = gate.stats()["5-8"]
    assert stats["drafting"] is False and stats["probes"] == 2
    assert stats["draft_tok_s"] == pytest.approx(50.0) and stats["plain_tok_s"] == pytest.approx(100.0)


def test_a_probe_that_finds_the_other_arm_faster_switches():
    gate = DraftGate()
    switch = 2 * DraftGate.WARMUP + 10  # drafting becomes twice as fast as plain after this step
    seq = _drive(gate, 400, lambda d, i: (200.0 if i >= switch else 50.0) if d else 100.0)
    first_probe = 2 * DraftGate.WARMUP + DraftGate.PROBE_EVERY
    assert "D" not in seq[2 * DraftGate.WARMUP:first_probe]
    assert seq[first_probe + DraftGate.PROBE_STEPS:].count(".") <= DraftGate.PROBE_STEPS * 6  # drafting kept
    assert gate.stats()["5-8"]["drafting"] is True


def test_buckets_decide_apart():
    gate = DraftGate()
    for _ in range(40):
        for batch, fast_draft in ((1, True), (32, False)):
            d = gate.wants_draft(batch)
            gate.record(batch, d, 10, 10 / ((300.0 if d else 100.0) if fast_draft else (30.0 if d else 100.0)))
    stats = gate.stats()
    assert stats["1"]["drafting"] is True and stats["17-32"]["drafting"] is False


def test_one_slow_step_does_not_decide():
    """A one-off (a graph capture, a compile) in drafting's warm-up: the median ignores it."""
    gate = DraftGate()
    seq = _drive(gate, 30, lambda d, i: (0.5 if i == 0 else 300.0) if d else 100.0)
    assert seq[2 * DraftGate.WARMUP:] == "D" * (30 - 2 * DraftGate.WARMUP)


@settings(max_examples=60, deadline=None)
@given(fast=st.floats(10.0, 1e5), ratio=st.floats(1.2, 20.0), draft_faster=st.booleans(),
       steps=st.integers(200, 1500))
def test_the_slower_arm_gets_at_most_warm_up_and_probes(fast, ratio, draft_faster, steps):
    slow = fast / ratio
    gate = DraftGate()
    seq = _drive(gate, steps, lambda d, i: (fast if d == draft_faster else slow))
    worse = seq.count("." if draft_faster else "D")
    bound = DraftGate.WARMUP + DraftGate.PROBE_STEPS * (steps // DraftGate.PROBE_EVERY + 1)
    assert worse <= bound, (worse, bound)


def test_unmeasurable_steps_are_ignored():
    gate = DraftGate()
    gate.record(4, True, 10, 0.0)
    gate.record(4, True, 10, float("nan"))
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
    assert stats["drafting"] is False
    assert stats["plain_steps"] > 3 * stats["drafted_steps"], stats
    assert drafter.proposes <= stats["drafted_steps"] + 2  # a plain step does not call propose


def test_a_drafter_that_pays_keeps_drafting(tiny):
    params = SamplingParams(max_new_tokens=80, ignore_eos=True)
    base = SpecEngine(tiny, NullDrafter(), max_num_seqs=8).generate(PROMPTS, params, chat=False)
    truth = {tuple(p): list(o.token_ids) for p, o in zip(PROMPTS, base)}
    engine = SpecEngine(tiny, _Oracle(truth), max_num_seqs=8, max_draft_tokens=8, draft_gate=True)
    outs = engine.generate(PROMPTS, params, chat=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    stats = engine.draft_gate_stats["5-8"]
    assert stats["drafting"] is True and stats["draft_tok_s"] > stats["plain_tok_s"], stats


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
    """Drafts in runs of ``on`` steps, then leaves ``off`` steps plain, whatever is measured."""

    def __init__(self, on: int, off: int):
        super().__init__()
        self.on, self.off, self.asked = on, off, 0

    def wants_draft(self, batch: int) -> bool:
        self.asked += 1
        return (self.asked - 1) % (self.on + self.off) < self.on


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
    engine._gate = gate = _Scripted(on=2, off=off)
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
