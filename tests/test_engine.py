"""Engine behaviour on a tiny random target: serving API, stop rules, bad input, preemption."""

from __future__ import annotations

import pytest

from specdec import EngineConfig, SamplingParams, SpecEngine
from specdec.drafters import Draft, Drafter, NullDrafter, SuffixAutomatonDrafter
from specdec.errors import (
    ConfigError,
    InvalidRequestError,
    MissingHookError,
    PromptTooLongError,
    SpecDecError,
    UnsupportedShapeError,
    VocabMismatchError,
)


PROMPTS = [[1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 10, 11], [5]]


def _gen(target, drafter, prompts=PROMPTS, **kw):
    params = SamplingParams(max_new_tokens=kw.pop("max_new_tokens", 30), ignore_eos=True)
    return SpecEngine(target, drafter, **kw).generate(prompts, params)


@pytest.mark.parametrize("tokens_per_block", [1, 4, 16])
def test_lossless_on_tiny_target(tiny, tokens_per_block):
    base = _gen(tiny, NullDrafter(), tokens_per_block=tokens_per_block)
    spec = _gen(tiny, SuffixAutomatonDrafter(), tokens_per_block=tokens_per_block)
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]


class OracleDrafter(Drafter):
    """Proposes the known greedy continuation, with every ``bad``-th token corrupted."""

    def __init__(self, truth: dict[str, list[int]], bad: int):
        self.truth, self.bad, self.pos = truth, bad, {}

    def start_request(self, req_id, prompt_token_ids):
        self.pos[req_id] = 0

    def propose(self, req_ids, max_tokens):
        out = []
        for r in req_ids:
            seq = self.truth[r][self.pos[r]:self.pos[r] + max_tokens]
            out.append(Draft(tuple((t + 1) % 64 if (self.pos[r] + i) % self.bad == self.bad - 1 else t
                                   for i, t in enumerate(seq))))
        return out

    def on_accepted(self, req_id, token_ids):
        self.pos[req_id] += len(token_ids)


def test_rollback_with_partly_wrong_drafts_and_tiny_pool(tiny):
    base = _gen(tiny, NullDrafter())
    truth = {str(i): list(o.token_ids) for i, o in enumerate(base)}
    # A pool of 12 pages x 4 tokens cannot hold all four requests at once: forces waiting and preemption.
    spec = _gen(tiny, OracleDrafter(truth, bad=5), tokens_per_block=4, num_pages=12, max_draft_tokens=6)
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]
    assert max(o.stats.mean_accepted_length for o in spec) > 2


def test_serving_api_streams_and_abort(tiny):
    engine = SpecEngine(tiny, SuffixAutomatonDrafter())
    a = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=20, ignore_eos=True))
    b = engine.add_request(PROMPTS[1], SamplingParams(max_new_tokens=20, ignore_eos=True))
    streamed = {a: [], b: []}
    engine.step()  # both prefilled, first tokens out
    engine.abort(b)
    while engine.has_unfinished():
        for out in engine.step():
            streamed[out.req_id] += out.new_token_ids
    assert engine.output(b).finish_reason == "abort"
    full = engine.output(a)
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    assert tuple(streamed[a]) == full.token_ids[-len(streamed[a]):]
    assert engine.manager.num_free_pages == engine.manager.num_pages  # nothing leaked


def test_bad_request_does_not_disturb_running(tiny):
    engine = SpecEngine(tiny, SuffixAutomatonDrafter())
    ref = SpecEngine(tiny, NullDrafter()).generate([PROMPTS[0]], SamplingParams(max_new_tokens=12, ignore_eos=True))
    a = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=12, ignore_eos=True))
    engine.step()
    for bad in ([], [64], [-1], list(range(96))):
        with pytest.raises(InvalidRequestError):
            engine.add_request(bad)
    with pytest.raises(InvalidRequestError, match="req_id"):
        engine.add_request([1], req_id=a)
    while engine.has_unfinished():
        engine.step()
    assert engine.output(a).token_ids == ref[0].token_ids


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kwargs)


