"""The Triton paged MLA decode/verify backend against the torch reference.

Each kernel case builds requests over a pool whose unowned slots (and the tails
of last pages) hold NaN, with shuffled page tables longer than needed, runs
``triton_mla`` and compares every query row with ``torch_ref`` run in fp32 on
the same values (for an FP8 cache: on the dequantised cache).

Where the tests run:

- CPU: Triton chooses the interpreter when the kernels are *defined*
  (``TRITON_INTERPRET=1`` before ``specdec`` is imported), so
  ``test_cpu_suite_under_the_interpreter`` re-runs this file in a subprocess
  with that variable set. To see the cases one by one:
  ``TRITON_INTERPRET=1 python -m pytest tests/test_triton_mla.py``.
  Interpreter cases use small latent dims (32 + 16) except two 512 + 64 cases.
- GPU (``-m gpu``): the benchmark grid's shapes at real dims, bf16 and FP8.

``supports`` is tested against the kernel itself: every CPU shape of the
sweep it accepts runs and matches; the refusals give their reason, and the
kernel-limit refusals are shown to fail when forced.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("triton", reason="triton is not installed (pip extra 'gpu'): no triton_mla backend to test")

from specdec.attention import selector  # noqa: E402
import triton  # noqa: E402

from specdec.attention.backends import triton_interp, triton_mla  # noqa: E402
from specdec.attention.backends.base import PhaseBatch  # noqa: E402
from specdec.attention.backends.torch_ref import TorchRefBackend  # noqa: E402
from specdec.attention.backends.triton_mla import TritonMLABackend, TritonMLAConfig  # noqa: E402
from specdec.attention.metadata import plan_step  # noqa: E402
from specdec.attention.selector import select  # noqa: E402
from specdec.attention.shapes import AttnShape  # noqa: E402
from specdec.errors import ConfigError, UnsupportedShapeError  # noqa: E402
from specdec.parallel.helix import HelixLayout, HelixShard, combine_partials, plan_shard, shard_attention  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
INTERPRET = triton_mla.INTERPRET
needs_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="CPU kernel cases need TRITON_INTERPRET=1 at import (test_cpu_suite_under_the_interpreter)"
)
F32, BF16, FP8 = torch.float32, torch.bfloat16, torch.float8_e4m3fn
NAME = {F32: "float32", BF16: "bfloat16", FP8: "float8_e4m3fn", torch.float16: "float16"}
TOL = {F32: 2e-5, BF16: 2e-2}  # by query dtype; fp32 accumulation either way
FP8_NAN = 0x7F  # an E4M3FN NaN byte
UNPATCHED: dict[str, object] = {}  # the interpreter bugs present before the test fixes


# --------------------------------------------------------------------------- interpreter fixes (tests only)


@pytest.fixture(autouse=True, scope="module")
def _interpreter_fixes(fixed_triton_interpreter):
    """Triton 3.6's CPU interpreter has two bugs (not the kernels'): fixed for this module by the
    conftest fixture (``specdec.attention.backends.triton_interp``). Without the fixes ``supports``
    refuses the CPU shapes they would break (``test_supports_refuses_what_the_interpreter_breaks``)."""
    UNPATCHED.update(bugs=fixed_triton_interpreter)
    yield


# --------------------------------------------------------------------------- harness


def mla_cpu(**kw) -> AttnShape:
    """A small MLA generation shape on the CPU (latent 16 + rope 16)."""
    base = dict(phase="generation", kind="mla", num_heads=4, num_kv_heads=1, head_dim=32, v_head_dim=16,
                tokens_per_block=16, max_q_len=1, kv_dtype="float32", q_dtype="float32", device="cpu")
    return AttnShape(**{**base, **kw})


def mla_gpu(**kw) -> AttnShape:
    """A DeepSeek/Kimi absorbed-MLA generation shape on an H200."""
    base = dict(phase="generation", kind="mla", num_heads=96, num_kv_heads=1, head_dim=576, v_head_dim=512,
                tokens_per_block=64, max_q_len=4, kv_dtype="bfloat16", q_dtype="bfloat16", device="cuda", sm=90)
    return AttnShape(**{**base, **kw})


def make_pool(q_lens, kv_lens, *, tpb, d, kv_dtype, device, seed=0):
    """Requests over a paged latent cache; returns ``(batch, cache, dequantised fp32 cache, kv_scale)``.

    Page tables are shuffled and two pages longer than needed. Every slot that
    holds none of a request's first ``kv_len`` tokens is NaN (slot 0 excepted:
    the reference pads its gather with it), so a kernel that reads past a
    request's context or through a wrong page cannot pass.
    """
    g = torch.Generator().manual_seed(seed)
    pages = [math.ceil(kv / tpb) for kv in kv_lens]
    num_pages = sum(pages) + 2 * len(pages) + 3
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables, at = [], 0
    for n in pages:
        tables.append(tuple(perm[at : at + n + 2]))
        at += n + 2
    values = torch.randn(num_pages * tpb, 1, d, generator=g)
    valid = torch.zeros(num_pages * tpb, dtype=torch.bool)
    for kv, table in zip(kv_lens, tables):
        valid[[table[p // tpb] * tpb + p % tpb for p in range(kv)]] = True
    valid[0] = True
    kv_scale = 1.0
    if kv_dtype == FP8:
        kv_scale = float(values.abs().max()) / 448.0
        cache = (values / kv_scale).to(FP8)
        cache.view(torch.uint8)[~valid] = FP8_NAN
        deq = cache.float() * kv_scale
    else:
        cache = values.to(kv_dtype)
        cache[~valid] = float("nan")
        deq = cache.float()
    batch = PhaseBatch(tuple(q_lens), tuple(kv_lens), tuple(tables), tpb, torch.device(device))
    return batch, cache.to(device), deq.to(device), kv_scale


def run_case(h, q_lens, kv_lens, *, tpb, lat=32, rope=16, q_dtype=F32, kv_dtype=F32, config=None,
             device=None, seed=0, head_gain=None):
    """``triton_mla`` vs ``torch_ref`` (fp32, dequantised cache) on one generation phase."""
    device = device or ("cpu" if INTERPRET else "cuda")
    d = lat + rope
    batch, cache, deq, kv_scale = make_pool(q_lens, kv_lens, tpb=tpb, d=d, kv_dtype=kv_dtype, device=device,
                                            seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(q_lens), h, d, generator=g)
    if head_gain is not None:  # per-head magnitudes, e.g. beyond fp16's range or far below 1
        q = q * torch.tensor(head_gain, dtype=torch.float32).repeat(h)[:h, None]
    q = q.to(device=device, dtype=q_dtype)
    scale = d**-0.5 * 1.3  # explicit, not the default
    backend = TritonMLABackend(config or TritonMLAConfig())
    out = backend.run(backend.plan(batch), q, cache, None, scale, lat, kv_scale=kv_scale)
    ref_backend = TorchRefBackend()
    ref = ref_backend.run(ref_backend.plan(batch), q.float(), deq, None, scale, lat)
    assert out.shape == (sum(q_lens), h, lat) and out.dtype == q_dtype
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(out.float(), ref, atol=TOL[q_dtype], rtol=TOL[q_dtype])
    return backend


def shard_pool(batch, cache, layout, rank):
    """Rank ``rank``'s view of a pool from :func:`make_pool` under Helix: its page tables (logical
    page ``p`` of a request is the rank's local page ``p // cp`` when ``p % cp == rank``) and a copy
    of the cache where every slot outside those pages is NaN (slot 0 excepted, as in ``make_pool``)."""
    cp, tpb = layout.cp, layout.tokens_per_block
    tables = tuple(tuple(t[rank::cp][: -(-layout.local_length(kv, rank) // tpb)])
                   for kv, t in zip(batch.kv_lens, batch.page_tables))
    mine = torch.zeros(cache.shape[0], dtype=torch.bool, device=cache.device)
    for t in tables:
        for page in t:
            mine[page * tpb : (page + 1) * tpb] = True
    mine[0] = True
    local = cache.clone()
    if local.dtype == FP8:
        local.view(torch.uint8)[~mine] = FP8_NAN
    else:
        local[~mine] = float("nan")
    shard = HelixShard(layout, rank)
    return PhaseBatch(batch.q_lens, batch.kv_lens, tables, tpb, batch.device, shard), local


def run_sharded_case(h, q_lens, kv_lens, cp, *, tpb, lat=32, rope=16, q_dtype=F32, kv_dtype=F32, config=None,
                     device=None, seed=0):
    """Helix with ``cp`` shards simulated in one process, through the kernel's LSE output:

    - the unsharded kernel's output and LSE equal the torch reference's
      (:func:`~specdec.parallel.helix.shard_attention` over the whole, fp32, dequantised cache);
    - each shard's kernel partial and LSE equal the reference's over the same shard;
    - :func:`~specdec.parallel.helix.combine_partials` of the kernel's partials equals the
      unsharded kernel output and the reference over the whole cache.
    """
    device = device or ("cpu" if INTERPRET else "cuda")
    d = lat + rope
    batch, cache, deq, kv_scale = make_pool(q_lens, kv_lens, tpb=tpb, d=d, kv_dtype=kv_dtype, device=device,
                                            seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(q_lens), h, d, generator=g).to(device=device, dtype=q_dtype)
    scale = d**-0.5 * 1.3
    tol = dict(atol=TOL[q_dtype], rtol=TOL[q_dtype])
    backend = TritonMLABackend(config or TritonMLAConfig())

    def reference(b, c, layout, rank):  # fp32 over the dequantised cache
        p = plan_shard(b.q_lens, b.kv_lens, b.page_tables, layout, rank, device)
        return shard_attention(p, q.float(), c, scale, lat)  # [T, H, lat], [T, H]

    out, lse = backend.attend(backend.plan(batch), q, cache, scale, lat, kv_scale=kv_scale, return_lse=True)
    want, want_lse = reference(batch, deq, HelixLayout(1, tpb), 0)
    assert out.dtype == q_dtype and lse.shape == (sum(q_lens), h) and lse.dtype == F32
    assert torch.isfinite(want).all()
    torch.testing.assert_close(out.float(), want, **tol)
    torch.testing.assert_close(lse, want_lse, **tol)
    assert torch.equal(backend.attend(backend.plan(batch), q, cache, scale, lat, kv_scale=kv_scale), out)

    layout, outs, lses = HelixLayout(cp, tpb), [], []
    for rank in range(cp):
        local_batch, local = shard_pool(batch, cache, layout, rank)
        plan = backend.plan(local_batch)
        part, part_lse = backend.attend(plan, q, local, scale, lat, kv_scale=kv_scale, return_lse=True,
                                        out_dtype=F32)
        _, local_deq = shard_pool(batch, deq, layout, rank)
        ref_part, ref_lse = reference(local_batch, local_deq, layout, rank)
        what = f"rank {rank} of {cp}"
        assert torch.equal(torch.isneginf(part_lse), torch.isneginf(ref_lse)), what  # rows that see nothing here
        torch.testing.assert_close(part, ref_part, **tol, msg=lambda m: f"{what}: {m}")
        torch.testing.assert_close(part_lse, ref_lse, **tol, msg=lambda m: f"{what}: {m}")
        outs.append(part)
        lses.append(part_lse)
    got, got_lse = combine_partials(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_lse, want_lse, **tol)
    torch.testing.assert_close(got.to(q_dtype).float(), out.float(), **tol)
    return lses


def shape_of_case(h, q_lens, *, tpb, lat=32, rope=16, q_dtype=F32, kv_dtype=F32, device="cpu") -> AttnShape:
    sm = None
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        sm = major * 10 + minor
    return AttnShape("generation", "mla", h, 1, lat + rope, lat, tpb, max(q_lens), NAME[kv_dtype], NAME[q_dtype],
                     device, sm)


# --------------------------------------------------------------------------- supports / cost / plan (no kernel)


@pytest.mark.parametrize(("overrides", "reason"), [
    (dict(kind="gqa", num_kv_heads=8, head_dim=128, v_head_dim=128), "kind must be 'mla'"),
    (dict(phase="context", max_q_len=512), "phase must be 'generation'"),
    # 96 heads split across 4 ranks: accepted once the GPU Helix tests have passed on sm90.
    (dict(helix_cp=4), None if 90 in triton_mla.HELIX_VALIDATED_SM else "Helix on sm=90 not validated yet"),
    (dict(helix_cp=5), "divisible by helix_cp (5)"),
    (dict(max_q_len=17), "max_q_len must be <= 16"),
    (dict(head_dim=192, v_head_dim=128, tokens_per_block=32), None),  # accepted: latent 128 + rope 64
    (dict(head_dim=512, v_head_dim=512), "rope"),
    (dict(head_dim=512 + 128, v_head_dim=512), "rope"),
    (dict(head_dim=1024 + 64, v_head_dim=1024), "v_head_dim (latent) must be one of"),
    (dict(head_dim=40 + 16, v_head_dim=40), "v_head_dim (latent) must be one of"),
    (dict(tokens_per_block=8), "tokens_per_block must be one of"),
    (dict(tokens_per_block=256), "tokens_per_block must be one of"),
    (dict(q_dtype="float32"), "q_dtype must be one of ('bfloat16',) on the GPU"),
    (dict(q_dtype="float16"), "q_dtype must be one of"),
    (dict(kv_dtype="float32"), "kv_dtype must be one of ('bfloat16', 'float8_e4m3fn') on the GPU"),
    (dict(sm=100), "sm=100 not validated"),
    (dict(sm=80), "sm=80 not validated"),
    (dict(sm=None), "not validated"),
])
def test_supports_states_the_gpu_limits(overrides, reason):
    verdict = TritonMLABackend().supports(mla_gpu(**overrides))
    if INTERPRET:  # every cuda shape is refused when the kernels are interpreted
        assert not verdict.ok and verdict.reason
        return
    if reason is None:
        assert verdict.ok, verdict.reason
    else:
        assert not verdict.ok and reason in verdict.reason, verdict.reason


@pytest.mark.skipif(INTERPRET, reason="cuda shapes are refused under the interpreter (tested above)")
@pytest.mark.parametrize("h", [1, 16, 33, 48, 64, 65, 96, 127, 128, 160])
@pytest.mark.parametrize("max_q_len", [1, 2, 4, 8, 16])
@pytest.mark.parametrize(("tpb", "kv_dtype"), [(16, "bfloat16"), (32, "float8_e4m3fn"), (64, "bfloat16"),
                                               (128, "float8_e4m3fn")])
def test_auto_selects_it_for_every_head_count_on_the_h200(h, max_q_len, tpb, kv_dtype):
    """Reference 000/001: H = 96 verify went to a kernel that rejects 64 < H < 128. This one has no head limit."""
    shape = mla_gpu(num_heads=h, max_q_len=max_q_len, tokens_per_block=tpb, kv_dtype=kv_dtype, mixed=h % 2 == 0)
    assert TritonMLABackend().supports(shape).ok
    assert select(shape).name == "triton_mla"
    assert TritonMLABackend().cost(shape) < selector.get_backend("torch_ref").cost(shape)


@pytest.mark.skipif(INTERPRET, reason="cuda shapes are refused under the interpreter (tested above)")
@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("h", [16, 48, 96, 128])
@pytest.mark.parametrize("max_q_len", [1, 4])
def test_auto_selects_it_for_helix_on_the_h200(h, max_q_len, cp):
    """Reference 003: Helix MLA (48 heads, 64-token pages, FP8) fell to a fallback with no page-64
    kernel. Here the Helix shapes the kernel runs go to it, ahead of the Helix reference, once its
    Helix path is validated on the arch; until then the reference runs them and a request names why."""
    shape = mla_gpu(num_heads=h, max_q_len=max_q_len, tokens_per_block=64, kv_dtype="float8_e4m3fn", helix_cp=cp)
    assert TritonMLABackend().cost(shape) < selector.get_backend("helix_ref").cost(shape)
    if 90 in triton_mla.HELIX_VALIDATED_SM:
        assert TritonMLABackend().supports(shape).ok
        assert select(shape).name == "triton_mla"
    else:
        assert select(shape).name == "helix_ref"
        with pytest.raises(UnsupportedShapeError, match=r"'triton_mla'.*Helix on sm=90 not validated yet"):
            select(shape, requested="triton_mla")


def test_requested_is_refused_with_the_reason_never_replaced():
    shape = mla_gpu(sm=100)
    with pytest.raises(UnsupportedShapeError, match=r"'triton_mla'.*(sm=100 not validated|cpu only)"):
        select(shape, requested="triton_mla")
    assert select(shape).name == "torch_ref"
    helix = mla_gpu(sm=100, helix_cp=2)
    with pytest.raises(UnsupportedShapeError, match=r"'triton_mla'.*(sm=100 not validated|cpu only)"):
        select(helix, requested="triton_mla")
    assert select(helix).name == "helix_ref"  # never torch_ref: it would attend this rank's pages only
    uneven = mla_gpu(helix_cp=5)
    with pytest.raises(UnsupportedShapeError, match=r"'triton_mla'.*divisible by helix_cp"):
        select(uneven, requested="triton_mla")
    ctx = mla_gpu(phase="context", max_q_len=300)
    with pytest.raises(UnsupportedShapeError, match=r"'triton_mla'.*phase must be 'generation'"):
        select(ctx, requested="triton_mla")


def test_cpu_only_under_the_interpreter():
    verdict = TritonMLABackend().supports(mla_cpu())
    assert verdict.ok == INTERPRET, verdict.reason
    if not INTERPRET:
        assert "TRITON_INTERPRET=1" in verdict.reason
        with pytest.raises(UnsupportedShapeError, match="triton_mla.*device must be cuda"):
            select(mla_cpu(), requested="triton_mla")
    # Auto selection keeps the reference on the CPU: the interpreter is far slower.
    assert select(mla_cpu()).name == "torch_ref"


@pytest.mark.parametrize("bugs", [frozenset(), {triton_interp.LOOP_BOUNDS}, {triton_interp.BF16_DOT},
                                  {triton_interp.LOOP_BOUNDS, triton_interp.BF16_DOT}], ids=str)
def test_supports_refuses_what_the_interpreter_breaks(monkeypatch, bugs):
    """CPU shapes: every kernel loop has runtime bounds; only bf16 queries reach tl.dot in bf16."""
    monkeypatch.setattr(triton_interp, "interpreter_bugs", lambda: frozenset(bugs))
    monkeypatch.setattr(triton_mla, "INTERPRET", True)
    for q_dtype, kv_dtype in [("float32", "float32"), ("float32", "bfloat16"), ("float32", "float8_e4m3fn"),
                              ("bfloat16", "bfloat16"), ("bfloat16", "float8_e4m3fn")]:
        verdict = TritonMLABackend().supports(mla_cpu(q_dtype=q_dtype, kv_dtype=kv_dtype))
        broken = triton_interp.LOOP_BOUNDS in bugs or (q_dtype == "bfloat16" and triton_interp.BF16_DOT in bugs)
        assert verdict.ok == (not broken), (q_dtype, kv_dtype, verdict.reason)
        if triton_interp.LOOP_BOUNDS in bugs:
            assert "triton-lang/triton#9171" in verdict.reason
        elif broken:
            assert "triton-lang/triton#11584" in verdict.reason


def test_interpreter_probe_sees_the_bugs_and_the_fix():
    """The probe runs on the interpreter whatever TRITON_INTERPRET says; the fix removes what it finds."""
    import numpy
    from triton.runtime import interpreter

    assert triton_interp.interpreter_bugs() == frozenset()  # fixed for this module
    pristine = not getattr(interpreter, "_specdec_fixed", False)  # triton_gqa's own patch, if still present
    if pristine and triton.__version__.startswith("3.6") and tuple(map(int, numpy.__version__.split(".")[:2])) >= (2, 4):
        assert UNPATCHED["bugs"] == {triton_interp.LOOP_BOUNDS, triton_interp.BF16_DOT}
    triton_interp.unfix_interpreter()
    try:
        assert triton_interp.interpreter_bugs() == UNPATCHED["bugs"]
        if UNPATCHED["bugs"] and INTERPRET:
            assert not TritonMLABackend().supports(mla_cpu(q_dtype="bfloat16")).ok
    finally:
        triton_interp.fix_interpreter()
    assert triton_interp.interpreter_bugs() == frozenset()


def test_plan_builds_padded_int32_tables_once():
    tables = ((7, 3, 9, 1), (4,), (0, 2, 5))
    batch = PhaseBatch((1, 4, 2), (33, 16, 40), tables, 16, torch.device("cpu"))
    plan = TritonMLABackend(TritonMLAConfig(num_splits=3, block_n=16)).plan(batch)
    assert plan.page_table.dtype == torch.int32 and plan.page_table.tolist() == [[7, 3, 9], [4, 0, 0], [0, 2, 5]]
    assert plan.kv_lens.tolist() == [33, 16, 40] and plan.kv_lens.dtype == torch.int32
    assert plan.q_start.tolist() == [0, 1, 5] and plan.q_lens.tolist() == [1, 4, 2]
    assert (plan.num_seqs, plan.num_tokens, plan.max_q_len, plan.max_kv_len, plan.num_sms) == (3, 7, 4, 40, 1)
    launch = TritonMLABackend(TritonMLAConfig(num_splits=3, block_n=16)).launch_config(plan, 4)
    assert (launch.num_splits, launch.block_n, launch.block_m, launch.row_blocks) == (3, 16, 16, 1)
    with pytest.raises(ValueError, match="q_len=5, kv_len=4"):
        TritonMLABackend().plan(PhaseBatch((5,), (4,), ((0,),), 16, torch.device("cpu")))


def test_default_launch_follows_the_rows():
    plan = TritonMLABackend().plan(PhaseBatch((4,), (300,), ((0, 1, 2, 3, 4),), 64, torch.device("cpu")))
    backend = TritonMLABackend()
    assert backend.launch_config(plan, 4).block_m == 16  # 16 rows
    assert backend.launch_config(plan, 8).block_m == 32
    big = backend.launch_config(plan, 96)
    assert (big.block_m, big.row_blocks, big.block_n, big.num_warps) == (64, 6, 64, 8)
    assert backend.launch_config(plan, 96, kv_bytes=1, fp8_with_bf16_q=True).fp16_dots
    assert not TritonMLABackend(TritonMLAConfig(fp8_dots="bf16")).launch_config(
        plan, 96, kv_bytes=1, fp8_with_bf16_q=True).fp16_dots


def test_automatic_splits_minimise_the_makespan():
    # One request: split as far as min_split_tokens allows when the device has room.
    assert triton_mla.choose_splits(1, 1, 32768, 132, min_split_tokens=256, max_splits=64, block_n=64) == 64
    assert triton_mla.choose_splits(1, 1, 300, 132, min_split_tokens=256, max_splits=64, block_n=64) == 1
    # 64 requests on 264 slots: 4 splits fill one wave; 5 (the old 2-waves target) would need two.
    assert triton_mla.choose_splits(64, 1, 32768, 264, min_split_tokens=256, max_splits=64, block_n=64) == 4
    # Rows alone fill the device: no split.
    assert triton_mla.choose_splits(64, 8, 8192, 132, min_split_tokens=256, max_splits=64, block_n=64) in (1, 2)
    backend = TritonMLABackend(TritonMLAConfig(ctas_per_sm=64 // 64 * 8, min_split_tokens=256))
    long_one = backend.plan(PhaseBatch((1,), (32768,), (tuple(range(512)),), 64, torch.device("cpu")))
    assert backend.launch_config(long_one, 16).num_splits == 8  # 8 slots on the interpreter's "1 SM"
    assert triton_mla.resident_ctas(64, 64, 2, 2) == 1 and triton_mla.resident_ctas(16, 32, 2, 2) == 2


@pytest.mark.parametrize(("field", "value"), [("num_splits", 0), ("min_split_tokens", 0), ("max_splits", 0),
                                              ("ctas_per_sm", 0), ("block_m", 128), ("block_n", 8), ("num_warps", 3),
                                              ("num_stages", 0), ("fp8_dots", "fp32")])
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ConfigError, match=f"TritonMLAConfig.{field}"):
        TritonMLAConfig(**{field: value})


def test_a_separate_v_cache_is_an_error():
    batch = PhaseBatch((1,), (4,), ((0,),), 16, torch.device("cpu"))
    backend = TritonMLABackend()
    with pytest.raises(ValueError, match="v_cache must be None"):
        backend.run(backend.plan(batch), torch.zeros(1, 4, 48), torch.zeros(16, 1, 48), torch.zeros(16, 1, 32),
                    0.1, 32)


# --------------------------------------------------------------------------- kernel cases (interpreter)

KERNEL_CASES = {
    # id: (h, q_lens, kv_lens, kwargs)
    "h16-decode-p16": (16, (1, 1, 1), (1, 37, 70), dict(tpb=16)),
    "h16-verify-p16-split3": (16, (1, 2, 4), (37, 70, 5), dict(tpb=16, config=TritonMLAConfig(num_splits=3))),
    "h96-verify-p64-split2": (96, (4, 2, 1), (130, 64, 9), dict(tpb=64, config=TritonMLAConfig(num_splits=2))),
    "h96-decode-p16-bf16": (96, (1, 1), (50, 17), dict(tpb=16, q_dtype=BF16, kv_dtype=BF16)),
    "h16-verify-p64-bf16-fp8-split2": (16, (2, 4), (100, 40), dict(tpb=64, q_dtype=BF16, kv_dtype=FP8,
                                                                 config=TritonMLAConfig(num_splits=2))),
    "h16-verify-p16-fp8-split4": (16, (4,), (45,), dict(tpb=16, kv_dtype=FP8, config=TritonMLAConfig(num_splits=4))),
    "h96-verify-p64-bf16-fp8": (96, (2, 1, 2), (70, 3, 129), dict(tpb=64, q_dtype=BF16, kv_dtype=FP8,
                                                                 config=TritonMLAConfig(num_splits=2))),
    "h16-verify-p32-bf16kv-split2": (16, (2, 1), (20, 33), dict(tpb=32, kv_dtype=BF16,
                                                               config=TritonMLAConfig(num_splits=2))),
    "h96-verify-p32-blockm16": (96, (2,), (40,), dict(tpb=32, config=TritonMLAConfig(num_splits=2, block_m=16,
                                                                                        block_n=16))),
    "h16-auto-splits": (16, (1, 3), (70, 50), dict(tpb=16, config=TritonMLAConfig(ctas_per_sm=4, min_split_tokens=16))),
    "h16-tile-spans-pages": (16, (2, 1), (70, 33), dict(tpb=16, config=TritonMLAConfig(num_splits=2, block_n=64))),
    "h96-bf16-fp8-fp16dots-bn32-p16": (96, (2, 1), (50, 17), dict(tpb=16, q_dtype=BF16, kv_dtype=FP8,
                                                                   config=TritonMLAConfig(block_n=32, num_splits=2))),
    "h16-bf16-fp8-fp16dots-wide-range": (16, (2, 1), (40, 20), dict(tpb=16, q_dtype=BF16, kv_dtype=FP8,
                                                                     head_gain=(1.0, 2.0**16, 2.0**-12, 3e4))),
    "h16-bf16-fp8-bf16dots": (16, (2, 4), (100, 40), dict(tpb=32, q_dtype=BF16, kv_dtype=FP8,
                                                         config=TritonMLAConfig(fp8_dots="bf16", num_splits=2))),
    "real-576-bf16-split2": (16, (2, 1), (20, 5), dict(tpb=16, lat=512, rope=64, q_dtype=BF16, kv_dtype=BF16,
                                                       config=TritonMLAConfig(num_splits=2))),
    "real-576-fp8": (16, (1, 4), (9, 33), dict(tpb=64, lat=512, rope=64, kv_dtype=FP8)),
}


@needs_interpreter
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_matches_the_reference(case):
    h, q_lens, kv_lens, kw = KERNEL_CASES[case]
    shape_kw = {k: v for k, v in kw.items() if k in ("tpb", "lat", "rope", "q_dtype", "kv_dtype")}
    verdict = TritonMLABackend().supports(shape_of_case(h, q_lens, **shape_kw))
    assert verdict.ok, verdict.reason  # every tested shape is one supports claims
    run_case(h, q_lens, kv_lens, **kw)


# Helix shards simulated in one process: (h, q_lens, kv_lens, cp, kwargs). Requests shorter than a page
# (ranks > 0 own nothing), verify rows straddling a page boundary (their keys on two ranks), one split
# and several (splits of a rank's keys that no row sees), tiles spanning pages, bf16 and FP8 caches.
HELIX_CASES = {
    "cp2-decode-p16": (16, (1, 1, 1), (5, 37, 70), 2, dict(tpb=16)),
    "cp2-verify-p16-split3": (16, (4, 2, 1), (33, 17, 70), 2, dict(tpb=16, config=TritonMLAConfig(num_splits=3))),
    "cp4-verify-p16-bf16-fp8-split2": (8, (3, 1), (50, 20), 4, dict(tpb=16, q_dtype=BF16, kv_dtype=FP8,
                                                                      config=TritonMLAConfig(num_splits=2))),
    "cp3-verify-p32-tile-spans-pages": (6, (2, 4), (100, 34), 3, dict(tpb=32, config=TritonMLAConfig(
        num_splits=2, block_n=64))),
    "real-576-cp2-bf16-split2": (16, (2, 1), (40, 9), 2, dict(tpb=16, lat=512, rope=64, q_dtype=BF16,
                                                               kv_dtype=BF16, config=TritonMLAConfig(num_splits=2))),
}


@needs_interpreter
@pytest.mark.parametrize("case", list(HELIX_CASES))
def test_lse_and_helix_shards_match_the_reference(case):
    """The kernel's LSE equals the torch reference's; shards of the pages through the kernel, combined
    by LSE, equal the unsharded kernel and the reference."""
    h, q_lens, kv_lens, cp, kw = HELIX_CASES[case]
    shape_kw = {k: v for k, v in kw.items() if k in ("tpb", "lat", "rope", "q_dtype", "kv_dtype")}
    shape = dataclasses.replace(shape_of_case(h, q_lens, **shape_kw), helix_cp=cp)
    verdict = TritonMLABackend().supports(shape)
    assert verdict.ok, verdict.reason
    lses = run_sharded_case(h, q_lens, kv_lens, cp, **kw)
    if min(kv_lens) < kw["tpb"]:  # a request on one page: every other rank saw nothing of it
        assert all(torch.isneginf(lse).any() for lse in lses[1:])


def _helix_run_worker(rank: int, world: int, init_file: str) -> None:
    """One gloo rank: ``run`` on its shard (kernel partial, all-to-all by head, combine, gather)
    equals ``torch_ref`` over the whole cache, for every head."""
    torch.set_num_threads(1)
    triton_interp.fix_interpreter()  # a fresh process: the conftest fixture did not run here
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        lat, rope, tpb = 32, 16, 16
        for n, (h, q_lens, kv_lens) in enumerate([(8, (4, 1, 2), (33, 5, 70)), (16, (1,), (3,))]):
            batch, cache, deq, _ = make_pool(q_lens, kv_lens, tpb=tpb, d=lat + rope, kv_dtype=F32, device="cpu",
                                             seed=n)
            q = torch.randn(sum(q_lens), h, lat + rope, generator=torch.Generator().manual_seed(n))
            shape = AttnShape("generation", "mla", h, 1, lat + rope, lat, tpb, max(q_lens), helix_cp=world)
            backend = select(shape, requested="triton_mla")
            local_batch, local = shard_pool(batch, cache, HelixLayout(world, tpb), rank)
            out = backend.run(backend.plan(local_batch), q, local, None, 0.2, lat)
            ref = TorchRefBackend()
            want = ref.run(ref.plan(batch), q, deq, None, 0.2, lat)
            torch.testing.assert_close(out, want, atol=TOL[F32], rtol=TOL[F32], msg=lambda m: f"rank {rank}: {m}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@needs_interpreter
def test_helix_run_on_gloo_ranks_equals_the_unsharded_reference(tmp_path):
    """The whole Helix path of ``run`` on 2 gloo processes (~10 s, mostly process start-up)."""
    ctx = mp.start_processes(_helix_run_worker, args=(2, str(tmp_path / "store")), nprocs=2, join=False,
                             start_method="spawn")
    start = time.monotonic()
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() - start > 120:
                pytest.fail("2 gloo ranks did not finish within 120 s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.terminate()


def _kernel_like_partials(num_tokens: int, heads: int, splits: int, dv: int, device: str, seed: int):
    """Split partials as a split-KV kernel leaves them: finite where the split saw keys, and where it
    saw none ``lse = -inf`` over a partial never written (NaN, infinities, huge values); some rows
    see no key at all (a Helix rank's)."""
    g = torch.Generator().manual_seed(seed)
    rows = num_tokens * heads
    lse2 = torch.randn(rows, splits, generator=g).mul(20)
    o = torch.randn(rows, splits, dv, generator=g)
    empty = torch.rand(rows, splits, generator=g) < 0.3
    empty[torch.rand(rows, generator=g) < 0.15] = True  # whole rows
    junk = torch.tensor([math.nan, math.inf, -math.inf, 3e38])[torch.randint(0, 4, (rows, splits, dv), generator=g)]
    o = torch.where(empty[..., None], junk, o)
    lse2 = lse2.masked_fill(empty, -math.inf)
    return o.reshape(rows * splits, dv).to(device), lse2.reshape(-1).to(device)


def _check_merge(num_tokens, heads, splits, dv, out_dtype, device, seed):
    from specdec.attention.mla_pack import merge_partials

    o, lse2 = _kernel_like_partials(num_tokens, heads, splits, dv, device, seed)
    want, want_lse = merge_partials(o.view(-1, splits, dv).clone(), lse2.view(-1, splits), out_dtype)
    got, got_lse = triton_mla.merge_split_partials(o, lse2, num_tokens, heads, out_dtype)
    assert got.shape == (num_tokens, heads, dv) and got.dtype == out_dtype and got_lse.shape == (num_tokens, heads)
    tol = dict(rtol=1e-5, atol=1e-6) if out_dtype == F32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got.reshape(-1, dv).float().cpu(), want.float().cpu(), **tol)
    torch.testing.assert_close(got_lse.reshape(-1).cpu(), want_lse.cpu(), rtol=1e-5, atol=1e-5)  # -inf on -inf
    only, none = triton_mla.merge_split_partials(o, lse2, num_tokens, heads, out_dtype, with_lse=False)
    assert none is None and torch.equal(only, got)


