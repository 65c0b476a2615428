"""Batched verification on the device (specdec.sampling) against the reference (specdec.verify),
and seeds that reproduce whatever the drafter.

Greedy rows are checked exactly; sampled rows in distribution, with the chi-square check of
test_verify (seeded, so deterministic; its negative control lives there). Whole batches of
independent requests (one seed each) give the trials in one call.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import SamplingParams, SpecEngine
from specdec.drafters import Draft, Drafter, HybridDrafter, NullDrafter, SuffixAutomatonDrafter
from specdec.drafters.block import BlockDrafterConfig, BlockDrafterNet, init_weights
from specdec.drafters.dflash import DFlashDrafter, DSparkDrafter
from specdec.errors import ConfigError
from specdec.sampling import (RowSampling, gumbel_noise, mix32, request_key, row_uniforms, sample_rows,
                              shape_logits, verify_batch)
from specdec.target import load_target
from specdec.verify import greedy_verify, logits_to_probs

from test_verify import CHI2_CRITICAL_1E3, _chi_square

VOCAB, K = 6, 2


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- counter RNG


@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=50, unique=True))
@settings(max_examples=60, deadline=None)
def test_mix32_is_a_32_bit_bijection_equal_on_ints_and_tensors(xs):
    ints = [mix32(x) for x in xs]
    assert all(0 <= h < 2**32 for h in ints) and len(set(ints)) == len(xs)
    assert mix32(torch.tensor(xs, dtype=torch.long)).tolist() == ints


@given(st.integers(-2**70, 2**70), st.integers(0, 2**31), st.integers(2, 50))
@settings(max_examples=40, deadline=None)
def test_noise_is_a_pure_function_of_seed_position_and_token(seed, position, vocab):
    key = torch.tensor([request_key(seed)] * 2)
    pos = torch.tensor([position, position + 1])
    g = gumbel_noise(key, pos, vocab)  # [2, vocab]
    assert g.shape == (2, vocab) and torch.isfinite(g).all()
    assert torch.equal(g, gumbel_noise(key, pos, vocab))  # no hidden state
    assert not torch.equal(g[0], g[1])  # the position matters
    other = gumbel_noise(torch.tensor([request_key(seed + 1)]), pos[:1], vocab)
    assert not torch.equal(g[0], other[0])  # the seed matters
    assert request_key(seed) == request_key(seed % 2**64)


def test_noise_is_standard_gumbel_and_uniforms_are_uniform():
    keys = torch.tensor([request_key(s) for s in range(400)]).repeat_interleave(50)  # [20000]
    pos = torch.arange(50).repeat(400)
    g = gumbel_noise(keys, pos, 64).flatten()  # 1.28M draws
    assert abs(float(g.mean()) - 0.5772157) < 0.01  # Euler-Mascheroni
    assert abs(float(g.var()) - torch.pi ** 2 / 6) < 0.02
    u = row_uniforms(keys, pos)  # [20000]
    assert ((u > 0) & (u < 1)).all()
    stat, dof = _chi_square(torch.bincount((u * 8).long(), minlength=8), torch.full((8,), 1 / 8))
    assert stat < CHI2_CRITICAL_1E3[dof]
    # neighbouring counters are not correlated
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.03


# --------------------------------------------------------------------------- per-row shaping


@given(seed=st.integers(0, 2**31 - 1), vocab=st.integers(2, 64),
       rows=st.lists(st.tuples(st.floats(0.2, 3.0), st.integers(0, 70), st.floats(0.01, 0.999) | st.just(1.0)),
                     min_size=1, max_size=6))
@settings(max_examples=60, deadline=None)
def test_shape_logits_is_logits_to_probs_row_by_row(seed, vocab, rows):
    """(top_p within fp32 rounding of 1, e.g. 0.99999994, is left out: whether the least likely tokens
    stay then depends on the order of the cumulative sum, fp32 here and float64 in the reference.)"""
    logits = torch.randn(len(rows), vocab, generator=_seeded(seed)) * 3  # [S, vocab]
    temp = torch.tensor([r[0] for r in rows], dtype=torch.float32)
    top_k = torch.tensor([r[1] for r in rows])
    top_p = torch.tensor([r[2] for r in rows], dtype=torch.float32)
    got = shape_logits(logits, temp, top_k, top_p).softmax(dim=-1)  # [S, vocab]
    for i, (t, k, p) in enumerate(rows):
        want = logits_to_probs(logits[i:i + 1], SamplingParams(temperature=t, top_k=k, top_p=p))[0]
        assert torch.equal(got[i] > 0, want > 0), (i, t, k, p)
        torch.testing.assert_close(got[i], want)


def test_shape_logits_without_limits_is_temperature_only():
    logits = torch.randn(3, 10, generator=_seeded(1))
    temp = torch.tensor([0.5, 1.0, 2.0])
    z = shape_logits(logits, temp, torch.zeros(3, dtype=torch.long), torch.ones(3), masked=False)
    torch.testing.assert_close(z, logits / temp[:, None])


# --------------------------------------------------------------------------- verify_batch vs the reference


def test_greedy_rows_are_the_argmax_exactly_in_a_mixed_batch():
    gen = _seeded(3)
    n_req = 40
    drafts, params = [], []
    for i in range(n_req):
        k = i % 4
        drafts.append(Draft(tuple(torch.randint(VOCAB, (k,), generator=gen).tolist())))
        params.append(SamplingParams() if i % 2 else SamplingParams(temperature=0.9, top_p=0.8))
    rows = sum(len(d) + 1 for d in drafts)
    logits = torch.randn(rows, VOCAB, generator=gen) * 2
    # make half of the greedy drafts right, so accepted prefixes of every length occur
    row, argmax = 0, logits.argmax(-1).tolist()
    for i, d in enumerate(drafts):
        if i % 4 == 1:
            drafts[i] = Draft(tuple(argmax[row:row + len(d)]))
        row += len(d) + 1
    out = verify_batch(logits, drafts, params, seeds=list(range(n_req)), positions=[5] * n_req)
    row = 0
    for d, p, emitted in zip(drafts, params, out):
        if p.greedy:
            assert emitted == greedy_verify(argmax[row:row + len(d) + 1], d.token_ids)
        assert 1 <= len(emitted) <= len(d) + 1 and list(emitted[:-1]) == list(d.token_ids[:len(emitted) - 1])
        row += len(d) + 1
    assert any(len(e) == len(d) + 1 and len(d) > 0 for e, d, p in zip(out, drafts, params) if p.greedy)


def _setup(one_hot: bool):
    """p ``[K + 1, VOCAB]`` (from logits, shaped by temperature and top-k) and q ``[K, VOCAB]`` or None."""
    gen = _seeded(0)
    logits = torch.randn(K + 1, VOCAB, generator=gen) * 1.5
    params = SamplingParams(temperature=0.9, top_k=5)
    p = logits_to_probs(logits, params)
    q = None if one_hot else torch.randn(K, VOCAB, generator=gen).softmax(-1)
    return logits, params, p, q


@pytest.mark.parametrize("one_hot", [True, False], ids=["one_hot_q", "random_q"])
def test_sampled_rows_in_a_batch_are_distributed_as_p(one_hot):
    """Each of many requests in one batch is an independent trial (its own seed); greedy requests
    interleaved with them keep their argmax. The token at position i (given the drafts before it
    were accepted) follows p[i], and drafts are accepted at the rate sum(min(p, q))."""
    logits, params, p, q = _setup(one_hot)
    trials, gen = 12_000, _seeded(2024)
    if q is None:  # a deterministic drafter always proposes the same chain
        chains = [[int(p[i].argmax()) for i in range(K)]] * trials
    else:
        chains = torch.stack([torch.multinomial(q[i], trials, replacement=True, generator=gen)
                              for i in range(K)], 1).tolist()
    greedy_logits = torch.randn(2, VOCAB, generator=gen)
    drafts, plist, blocks = [], [], []
    for t, chain in enumerate(chains):
        drafts.append(Draft(tuple(chain), probs=q))
        plist.append(params)
        blocks.append(logits)
        if t % 50 == 0:  # a greedy request between the sampled ones
            drafts.append(Draft((int(greedy_logits[0].argmax()),)))
            plist.append(SamplingParams())
            blocks.append(greedy_logits)
    out = verify_batch(torch.cat(blocks), drafts, plist, seeds=range(10**6, 10**6 + len(drafts)),
                       positions=[7] * len(drafts))
    greedy_want = greedy_logits.argmax(-1).tolist()
    sampled = [o for o, sp in zip(out, plist) if not sp.greedy]
    assert all(o == greedy_want for o, sp in zip(out, plist) if sp.greedy)
    for position in range(K + 1):
        tokens = torch.tensor([o[position] for o in sampled if len(o) > position])
        stat, dof = _chi_square(torch.bincount(tokens, minlength=VOCAB), p[position])
        assert stat < CHI2_CRITICAL_1E3[dof], f"position {position}: chi2 = {stat:.2f} over {len(tokens)}"
    q0 = torch.nn.functional.one_hot(p[0].argmax(), VOCAB).float() if q is None else q[0]
    rate = float(torch.minimum(p[0], q0).sum())
    accepted = sum(len(o) > 1 for o in sampled)
    assert abs(accepted - trials * rate) < 5 * (trials * rate * (1 - rate)) ** 0.5


def test_a_wrong_coupling_is_detected():
    """Negative control for the chi-square above: one noise for every seed (a broken counter) makes
    the emitted tokens a constant, far from p."""
    logits, params, p, _ = _setup(True)
    drafts = [Draft((0, 1))] * 2000
    out = verify_batch(logits.repeat(2000, 1), drafts, [params] * 2000, seeds=[5] * 2000, positions=[7] * 2000)
    stat, dof = _chi_square(torch.bincount(torch.tensor([o[0] for o in out]), minlength=VOCAB), p[0])
    assert stat > 5 * CHI2_CRITICAL_1E3[dof]


@pytest.mark.parametrize("with_probs", [False, True])
def test_out_of_vocabulary_drafts_are_rejected(with_probs):
    logits = torch.randn(3, VOCAB, generator=_seeded(4))
    q = torch.full((2, VOCAB), 1 / VOCAB) if with_probs else None
    for params in (SamplingParams(), SamplingParams(temperature=1.0)):
        for bad in (-7, VOCAB + 3):
            out = verify_batch(logits, [Draft((bad, 1), probs=q)], [params], [1], [0])[0]
            assert len(out) == 1 and 0 <= out[0] < VOCAB


def test_sample_rows_without_sampled_rows_is_the_argmax():
    logits = torch.randn(5, VOCAB, generator=_seeded(5))
    assert torch.equal(sample_rows(logits, None, None), logits.argmax(-1))
    assert torch.equal(sample_rows(logits, None, RowSampling()), logits.argmax(-1))


def test_verify_batch_rejects_bad_shapes():
    with pytest.raises(ValueError, match="one entry per request"):
        verify_batch(torch.zeros(2, 4), [Draft((1,))], [SamplingParams()], [], [0])
    with pytest.raises(ValueError, match="logits"):
        verify_batch(torch.zeros(3, 4), [Draft((1,))], [SamplingParams()], [0], [0])


# --------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A random 3-layer Llama (vocab 64) with a usable logit scale; block drafters read layers 0 and 2."""
    path = tmp_path_factory.mktemp("tiny_sampling")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=160,
                                   initializer_range=0.3, eos_token_id=63)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return load_target(path)


