"""FP8 context inputs: caller-quantized E4M3 K/V (and Q) give the same bits as the internal path."""

from __future__ import annotations

import pytest
import torch

from specdec.attention.fp8 import E4M3, FP8InputError, quantize_e4m3
from specdec.attention.metadata import plan_step
from specdec.attention.shapes import AttnShape
from specdec.kvcache import KVCacheManager

H, HKV, D, TPB = 8, 2, 32, 4
KV_SCALE, Q_SCALE = 0.05, 0.03


def _step(kv_dtype=E4M3, lens=(7, 5)):
    mgr = KVCacheManager(16, TPB)
    ctx, slots = [], []
    for i, n in enumerate(lens):
        mgr.allocate(i, n)
        ctx.append((n, n, tuple(mgr.page_table(i))))
        slots += mgr.slots(i, 0, n)
    dt = str(kv_dtype).removeprefix("torch.")
    shape_of = lambda phase, q, mixed: AttnShape(phase, "gqa", H, HKV, D, D, TPB, q, dt, "bfloat16")  # noqa: E731
    attn = plan_step(ctx, [], torch.tensor(slots), shape_of, TPB, requested="torch_ref")
    caches = [torch.zeros(16 * TPB, HKV, D, dtype=kv_dtype) for _ in range(2)]
    return attn, caches, sum(lens)


def _inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, h, D, generator=g).bfloat16() for h in (H, HKV, HKV))
    return q, k, v


def test_caller_quantized_kv_is_bit_identical_to_internal_path():
    attn, (kc1, vc1), n = _step()
    q, k, v = _inputs(n)
    internal = attn.attend(q, k, v, kc1, vc1, D ** -0.5, D, kv_scale=KV_SCALE)
    _, (kc2, vc2), _ = _step()
    caller = attn.attend(q, quantize_e4m3(k, KV_SCALE), quantize_e4m3(v, KV_SCALE), kc2, vc2, D ** -0.5, D,
                         kv_scale=KV_SCALE)
    assert torch.equal(internal, caller)
    assert torch.equal(kc1.view(torch.uint8), kc2.view(torch.uint8))
    assert torch.equal(vc1.view(torch.uint8), vc2.view(torch.uint8))
    # and it is FP8 attention: close to, but not the same as, bf16 attention
    _, (kb, vb), _ = _step(torch.bfloat16)
    exact = attn.attend(q, k, v, kb, vb, D ** -0.5, D)
    err = (internal.float() - exact.float()).abs()
    assert err.mean() < 0.05 and err.max() < 0.3  # E4M3 keeps 3 mantissa bits
    assert not torch.equal(internal, exact)


@pytest.mark.parametrize("kv_quantized", [True, False])
def test_fp8_q_with_scale_matches_internal_quantization(kv_quantized):
    attn, (kc1, vc1), n = _step()
    q, k, v = _inputs(n, seed=1)
    internal = attn.attend(q, k, v, kc1, vc1, D ** -0.5, D, kv_scale=KV_SCALE, q_scale=Q_SCALE)
    _, (kc2, vc2), _ = _step()
    if kv_quantized:
        k, v = quantize_e4m3(k, KV_SCALE), quantize_e4m3(v, KV_SCALE)
    caller = attn.attend(quantize_e4m3(q, Q_SCALE), k, v, kc2, vc2, D ** -0.5, D, kv_scale=KV_SCALE, q_scale=Q_SCALE)
    assert torch.equal(internal, caller)  # Q-only (kv_quantized=False) and Q+K+V


@pytest.mark.parametrize("which", ["k", "v"])
def test_kv_of_different_dtypes_is_a_typed_error(which):
    attn, (kc, vc), n = _step()
    q, k, v = _inputs(n)
    if which == "k":
        k = quantize_e4m3(k, KV_SCALE)
    else:
        v = quantize_e4m3(v, KV_SCALE)
    with pytest.raises(FP8InputError, match="K and V must both be E4M3"):
        attn.attend(q, k, v, kc, vc, D ** -0.5, D, kv_scale=KV_SCALE)
    assert not kc.view(torch.uint8).any()  # nothing was written


def test_fp8_inputs_need_an_fp8_cache_and_q_scale():
    attn, (kc, vc), n = _step(torch.bfloat16)
    q, k, v = _inputs(n)
    with pytest.raises(FP8InputError, match="E4M3 KV cache"):
        attn.attend(q, quantize_e4m3(k, KV_SCALE), quantize_e4m3(v, KV_SCALE), kc, vc, D ** -0.5, D)
    attn, (kc, vc), n = _step()
    with pytest.raises(FP8InputError, match="q_scale"):
        attn.attend(quantize_e4m3(q, Q_SCALE), k, v, kc, vc, D ** -0.5, D, kv_scale=KV_SCALE)
    with pytest.raises(FP8InputError, match="scale must be > 0"):
        quantize_e4m3(q, 0.0)


def test_bf16_inputs_keep_the_bf16_path():
    attn, (kc, vc), n = _step(torch.bfloat16)
    q, k, v = _inputs(n, seed=2)
    out = attn.attend(q, k, v, kc, vc, D ** -0.5, D)
    p = attn.phases[0]
    again = p.backend.run(p.plan, q, kc, vc, D ** -0.5, D)
    assert torch.equal(out, again) and kc.dtype == torch.bfloat16
    assert torch.equal(kc[attn.slot_mapping], k)  # stored unquantized
