"""Chunked prefill (``EngineConfig.max_prefill_tokens``): long prompts fed over several steps,
beside the decoding requests; outputs, drafts and the cache as with whole prompts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import tiny_llama
from specdec import SamplingParams, SpecEngine
from specdec.config import EngineConfig
from specdec.drafters import NullDrafter, SuffixAutomatonDrafter
from specdec.drafters.block import BlockDrafterConfig, BlockDrafterNet, init_weights
from specdec.drafters.dflash import DFlashDrafter, DSparkDrafter
from specdec.errors import ConfigError

VOCAB, HIDDEN = 64, 32


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A random 3-layer Llama (vocab 64, 160 positions) with a usable logit scale."""
    return tiny_llama(tmp_path_factory.mktemp("chunk_target"), "cpu", num_hidden_layers=3,
                      max_position_embeddings=160, initializer_range=0.3)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    # a repeated motif, so that the suffix drafter drafts, with random tokens between
    return [[int(t) % 62 for t in torch.randint(0, 62, (n,), generator=g).tolist()] for n in lengths]


def _params(n, sampled_every=0, new=24):
    return [SamplingParams(max_new_tokens=new, ignore_eos=True, temperature=0.9, top_p=0.9, seed=i)
            if sampled_every and i % sampled_every == 0 else SamplingParams(max_new_tokens=new, ignore_eos=True)
            for i in range(n)]


class _Spy:
    """Records each step's context chunks and number of decoding requests, and the drafts proposed."""

    def __init__(self, engine):
        self.steps, self.drafts = [], []
        launch, pack = engine.runner.launch, engine.scheduler.pack

        def spy_launch(step, *a, **kw):
            self.steps.append(([c[0] for c in step.context], len(step.generation)))
            return launch(step, *a, **kw)

        def spy_pack(plan, drafts):  # the drafts as verified (each cut to its request's budget)
            self.drafts.append([(s.req_id, tuple(int(t) for t in d.token_ids)) for s, d in zip(plan.generation, drafts)])
            return pack(plan, drafts)

        engine.runner.launch = spy_launch
        engine.scheduler.pack = spy_pack


def _run(target, drafter, prompts, params, **cfg):
    engine = SpecEngine(target, drafter, max_num_seqs=4, tokens_per_block=16, **{"draft_gate": False, **cfg})
    free = engine.manager.num_free_pages
    spy = _Spy(engine)
    outs = engine.generate(prompts, params, chat=False)
    assert engine.manager.num_free_pages == free  # no page kept
    return [o.token_ids for o in outs], spy


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 120), min_size=1, max_size=6), chunk=st.integers(1, 70),
       sampled_every=st.sampled_from([0, 2]), drafter=st.sampled_from(["null", "suffix"]))
def test_chunked_outputs_equal_whole_prompts_and_no_step_feeds_more_than_the_budget(target, lengths, chunk,
                                                                                     sampled_every, drafter):
    prompts, params = _prompts(lengths), _params(len(lengths), sampled_every)
    make = (lambda: NullDrafter()) if drafter == "null" else (lambda: SuffixAutomatonDrafter())
    want, _ = _run(target, make(), prompts, params)
    got, spy = _run(target, make(), prompts, params, max_prefill_tokens=chunk)
    assert got == want  # greedy and seeded sampled rows alike
    assert all(sum(ctx) <= chunk for ctx, _ in spy.steps)
    assert sum(spy.steps[0][0]) == min(chunk, sum(lengths[:4]))  # the first step fills its budget (4 running at most)


def test_decoding_requests_advance_every_step_while_a_long_prompt_is_fed(target):
    engine = SpecEngine(target, NullDrafter(), max_num_seqs=4, tokens_per_block=16, max_prefill_tokens=16)
    spy = _Spy(engine)
    short, long = _prompts([5, 120])
    a = engine.add_request(short, SamplingParams(max_new_tokens=40, ignore_eos=True), chat=False)
    engine.step()  # a's prompt
    engine.add_request(long, SamplingParams(max_new_tokens=4, ignore_eos=True), chat=False)
    got = []
    for _ in range(8):  # 120 prompt tokens in chunks of 16: 8 steps, a decodes in each
        got.append(sum(len(o.new_token_ids) for o in engine.step() if o.req_id == a))
    assert got == [1] * 8
    assert [ctx for ctx, gen in spy.steps[1:]] == [[16]] * 7 + [[8]]
    assert all(gen == 1 for _, gen in spy.steps[1:])


@pytest.mark.parametrize("cls,shift", [(DFlashDrafter, 0), (DSparkDrafter, 1)])
def test_block_drafters_draft_the_same_from_chunked_context(target, cls, shift):
    """A block drafter reads the target's hidden states of every prompt position: fed in chunks, its
    context (and so every draft) is the one whole prompts give."""
    cfg = BlockDrafterConfig(block_size=4, shift_label=shift, target_layer_ids=(0, 2), target_hidden_size=HIDDEN,
                             vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=1, num_heads=4, num_kv_heads=2,
                             head_dim=8, intermediate_size=64)
    prompts, params = _prompts([37, 90, 8]), _params(3)
    runs = []
    for chunk in (None, 13):
        drafter = cls(init_weights(BlockDrafterNet(cfg), seed=1))
        runs.append(_run(target, drafter, prompts, params, max_draft_tokens=4, max_prefill_tokens=chunk))
    (want, whole), (got, chunked) = runs
    assert got == want

    def by_request(spy):  # each request's drafts in order (chunking changes which requests share a propose)
        out = {}
        for call in spy.drafts:
            for req_id, draft in call:
                out.setdefault(req_id, []).append(draft)
        return out

    assert by_request(chunked) == by_request(whole)
    assert sum(len(d) for ds in by_request(whole).values() for d in ds) > 0


def test_preemption_and_a_failed_step_mid_prompt(target):
    """A pool too small for every request preempts, a step that fails while a prompt is half fed
    is undone; outputs equal whole prompts' in a roomy pool, and no page is left."""
    prompts, params = _prompts([70, 60, 50, 40]), _params(4, sampled_every=2, new=30)
    want, _ = _run(target, SuffixAutomatonDrafter(), prompts, params)
    engine = SpecEngine(target, SuffixAutomatonDrafter(), max_num_seqs=4, tokens_per_block=16, num_pages=12,
                        max_prefill_tokens=24)
    launch, calls = engine.runner.launch, [0]

    def flaky(step, *a, **kw):
        calls[0] += 1
        if calls[0] == 3:  # the third step: the first prompt is half fed
            raise RuntimeError("device fault")
        return launch(step, *a, **kw)

    engine.runner.launch = flaky
    ids = [engine.add_request(p, sp, chat=False) for p, sp in zip(prompts, params)]
    failures = 0
    while engine.has_unfinished():
        try:
            engine.step()
        except RuntimeError:
            failures += 1
    assert failures == 1
    assert [engine.release(i).token_ids for i in ids] == want
    assert engine.manager.num_free_pages == 12


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "64"])
def test_max_prefill_tokens_errors(bad):
    with pytest.raises(ConfigError, match="max_prefill_tokens"):
        EngineConfig(max_prefill_tokens=bad)


def test_not_with_helix():
    with pytest.raises(ConfigError, match="max_prefill_tokens"):
        EngineConfig(max_prefill_tokens=64, helix_cp=2)
    with pytest.raises(ConfigError, match="helix_cp must be an integer"):  # a bad helix_cp is named first
        EngineConfig(max_prefill_tokens=64, helix_cp="2")