@needs_interpreter
@pytest.mark.parametrize(("num_tokens", "heads", "splits", "dv", "out_dtype"),
                         [(1, 1, 1, 8, F32), (3, 5, 4, 16, F32), (2, 20, 7, 32, BF16), (4, 16, 2, 8, BF16)])
def test_the_merge_of_another_kernel_s_partials_equals_merge_partials(num_tokens, heads, splits, dv, out_dtype):
    """``merge_split_partials`` (``cute_mla``'s merge, one launch): ``merge_partials``'s result up to fp32
    rounding, whatever a split that saw no key left in its partial; rows with no key get 0 and -inf."""
    for seed in range(3):
        _check_merge(num_tokens, heads, splits, dv, out_dtype, "cpu", seed)


def test_the_merge_refuses_partials_that_do_not_fit():
    o, lse2 = torch.zeros(2 * 3 * 4, 8), torch.zeros(2 * 3 * 4)
    with pytest.raises(ValueError, match="rows of splits"):
        triton_mla.merge_split_partials(o, lse2[:-1], 2, 3, F32)
    with pytest.raises(ValueError, match="rows of splits"):
        triton_mla.merge_split_partials(o[:-1], lse2, 2, 3, F32)
    with pytest.raises(ValueError, match="power of two"):
        triton_mla.merge_split_partials(torch.zeros(24, 6), lse2, 2, 3, F32)
    with pytest.raises(ValueError, match="fp32"):
        triton_mla.merge_split_partials(o.to(BF16), lse2, 2, 3, F32)
    with pytest.raises(ValueError, match="contiguous"):
        triton_mla.merge_split_partials(torch.zeros(8, 24).t(), lse2, 2, 3, F32)
    out, lse = triton_mla.merge_split_partials(o[:0], lse2[:0], 0, 3, BF16)  # no tokens: nothing to merge
    assert out.shape == (0, 3, 8) and out.dtype == BF16 and lse.shape == (0, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU (and kernels built for it)")
@pytest.mark.parametrize("splits", [1, 4, 64])
def test_the_merge_of_another_kernel_s_partials_on_the_gpu(splits):
    """At cute_mla's widths: 512-wide values, 96 and 128 heads."""
    for heads, seed in ((96, 0), (128, 1)):
        _check_merge(8, heads, splits, 512, BF16, "cuda", seed)
        _check_merge(2, heads, splits, 512, F32, "cuda", seed + 2)


# One field of a small base shape changed at a time; ``ok`` is what supports must say.
SWEEP = [
    *[(dict(tokens_per_block=t), t in (16, 32, 64, 128)) for t in (8, 16, 32, 64, 128, 256)],
    *[(dict(max_q_len=q), q <= 16) for q in (1, 3, 8, 16, 17)],
    *[(dict(num_heads=h), True) for h in (1, 3, 33)],
    *[(dict(head_dim=lat + rope, v_head_dim=lat), ok) for lat, rope, ok in [
        (16, 16, True), (64, 32, True), (128, 64, True), (256, 16, True), (40, 16, False), (32, 8, False),
        (32, 128, False), (1024, 64, False)]],
    *[(dict(q_dtype=q, kv_dtype=kv), q in ("float32", "bfloat16") and kv != "float16")
      for q in ("float32", "bfloat16", "float16") for kv in ("float32", "bfloat16", "float8_e4m3fn", "float16")],
    (dict(mixed=True), True),
    (dict(helix_cp=2), True),
    (dict(helix_cp=4, max_q_len=3), True),
    (dict(helix_cp=3), False),  # 4 heads do not split across 3 ranks
    (dict(kind="gqa", num_kv_heads=4, head_dim=16), False),
    (dict(phase="context", max_q_len=4), False),
    (dict(device="cuda", sm=90), False),  # kernels built for the interpreter run on the CPU only
]
TORCH_DTYPE = {v: k for k, v in NAME.items()}


@needs_interpreter
@pytest.mark.parametrize(("overrides", "ok"), SWEEP, ids=[",".join(f"{k}={v}" for k, v in o.items()) for o, _ in SWEEP])
def test_every_claimed_cpu_shape_runs_and_matches(overrides, ok):
    shape = mla_cpu(**overrides)
    verdict = TritonMLABackend().supports(shape)
    assert verdict.ok == ok, verdict.reason
    if not ok:
        assert verdict.reason
        return
    q_lens = (shape.max_q_len, 1)
    kv_lens = (shape.max_q_len + 20, shape.max_q_len + 2)
    if shape.helix_cp > 1:
        run_sharded_case(shape.num_heads, q_lens, kv_lens, shape.helix_cp, tpb=shape.tokens_per_block,
                         config=TritonMLAConfig(num_splits=2))
        return
    run_case(shape.num_heads, q_lens, kv_lens, tpb=shape.tokens_per_block, lat=shape.v_head_dim,
             rope=shape.head_dim - shape.v_head_dim, q_dtype=TORCH_DTYPE[shape.q_dtype],
             kv_dtype=TORCH_DTYPE[shape.kv_dtype], config=TritonMLAConfig(num_splits=2))


@needs_interpreter
@pytest.mark.parametrize(("lat", "rope"), [(40, 16), (32, 24)])
def test_refused_head_dims_fail_in_the_kernel(lat, rope):
    """Non-power-of-two dims are kernel limits (tl.arange). Dims below 16 are refused for tl.dot's
    minimum on GPUs, which the interpreter does not enforce; above 512 + 64, for registers and shared memory."""
    batch, cache, _, _ = make_pool((1,), (20,), tpb=16, d=lat + rope, kv_dtype=F32, device="cpu")
    backend = TritonMLABackend()
    with pytest.raises(Exception, match="power of 2|power of two"):
        backend.run(backend.plan(batch), torch.randn(1, 4, lat + rope), cache, None, 0.1, lat)


@needs_interpreter
def test_plan_step_routes_a_verify_step_through_the_kernel():
    """Through ``plan_step`` + ``attend`` (which writes the step's latent rows first), requested by name."""
    tpb, h, lat, rope = 16, 16, 32, 16
    d = lat + rope
    q_lens, kv_lens = (3, 1), (21, 40)
    batch, cache, _, _ = make_pool(q_lens, kv_lens, tpb=tpb, d=d, kv_dtype=F32, device="cpu", seed=3)
    slots = [t[p // tpb] * tpb + p % tpb for q, kv, t in zip(q_lens, kv_lens, batch.page_tables)
             for p in range(kv - q, kv)]
    g = torch.Generator().manual_seed(4)
    q, new = torch.randn(4, h, d, generator=g), torch.randn(4, 1, d, generator=g)
    gen = [(ql, kv, t) for ql, kv, t in zip(q_lens, kv_lens, batch.page_tables)]

    def shape_of(phase, max_q_len, mixed):
        return AttnShape(phase, "mla", h, 1, d, lat, tpb, max_q_len, mixed=mixed)

    outs = {}
    for name in ("triton_mla", "torch_ref"):
        attn = plan_step([], gen, torch.tensor(slots), shape_of, tpb, requested=name)
        assert attn.backends == {"generation": name}
        outs[name] = attn.attend(q, new, None, cache.clone(), None, 0.2, lat)
    torch.testing.assert_close(outs["triton_mla"], outs["torch_ref"], atol=TOL[F32], rtol=TOL[F32])


# --------------------------------------------------------------------------- CPU: the interpreter suite


@pytest.mark.skipif(INTERPRET, reason="already running under the interpreter")
def test_cpu_suite_under_the_interpreter():  # ~20 s
    """Re-run this file with ``TRITON_INTERPRET=1``, so the kernels are built for Triton's CPU interpreter."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", __file__, "-o", "addopts=", "-q", "-m", "not gpu", "-p", "no:cacheprovider",
           "-x"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and " failed" not in done.stdout


def test_bench_smoke_runs_on_cpu(tmp_path):
    """``bench/mla_decode.py --smoke --sweep``: the benchmark's own logic (sweep, grid, checks, outputs), tiny
    shapes, under the interpreter."""
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "mla_decode.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, bench, "--smoke", "--sweep", "--out", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = (tmp_path / "grid.md").read_text()
    assert "| H | q_len |" in table and table.count("| 16 | 2 |") == 4 and "0 mismatches" in table
    grid = json.loads((tmp_path / "grid.json").read_text())
    assert len(grid["rows"]) == 4 and all(r["checked"] and r["splits"] == 2 for r in grid["rows"])
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    assert set(sweep["winners"]) == {f"{c}/{kv}" for c in ("rows<=32", "rows<=64", "rows>64") for kv in ("bf16", "fp8")}


# --------------------------------------------------------------------------- GPU

GPU_KV_LENS = (1000, 333, 2055)  # ragged, not page multiples; a few splits each


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRET, reason="needs a CUDA GPU (and kernels compiled for it, not interpreted)")
class TestGPU:
    """The benchmark grid's shapes at real dims (512 + 64), bf16 queries, bf16 and FP8 caches.

    This class is the gate for ``triton_mla.VALIDATED_SM``: it runs the kernel on
    whatever GPU is present, whether or not ``supports`` claims its arch yet.
    """

    @pytest.mark.parametrize("kv_dtype", [BF16, FP8], ids=["bf16", "fp8"])
    @pytest.mark.parametrize("tpb", [32, 64])
    @pytest.mark.parametrize("q_len", [1, 2, 4, 8])
    @pytest.mark.parametrize("h", [16, 48, 64, 96, 128])
    def test_grid_vs_reference(self, h, q_len, tpb, kv_dtype):
        q_lens = (q_len, max(1, q_len - 1), q_len)
        shape = shape_of_case(h, q_lens, tpb=tpb, lat=512, rope=64, q_dtype=BF16, kv_dtype=kv_dtype, device="cuda")
        verdict = TritonMLABackend().supports(shape)
        if shape.sm in triton_mla.VALIDATED_SM:
            assert verdict.ok, verdict.reason
        run_case(h, q_lens, GPU_KV_LENS, tpb=tpb, lat=512, rope=64, q_dtype=BF16, kv_dtype=kv_dtype, device="cuda",
                 seed=h + q_len)

    @pytest.mark.parametrize("kv_dtype", [BF16, FP8], ids=["bf16", "fp8"])
    @pytest.mark.parametrize(("splits", "block_m"), [(1, None), (7, None), (3, 16), (3, 32), (3, 64)])
    def test_forced_splits_and_row_blocks(self, kv_dtype, splits, block_m):
        run_case(96, (4, 1, 3), (4096, 17, 777), tpb=64, lat=512, rope=64, q_dtype=BF16, kv_dtype=kv_dtype,
                 config=TritonMLAConfig(num_splits=splits, block_m=block_m), device="cuda")

    @pytest.mark.parametrize("kv_dtype", [BF16, FP8], ids=["bf16", "fp8"])
    @pytest.mark.parametrize("cp", [2, 4])
    @pytest.mark.parametrize("q_len", [1, 4])
    @pytest.mark.parametrize("h", [48, 96])
    def test_helix_shards_combine_to_the_unsharded_result(self, h, q_len, cp, kv_dtype):
        """The kernel's LSE equals the reference's, and Helix shards simulated on one GPU, combined by
        LSE, equal the unsharded kernel and the reference (a request shorter than a page included)."""
        q_lens = (q_len, max(1, q_len - 1), q_len, 1)
        shape = shape_of_case(h, q_lens, tpb=64, lat=512, rope=64, q_dtype=BF16, kv_dtype=kv_dtype, device="cuda")
        verdict = TritonMLABackend().supports(dataclasses.replace(shape, helix_cp=cp))
        if shape.sm in triton_mla.HELIX_VALIDATED_SM:
            assert verdict.ok, verdict.reason
        run_sharded_case(h, q_lens, (*GPU_KV_LENS, 40), cp, tpb=64, lat=512, rope=64, q_dtype=BF16,
                         kv_dtype=kv_dtype, device="cuda", seed=h + q_len + cp)

    @pytest.mark.parametrize("splits", [1, 5])
    def test_helix_shards_with_forced_splits(self, splits):
        run_sharded_case(96, (4, 1, 3), (4096, 17, 777), 4, tpb=64, lat=512, rope=64, q_dtype=BF16, kv_dtype=FP8,
                         config=TritonMLAConfig(num_splits=splits), device="cuda")

    def test_long_single_request_and_large_batch(self):
        run_case(128, (1,), (32768,), tpb=64, lat=512, rope=64, q_dtype=BF16, kv_dtype=FP8, device="cuda")
        g = torch.Generator().manual_seed(0)
        kv = torch.randint(8, 3000, (64,), generator=g).tolist()
        run_case(16, (4,) * 64, tuple(kv), tpb=32, lat=512, rope=64, q_dtype=BF16, kv_dtype=BF16, device="cuda")