PROMPTS = [[1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2, 3], [7, 8, 9], list(range(10, 40)), [5, 5]]
SAMPLED = SamplingParams(max_new_tokens=24, temperature=0.7, top_p=0.95, seed=11, ignore_eos=True)


def _block(cls, shift: int):
    cfg = BlockDrafterConfig(block_size=4, shift_label=shift, target_layer_ids=(0, 2), target_hidden_size=32,
                             vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                             intermediate_size=64)
    return cls(init_weights(BlockDrafterNet(cfg), seed=1))


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return SamplingParams(**{**{f: getattr(params, f) for f in params.__slots__}, "seed": seed})


def _run(target, drafter, prompts, params, warm: list | None = None):
    engine = SpecEngine(target, drafter, max_draft_tokens=4, num_pages=128, draft_gate=False)
    if warm:  # other requests first: a suffix drafter's global automaton learns their responses
        engine.generate(warm, _with_seed(params, 99))
    return engine.generate(prompts, params)


@pytest.fixture(scope="module")
def null_outputs(target):
    """Each prompt alone with the null drafter, sampled with seeds 11, 12, .. (and greedy)."""
    sampled = [_run(target, NullDrafter(), [p], _with_seed(SAMPLED, 11 + i))[0].token_ids for i, p in enumerate(PROMPTS)]
    greedy = [o.token_ids for o in _run(target, NullDrafter(), PROMPTS, SamplingParams(max_new_tokens=24,
                                                                                      ignore_eos=True))]
    return sampled, greedy


