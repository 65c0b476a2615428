"""The fused sampling kernel (specdec.sampling_kernel) against the torch reference (specdec.sampling).

Exact equality throughout: the kernel's perturbed logits ``z + G`` (with ``-inf`` where top-k /
top-p drop a token) must equal, bit for bit, ``apply_cutoffs(logits / T) + gumbel_noise`` of the
torch path, and so must the sampled tokens, for random logits (fp32, bf16, fp16), vocabularies
that are not multiples of the kernel's block, rows mixing temperature, top-k, top-p and none,
exact ties in the logits, 64-bit seeds and positions past 2**32, one or many vocabulary splits.

Where the tests run:

- on a CUDA GPU: everything here, with the compiled kernel (libdevice ``log``/``log1p``), plus
  the ``gpu`` test at vocab 49152;
- on a CPU machine: the kernels run in Triton's interpreter, chosen when the kernel module is
  imported with ``TRITON_INTERPRET=1``; ``test_cpu_interpreter_suite`` re-runs this file in a
  subprocess with that variable set (``TRITON_INTERPRET=1 python -m pytest
  tests/test_sampling_kernel.py`` shows the cases one by one).

The cutoffs (``row_cutoffs``) that both paths share are checked against the stable-sort mask
that ``shape_logits`` computed before them, on every machine.
"""

from __future__ import annotations


import pytest
import torch
from helpers import run_interpreted
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec import SamplingParams
from specdec.drafters import Draft
from specdec.sampling import (_STREAM_SAMPLE, RowSampling, apply_cutoffs, gumbel_noise, request_key, row_cutoffs,
                              sample_rows)
from specdec.verify import nucleus_prefix

pytest.importorskip("triton", reason="triton is not installed (pip extra 'gpu'): no sampling kernel to test")

from specdec import sampling, sampling_kernel  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
INTERPRETED = sampling_kernel.INTERPRETED
DEVICE = "cpu" if INTERPRETED or not HAS_CUDA else "cuda"
needs_kernels = pytest.mark.skipif(
    not (INTERPRETED or HAS_CUDA),
    reason="no CUDA GPU and the kernel was not built for the interpreter; "
    "test_cpu_interpreter_suite runs these with TRITON_INTERPRET=1",
)
# The split kernel loops over a runtime count of blocks, which Triton 3.6's interpreter cannot run
# with NumPy >= 2.4 (specdec.attention.backends.triton_interp); the fixture fixes it for this module.
pytestmark = pytest.mark.usefixtures("fixed_triton_interpreter")
SEEDS = st.one_of(st.integers(0, 2**16), st.sampled_from([2**64 - 1, 2**63, 2**32 + 7, -3, 2**70 + 11]))


