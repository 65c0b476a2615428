"""Overlapped decode steps (``EngineConfig.overlap_steps``): the next step launched before the current
step's tokens reach the host gives exactly the outputs of plain steps, whatever ends requests.

On the CPU the same logic runs (the launch is synchronous there, so nothing overlaps in time): the next
step's input tokens come from the previous step's argmax tensor, the cache slot is reserved ahead, and a
request that ends drops the token of the step launched ahead.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec import EngineConfig, SamplingParams, SpecEngine
from specdec.drafters import SuffixAutomatonDrafter
from specdec.errors import ConfigError


def _outputs(engine, prompts, params):
    return [(o.token_ids, o.finish_reason) for o in engine.generate(prompts, params)]


def _pair(target, **kw):
    return (SpecEngine(target, None, EngineConfig(overlap_steps=False, **kw)),
            SpecEngine(target, None, EngineConfig(overlap_steps=True, **kw)))


def test_config_is_checked(tiny):
    with pytest.raises(ConfigError, match="overlap_steps must be True, False or None"):
        EngineConfig(overlap_steps="yes")
    with pytest.raises(ConfigError, match="never drafts"):
        SpecEngine(tiny, SuffixAutomatonDrafter(), EngineConfig(overlap_steps=True))
    # a drafter with max_draft_tokens=0 never drafts: allowed; so is one behind the draft gate (the
    # plain steps it takes chain)
    SpecEngine(tiny, SuffixAutomatonDrafter(), EngineConfig(overlap_steps=True, max_draft_tokens=0))
    assert SpecEngine(tiny, SuffixAutomatonDrafter(),
                      EngineConfig(overlap_steps=True, draft_gate=True)).executor.name == "overlap"
    # default (None): on where it helps, the null drafter on CUDA; so off here on the CPU, and off
    # (not an error) with a drafter that drafts
    assert EngineConfig().overlap_steps is None
    assert SpecEngine(tiny, None).executor.name == "plain"
    assert SpecEngine(tiny, SuffixAutomatonDrafter()).executor.name == "plain"
    assert SpecEngine(tiny, None, EngineConfig(overlap_steps=True)).executor.name == "overlap"


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8])
def test_equal_to_plain_steps_with_eos_and_lengths(tiny, max_num_seqs):
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [5], [40, 41], [3, 3, 3, 3]]
    params = [SamplingParams(max_new_tokens=n) for n in (30, 1, 12, 2, 45, 20)]  # EOS may end any of them
    plain, overlap = _pair(tiny, max_num_seqs=max_num_seqs)
    want, got = _outputs(plain, prompts, params), _outputs(overlap, prompts, params)
    assert got == want
    assert overlap.timings["overlapped_steps"] > 0 and plain.timings["overlapped_steps"] == 0
    assert overlap.runner.stats["chained_steps"] == overlap.timings["overlapped_steps"]
    assert overlap.manager.num_free_pages == overlap.manager.num_pages  # nothing leaked
    assert not overlap.executor.in_flight


def test_serving_calls_abort_and_late_arrivals(tiny):
    """The serving loop: requests added and aborted between steps stream the same tokens. (A request
    added while a step is in flight is admitted one step later: that step was launched without it.)"""
    plain, overlap = _pair(tiny, max_num_seqs=4)
    streams = []
    for engine in (plain, overlap):
        got, ids = {}, {}
        ids["a"] = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=25, ignore_eos=True))
        ids["b"] = engine.add_request([9, 8], SamplingParams(max_new_tokens=25, ignore_eos=True))
        for i in range(40):
            if i == 4:
                ids["c"] = engine.add_request([4, 4, 4, 4], SamplingParams(max_new_tokens=10, ignore_eos=True))
            if i == 7:
                engine.abort(ids["b"])
            for o in engine.step():
                got[o.req_id] = got.get(o.req_id, ()) + o.new_token_ids
            if not engine.has_unfinished():
                break
        streams.append((got, {k: engine.output(v).token_ids for k, v in ids.items()}))
        assert engine.manager.num_free_pages == engine.manager.num_pages
    assert streams[1] == streams[0]
    assert overlap.timings["overlapped_steps"] > 0


def test_abort_of_every_request_of_the_step_in_flight(tiny):
    engine = SpecEngine(tiny, None, EngineConfig(overlap_steps=True))
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=20, ignore_eos=True)) for p in ([1, 2], [3, 4, 5])]
    engine.step()
    engine.step()
    assert engine.executor.in_flight
    for r in ids:
        engine.abort(r)
    assert not engine.executor.in_flight  # dropped at the abort: nothing holds its tensors until the next step
    assert engine.step() == [] and not engine.executor.in_flight and not engine.has_unfinished()
    assert engine.manager.num_free_pages == engine.manager.num_pages
    later = engine.generate([[7, 8, 9]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert later[0].token_ids == SpecEngine(tiny, None).generate([[7, 8, 9]], SamplingParams(
        max_new_tokens=6, ignore_eos=True))[0].token_ids


def test_pool_pressure_falls_back_to_plain_steps(tiny):
    """A pool too small to reserve every request's next slot ahead: those steps run plainly (and the
    scheduler preempts as it would without overlap); outputs unchanged."""
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15, 16, 17, 18]]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    plain, overlap = _pair(tiny, max_num_seqs=3, num_pages=14, tokens_per_block=4)
    assert _outputs(overlap, prompts, params) == _outputs(plain, prompts, params)
    assert 0 < overlap.timings["overlapped_steps"] < overlap.timings["steps"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_mix_of_requests_gives_plain_outputs(tiny, data):
    n = data.draw(st.integers(1, 5))
    prompts = [data.draw(st.lists(st.integers(0, 62), min_size=1, max_size=12)) for _ in range(n)]
    params = [SamplingParams(max_new_tokens=data.draw(st.integers(1, 24)), ignore_eos=data.draw(st.booleans()),
                             **data.draw(st.sampled_from([{}, {"temperature": 1.0, "seed": 7},
                                                          {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 3}])))
              for _ in range(n)]
    kw = {"max_num_seqs": data.draw(st.integers(1, 4)), "tokens_per_block": data.draw(st.sampled_from([1, 4, 16])),
          "num_pages": data.draw(st.sampled_from([None, 64]))}
    plain, overlap = _pair(tiny, **kw)
    assert _outputs(overlap, prompts, params) == _outputs(plain, prompts, params)
    assert overlap.manager.num_free_pages == overlap.manager.num_pages


def test_overlap_is_not_offered_under_helix():
    from specdec.executor import overlap_wanted

    with pytest.raises(ConfigError, match="helix_cp=2"):
        overlap_wanted(True, True, "cuda", "NullDrafter", 0, helix_cp=2)
    assert overlap_wanted(None, True, "cuda", "NullDrafter", 0, helix_cp=2) is False
    assert overlap_wanted(None, True, "cuda", "NullDrafter", 0) is True
    assert overlap_wanted(None, True, "cpu", "NullDrafter", 0) is False


def test_sampled_requests_overlap_too(tiny):
    """A seeded sampled request draws its noise by position, so its next step is launched ahead like a
    greedy one's; beside greedy requests, every output equals plain steps'."""
    prompts = [[1, 2, 3], [9, 8, 7, 6], [4, 4], [30, 31, 32, 33, 34]]
    params = [SamplingParams(max_new_tokens=30, temperature=1.0, seed=11, ignore_eos=True),
              SamplingParams(max_new_tokens=22, temperature=0.7, top_p=0.8, seed=5),
              SamplingParams(max_new_tokens=25, ignore_eos=True),
              SamplingParams(max_new_tokens=18, temperature=1.3, top_k=5, seed=2, ignore_eos=True)]
    plain, overlap = _pair(tiny, max_num_seqs=4)
    assert _outputs(overlap, prompts, params) == _outputs(plain, prompts, params)
    steps = overlap.timings
    assert steps["overlapped_steps"] > steps["steps"] // 2  # the sampled rows did not turn overlap off
    alone = _outputs(SpecEngine(tiny, None, EngineConfig(overlap_steps=True)), prompts[:1], params[:1])
    assert alone == _outputs(overlap, prompts, params)[:1]  # and the seed reproduces alone


@pytest.mark.slow
def test_real_model_equal_to_plain_steps(smollm2):
    """SmolLM2 fp32 on HumanEval prompts, ended by its own EOS or the length limit."""
    from specdec.prompts import humaneval_prompts

    prompts = humaneval_prompts(range(0, 3))
    params = SamplingParams(max_new_tokens=40)
    plain, overlap = _pair(smollm2, max_num_seqs=3)
    assert _outputs(overlap, prompts, params) == _outputs(plain, prompts, params)
    assert overlap.timings["overlapped_steps"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU tests above run the same logic)")
class TestOnGPU:
    """Graph steps chained on the device: pinned argmax copies in turn, event waits, tokens copied
    into the next graph's inputs."""

    @pytest.mark.parametrize("batch", [1, 4])
    def test_equal_to_plain_graph_steps(self, batch):
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
        from step_profile import prompts, random_target

        target = random_target("cuda", torch.bfloat16, layers=4)
        ids = prompts(batch + 1, 30, target.config.vocab_size)
        params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (40, 7, 33, 12, 25)[: batch + 1]]
        plain, overlap = _pair(target, max_num_seqs=batch)
        assert SpecEngine(target, None, EngineConfig(max_num_seqs=batch)).executor.name == "overlap"  # the default on CUDA
        assert _outputs(overlap, ids, params) == _outputs(plain, ids, params)
        assert overlap.timings["overlapped_steps"] > 0 and overlap.graph_stats["graph_steps"] > 0
        scratch = int(overlap.runner.scratch_slot is not None)  # graphs hold one scratch page for padding
        assert overlap.manager.num_free_pages == plain.manager.num_free_pages == overlap.manager.num_pages - scratch
