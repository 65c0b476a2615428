"""The CuTe DSL MLA backend (``cute_mla``): host logic on the CPU, the kernel on an sm90 GPU.

CPU (always): ``supports`` verdicts and reasons (FP8 and Helix shapes included); the module
imports without ``nvidia-cutlass-dsl``; the kernel's decomposition (row blocks, splits, tiles,
causal bounds, page-tail zeroing, LSE merge) emulated in PyTorch
(:func:`~specdec.attention.mla_pack.emulate_blocks`) equals ``torch_ref`` over random batches
(hypothesis), with an FP8 E4M3 cache too, and under Helix equals the per-rank reference
(``shard_attention``, what ``helix_ref`` runs on each rank). The host side of a call:
``merge_splits`` equals ``merge_partials`` bit for bit (special values included) in fewer ops;
``launch_args`` reads every value from that call's tensors (nothing kept between calls) and
refuses misaligned buffers.

CPU with ``nvidia-cutlass-dsl`` installed (skipped otherwise): the kernel compiles for
``sm_90a`` without a GPU (bf16 and FP8 caches, with and without Helix page tables), with wgmma /
TMA / setmaxnreg (FP8: the e4m3 conversions) in its PTX, no spills reported by ptxas and shared
memory within an sm90 CTA's; the register-layout facts it relies on hold
(:func:`register_layout_problems`). The backend's pointer entry compiles to the PTX the previous
path's ``from_dlpack`` tensors compiled to; a ``PreparedLaunch`` marshals once and writes each
call's values in place, and its slots marshal to the same bytes as the DSL's own argument objects.

GPU (``-m gpu``, an sm90 GPU and the package): the kernel against ``torch_ref`` over the issue's
grid (H 16/48/64/96/128 x q_len 1/2/4/8 x pages 16/64/128, bf16, with LSE, forced splits), the
same for an FP8 cache, and Helix shards against the per-rank reference; the prepared launch bit
for bit against the previous calling path (``bench/cute_host.PreviousPath``). This class is the gate
for ``cute_mla.VALIDATED_SM`` (and ``FP8_VALIDATED_SM``, ``HELIX_VALIDATED_SM``)::

    PYTHONPATH=$PWD python -m pytest -m gpu tests/test_cute_mla.py -q
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.attention.backends import cute_mla
from specdec.attention.backends.base import PhaseBatch
from specdec.attention.backends.cute_mla import CuteMLABackend, kernel_config, merge_splits
from specdec.attention.backends.torch_ref import TorchRefBackend
from specdec.attention.mla_pack import (block_keys, choose_splits, emulate_blocks, merge_partials, owned_keys,
                                        row_blocks, split_chunk)
from specdec.attention.shapes import AttnShape
from specdec.parallel.helix import HelixLayout, HelixShard, combine_partials, plan_shard, shard_attention

HAS_CUTLASS = cute_mla.IMPORT_ERROR is None
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")  # bench/cute_host.py
HAS_CUDA = torch.cuda.is_available()
needs_cutlass = pytest.mark.skipif(not HAS_CUTLASS, reason=f"nvidia-cutlass-dsl not importable: {cute_mla.IMPORT_ERROR}")


def mla_gpu(**kw) -> AttnShape:
    base = dict(phase="generation", kind="mla", num_heads=96, num_kv_heads=1, head_dim=576, v_head_dim=512,
                tokens_per_block=64, max_q_len=2, kv_dtype="bfloat16", q_dtype="bfloat16", device="cuda", sm=90)
    return AttnShape(**{**base, **kw})


def make_pool(q_lens, kv_lens, *, tpb, d, dtype=torch.float32, device="cpu", seed=0):
    """Requests over a paged latent cache with shuffled page tables (two spare pages each); every slot
    outside a request's context, page tails included, is NaN (slot 0 excepted: the reference pads with it)."""
    g = torch.Generator().manual_seed(seed)
    pages = [math.ceil(kv / tpb) for kv in kv_lens]
    num_pages = sum(pages) + 2 * len(pages) + 3
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables, at = [], 0
    for n in pages:
        tables.append(tuple(perm[at: at + n + 2]))
        at += n + 2
    cache = torch.randn(num_pages * tpb, 1, d, generator=g)
    valid = torch.zeros(num_pages * tpb, dtype=torch.bool)
    for kv, table in zip(kv_lens, tables):
        valid[[table[p // tpb] * tpb + p % tpb for p in range(kv)]] = True
    valid[0] = True
    cache[~valid] = float("nan")
    batch = PhaseBatch(tuple(q_lens), tuple(kv_lens), tuple(tables), tpb, torch.device(device))
    return batch, cache.to(device=device, dtype=dtype)


FP8 = torch.float8_e4m3fn
# fp32-query FP8 cases: the cache is 3x a normal sample (values the dots sum reach ~10), and the
# emulation sums by tiles and splits where torch_ref sums once, so fp32 rounding of the two orders
# reaches a few 1e-5 absolute on outputs near 0 (2.4e-5 seen: h=16, q_lens [5, 1], tpb 16, seed 675)
FP8_TOL = dict(atol=5e-5, rtol=2e-5)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)  # its bf16-query cases (TOL[BF16]), FP8 included


def to_fp8(cache):
    """An FP8 E4M3 copy of a pool from :func:`make_pool` and its per-tensor scale (the largest finite
    value maps to 448; NaN slots stay NaN bytes)."""
    kv_scale = float(cache[torch.isfinite(cache)].abs().max()) / 448.0
    return (cache.float() / kv_scale).to(FP8), kv_scale


def shard_pool(batch, cache, layout, rank):
    """Rank ``rank``'s view of a pool under Helix: its page tables (logical page ``p`` of a request is
    the rank's local page ``p // cp`` when ``p % cp == rank``) and a copy of the cache where every slot
    outside those pages is NaN (slot 0 excepted, as in :func:`make_pool`)."""
    cp, tpb = layout.cp, layout.tokens_per_block
    tables = tuple(tuple(t[rank::cp][: -(-layout.local_length(kv, rank) // tpb)])
                   for kv, t in zip(batch.kv_lens, batch.page_tables))
    mine = torch.zeros(cache.shape[0], dtype=torch.bool)
    for t in tables:
        for page in t:
            mine[page * tpb: (page + 1) * tpb] = True
    mine[0] = True
    local = cache.clone()
    if local.dtype == FP8:
        local.view(torch.uint8)[~mine.to(local.device)] = 0x7F  # an E4M3FN NaN
    else:
        local[~mine.to(local.device)] = float("nan")
    return PhaseBatch(batch.q_lens, batch.kv_lens, tables, tpb, batch.device, HelixShard(layout, rank)), local


def reference(batch, q, cache, scale, lat, kv_scale=1.0):
    """torch_ref in fp32 (an FP8 cache dequantised by torch_ref itself)."""
    ref = TorchRefBackend()
    return ref.run(ref.plan(batch), q.float(), cache if cache.dtype == FP8 else cache.float(), None, scale, lat,
                   kv_scale=kv_scale)


def reference_lse(batch, q, cache, scale, kv_scale=1.0):
    """Natural-log LSE of each query row, fp32, gathered like torch_ref."""
    out = []
    start = 0
    tpb = batch.tokens_per_block
    cache = cache.float()  # exact for E4M3 (and no float8 indexing needed)
    for q_len, kv_len, table in zip(batch.q_lens, batch.kv_lens, batch.page_tables):
        slots = [table[p // tpb] * tpb + p % tpb for p in range(kv_len)]
        k = cache[slots, 0].float() * kv_scale  # [kv, D]
        s = torch.einsum("thd,kd->thk", q[start: start + q_len].float(), k) * scale
        pos = torch.arange(kv_len)
        mask = pos[None, :] <= (kv_len - q_len + torch.arange(q_len))[:, None]  # [q_len, kv]
        s = s.masked_fill(~mask[:, None, :], -math.inf)
        out.append(torch.logsumexp(s, dim=-1))
        start += q_len
    return torch.cat(out)


# --------------------------------------------------------------------------- supports (no kernel)


@pytest.mark.parametrize(("overrides", "reason"), [
    (dict(kind="gqa", num_kv_heads=8, head_dim=128, v_head_dim=128), "kind must be 'mla'"),
    (dict(phase="context", max_q_len=512), "phase must be 'generation'"),
    (dict(helix_cp=5), "num_heads (96) must be divisible by helix_cp (5)"),
    (dict(max_q_len=9), "max_q_len must be <= 8"),
    (dict(num_heads=160), "num_heads must be <= 128"),
    (dict(head_dim=192, v_head_dim=128), "only latent 512 + rope 64"),
    (dict(tokens_per_block=8), "tokens_per_block must be one of"),
    (dict(tokens_per_block=256), "tokens_per_block must be one of"),
    (dict(device="cpu", sm=None), "device must be cuda"),
    (dict(q_dtype="float32"), "q_dtype must be one of ('bfloat16',)"),
    (dict(kv_dtype="float32"), "kv_dtype must be one of ('bfloat16', 'float8_e4m3fn')"),
])
def test_supports_refuses_with_the_reason(overrides, reason):
    verdict = CuteMLABackend().supports(mla_gpu(**overrides))
    assert not verdict.ok and reason in verdict.reason, verdict.reason


@pytest.mark.parametrize("h", [16, 48, 64, 96, 128])
@pytest.mark.parametrize("q_len", [1, 2, 4, 8])
@pytest.mark.parametrize("tpb", [16, 32, 64, 128])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_supports_the_issue_grid_only_once_validated(h, q_len, tpb, kv_dtype):
    """Every in-scope shape is refused for exactly one reason until sm90 is validated: the missing
    package, or "not yet validated on SM90"; once validated, accepted."""
    shape = mla_gpu(num_heads=h, max_q_len=q_len, tokens_per_block=tpb, mixed=h % 2 == 0, kv_dtype=kv_dtype)
    verdict = CuteMLABackend().supports(shape)
    fp8 = kv_dtype == "float8_e4m3fn"
    if not HAS_CUTLASS:
        assert not verdict.ok and "nvidia-cutlass-dsl is not importable" in verdict.reason
    elif 90 in cute_mla.VALIDATED_SM and (not fp8 or 90 in cute_mla.FP8_VALIDATED_SM):
        assert verdict.ok, verdict.reason
    else:
        assert not verdict.ok and "not yet validated on SM90" in verdict.reason, verdict.reason


@pytest.mark.parametrize(("overrides", "fp8_sm", "helix_sm", "reason"), [
    (dict(), (), (), None),
    (dict(kv_dtype="float8_e4m3fn"), (), (), "the FP8 E4M3 cache is not yet validated on SM90"),
    (dict(kv_dtype="float8_e4m3fn"), (90,), (), None),
    (dict(kv_dtype="float8_e4m3fn", tokens_per_block=128, max_q_len=8, num_heads=128), (90,), (), None),
    (dict(helix_cp=4), (90,), (), "Helix (helix_cp=4) is not yet validated on SM90"),
    (dict(helix_cp=4), (), (90,), None),
    (dict(helix_cp=2, kv_dtype="float8_e4m3fn"), (), (90,), "the FP8 E4M3 cache is not yet validated"),
    (dict(helix_cp=2, kv_dtype="float8_e4m3fn"), (90,), (90,), None),
    (dict(helix_cp=5), (90,), (90,), "num_heads (96) must be divisible by helix_cp (5)"),
    (dict(helix_cp=4, kv_dtype="float8_e4m3fn", sm=100), (90,), (90,), "written for sm90"),
    (dict(kv_dtype="float8_e5m2"), (90,), (90,), "kv_dtype must be one of ('bfloat16', 'float8_e4m3fn')"),
])
def test_fp8_and_helix_verdicts_once_sm90_is_validated(monkeypatch, overrides, fp8_sm, helix_sm, reason):
    """With the package importable and bf16 validated on sm90, FP8 caches and Helix page tables are
    each admitted by their own gate, and refused for their own reason until then."""
    monkeypatch.setattr(cute_mla, "IMPORT_ERROR", None)
    monkeypatch.setattr(cute_mla, "VALIDATED_SM", (90,))
    monkeypatch.setattr(cute_mla, "FP8_VALIDATED_SM", fp8_sm)
    monkeypatch.setattr(cute_mla, "HELIX_VALIDATED_SM", helix_sm)
    verdict = CuteMLABackend().supports(mla_gpu(**overrides))
    if reason is None:
        assert verdict.ok, verdict.reason
    else:
        assert not verdict.ok and reason in verdict.reason, verdict.reason


def test_until_sm90_is_validated_fp8_and_helix_are_refused_for_that_alone(monkeypatch):
    monkeypatch.setattr(cute_mla, "IMPORT_ERROR", None)
    monkeypatch.setattr(cute_mla, "VALIDATED_SM", ())
    monkeypatch.setattr(cute_mla, "FP8_VALIDATED_SM", (90,))
    monkeypatch.setattr(cute_mla, "HELIX_VALIDATED_SM", (90,))
    for shape in (mla_gpu(kv_dtype="float8_e4m3fn"), mla_gpu(helix_cp=2), mla_gpu(helix_cp=8, num_heads=128)):
        verdict = CuteMLABackend().supports(shape)
        assert not verdict.ok and "not yet validated on SM90 (gate: tests/test_cute_mla.py::TestGPU;" in verdict.reason


@pytest.mark.parametrize("sm", [80, 89, 100, 120, None])
def test_other_archs_are_refused(sm):
    verdict = CuteMLABackend().supports(mla_gpu(sm=sm))
    assert not verdict.ok and verdict.reason


def test_the_validation_gate_is_what_admits_sm90(monkeypatch):
    """With the package importable, VALIDATED_SM alone decides sm90 (the selector never sees it before)."""
    monkeypatch.setattr(cute_mla, "IMPORT_ERROR", None)
    monkeypatch.setattr(cute_mla, "VALIDATED_SM", ())
    assert "not yet validated on SM90" in CuteMLABackend().supports(mla_gpu()).reason
    monkeypatch.setattr(cute_mla, "VALIDATED_SM", (90,))
    assert CuteMLABackend().supports(mla_gpu()).ok


def test_cost_ranks_it_behind_triton_until_measured(monkeypatch):
    backend = CuteMLABackend()
    assert backend.cost(mla_gpu()) > 10.0  # triton_mla's GPU cost
    assert backend.cost(mla_gpu()) < 100.0  # torch_ref's
    monkeypatch.setattr(cute_mla, "MEASURED_FASTER", frozenset({("bfloat16", 2)}))
    assert backend.cost(mla_gpu()) < 10.0
    assert backend.cost(mla_gpu(max_q_len=4)) > 10.0


def test_the_module_imports_and_refuses_without_the_package():
    """A fresh interpreter where ``cutlass`` cannot be imported: the backend module imports, every
    shape is refused with the reason, and attend says what is missing."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'cutlass' or name.startswith('cutlass.'):\n"
        "            raise ImportError('blocked for the test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from specdec.attention.backends import cute_mla\n"
        "from specdec.attention.shapes import AttnShape\n"
        "assert cute_mla.IMPORT_ERROR and 'blocked' in cute_mla.IMPORT_ERROR, cute_mla.IMPORT_ERROR\n"
        "s = AttnShape('generation', 'mla', 96, 1, 576, 512, 64, 2, 'bfloat16', 'bfloat16', 'cuda', 90)\n"
        "v = cute_mla.CuteMLABackend().supports(s)\n"
        "assert not v.ok and 'nvidia-cutlass-dsl is not importable' in v.reason, v.reason\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


# --------------------------------------------------------------------------- the decomposition, on the CPU


def test_row_blocks_pad_only_to_tile_granularity():
    assert row_blocks(2, 96) == 3  # 192 rows: three full blocks of 64
    assert row_blocks(1, 16) == 1 and row_blocks(8, 128) == 16 and row_blocks(1, 96) == 2


@given(kv_len=st.integers(1, 5000), splits=st.integers(1, 64), block_n=st.sampled_from([16, 32, 64]))
def test_splits_cover_every_key_once_in_whole_tiles(kv_len, splits, block_n):
    chunk = split_chunk(kv_len, splits, block_n)
    assert chunk % block_n == 0 and chunk * splits >= kv_len
    covered = []
    for s in range(splits):
        k = block_keys(1, kv_len, 1, 0, s, splits, block_n)
        covered += list(range(k.lo, k.hi))
        assert k.n_tiles * block_n >= k.hi - k.lo >= (k.n_tiles - 1) * block_n if k.n_tiles else k.hi <= k.lo
    assert covered == list(range(kv_len))


@given(q_len=st.integers(1, 8), h=st.integers(1, 130), kv_extra=st.integers(0, 300), mblk=st.integers(0, 20))
def test_a_row_block_reads_every_key_its_rows_see(q_len, h, kv_extra, mblk):
    kv_len = q_len + kv_extra
    if mblk >= row_blocks(q_len, h):
        return
    k = block_keys(q_len, kv_len, h, mblk, 0, 1, 64)
    last_row = min(mblk * 64 + 63, q_len * h - 1)
    assert k.lo == 0 and k.hi == kv_len - q_len + last_row // h + 1  # exactly the last row's causal bound


@given(n_ctas=st.integers(1, 2048), kv=st.integers(1, 70000), sms=st.sampled_from([1, 78, 132]))
def test_choose_splits_stays_in_range(n_ctas, kv, sms):
    s = choose_splits(n_ctas, kv, sms, block_n=64)
    assert 1 <= s <= max(1, min(64, kv // 256))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), splits=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_merge_of_split_partials_equals_attention_over_the_whole(rows, splits, seed):
    """Scores of ``rows`` rows over random keys, cut into ``splits`` parts (some empty): merging the
    per-part softmax outputs by their log2 LSE equals softmax over all keys; rows with no key give 0, -inf."""
    g = torch.Generator().manual_seed(seed)
    n_keys = int(torch.randint(0, 50, (1,), generator=g))
    s = torch.randn(rows, n_keys, generator=g, dtype=torch.float64) * 3
    v = torch.randn(n_keys, 8, generator=g, dtype=torch.float64)
    cuts = sorted(torch.randint(0, n_keys + 1, (splits - 1,), generator=g).tolist())
    bounds = [0, *cuts, n_keys]
    o_part = torch.zeros(rows, splits, 8, dtype=torch.float32)
    lse2 = torch.full((rows, splits), -math.inf, dtype=torch.float32)
    for i in range(splits):
        a, b = bounds[i], bounds[i + 1]
        if b > a:
            o_part[:, i] = torch.softmax(s[:, a:b], dim=1).float() @ v[a:b].float()
            lse2[:, i] = (torch.logsumexp(s[:, a:b], dim=1) / math.log(2)).float()
    out, lse = merge_partials(o_part, lse2, torch.float32)
    if n_keys == 0:
        assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
        return
    torch.testing.assert_close(out, (torch.softmax(s, dim=1) @ v).float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(s, dim=1).float(), atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    h=st.sampled_from([1, 3, 16, 24, 40]),
    q_lens=st.lists(st.integers(1, 8), min_size=1, max_size=3),
    extra=st.lists(st.integers(0, 90), min_size=3, max_size=3),
    tpb=st.sampled_from([16, 32, 64, 128]),
    splits=st.integers(1, 5),
    seed=st.integers(0, 1000),
)
def test_the_kernel_decomposition_equals_the_reference(h, q_lens, extra, tpb, splits, seed):
    """Row blocks of 64, ``block_n = min(64, page)``, forced splits, zeroed page tails, merged by LSE:
    the emulated kernel equals torch_ref (fp32, NaN everywhere outside the contexts), LSE included."""
    kv_lens = [q + e for q, e in zip(q_lens, extra)]
    lat, rope = 32, 16
    batch, cache = make_pool(q_lens, kv_lens, tpb=tpb, d=lat + rope, seed=seed)
    q = torch.randn(sum(q_lens), h, lat + rope, generator=torch.Generator().manual_seed(seed + 1))
    scale = (lat + rope) ** -0.5 * 1.3
    block_n = kernel_config(tpb)[0]
    o_part, lse2 = emulate_blocks(q, cache, batch.page_tables, q_lens, kv_lens, tokens_per_block=tpb, scale=scale,
                                  v_head_dim=lat, num_splits=splits, block_n=block_n)
    out, lse = merge_partials(o_part, lse2, torch.float32)
    want = reference(batch, q, cache, scale, lat)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(out.view(-1, h, lat), want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, reference_lse(batch, q, cache, scale).reshape(-1), atol=2e-5, rtol=2e-5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    h=st.sampled_from([1, 3, 16, 40]),
    q_lens=st.lists(st.integers(1, 8), min_size=1, max_size=3),
    extra=st.lists(st.integers(0, 90), min_size=3, max_size=3),
    tpb=st.sampled_from([16, 32, 64, 128]),
    splits=st.integers(1, 5),
    bf16=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_the_fp8_decomposition_equals_the_reference(h, q_lens, extra, tpb, splits, bf16, seed):
    """An FP8 E4M3 cache (NaN bytes outside the contexts) read as the kernel does: tiles of
    ``min(32, page)`` keys, e4m3 values unscaled in the dots, ``kv_scale`` folded into the score
    scale and the output. fp32 queries equal torch_ref's FP8 result at test_triton_mla's fp32
    tolerance; bf16 queries with P rounded to bf16 (the kernel's numerics) at its bf16 tolerance."""
    kv_lens = [q + e for q, e in zip(q_lens, extra)]
    lat, rope = 32, 16
    batch, cache = make_pool(q_lens, kv_lens, tpb=tpb, d=lat + rope, seed=seed)
    cache, kv_scale = to_fp8(cache * 3.0)
    q = torch.randn(sum(q_lens), h, lat + rope, generator=torch.Generator().manual_seed(seed + 1))
    if bf16:
        q = q.bfloat16().float()
    scale = (lat + rope) ** -0.5 * 1.3
    block_n = kernel_config(tpb, fp8=True)[0]
    o_part, lse2 = emulate_blocks(q, cache, batch.page_tables, q_lens, kv_lens, tokens_per_block=tpb, scale=scale,
                                  v_head_dim=lat, num_splits=splits, block_n=block_n, kv_scale=kv_scale,
                                  p_dtype=torch.bfloat16 if bf16 else None)
    out, lse = merge_partials(o_part, lse2, torch.float32)
    want = reference(batch, q, cache, scale, lat, kv_scale)
    assert torch.isfinite(want).all()
    tol = BF16_TOL if bf16 else FP8_TOL
    torch.testing.assert_close(out.view(-1, h, lat), want, **tol)
    torch.testing.assert_close(lse, reference_lse(batch, q, cache, scale, kv_scale).reshape(-1), **tol)


@given(n=st.integers(0, 3000), cp=st.integers(1, 5), tpb=st.sampled_from([16, 32, 64, 128]), data=st.data())
def test_owned_keys_is_the_layouts_local_length(n, cp, tpb, data):
    rank = data.draw(st.integers(0, cp - 1))
    assert owned_keys(n, cp, rank, tpb) == HelixLayout(cp, tpb).local_length(n, rank)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    h=st.sampled_from([4, 16, 40]),
    q_lens=st.lists(st.integers(1, 8), min_size=1, max_size=3),
    extra=st.lists(st.integers(0, 150), min_size=3, max_size=3),
    tpb=st.sampled_from([16, 32, 64]),
    cp=st.integers(2, 4),
    splits=st.integers(1, 4),
    fp8=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_the_helix_decomposition_equals_the_per_rank_reference(h, q_lens, extra, tpb, cp, splits, fp8, seed):
    """Helix: each rank's page tables (its pages only, the rest of its cache NaN) through the
    emulated kernel equal ``shard_attention`` (what helix_ref runs on each rank), output and LSE,
    including rows that see none of the rank's keys (0, -inf); the ranks' partials combined by LSE
    equal torch_ref over the whole cache."""
    kv_lens = [q + e for q, e in zip(q_lens, extra)]
    lat, rope = 32, 16
    batch, cache = make_pool(q_lens, kv_lens, tpb=tpb, d=lat + rope, seed=seed)
    kv_scale = 1.0
    if fp8:
        cache, kv_scale = to_fp8(cache)
    q = torch.randn(sum(q_lens), h, lat + rope, generator=torch.Generator().manual_seed(seed + 1))
    scale = (lat + rope) ** -0.5 * 1.3
    block_n = kernel_config(tpb, fp8=fp8)[0]
    layout, outs, lses = HelixLayout(cp, tpb), [], []
    for rank in range(cp):
        local_batch, local = shard_pool(batch, cache, layout, rank)
        o_part, lse2 = emulate_blocks(q, local, local_batch.page_tables, q_lens, kv_lens, tokens_per_block=tpb,
                                      scale=scale, v_head_dim=lat, num_splits=splits, block_n=block_n,
                                      kv_scale=kv_scale, cp=cp, rank=rank)
        out, lse = merge_partials(o_part, lse2, torch.float32)
        out, lse = out.view(-1, h, lat), lse.view(-1, h)
        plan = plan_shard(q_lens, kv_lens, local_batch.page_tables, layout, rank)
        want, want_lse = shard_attention(plan, q, local, scale, lat, kv_scale)
        what = f"rank {rank} of {cp}"
        assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse)), what
        torch.testing.assert_close(out, want, **FP8_TOL, msg=lambda m: f"{what}: {m}")
        torch.testing.assert_close(lse, want_lse, **FP8_TOL, msg=lambda m: f"{what}: {m}")
        outs.append(out)
        lses.append(lse)
    got, got_lse = combine_partials(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(got, reference(batch, q, cache, scale, lat, kv_scale), **FP8_TOL)
    want_lse = reference_lse(batch, q, cache, scale, kv_scale).reshape(-1)
    torch.testing.assert_close(got_lse.reshape(-1), want_lse, **FP8_TOL)


def test_helix_plans_hold_the_ranks_pages_and_split_its_keys():
    """plan() under Helix: the rank's own page tables, global kv_lens, ``max_kv_len`` the most keys
    one request has on this rank (what the splits cut); a mismatched layout page size is refused."""
    batch, _ = make_pool([2, 1], [150, 40], tpb=32, d=48)
    local_batch, _ = shard_pool(batch, torch.zeros(1), HelixLayout(2, 32), 1)
    plan = CuteMLABackend().plan(local_batch)
    assert plan.shard is local_batch.shard and plan.kv_lens.tolist() == [150, 40]
    assert plan.max_kv_len == max(HelixLayout(2, 32).local_length(n, 1) for n in (150, 40)) == 64
    assert plan.page_table.tolist() == [list(local_batch.page_tables[0][:2]), [local_batch.page_tables[1][0], 0]]
    bad = dataclasses.replace(local_batch, shard=HelixShard(HelixLayout(2, 64), 1))
    with pytest.raises(ValueError, match="pages hold 64 tokens"):
        CuteMLABackend().plan(bad)


@pytest.mark.parametrize("tpb", [16, 32, 64, 128])
@pytest.mark.parametrize("fp8", [False, True])
def test_kernel_config_fits_the_shared_memory_and_the_converters(tpb, fp8):
    """Q (72 KB) + the bf16 ring + (FP8) the e4m3 staging ring stay within an sm90 CTA's 227 KB; FP8
    tiles of ``min(32, page)`` keys, whose 8-value chunks split evenly over the 96 converter threads."""
    block_n, stages, fp8_stages = kernel_config(tpb, fp8=fp8)
    assert tpb % block_n == 0 and block_n == min(32 if fp8 else 64, tpb)
    assert (fp8_stages > 0) == fp8 and (block_n * 576 // 8) % 96 == 0
    q_bytes, ring, staging = 64 * 576 * 2, stages * block_n * 576 * 2, fp8_stages * block_n * 576
    assert q_bytes + ring + staging + 1024 <= cute_mla.SMEM_LIMIT
    assert stages * block_n >= 64 and (not fp8 or fp8_stages * block_n >= 128)  # keys in flight


def test_without_the_tail_zeroing_nan_leaks():
    """The zeroing of a page's tail is what keeps NaN out: skip it (read the raw tile) and the
    emulation fails, so the test above can fail."""
    batch, cache = make_pool([1], [20], tpb=32, d=48, seed=1)
    q = torch.randn(1, 4, 48)
    p = batch.page_tables[0][0]
    tile = cache[p * 32: p * 32 + 32, 0]
    s = torch.softmax(torch.where(torch.arange(32) < 20, q[0] @ tile.T, -math.inf), dim=1)
    assert torch.isnan(s @ tile[:, :32]).all()  # 0 * NaN in P V


# --------------------------------------------------------------------------- the host side of a call, on the CPU

# MLADecodeKernel.launch's arguments, in order (_cute_mla_kernel.LAUNCH_ARGS, checked below where the DSL is installed)
LAUNCH_NAMES = ("q", "kv", "o_part", "lse_part", "page_table", "kv_lens", "q_start", "q_lens", "num_rows", "num_slots",
                "num_parts", "num_seqs", "max_pages", "page_stride", "scale_log2", "v_scale", "num_heads",
                "num_splits", "row_blocks", "cp", "rank", "stream")


def float_bits(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ``t`` is NaN, and the bits of every other value (signed zeros told apart)."""
    nan = torch.isnan(t)
    return nan, t.masked_fill(nan, 0).view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    (got_nan, got_bits), (want_nan, want_bits) = float_bits(got), float_bits(want)
    assert torch.equal(got_nan, want_nan) and torch.equal(got_bits, want_bits)


@settings(max_examples=150, deadline=None)
@given(rows=st.integers(1, 12), splits=st.integers(1, 9), dv=st.sampled_from([1, 5, 16]),
       empty=st.floats(0.0, 0.6), bad=st.floats(0.0, 0.2), bf16=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_merge_splits_equals_merge_partials_bit_for_bit(rows, splits, dv, empty, bad, bf16, seed):
    """Splits that saw no key (``-inf``), rows none of whose splits did, non-finite partials and LSEs
    (NaN, +-inf: what a NaN or infinite input makes), signed zeros: every value, LSE included, has the
    same bits as ``merge_partials``'s (NaN where it has NaN); without the LSE the output is the same."""
    g = torch.Generator().manual_seed(seed)
    lse2 = torch.randn(rows, splits, generator=g, dtype=torch.float64).mul(30).float()
    o = torch.randn(rows, splits, dv, generator=g)
    lse2[torch.rand(rows, splits, generator=g) < empty] = -math.inf
    lse2[torch.rand(rows, generator=g) < empty / 3] = -math.inf  # whole rows
    specials = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 0.0])
    pick = torch.randint(0, len(specials), (rows, splits), generator=g)
    lse2 = torch.where(torch.rand(rows, splits, generator=g) < bad / 4, specials[pick], lse2)
    pick = torch.randint(0, len(specials), (rows, splits, dv), generator=g)
    o = torch.where(torch.rand(rows, splits, dv, generator=g) < bad, specials[pick], o)
    out_dtype = torch.bfloat16 if bf16 else torch.float32
    want, want_lse = merge_partials(o.clone(), lse2.clone(), out_dtype)
    got, got_lse = merge_splits(o.clone(), lse2.clone(), out_dtype)
    assert_same_bits(got, want)
    assert_same_bits(got_lse, want_lse)
    only, none = merge_splits(o.clone(), lse2.clone(), out_dtype, with_lse=False)
    assert_same_bits(only, want)
    assert none is None


def test_the_merge_is_fused_or_torch_s_and_nothing_else():
    assert CuteMLABackend().merge == "fused" and CuteMLABackend(merge="torch").merge == "torch"
    with pytest.raises(ValueError, match="merge must be one of"):
        CuteMLABackend(merge="tensor")


def test_merge_splits_runs_fewer_ops():
    """The torch ops each merge dispatches (views and allocations left out): 10 for the output, 13 with
    the LSE, where merge_partials runs 20 (each one a kernel launch on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view and func.overloadpacket is not torch.ops.aten.empty:
                self.names.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    o, lse2 = torch.randn(8, 3, 16), torch.randn(8, 3)
    counts = []
    for merge, kw in ((merge_partials, {}), (merge_splits, {}), (merge_splits, dict(with_lse=False))):
        o_in, lse_in = o.clone(), lse2.clone()
        with Ops() as ops:
            merge(o_in, lse_in, torch.bfloat16, **kw)
        counts.append(len(ops.names))
    assert counts == [20, 13, 10], counts


def launch_buffers(plan, h, splits, kv_dtype=torch.bfloat16, slots=300):
    """What ``attend`` hands ``_launch``: the packed queries, the cache's rows, the split partials."""
    n_rows = plan.num_tokens * h
    return (torch.empty(n_rows, 576, dtype=torch.bfloat16), torch.empty(slots, 576, dtype=kv_dtype),
            torch.empty(n_rows * splits, 512), torch.empty(n_rows * splits))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(q_lens=st.lists(st.integers(1, 8), min_size=1, max_size=5), extra=st.lists(st.integers(0, 300), min_size=5,
       max_size=5), tpb=st.sampled_from([16, 32, 64, 128]), h=st.integers(1, 128), splits=st.integers(1, 9),
       cp=st.sampled_from([1, 2, 4]), fp8=st.booleans(), pad=st.integers(0, 5), data=st.data())
def test_launch_args_are_read_from_each_calls_tensors(q_lens, extra, tpb, h, splits, cp, fp8, pad, data):
    """Every value ``_launch`` passes is read from that call's tensors and plan: addresses, row counts,
    the page table's width and row stride (a padded table too), Helix rank; a second call with other
    buffers and another plan reads those (nothing is kept from the first)."""
    kv_lens = [q + e for q, e in zip(q_lens, extra)]
    batch, cache = make_pool(q_lens, kv_lens, tpb=tpb, d=4)
    rank = data.draw(st.integers(0, cp - 1))
    if cp > 1:
        batch, _ = shard_pool(batch, cache, HelixLayout(cp, tpb), rank)
    plan = CuteMLABackend().plan(batch)
    if pad:  # the table as a view of a wider one: rows pad + max_pages apart
        wide = torch.zeros(plan.num_seqs, plan.page_table.shape[1] + pad, dtype=torch.int32)
        wide[:, :plan.page_table.shape[1]] = plan.page_table
        plan = dataclasses.replace(plan, page_table=wide[:, :plan.page_table.shape[1]])
    calls = []
    for p in (plan, CuteMLABackend().plan(make_pool([1], [5], tpb=tpb, d=4)[0])):
        bufs = launch_buffers(p, h, splits, FP8 if fp8 else torch.bfloat16)
        grid_m = row_blocks(p.max_q_len, h)
        args = dict(zip(LAUNCH_NAMES, cute_mla.launch_args(p, *bufs, 0.625, 0.25, h, splits, grid_m, 77), strict=True))
        q2, kv2, o_part, lse_part = bufs
        tensors = dict(q=q2, kv=kv2, o_part=o_part, lse_part=lse_part, page_table=p.page_table, kv_lens=p.kv_lens,
                       q_start=p.q_start, q_lens=p.q_lens)
        assert {k: args[k] for k in tensors} == {k: t.data_ptr() for k, t in tensors.items()}
        rows = p.num_tokens * h
        assert (args["num_rows"], args["num_slots"], args["num_parts"]) == (rows, 300, rows * splits)
        assert (args["num_seqs"], args["max_pages"], args["page_stride"]) == (
            p.num_seqs, p.page_table.shape[1], p.page_table.stride(0))
        assert (args["scale_log2"], args["v_scale"], args["num_heads"], args["num_splits"], args["row_blocks"]) == (
            0.625, 0.25, h, splits, grid_m)
        assert (args["cp"], args["rank"], args["stream"]) == ((cp, rank) if p is plan and cp > 1 else (1, 0)) + (77,)
        calls.append(args)
    assert all(calls[0][k] != calls[1][k] for k in ("q", "kv", "o_part", "lse_part", "page_table", "kv_lens"))


@pytest.mark.parametrize("which", ["q2", "kv2", "o_part", "lse_part", "kv_lens", "page_table"])
def test_launch_args_refuse_misaligned_buffers(which):
    """A buffer that starts off the kernel's alignment (16 bytes; the page table 4) is refused, as its
    ``from_dlpack`` conversion did; the page table may start at any int32."""
    plan = CuteMLABackend().plan(make_pool([2, 1], [70, 5], tpb=64, d=4)[0])
    bufs = dict(zip(("q2", "kv2", "o_part", "lse_part"), launch_buffers(plan, 16, 2)))
    shifted = {}
    for name, t in [*bufs.items(), ("kv_lens", plan.kv_lens), ("page_table", plan.page_table)]:
        room = torch.empty(t.numel() + 1, dtype=t.dtype)
        shifted[name] = room[1:].view(t.shape) if name == which else t
    plan = dataclasses.replace(plan, kv_lens=shifted["kv_lens"], page_table=shifted["page_table"])
    call = lambda: cute_mla.launch_args(plan, *(shifted[k] for k in bufs), 1.0, 1.0, 16, 2, 1, 0)  # noqa: E731
    if which == "page_table":
        call()
    else:
        with pytest.raises(ValueError, match="16-byte aligned"):
            call()


class RecordingCompiled:
    """Stands in for a compiled ``MLADecodeKernel.launch`` on a machine without a driver: marshals
    argument slots as the DSL does (each one's ``__c_pointers__``), and each launch records the
    values found behind those pointers."""

    def __init__(self):
        self.marshalled, self.launches = 0, []

    def generate_execution_args(self, *args):
        self.marshalled += 1
        return [p for a in args for p in a.__c_pointers__()], []

    def to(self):
        return self

    def run_compiled_program(self, exe_args):
        from specdec.attention.backends._cute_mla_kernel import LAUNCH_ARGS

        self.launches.append(tuple(ctype.from_address(p).value for (_, ctype), p in zip(LAUNCH_ARGS, exe_args,
                                                                                         strict=True)))


def some_launch_args(i: int) -> tuple:
    """Distinct values of every argument (fp32-exact floats, non-zero addresses)."""
    return (*(16 * (1000 * i + k + 1) for k in range(8)), *(1000 * i + k for k in range(5)), 2**40 + i, 0.5 + i,
            0.25 * i, *(7 * i + k for k in range(5)), 4096 + i)


@needs_cutlass
def test_prepared_launch_marshals_once_and_writes_each_call_in_place():
    """The argument slots are marshalled on the first launch only; every launch finds that call's
    values behind them, also with threads launching at once (the lock keeps each launch whole)."""
    import sys
    import threading

    from specdec.attention.backends._cute_mla_kernel import LAUNCH_ARGS

    assert tuple(name for name, _ in LAUNCH_ARGS) == LAUNCH_NAMES
    compiled = RecordingCompiled()
    launch = cute_mla.PreparedLaunch(compiled)
    for i in range(3):
        launch(some_launch_args(i))
    assert compiled.marshalled == 1 and compiled.launches == [some_launch_args(i) for i in range(3)]

    def worker(t):
        for i in range(t * 100, t * 100 + 50):
            launch(some_launch_args(i))

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(1, 5)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: without the lock, launches would interleave their values
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    want = {some_launch_args(i) for t in range(1, 5) for i in range(t * 100, t * 100 + 50)}
    assert compiled.marshalled == 1 and set(compiled.launches[3:]) == want and len(compiled.launches) == 203


# --------------------------------------------------------------------------- compiles without a GPU


def run_for_sm90a(code: str, **env_extra) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with ``CUTE_DSL_ARCH=sm_90a`` (the DSL reads it once per process)."""
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path]),
           **env_extra}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)


@needs_cutlass
def test_register_layout_assumptions_hold():
    done = run_for_sm90a("from specdec.attention.backends import _cute_mla_kernel as K\n"
                         "p = K.register_layout_problems()\nprint(len(p), p[:5])\n")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().startswith("0 "), done.stdout[-3000:]


COMPILE_CASES = [(tpb, fp8, False) for fp8 in (False, True) for tpb in (16, 32, 64, 128)] + [
    (64, False, True), (16, True, True), (128, True, True)]  # (page size, FP8 cache, Helix)


@needs_cutlass
@pytest.mark.parametrize(("tpb", "fp8", "helix"), COMPILE_CASES)
def test_kernel_compiles_for_sm90a_without_a_gpu(tpb, fp8, helix, tmp_path):
    """In a subprocess (the arch is read once per process): CUTE_DSL_ARCH=sm_90a, PTX and cubin kept,
    ptxas remarks on. The PTX has the wgmma shapes, TMA loads and register reallocation of the design
    (FP8: the hardware e4m3 -> f16 conversions, then f32 -> bf16, with vectorised shared-memory moves);
    ptxas reports no spills; the launch's shared memory fits an sm90 CTA."""
    code = (
        "from specdec.attention.backends import _cute_mla_kernel as K\n"
        "from specdec.attention.backends.cute_mla import kernel_config\n"
        f"_, smem = K.compile_fake(512, 64, {tpb}, *kernel_config({tpb}, fp8={fp8}), helix={helix})\n"
        "print('SMEM', smem)\n"
    )
    done = run_for_sm90a(code, CUTE_DSL_KEEP="ptx,cubin", CUTE_DSL_DUMP_DIR=str(tmp_path),
                         CUTE_DSL_COMPILER_OPT="remarks{ptx}")
    log = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)
    assert done.returncode == 0, log[-3000:]
    ptx = [p for p in tmp_path.iterdir() if p.suffix == ".ptx"]
    cubin = [p for p in tmp_path.iterdir() if p.suffix == ".cubin"]
    assert len(ptx) == 1 and len(cubin) == 1 and cubin[0].stat().st_size > 10_000
    text = ptx[0].read_text()
    assert ".target sm_90a" in text
    block_n = kernel_config(tpb, fp8=fp8)[0]
    assert text.count(f"wgmma.mma_async.sync.aligned.m64n{block_n}k16.f32.bf16.bf16") == 576 // 16  # S = Q K^T
    assert text.count("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16") == block_n // 16  # O += P V
    assert "cp.async.bulk.tensor.2d.shared::cta.global" in text
    assert "setmaxnreg.dec.sync.aligned.u32" in text and "setmaxnreg.inc.sync.aligned.u32" in text
    assert ".local" not in text  # no local-memory arrays in the PTX
    if fp8:  # 8 values a thread: 4 e4m3x2 -> f16x2, each half -> f32, pairs -> bf16x2; 8 bytes in, 16 out
        assert text.count("cvt.rn.f16x2.e4m3x2") == 4 and "cvt.rn.bf16x2.f32" in text
        assert "ld.shared.v2.b32" in text and "st.shared.v4.b32" in text
    else:
        assert "e4m3" not in text
    used = re.findall(r"Used (\d+) registers", log)
    assert used and "0 bytes spill stores, 0 bytes spill loads" in log, log[-3000:]
    smem = int(re.search(r"SMEM (\d+)", log).group(1))
    assert smem <= cute_mla.SMEM_LIMIT, smem


@needs_cutlass
def test_the_backend_compiles_against_real_tensors_and_stops_only_at_the_launch():
    """``attend`` on CPU tensors (bf16 cache, FP8 cache, FP8 under a Helix plan): one kernel compiled
    for each and the arguments prepared (the path a GPU call takes); only loading the module for the
    launch fails, for want of a CUDA driver."""
    code = (
        "import torch\n"
        "from specdec.attention.backends.cute_mla import CuteMLABackend\n"
        "from specdec.attention.backends.base import PhaseBatch\n"
        "from specdec.parallel.helix import HelixLayout, HelixShard\n"
        "b = CuteMLABackend()\n"
        "plan = b.plan(PhaseBatch((2, 1), (70, 5), ((3, 1, 0), (2,)), 64, torch.device('cpu')))\n"
        "shard = HelixShard(HelixLayout(2, 64), 1)\n"
        "helix = b.plan(PhaseBatch((2, 1), (70, 5), ((1,), ()), 64, torch.device('cpu'), shard))\n"
        "q, cache = torch.randn(3, 16, 576).bfloat16(), torch.randn(256, 1, 576).bfloat16()\n"
        "for p, c in ((plan, cache), (plan, cache.to(torch.float8_e4m3fn)), (helix, cache.to(torch.float8_e4m3fn))):\n"
        "    try:\n"
        "        b.attend(p, q, c, 0.1, 512, kv_scale=0.5)\n"
        "    except Exception as e:\n"
        "        print(type(e).__name__, 'Driver' in str(e) or 'driver' in str(e))\n"
        "print(sorted(b._compiled))\n"
    )
    done = run_for_sm90a(code)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("DSLCudaRuntimeError True") == 3, done.stdout[-3000:]
    assert ("[(512, 64, 64, 'bfloat16', False), (512, 64, 64, 'float8_e4m3fn', False), "
            "(512, 64, 64, 'float8_e4m3fn', True)]") in done.stdout, done.stdout[-3000:]


@needs_cutlass
def test_prepared_arguments_marshal_as_the_dsls_own():
    """The compiled entry, given the DSL's own argument objects (``make_ptr`` pointers, ``Int32`` /
    ``Int64`` / ``Float32`` scalars, a ``CUstream``), marshals the same number of arguments with the
    same bytes behind each as a PreparedLaunch's slots holding the same values: the host function
    reads what the ordinary call would have passed."""
    code = (
        "import ctypes\n"
        "import cutlass, cutlass.cute as cute\n"
        "import cuda.bindings.driver as cuda\n"
        "from cutlass.cute.runtime import make_ptr\n"
        "from specdec.attention.backends import _cute_mla_kernel as K\n"
        "from specdec.attention.backends.cute_mla import PreparedLaunch, kernel_config\n"
        "compiled, _ = K.compile_launch(512, 64, 16, *kernel_config(16, fp8=True), helix=True)\n"
        f"values = {some_launch_args(3)!r}\n"
        "gmem, i32 = cute.AddressSpace.gmem, cutlass.Int32\n"
        "types = [cutlass.BFloat16, cutlass.Float8E4M3FN, cutlass.Float32, cutlass.Float32] + [cutlass.Int32] * 4\n"
        "own = [make_ptr(t, v, gmem, assumed_align=4 if i == 4 else 16)\n"
        "       for i, (t, v) in enumerate(zip(types, values))]\n"
        "own += [i32(v) for v in values[8:13]] + [cutlass.Int64(values[13])]\n"
        "own += [cutlass.Float32(v) for v in values[14:16]] + [i32(v) for v in values[16:21]]\n"
        "own += [cuda.CUstream(values[21])]\n"
        "theirs, keep = compiled.generate_execution_args(*own)\n"
        "launch = PreparedLaunch(compiled)\n"
        "launch.write(values)\n"
        "ours, _ = compiled.generate_execution_args(*launch.slots)\n"
        "addr = lambda p: p.value if isinstance(p, ctypes.c_void_p) else int(p)\n"
        "size = [ctypes.sizeof(t) for _, t in K.LAUNCH_ARGS]\n"
        "read = lambda ptrs: [ctypes.string_at(addr(p), n) for p, n in zip(ptrs, size, strict=True)]\n"
        "print(len(theirs), len(ours), read(theirs) == read(ours))\n"
    )
    done = run_for_sm90a(code)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.split()[-3:] == ["22", "22", "True"], done.stdout[-3000:]


@needs_cutlass
def test_the_pointer_entry_compiles_to_the_previous_paths_kernel(tmp_path):
    """The previous path's conversions (``bench/cute_host.previous_args``: ``from_dlpack`` of every
    tensor, typed as CUDA tensors are: global memory) compiled through the tensor entry, and the
    backend's pointer entry: the same PTX, kernel names aside. So the kernel the backend launches is
    the one it launched before, instruction for instruction."""
    code = (
        "import ctypes, re, sys, torch\n"
        f"sys.path.insert(0, {BENCH!r})\n"
        "import cutlass.cute as cute\n"
        "from cute_host import previous_args\n"
        "from specdec.attention.backends import _cute_mla_kernel as K\n"
        "from specdec.attention.backends.cute_mla import CuteMLABackend, kernel_config\n"
        "from specdec.attention.backends.base import PhaseBatch\n"
        "from specdec.parallel.helix import HelixLayout, HelixShard\n"
        "class AsCuda:  # a CPU tensor exported as if on CUDA device 0 (a conversion reads metadata only)\n"
        "    def __init__(self, t): self.t = t\n"
        "    def __dlpack_device__(self): return (2, 0)\n"
        "    def __dlpack__(self, stream=None, **kw):\n"
        "        capsule = torch.utils.dlpack.to_dlpack(self.t)\n"
        "        get = ctypes.pythonapi.PyCapsule_GetPointer\n"
        "        get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]\n"
        "        ctypes.c_int32.from_address(get(capsule, b'dltensor') + 8).value = 2  # device_type = kDLCUDA\n"
        "        return capsule\n"
        "name = lambda ptx: re.sub(r'\\b\\w*MLADecodeKernel\\w*', 'K', ptx)\n"
        "for tpb, fp8, helix in ((64, False, False), (16, True, True)):\n"
        "    shard = HelixShard(HelixLayout(2, tpb), 1) if helix else None\n"
        "    phase = PhaseBatch((2, 1), (70, 5), ((3, 1, 0), (2,)), tpb, torch.device('cpu'), shard)\n"
        "    plan = CuteMLABackend().plan(phase)\n"
        "    kv = torch.zeros(256, 576, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)\n"
        "    bufs = (torch.zeros(48, 576, dtype=torch.bfloat16), kv, torch.zeros(96, 512), torch.zeros(96))\n"
        "    args = previous_args(plan, *bufs, 1.0, 1.0, 16, 2, 1, wrap=AsCuda)\n"
        "    cfg = kernel_config(tpb, fp8=fp8)\n"
        "    before = cute.compile(K.MLADecodeKernel(512, 64, tpb, *cfg, helix=helix), *args)\n"
        "    now, _ = K.compile_launch(512, 64, tpb, *cfg, helix=helix)\n"
        "    a, b = name(before.__ptx__), name(now.__ptx__)\n"
        "    print(tpb, fp8, helix, args[0].memspace, len(a) > 50000, a == b)\n"
    )
    done = run_for_sm90a(code, CUTE_DSL_KEEP="ptx", CUTE_DSL_DUMP_DIR=str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[-2:] == ["64 False False gmem True True", "16 True True gmem True True"], \
        done.stdout[-3000:]


# --------------------------------------------------------------------------- GPU


GPU_KV_LENS = (1000, 333, 2055)


def gpu_case(h, q_lens, kv_lens, *, tpb, num_splits=None, seed=0, check_lse=True, fp8=False):
    """The kernel against torch_ref (fp32) on one phase, bf16 queries, a bf16 or (``fp8``) E4M3 cache."""
    lat, rope = 512, 64
    batch, cache = make_pool(q_lens, kv_lens, tpb=tpb, d=lat + rope, seed=seed)
    kv_scale = 1.0
    if fp8:
        cache, kv_scale = to_fp8(cache)
    cache = cache.to("cuda", FP8 if fp8 else torch.bfloat16)
    batch = dataclasses.replace(batch, device=torch.device("cuda"))
    q = torch.randn(sum(q_lens), h, lat + rope, generator=torch.Generator().manual_seed(seed + 1))
    q = q.to("cuda", torch.bfloat16)
    scale = (128 + 64) ** -0.5
    backend = CuteMLABackend(num_splits=num_splits)
    plan = backend.plan(batch)
    out, lse = backend.attend(plan, q, cache, scale, lat, kv_scale=kv_scale, return_lse=True)
    want = reference(batch, q, cache, scale, lat, kv_scale)
    assert out.shape == (sum(q_lens), h, lat) and out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.isfinite(want).all()
    torch.testing.assert_close(out.float(), want, **BF16_TOL)
    if check_lse:
        want_lse = reference_lse(batch, q.cpu(), cache.cpu(), scale, kv_scale).view(-1, h).to("cuda")
        torch.testing.assert_close(lse, want_lse, **BF16_TOL)
    assert torch.equal(backend.run(plan, q, cache, None, scale, lat, kv_scale=kv_scale), out)  # deterministic
    return backend


def gpu_helix_case(h, q_lens, kv_lens, cp, *, tpb, num_splits=None, seed=0, fp8=False):
    """Helix shards simulated in one process: each rank's kernel partial and LSE (its pages only, the
    rest of its cache NaN) against ``shard_attention`` on the same shard; the partials combined by LSE
    against torch_ref over the whole cache."""
    lat, rope = 512, 64
    batch, cache = make_pool(q_lens, kv_lens, tpb=tpb, d=lat + rope, seed=seed)
    kv_scale = 1.0
    if fp8:
        cache, kv_scale = to_fp8(cache)
    cache = cache.to(FP8 if fp8 else torch.bfloat16)
    q = torch.randn(sum(q_lens), h, lat + rope, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    scale = (128 + 64) ** -0.5
    backend = CuteMLABackend(num_splits=num_splits)
    layout, outs, lses = HelixLayout(cp, tpb), [], []
    for rank in range(cp):
        local_batch, local = shard_pool(batch, cache, layout, rank)
        plan = backend.plan(dataclasses.replace(local_batch, device=torch.device("cuda")))
        part, part_lse = backend.attend(plan, q.cuda(), local.cuda(), scale, lat, kv_scale=kv_scale,
                                        return_lse=True, out_dtype=torch.float32)
        want, want_lse = shard_attention(plan_shard(q_lens, kv_lens, local_batch.page_tables, layout, rank),
                                         q.float(), local, scale, lat, kv_scale)
        what = f"rank {rank} of {cp}"
        assert torch.equal(torch.isneginf(part_lse).cpu(), torch.isneginf(want_lse)), what
        torch.testing.assert_close(part.cpu(), want, **BF16_TOL, msg=lambda m: f"{what}: {m}")
        torch.testing.assert_close(part_lse.cpu(), want_lse, **BF16_TOL, msg=lambda m: f"{what}: {m}")
        outs.append(part.cpu())
        lses.append(part_lse.cpu())
    got, _ = combine_partials(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(got, reference(batch, q, cache, scale, lat, kv_scale), **BF16_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.skipif(not HAS_CUTLASS, reason=f"nvidia-cutlass-dsl not importable: {cute_mla.IMPORT_ERROR}")
class TestGPU:
    """The gate for ``cute_mla.VALIDATED_SM``: runs the kernel on the GPU present whether or not
    ``supports`` claims its arch yet (bf16 queries and cache, 512 + 64)."""

    @pytest.fixture(autouse=True)
    def _sm90(self):
        major, minor = torch.cuda.get_device_capability()
        if major * 10 + minor != 90:
            pytest.skip(f"the kernel is written for sm90, this GPU is sm{major}{minor}")

    @pytest.mark.parametrize("tpb", [16, 64, 128])
    @pytest.mark.parametrize("q_len", [1, 2, 4, 8])
    @pytest.mark.parametrize("h", [16, 48, 64, 96, 128])
    def test_grid_vs_reference(self, h, q_len, tpb):
        q_lens = (q_len, max(1, q_len - 1), q_len)
        shape = dataclasses.replace(mla_gpu(num_heads=h, max_q_len=q_len, tokens_per_block=tpb))
        if 90 in cute_mla.VALIDATED_SM:
            assert CuteMLABackend().supports(shape).ok
        gpu_case(h, q_lens, GPU_KV_LENS, tpb=tpb, seed=h + q_len + tpb)

    @pytest.mark.parametrize("splits", [1, 2, 7, 33])
    @pytest.mark.parametrize("tpb", [32, 64])
    def test_forced_splits(self, splits, tpb):
        """Splits of keys no row of a block sees, and empty splits (33 splits of a 17-key request)."""
        gpu_case(96, (4, 1, 3), (4096, 17, 777), tpb=tpb, num_splits=splits)

    def test_odd_heads_and_partial_blocks(self):
        gpu_case(33, (3, 1, 8), (70, 5, 200), tpb=16, num_splits=2)

    def test_long_single_request_and_large_batch(self):
        gpu_case(128, (1,), (32768,), tpb=64, check_lse=False)
        kv = torch.randint(8, 3000, (64,), generator=torch.Generator().manual_seed(0)).tolist()
        gpu_case(16, (4,) * 64, tuple(kv), tpb=32, check_lse=False)

    @pytest.mark.parametrize(("tpb", "fp8", "cp", "splits"), [
        (64, False, 1, None), (16, False, 1, 7), (32, True, 1, 3), (128, True, 1, None), (64, False, 2, 2),
        (16, True, 4, None)])
    def test_the_prepared_launch_equals_the_previous_path(self, tpb, fp8, cp, splits):
        """Outputs and LSEs bit for bit those of the calling path the backend had before
        (``bench/cute_host.PreviousPath``: the tensor entry, ``from_dlpack`` conversions, the DSL's
        marshalling, ``merge_partials``): bf16 and FP8 caches, forced splits, Helix shards."""
        sys.path.insert(0, BENCH)
        from cute_host import PreviousPath

        batch, cache = make_pool((2, 1, 4), (1000, 333, 2055), tpb=tpb, d=576, seed=tpb + cp)
        kv_scale = 1.0
        if fp8:
            cache, kv_scale = to_fp8(cache)
        cache = cache.to(FP8 if fp8 else torch.bfloat16)
        if cp > 1:
            batch, cache = shard_pool(batch, cache, HelixLayout(cp, tpb), cp - 1)
        batch, cache = dataclasses.replace(batch, device=torch.device("cuda")), cache.cuda()
        q = torch.randn(7, 96, 576, generator=torch.Generator().manual_seed(tpb)).to("cuda", torch.bfloat16)
        backend = CuteMLABackend(num_splits=splits, merge="torch")
        plan = backend.plan(batch)
        kw = dict(kv_scale=kv_scale, out_dtype=torch.float32 if cp > 1 else None)
        now = backend.attend(plan, q, cache, (128 + 64) ** -0.5, 512, return_lse=True, **kw)
        before = PreviousPath(backend).attend(plan, q, cache, (128 + 64) ** -0.5, 512, return_lse=True, **kw)
        for got, want in zip(now, before, strict=True):
            assert_same_bits(got.cpu(), want.cpu())
        assert_same_bits(backend.attend(plan, q, cache, (128 + 64) ** -0.5, 512, **kw).cpu(), now[0].cpu())
        # the default, fused merge: the same merge up to fp32 rounding (bf16 outputs within a rounding)
        fused = CuteMLABackend(num_splits=splits).attend(plan, q, cache, (128 + 64) ** -0.5, 512, return_lse=True, **kw)
        tol = dict(rtol=1e-5, atol=1e-5) if kw["out_dtype"] == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(fused[0].float(), now[0].float(), **tol)
        torch.testing.assert_close(fused[1], now[1], rtol=1e-5, atol=1e-5)

    # ---- FP8 E4M3 cache: the gate for cute_mla.FP8_VALIDATED_SM

    @pytest.mark.parametrize("tpb", [16, 32, 64, 128])
    @pytest.mark.parametrize("q_len", [1, 2, 4, 8])
    @pytest.mark.parametrize("h", [16, 64, 96, 128])
    def test_fp8_grid_vs_reference(self, h, q_len, tpb):
        gpu_case(h, (q_len, max(1, q_len - 1), q_len), GPU_KV_LENS, tpb=tpb, seed=h + q_len + tpb, fp8=True)

    @pytest.mark.parametrize("splits", [1, 2, 7, 33])
    def test_fp8_forced_splits(self, splits):
        gpu_case(96, (4, 1, 3), (4096, 17, 777), tpb=64, num_splits=splits, fp8=True)

    def test_fp8_odd_heads_long_request_and_large_batch(self):
        gpu_case(33, (3, 1, 8), (70, 5, 200), tpb=16, num_splits=2, fp8=True)
        gpu_case(128, (1,), (32768,), tpb=128, check_lse=False, fp8=True)
        kv = torch.randint(8, 3000, (64,), generator=torch.Generator().manual_seed(1)).tolist()
        gpu_case(16, (4,) * 64, tuple(kv), tpb=32, check_lse=False, fp8=True)

    # ---- Helix page tables: the gate for cute_mla.HELIX_VALIDATED_SM

    @pytest.mark.parametrize("fp8", [False, True])
    @pytest.mark.parametrize(("cp", "tpb"), [(2, 16), (4, 64), (8, 128), (3, 32)])
    def test_helix_shards_vs_reference(self, cp, tpb, fp8):
        """Requests shorter than a page (ranks that own none of them), verify rows straddling pages."""
        gpu_helix_case(48, (4, 1, 2), (1000, 9, 2055), cp, tpb=tpb, fp8=fp8)

    @pytest.mark.parametrize("splits", [1, 3, 17])
    def test_helix_forced_splits(self, splits):
        gpu_helix_case(96, (8, 1), (3000, 700), 4, tpb=64, num_splits=splits, fp8=True)