def _sorted_mask(z: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """The stable-sort mask of top-k then top-p (exact fixed-point masses, verify.nucleus_prefix)."""
    vocab = z.shape[-1]
    tk, tp = torch.tensor(top_k), torch.tensor(top_p, dtype=torch.float32)
    srt, order = z.sort(dim=-1, descending=True, stable=True)
    k = torch.where((tk > 0) & (tk < vocab), tk, vocab)
    drop = ~nucleus_prefix(srt, k, tp)
    return z.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


def _logits(gen: torch.Generator, n: int, vocab: int, ties: bool, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(n, vocab, generator=gen) * 3
    if ties:  # a coarse grid: many exact ties, also at the top-k / top-p cutoffs
        x = (x * 2).round() / 2
    return x.to(dtype)


ROW = st.tuples(st.sampled_from([0.3, 0.7, 1.0, 1.7]), st.sampled_from([0, 0, 1, 2, 5, 40, 5000]),
                st.sampled_from([1.0, 1.0, 0.5, 0.9, 0.99]))


# --------------------------------------------------------------------------- the shared cutoffs (torch)


@given(seed=st.integers(0, 2**20), vocab=st.sampled_from([3, 17, 100, 1000]), ties=st.booleans(),
       rows=st.lists(ROW, min_size=1, max_size=8))
@settings(max_examples=60, deadline=None)
def test_row_cutoffs_keep_the_stable_sort_prefix(seed, vocab, ties, rows):
    z = _logits(torch.Generator().manual_seed(seed), len(rows), vocab, ties, torch.float32)
    z = z / torch.tensor([r[0] for r in rows])[:, None]
    top_k, top_p = [r[1] for r in rows], [r[2] for r in rows]
    got = apply_cutoffs(z, row_cutoffs(z, top_k, top_p))
    assert torch.equal(got, _sorted_mask(z, top_k, top_p))


def test_row_cutoffs_cut_through_ties_in_index_order():
    z = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 2.0, 0.0]])
    thr, icut = row_cutoffs(z, [3], [1.0])  # 3, 3, then the first 2 (index 2)
    assert thr.tolist() == [2.0] and icut.tolist() == [2]
    assert torch.isfinite(apply_cutoffs(z, (thr, icut))).tolist() == [[False, True, True, True, False, False, False]]
    thr, icut = row_cutoffs(z, [0], [1.0])  # no limit: keep all
    assert thr.tolist() == [float("-inf")] and icut.tolist() == [7]


# --------------------------------------------------------------------------- the sort-free cutoff kernel


def _cutoff_logits(gen: torch.Generator, n: int, vocab: int, kind: str) -> torch.Tensor:
    """``[n, vocab]`` fp32 logits: random, coarse (exact ties), flat (equal or nearly), hot (top-p
    needs most of the vocabulary), or random with ``-inf`` stretches."""
    x = torch.randn(n, vocab, generator=gen) * 3
    if kind == "ties":
        x = (x * 2).round() / 2
    elif kind == "flat":
        x = torch.where(torch.arange(n)[:, None] % 2 == 0, torch.zeros_like(x), x * 1e-4)
    elif kind == "hot":
        x = x / 40.0
    elif kind == "inf":
        x[:, ::3] = float("-inf")
        x[0] = float("-inf")
    elif kind == "zeros":  # exact +0.0 and -0.0 (equal: ties in index order), also at the top
        pick = torch.rand(n, vocab, generator=gen)
        x = torch.where(pick < 0.3, 0.0, torch.where(pick < 0.6, -0.0, -x.abs() - 1))
    return x


def _keeps(z: torch.Tensor, thr: torch.Tensor, icut: torch.Tensor) -> torch.Tensor:
    """The tokens a cutoff keeps, ``-inf`` ones included (apply_cutoffs' rule, as a mask)."""
    idx = torch.arange(z.shape[-1], device=z.device)
    return (z > thr[:, None]) | ((z == thr[:, None]) & (idx[None, :] <= icut[:, None]))


