"""The torch reference backend, planned by ``plan_step``, vs naive dense attention.

Each case builds requests with random, shuffled physical page tables over a
pool filled with noise, writes each request's earlier context into the cache,
then runs one step through ``AttentionMetadata.attend`` (which writes the
step's K/V at ``slot_mapping`` and attends) and compares every query row with
``softmax(q k^T * scale + causal mask) v`` computed from the dense tensors in
float64. GQA repeats each KV head over its group of query heads; K-only
(MLA-like) layers use ``V = K[..., :v_head_dim]``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.attention.metadata import plan_step
from specdec.attention.shapes import AttnShape

ATOL = RTOL = 1e-5
TPBS = [1, 4, 16]


# --------------------------------------------------------------------------- harness


def naive_attention(q, k, v, q_pos, scale):
    """Dense causal attention of one request in float64.

    Args:
        q: ``[q_len, H, D]``; k: ``[kv_len, Hkv, D]``; v: ``[kv_len, Hkv, Dv]``.
        q_pos: absolute position of each query row. ``[q_len]``

    Returns:
        ``[q_len, H, Dv]``.
    """
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)  # query head h reads KV head h // group
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    causal = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]  # [q_len, kv_len]
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def run_step(context, generation, *, h, hkv, d, dv, tpb, k_only=False, seed=0, extra_pages=0):
    """One step through ``plan_step`` + ``attend``; returns (output, expected, attn, shape_of calls).

    ``context`` / ``generation``: ``(q_len, kv_len)`` per request; the first
    ``kv_len - q_len`` tokens are already cached, the last ``q_len`` are this step's.
    """
    g = torch.Generator().manual_seed(seed)
    reqs = [(q, kv) for q, kv in context] + [(q, kv) for q, kv in generation]
    pages_needed = [math.ceil(kv / tpb) + extra_pages for _, kv in reqs]
    num_pages = sum(pages_needed) + 3  # a few pages no request owns
    perm = torch.randperm(num_pages, generator=g).tolist()  # shuffled, non-contiguous tables
    tables, at = [], 0
    for n in pages_needed:
        tables.append(tuple(perm[at : at + n]))
        at += n

    num_slots = num_pages * tpb
    # Noise everywhere, large enough that reading a wrong slot cannot pass.
    k_cache = torch.randn(num_slots, hkv, d, generator=g) * 10
    v_cache = None if k_only else torch.randn(num_slots, hkv, dv, generator=g) * 10

    def slots_of(table, start, stop):
        return [table[p // tpb] * tpb + p % tpb for p in range(start, stop)]

    dense_k, dense_v, q_rows, k_new, v_new, slot_mapping = [], [], [], [], [], []
    for (q_len, kv_len), table in zip(reqs, tables):
        kk = torch.randn(kv_len, hkv, d, generator=g)
        vv = kk[..., :dv] if k_only else torch.randn(kv_len, hkv, dv, generator=g)
        past = torch.tensor(slots_of(table, 0, kv_len - q_len), dtype=torch.long)
        k_cache[past] = kk[: kv_len - q_len]
        if not k_only:
            v_cache[past] = vv[: kv_len - q_len]
        dense_k.append(kk)
        dense_v.append(vv)
        q_rows.append(torch.randn(q_len, h, d, generator=g))
        k_new.append(kk[kv_len - q_len :])
        v_new.append(vv[kv_len - q_len :])
        slot_mapping += slots_of(table, kv_len - q_len, kv_len)

    calls = []

    def shape_of(phase, max_q_len, mixed):
        calls.append((phase, max_q_len, mixed))
        return AttnShape(phase, "mla" if k_only else "gqa", h, hkv, d, dv, tpb, max_q_len, mixed=mixed)

    n_ctx = len(context)
    ctx_plan = [(q, kv, t) for (q, kv), t in zip(reqs[:n_ctx], tables[:n_ctx])]
    gen_plan = [(q, kv, t) for (q, kv), t in zip(reqs[n_ctx:], tables[n_ctx:])]
    slot_mapping = torch.tensor(slot_mapping, dtype=torch.long)
    # Requested, so a cheaper CPU backend registered later cannot change what this file tests.
    attn = plan_step(ctx_plan, gen_plan, slot_mapping, shape_of, tpb, requested="torch_ref")

    scale = 1.0 / math.sqrt(d) * 1.3  # explicit, not the default
    q = torch.cat(q_rows)
    out = attn.attend(q, torch.cat(k_new), None if k_only else torch.cat(v_new), k_cache, v_cache, scale, dv)

    # attend wrote this step's K/V at slot_mapping.
    torch.testing.assert_close(k_cache[slot_mapping], torch.cat(k_new), rtol=0, atol=0)
    if not k_only:
        torch.testing.assert_close(v_cache[slot_mapping], torch.cat(v_new), rtol=0, atol=0)

    expected = torch.cat([
        naive_attention(qr, kk, vv, torch.arange(kv - ql, kv), scale)
        for qr, kk, vv, (ql, kv) in zip(q_rows, dense_k, dense_v, reqs)
    ])
    # The backend's LSE output: the same attention from explicit scores, and each row's natural-log
    # log-sum-exp of its scaled, causally masked scores (what Helix's combine merges partials by).
    for p in attn.phases:
        rows = slice(p.start, p.stop)
        got, lse = p.backend.run(p.plan, q[rows], k_cache, v_cache, scale, dv, return_lse=True)
        assert lse.shape == (p.stop - p.start, h) and lse.dtype == torch.float32
        torch.testing.assert_close(got, out[rows], rtol=RTOL, atol=ATOL)
        want_lse = torch.cat([naive_lse(qr, kk, torch.arange(kv - ql, kv), scale)
                              for qr, kk, (ql, kv) in zip(q_rows, dense_k, reqs)])[rows]
        torch.testing.assert_close(lse.double(), want_lse, rtol=RTOL, atol=ATOL)
    return out, expected, attn, calls


def naive_lse(q, k, q_pos, scale):
    """``logsumexp`` of one request's causally masked, scaled scores in float64: ``[q_len, H]``."""
    k = k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->qhk", q.double(), k) * scale
    causal = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]  # [q_len, kv_len]
    return scores.masked_fill(~causal[:, None, :], float("-inf")).logsumexp(-1)


