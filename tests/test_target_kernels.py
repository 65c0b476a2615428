"""The fused Triton elementwise kernels of the GPU forward against their PyTorch forms.

On a CPU they run in Triton's interpreter: ``test_cpu_interpreter_suite`` re-runs
this file in a subprocess with ``TRITON_INTERPRET=1`` (the kernels must be
built for the interpreter at import). On a GPU everything runs in-process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed (pip extra 'gpu')")

import triton  # noqa: E402

from specdec.target.kernels import (add_rms_norm_, fused_linear, qkv_rope_write_kv, rope_,  # noqa: E402
                                    rope_write_kv_, silu_mul, ss_parts)
from specdec.layers import rms_norm, rotate, signed_sin  # noqa: E402

INTERPRETED = bool(triton.knobs.runtime.interpret)
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cpu" if INTERPRETED or not HAS_CUDA else "cuda"
needs_kernels = pytest.mark.skipif(not (INTERPRETED or HAS_CUDA),
                                   reason="no GPU; test_cpu_interpreter_suite runs these with TRITON_INTERPRET=1")
DTYPES = [torch.float32, torch.bfloat16]
# the GEMM kernels loop over runtime bounds and dot bf16 tiles: Triton's interpreter needs its fixes
pytestmark = pytest.mark.usefixtures("fixed_triton_interpreter")


def randn(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 2).to(dtype=dtype, device=DEVICE)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [32, 576, 100])
def test_add_rms_norm_matches_the_hf_form(dtype, hidden):
    x, delta = randn(5, hidden, dtype=dtype), randn(5, hidden, dtype=dtype, seed=1)
    w = randn(hidden, dtype=dtype, seed=2)
    want_x = x + delta
    want = rms_norm(want_x, w, 1e-5)
    got = add_rms_norm_(x, delta, w, 1e-5)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=3e-2)
    if DEVICE == "cuda" or dtype == torch.float32:
        assert torch.equal(x, want_x)  # the residual add is one rounding, as torch's
    else:  # the interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest
        torch.testing.assert_close(x, want_x, atol=0, rtol=2 ** -7)
    torch.testing.assert_close(got, want, **tol)
    plain = randn(5, hidden, dtype=dtype, seed=3)
    torch.testing.assert_close(add_rms_norm_(plain, None, w, 1e-5), rms_norm(plain, w, 1e-5), **tol)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_q_and_k_heads_and_leaves_v(dtype):
    T, H, Hkv, D = 6, 4, 2, 16
    qkv = randn(T, (H + 2 * Hkv) * D, dtype=dtype)
    positions = torch.tensor([0, 1, 5, 9, 2, 30], device=DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    emb = torch.outer(torch.arange(64).float(), inv)
    emb = torch.cat((emb, emb), -1)
    cos, sin = emb.cos().to(dtype=dtype, device=DEVICE), emb.sin().to(dtype=dtype, device=DEVICE)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], -1)
    want_q = rotate(q.reshape(T, H, D).float(), c.float(), signed_sin(s.float()))
    want_k = rotate(k.reshape(T, Hkv, D).float(), c.float(), signed_sin(s.float()))
    want_v = v.clone()
    rope_(qkv, H + Hkv, D, cos, sin, positions)
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], -1)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(q.reshape(T, H, D).float(), want_q, **tol)
    torch.testing.assert_close(k.reshape(T, Hkv, D).float(), want_k, **tol)
    assert torch.equal(v, want_v)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv_equals_rope_then_cache_writes(dtype):
    T, H, Hkv, D, slots_total = 5, 4, 2, 16, 40
    qkv = randn(T, (H + 2 * Hkv) * D, dtype=dtype)
    positions = torch.tensor([3, 4, 5, 6, 7], device=DEVICE)
    slots = torch.tensor([17, 2, 33, 8, 9], device=DEVICE)
    emb = torch.outer(torch.arange(16).float(), 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)))
    emb = torch.cat((emb, emb), -1)
    cos, sin = emb.cos().to(dtype=dtype, device=DEVICE), emb.sin().to(dtype=dtype, device=DEVICE)
    want_qkv = rope_(qkv.clone(), H + Hkv, D, cos, sin, positions)
    q, k, v = want_qkv.split([H * D, Hkv * D, Hkv * D], -1)
    kc, vc = randn(slots_total, Hkv, D, dtype=dtype, seed=7), randn(slots_total, Hkv, D, dtype=dtype, seed=8)
    want_kc, want_vc = kc.clone(), vc.clone()
    want_kc[slots], want_vc[slots] = k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
    got_q = rope_write_kv_(qkv, H, Hkv, D, cos, sin, positions, slots, kc, vc)
    assert torch.equal(got_q, q.reshape(T, H, D))
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)  # other slots untouched


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 1536, 40])
def test_silu_mul_matches_torch(dtype, inter):
    gu = randn(3, 2 * inter, dtype=dtype)
    gate, up = gu.chunk(2, -1)
    want = F.silu(gate) * up  # two roundings in bf16, as the kernel does
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=3e-2)
    torch.testing.assert_close(silu_mul(gu), want, **tol)


def tables(D, n, dtype):
    emb = torch.outer(torch.arange(n).float(), 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)))
    emb = torch.cat((emb, emb), -1)
    return emb.cos().to(dtype=dtype, device=DEVICE), emb.sin().to(dtype=dtype, device=DEVICE)


def tol_for(dtype, want=None):
    """fp32: tight. bf16: a few ulps of the output's scale (the interpreter rounds bf16 toward zero at
    every step, so cancelling sums drift further there than on the GPU)."""
    if dtype == torch.float32:
        return dict(atol=1e-4, rtol=1e-4)
    scale = 1.0 if want is None else float(want.float().abs().max())
    return dict(atol=4e-2 * scale, rtol=4e-2)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 5, 17])
@pytest.mark.parametrize("mode", ["plain", "norm", "silu_mul", "residual", "norm_fp32_out", "norm_short_k_tiles",
                                  "silu_mul_short_k_tiles"])
def test_fused_linear_matches_the_unfused_layers(dtype, m, mode):
    k, n = (100, 40) if mode != "norm_fp32_out" else (72, 300)
    cfg = {"block_k": 32 if mode.endswith("short_k_tiles") else 64}  # 32: a 4-step K loop, a partial last tile
    mode = mode.removesuffix("_short_k_tiles")
    x = randn(m, k, dtype=dtype, seed=1) * 0.5
    w = randn(2 * n if mode == "silu_mul" else n, k, dtype=dtype, seed=2) * 0.1
    nw = randn(k, dtype=dtype, seed=3)
    if mode == "plain":
        want, got = F.linear(x, w), fused_linear(x, w)
    elif mode == "norm":
        want, got = F.linear(rms_norm(x, nw, 1e-5), w), fused_linear(x, w, norm_weight=nw, eps=1e-5, config=cfg)
    elif mode == "silu_mul":
        gate, up = F.linear(rms_norm(x, nw, 1e-5), w).chunk(2, -1)
        want, got = F.silu(gate) * up, fused_linear(x, w, norm_weight=nw, eps=1e-5, silu_mul=True, config=cfg)
    elif mode == "residual":  # in place, as the decoder's O and down projections run
        xs = randn(m, k, dtype=dtype, seed=4)
        w = randn(k, k, dtype=dtype, seed=5) * 0.1
        want = xs + F.linear(x, w)
        got = fused_linear(x, w, residual=xs, out=xs)
        assert got.data_ptr() == xs.data_ptr()
    else:  # the LM head: norm, bf16 GEMM rounded, fp32 logits
        want = F.linear(rms_norm(x, nw, 1e-5), w).float()
        got = fused_linear(x, w, norm_weight=nw, eps=1e-5, out_dtype=torch.float32)
        assert got.dtype == torch.float32
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, **tol_for(dtype, want))


def test_fused_linear_rejects_a_weight_of_the_wrong_width():
    with pytest.raises(ValueError, match="does not fit"):
        fused_linear(torch.zeros(2, 8), torch.zeros(4, 6))
    with pytest.raises(ValueError, match="contiguous last dim"):
        fused_linear(torch.zeros(8, 2).t(), torch.zeros(4, 8))


@needs_kernels
def test_fused_linear_rejects_an_ss_buffer_of_the_wrong_shape():
    x, w = randn(3, 32, dtype=torch.float32), randn(40, 32, dtype=torch.float32)
    with pytest.raises(ValueError, match="ss_out must be"):
        fused_linear(x, w, ss_out=torch.zeros(3, 1, device=DEVICE))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 19])
def test_norm_from_the_partial_sums_the_writer_left(dtype, m):
    """The residual kernel leaves each row's sum of squares in column-block parts; the next
    norm (a fused GEMM or the QKV kernel) reads them instead of passing over the row: the
    same result as the norm's own pass."""
    hidden, inter, H, Hkv, D = 96, 64, 2, 1, 32
    x = randn(m, hidden, dtype=dtype, seed=1)
    o = randn(m, hidden, dtype=dtype, seed=2) * 0.3
    w_o = randn(hidden, hidden, dtype=dtype, seed=3) * 0.1
    ss = torch.full((m, ss_parts(hidden, hidden)), float("nan"), device=DEVICE)
    fused_linear(o, w_o, residual=x, out=x, ss_out=ss)
    assert not ss.isnan().any()
    torch.testing.assert_close(ss.sum(1), x.float().pow(2).sum(1), rtol=1e-5, atol=1e-4)
    nw = randn(hidden, dtype=dtype, seed=4)
    w_gu = randn(2 * inter, hidden, dtype=dtype, seed=5) * 0.1
    want = fused_linear(x, w_gu, norm_weight=nw, eps=1e-5, silu_mul=True)
    got = fused_linear(x, w_gu, norm_weight=nw, eps=1e-5, silu_mul=True, norm_ss=ss)
    torch.testing.assert_close(got, want, **tol_for(dtype, want))
    w_qkv = randn((H + 2 * Hkv) * D, hidden, dtype=dtype, seed=6) * 0.1
    cos, sin = tables(D, 64, dtype)
    pos, slots = torch.arange(m, device=DEVICE), torch.arange(m, device=DEVICE)
    caches = [randn(m, Hkv, D, dtype=dtype, seed=s) for s in (7, 8, 7, 8)]
    q_want = qkv_rope_write_kv(x, w_qkv, None, nw, 1e-5, H, Hkv, D, cos, sin, pos, slots, *caches[:2])
    q_got = qkv_rope_write_kv(x, w_qkv, None, nw, 1e-5, H, Hkv, D, cos, sin, pos, slots, *caches[2:], norm_ss=ss)
    torch.testing.assert_close(q_got, q_want, **tol_for(dtype, q_want))
    torch.testing.assert_close(caches[2], caches[0], **tol_for(dtype, caches[0]))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_linear_rows_do_not_depend_on_the_batch(dtype):
    """A row computed alone equals the same row inside a 37-row step, bit for bit."""
    x = randn(37, 96, dtype=dtype, seed=1) * 0.5
    w = randn(2 * 48, 96, dtype=dtype, seed=2) * 0.1
    nw = randn(96, dtype=dtype, seed=3)
    full = fused_linear(x, w, norm_weight=nw, silu_mul=True)
    for r in (0, 16, 36):
        assert torch.equal(fused_linear(x[r:r + 1].contiguous(), w, norm_weight=nw, silu_mul=True), full[r:r + 1])


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,bias,config", [(16, False, None), (64, True, None),
                                           (64, False, {"head_split": 1, "block_k": 32})])