def test_bad_input_table(tiny):
    engine = SpecEngine(tiny)
    with pytest.raises(InvalidRequestError, match="prompts must be a non-empty list"):
        engine.generate([])
    with pytest.raises(InvalidRequestError, match="prompt must be a non-empty"):
        engine.generate([[]])
    with pytest.raises(PromptTooLongError, match="max context 96"):
        engine.generate([[1] * 96])
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        engine.generate([[1]], max_new_tokens=0)
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        engine.generate(["text"])
    assert issubclass(PromptTooLongError, SpecDecError)


def test_drafter_errors_at_build(tiny):
    class WrongVocab(Drafter):
        vocab_size = 65

    with pytest.raises(VocabMismatchError, match="vocab_size"):
        SpecEngine(tiny, WrongVocab())

    class NoHooks:  # not a Drafter: lacks every hook
        def propose(self, req_ids, max_tokens):
            return []

    with pytest.raises(MissingHookError, match="kv_layer_specs"):
        SpecEngine(tiny, NoHooks())


def test_engine_config_errors_and_forced_backend(tiny):
    with pytest.raises(ConfigError, match="tokens_per_block"):
        EngineConfig(tokens_per_block=3)
    with pytest.raises(ConfigError, match="max_draft_tokens"):
        EngineConfig(max_draft_tokens=-1)
    with pytest.raises(ConfigError, match="attention_backend must be one of"):
        SpecEngine(tiny, attention_backend="nope")
    engine = SpecEngine(tiny, attention_backend="torch_ref")
    engine.generate([[1, 2]], max_new_tokens=2)
    assert engine.attention_backends == {"generation": "torch_ref"}


def test_forced_backend_that_cannot_run_is_refused_at_build(tiny):
    from specdec.attention.backends.torch_ref import TorchRefBackend
    from specdec.attention.selector import _BACKENDS, register_backend
    from specdec.attention.shapes import Verdict

    class OnlyDecode(TorchRefBackend):
        name = "only_decode_test"

        def supports(self, shape):
            return Verdict(shape.max_q_len == 1, "only single-token decode")

    register_backend(OnlyDecode)
    try:
        with pytest.raises(UnsupportedShapeError, match="only_decode_test.*only single-token decode"):
            SpecEngine(tiny, attention_backend="only_decode_test")
    finally:
        del _BACKENDS["only_decode_test"]


def test_engines_build_their_own_attention_backends(tiny):
    """Each engine builds its attention backends from its own config: two engines in one process with
    different ``attention_pdl`` keep their own choice, share no backend, and change nothing global."""
    pytest.importorskip("triton", reason="triton_gqa (the backend that reads attention_pdl) needs triton")
    from specdec.attention.selector import get_backend

    off, auto = SpecEngine(tiny, attention_pdl=False), SpecEngine(tiny)
    gqa = [next(b for b in e.runner.backends if b.name == "triton_gqa") for e in (off, auto)]
    assert gqa[0].pdl is False and gqa[1].pdl is None
    assert not {id(b) for b in off.runner.backends} & {id(b) for b in auto.runner.backends}
    assert get_backend("triton_gqa").pdl is None  # what the registry builds by default is unchanged
    outs = [e.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))[0].token_ids for e in (off, auto)]
    assert outs[0] == outs[1]  # on a CPU both run torch_ref
    with pytest.raises(ConfigError, match="attention_pdl must be True, False or None"):
        SpecEngine(tiny, attention_pdl=1)


def test_eos_and_stats(tiny):
    engine = SpecEngine(tiny, SuffixAutomatonDrafter())
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=40))
    for o in outs:
        assert o.finish_reason in ("eos", "length")
        if o.finish_reason == "eos":
            assert o.token_ids[-1] == 63 and 63 not in o.token_ids[:-1]
        assert o.stats.target_steps == len(o.stats.accepted_lengths) + 1
        assert sum(o.stats.accepted_lengths) + 1 == len(o.token_ids)