def check(out, expected, num_tokens, h, dv):
    assert out.shape == (num_tokens, h, dv) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=RTOL, atol=ATOL)


gqa_heads = st.sampled_from([(1, 1), (2, 1), (4, 2), (6, 3), (8, 2), (4, 4), (6, 1)])  # (H, Hkv)
SETTINGS = settings(max_examples=15, deadline=None)


# --------------------------------------------------------------------------- cases


@pytest.mark.parametrize("tpb", TPBS)
@SETTINGS
@given(
    lens=st.lists(st.tuples(st.integers(1, 24), st.integers(0, 12)), min_size=1, max_size=4),
    heads=gqa_heads,
    seed=st.integers(0, 2**31),
)
def test_context_only(tpb, lens, heads, seed):
    """Prompts (q_len == kv_len) and chunks after a cached prefix (q_len < kv_len)."""
    h, hkv = heads
    context = [(q, q + prefix) for q, prefix in lens]
    out, expected, attn, calls = run_step(context, [], h=h, hkv=hkv, d=16, dv=16, tpb=tpb, seed=seed)
    check(out, expected, sum(q for q, _ in context), h, 16)
    assert attn.backends == {"context": "torch_ref"}
    assert calls == [("context", max(q for q, _ in context), False)]


@pytest.mark.parametrize("tpb", TPBS)
@SETTINGS
@given(
    kv_lens=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    heads=gqa_heads,
    seed=st.integers(0, 2**31),
    extra=st.integers(0, 1),
)
def test_decode(tpb, kv_lens, heads, seed, extra):
    """One query token per request, ragged lengths; tables may hold a spare page past the end."""
    h, hkv = heads
    generation = [(1, kv) for kv in kv_lens]
    out, expected, attn, calls = run_step([], generation, h=h, hkv=hkv, d=16, dv=8, tpb=tpb, seed=seed,
                                          extra_pages=extra)
    check(out, expected, len(kv_lens), h, 8)
    assert attn.backends == {"generation": "torch_ref"}
    assert calls == [("generation", 1, False)]


