"""Tests of specdec.verify: greedy and sampling verification, and how p is shaped.

The statistical tests are seeded, so they are deterministic; the negative
controls show that the same chi-square check fails a sampler with the classic
bug (recovered token drawn from p instead of the residual), so it can fail.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.config import SamplingParams
from specdec.drafters.base import Draft
from specdec.errors import ConfigError
from specdec.verify import greedy_verify, logits_to_probs, rejection_sample, verify_draft

# Chi-square critical values at alpha = 1e-3, by degrees of freedom (any table,
# e.g. NIST/SEMATECH e-Handbook 1.3.6.7.4); checked against torch below.
CHI2_CRITICAL_1E3 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}

VOCAB = 6
K = 2
TRIALS = 20_000

Sampler = Callable[[torch.Tensor, Sequence[int], "torch.Tensor | None", torch.Generator], list[int]]


# --------------------------------------------------------------------------- greedy


@pytest.mark.parametrize(
    ("target_argmax", "drafts", "emitted"),
    [
        ([5, 6, 7, 8], [5, 6, 7], [5, 6, 7, 8]),  # all accepted: k drafts + bonus
        ([4, 6, 7, 8], [5, 6, 7], [4]),  # first rejected: only the target's token
        ([5, 9, 7, 8], [5, 6, 7], [5, 9]),  # middle rejection: prefix + recovered
        ([5, 6, 9, 8], [5, 6, 7], [5, 6, 9]),  # last rejected
        ([3], [], [3]),  # k = 0: plain decoding
    ],
)
def test_greedy_verify_exact(target_argmax: list[int], drafts: list[int], emitted: list[int]) -> None:
    assert greedy_verify(target_argmax, drafts) == emitted


def test_greedy_verify_accepts_tensors_and_stops_at_first_mismatch() -> None:
    # A later draft matching again must not be accepted after a mismatch.
    assert greedy_verify(torch.tensor([1, 9, 3, 4]), torch.tensor([1, 2, 3])) == [1, 9]


def test_greedy_verify_rejects_wrong_lengths() -> None:
    with pytest.raises(ValueError, match="len\\(draft_tokens\\) \\+ 1"):
        greedy_verify([1, 2], [1, 2])


# --------------------------------------------------------------------------- rejection sampling, exact cases


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_probs(rows: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=generator).softmax(dim=-1)  # [rows, VOCAB]


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sample_is_deterministic_given_the_seed(one_hot: bool) -> None:
    init = _seeded(7)
    p, q = _random_probs(K + 1, init), _random_probs(K, init)
    draft_probs = None if one_hot else q
    drafts = [[int(t) for t in torch.randint(VOCAB, (K,), generator=init)] for _ in range(200)]

    def run(seed: int) -> list[list[int]]:
        gen = _seeded(seed)
        return [rejection_sample(p, d, draft_probs, gen) for d in drafts]

    first = run(123)
    assert run(123) == first
    assert run(124) != first  # the seed matters
    assert all(1 <= len(out) <= K + 1 and out[:-1] == d[: len(out) - 1] for out, d in zip(first, drafts))


def test_rejection_sample_k0_samples_from_p() -> None:
    p = torch.tensor([[0.0, 0.0, 1.0, 0.0]])  # [1, vocab]
    assert rejection_sample(p, [], None, _seeded(0)) == [2]
    assert rejection_sample(p, [], torch.empty(0, 4), _seeded(0)) == [2]


def test_rejection_sample_accepts_everything_when_q_equals_p() -> None:
    gen = _seeded(1)
    p = _random_probs(K + 1, gen)
    for _ in range(300):
        drafts = [int(torch.multinomial(p[i], 1, generator=gen)) for i in range(K)]
        out = rejection_sample(p, drafts, p[:K].clone(), gen)
        assert out[:K] == drafts and len(out) == K + 1


def test_rejection_sample_never_accepts_a_token_the_target_rules_out() -> None:
    p = torch.tensor([[0.5, 0.0, 0.5], [0.2, 0.3, 0.5]])  # [k + 1, vocab], p(1) = 0
    q = torch.tensor([[0.0, 1.0, 0.0]])
    gen = _seeded(2)
    for draft_probs in (q, None):
        outs = [rejection_sample(p, [1], draft_probs, gen) for _ in range(300)]
        assert all(len(out) == 1 and out[0] in (0, 2) for out in outs)


def test_rejection_sample_one_hot_p_accepts_its_token() -> None:
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    q = torch.tensor([[0.3, 0.4, 0.3]])
    for draft_probs in (q, None):
        assert rejection_sample(p, [1], draft_probs, _seeded(3)) == [1, 2]


def test_rejection_sample_degenerate_residual_falls_back_to_p() -> None:
    # q >= p everywhere (only rounding does this to real distributions): max(0, p - q) == 0.
    p = torch.tensor([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.4, 0.3, 0.5]])
    gen = _seeded(4)
    outs = [rejection_sample(p, [0], q, gen) for _ in range(200)]
    rejected = [out for out in outs if len(out) == 1]
    assert 0 < len(rejected) < len(outs)  # accepted with probability 1/2
    assert all(out == [0, 0] for out in outs if len(out) == 2)
    assert {out[0] for out in rejected} <= {0, 1, 2}


def test_rejection_sample_rejects_wrong_shapes() -> None:
    p = torch.full((3, 4), 0.25)
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(p, [1], None)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(p, [1, 2], torch.full((2, 5), 0.2))


# --------------------------------------------------------------------------- rejection sampling, distribution


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` ``[vocab]`` against ``probs`` ``[vocab]``, and its dof.

    Cells the distribution rules out must be empty (else the statistic is inf).
    """
    total = int(counts.sum())
    support = probs > 0
    if counts[~support].sum() > 0:
        return float("inf"), int(support.sum()) - 1
    expected = probs[support].double() * total
    assert expected.min() >= 5, "too few samples for a chi-square test"
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    return float(stat), int(support.sum()) - 1