DRAFTERS = {
    "suffix_cold": lambda: (SuffixAutomatonDrafter(), None),
    "suffix_warm": lambda: (SuffixAutomatonDrafter(), PROMPTS[::-1] + [[1, 2, 3, 4, 5, 6] * 3]),
    "dflash": lambda: (_block(DFlashDrafter, 0), None),
    "dspark": lambda: (_block(DSparkDrafter, 1), None),
    "hybrid": lambda: (HybridDrafter(_block(DSparkDrafter, 1), SuffixAutomatonDrafter()), PROMPTS[::-1]),
}


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_a_seed_gives_the_null_drafters_tokens_with_any_drafter(target, null_outputs, name):
    """Alone, then in a batch mixing greedy and sampled requests, then that batch again (the suffix
    drafter's global automaton now holds the first run's responses, so its drafts change and are
    accepted): each seeded request equals its solo null-drafter run, each greedy one its solo output."""
    sampled, greedy = null_outputs
    drafter, warm = DRAFTERS[name]()
    engine = SpecEngine(target, drafter, max_draft_tokens=4, num_pages=128, draft_gate=False)
    if warm:
        engine.generate(warm, _with_seed(SAMPLED, 99))
    alone = engine.generate([PROMPTS[0]], _with_seed(SAMPLED, 11))[0]
    assert alone.token_ids == sampled[0]
    greedy_params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    mixed = [_with_seed(SAMPLED, 11 + i) if i % 2 == 0 else greedy_params for i in range(len(PROMPTS))]
    for run in range(2):
        outs = engine.generate(PROMPTS, mixed)
        for i, o in enumerate(outs):
            assert o.token_ids == (sampled[i] if i % 2 == 0 else greedy[i]), f"request {i} ({name}, run {run})"
        assert sum(o.stats.drafted for o in outs) > 0
    if name.startswith("suffix"):  # speculation really happened on the sampled requests
        assert sum(o.stats.accepted for o in outs[::2]) >= 10


