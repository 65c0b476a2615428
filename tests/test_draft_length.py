"""Draft length from confidence: the pure rule against brute force, the cost profile, and the engine
cutting drafts losslessly."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import SamplingParams, SpecEngine
from specdec.draft_length import CostProfile, choose_lengths, expected_tokens, kept_lengths, profile_key
from specdec.drafters.base import Draft, Drafter
from specdec.drafters.block import BlockDrafterConfig, BlockDrafterNet, init_weights
from specdec.drafters.dflash import DSparkDrafter
from specdec.errors import CheckpointError, ConfigError

confs = st.lists(st.lists(st.floats(0, 1), min_size=0, max_size=4), min_size=1, max_size=3)


def affine(a: float, per_row: float, per_req: float):
    return lambda b, r: a + per_row * r + per_req * b


def brute_force(confidences, cost):
    B = len(confidences)
    best, arg = -1.0, None
    for ks in itertools.product(*[range(len(c) + 1) for c in confidences]):
        gain = sum(expected_tokens(c, k) for c, k in zip(confidences, ks))
        ratio = gain / cost(B, B + sum(ks))
        if ratio > best + 1e-12:
            best, arg = ratio, ks
    return best, arg


@given(confs, st.floats(0.1, 5), st.floats(0, 1), st.floats(0, 1))
@settings(max_examples=300, deadline=None)
def test_the_rule_maximises_expected_tokens_per_unit_cost(confidences, a, per_row, per_req):
    cost = affine(a, per_row, per_req)
    ks = choose_lengths(confidences, cost)
    assert all(0 <= k <= len(c) for k, c in zip(ks, confidences))
    got = sum(expected_tokens(c, k) for c, k in zip(confidences, ks)) / cost(len(ks), len(ks) + sum(ks))
    best, _ = brute_force(confidences, cost)
    assert got == pytest.approx(best, rel=1e-9, abs=1e-12)
    # never worse than not drafting at all (the null drafter's step)
    assert got >= len(ks) / cost(len(ks), len(ks)) - 1e-12


@given(confs)
@settings(max_examples=100, deadline=None)
def test_rows_that_cost_nothing_keep_every_token_with_a_chance(confidences):
    ks = choose_lengths(confidences, lambda b, r: 1.0)
    for c, k in zip(confidences, ks):
        run, want = 1.0, 0
        for j, x in enumerate(c):
            run *= x
            if run > 1e-9:  # a gain below the float resolution of 1 + gain changes nothing
                want = j + 1
        assert k == want or (k > want and run <= 1e-9)


def test_costly_rows_cut_drafts_and_unconfident_drafts_stay_whole():
    steep = affine(1.0, 0.5, 0.0)
    assert choose_lengths([[0.9, 0.5, 0.1]], steep) == [1]  # (1 + .9) / 2 beats 1 / 1.5 and the longer ones
    assert choose_lengths([[0.1, 0.1]], steep) == [0]
    assert kept_lengths([[0.1, 0.1], None], [2, 3], steep) == [0, 3]


def test_cost_profile_interpolates_and_round_trips(tmp_path):
    p = CostProfile({(1, 1): 1.0, (1, 9): 2.0, (4, 4): 2.0, (4, 36): 6.0}, {"device": "test"})
    assert p(1, 1) == 1.0 and p(1, 5) == pytest.approx(1.5) and p(1, 17) == pytest.approx(3.0)
    assert p(4, 20) == pytest.approx(4.0)
    assert p(2, 2) == pytest.approx(1.0 + (2.0 - 1.0) / 3)  # 1 row per request: a third of the way in batch
    assert p(100, 100) == p(4, 4) and p(1, 0) == 1.0
    p.save(tmp_path / "p.json")
    q = CostProfile.load(tmp_path / "p.json")
    assert q.points == p.points and q.meta == {"device": "test"}
    with pytest.raises(CheckpointError, match="cost profile"):
        CostProfile.load(tmp_path / "none.json")
    with pytest.raises(ConfigError, match="> 0"):
        CostProfile({(1, 1): 0.0}, {})


def test_measured_profile_covers_the_grid(tiny):
    p = CostProfile.measure(tiny, 4, batch_sizes=(1, 2), rows_per_request=(1, 3), context=8, repeats=1)
    assert set(p.points) == {(1, 1), (1, 3), (2, 2), (2, 6)} and all(t > 0 for t in p.points.values())
    assert p.meta["target"] == profile_key(tiny, 4) and "cpu" in p.meta["target"]


class ConfidentDrafter(Drafter):
    """Drafts a fixed continuation with confidences that fall along the draft."""

    def __init__(self, vocab: int):
        self.vocab_size = None

    def propose(self, req_ids, max_tokens):
        return [Draft(tuple((7 * j + 3) % 60 for j in range(max_tokens)),
                      confidence=tuple(0.9 ** (j + 1) for j in range(max_tokens))) for _ in req_ids]


def test_engine_cuts_by_confidence_and_stays_lossless(tiny, tmp_path):
    CostProfile({(1, 1): 1.0, (1, 9): 3.0, (8, 8): 1.0, (8, 72): 3.0}, {}).save(tmp_path / "p.json")
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4], [5, 6], [9, 9, 9, 9, 9], [11, 12, 13]]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    base = SpecEngine(tiny).generate(prompts, params)
    e = SpecEngine(tiny, ConfidentDrafter(64), draft_length="confidence", cost_profile=str(tmp_path / "p.json"))
    outs = e.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    s = e.draft_length_stats
    assert s["steps"] > 0 and 0 < s["kept"] < s["drafted"]
    fixed = SpecEngine(tiny, ConfidentDrafter(64))
    fixed.generate(prompts, params)
    assert fixed.draft_length_stats["steps"] == 0


def test_bad_confidences_are_dropped_for_the_step(tiny):
    class Bad(Drafter):
        def propose(self, req_ids, max_tokens):
            return [Draft((1,), confidence=(1.5,)) for _ in req_ids]

    e = SpecEngine(tiny, Bad())
    with pytest.warns(RuntimeWarning):
        e.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert e.fault_stats["invalid_drafts"] > 0
    with pytest.raises(ConfigError, match="draft_length"):
        SpecEngine(tiny, draft_length="longest")


def test_dspark_drafts_carry_confidences_and_a_flat_profile_keeps_them_all(tiny):
    cfg = BlockDrafterConfig(block_size=4, shift_label=1, target_layer_ids=(0, 1), target_hidden_size=32,
                             vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                             intermediate_size=64, markov_rank=4, confidence_head=True)
    d = DSparkDrafter(init_weights(BlockDrafterNet(cfg), seed=0))
    e = SpecEngine(tiny, d, draft_length="confidence", cost_profile=None)
    e._cost_profile = CostProfile.flat()  # no measuring in this test
    e.add_request([1, 2, 3, 4], SamplingParams(max_new_tokens=8, ignore_eos=True), req_id="r")
    e.step()
    (draft,) = d.propose(["r"], 4)
    assert len(draft.confidence) == len(draft) == 4 and all(0 < c < 1 for c in draft.confidence)
    while e.has_unfinished():
        e.step()
    s = e.draft_length_stats  # rows that cost nothing: every token with a chance is verified
    assert s["steps"] > 0 and s["kept"] == s["drafted"] > 0


@pytest.mark.parametrize("batch", [1, 4])
def test_suffix_drafter_cut_by_its_counts_is_lossless(tiny, tmp_path, batch):
    from specdec.drafters import SuffixAutomatonDrafter

    CostProfile({(1, 1): 1.0, (1, 9): 2.0, (4, 4): 1.0, (4, 36): 2.5}, {}).save(tmp_path / "p.json")
    prompts = [[1, 2, 3, 4] * 4, [5, 6, 7] * 5, [9, 9, 9, 9, 9], [11, 12, 13, 11, 12, 13]]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    base = SpecEngine(tiny, max_num_seqs=batch).generate(prompts, params)
    e = SpecEngine(tiny, SuffixAutomatonDrafter(), max_num_seqs=batch, draft_length="confidence",
                   cost_profile=str(tmp_path / "p.json"))
    outs = e.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert e.draft_length_stats["steps"] > 0 and e.draft_length_stats["kept"] <= e.draft_length_stats["drafted"]