def _reference_keeps(z: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """The stable-sort prefix top-k then top-p keep (verify.nucleus_prefix), as a mask over tokens."""
    vocab = z.shape[-1]
    tk, tp = torch.tensor(top_k), torch.tensor(top_p, dtype=torch.float32)
    srt, order = z.sort(dim=-1, descending=True, stable=True)
    keep_sorted = nucleus_prefix(srt, torch.where((tk > 0) & (tk < vocab), tk, vocab), tp)
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def _kernel_keeps(logits, rows, temperature, top_k, top_p, limit, with_argmax=True) -> torch.Tensor:
    argmax = logits.argmax(dim=-1) if with_argmax else None  # the maximum read at the argmax, or searched for
    thr, icut = sampling_kernel.row_cutoffs(logits, rows, temperature, top_k, top_p, argmax, limit=limit)
    z = logits.index_select(0, rows).float() / temperature[:, None]
    return _keeps(z, thr, icut)


@pytest.fixture
def small_cap(monkeypatch):
    """Sort at most 64 candidates: a 1024-wide sort takes seconds in the interpreter, and small rows
    then reach the exact search's paths on the GPU too (the vocab-49152 GPU tests keep the default)."""
    monkeypatch.setattr(sampling_kernel, "CUT_CAP", 64)
    return sampling_kernel.CUT_CAP


CUT_ROW = st.tuples(st.sampled_from([0.3, 0.7, 1.0, 1.7]), st.sampled_from([0, 0, 1, 2, 3, 5, 35, 40, 70, 5000]),
                    st.sampled_from([1.0, 1.0, 0.5, 0.9, 0.99, 0.05]))


@needs_kernels
@given(seed=st.integers(0, 2**20), vocab=st.sampled_from([1, 5, 40, 100, 1000, 1031]),
       kind=st.sampled_from(["random", "ties", "flat", "hot", "inf", "zeros"]),
       rows=st.lists(CUT_ROW, min_size=1, max_size=5),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), limit=st.sampled_from(["cap", 16, 0]),
       with_argmax=st.booleans())
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_cutoff_kernel_keeps_what_the_sorting_reference_keeps(small_cap, seed, vocab, kind, rows, dtype, limit,
                                                              with_argmax):
    """Every path of the search (candidates sorted at once, after a few passes, or never: the exact
    search and its ties pass; top-k and top-p apart or together, top-k beyond the candidates)."""
    gen = torch.Generator().manual_seed(seed)
    logits = _cutoff_logits(gen, len(rows) + 1, vocab, kind).to(dtype).to(DEVICE)
    picked = torch.randperm(len(rows) + 1, generator=gen)[:len(rows)].to(DEVICE)
    temperature = torch.tensor([r[0] for r in rows], dtype=torch.float32, device=DEVICE)
    top_k, top_p = [r[1] for r in rows], [r[2] for r in rows]
    got = _kernel_keeps(logits, picked, temperature, torch.tensor(top_k, device=DEVICE),
                        torch.tensor(top_p, dtype=torch.float32, device=DEVICE), small_cap if limit == "cap" else limit,
                        with_argmax)
    z = logits.index_select(0, picked).float() / temperature[:, None]
    want = _reference_keeps(z.cpu(), top_k, top_p)
    assert torch.equal(got.cpu(), want), (got.cpu() != want).sum(dim=-1).tolist()


