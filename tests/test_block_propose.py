"""Block drafters' batched propose (one packed copy, RoPE tables, padded buckets, CUDA graphs)
drafts exactly what the algorithm it replaced drafted.

The reference below is a frozen copy of that algorithm: a per-request gather index,
RoPE factors recomputed per call and layer, the old layer loops. On the CPU in fp32 the
new path must give the same drafts and the same hidden states (to fp32 rounding: projections
are fused); padded shapes the same drafts (padding rows and keys are masked out). Context
writes staged for the next propose leave the cache and the drafts as immediate writes do.
On CUDA, graph replays equal eager runs.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hypothesis import given, settings
from hypothesis import strategies as hst

from specdec.drafters.block import (BlockDrafterConfig, BlockDrafterNet, RopeTable, _rms, init_weights,
                                    rope_cos_sin)
from specdec.drafters.dflash import (CTX_BUCKET, MAX_PADDED_REQUESTS, STAGE_STEPS, DFlashDrafter, DSparkDrafter,
                                    propose_buckets)
from specdec.drafters.dspark_mla import MLABlockDrafterConfig, MLABlockDrafterNet, MLADSparkDrafter
from specdec.errors import ConfigError
from specdec.kvcache import KVCacheManager, KVPool
from specdec.kvcache.draft_kv import DraftKV

from helpers import needs_cxx

HAS_CUDA = torch.cuda.is_available()
VOCAB, HIDDEN, TARGET_LAYERS = 96, 32, 3


# --------------------------------------------------------------------------- the replaced algorithm (frozen)


def _old_rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos.to(torch.float32)[..., None] * inv  # [..., D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1).unsqueeze(-2), torch.cat([ang.sin()] * 2, -1).unsqueeze(-2)
    rot = torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1)
    return (x.float() * cos + rot.float() * sin).to(x.dtype)


def _old_forward_gqa(net, x, positions, ctx_kv, ctx_valid):
    c = net.config
    N, B, _ = x.shape
    mask = torch.cat([ctx_valid, ctx_valid.new_ones(N, B)], 1)[:, None, None, :]
    for L, (kc, vc) in zip(net.layers, ctx_kv):
        h = _rms(x, L.input_layernorm.weight, c.rms_norm_eps)
        q = _old_rope(L.qk(h, c, c.num_heads, "q"), positions, c.rope_theta)
        k = _old_rope(L.qk(h, c, c.num_kv_heads, "k"), positions, c.rope_theta)
        v = L.self_attn.v_proj(h).view(N, B, c.num_kv_heads, c.head_dim)
        k = torch.cat([kc.expand(N, -1, -1, -1).to(k.dtype), k], 1).transpose(1, 2)
        v = torch.cat([vc.expand(N, -1, -1, -1).to(v.dtype), v], 1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
                                           enable_gqa=c.num_heads != c.num_kv_heads)
        x = x + L.self_attn.o_proj(o.transpose(1, 2).reshape(N, B, -1))
        h = _rms(x, L.post_attention_layernorm.weight, c.rms_norm_eps)
        m = L.mlp
        x = x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))
    return _rms(x, net.norm.weight, c.rms_norm_eps)


def _old_latent(L, h, positions):
    c = L.c
    c_kv, k_rope = L.self_attn.kv_a_proj_with_mqa(h).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
    c_kv = _rms(c_kv, L.self_attn.kv_a_layernorm.weight, c.rms_norm_eps)
    return torch.cat([c_kv[..., None, :], _old_rope(k_rope[..., None, :], positions, c.rope_theta)], -1)


def _old_forward_mla(net, x, positions, ctx_kv, ctx_valid):
    c = net.config
    N, B, _ = x.shape
    H, nope, r = c.num_heads, c.qk_nope_head_dim, c.kv_lora_rank
    mask = torch.cat([ctx_valid, ctx_valid.new_ones(N, B)], 1)[:, None, None, :]
    for L, (latent, _) in zip(net.layers, ctx_kv):
        h = _rms(x, L.input_layernorm.weight, c.rms_norm_eps)
        w_uk, w_uv = L._kv_b()
        q_nope, q_rope = L.self_attn.q_proj(h).view(N, B, H, -1).split([nope, c.qk_rope_head_dim], -1)
        q_lat = torch.einsum("nbhd,hdr->nbhr", q_nope, w_uk)
        q = torch.cat([q_lat, _old_rope(q_rope, positions, c.rope_theta)], -1)
        k = torch.cat([latent.expand(N, -1, -1, -1).to(q.dtype), _old_latent(L, h, positions)], 1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, k[..., :r], attn_mask=mask,
                                           scale=(nope + c.qk_rope_head_dim) ** -0.5, enable_gqa=H > 1)
        o = torch.einsum("nhbr,hvr->nbhv", o, w_uv)
        x = x + L.self_attn.o_proj(o.reshape(N, B, H * c.v_head_dim))
        h = _rms(x, L.post_attention_layernorm.weight, c.rms_norm_eps)
        m = L.mlp
        x = x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))
    return _rms(x, net.norm.weight, c.rms_norm_eps)


def _old_forward(net, *args):
    return (_old_forward_mla if isinstance(net, MLABlockDrafterNet) else _old_forward_gqa)(net, *args)


@torch.inference_mode()
def reference_propose(d, req_ids, max_tokens):
    """``BlockDrafter.propose`` as it was: returns the drafts and the block's hidden states ``[N, B, hidden]``."""
    c, dev = d.config, d._embed.device
    B, N = c.block_size, len(req_ids)
    anchors = [d._tokens[r][-1] for r in req_ids]
    ctx_lens = [d._ctx_len[r] for r in req_ids]
    ids = torch.full((N, B), c.mask_token_id, dtype=torch.long, device=dev)
    ids[:, 0] = torch.tensor(anchors, device=dev)
    positions = torch.tensor(ctx_lens, device=dev)[:, None] + torch.arange(B, device=dev)
    tpb, width = d.kv.tokens_per_block, max(1, max(ctx_lens))
    gather = torch.zeros(N, width, dtype=torch.long)
    valid = torch.zeros(N, width, dtype=torch.bool)
    offs = torch.arange(tpb)
    for i, (r, n) in enumerate(zip(req_ids, ctx_lens)):
        if n:
            pages = torch.tensor(d.kv.page_table(r)[: -(-n // tpb)])
            gather[i, :n] = (pages[:, None] * tpb + offs).flatten()[:n]
            valid[i, :n] = True
    gather, valid = gather.to(dev), valid.to(dev)
    ctx_kv = [(d.kv.k(i)[gather], None if d.kv.v(i) is None else d.kv.v(i)[gather]) for i in range(c.num_layers)]
    h = _old_forward(d.net, d._embed[ids], positions, ctx_kv, valid)
    slots = list(d._slots)[:max_tokens]
    logits = F.linear(h[:, slots], d._lm_head)
    return [tuple(t) for t in logits.argmax(-1).tolist()], h


# --------------------------------------------------------------------------- set-up: drafter, pool, contexts


def fake_target(device="cpu", dtype=torch.float32, max_context=1024, seed=0):
    """What ``bind`` reads from a target: sizes, device, dtype, embedding and LM head."""
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(VOCAB, HIDDEN, generator=g)
    lm_head = torch.randn(VOCAB, HIDDEN, generator=g) * 2
    return SimpleNamespace(hidden_size=HIDDEN, vocab_size=VOCAB, num_layers=TARGET_LAYERS, max_context=max_context,
                           device=torch.device(device), dtype=dtype, embed=embed.to(device, dtype),
                           lm_head=lm_head.to(device, dtype))


def make_drafter(kind: str, seed: int = 1, cuda_graphs: bool = True):
    common = dict(block_size=5, target_layer_ids=(0, 2), target_hidden_size=HIDDEN, vocab_size=VOCAB,
                  hidden_size=HIDDEN, num_layers=2, intermediate_size=48, mask_token_id=3)
    if kind == "mla":
        net = MLABlockDrafterNet(MLABlockDrafterConfig(num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8,
                                                       qk_rope_head_dim=8, v_head_dim=8, **common))
        return MLADSparkDrafter(init_weights(net, seed=seed, std=0.2), cuda_graphs=cuda_graphs)
    shift = 0 if kind == "dflash" else 1
    heads = dict(markov_rank=4, confidence_head=True) if kind == "dspark_heads" else {}
    net = BlockDrafterNet(BlockDrafterConfig(shift_label=shift, num_heads=4, num_kv_heads=2, head_dim=8,
                                             qk_norm=kind == "dspark", **heads, **common))
    init_weights(net, seed=seed, std=0.2)
    if heads:  # the Markov head starts as no bias: give it one; the confidence bias is not drawn by init_weights
        with torch.no_grad():
            net.markov.up.weight.normal_(0, 0.2, generator=torch.Generator().manual_seed(seed))
            net.confidence.bias.fill_(0.1)
    cls = DFlashDrafter if shift == 0 else DSparkDrafter
    return cls(net, cuda_graphs=cuda_graphs)


class State:
    """A drafter bound to its own pool (or a shared one whose pages run past the drafter's context),
    with requests whose contexts were written in interleaved chunks (scattered page tables)."""

    def __init__(self, d, tpb: int, lens: list[int], shared: bool, seed: int, device="cpu", dtype=torch.float32):
        self.d, self.rng = d, random.Random(seed)
        pages = sum(-(-(n + 9) // tpb) for n in lens) + 16
        pool = KVPool(d.kv_layer_specs(), pages, tpb, device=device)
        g = torch.Generator().manual_seed(seed)
        for t in pool.k + [v for v in pool.v if v is not None]:  # garbage everywhere: masking must hide it
            t.copy_(torch.randn(t.shape, generator=g) * 50)
        self.manager = KVCacheManager(pages, tpb)
        d.bind(fake_target(device, dtype), DraftKV(pool, range(d.config.num_layers), self.manager, shared))
        self.reqs = [f"r{i}" for i in range(len(lens))]
        if shared:  # the target owns the pages: prompt + room for a verify, a few pages more than the drafter reads
            for r in self.reqs:
                self.manager.allocate(r, 0)
        self.manager.allocate("hole", 2 * tpb)  # freed below: later pages come out of order
        for r, n in zip(self.reqs, lens):
            d.start_request(r, [self.rng.randrange(VOCAB) for _ in range(n + 1)])
        done = [0] * len(lens)
        for part in range(1, 4):
            if part == 2:
                self.manager.free("hole")
            spans, row = [], 0
            for i, (r, n) in enumerate(zip(self.reqs, lens)):
                stop = n * part // 3
                if shared:
                    self.manager.append(r, stop - done[i] + (self.rng.randint(1, 9) if part == 3 else 0))
                if stop > done[i]:
                    spans.append((r, done[i], row, stop - done[i]))
                    row += stop - done[i]
                done[i] = stop
            if spans:
                width = len(d.target_layer_ids) * HIDDEN
                d.on_contexts(spans, torch.randn(row, width, generator=g).to(device, dtype))

    def ids(self, k: int) -> list[str]:
        """``k`` requests in a random order (a batch of the engine)."""
        return self.rng.sample(self.reqs, k)


def lengths(rng: random.Random, tpb: int, n: int) -> list[int]:
    special = [0, 1, tpb - 1, tpb, tpb + 1, 3 * tpb + 2, 5 * tpb]
    return [rng.choice(special) if rng.random() < 0.5 else rng.randint(0, 90) for _ in range(n)]


def capture_hidden(d):
    """Record what ``run_block`` returns (the new path's block hidden states)."""
    seen, run = [], d.net.run_block
    d.net.run_block = lambda *a: seen.append(run(*a)) or seen[-1]
    return seen


KINDS = ["dflash", "dspark", "mla"]


# --------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("dim,theta", [(8, 100000.0), (16, 10000.0), (64, 100000.0)])
def test_rope_table_gives_the_per_call_factors(dim, theta):
    table = RopeTable(dim, theta, 3000, "cpu")
    pos = torch.randint(0, 2990, (7, 1)) + torch.arange(9)
    x = torch.randn(7, 9, 3, dim)
    for a, b in zip(table(pos), rope_cos_sin(pos, dim, theta)):
        assert torch.equal(a, b)
    from specdec.drafters.block import rotate

    assert torch.equal(rotate(x, *table(pos)), _old_rope(x, pos, theta))


@pytest.mark.parametrize("kind", KINDS)
def test_forward_block_is_unchanged(kind):
    """The training-time entry point still computes what it computed (to fp32 rounding: projections
    are fused into fewer GEMMs)."""
    net = make_drafter(kind).net
    c, N, B, Lc = net.config, 3, net.config.block_size, 11
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, B, HIDDEN, generator=g)
    pos = torch.randint(0, 50, (N, 1), generator=g) + torch.arange(B)
    valid = torch.rand(N, Lc, generator=g) > 0.3
    with torch.no_grad():
        ctx = net.project_context(torch.randn(1, Lc, 2 * HIDDEN, generator=g))
        ctx_kv = [net.context_kv(i, ctx, torch.arange(Lc)) for i in range(c.num_layers)]
        torch.testing.assert_close(net.forward_block(x, pos, ctx_kv, valid), _old_forward(net, x, pos, ctx_kv, valid),
                                   rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(kv_heads=hst.integers(1, 3), group=hst.integers(1, 4), block=hst.integers(2, 6), n=hst.integers(1, 4),
       ctx=hst.integers(0, 19), seed=hst.integers(0, 2**16))
def test_folded_queries_attend_as_one_head_at_a_time(kv_heads, group, block, n, ctx, seed):
    """A block whose queries all see the same keys runs a KV head's query heads as more query rows
    (``BlockDrafterNet.fold_queries``): the same hidden states as one head at a time, whatever the
    heads, block, requests and context (some requests with no context key at all)."""
    c = BlockDrafterConfig(block_size=block, shift_label=1, target_layer_ids=(0,), target_hidden_size=16, vocab_size=VOCAB,
                           hidden_size=16, num_layers=2, num_heads=kv_heads * group, num_kv_heads=kv_heads,
                           head_dim=4, intermediate_size=24)
    net = init_weights(BlockDrafterNet(c), seed=seed % 7, std=0.3)
    net.fold_min_rows = 1  # fold however few the requests
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, block, 16, generator=g)
    pos = torch.randint(0, 40, (n, 1), generator=g) + torch.arange(block)
    valid = torch.rand(n, ctx, generator=g) > 0.4
    with torch.no_grad():
        feats = net.project_context(torch.randn(n, ctx, 16, generator=g))
        ctx_kv = [net.context_kv(i, feats, torch.arange(ctx)) for i in range(c.num_layers)]
        folded = net.forward_block(x, pos, ctx_kv, valid)
        net.fold_queries = False
        apart = net.forward_block(x, pos, ctx_kv, valid)
    torch.testing.assert_close(folded, apart, rtol=1e-5, atol=1e-5)


def test_folding_starts_at_fold_min_rows(monkeypatch):
    """The propose's attention folds a KV head's query heads into query rows from
    ``fold_min_rows`` requests on, and runs one head at a time below it."""
    net = make_drafter("dflash").net
    c, B, Lc = net.config, net.config.block_size, 5
    G = c.num_heads // c.num_kv_heads
    assert G > 1
    seen = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, *a, **k: (seen.append(tuple(q.shape)), sdpa(q, *a, **k))[1])
    for n in (net.fold_min_rows - 1, net.fold_min_rows):
        seen.clear()
        with torch.no_grad():
            feats = net.project_context(torch.randn(n, Lc, 2 * HIDDEN))
            ctx_kv = [net.context_kv(i, feats, torch.arange(Lc)) for i in range(c.num_layers)]
            net.forward_block(torch.randn(n, B, HIDDEN), torch.arange(B).expand(n, -1) + Lc, ctx_kv,
                              torch.ones(n, Lc, dtype=torch.bool))
        folded = (n, c.num_kv_heads, B * G, c.head_dim)
        apart = (n, c.num_heads, B, c.head_dim)
        assert seen == [folded if n >= net.fold_min_rows else apart] * c.num_layers


def test_per_query_masks_are_not_folded():
    """Training's masks differ by query (each anchor's block sees the context before it): those run
    one head at a time, and give what each block run alone gives."""
    net = make_drafter("dflash").net
    c, B, Lc = net.config, net.config.block_size, 9
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2 * B, HIDDEN, generator=g)  # two blocks of one sequence, as training runs them
    anchors = torch.tensor([[3, 7]])
    with torch.no_grad():
        feats = net.project_context(torch.randn(1, Lc, 2 * HIDDEN, generator=g))
        ctx_kv = [net.context_kv(i, feats, torch.arange(Lc)) for i in range(c.num_layers)]
        pos = (anchors[..., None] + torch.arange(B)).flatten(1)
        from specdec.drafters.training import anchor_block_mask

        both = net.run_block(x, rope_cos_sin(pos, c.head_dim, c.rope_theta), ctx_kv, anchor_block_mask(anchors, B, Lc))
        for j, a in enumerate(anchors[0].tolist()):
            alone = net.forward_block(x[:, j * B:(j + 1) * B], a + torch.arange(B)[None], ctx_kv,
                                      torch.arange(Lc)[None] < a)
            torch.testing.assert_close(both[:, j * B:(j + 1) * B], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tpb,shared", [(4, False), (16, False), (8, True)])
def test_propose_equals_the_old_algorithm(kind, tpb, shared):
    rng = random.Random(f"{kind}-{tpb}-{shared}")
    for mix in range(3):
        st = State(make_drafter(kind, seed=mix), tpb, lengths(rng, tpb, rng.randint(1, 12)), shared, seed=mix)
        d, seen = st.d, capture_hidden(st.d)
        for _ in range(4):
            req_ids = st.ids(rng.randint(1, len(st.reqs)))
            k = rng.choice([1, 2, d.config.draft_width, d.config.draft_width + 3])
            want, h_want = reference_propose(d, req_ids, k)
            got = d.propose(req_ids, k)
            assert [x.token_ids for x in got] == want, (kind, tpb, shared, mix, req_ids, k)
            torch.testing.assert_close(seen[-1], h_want, rtol=1e-5, atol=1e-5)  # not only the argmax: the numbers
            assert all(len(x) == min(k, d.config.draft_width) for x in got)
    assert d.stats["graph_proposes"] == 0 and d.stats["eager_proposes"] == 4
    assert set(d.stats["eager_reasons"]) == {"device is cpu, graphs need cuda"}


@pytest.mark.parametrize("kind", KINDS)
def test_padded_buckets_draft_the_same(kind):
    """Requests padded to a power of two, context keys to a multiple of CTX_BUCKET: the padding is masked out."""
    rng = random.Random(7)
    st = State(make_drafter(kind), 8, lengths(rng, 8, 11) + [300], shared=False, seed=3)
    d, seen = st.d, capture_hidden(st.d)
    d.pad_shapes = True
    for n in (1, 3, 4, 5, 12):
        req_ids = st.ids(n)
        want, h_want = reference_propose(d, req_ids, 9)
        assert [x.token_ids for x in d.propose(req_ids, 9)] == want
        h = seen[-1]
        assert h.shape[0] == 1 << (n - 1).bit_length()
        torch.testing.assert_close(h[:n], h_want, rtol=1e-5, atol=1e-5)
    assert d.pad_shapes and CTX_BUCKET % 8 == 0


def test_every_request_can_have_an_empty_context():
    st = State(make_drafter("dspark"), 4, [0, 0, 0], shared=False, seed=0)
    want, _ = reference_propose(st.d, st.reqs, 5)
    assert [x.token_ids for x in st.d.propose(st.reqs, 5)] == want


def test_nothing_asked_nothing_drafted():
    st = State(make_drafter("dflash"), 4, [5, 9], shared=False, seed=0)
    assert st.d.propose([], 4) == []
    assert [len(x) for x in st.d.propose(st.reqs, 0)] == [0, 0]


@pytest.mark.parametrize("kind", KINDS)
def test_context_kv_written_as_before(kind):
    """on_contexts looks RoPE factors up in the table: the cache holds what per-call factors gave."""
    st = State(make_drafter(kind), 4, [13, 6], shared=False, seed=1)
    d, g = st.d, torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 2 * HIDDEN, generator=g)
    n = d._ctx_len["r0"]
    d.on_context("r0", n, hidden)
    with torch.no_grad():
        ctx = d.net.project_context(hidden)
        pos = torch.arange(n, n + 3)
        if kind == "mla":
            want = _old_latent(d.net.layers[1], ctx, pos)
        else:
            L, c = d.net.layers[1], d.config
            want = _old_rope(L.qk(ctx, c, c.num_kv_heads, "k"), pos, c.rope_theta)
    assert torch.equal(d.kv.k(1)[d.kv.slots("r0", n, n + 3)], want)


@given(max_requests=hst.integers(1, 600), max_context=hst.integers(1, 5000), data=hst.data())
def test_propose_buckets_hold_every_padded_propose(max_requests, max_context, data):
    """What :meth:`BlockDrafter.capture_graphs` captures: the bucket of any padded propose of up to
    ``max_requests`` requests and ``max_context`` context tokens, each once, and nothing bigger."""
    buckets = propose_buckets(max_requests, max_context)
    assert len(set(buckets)) == len(buckets)
    n = data.draw(hst.integers(1, min(max_requests, MAX_PADDED_REQUESTS)))
    ctx = data.draw(hst.integers(0, max_context))
    key = (1 << (n - 1).bit_length(), -(-max(1, ctx) // CTX_BUCKET) * CTX_BUCKET)  # as propose pads it
    assert key in buckets
    assert max(r for r, _ in buckets) == min(1 << (max_requests - 1).bit_length(), MAX_PADDED_REQUESTS)
    assert max(c for _, c in buckets) == -(-max_context // CTX_BUCKET) * CTX_BUCKET


def test_capture_graphs_is_a_no_op_on_the_cpu():
    st = State(make_drafter("dspark"), 4, [5, 9], shared=False, seed=0)
    assert st.d.capture_graphs(8, 600) == 0 and st.d._graphs == {}


def test_cuda_graphs_flag_is_reported():
    st = State(make_drafter("dflash", cuda_graphs=False), 4, [5], shared=False, seed=0)
    st.d.propose(st.reqs, 4)
    assert st.d.stats["eager_reasons"] == {"cuda_graphs disabled": 1}
    assert DFlashDrafter.from_pretrained("smollm2-135m-dflash", cuda_graphs=False).cuda_graphs is False


def _bound_pair(kind: str, tpb: int, pad: bool, device="cpu", dtype=torch.float32):
    """Two copies of one drafter, each on its own pool: one stages short context writes for the next
    propose (its KV has a scratch slot), the other writes everything at once."""
    out = []
    for scratch in (True, False):
        d = make_drafter(kind)
        pages = 200
        pool = KVPool(d.kv_layer_specs(), pages + 1, tpb, device=device)
        d.bind(fake_target(device, dtype), DraftKV(pool, range(d.config.num_layers), KVCacheManager(pages, tpb),
                                                   shared=False, scratch_slot=pages * tpb if scratch else None))
        d.pad_shapes = pad
        out.append(d)
    out[1].cuda_graphs = False  # on CUDA: the staged one replays graphs, the other runs eagerly
    assert out[0]._defer == out[0].config.block_size + 1 and out[1]._defer == 0
    return out


@settings(max_examples=16, deadline=None)
@given(seed=hst.integers(0, 10**6), kind=hst.sampled_from(KINDS), tpb=hst.sampled_from([4, 16]), pad=hst.booleans(),
       ring=hst.sampled_from([None, 7, 16, 40]))
def test_staged_context_writes_equal_immediate_writes(seed, kind, tpb, pad, ring):
    """Any interleaving of prompts, accepted spans, proposes of any subset, requests that are not
    proposed for (their positions stay staged over several steps, outgrowing what a propose writes,
    until a propose for them or the staging ring coming round writes them; a small ring comes round
    often, or is smaller than a step's spans) and stopped requests: the drafts, confidences and, in
    the end, every context position's K/V equal those of immediate writes."""
    staged_vs_immediate(seed, kind, tpb, pad, ring=ring)


def staged_vs_immediate(seed: int, kind: str, tpb: int, pad: bool, device: str = "cpu", compiled: bool = False,
                        ring: int | None = None):
    """A random run of both drafters of :func:`_bound_pair` side by side (the staged one through
    ``torch.compile`` if ``compiled``, its staging ring cut to ``ring`` rows if given); returns them."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    staged, plain = _bound_pair(kind, tpb, pad, device)
    staged.torch_compile = compiled
    if ring is not None:
        staged._ctx_stage = staged._ctx_stage[:ring]
    width = len(staged.target_layer_ids) * HIDDEN
    live, next_id = [], 0
    for _ in range(14):
        if len(live) < 4 and rng.random() < 0.5:  # a new request and its prompt, maybe short enough to stage
            r, n = f"r{next_id}", rng.choice([1, 3, 6, 7, 25])
            next_id += 1
            toks = [rng.randrange(VOCAB) for _ in range(n + 1)]
            for d in (staged, plain):
                d.start_request(r, toks)
            hidden = torch.randn(n, width, generator=g).to(device)
            for d in (staged, plain):
                d.on_contexts([(r, 0, 0, n)], hidden)
            live.append(r)
        if live:
            ask = rng.sample(live, rng.randint(0, len(live)))
            k = rng.choice([1, 3, 9])
            a, b = staged.propose(ask, k), plain.propose(ask, k)
            assert [x.token_ids for x in a] == [x.token_ids for x in b]
            for x, y in zip(a, b):
                assert (x.confidence is None) == (y.confidence is None)
                if x.confidence is not None:
                    assert x.confidence == pytest.approx(y.confidence, abs=1e-5)
            spans, row = [], 0  # the step accepts 1..k+1 tokens of some requests
            for r in rng.sample(live, rng.randint(0, len(live))):
                m = rng.randint(1, min(k + 1, staged.config.block_size + 1))
                toks = [rng.randrange(VOCAB) for _ in range(m)]
                spans.append((r, staged._ctx_len[r], row, m))
                row += m
                for d in (staged, plain):
                    d.on_accepted(r, toks)
            if spans:
                rng.shuffle(spans)
                hidden = torch.randn(row + rng.randint(0, 3), width, generator=g).to(device)  # other rows too
                for d in (staged, plain):
                    d.on_contexts(spans, hidden)
            if rng.random() < 0.2:
                r = live.pop(rng.randrange(len(live)))
                for d in (staged, plain):
                    d.stop_request(r)
    staged.propose(live, 1)  # writes what is still staged
    assert not staged._pending
    for r in live:
        n = staged._ctx_len[r]
        assert n == plain._ctx_len[r]
        for i in range(staged.config.num_layers):
            torch.testing.assert_close(staged.kv.k(i)[staged.kv.slots(r, 0, n)], plain.kv.k(i)[plain.kv.slots(r, 0, n)],
                                       rtol=1e-5, atol=1e-5)
    return staged, plain


@pytest.mark.parametrize("per_step", [1, 2, 3])
def test_staged_positions_wait_for_the_propose_that_needs_them(monkeypatch, per_step):
    """A request left out of proposes keeps its positions staged, however many (no eager write: a
    draft gate's plain steps cost the drafter one copy a step); the next propose for it writes those
    past what its graph writes (block_size + 1) at once, that request's alone; when the staging ring
    comes round, every staged position is written at once."""
    staged, _ = _bound_pair("dspark", 4, pad=False)
    writes = []
    real_write = staged._write
    monkeypatch.setattr(staged, "_write", lambda hidden, runs: (writes.append(sorted(p for r in runs for p in r[1])),
                                                              real_write(hidden, runs)))
    width = len(staged.target_layer_ids) * HIDDEN
    g = torch.Generator().manual_seed(0)
    for r in ("a", "b"):
        staged.start_request(r, [1] * 21)
        staged.on_contexts([(r, 0, 0, 20)], torch.randn(20, width, generator=g))  # a prompt: written now
    assert writes == [list(range(20))] * 2
    writes.clear()
    D = staged._defer

    def step():
        spans = [("a", staged._ctx_len["a"], 0, per_step), ("b", staged._ctx_len["b"], per_step, per_step)]
        for r, *_ in spans:
            staged.on_accepted(r, [2] * per_step)
        staged.on_contexts(spans, torch.randn(2 * per_step, width, generator=g))

    for _ in range(12):
        staged.propose(["a"], 3)  # "b" is not proposed for
        step()
        assert len(staged._pending["a"][0]) == per_step  # a's positions go with its proposes
    assert writes == [] and staged._pending["b"][1] == list(range(20, 20 + 12 * per_step))
    staged.propose(["a", "b"], 3)  # b's positions outgrow the propose's writes: b's, at once
    assert writes == [list(range(20, 20 + 12 * per_step))] and not staged._pending
    writes.clear()
    ring = 5 * 2 * per_step  # five steps of both requests
    staged._ctx_stage, staged._stage_top = staged._ctx_stage[:ring], 0
    for i in range(7):
        step()  # nothing proposed: the ring comes round after five steps
        if i < 5:
            assert writes == []
    start = 20 + 12 * per_step
    assert writes == [sorted([*range(start, start + 5 * per_step)] * 2)]
    assert staged._pending["a"][1] == staged._pending["b"][1] == list(range(start + 5 * per_step, start + 7 * per_step))


def test_staged_writes_of_a_request_whose_pages_were_freed_are_dropped():
    """In a pool shared with the target, preemption frees a request's pages and another request may
    take them: the first request's staged positions must never be written over the second's."""
    d = make_drafter("dspark")
    tpb, pages = 4, 40
    manager = KVCacheManager(pages, tpb)  # the target's: the drafter's layers share its pages
    pool = KVPool(d.kv_layer_specs(), pages + 1, tpb)
    d.bind(fake_target(), DraftKV(pool, range(d.config.num_layers), manager, shared=True, scratch_slot=pages * tpb))
    width = len(d.target_layer_ids) * HIDDEN
    g = torch.Generator().manual_seed(0)
    d.start_request("a", [1] * 21)
    manager.allocate("a", 20)
    d.on_contexts([("a", 0, 0, 20)], torch.randn(20, width, generator=g))  # a prompt: written now
    manager.append("a", 3)
    d.on_accepted("a", [2, 2, 2])
    d.on_contexts([("a", 20, 0, 3)], torch.randn(3, width, generator=g))  # staged
    assert len(d._pending["a"][0]) == 3
    staged_slots = manager.slots("a", 20, 23)
    manager.free("a")  # preempted: its pages go back to the pool
    manager.allocate("b", 23)  # and another request takes them
    d.start_request("b", [5] * 24)
    d.on_contexts([("b", 0, 0, 23)], torch.randn(23, width, generator=g))
    slots_b = manager.slots("b", 0, 23)
    assert set(slots_b) & set(staged_slots)  # the freed slots are b's now
    k_b = d.kv.k(0)[slots_b].clone()
    manager.allocate("a", 23)  # readmitted: its context is computed again
    d.on_contexts([("a", 0, 0, 23)], torch.randn(23, width, generator=g))
    manager.append("a", 2)  # and a step accepts two tokens before any propose for it: staged, fresh
    d.on_accepted("a", [2, 2])
    d.on_contexts([("a", 23, 0, 2)], torch.randn(2, width, generator=g))
    assert d._pending["a"][1] == [23, 24]  # the stale positions went, the fresh ones stay
    fresh = manager.slots("a", 23, 25)
    k_fresh = d.kv.k(0)[fresh].clone()
    for _ in range(STAGE_STEPS + 1):  # sections come round again, proposes run: no stale write anywhere
        d.propose(["a", "b"], 3)
        d.on_contexts([], torch.zeros(0, width))
    assert torch.equal(d.kv.k(0)[slots_b], k_b) and "a" not in d._pending
    assert not torch.equal(d.kv.k(0)[fresh], k_fresh)  # the fresh positions were written


def test_several_spans_of_one_request_in_one_step_and_a_failed_propose_lose_nothing(monkeypatch):
    """Two spans of one request in one on_contexts call (more than a propose writes, together) stay
    staged, and the next propose writes them at once; a propose that raises keeps its staged
    writes (those its graph writes) for the next one."""
    staged, plain = _bound_pair("dspark", 4, pad=False)
    width = len(staged.target_layer_ids) * HIDDEN
    g = torch.Generator().manual_seed(1)
    D = staged._defer
    for d in (staged, plain):
        d.start_request("a", [1] * 61)
    hidden = torch.randn(20, width, generator=g)
    for d in (staged, plain):
        d.on_contexts([("a", 0, 0, 20)], hidden)
    hidden = torch.randn(2 * D, width, generator=g)
    for d in (staged, plain):
        d.on_accepted("a", [2] * (2 * D))
        d.on_contexts([("a", 20, 0, D), ("a", 20 + D, D, D)], hidden)
    assert staged._pending["a"][1] == list(range(20, 20 + 2 * D))  # both spans, staged
    assert staged.propose(["a"], 3)[0].token_ids == plain.propose(["a"], 3)[0].token_ids  # written at once first
    assert "a" not in staged._pending
    hidden = torch.randn(3, width, generator=g)
    for d in (staged, plain):
        d.on_accepted("a", [3] * 3)
        d.on_contexts([("a", 20 + 2 * D, 0, 3)], hidden)
    assert len(staged._pending["a"][0]) == 3

    def fail(*args, **kwargs):
        raise RuntimeError("propose failed")

    monkeypatch.setattr(staged, "_run_draft", fail)
    with pytest.raises(RuntimeError, match="propose failed"):
        staged.propose(["a"], 3)
    assert len(staged._pending["a"][0]) == 3  # still staged
    monkeypatch.undo()
    assert staged.propose(["a"], 3)[0].token_ids == plain.propose(["a"], 3)[0].token_ids
    assert "a" not in staged._pending
    n = staged._ctx_len["a"]
    torch.testing.assert_close(staged.kv.k(0)[staged.kv.slots("a", 0, n)], plain.kv.k(0)[plain.kv.slots("a", 0, n)],
                               rtol=1e-5, atol=1e-5)


def test_staged_positions_around_a_span_written_at_once_land_in_their_own_slots():
    """A request's staged positions with a gap (a span longer than a propose writes, written at once,
    between two staged ones): every position's K/V equals immediate writes after the next propose."""
    staged, plain = _bound_pair("dflash", 4, pad=False)
    width = len(staged.target_layer_ids) * HIDDEN
    g = torch.Generator().manual_seed(2)
    D = staged._defer
    for d in (staged, plain):
        d.start_request("a", [1] * 9)
    start = 0
    for n in (8, 2, D + 1, 2):  # a prompt (written at once), staged, written at once, staged
        hidden = torch.randn(n, width, generator=g)
        for d in (staged, plain):
            if start:
                d.on_accepted("a", [2] * n)
            d.on_contexts([("a", start, 0, n)], hidden)
        start += n
    assert staged._pending["a"][1] == [8, 9, 11 + D, 12 + D]
    assert staged.propose(["a"], 3)[0].token_ids == plain.propose(["a"], 3)[0].token_ids
    for i in range(staged.config.num_layers):
        torch.testing.assert_close(staged.kv.k(i)[staged.kv.slots("a", 0, start)],
                                   plain.kv.k(i)[plain.kv.slots("a", 0, start)], rtol=1e-5, atol=1e-5)


@needs_cxx
@pytest.mark.parametrize("kind", ["dflash", "dflash_folded", "dspark_heads", "mla"])
def test_compiled_propose_drafts_as_eager(kind, monkeypatch):
    """``torch_compile=True``: the whole propose pass (staged context writes, gathers, layers, the
    Markov head's slot-by-slot decode, confidences) compiles into one dynamic graph, and drafts,
    confidences and context K/V equal the eager drafter's, over a run whose batch and context
    sizes vary (one request and one page included)."""
    from torch._dynamo.utils import counters

    if kind == "dflash_folded":  # the folded attention at these few requests too
        monkeypatch.setattr(BlockDrafterNet, "fold_min_rows", 1)
        kind = "dflash"
    torch._dynamo.reset()
    counters.clear()
    staged, plain = staged_vs_immediate(3, kind, 4, pad=False, compiled=True)
    assert staged.torch_compile and staged.stats["compile_errors"] == 0
    assert staged.stats["compile_s"] > 0 and plain.stats["compile_s"] == 0
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1  # padded to >= 2 requests and pages: no size specialises


@needs_cxx
def test_each_drafter_compiles_its_own_propose():
    """Drafters of one kind in one process (several engines, batch sizes) each compile their
    propose: torch's cache is kept per function code, and each drafter's compiled pass has a code
    object of its own, so none runs graphs compiled for an earlier one's sizes."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    for n, graphs in ((3, 1), (5, 2), (7, 3)):  # shared, the third would run the second's graph
        rng = random.Random(n)
        st = State(make_drafter("dflash"), n, lengths(rng, n, 5), False, seed=n)
        st.d.torch_compile = True
        st.d.propose(st.reqs, 9)
        assert st.d.stats["compile_errors"] == 0
        assert counters["stats"]["unique_graphs"] == graphs


@needs_cxx
def test_a_compiled_drafter_rebound_to_another_target_drafts_with_its_embedding():
    """After ``bind`` to a target with another embedding and LM head, the compiled pass reads the
    new products (the Markov head's ``embed @ down`` and ``lm_head @ up``), as the eager one does."""
    rng = random.Random(4)
    st = State(make_drafter("dspark_heads"), 4, lengths(rng, 4, 5), False, seed=5)
    d, ids = st.d, st.reqs
    d.torch_compile = True
    d.propose(ids, 9)
    other = fake_target(seed=7)
    d.bind(other, d.kv)
    e = make_drafter("dspark_heads")
    e.bind(other, d.kv)
    e._tokens, e._ctx_len = {r: list(t) for r, t in d._tokens.items()}, dict(d._ctx_len)
    got, want = d.propose(ids, 9), e.propose(ids, 9)
    assert [x.token_ids for x in got] == [x.token_ids for x in want]
    assert d.stats["compile_errors"] == 0


def test_a_failing_compile_falls_back_to_eager(monkeypatch):
    """A compiler failure turns ``torch_compile`` off with a warning; that propose, and the next,
    run eagerly and draft what an eager drafter drafts (its staged writes are not lost)."""
    def broken(fn, *a, **k):
        def run(*args, **kwargs):
            raise RuntimeError("inductor failed")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    staged, plain = _bound_pair("dspark_heads", 4, pad=False)
    staged.torch_compile = True
    g = torch.Generator().manual_seed(0)
    width = len(staged.target_layer_ids) * HIDDEN
    for d in (staged, plain):
        d.start_request("a", [1, 2, 3, 4])
    hidden = torch.randn(3, width, generator=g)
    for d in (staged, plain):
        d.on_contexts([("a", 0, 0, 3)], hidden)  # short: staged for the next propose
    with pytest.warns(RuntimeWarning, match="compiled propose failed"):
        a = staged.propose(["a"], 9)
    _same_drafts(a, plain.propose(["a"], 9))
    assert staged.torch_compile is False and staged.stats["compile_errors"] == 1
    _same_drafts(staged.propose(["a"], 9), plain.propose(["a"], 9))


def _same_drafts(got, want):
    """Same tokens; confidences equal up to float rounding (the failed compile's eager warm-up ran the
    pass padded to two rows, whose matmuls may round differently on some CPUs)."""
    assert [d.token_ids for d in got] == [d.token_ids for d in want]
    for d, w in zip(got, want):
        assert d.confidence == pytest.approx(w.confidence, rel=1e-5, abs=1e-6)


def test_torch_compile_is_a_bool_or_none():
    with pytest.raises(ConfigError, match="torch_compile"):
        make_drafter("dflash").__class__(make_drafter("dflash").net, torch_compile="yes")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU case is the twin)")])])
def test_torch_compile_defaults_to_the_target_s_device(device):
    """By default (``None``) the propose is compiled for a CUDA target, not for a CPU one; an explicit
    setting stays whatever the target; ``None`` set later follows the next bind."""
    auto, off, on = make_drafter("dflash"), make_drafter("dflash"), make_drafter("dflash")
    off.torch_compile, on.torch_compile = False, True
    assert auto.torch_compile is False  # not bound yet
    for d in (auto, off, on):
        pool = KVPool(d.kv_layer_specs(), 9, 16, device=device)
        d.bind(fake_target(device, torch.float32), DraftKV(pool, range(d.config.num_layers), KVCacheManager(8, 16),
                                                           shared=False))
    assert auto.torch_compile is (device == "cuda")
    assert off.torch_compile is False and on.torch_compile is True
    on.torch_compile = None
    on.bind(fake_target(device, torch.float32), on.kv)
    assert on.torch_compile is (device == "cuda")


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", KINDS)
def test_staged_writes_inside_graph_replays_equal_immediate_writes(kind):
    """On CUDA the staged writes run inside the captured propose (the staged drafter replays graphs,
    the other runs eagerly with every write immediate): same drafts, same cache."""
    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        for seed in range(4):
            staged, _ = staged_vs_immediate(seed, kind, 16, True, "cuda")
            assert staged.stats["graph_proposes"] > 0
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
class TestOnGPU:
    @pytest.mark.parametrize("kind", KINDS)
    def test_unpadded_eager_equals_the_old_algorithm_in_fp32(self, kind):
        """On CUDA too the table holds the per-call factors: same shapes, same numbers."""
        rng = random.Random(1)
        st = State(make_drafter(kind, cuda_graphs=False), 16, lengths(rng, 16, 9), False, seed=2, device="cuda")
        d, seen = st.d, capture_hidden(st.d)
        d.pad_shapes = False
        for n in (1, 4, 9):
            req_ids = st.ids(n)
            want, h_want = reference_propose(d, req_ids, 9)
            assert [x.token_ids for x in d.propose(req_ids, 9)] == want
            torch.testing.assert_close(seen[-1], h_want, rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("kind", KINDS)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_graph_replays_equal_eager_proposes(self, kind, dtype):
        """Same bucket, same kernels: replay == padded eager, token for token; in fp32 both == the old path."""
        rng = random.Random(2)
        st = State(make_drafter(kind), 16, lengths(rng, 16, 20) + [600], False, seed=3, device="cuda", dtype=dtype)
        d = st.d
        buckets = set()
        for n in (1, 3, 4, 7, 8, 21, 3):
            req_ids = st.ids(n)
            d.cuda_graphs = False
            eager = d.propose(req_ids, 9)
            d.cuda_graphs = True
            graph = d.propose(req_ids, 9)
            assert graph == eager, (kind, dtype, n)
            if dtype == torch.float32:
                assert [x.token_ids for x in graph] == reference_propose(d, req_ids, 9)[0]
            width = max(1, max(d._ctx_len[r] for r in req_ids))
            buckets.add((1 << (n - 1).bit_length(), -(-width // CTX_BUCKET) * CTX_BUCKET))
        assert d.stats["graph_proposes"] == 7 and d.stats["eager_proposes"] == 7
        assert d.stats["graphs_captured"] == len(buckets) < 7  # buckets are reused

    @pytest.mark.parametrize("kind", ["dflash", "dspark_heads", "mla"])
    def test_compiled_graph_replays_draft_as_eager(self, kind):
        """``torch_compile=True`` on CUDA: each bucket's graph captures the compiled pass (staged
        writes included); drafts, confidences and the cache equal the eager drafter's (fp32)."""
        tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
        try:
            staged, _ = staged_vs_immediate(5, kind, 16, True, "cuda", compiled=True)
            assert staged.stats["graph_proposes"] > 0 and staged.stats["compile_s"] > 0
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32

    @pytest.mark.parametrize("kind", KINDS[:2])
    def test_engine_with_graph_proposes_is_lossless(self, tmp_path, kind):
        """The drafter's graphs beside the target's own graph steps: fp32 greedy output == the null drafter's."""
        from specdec import SamplingParams, SpecEngine

        from helpers import tiny_llama

        target = tiny_llama(tmp_path, "cuda", vocab_size=128, hidden_size=64, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                            eos_token_id=127)
        cfg = BlockDrafterConfig(block_size=5, shift_label=int(kind == "dspark"), target_layer_ids=(0, 1),
                                 target_hidden_size=64, vocab_size=128, hidden_size=64, num_layers=2, num_heads=4,
                                 num_kv_heads=2, head_dim=16, intermediate_size=96)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 127, (n,), generator=g).tolist() for n in (300, 5, 40, 130, 1, 77)]
        params = SamplingParams(max_new_tokens=40, ignore_eos=True)
        outs = {}
        for name, graphs in (("null", None), ("eager", False), ("graph", True), ("precaptured", True),
                             ("compiled", True)):
            d = None if graphs is None else (DFlashDrafter if kind == "dflash" else DSparkDrafter)(
                init_weights(BlockDrafterNet(cfg), seed=4), cuda_graphs=graphs, torch_compile=name == "compiled")
            engine = SpecEngine(target, d, max_draft_tokens=4, tokens_per_block=16, draft_gate=False)
            if name in ("precaptured", "compiled"):  # every propose bucket before the first step: none captured later
                engine.capture_graphs(max_kv_len=400, progress=False)
                before = d.stats["graphs_captured"]
                assert before == len(propose_buckets(engine.config.max_num_seqs, 400))
            outs[name] = [o.token_ids for o in engine.generate(prompts, params)]
            if graphs:
                assert d.stats["graph_proposes"] > 0 and d.stats["eager_proposes"] == 0
            if name in ("precaptured", "compiled"):
                assert d.stats["graphs_captured"] == before
        assert outs["graph"] == outs["eager"] == outs["null"] == outs["precaptured"] == outs["compiled"]


@pytest.mark.parametrize("qk_norm", [False, True])
def test_all_layers_context_kv_in_one_projection_equals_each_layer(qk_norm):
    from specdec.drafters.block import BlockDrafterConfig, BlockDrafterNet, init_weights, rope_cos_sin

    cfg = BlockDrafterConfig(block_size=4, shift_label=1, target_layer_ids=(0,), target_hidden_size=32,
                             vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                             intermediate_size=64, qk_norm=qk_norm)
    net = init_weights(BlockDrafterNet(cfg), seed=1)
    if qk_norm:
        with torch.no_grad():
            for L in net.layers:
                L.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    ctx, pos = torch.randn(7, 32), torch.arange(3, 10)
    rope = rope_cos_sin(pos, 8, cfg.rope_theta)
    got = net.context_kv_all(ctx, pos, rope)
    for i, (k, v) in enumerate(got):
        k_ref, v_ref = net.context_kv(i, ctx, pos, rope)
        torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        net.layers[1].self_attn.v_proj.weight.mul_(2)  # a changed weight is seen (the stacked copy is rebuilt)
    torch.testing.assert_close(net.context_kv_all(ctx, pos, rope)[1][1], net.context_kv(1, ctx, pos, rope)[1])


def test_the_context_host_bench_runs_and_plain_steps_write_nothing_at_once(tmp_path):
    """``bench/context_host.py`` on a few steps: its table and JSON are written; in the plain regime
    (no propose) nothing is written at once, and in the drafting regime only its first propose
    writes at once what the plain steps staged (more than its graph writes), every request's in one go."""
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("context_host", Path(__file__).resolve().parent.parent / "bench"
                                                  / "context_host.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--batch", "4", "--prompt", "40", "--steps", "12", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "context_host.json").read_text())["results"]
    assert res["plain"]["eager_writes_per_step"] == 0
    assert res["drafting"]["eager_writes_per_step"] == 1 / 12 and res["drafting"]["positions_per_write"] == 4 * 12
    assert res["drafting"]["pack_us"] > 0 and "| plain |" in (tmp_path / "context_host.md").read_text()
    assert torch.is_grad_enabled()
