"""Drafts left on the device: a block drafter's propose returns without a synchronisation and the
target's step reads the drafted tokens on the device (``DraftsOnDevice``, ``StepInput.draft_source``).

The CPU runs the same path (``device_drafts=True``): tokens are written into the step's input by
the same gather, read on the host only after the step. The real SmolLM2 with the shipped
checkpoints is in test_lossless.py; the GPU twin (no synchronisation at all, CUDA's sync debug
mode) is at the end.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import SamplingParams, SpecEngine
from specdec.drafters import Drafter, HybridDrafter, NullDrafter
from specdec.drafters.base import DeviceIds, Draft, DraftsOnDevice, on_device, to_host
from specdec.drafters.block import BlockDrafterConfig, BlockDrafterNet, init_weights
from specdec.drafters.dflash import DFlashDrafter, DSparkDrafter
from specdec.errors import ConfigError
from specdec.model_runner import take_drafts_
from specdec.target import load_target

VOCAB, HIDDEN = 64, 32
PROMPTS = [[1, 2, 3, 4, 5, 6, 1, 2, 3, 4], [7, 8, 9], list(range(10, 40)), [5, 5], [3, 1, 4, 1, 5, 9, 2, 6]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_target")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=200,
                                   initializer_range=0.3)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return load_target(path)


def net(shift: int, seed: int = 1, **kw) -> BlockDrafterNet:
    base = dict(block_size=4, shift_label=shift, target_layer_ids=(0, 2), target_hidden_size=HIDDEN, vocab_size=VOCAB,
                hidden_size=HIDDEN, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64)
    return init_weights(BlockDrafterNet(BlockDrafterConfig(**{**base, **kw})), seed=seed)


# -- the lazy draft values ------------------------------------------------------------------------
def test_device_ids_know_their_length_and_prefixes_without_reading_the_device():
    src = DraftsOnDevice(torch.tensor([[5, 6, 7], [8, 9, 10]]), torch.tensor([[.9, .8, .7], [.6, .5, .4]]), 64)
    ids, conf = src.ids(1, 3), src.confidences(1, 3)
    assert len(ids) == 3 and len(ids[:2]) == 2 and len(ids[:-1]) == 2 and len(ids[:9]) == 3
    assert isinstance(ids[:2], DeviceIds) and not src.fetched  # lengths and prefixes: nothing read
    assert tuple(ids[:2]) == (8, 9) and src.fetched
    assert ids == (8, 9, 10) and ids[2] == 10 and list(ids[1:]) == [9, 10]
    assert tuple(conf[:1]) == pytest.approx((0.6,)) and len(conf) == 3
    assert on_device(Draft(ids)) is src and on_device(Draft((1, 2))) is None
    host = to_host(Draft(ids, confidence=conf))
    assert host.token_ids == (8, 9, 10) and host.confidence == pytest.approx((0.6, 0.5, 0.4))
    assert type(host.token_ids) is tuple and on_device(host) is None
    assert src.confidences(0, 2) is not None and DraftsOnDevice(torch.zeros(1, 2), None, 64).confidences(0, 2) is None


def test_ids_outside_the_vocabulary_are_clamped_for_the_step_and_seen_as_they_are_on_the_host():
    src = DraftsOnDevice(torch.tensor([[-3, 70, 12]]), None, 64)
    assert src.flat.tolist() == [0, 63, 12]  # what the step reads
    assert tuple(src.ids(0, 3)) == (-3, 70, 12)  # what the engine checks


def test_a_drafters_host_buffers_keep_each_proposes_values():
    """A block drafter's device drafts share two host buffers, used in turn: a third propose
    (several in one step: the engine's fallback to one propose per request) must not change
    what the first one's drafts read."""
    d = DFlashDrafter(net(0))
    calls = [d._on_device(torch.full((2, 3), v), None, 3) for v in (11, 22, 33, 44)]
    assert [tuple(c[1].token_ids) for c in calls] == [(11,) * 3, (22,) * 3, (33,) * 3, (44,) * 3]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 99), min_size=1, max_size=40), st.data())
def test_take_drafts_replaces_exactly_the_placeholders(ids, data):
    source = torch.tensor(data.draw(st.lists(st.integers(0, 99), min_size=1, max_size=20)))
    marks = data.draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
    picks = [data.draw(st.integers(0, len(source) - 1)) for _ in ids]
    step = [-1 - p if m else t for t, m, p in zip(ids, marks, picks)]
    want = [source[p].item() if m else t for t, m, p in zip(ids, marks, picks)]
    got = take_drafts_(torch.tensor(step), source)
    assert got.tolist() == want