@needs_kernels
def test_cutoff_kernel_paths_on_chosen_rows(small_cap):
    """Rows built to take each path: a peaked row (sorted at once), a flat row whose nucleus is
    larger than the candidates can hold (exact search), top-k beyond the candidates with top-p
    (two searches), a cut through exact ties, rows without limits, and a row of -inf."""
    vocab = 600
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(7, vocab, generator=gen) * 3
    logits[1] = torch.linspace(0.0, 1e-3, vocab)  # flat: top-p 0.9 keeps about 540 tokens
    logits[3] = logits[4] = torch.tensor([2.0, 1.0] * (vocab // 2))  # 300 tokens tie at 2.0, 300 at 1.0
    logits[6] = float("-inf")
    logits = logits.to(DEVICE)
    rows = torch.arange(7, device=DEVICE)
    temperature = torch.tensor([0.7, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], device=DEVICE)
    top_k = [0, 0, 500, 10, 0, 0, 3]
    top_p = [0.9, 0.9, 0.9, 1.0, 0.37, 1.0, 0.5]
    want = _reference_keeps((logits / temperature[:, None]).cpu(), top_k, top_p)
    for limit, with_argmax in ((small_cap, True), (0, True), (small_cap, False)):
        got = _kernel_keeps(logits, rows, temperature, torch.tensor(top_k, device=DEVICE),
                            torch.tensor(top_p, dtype=torch.float32, device=DEVICE), limit, with_argmax)
        assert torch.equal(got.cpu(), want), (limit, (got.cpu() != want).sum(dim=-1).tolist())
    kept = want.sum(dim=-1).tolist()
    assert kept[1] > small_cap and kept[3] == 10 and kept[5] == vocab and kept[6] == 1, kept  # -inf row: top-p keeps one
    # the ties at 2.0 hold 1 / (1 + e^-1) of the mass: top-p 0.37 keeps the first 152 of them, in index order
    assert want[4].nonzero()[:, 0].tolist() == list(range(0, 2 * 152, 2))


@needs_kernels
def test_cutoff_kernel_keeps_infinite_and_signed_zero_ties_as_the_sort(small_cap):
    """A vocabulary below the candidate capacity whose top-k reaches into its -inf tokens (every finite
    token kept, then -inf ones in index order); a row of -inf; +0.0 and -0.0 tied at the top."""
    vocab = 40
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(5))
    logits[0, :10] = float("-inf")  # 30 finite tokens; top-k 35 keeps them and the first five -inf
    logits[1] = float("-inf")
    logits[2, :4] = torch.tensor([1.0, 2.0, -0.0, 0.0])
    logits[2, 4:] = -5.0
    logits[3] = logits[2]
    logits = logits.to(DEVICE)
    rows = torch.arange(4, device=DEVICE)
    temperature = torch.ones(4, device=DEVICE)
    top_k, top_p = [35, 3, 3, 0], [1.0, 0.5, 1.0, 0.3]
    want = _reference_keeps(logits.cpu(), top_k, top_p)
    assert want[0].sum() == 35 and want[0, :5].all() and want[2].tolist()[:4] == [True, True, True, False]
    for limit in (small_cap, 0):
        got = _kernel_keeps(logits, rows, temperature, torch.tensor(top_k, device=DEVICE),
                            torch.tensor(top_p, device=DEVICE), limit)
        assert torch.equal(got.cpu(), want), (limit, (got.cpu() != want).sum(dim=-1).tolist())


@needs_kernels
def test_a_top_p_that_rounds_to_zero_keeps_one_token(small_cap):
    """top_p = 1e-50 is valid but 0 in fp32: the most likely token alone, as the reference keeps."""
    top_p = float(SamplingParams(top_p=1e-50).top_p)
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    top_k = [0, 3]
    got = _kernel_keeps(logits, torch.arange(2, device=DEVICE), torch.ones(2, device=DEVICE),
                        torch.tensor(top_k, device=DEVICE), torch.tensor([top_p] * 2, device=DEVICE), small_cap)
    want = _reference_keeps(logits.cpu(), top_k, [top_p] * 2)
    assert want.sum(dim=-1).tolist() == [1, 1] and torch.equal(got.cpu(), want)


def test_cutoff_kernel_refuses_a_limit_past_its_capacity():
    with pytest.raises(ValueError, match="limit"):
        sampling_kernel.row_cutoffs(torch.zeros(1, 4), torch.zeros(1, dtype=torch.long), torch.ones(1),
                                    torch.zeros(1, dtype=torch.long), torch.ones(1), limit=sampling_kernel.CUT_CAP + 1)


# --------------------------------------------------------------------------- kernel vs torch


def _torch_perturbed(logits, rows, temperature, top_k, top_p, keys, positions):
    """The torch path's ``z + G`` ``[S, vocab]`` and tokens."""
    z = logits.index_select(0, rows).float() / temperature[:, None]
    if any(0 < k < logits.shape[-1] or p < 1.0 for k, p in zip(top_k, top_p)):
        z = apply_cutoffs(z, row_cutoffs(z, top_k, top_p))
    perturbed = z + gumbel_noise(keys, positions, logits.shape[-1])
    return perturbed, perturbed.argmax(dim=-1)


def _check_kernel(logits, rows, params, seeds, positions, target_programs=None):
    dev = logits.device
    rows_t = torch.tensor(rows, device=dev)
    temperature = torch.tensor([p[0] for p in params], dtype=torch.float32, device=dev)
    top_k, top_p = [p[1] for p in params], [p[2] for p in params]
    keys = torch.tensor([request_key(s) for s in seeds], device=dev)
    pos = torch.tensor(positions, device=dev)
    want, want_tokens = _torch_perturbed(logits, rows_t, temperature, top_k, top_p, keys, pos)
    z = logits.index_select(0, rows_t).float() / temperature[:, None]
    limited = any(0 < k < logits.shape[-1] or p < 1.0 for k, p in zip(top_k, top_p))
    cutoffs = row_cutoffs(z, top_k, top_p) if limited else None
    saved = sampling_kernel.TARGET_PROGRAMS
    if target_programs is not None:
        sampling_kernel.TARGET_PROGRAMS = target_programs
    try:
        tokens, perturbed = sampling_kernel.sample_tokens(logits, rows_t, temperature, keys, pos, _STREAM_SAMPLE,
                                                          cutoffs, store=True)
    finally:
        sampling_kernel.TARGET_PROGRAMS = saved
    assert torch.equal(perturbed, want), (perturbed != want).nonzero()[:5]
    assert torch.equal(tokens, want_tokens)
    return tokens


@needs_kernels
@given(seed=st.integers(0, 2**20), vocab=st.sampled_from([1000, 4099, 1024, 5]), ties=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       rows=st.lists(st.tuples(ROW, SEEDS, st.integers(0, 2**40)), min_size=1, max_size=6),
       target_programs=st.sampled_from([1, 1024]))
@settings(max_examples=40, deadline=None)
def test_kernel_equals_torch_bit_for_bit(seed, vocab, ties, dtype, rows, target_programs):
    """One split per row (target_programs=1: every block in one program's loop) or many."""
    gen = torch.Generator().manual_seed(seed)
    logits = _logits(gen, len(rows) + 2, vocab, ties, dtype).to(DEVICE)
    picked = torch.randperm(len(rows) + 2, generator=gen)[:len(rows)].tolist()
    _check_kernel(logits, picked, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows],
                  target_programs)