def test_qkv_rope_write_kv_equals_norm_gemm_rope_and_cache_writes(dtype, D, bias, config):
    T, H, Hkv, hidden, slots_total = 5, 4, 2, 80, 40
    x = randn(T, hidden, dtype=dtype, seed=1)
    w = randn((H + 2 * Hkv) * D, hidden, dtype=dtype, seed=2) * 0.1
    b = randn((H + 2 * Hkv) * D, dtype=dtype, seed=3) if bias else None
    nw = randn(hidden, dtype=dtype, seed=4)
    positions = torch.tensor([3, 4, 5, 6, 30], device=DEVICE)
    slots = torch.tensor([17, 2, 33, 8, 9], device=DEVICE)
    cos, sin = tables(D, 32, dtype)
    kc, vc = randn(slots_total, Hkv, D, dtype=dtype, seed=7), randn(slots_total, Hkv, D, dtype=dtype, seed=8)
    want_kc, want_vc = kc.clone(), vc.clone()
    qkv = F.linear(rms_norm(x, nw, 1e-5), w, b)
    want_q = rope_write_kv_(qkv, H, Hkv, D, cos, sin, positions, slots, want_kc, want_vc)
    got_q = qkv_rope_write_kv(x, w, b, nw, 1e-5, H, Hkv, D, cos, sin, positions, slots, kc, vc, config=config)
    assert got_q.shape == (T, H, D)
    torch.testing.assert_close(got_q, want_q, **tol_for(dtype, want_q))
    torch.testing.assert_close(kc, want_kc, **tol_for(dtype, want_kc))
    torch.testing.assert_close(vc, want_vc, **tol_for(dtype, want_vc))
    untouched = torch.ones(slots_total, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert torch.equal(kc[untouched.to(DEVICE)], want_kc[untouched.to(DEVICE)])


@needs_kernels
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_fused_llama_forward_matches_the_plain_one(tmp_path, kv_dtype):
    """The whole decoder: each op set (``KernelConfig``: fused kernels with and without the fused GEMMs,
    and the fused GEMMs up to 4 tokens, so the 5-token context step takes the other fused ops) vs plain
    PyTorch, fp32, over a context + verify step, with a cache of the compute dtype (fused cache write)
    and an FP8 cache (attend writes; the fused GEMMs step aside)."""
    import transformers

    from specdec.attention.metadata import plan_step
    from specdec.config import KernelConfig
    from specdec.kvcache import KVCacheManager, KVPool
    from specdec.target import load_target

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    results = []
    for kernels in (KernelConfig(fused=False), KernelConfig(fused=True, fused_gemm=False), KernelConfig(fused=True),
                    KernelConfig(fused=True, fused_gemm_max_tokens=4)):
        target = load_target(tmp_path, device=DEVICE, kernels=kernels)
        from specdec.pdl import pdl_level

        want_pdl = pdl_level(torch.device(DEVICE)) if kernels.fused and kernels.fused_gemm else 0
        assert target.kernels.fused == kernels.fused and target.kernels.pdl == want_pdl
        pool, mgr = KVPool(target.layer_specs(kv_dtype), 8, 4, device=DEVICE), KVCacheManager(8, 4)
        out = []
        for chunk in ([3, 5, 7, 9, 11], [13, 2, 4]):  # context, then a 3-token verify
            start = mgr.length("r") if "r" in mgr else 0
            if "r" not in mgr:
                mgr.allocate("r", 0)
            mgr.append("r", len(chunk))
            phase = ([(len(chunk), start + len(chunk), tuple(mgr.page_table("r")))], [])
            ctx, gen = phase if start == 0 else phase[::-1]
            slots = torch.tensor(mgr.slots("r", start, start + len(chunk)), device=DEVICE)
            attn = plan_step(ctx, gen, slots, lambda p, q, m: target.attn_shape(p, q, 4, m, kv_dtype=kv_dtype), 4,
                             "torch_ref")
            with torch.inference_mode():
                hidden, captured = target.forward(torch.tensor(chunk, device=DEVICE),
                                                  torch.arange(start, start + len(chunk), device=DEVICE),
                                                  attn, pool, hidden_layer_ids=(0,))
                out += [target.compute_logits(hidden), captured[0]]
        results.append(out)
    for plain, *fused in zip(*results):
        for got in fused:
            torch.testing.assert_close(got, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(INTERPRETED or HAS_CUDA, reason="the kernel tests run in this process (interpreter or GPU)")
def test_cpu_interpreter_suite():
    """Re-run this file with ``TRITON_INTERPRET=1``, so the kernels are built for Triton's CPU interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-k", "not interpreter_suite", "-p", "no:cacheprovider", "-x"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    # every selected test ran there: passed, none skipped (a warning from the interpreter is fine)
    assert re.search(r"\b\d+ passed, \d+ deselected(, \d+ warnings?)? in\b", done.stdout), done.stdout[-3000:]


def test_fused_gemm_row_limit_follows_the_weight_size():
    """Small models (GEMM weights that stay in L2) use the fused GEMMs up to 512-token steps; large
    ones only up to 64 rows (each 16-row block rereads the weights from HBM), then cuBLAS."""
    from types import SimpleNamespace

    from specdec.target.kernels import FUSED_GEMM_MAX_TOKENS
    from specdec.target.llama import fused_gemm_max_tokens

    def layer(hidden, inter, dtype=torch.bfloat16):
        def w(*shape):
            return torch.empty(*shape, dtype=dtype, device="meta")

        return SimpleNamespace(w_qkv=w(hidden + hidden // 2, hidden), w_o=w(hidden, hidden),
                               w_gate_up=w(2 * inter, hidden), w_down=w(hidden, inter))

    assert fused_gemm_max_tokens(layer(576, 1536)) == FUSED_GEMM_MAX_TOKENS == 512  # SmolLM2-135M
    assert fused_gemm_max_tokens(layer(576, 1536, torch.float32)) == 512
    assert fused_gemm_max_tokens(layer(4096, 14336)) == 64  # Llama-3-8B
    assert fused_gemm_max_tokens(None) == 512
