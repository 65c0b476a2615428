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

from specdec.target.kernels import add_rms_norm_, rope_, rope_write_kv_, silu_mul  # noqa: E402
from specdec.target.llama import apply_rope, rms_norm  # noqa: E402

INTERPRETED = bool(triton.knobs.runtime.interpret)
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cpu" if INTERPRETED or not HAS_CUDA else "cuda"
needs_kernels = pytest.mark.skipif(not (INTERPRETED or HAS_CUDA),
                                   reason="no GPU; test_cpu_interpreter_suite runs these with TRITON_INTERPRET=1")
DTYPES = [torch.float32, torch.bfloat16]


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
    want_q = apply_rope(q.reshape(T, H, D).float(), c.float(), s.float())
    want_k = apply_rope(k.reshape(T, Hkv, D).float(), c.float(), s.float())
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


@needs_kernels
@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_fused_llama_forward_matches_the_plain_one(tmp_path, kv_dtype):
    """The whole decoder: fused kernels (GPU path) vs plain PyTorch, fp32, over a context + verify step,
    with a cache of the compute dtype (fused cache write) and an FP8 cache (attend writes)."""
    import transformers

    from specdec.attention.metadata import plan_step
    from specdec.kvcache import KVCacheManager, KVPool
    from specdec.target import load_target

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    target = load_target(tmp_path, device=DEVICE)
    results = []
    for fused in (False, True):
        target.fused = fused
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
    for plain, fused in zip(*results):
        torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(INTERPRETED or HAS_CUDA, reason="the kernel tests run in this process (interpreter or GPU)")
def test_cpu_interpreter_suite():
    """Re-run this file with ``TRITON_INTERPRET=1``, so the kernels are built for Triton's CPU interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-k", "not interpreter_suite", "-p", "no:cacheprovider", "-x"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert re.search(r"\b\d+ passed, \d+ deselected in\b", done.stdout), done.stdout[-3000:]