# -- the engine with drafts on the device ---------------------------------------------------------
def _generate(target, drafter, prompts, params, **kw):
    engine = SpecEngine(target, drafter, max_draft_tokens=4, tokens_per_block=16, **{"draft_gate": False, **kw})
    return engine, engine.generate(prompts, params)


@pytest.mark.parametrize("cls,shift", [(DFlashDrafter, 0), (DSparkDrafter, 1)])
@pytest.mark.parametrize("batch", [1, 3, 5])
def test_device_drafts_are_lossless_and_verify_the_same_drafts(tiny, cls, shift, batch):
    """Null vs the drafter with its drafts on the device vs the same drafter reading them on the
    host: equal tokens, and equal accepted counts (the same drafts were verified)."""
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    prompts = PROMPTS[:batch]
    _, base = _generate(tiny, NullDrafter(), prompts, params)
    engine, dev = _generate(tiny, cls(net(shift), device_drafts=True), prompts, params)
    _, host = _generate(tiny, cls(net(shift), device_drafts=False), prompts, params)
    assert [o.token_ids for o in dev] == [o.token_ids for o in base] == [o.token_ids for o in host]
    assert [o.stats.accepted_lengths for o in dev] == [o.stats.accepted_lengths for o in host]
    assert sum(o.stats.drafted for o in dev) > 0


def test_a_propose_with_device_drafts_does_not_read_them_before_the_step(tiny, monkeypatch):
    """The CPU twin of the GPU test below: the drafted values are read on the host only once the
    step that verifies them has run, and the step's input holds placeholders for them."""
    events = []
    real_host, real_launch = DraftsOnDevice.host, None
    from specdec.model_runner import ModelRunner

    real_launch = ModelRunner.launch

    def host(self):
        if not self.fetched:  # the first read, the one that would wait
            events.append("host")
        return real_host(self)

    def launch(self, step, *a, **kw):
        events.append("launch-draft" if step.draft_source is not None else "launch")
        if step.draft_source is not None:
            assert any(t < 0 for t in step.input_ids)
        return real_launch(self, step, *a, **kw)

    monkeypatch.setattr(DraftsOnDevice, "host", host)
    monkeypatch.setattr(ModelRunner, "launch", launch)
    _generate(tiny, DFlashDrafter(net(0), device_drafts=True), PROMPTS[:3], SamplingParams(max_new_tokens=12,
                                                                                           ignore_eos=True))
    first = events.index("launch-draft")
    assert events[first + 1] == "host"  # after the step, not before it
    assert all(events[i - 1] == "launch-draft" for i, e in enumerate(events) if e == "host")


def test_sampled_requests_beside_device_drafts(tiny):
    """A batch of greedy and sampled requests: the sampled rows' coupling needs their drafts on
    the host (read before the step); greedy rows equal null's, sampled rows equal the run with host
    drafts (same seeds)."""
    greedy = SamplingParams(max_new_tokens=24, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.9, top_p=0.95, seed=7)
    params = [greedy, sampled, greedy, sampled]
    _, base = _generate(tiny, NullDrafter(), PROMPTS[:4], params)
    _, dev = _generate(tiny, DSparkDrafter(net(1), device_drafts=True), PROMPTS[:4], params)
    _, host = _generate(tiny, DSparkDrafter(net(1), device_drafts=False), PROMPTS[:4], params)
    assert [dev[i].token_ids for i in (0, 2)] == [base[i].token_ids for i in (0, 2)]
    assert [o.token_ids for o in dev] == [o.token_ids for o in host]


def test_confidence_cut_with_device_drafts(tiny, tmp_path):
    """draft_length="confidence" reads the confidences on the host before the step: same tokens,
    same cut as with host drafts."""
    from specdec.draft_length import CostProfile

    CostProfile({(1, 1): 1.0, (1, 17): 2.6, (8, 8): 1.0, (8, 136): 13.8}, {}).save(tmp_path / "cost.json")
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    kw = dict(draft_length="confidence", cost_profile=str(tmp_path / "cost.json"))
    _, base = _generate(tiny, NullDrafter(), PROMPTS[:3], params)
    conf = dict(markov_rank=4, confidence_head=True)
    e_dev, dev = _generate(tiny, DSparkDrafter(net(1, **conf), device_drafts=True), PROMPTS[:3], params, **kw)
    e_host, host = _generate(tiny, DSparkDrafter(net(1, **conf), device_drafts=False), PROMPTS[:3], params, **kw)
    assert [o.token_ids for o in dev] == [o.token_ids for o in base]
    assert e_dev.draft_length_stats == e_host.draft_length_stats and e_dev.draft_length_stats["drafted"] > 0