@pytest.mark.parametrize("temperature", [1e-38, 1e-30, 9.99e-6])
def test_a_temperature_below_1e_5_decodes_greedily(target, null_outputs, temperature):
    """Below GREEDY_BELOW a request is greedy (logits / temperature would overflow fp32 near 1e-38):
    the greedy tokens, with any seed, in a batch beside sampled requests; at 1e-5 it samples."""
    _, greedy = null_outputs
    tiny = SamplingParams(max_new_tokens=24, temperature=temperature, seed=5, ignore_eos=True)
    assert tiny.greedy and not SamplingParams(temperature=1e-5).greedy
    mixed = [tiny if i % 2 == 0 else _with_seed(SAMPLED, 11 + i) for i in range(len(PROMPTS))]
    outs = _run(target, SuffixAutomatonDrafter(), PROMPTS, mixed)
    assert [o.token_ids for o in outs[::2]] == greedy[::2]
    with pytest.raises(ConfigError, match="sampling temperature"):
        logits_to_probs(torch.zeros(1, VOCAB), tiny)


def test_sampled_requests_in_an_engine_batch_follow_p(target, paged_runner):
    """First tokens of 600 sampled requests (one prompt, seeds 0..599) in batches of 64 with greedy
    requests among them: distributed as logits_to_probs of the target's logits."""
    prompt = [3, 1, 4, 1, 5]
    params = SamplingParams(max_new_tokens=1, temperature=1.3, top_k=6, ignore_eos=True)
    engine = SpecEngine(target, SuffixAutomatonDrafter(), max_num_seqs=64, num_pages=128)
    plist = [_with_seed(params, s) if s % 10 else SamplingParams(max_new_tokens=1, ignore_eos=True)
             for s in range(660)]
    outs = engine.generate([prompt] * len(plist), plist)
    logits = paged_runner(target).step({"r": prompt}, context={"r"})["r"][-1:]  # [1, vocab]
    p = logits_to_probs(logits, params)[0]
    tokens = torch.tensor([o.token_ids[0] for o, sp in zip(outs, plist) if not sp.greedy])
    assert len(tokens) == 594
    stat, dof = _chi_square(torch.bincount(tokens, minlength=64), p)
    assert stat < CHI2_CRITICAL_1E3[dof], f"chi2 = {stat:.2f}"
    assert {o.token_ids[0] for o, sp in zip(outs, plist) if sp.greedy} == {int(logits.argmax())}


class _ProbDrafter(Drafter):
    """Drafts two tokens from a fixed q with its own seeded generator (a drafter with probabilities)."""

    def __init__(self, seed: int):
        self.gen = _seeded(seed)
        self.q = torch.randn(64, generator=_seeded(0)).mul(2).softmax(-1)

    def propose(self, req_ids, max_tokens):
        k = min(2, max_tokens)
        return [Draft(tuple(torch.multinomial(self.q, k, replacement=True, generator=self.gen).tolist()),
                      probs=self.q.expand(k, 64)) for _ in req_ids]


def test_drafts_with_probabilities_are_rejection_sampled_and_reproducible(target):
    params = _with_seed(SAMPLED, 5)
    a = _run(target, _ProbDrafter(1), PROMPTS, params)
    b = _run(target, _ProbDrafter(1), PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 24 for o in a)
    assert sum(o.stats.drafted for o in a) > 0