@needs_kernels
def test_kernel_with_infinite_logits_and_one_token_rows():
    """Rows of -inf (the argmax is then token 0, as torch's), partly -inf rows, top-k 1, top-p tiny."""
    logits = torch.randn(4, 2051, generator=torch.Generator().manual_seed(1))
    logits[0] = float("-inf")
    logits[1, ::2] = float("-inf")
    logits[2, 1500:] = float("-inf")
    logits = logits.to(DEVICE)
    params = [(1.0, 0, 1.0), (0.5, 3000, 0.3), (1.0, 1, 1.0), (2.0, 2000, 1.0)]
    tokens = _check_kernel(logits, [0, 1, 2, 3], params, [1, 2, 3, 4], [0, 9, 2**33, 5], target_programs=1)
    assert tokens[0] == 0 and tokens[2] == logits[2].argmax()


@needs_kernels
@pytest.mark.parametrize("with_probs", [False, True], ids=["deterministic_drafts", "drafts_with_probs"])
def test_sample_rows_gives_the_same_tokens_with_the_kernel(small_cap, with_probs):
    """The whole of sample_rows, kernels (cutoffs and sampling) against torch: greedy rows among
    sampled ones, limits on some rows only, rejection sampling on the rows whose drafts carry q."""
    gen = torch.Generator().manual_seed(7)
    vocab, n_req = 1000, 12
    params = [SamplingParams() if i % 4 == 3 else
              SamplingParams(temperature=0.6 + 0.1 * i, top_k=[0, 20, 0][i % 3], top_p=[1.0, 1.0, 0.9, 0.95][i % 4])
              for i in range(n_req)]
    logits = (torch.randn(3 * n_req, vocab, generator=gen) * 3).to(DEVICE)
    q = torch.randn(2, vocab, generator=gen).softmax(-1) if with_probs else None
    sampling_rows = RowSampling()
    for i, p in enumerate(params):
        if not p.greedy:
            draft = Draft(tuple(torch.randint(vocab, (2,), generator=gen).tolist()), probs=q)
            sampling_rows.add(3 * i, p, request_key(2**63 + i), 100 + i, draft)
    want = sample_rows(logits, None, sampling_rows, kernel=False)
    got = sample_rows(logits, None, sampling_rows, kernel=True)
    assert torch.equal(got, want)
    assert bool(sampling_rows.draft_probs) == with_probs