@pytest.mark.parametrize("tpb", TPBS)
def test_decode_equal_lengths(tpb):
    """All requests at the same length: the plan needs no mask."""
    out, expected, attn, _ = run_step([], [(1, 13)] * 3, h=4, hkv=2, d=16, dv=16, tpb=tpb, seed=tpb)
    assert attn.phases[0].plan.mask is None
    check(out, expected, 3, 4, 16)


@pytest.mark.parametrize("tpb", TPBS)
@SETTINGS
@given(
    reqs=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 30)), min_size=1, max_size=5),
    heads=gqa_heads,
    seed=st.integers(0, 2**31),
)
def test_verify(tpb, reqs, heads, seed):
    """1 + k query tokens per request (k ragged), over ragged cached lengths."""
    h, hkv = heads
    generation = [(1 + k, 1 + k + past) for k, past in reqs]
    out, expected, attn, calls = run_step([], generation, h=h, hkv=hkv, d=16, dv=16, tpb=tpb, seed=seed)
    check(out, expected, sum(q for q, _ in generation), h, 16)
    assert attn.backends == {"generation": "torch_ref"}
    assert calls == [("generation", max(q for q, _ in generation), False)]


@pytest.mark.parametrize("tpb", TPBS)
@SETTINGS
@given(
    ctx=st.lists(st.tuples(st.integers(1, 20), st.integers(0, 8)), min_size=1, max_size=3),
    gen=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 30)), min_size=1, max_size=3),
    heads=gqa_heads,
    seed=st.integers(0, 2**31),
)
def test_mixed(tpb, ctx, gen, heads, seed):
    """Context and generation requests in one step, each phase planned on its own."""
    h, hkv = heads
    context = [(q, q + prefix) for q, prefix in ctx]
    generation = [(q, q + past) for q, past in gen]
    out, expected, attn, calls = run_step(context, generation, h=h, hkv=hkv, d=16, dv=16, tpb=tpb, seed=seed)
    check(out, expected, sum(q for q, _ in context + generation), h, 16)
    assert attn.backends == {"context": "torch_ref", "generation": "torch_ref"}
    assert calls == [("context", max(q for q, _ in context), False),
                     ("generation", max(q for q, _ in generation), True)]
    n_ctx = sum(q for q, _ in context)
    assert [(p.start, p.stop) for p in attn.phases] == [(0, n_ctx), (n_ctx, out.shape[0])]


@pytest.mark.parametrize("h", [16, 96])
@pytest.mark.parametrize("tpb", TPBS)
@settings(max_examples=6, deadline=None)
@given(
    ctx=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 6)), max_size=2),
    gen=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 20)), max_size=3),
    seed=st.integers(0, 2**31),
)
def test_k_only_mla_like(h, tpb, ctx, gen, seed):
    """One latent KV head, no V cache: V is K[..., :v_head_dim]; context, decode/verify and mixed."""
    if not ctx and not gen:
        gen = [(1, 5)]
    context = [(q, q + prefix) for q, prefix in ctx]
    generation = [(q, q + past) for q, past in gen]
    out, expected, attn, calls = run_step(context, generation, h=h, hkv=1, d=40, dv=32, tpb=tpb, k_only=True,
                                          seed=seed)
    check(out, expected, sum(q for q, _ in context + generation), h, 32)
    assert set(attn.backends) == {p for p, lst in (("context", ctx), ("generation", gen)) if lst}
    assert all(shape.kind == "mla" for shape in (p.shape for p in attn.phases))
    assert [mixed for _, _, mixed in calls] == [bool(ctx) and phase == "generation" for phase, _, _ in calls]