def test_the_hybrid_mixes_host_and_device_drafts(tiny):
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    _, base = _generate(tiny, NullDrafter(), PROMPTS, params)
    hybrid = HybridDrafter(DFlashDrafter(net(0)), device_drafts=True, cost_aware=False)
    assert hybrid.device_drafts and hybrid.learned.device_drafts
    _, outs = _generate(tiny, hybrid, PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert hybrid.stats["learned"] > 0 and hybrid.stats["suffix"] > 0  # both kinds in the run's steps


class _Oracle(Drafter):
    """Leaves on the device the null drafter's own continuation of each request, with one token
    planted wrong at a place that differs per request and step (so a mix-up of rows, proposes or
    buffers changes what is accepted); ``fail_batched``: a propose of several requests raises,
    so the engine proposes once per request (several proposes in one step)."""

    def __init__(self, continuations: dict, fail_batched: bool = False, read_first: bool = False):
        self.continuations, self.fail_batched, self.read_first = continuations, fail_batched, read_first
        self.seen: dict[str, list[int]] = {}
        self.prompt: dict[str, tuple] = {}
        self.steps = 0
        self.sizes: list[int] = []  # requests of each propose that drafted

    def start_request(self, req_id, prompt_token_ids):
        self.prompt[req_id], self.seen[req_id] = tuple(prompt_token_ids), []

    def on_accepted(self, req_id, token_ids):
        self.seen[req_id] += list(token_ids)

    def propose(self, req_ids, max_tokens):
        if self.fail_batched and len(req_ids) > 1:
            raise RuntimeError("batched propose unavailable")
        self.steps += 1
        self.sizes.append(len(req_ids))
        k = max(1, min(max_tokens, 4))
        rows = []
        for r in req_ids:
            rest = list(self.continuations[self.prompt[r]][len(self.seen[r]):]) + [0] * k
            row = rest[:k]
            bad = (len(self.seen[r]) + len(self.prompt[r]) + self.steps) % (k + 2)
            if bad < k:
                row[bad] = (row[bad] + 1) % VOCAB
            rows.append(row)
        src = DraftsOnDevice(torch.tensor(rows), None, VOCAB)
        if self.read_first:
            src.host()
        return [Draft(src.ids(i, k)) for i in range(len(req_ids))]


@pytest.mark.parametrize("fail_batched,read_first", [(False, False), (True, False), (False, True)])
def test_device_drafts_of_each_request_are_its_own(tiny, fail_batched, read_first):
    """Drafts that differ per request and mostly agree with the target: the engine verifies each
    request's own, whether one propose drafts for the batch, one propose per request runs (the
    fallback after a batched propose raised: several proposes in one step), or the values were
    read on the host before the step."""
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    _, base = _generate(tiny, NullDrafter(), PROMPTS, params)
    cont = {tuple(o.prompt_token_ids): tuple(o.token_ids) for o in base}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the batched propose's fault is warned about once
        oracle = _Oracle(cont, fail_batched, read_first)
        engine, outs = _generate(tiny, oracle, PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    accepted = sum(o.stats.accepted for o in outs)
    assert accepted > 0.4 * sum(o.stats.drafted for o in outs) > 0  # mostly right drafts, verified as such
    assert (max(oracle.sizes) == 1) == fail_batched  # one propose per request: several in a step


class _Unsure(Drafter):
    """Device drafts whose confidences are out of [0, 1] (NaN included)."""

    def propose(self, req_ids, max_tokens):
        k = min(max_tokens, 2)
        src = DraftsOnDevice(torch.ones(len(req_ids), k, dtype=torch.long),
                             torch.tensor([[float("nan"), 1.5]][0][:k]).repeat(len(req_ids), 1), VOCAB)
        return [Draft(src.ids(i, k), confidence=src.confidences(i, k)) for i in range(len(req_ids))]


def test_device_confidences_out_of_range_drop_the_draft(tiny):
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    _, base = _generate(tiny, NullDrafter(), PROMPTS[:2], params)
    with pytest.warns(RuntimeWarning, match="confidence"):
        engine, outs = _generate(tiny, _Unsure(), PROMPTS[:2], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert engine.fault_stats["invalid_drafts"] > 0 and sum(o.stats.drafted for o in outs) == 0


class _OutOfRange(Drafter):
    """Leaves drafts on the device whose ids fall outside the vocabulary (``read_first``: their
    values already read on the host, as a hybrid reading their confidences does)."""

    def __init__(self, read_first: bool = False):
        self.read_first = read_first

    def propose(self, req_ids, max_tokens):
        k = min(max_tokens, 3)
        src = DraftsOnDevice(torch.tensor([[VOCAB + 5, -2, 3][:k]] * len(req_ids)), None, VOCAB)
        if self.read_first:
            src.host()
        return [Draft(src.ids(i, k)) for i in range(len(req_ids))]


@pytest.mark.parametrize("sampled,read_first", [(False, False), (True, False), (False, True)])
def test_device_drafts_out_of_the_vocabulary_are_dropped_not_crashed(tiny, sampled, read_first):
    """Ids out of range left on the device: the step reads them clamped, the engine drops the
    draft (counted, one warning per request), every output stays the null drafter's; with a
    sampled request in the batch they are read (and dropped) before the step."""
    params = [SamplingParams(max_new_tokens=16, ignore_eos=True)] * 3
    if sampled:
        params[1] = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=0.8, seed=5)
    _, base = _generate(tiny, NullDrafter(), PROMPTS[:3], params)
    with pytest.warns(RuntimeWarning, match="invalid draft"):
        engine, outs = _generate(tiny, _OutOfRange(read_first), PROMPTS[:3], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert engine.fault_stats["invalid_drafts"] > 0
    assert sum(o.stats.drafted for o in outs) == 0  # every draft was dropped


def test_device_drafts_setting_is_checked():
    with pytest.raises(ConfigError, match="device_drafts"):
        DFlashDrafter(net(0), device_drafts="yes")
    d = DFlashDrafter(net(0))
    assert d.device_drafts is False  # off by default (measured slower, see the class doc)
    assert DFlashDrafter(net(0), device_drafts=None).device_drafts is False  # None: decided at bind
    with pytest.raises(ConfigError, match="device_drafts"):
        HybridDrafter(DFlashDrafter(net(0)), device_drafts=1)


def test_device_drafts_follow_the_target_device_when_asked(tiny):
    d = DFlashDrafter(net(0), device_drafts=None)
    SpecEngine(tiny, d, max_draft_tokens=4)
    assert d.device_drafts is False  # None on a CPU target: off
    d2 = DFlashDrafter(net(0), device_drafts=True)
    SpecEngine(tiny, d2, max_draft_tokens=4)
    assert d2.device_drafts is True


# -- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the synchronisation check is the GPU's")
def test_gpu_propose_and_step_launch_without_a_synchronisation(tmp_path):
    """On CUDA (graphs, compiled propose off for speed) a step's propose and the launch of the target's
    forward run under CUDA's sync debug mode set to raise: no synchronisation between them; and the
    outputs equal null's and the host-drafts run's in fp32."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=200,
                                   initializer_range=0.3)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    target = load_target(tmp_path, device="cuda")
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    _, base = _generate(target, NullDrafter(), PROMPTS, params)
    _, on_host = _generate(target, DFlashDrafter(net(0), torch_compile=False), PROMPTS, params)
    drafter = DFlashDrafter(net(0), torch_compile=False, device_drafts=None)
    engine = SpecEngine(target, drafter, max_draft_tokens=4, tokens_per_block=16, draft_gate=False)
    assert drafter.device_drafts  # None: on for a CUDA target
    engine.capture_graphs(max_kv_len=120, progress=False)  # no capture (which synchronises) inside the steps
    for p in PROMPTS:
        engine.add_request(p, params)
    engine.step()  # prompts
    engine.step()
    engine.step()
    real_propose, real_launch = engine._propose, engine._launch
    real_host, real_sync = DraftsOnDevice.host, torch.cuda.Event.synchronize
    window, checked = [False], []

    def host(self):  # reading the drafts inside the window would wait for the propose
        if window[0] and not self.fetched:
            raise AssertionError("device drafts read between the propose and the step's launch")
        return real_host(self)

    def sync(self):
        if window[0]:
            raise AssertionError("a CUDA event waited for between the propose and the step's launch")
        return real_sync(self)

    def propose(plan):  # the window: from the propose through pack to the launch of the target's forward
        window[0] = True
        torch.cuda.set_sync_debug_mode("error")
        checked.append("_propose")
        return real_propose(plan)

    def launch(plan):
        try:
            assert plan.inputs.draft_source is not None and any(t < 0 for t in plan.inputs.input_ids)
            return real_launch(plan)
        finally:
            window[0] = False
            torch.cuda.set_sync_debug_mode("default")
            checked.append("_launch")

    engine._propose, engine._launch = propose, launch
    DraftsOnDevice.host, torch.cuda.Event.synchronize = host, sync
    try:
        for _ in range(3):
            engine.step()
    finally:
        engine._propose, engine._launch = real_propose, real_launch
        DraftsOnDevice.host, torch.cuda.Event.synchronize = real_host, real_sync
        torch.cuda.set_sync_debug_mode("default")
    assert checked == ["_propose", "_launch"] * 3
    while engine.has_unfinished():
        engine.step()
    outs = [engine.release(r) for r in list(engine._seqs)]
    assert sorted(o.token_ids for o in outs) == sorted(o.token_ids for o in base) == sorted(o.token_ids for o in on_host)
