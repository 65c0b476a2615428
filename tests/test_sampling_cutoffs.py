"""row_cutoffs sorts many rows in chunks (specdec.sampling.SORT_ROWS): the cutoffs, and so every
sampled token, must equal those of the one-call stable sort they replaced, exactly.

Compared: ``row_cutoffs`` as it is against the one-call version kept here verbatim, over random
logits with exact ties, flat rows and high temperatures (top-p needing most of the vocabulary),
rows mixing top-k and top-p, and row counts on both sides of the chunk size; and the chunked sort
itself against ``torch.sort`` for any chunk size. On a CUDA GPU also at vocab 49152 with 144 and
288 rows (where a one-call sort takes cub's segmented sort and the chunks the device-wide one).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.sampling import SORT_ROWS, _sort_descending, row_cutoffs
from specdec.verify import nucleus_prefix


def one_call_cutoffs(z: torch.Tensor, top_k: list[int], top_p: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """row_cutoffs before the chunked sort (top-p rows sorted in one torch.sort call)."""
    dev, (n_rows, vocab) = z.device, z.shape
    thr = torch.full((n_rows,), float("-inf"), dtype=torch.float32, device=dev)
    icut = torch.full((n_rows,), vocab, dtype=torch.int32, device=dev)
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    by_p = [i for i, p in enumerate(top_p) if p < 1.0]
    by_k = [i for i, (k, p) in enumerate(zip(ks, top_p)) if k < vocab and not p < 1.0]
    if by_p:
        sel = torch.tensor(by_p, dtype=torch.long).to(dev)
        lims = torch.tensor([[ks[i] for i in by_p]], dtype=torch.long).to(dev)
        ps = torch.tensor([top_p[i] for i in by_p], dtype=torch.float32).to(dev)
        srt, order = z.index_select(0, sel).sort(dim=-1, descending=True, stable=True)
        drop = ~nucleus_prefix(srt, lims[0], ps)
        last = ((~drop).sum(dim=-1, keepdim=True) - 1)
        thr.index_copy_(0, sel, srt.gather(1, last)[:, 0])
        icut.index_copy_(0, sel, order.gather(1, last)[:, 0].int())
    if by_k:
        sel = torch.tensor(by_k, dtype=torch.long).to(dev)
        k = torch.tensor([ks[i] for i in by_k], dtype=torch.long).to(dev)
        zk = z.index_select(0, sel)
        t = zk.topk(max(ks[i] for i in by_k), dim=-1).values.gather(1, (k - 1)[:, None])
        ties = k - (zk > t).sum(dim=-1)
        eq = zk == t
        thr.index_copy_(0, sel, t[:, 0])
        icut.index_copy_(0, sel, (eq.cumsum(dim=-1) < ties[:, None]).sum(dim=-1).int())
    return thr, icut


def _logits(seed: int, rows: int, vocab: int, kind: str, device: str = "cpu") -> torch.Tensor:
    """``[rows, vocab]`` fp32 logits / temperature: random, with exact ties, flat, or at a high temperature."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, vocab, generator=g) * 4
    if kind == "ties":  # few distinct values: ties everywhere, also at the cutoff
        z = z.round().clamp(-3, 3)
    elif kind == "flat":  # every other row all equal, the rest nearly equal
        z = torch.where(torch.arange(rows)[:, None] % 2 == 0, torch.zeros_like(z), z * 1e-4)
    elif kind == "hot":  # temperature 50: top-p 0.95 keeps most of the vocabulary
        z = z / 50.0
    return z.to(device)


def _limits(seed: int, rows: int, vocab: int) -> tuple[list[int], list[float]]:
    g = torch.Generator().manual_seed(seed + 1)
    top_p = [float(x) for x in torch.tensor([0.95, 0.5, 0.999, 1.0, 0.1])[torch.randint(0, 5, (rows,), generator=g)]]
    top_k = [int(x) for x in torch.tensor([0, 0, 3, vocab - 1, vocab + 5])[torch.randint(0, 5, (rows,), generator=g)]]
    return top_k, top_p


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.integers(1, 40), vocab=st.integers(1, 70), chunk=st.integers(1, 12),
       ties=st.booleans())
def test_chunked_sort_is_the_one_call_stable_sort(seed, rows, vocab, chunk, ties):
    z = _logits(seed, rows, vocab, "ties" if ties else "random")
    values, indices = _sort_descending(z, chunk)
    ref_values, ref_indices = z.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(values, ref_values) and torch.equal(indices, ref_indices)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), rows=st.sampled_from([1, 5, SORT_ROWS, SORT_ROWS + 1, 2 * SORT_ROWS + 3]),
       vocab=st.sampled_from([1, 7, 64, 200]), kind=st.sampled_from(["random", "ties", "flat", "hot"]))
def test_row_cutoffs_equal_the_one_call_sort(seed, rows, vocab, kind):
    z = _logits(seed, rows, vocab, kind)
    top_k, top_p = _limits(seed, rows, vocab)
    thr, icut = row_cutoffs(z, top_k, top_p)
    ref_thr, ref_icut = one_call_cutoffs(z, top_k, top_p)
    assert torch.equal(thr, ref_thr) and torch.equal(icut, ref_icut)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch's sort paths differ there)")
@pytest.mark.parametrize("rows", [16, 127, 128, 144, 288])
@pytest.mark.parametrize("kind", ["random", "ties", "flat", "hot"])
def test_row_cutoffs_equal_the_one_call_sort_on_the_gpu(rows, kind):
    z = _logits(rows, rows, 49152, kind, "cuda")
    top_k, top_p = [0] * rows, [0.95] * rows
    assert all(torch.equal(a, b) for a, b in zip(row_cutoffs(z, top_k, top_p), one_call_cutoffs(z, top_k, top_p)))
    values, indices = _sort_descending(z)
    ref_values, ref_indices = z.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(values, ref_values) and torch.equal(indices, ref_indices)