def test_the_default_path_is_torch_off_cuda(monkeypatch):
    """On CPU tensors sample_rows takes the torch path unless told otherwise (the kernel is never called)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the kernel was called")

    monkeypatch.setattr(sampling_kernel, "sample_tokens", refuse)
    monkeypatch.setattr(sampling_kernel, "row_cutoffs", refuse)
    monkeypatch.setattr(sampling, "USE_KERNEL", None)
    sampled = RowSampling()
    sampled.add(0, SamplingParams(temperature=1.0, top_p=0.9), request_key(1), 0, None)
    logits = torch.randn(2, 50)
    out = sample_rows(logits, None, sampled)
    assert out[1] == logits[1].argmax()
    with pytest.raises(AssertionError, match="kernel was called"):
        sample_rows(logits, None, sampled, kernel=True)
    monkeypatch.setattr(sampling, "USE_KERNEL", True)
    with pytest.raises(AssertionError, match="kernel was called"):
        sample_rows(logits, None, sampled)


# --------------------------------------------------------------------------- CPU: the interpreter suite


@pytest.mark.skipif(INTERPRETED or HAS_CUDA, reason="the kernel tests run in this process (interpreter or GPU)")
def test_cpu_interpreter_suite():
    """Re-run this file with ``TRITON_INTERPRET=1``, so the kernels are built for Triton's CPU interpreter."""
    run_interpreted(__file__, "not interpreter_suite", timeout=900)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETED, reason="needs a CUDA GPU (and the kernel compiled for it)")
@pytest.mark.parametrize("n_rows", [9, 288])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_equals_torch_on_the_gpu_at_vocab_49152(n_rows, dtype):
    """The compiled kernel (libdevice log / log1p) against torch's CUDA kernels: same bits, same tokens."""
    gen = torch.Generator().manual_seed(n_rows)
    vocab = 49152
    logits = (torch.randn(n_rows + 5, vocab, generator=gen) * 4).to(dtype).cuda()
    rows = torch.randperm(n_rows + 5, generator=gen)[:n_rows].tolist()
    choices = [(0.7, 0, 1.0), (1.0, 50, 1.0), (0.9, 0, 0.95), (1.3, 20, 0.8), (0.2, 0, 1.0)]
    params = [choices[i % len(choices)] for i in range(n_rows)]
    seeds = [2**64 - 1 - i if i % 2 else i for i in range(n_rows)]
    positions = [(i * 977) % 4000 + (2**32 if i % 7 == 0 else 0) for i in range(n_rows)]
    _check_kernel(logits, rows, params, seeds, positions)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETED, reason="needs a CUDA GPU (and the kernel compiled for it)")