def test_sampling_is_seeded_and_same_path_with_and_without_drafter(tiny):
    p = SamplingParams(max_new_tokens=25, temperature=0.8, top_k=20, top_p=0.9, seed=3, ignore_eos=True)
    a = SpecEngine(tiny).generate(PROMPTS, p)
    b = SpecEngine(tiny).generate(PROMPTS, p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    c = SpecEngine(tiny, SuffixAutomatonDrafter()).generate(PROMPTS, p)
    assert [o.token_ids for o in c] == [o.token_ids for o in a]  # a seed gives the same tokens with any drafter
    d = SpecEngine(tiny).generate(PROMPTS, SamplingParams(**{**{f: getattr(p, f) for f in p.__slots__}, "seed": 4}))
    assert [o.token_ids for o in d] != [o.token_ids for o in a]  # the seed matters


class TestWarmUp:
    """``SpecEngine.warm_up``: every kind of step once, and the engine left as it was."""

    def _record(self, engine):
        seen = []
        launch = engine.runner.launch

        def spy(step, *a, **kw):
            seen.append(([c[0] for c in step.context], len(step.generation)))
            return launch(step, *a, **kw)

        engine.runner.launch = spy
        return seen

    @pytest.mark.parametrize("drafter", ["null", "suffix"])
    def test_runs_each_prompt_bucket_two_prompts_and_a_mixed_step_then_leaves_no_trace(self, tiny, drafter):
        from specdec.drafters import make_drafter

        prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 7, 6, 9, 8, 7, 6, 9]]
        params = [SamplingParams(max_new_tokens=20), SamplingParams(max_new_tokens=20, temperature=0.9, seed=3)]
        with SpecEngine(tiny, make_drafter(drafter), max_num_seqs=4) as fresh:
            want = [o.token_ids for o in fresh.generate(prompts, params, chat=False)]
        engine = SpecEngine(tiny, make_drafter(drafter), max_num_seqs=4)
        free = engine.manager.num_free_pages
        seen = self._record(engine)
        steps = engine.warm_up()
        assert steps == len(seen) > 0
        q_lens = {q for ctx, _ in seen for q in ctx}
        assert {15, 16, 31, 32, 63, 64} <= q_lens  # each power-of-two bucket
        assert max(q_lens) >= tiny.max_context - 3 - engine.config.max_draft_tokens  # and about the longest
        assert any(len(ctx) == 2 for ctx, _ in seen)  # two prompts in one step
        mixed = {q for ctx, gen in seen if gen for q in ctx}  # prompts fed beside decoding requests
        assert {15, 16, 31, 32, 63, 64} <= mixed
        # nothing left: no request, every page free, timings untouched, no response indexed
        assert not engine.has_unfinished() and not engine._seqs
        assert engine.manager.num_free_pages == free
        assert engine.timings["steps"] == 0
        if drafter == "suffix":
            assert engine.drafter.global_tokens == 0
        ids = [engine.add_request(p, sp, chat=False) for p, sp in zip(prompts, params)]
        assert ids == ["0", "1"]  # the request ids a fresh engine gives
        while engine.has_unfinished():
            engine.step()
        assert [engine.release(i).token_ids for i in ids] == want  # greedy and seeded outputs as a fresh engine's

    def test_max_prompt_len_bounds_the_prompts_and_a_small_pool_skips_what_it_cannot_hold(self, tiny):
        engine = SpecEngine(tiny, max_num_seqs=2)
        seen = self._record(engine)
        engine.warm_up(max_prompt_len=20)
        assert max(q for ctx, _ in seen for q in ctx) == 20
        small = SpecEngine(tiny, max_num_seqs=2, num_pages=3, tokens_per_block=16)  # 48 tokens
        seen = self._record(small)
        small.warm_up()
        assert max(q for ctx, _ in seen for q in ctx) <= 48
        assert small.manager.num_free_pages == 3 and not small._seqs

    def test_errors(self, tiny):
        engine = SpecEngine(tiny, max_num_seqs=2)
        for bad in (0, -1, 2.5, True, "8"):
            with pytest.raises(InvalidRequestError, match="max_prompt_len"):
                engine.warm_up(max_prompt_len=bad)
        engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2), chat=False)
        with pytest.raises(InvalidRequestError, match="idle"):
            engine.warm_up()
        engine.close()
        from specdec.errors import EngineClosedError

        with pytest.raises(EngineClosedError):
            engine.warm_up()