def _counts(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=VOCAB)  # [VOCAB]


def _setup(one_hot: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Random p ``[K + 1, VOCAB]`` and q ``[K, VOCAB]`` (or None), fixed by a seed.

    p[0] rules out the token q[0] likes most, so drafts of a token with p = 0 occur.
    """
    gen = _seeded(0)
    p, q = _random_probs(K + 1, gen), _random_probs(K, gen)
    p[0, q[0].argmax()] = 0.0
    p[0] /= p[0].sum()
    return p, (None if one_hot else q)


def _run_trials(sampler: Sampler, one_hot: bool, trials: int = TRIALS) -> list[list[int]]:
    """Emitted tokens of ``trials`` independent verify steps, drafts drawn from q."""
    p, q = _setup(one_hot)
    gen = _seeded(2024)
    if q is None:  # a deterministic drafter always proposes the same chain
        drafts = [[int(p[i].argmax()) for i in range(K)]] * trials
    else:
        columns = [torch.multinomial(q[i], trials, replacement=True, generator=gen) for i in range(K)]
        drafts = torch.stack(columns, dim=1).tolist()  # [trials, K]
    return [sampler(p, d, q, gen) for d in drafts]


@functools.lru_cache(maxsize=None)
def _real_trials(one_hot: bool) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(out) for out in _run_trials(rejection_sample, one_hot))


def test_chi_square_table_matches_the_chi_square_tail() -> None:
    for dof, critical in CHI2_CRITICAL_1E3.items():
        tail = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(critical / 2, dtype=torch.float64))
        assert abs(float(tail) - 1e-3) < 2e-6, dof


@pytest.mark.parametrize("one_hot", [False, True], ids=["random_q", "one_hot_q"])
@pytest.mark.parametrize("position", range(K + 1))
def test_emitted_token_is_distributed_as_p(one_hot: bool, position: int) -> None:
    """Token ``position`` (given that all before it were accepted drafts) follows p[position]."""
    p, _ = _setup(one_hot)
    outs = _real_trials(one_hot)
    tokens = [out[position] for out in outs if len(out) > position]
    stat, dof = _chi_square(_counts(tokens), p[position])
    assert stat < CHI2_CRITICAL_1E3[dof], f"chi2 = {stat:.2f} with {dof} dof over {len(tokens)} samples"


@pytest.mark.parametrize("one_hot", [False, True], ids=["random_q", "one_hot_q"])
def test_acceptance_rate_is_sum_of_min_p_q(one_hot: bool) -> None:
    p, q = _setup(one_hot)
    q0 = torch.nn.functional.one_hot(p[0].argmax(), VOCAB).float() if q is None else q[0]
    rate = float(torch.minimum(p[0], q0).sum())
    accepted = sum(len(out) > 1 for out in _real_trials(one_hot))
    sigma = (TRIALS * rate * (1 - rate)) ** 0.5
    assert abs(accepted - TRIALS * rate) < 5 * sigma


def _recovers_from_p(
    target_probs: torch.Tensor, draft_tokens: Sequence[int], draft_probs: torch.Tensor | None, generator: torch.Generator
) -> list[int]:
    """A wrong sampler with the classic bug: on rejection it resamples from p, not from norm(max(0, p - q))."""
    p = target_probs.tolist()
    uniforms = torch.rand(len(draft_tokens) + 1, generator=generator).tolist()
    for i, x in enumerate(draft_tokens):
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if uniforms[i] * q_x >= p[i][x]:
            return [*draft_tokens[:i], _inverse_cdf(p[i], uniforms[-1])]
    return [*draft_tokens, _inverse_cdf(p[-1], uniforms[-1])]


def _inverse_cdf(probs: list[float], u: float) -> int:
    mass = 0.0
    for token, prob in enumerate(probs):
        mass += prob
        if u < mass:
            return token
    return max(t for t, prob in enumerate(probs) if prob > 0)  # rounding: the last token in the support


@pytest.mark.parametrize("one_hot", [False, True], ids=["random_q", "one_hot_q"])
def test_chi_square_detects_a_wrong_sampler(one_hot: bool) -> None:
    """Negative control: the check above fails a sampler that recovers from p."""
    p, _ = _setup(one_hot)
    outs = _run_trials(_recovers_from_p, one_hot)
    stat, dof = _chi_square(_counts([out[0] for out in outs]), p[0])
    assert stat > 5 * CHI2_CRITICAL_1E3[dof], f"chi2 = {stat:.2f}: the wrong sampler went unnoticed"


# --------------------------------------------------------------------------- logits_to_probs


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_temperature_matches_softmax_of_scaled_logits(temperature: float) -> None:
    logits = torch.randn(4, 50, generator=_seeded(5))  # [n, vocab]
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, (logits / temperature).softmax(dim=-1))


def test_low_precision_logits_give_fp32_rows_summing_to_one() -> None:
    logits = (torch.randn(3, 100, generator=_seeded(6)) * 4).to(torch.bfloat16)
    probs = logits_to_probs(logits, SamplingParams(temperature=0.7, top_k=20, top_p=0.9))
    assert probs.dtype == torch.float32 and probs.shape == (3, 100)
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(3))


def test_greedy_params_are_refused() -> None:
    with pytest.raises(ConfigError, match="temperature"):
        logits_to_probs(torch.zeros(1, 4), SamplingParams(temperature=0.0))


@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(2, 64),
    top_k=st.integers(1, 64),
    temperature=st.floats(0.2, 3.0),
)
@settings(max_examples=60, deadline=None)
def test_top_k_keeps_exactly_the_k_largest(seed: int, vocab: int, top_k: int, temperature: float) -> None:
    logits = torch.randn(3, vocab, generator=_seeded(seed)) * 3  # [n, vocab]
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature, top_k=top_k))
    kept = probs > 0
    assert (kept.sum(dim=-1) == min(top_k, vocab)).all()
    for row in range(3):
        smallest_kept = logits[row][kept[row]].min()
        assert (logits[row][~kept[row]] <= smallest_kept).all()
        expected = (logits[row][kept[row]] / temperature).softmax(dim=-1)
        torch.testing.assert_close(probs[row][kept[row]], expected)


def test_top_k_with_ties_keeps_exactly_k() -> None:
    probs = logits_to_probs(torch.zeros(2, 10), SamplingParams(temperature=1.0, top_k=3))
    assert ((probs > 0).sum(dim=-1) == 3).all()
    torch.testing.assert_close(probs.max(dim=-1).values, torch.full((2,), 1 / 3))


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.01, 1), (0.4, 1), (0.75, 2), (0.85, 3), (0.97, 4), (1.0, 4)],
)
def test_top_p_keeps_the_minimal_nucleus(top_p: float, kept: int) -> None:
    base = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = base.log()[torch.tensor([2, 0, 3, 1])]  # shuffled: probs [0.15, 0.5, 0.05, 0.3]
    probs = logits_to_probs(logits[None], SamplingParams(temperature=1.0, top_p=top_p))[0]
    order = torch.tensor([1, 3, 0, 2])  # tokens by descending probability
    assert (probs[order[:kept]] > 0).all() and (probs[order[kept:]] == 0).all()
    expected = base[:kept] / base[:kept].sum()
    torch.testing.assert_close(probs[order[:kept]], expected)


@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(1, 64),
    top_p=st.floats(0.01, 1.0),
)
@settings(max_examples=80, deadline=None)
def test_top_p_nucleus_is_minimal_and_sufficient(seed: int, vocab: int, top_p: float) -> None:
    logits = torch.randn(2, vocab, generator=_seeded(seed)) * 2  # [n, vocab]
    full = logits.softmax(dim=-1)
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(2))
    for row in range(2):
        kept = probs[row] > 0
        assert kept[full[row].argmax()]  # the top token always survives
        if (~kept).any():  # a prefix of the sorted order
            assert full[row][kept].min() >= full[row][~kept].max()
        mass = float(full[row][kept].sum())
        assert mass >= top_p - 1e-5 or kept.all()  # sufficient
        assert mass - float(full[row][kept].min()) < top_p + 1e-5  # minimal: dropping the smallest falls short


def test_top_k_applies_before_top_p() -> None:
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # top-k = 2 renormalises to [4/7, 3/7]; top-p = 0.5 then keeps only the first token.
    # (top-p first would keep two tokens: 0.4 < 0.5.)
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5))
    torch.testing.assert_close(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


# --------------------------------------------------------------------------- verify_draft


def test_verify_draft_greedy_uses_the_argmax() -> None:
    logits = torch.full((3, 5), -1.0)
    logits[0, 4] = logits[1, 2] = logits[2, 0] = 1.0  # argmax [4, 2, 0]
    assert verify_draft(logits, Draft(token_ids=(4, 1)), SamplingParams()) == [4, 2]
    assert verify_draft(logits, Draft(token_ids=(4, 2)), SamplingParams()) == [4, 2, 0]


@pytest.mark.parametrize("with_probs", [False, True])
def test_verify_draft_sampling_is_rejection_sample_of_shaped_p(with_probs: bool) -> None:
    init = _seeded(8)
    logits = torch.randn(K + 1, VOCAB, generator=init)
    q = _random_probs(K, init) if with_probs else None
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    draft = Draft(token_ids=(1, 3), probs=q)
    for seed in range(20):
        expected = rejection_sample(logits_to_probs(logits, params), [1, 3], q, _seeded(seed))
        assert verify_draft(logits, draft, params, _seeded(seed)) == expected


def test_drafts_are_chains_until_trees_are_verified() -> None:
    """``Draft`` offers no tree field: one the engine would ignore is refused at construction."""
    with pytest.raises(TypeError, match="parents"):
        Draft(token_ids=(1, 2), parents=(-1, -1))
