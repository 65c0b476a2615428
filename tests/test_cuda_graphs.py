"""CUDA-graph steps: bucketing (pure functions, CPU), and on the GPU replay == eager and strict lossless."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import SamplingParams, SpecEngine
from specdec.drafters import SuffixAutomatonDrafter
from specdec.errors import ConfigError
from specdec.graphs import (MAX_GRAPH_SPLITS, MIN_KV_BUCKET, GraphKey, GraphPolicy, all_buckets, graph_key,
                            next_pow2, pad_step_into, single_prompt_buckets, split_chunk)

HAS_CUDA = torch.cuda.is_available()
POLICY = GraphPolicy(max_num_seqs=64, max_draft_tokens=8, max_context=8192)


# --------------------------------------------------------------------------- buckets (CPU)


@pytest.mark.parametrize(("q_lens", "kv_lens", "want"), [
    ([1], [300], GraphKey(1, 1, 1, 512)),  # decode, batch 1
    ([5], [40], GraphKey(1, 8, 9, MIN_KV_BUCKET)),  # a verify of 5 tokens: the 9-token kernel, 8 rows
    ([9], [9000 - 1192], GraphKey(1, 9, 9, 8192)),  # tokens capped at requests x (1 + k)
    ([1, 1, 1], [10, 20, 30], GraphKey(4, 4, 1, MIN_KV_BUCKET)),
    ([9, 1, 1], [10, 20, 700], GraphKey(4, 16, 9, 1024)),
])
def test_graph_key_buckets(q_lens, kv_lens, want):
    assert graph_key(POLICY, q_lens, kv_lens) == (want, "")


@pytest.mark.parametrize(("q_lens", "kv_lens", "reason"), [
    ([1] * 65, [5] * 65, "65 requests > max_num_seqs 64"),
    ([10], [50], "feeds 10 tokens > 1 + max_draft_tokens = 9"),
    ([1], [8193], "kv_len 8193 > max_context 8192"),
    ([], [], "no generation requests"),
])
def test_graph_key_says_why_a_step_runs_eagerly(q_lens, kv_lens, reason):
    key, why = graph_key(POLICY, q_lens, kv_lens)
    assert key is None and reason in why


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 8000)), min_size=1, max_size=64),
       st.integers(1, 64), st.booleans())
def test_every_fitting_step_gets_a_bucket_that_holds_it(reqs, max_seqs, invariant):
    policy = GraphPolicy(max_num_seqs=max_seqs, max_draft_tokens=8, max_context=8192, batch_invariant=invariant)
    q_lens = [q for q, _ in reqs]
    kv_lens = [q + extra for q, extra in reqs]
    key, why = graph_key(policy, q_lens, kv_lens)
    if len(reqs) > max_seqs or max(kv_lens) > 8192:
        assert key is None and why
        return
    assert why == ""
    assert key.num_seqs >= len(reqs) and key.num_seqs <= max_seqs
    assert key.num_tokens >= sum(q_lens) and key.num_tokens <= key.num_seqs * key.max_q_len
    assert key.max_q_len >= max(q_lens) and key.max_kv_len >= max(kv_lens)
    if invariant:  # one bucket for every step
        assert key == GraphKey(max_seqs, max_seqs * 9, 9, 8192)
    else:  # few buckets: powers of two (or the caps), decode or full verify length
        assert key.num_seqs in (next_pow2(len(reqs)), max_seqs)
        assert key.max_q_len in (1, 9)
        assert key.num_tokens == key.num_seqs * key.max_q_len or key.num_tokens & (key.num_tokens - 1) == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 3000)), min_size=1, max_size=24),
       st.integers(1, 24), st.sampled_from([1, 4, 8]), st.booleans())
def test_all_buckets_lists_every_bucket_a_step_can_need(reqs, max_seqs, k, invariant):
    """``all_buckets`` (what capture_graphs captures) holds the bucket of every fitting step, and
    each listed bucket is the one its sample step falls in."""
    policy = GraphPolicy(max_num_seqs=max_seqs, max_draft_tokens=k, max_context=4096, batch_invariant=invariant)
    listed = all_buckets(policy)
    assert len(set(key for key, _ in listed)) == len(listed)
    for key, q_lens in listed:
        assert graph_key(policy, q_lens, [key.max_kv_len] * len(q_lens)) == (key, "")
    q_lens = [min(q, 1 + k) for q, _ in reqs][:max_seqs]
    kv_lens = [q + extra for q, (_, extra) in zip(q_lens, reqs)]
    key, _ = graph_key(policy, q_lens, kv_lens)
    assert key in {key for key, _ in listed}
    if max(q_lens) == 1:
        assert key in {key for key, _ in all_buckets(policy, decode_only=True)}
    if not invariant:
        assert all(b.max_kv_len <= 512 for b, _ in all_buckets(policy, max_kv_len=300))


@given(st.integers(1, 1 << 21))
def test_split_chunk_is_fixed_below_4k_and_bounds_the_splits(max_kv):
    chunk = split_chunk(max_kv)
    assert chunk % 128 == 0 and chunk >= 256  # whole key tiles of every tile size
    assert -(-max_kv // chunk) <= MAX_GRAPH_SPLITS
    assert chunk == 256 if max_kv <= 4096 else chunk < 2 * max(256, -(-max_kv // MAX_GRAPH_SPLITS))
    assert split_chunk(max_kv + 1) >= chunk  # a larger bucket never splits finer


@given(st.integers(1, 1 << 20), st.integers(0, 1 << 20), st.booleans())
def test_an_eager_step_splits_where_its_graph_bucket_does(kv, extra_context, prompt):
    """Eager phases split at split_chunk(their longest kv_len) (triton_gqa.plan), graph steps at
    split_chunk(their bucket's kv): the same chunk, so the same split offsets, whatever the context
    limit (a power of two or not)."""
    from specdec.graphs import prompt_graph_key

    policy = GraphPolicy(max_num_seqs=4, max_draft_tokens=3, max_context=kv + extra_context, prompt_graphs=True)
    key, why = (prompt_graph_key(policy, [1], [kv]) if prompt else graph_key(policy, [1], [kv]))
    assert not why and key.max_kv_len >= kv
    assert split_chunk(key.max_kv_len) == split_chunk(kv)


def test_all_buckets_for_a_small_policy():
    policy = GraphPolicy(max_num_seqs=3, max_draft_tokens=2, max_context=600)
    got = {key for key, _ in all_buckets(policy, max_kv_len=200)}
    assert got == {GraphKey(1, 1, 1, 256), GraphKey(2, 2, 1, 256), GraphKey(3, 3, 1, 256), GraphKey(1, 2, 3, 256),
                   GraphKey(1, 3, 3, 256), GraphKey(2, 4, 3, 256), GraphKey(2, 6, 3, 256),
                   GraphKey(3, 4, 3, 256), GraphKey(3, 8, 3, 256), GraphKey(3, 9, 3, 256)}
    assert {key.max_kv_len for key, _ in all_buckets(policy)} == {256, 512, 600}


def test_capture_graphs_is_a_no_op_on_the_cpu(tmp_path):
    from helpers import tiny_llama

    engine = SpecEngine(tiny_llama(tmp_path, "cpu"), tokens_per_block=4)
    assert engine.capture_graphs(progress=False) == 0


@pytest.mark.parametrize("bad", [0, -3, 2.5, "512"])
def test_all_buckets_refuses_a_bad_max_kv_len(bad):
    with pytest.raises(ConfigError, match="max_kv_len must be an integer >= 1"):
        all_buckets(GraphPolicy(max_num_seqs=2, max_draft_tokens=2, max_context=600), max_kv_len=bad)


def test_pad_step_pads_to_the_bucket_and_refuses_overflow():
    import numpy as np

    key = GraphKey(2, 4, 9, 256)
    buf = np.full((3, 4), 7, dtype=np.int64)  # what an earlier step left in the pinned buffer
    pad_step_into(buf, key, [5, 6], [10, 11], [40, 41], 999)
    assert buf.tolist() == [[5, 6, 0, 0], [10, 11, 0, 0], [40, 41, 999, 999]]
    with pytest.raises(ValueError, match="more than its bucket"):
        pad_step_into(buf, key, [1] * 5, [0] * 5, [0] * 5, 999)


def test_config_validates_graph_settings():
    from specdec.config import EngineConfig

    with pytest.raises(ConfigError, match="cuda_graphs must be True or False"):
        EngineConfig(cuda_graphs=1)
    with pytest.raises(ConfigError, match="batch_invariant=True needs cuda_graphs=True"):
        EngineConfig(cuda_graphs=False, batch_invariant=True)


def test_cpu_steps_run_eagerly_and_say_why(tmp_path):
    from helpers import tiny_llama

    target = tiny_llama(tmp_path, "cpu")
    engine = SpecEngine(target, SuffixAutomatonDrafter(), tokens_per_block=4)
    engine.generate([[1, 2, 3, 1, 2, 3]], SamplingParams(max_new_tokens=6, ignore_eos=True))
    stats = engine.runner.stats
    assert stats["graph_steps"] == 0 and stats["eager_steps"] == engine.timings["steps"]
    assert stats["eager_reasons"] == {"device is cpu, graphs need cuda": engine.timings["steps"]}
    off = SpecEngine(target, tokens_per_block=4, cuda_graphs=False)
    off.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert set(off.runner.stats["eager_reasons"]) == {"cuda_graphs disabled"}


# --------------------------------------------------------------------------- GPU


def _only_prompt_steps_eager(reasons) -> bool:
    """Every eager step was a mixed step or a prompt step too large for a prompt graph."""
    return all(r == "a context phase in the step" or r.startswith("a prompt step of") for r in reasons)


def _generate(target, drafter, prompts, max_new_tokens, **kw):
    engine = SpecEngine(target, drafter, **kw)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    return [o.token_ids for o in outs], engine


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
class TestOnGPU:
    def test_graph_steps_equal_eager_steps_in_fp32(self, tmp_path):
        from helpers import tiny_llama

        target = tiny_llama(tmp_path, "cuda", vocab_size=256, hidden_size=576, intermediate_size=256,
                            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                            eos_token_id=255)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 255, (n,), generator=g).tolist() for n in (600, 5, 130)] + [[1, 2, 3, 4] * 30]
        for batch in (prompts[:1], prompts):
            eager, _ = _generate(target, SuffixAutomatonDrafter(), batch, 40, cuda_graphs=False)
            graph, engine = _generate(target, SuffixAutomatonDrafter(), batch, 40)
            null, _ = _generate(target, None, batch, 40)
            assert graph == eager == null
            assert engine.runner.stats["graph_steps"] > 0 and engine.runner.stats["graphs_captured"] > 0
            assert _only_prompt_steps_eager(engine.runner.stats["eager_reasons"]), engine.runner.stats["eager_reasons"]

    def test_captured_before_serving_equals_captured_on_demand(self, tmp_path):
        """capture_graphs() captures every generation bucket and every one-request prompt bucket up
        front (scratch slot only): generation then captures only prompt buckets of several requests,
        and outputs equal those of an engine that captured on demand."""
        from helpers import tiny_llama

        target = tiny_llama(tmp_path, "cuda", vocab_size=256, hidden_size=64, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                            eos_token_id=255)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 255, (n,), generator=g).tolist() for n in (40, 5, 130)] + [[1, 2, 3, 4] * 30]
        on_demand, _ = _generate(target, SuffixAutomatonDrafter(), prompts, 40, max_num_seqs=4)
        engine = SpecEngine(target, SuffixAutomatonDrafter(), max_num_seqs=4)
        captured = engine.capture_graphs(max_kv_len=300, progress=False)
        policy = engine.runner.policy
        assert captured == len(all_buckets(policy, max_kv_len=300)) + len(single_prompt_buckets(policy, 300)) > 0
        before = set(engine.runner._graphs)
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=40, ignore_eos=True))
        assert [o.token_ids for o in outs] == on_demand
        later = set(engine.runner._graphs) - before
        assert all(k.phase == "context" and k.num_seqs > 1 for k in later), later
        assert engine.runner.stats["graphs_captured"] == captured + len(later)
        assert engine.runner.stats["graph_steps"] > 0

    def test_replay_equals_eager_in_bf16(self, tmp_path):
        """One verify step, same inputs: replays are identical, and equal the eager forward up to
        bf16 rounding (the GEMMs see 5 rows eagerly, the bucket's 8 in the graph)."""
        from specdec.model_runner import StepInput
        from specdec.target import load_target

        from helpers import tiny_llama

        tiny_llama(tmp_path, "cpu", vocab_size=256, hidden_size=576, intermediate_size=256,
                   num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048)
        target = load_target(tmp_path, dtype=torch.bfloat16, device="cuda")
        # plain steps: this test drives the runner itself (no step launched ahead, an eager prompt)
        engine = SpecEngine(target, tokens_per_block=16, overlap_steps=False, prompt_graphs=False)
        req = engine.add_request(list(range(1, 200)), SamplingParams(max_new_tokens=64, ignore_eos=True))
        engine.step()  # the prompt (eager: a context phase)
        seq, n = engine._seqs[req], engine._seqs[req].num_cached
        engine.manager.append(req, 5)

        def step():
            return StepInput([seq.tokens[-1], 7, 8, 9, 10], list(range(n, n + 5)), engine.manager.slots(req, n, n + 5),
                             [], [(5, n + 5, tuple(engine.manager.page_table(req)))], [0, 1, 2, 3, 4])

        first = engine.runner.execute(step())  # captures, then replays
        assert first.graph and first.backends == {"generation": "triton_gqa"}
        logits = first.logits.clone()
        again = engine.runner.execute(step())
        assert torch.equal(again.logits, logits) and again.argmax == first.argmax
        engine.runner._no_graph = "test: eager"
        eager = engine.runner.execute(step())
        assert not eager.graph
        torch.testing.assert_close(logits, eager.logits, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
class TestSmolLM2OnGPU:
    """The real model on the GPU with graph steps: strict lossless in fp32; in bf16 with batch_invariant."""

    @pytest.fixture(scope="class")
    def prompts(self):
        from specdec.errors import CheckpointError
        from specdec.prompts import humaneval_prompts

        try:  # the real model and prompts travel to the GPU machine only when staged
            return humaneval_prompts(range(100, 106))
        except CheckpointError as e:
            pytest.skip(f"HumanEval prompts not installed on this machine: {e}")

    @pytest.mark.parametrize("batch", [1, 6])
    def test_strict_lossless_fp32(self, prompts, batch):
        from specdec.target import load_target

        target = load_target("smollm2-135m", device="cuda")
        groups = [[p] for p in prompts[:2]] if batch == 1 else [prompts[:batch]]
        for group in groups:
            null, _ = _generate(target, None, group, 96)
            drafted, engine = _generate(target, SuffixAutomatonDrafter(), group, 96)
            assert drafted == null
            assert engine.runner.stats["graph_steps"] > 0

    @pytest.mark.parametrize("batch", [1, 4])
    def test_bf16_batch_invariant_outputs_equal_the_null_drafters(self, prompts, batch):
        from specdec.target import load_target

        target = load_target("smollm2-135m", dtype=torch.bfloat16, device="cuda")
        kw = dict(batch_invariant=True, max_num_seqs=4)
        null, _ = _generate(target, None, prompts[:batch], 128, **kw)
        drafted, engine = _generate(target, SuffixAutomatonDrafter(), prompts[:batch], 128, **kw)
        assert drafted == null
        assert _only_prompt_steps_eager(engine.runner.stats["eager_reasons"]), engine.runner.stats["eager_reasons"]


# --------------------------------------------------------------------------- prompt buckets (pure)

PROMPT_POLICY = GraphPolicy(max_num_seqs=8, max_draft_tokens=8, max_context=2048, prompt_graphs=True)


@given(st.lists(st.integers(1, 300), min_size=1, max_size=10))
def test_prompt_key_holds_the_step_or_says_why(prompts):
    from specdec.graphs import MAX_PROMPT_GRAPH_TOKENS, prompt_graph_key

    key, why = prompt_graph_key(PROMPT_POLICY, prompts, prompts)
    if len(prompts) > 8:
        assert key is None and "max_num_seqs" in why
    elif sum(prompts) > MAX_PROMPT_GRAPH_TOKENS:
        assert key is None and "tokens" in why
    else:
        assert why == "" and key.phase == "context"
        assert key.num_seqs >= len(prompts) and key.num_tokens >= sum(prompts) and key.max_q_len >= max(prompts)
        assert key.max_kv_len >= max(prompts) and key.max_q_len <= key.num_tokens <= MAX_PROMPT_GRAPH_TOKENS
        assert all(v & (v - 1) == 0 for v in (key.num_seqs, key.num_tokens, key.max_q_len))


def test_prompt_keys_are_off_unless_asked_and_differ_from_generation_keys():
    from specdec.graphs import prompt_graph_key, single_prompt_buckets

    assert prompt_graph_key(POLICY, [5], [5]) == (None, "a context phase in the step")
    assert single_prompt_buckets(POLICY) == []
    key, _ = prompt_graph_key(PROMPT_POLICY, [1], [1])
    assert key == GraphKey(1, 16, 16, MIN_KV_BUCKET, "context") != GraphKey(1, 16, 16, MIN_KV_BUCKET)


@given(st.integers(1, 512))
def test_single_prompt_buckets_cover_every_one_request_prompt(length):
    from specdec.graphs import prompt_graph_key, single_prompt_buckets

    buckets = single_prompt_buckets(PROMPT_POLICY)
    assert len({k for k, _ in buckets}) == len(buckets) == 6  # 16 .. 512 tokens
    for key, n in buckets:  # each listed length falls in its own bucket
        assert prompt_graph_key(PROMPT_POLICY, [n], [n])[0] == key
    assert prompt_graph_key(PROMPT_POLICY, [length], [length])[0] in {k for k, _ in buckets}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (the bucketing above is tested on the CPU)")
class TestPromptGraphsOnGPU:
    """Prompt-only steps replayed from graphs give the eager prompt step's tokens."""

    @pytest.mark.parametrize("batch", [1, 3])
    def test_equal_to_eager_prompt_steps(self, batch):
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
        from step_profile import prompts, random_target

        from specdec import EngineConfig, SamplingParams, SpecEngine

        target = random_target("cuda", torch.float32, layers=3)
        ids = prompts(2 * batch, 37, target.config.vocab_size)
        params = SamplingParams(max_new_tokens=12, ignore_eos=True)
        runs = []
        for prompt_graphs in (False, True):
            engine = SpecEngine(target, None, EngineConfig(max_num_seqs=batch, prompt_graphs=prompt_graphs))
            captured = engine.capture_graphs(max_kv_len=64, progress=False)
            runs.append([o.token_ids for o in engine.generate(ids, params)])
            reasons = engine.graph_stats["eager_reasons"]
            if prompt_graphs:
                assert captured > 0 and "a context phase in the step" not in reasons, reasons
                assert engine.graph_stats["backends"].get("context:triton_gqa", 0) > 0
        assert runs[1] == runs[0]

    @pytest.mark.parametrize("length", [20, 37, 100, 300])
    def test_bf16_prompt_step_bit_for_bit(self, length):
        """In bf16 a prompt step replayed from its graph writes the same cache bits and gives the
        same last-token logits as the eager step (the CPU twin: test_triton_gqa's
        test_eager_prompt_step_equals_its_prompt_graph). The split offsets and attention tiles of
        eager prompt steps follow the graphs'; before, 13/64 HumanEval outputs changed."""
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
        from step_profile import prompts, random_target

        from specdec import EngineConfig, SpecEngine
        from specdec.model_runner import StepInput

        target = random_target("cuda", torch.bfloat16, layers=3)
        ids = prompts(1, length, target.config.vocab_size)[0]
        out = []
        for prompt_graphs in (False, True):
            engine = SpecEngine(target, None, EngineConfig(max_num_seqs=2, prompt_graphs=prompt_graphs))
            engine.manager.allocate("r", length)
            slots = engine.manager.slots("r", 0, length)
            table = tuple(engine.manager.page_table("r"))
            step = StepInput(list(ids), list(range(length)), slots, [(length, length, table)], [], [length - 1])
            result = engine.runner.execute(step)
            assert result.graph == prompt_graphs
            idx = torch.tensor(slots, device="cuda")
            kv = [torch.cat([k[idx].flatten(), v[idx].flatten()]) for k, v in zip(engine.pool.k, engine.pool.v)]
            out.append((result.logits.clone(), torch.cat(kv)))
        assert torch.equal(out[0][1], out[1][1])  # the prompt's cache, every layer
        assert torch.equal(out[0][0], out[1][0])  # the last token's logits