def test_one_compiled_variant_serves_every_row_count():
    """A new compiled variant costs about 0.25 s: a step whose sampled-row count is new must not
    compile one (the blocks per split and the splits are runtime arguments)."""

    def compiled() -> int:
        return sum(len(cache[0]) for cache in sampling_kernel._sample_split_kernel.device_caches.values())

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(400, 49152, generator=gen).to(torch.bfloat16).cuda()
    counts = []
    for n_rows in (16, 1, 3, 40, 144, 288, 399):
        rows = torch.arange(n_rows, device="cuda")
        temperature = torch.full((n_rows,), 0.8, device="cuda")
        keys = torch.arange(n_rows, device="cuda")
        sampling_kernel.sample_tokens(logits, rows, temperature, keys, keys.clone(), sampling._STREAM_SAMPLE)
        counts.append(compiled())
    torch.cuda.synchronize()
    assert counts == [counts[0]] * len(counts), counts


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETED, reason="needs a CUDA GPU (and the kernel compiled for it)")
@pytest.mark.parametrize("n_rows", [16, 288])
@pytest.mark.parametrize("kind", ["random", "ties", "flat", "hot", "inf", "zeros"])
def test_cutoff_kernel_equals_torch_on_the_gpu_at_vocab_49152(n_rows, kind):
    """The compiled cutoff kernel (libdevice exp) against the sorting torch path on the GPU (torch's exp):
    the same kept tokens, whichever path each row takes."""
    gen = torch.Generator().manual_seed(n_rows)
    logits = _cutoff_logits(gen, n_rows, 49152, kind).to(torch.bfloat16).cuda()
    rows = torch.arange(n_rows, device="cuda")
    choices = [(0.8, 0, 0.95), (1.0, 50, 1.0), (0.7, 0, 0.9), (1.3, 20, 0.8), (1.0, 3000, 0.99), (1.0, 0, 0.5)]
    params = [choices[i % len(choices)] for i in range(n_rows)]
    temperature = torch.tensor([p[0] for p in params], device="cuda")
    top_k, top_p = [p[1] for p in params], [p[2] for p in params]
    z = logits.float() / temperature[:, None]
    want = _keeps(z, *row_cutoffs(z, top_k, top_p))
    for limit, with_argmax in ((None, True), (0, True), (None, False)):
        got = _kernel_keeps(logits, rows, temperature, torch.tensor(top_k, device="cuda"),
                            torch.tensor(top_p, device="cuda"), limit, with_argmax)
        assert torch.equal(got, want), (limit, (got != want).sum(dim=-1).tolist())


def test_warm_up_is_a_no_op_where_sample_rows_takes_the_torch_path(monkeypatch):
    monkeypatch.setattr(sampling, "USE_KERNEL", None)
    assert sampling.warm_up(100, "cpu") is False


@needs_kernels
def test_warm_up_runs_every_kernel_sample_rows_launches(monkeypatch, small_cap):
    """Forced onto the kernel path (the interpreter on the CPU), warm_up calls the cutoff kernel once
    and the sampling kernel with and without cutoffs."""
    calls = []
    for name in ("row_cutoffs", "sample_tokens"):
        real = getattr(sampling_kernel, name)
        monkeypatch.setattr(sampling_kernel, name,
                            lambda *a, _real=real, _name=name, **kw: (calls.append((_name, a[-1] if _name == "sample_tokens"
                                                                                    else None)), _real(*a, **kw))[1])
    monkeypatch.setattr(sampling, "USE_KERNEL", True)
    assert sampling.warm_up(50, DEVICE) is True
    names = [c[0] for c in calls]
    assert names.count("row_cutoffs") == 1 and names.count("sample_tokens") == 2
    masked = [c[1] is not None for c in calls if c[0] == "sample_tokens"]
    assert sorted(masked) == [False, True]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETED, reason="needs a CUDA GPU (and the kernels compiled for it)")
def test_after_warm_up_a_sampled_step_compiles_nothing():
    def compiled() -> int:
        return sum(len(cache[0]) for k in (sampling_kernel._sample_split_kernel, sampling_kernel._cutoff_kernel,
                                           sampling_kernel._reduce_splits_kernel) for cache in k.device_caches.values())

    sampling.warm_up(49152, "cuda")
    before = compiled()
    logits = torch.randn(6, 49152, device="cuda")
    rows = RowSampling()
    for i, p in enumerate([SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=0.7, top_k=50),
                           SamplingParams(temperature=1.0)]):
        rows.add(2 * i, p, request_key(i), 10 + i, None)
    sample_rows(logits, None, rows)
    torch.cuda.synchronize()
    assert compiled() == before
