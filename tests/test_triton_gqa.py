"""The Triton paged GQA backend against the torch reference.

Every case builds requests over a pool filled with large noise, with shuffled
page tables, writes each request's earlier context into the cache, then runs
one step through ``plan_step`` + ``AttentionMetadata.attend`` twice: once
forcing ``triton_gqa`` and once forcing ``torch_ref`` (on fp32 copies of the
same inputs), and compares every query row.

Where the tests run:

- on a machine with a CUDA GPU: everything here, on the GPU (the ``gpu`` class
  adds large shapes, CUDA-graph capture and an end-to-end engine check);
- on a CPU machine: the kernels run in Triton's interpreter, which Triton
  chooses when the kernels are *defined* (``TRITON_INTERPRET=1`` before the
  backend module is imported). ``test_cpu_interpreter_suite`` re-runs
  this file in a subprocess with that variable set; run
  ``TRITON_INTERPRET=1 python -m pytest tests/test_triton_gqa.py`` to see the
  cases one by one.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip extra 'gpu'): no Triton backend to test")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from specdec.attention import selector  # noqa: E402
from specdec.attention.backends import triton_gqa  # noqa: E402
from specdec.attention.backends.base import PhaseBatch  # noqa: E402
from specdec.attention.backends.triton_gqa import TritonGQABackend  # noqa: E402
from specdec.attention.metadata import plan_step  # noqa: E402
from specdec.attention.selector import select  # noqa: E402
from specdec.attention.shapes import AttnShape  # noqa: E402
from specdec.errors import ConfigError, UnsupportedShapeError  # noqa: E402
from helpers import run_interpreted, tiny_llama  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
INTERPRETED = triton_gqa.INTERPRETED
# Triton 3.6's interpreter bugs are fixed for this module's tests (see triton_interp); supports()
# refuses interpreted shapes while they are present (test_supports_refuses_a_broken_interpreter).
pytestmark = pytest.mark.usefixtures("fixed_triton_interpreter", "row_by_row_dot")
# Kernels built for the GPU run on it; kernels built for the interpreter run on the CPU.
DEVICE = "cpu" if INTERPRETED or not HAS_CUDA else "cuda"
RUNNABLE = INTERPRETED or HAS_CUDA
needs_kernels = pytest.mark.skipif(
    not RUNNABLE,
    reason="no CUDA GPU and the kernels were not built for the interpreter; "
    "test_cpu_interpreter_suite runs these with TRITON_INTERPRET=1",
)
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
DTYPE_NAME = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


# --------------------------------------------------------------------------- harness


def sm_of(device: str) -> int | None:
    if device != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def make_step(context, generation, *, h, hkv, d, dv=None, tpb, dtype, device=DEVICE, seed=0):
    """Requests over a noisy paged pool, ready for one step.

    ``context`` / ``generation``: ``(q_len, kv_len)`` per request; the first
    ``kv_len - q_len`` tokens are already cached, the last ``q_len`` come this step.
    Returns a dict with the step's tensors and the ``plan_step`` arguments.
    """
    dv = dv or d
    g = torch.Generator().manual_seed(seed)
    reqs = list(context) + list(generation)
    pages = [math.ceil(kv / tpb) for _, kv in reqs]
    num_pages = sum(pages) + 3  # a few pages no request owns
    perm = torch.randperm(num_pages, generator=g).tolist()
    tables, at = [], 0
    for n in pages:
        tables.append(tuple(perm[at : at + n]))
        at += n
    # Noise everywhere, large enough that reading a wrong slot cannot pass.
    k_cache = torch.randn(num_pages * tpb, hkv, d, generator=g) * 10
    v_cache = torch.randn(num_pages * tpb, hkv, dv, generator=g) * 10
    k_new, v_new, slots = [], [], []
    for (q_len, kv_len), table in zip(reqs, tables):
        at = [table[p // tpb] * tpb + p % tpb for p in range(kv_len)]
        k, v = torch.randn(kv_len, hkv, d, generator=g), torch.randn(kv_len, hkv, dv, generator=g)
        past = torch.tensor(at[: kv_len - q_len], dtype=torch.long)
        k_cache[past], v_cache[past] = k[: kv_len - q_len], v[: kv_len - q_len]
        k_new.append(k[kv_len - q_len :])
        v_new.append(v[kv_len - q_len :])
        slots += at[kv_len - q_len :]
    num_tokens = len(slots)
    n_ctx = len(context)
    to = dict(device=device, dtype=dtype)
    return dict(
        q=torch.randn(num_tokens, h, d, generator=g).to(**to),
        k=torch.cat(k_new).to(**to),
        v=torch.cat(v_new).to(**to),
        k_cache=k_cache.to(**to),
        v_cache=v_cache.to(**to),
        context=[(q, kv, t) for (q, kv), t in zip(context, tables[:n_ctx])],
        generation=[(q, kv, t) for (q, kv), t in zip(generation, tables[n_ctx:])],
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        h=h, hkv=hkv, d=d, dv=dv, tpb=tpb,
    )


def attend(step, backend: str, dtype=None, backends=None):
    """Run the step through ``plan_step`` + ``attend`` with ``backend`` forced (from ``backends``, default
    the registered ones); returns (out, metadata)."""
    dtype = dtype or step["q"].dtype
    dev = step["q"].device

    def shape_of(phase, max_q_len, mixed):
        name = DTYPE_NAME[dtype]
        return AttnShape(phase, "gqa", step["h"], step["hkv"], step["d"], step["dv"], step["tpb"], max_q_len,
                         name, name, dev.type, sm_of(dev.type), 1, mixed)

    attn = plan_step(step["context"], step["generation"], step["slot_mapping"], shape_of, step["tpb"], backend,
                     backends=backends)
    t = {k: step[k].to(dtype).clone() for k in ("q", "k", "v", "k_cache", "v_cache")}
    out = attn.attend(t["q"], t["k"], t["v"], t["k_cache"], t["v_cache"], step["d"] ** -0.5, step["dv"])
    return out, attn


def check(step, atol=None, backend=None):
    """``triton_gqa`` (``backend``, default the registered one) equals the fp32 reference on the same
    (possibly 16-bit) inputs."""
    dtype = step["q"].dtype
    out, attn = attend(step, "triton_gqa", backends=None if backend is None else [backend])
    ref, _ = attend(step, "torch_ref", torch.float32)
    assert set(attn.backends.values()) == {"triton_gqa"}
    assert out.dtype == dtype and out.shape == ref.shape
    tol = atol or TOL[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    return attn


@pytest.fixture
def split_backend():
    """A ``triton_gqa`` that splits contexts of 16+ tokens in balanced splits (so small cases take the
    balanced split path, not the fixed 256-key offsets of small eager phases)."""
    return TritonGQABackend(max_splits=4, min_split_tokens=16, fixed_split_max_tokens=0)


@needs_kernels
@pytest.mark.parametrize(("key_tile", "num_stages"), [(16, 1), (32, 3), (256, 2)])
def test_tuned_key_tiles_and_stages_give_the_reference(key_tile, num_stages):
    """A backend built with another key tile / pipeline depth (what bench/gqa_sweep.py times) still
    computes the reference, for decode and verify over several pages."""
    backend = TritonGQABackend(max_splits=4, min_split_tokens=16, key_tile=key_tile, num_stages=num_stages,
                               fixed_split_max_tokens=0)
    check(make_step([], [(3, 70), (1, 33)], h=4, hkv=2, d=32, tpb=8, dtype=torch.bfloat16, seed=key_tile), backend=backend)


@pytest.mark.parametrize(("kw", "match"), [(dict(key_tile=24), "key_tile must be a power of two >= 16"),
                                           (dict(key_tile=8), "key_tile must be a power of two >= 16"),
                                           (dict(num_stages=0), "num_stages must be >= 1"),
                                           (dict(fixed_split_max_tokens=-1), "fixed_split_max_tokens must be >= 0")])
def test_backend_settings_are_checked(kw, match):
    with pytest.raises(ConfigError, match=match):
        TritonGQABackend(**kw)


# --------------------------------------------------------------------------- supports / cost


def gqa(**kw) -> AttnShape:
    base = dict(phase="generation", kind="gqa", num_heads=9, num_kv_heads=3, head_dim=64, v_head_dim=64,
                tokens_per_block=16, max_q_len=4, kv_dtype="bfloat16", q_dtype="bfloat16", device="cuda", sm=90)
    return AttnShape(**{**base, **kw})


@pytest.mark.parametrize(("overrides", "reason"), [
    (dict(kind="mla", num_kv_heads=1, head_dim=576, v_head_dim=512), "kind must be 'gqa'"),
    (dict(helix_cp=2), "helix_cp must be 1"),
    (dict(head_dim=320, v_head_dim=320), "head_dim must be <= 256"),
    (dict(v_head_dim=512), "v_head_dim must be <= 256"),
    (dict(tokens_per_block=512), "tokens_per_block must be a power of two <= 256"),
    (dict(tokens_per_block=12), "tokens_per_block must be a power of two"),
    (dict(kv_dtype="float8_e4m3fn"), "kv_dtype must be one of"),
    (dict(kv_dtype="float32"), "q_dtype must equal kv_dtype"),
    (dict(sm=75), "sm >= 80"),
    (dict(sm=None), "sm >= 80"),
])
def test_supports_refuses_with_the_reason(overrides, reason):
    verdict = TritonGQABackend().supports(gqa(**overrides))
    assert not verdict.ok and reason in verdict.reason


@pytest.mark.parametrize("overrides", [
    dict(), dict(max_q_len=1), dict(max_q_len=16, mixed=True), dict(phase="context", max_q_len=8192),
    dict(num_heads=64, num_kv_heads=8, head_dim=128, v_head_dim=128), dict(num_heads=4, num_kv_heads=4),
    dict(head_dim=80, v_head_dim=80), dict(head_dim=256, v_head_dim=256), dict(head_dim=8, v_head_dim=8),
    dict(tokens_per_block=1), dict(tokens_per_block=128), dict(tokens_per_block=256),
    dict(kv_dtype="float16", q_dtype="float16"), dict(kv_dtype="float32", q_dtype="float32"), dict(sm=120),
])
def test_supports_the_gpu_shapes_it_claims(overrides):
    shape = gqa(**overrides)
    assert TritonGQABackend().supports(shape).ok
    assert select(shape).name == "triton_gqa"  # the cheapest supporting backend on the GPU
    assert TritonGQABackend().cost(shape) < selector.get_backend("torch_ref").cost(shape)


@pytest.mark.skipif(not INTERPRETED, reason="only the interpreter has these bugs")
def test_supports_refuses_a_broken_interpreter():
    from specdec.attention.backends import triton_interp

    triton_interp.unfix_interpreter()
    try:
        bugs = triton_interp.interpreter_bugs()
        verdict = TritonGQABackend().supports(gqa(device="cpu", sm=None))  # bf16: loops and bf16 dots
        assert verdict.ok == (not bugs)
        if bugs:
            assert "interpreter" in verdict.reason and "triton_interp" in verdict.reason
    finally:
        triton_interp.fix_interpreter()


def test_cpu_only_under_the_interpreter():
    shape = gqa(device="cpu", sm=None)
    verdict = TritonGQABackend().supports(shape)
    assert verdict.ok == INTERPRETED
    if not INTERPRETED:
        assert "TRITON_INTERPRET=1" in verdict.reason
        with pytest.raises(UnsupportedShapeError, match="triton_gqa.*device must be 'cuda'"):
            select(shape, requested="triton_gqa")
    assert select(shape).name == "torch_ref"  # the interpreter is never picked automatically


# --------------------------------------------------------------------------- kernel vs reference (CPU interpreter or GPU)


@needs_kernels
@pytest.mark.parametrize(("h", "hkv", "q_len", "tpb"), [
    (9, 3, 1, 4), (9, 3, 3, 16), (9, 3, 7, 4),
    (4, 4, 1, 16), (4, 4, 3, 4), (4, 4, 7, 16),
    (8, 2, 1, 4), (8, 2, 3, 16), (8, 2, 7, 4),
])
def test_generation_fp32(h, hkv, q_len, tpb):
    """Decode and verify over ragged contexts (one context of exactly q_len tokens)."""
    step = make_step([], [(q_len, q_len), (q_len, q_len + 13), (q_len, q_len + 45)],
                     h=h, hkv=hkv, d=64, tpb=tpb, dtype=torch.float32, seed=q_len + tpb)
    attn = check(step)
    assert attn.phases[0].shape.phase == "generation" and not attn.phases[0].shape.mixed


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_generation_16bit_with_ragged_draft_lengths(dtype):
    step = make_step([], [(1, 30), (4, 9), (7, 70)], h=9, hkv=3, d=64, tpb=16, dtype=dtype, seed=1)
    check(step)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mixed_step(dtype):
    """A prompt, a chunked-prefill continuation and verify requests in one step: two phases, one kernel."""
    step = make_step([(11, 11), (6, 20)], [(1, 17), (5, 40)], h=8, hkv=2, d=64, tpb=4, dtype=dtype, seed=2)
    attn = check(step)
    assert [p.shape.phase for p in attn.phases] == ["context", "generation"]
    assert attn.phases[1].shape.mixed


@needs_kernels
def test_context_with_several_row_blocks():
    """A 70-token prompt with group 3 has 210 query rows: two 16-bit row blocks of 128, causal skipping."""
    step = make_step([(70, 70), (5, 5)], [], h=6, hkv=2, d=32, tpb=16, dtype=torch.bfloat16, seed=3)
    check(step)


@needs_kernels
@pytest.mark.parametrize("q_len", [1, 5])
def test_split_kv_merge(split_backend, q_len):
    """Split-KV with an exact LSE merge; the short request leaves splits empty (their LSE is -inf)."""
    step = make_step([], [(q_len, 150), (q_len, q_len + 2)], h=4, hkv=1, d=32, tpb=8, dtype=torch.float32, seed=4)
    attn = check(step, backend=split_backend)
    plan = attn.phases[0].plan
    assert plan.num_splits is None and plan.split_chunk == 0  # run() chose the balanced splits:
    assert split_backend._num_splits(plan, 1) == 4


def _cache_after_writes(step):
    kc, vc = step["k_cache"].clone(), step["v_cache"].clone()
    kc.index_copy_(0, step["slot_mapping"], step["k"])
    vc.index_copy_(0, step["slot_mapping"], step["v"])
    return kc, vc


@needs_kernels
@pytest.mark.parametrize("split_chunk", [0, 64])
def test_graph_plan_ignores_padding_requests_and_tokens(split_chunk):
    """A CUDA-graph plan over a static meta buffer: extra rows (``q_len = 0``) and extra query
    tokens change nothing for the real requests, with balanced or fixed-offset splits."""
    step = make_step([], [(3, 150), (1, 40)], h=4, hkv=2, d=32, tpb=8, dtype=torch.float32, seed=5)
    ref, _ = attend(step, "torch_ref")
    backend, width = TritonGQABackend(), 3 + 32
    rows = backend.pack_meta([3, 1], [150, 40], [t for _, _, t in step["generation"]], 8, width)
    meta = torch.tensor(rows + [[0] * width] * 2, dtype=torch.int32, device=DEVICE)
    plan = backend.graph_plan(meta, 6, 9, 256, 8, split_chunk=split_chunk)
    kc, vc = _cache_after_writes(step)
    q = torch.cat([step["q"], torch.randn(2, 4, 32, device=DEVICE)])  # two padding tokens
    out = backend.run(plan, q, kc, vc, 32 ** -0.5, 32)
    torch.testing.assert_close(out[:4], ref, atol=1e-5, rtol=1e-5)
    assert plan.num_splits == (4 if split_chunk else None)


@pytest.fixture
def row_by_row_dot(monkeypatch):
    """Under Triton's CPU interpreter ``tl.dot`` is NumPy's ``matmul``, whose OpenBLAS kernels may
    round a row differently by how many rows the product has (seen on an AMD EPYC: a 1-row product
    differs in the last bits from the same row inside a 16-row one). A GPU's MMA gives each row the
    same bits whatever the other rows, and the bit-for-bit tests rest on that; so the interpreter's
    products are taken one row at a time in this module, as the hardware's are. (A no-op on the GPU.)"""
    if INTERPRETED:
        import numpy as np

        matmul = np.matmul

        def rows(a, b, *args, **kw):
            a = np.asarray(a)
            if a.ndim != 2 or a.shape[0] < 2:
                return matmul(a, b, *args, **kw)
            return np.concatenate([matmul(a[i:i + 1], b, *args, **kw) for i in range(a.shape[0])], 0)

        monkeypatch.setattr(np, "matmul", rows)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_offset_splits_make_a_row_independent_of_its_step(dtype):
    """With ``split_chunk`` the query at position p gives the same bits in a decode step
    (``kv_len = p + 1``) as inside a 4-token verify step (``kv_len = p + 4 - j``): batch invariance."""
    step = make_step([], [(4, 200)], h=4, hkv=2, d=32, tpb=8, dtype=dtype, seed=6)
    kc, vc = _cache_after_writes(step)
    table, backend = step["generation"][0][2], TritonGQABackend()

    def run(q_len, kv_len, q):
        meta = torch.tensor(backend.pack_meta([q_len], [kv_len], [table], 8, 3 + 32), dtype=torch.int32,
                            device=DEVICE)
        return backend.run(backend.graph_plan(meta, q.shape[0], 9, 256, 8, split_chunk=64), q, kc, vc,
                           32 ** -0.5, 32)

    verify = run(4, 200, step["q"])
    for j in range(4):
        assert torch.equal(run(1, 197 + j, step["q"][j:j + 1])[0], verify[j])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len", [9, 16])
def test_decode_and_verify_rows_agree_bit_for_bit(dtype, q_len):
    """SmolLM2's heads (9 x 64, 3 KV heads), one KV split: the query at position p gives the same bits in
    a decode step as inside a verify step of 9 or 16 tokens (27 or 48 rows: the same key tiles and MMA
    shapes as decode), so a bf16 drafter's greedy output can equal the null drafter's."""
    step = make_step([], [(q_len, 200)], h=9, hkv=3, d=64, tpb=16, dtype=dtype, seed=7)
    kc, vc = _cache_after_writes(step)
    table, backend = step["generation"][0][2], TritonGQABackend()

    def run(n, kv_len, q):
        meta = torch.tensor(backend.pack_meta([n], [kv_len], [table], 16, 3 + 16), dtype=torch.int32, device=DEVICE)
        plan = backend.graph_plan(meta, q.shape[0], n, 256, 16)  # as the step's bucket: max_q_len = n
        assert backend._num_splits(plan, 3) == 1
        return backend.run(plan, q, kc, vc, 64 ** -0.5, 64)

    verify = run(q_len, 200, step["q"])
    for j in range(q_len):
        assert torch.equal(run(1, 200 - q_len + 1 + j, step["q"][j:j + 1])[0], verify[j]), j


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_buckets_give_a_row_the_same_bits(dtype):
    """A request's decode row in graph buckets of 512, 1,024 and 4,096 keys (the split count follows
    the bucket, the split offsets do not: graphs.split_chunk), in an eager step and in a 9-token verify
    step: the same bits, so the other requests of a step cannot change a row (batch 8 and 32 outputs
    equal null's), nor can running it eagerly.
    With balanced splits (``split_chunk=0``) this fails."""
    from specdec.graphs import split_chunk

    step = make_step([], [(9, 300)], h=9, hkv=3, d=64, tpb=16, dtype=dtype, seed=8)
    kc, vc = _cache_after_writes(step)
    table, backend = step["generation"][0][2], TritonGQABackend()

    def run(n, kv_len, q, bucket):
        meta = torch.tensor(backend.pack_meta([n], [kv_len], [table], 16, 3 + 32), dtype=torch.int32, device=DEVICE)
        plan = backend.graph_plan(meta, q.shape[0], n, bucket, 16, split_chunk=split_chunk(bucket))
        return backend.run(plan, q, kc, vc, 64 ** -0.5, 64)

    verify = run(9, 300, step["q"], 512)
    for j in (0, 4, 8):
        for bucket in (512, 1024, 4096):
            assert torch.equal(run(1, 292 + j, step["q"][j:j + 1], bucket)[0], verify[j]), (j, bucket)
        # an eager step (a mixed step's generation phase, graphs off) splits at the same offsets
        plan = backend.plan(PhaseBatch((1,), (292 + j,), (table,), 16, step["q"].device))
        assert torch.equal(backend.run(plan, step["q"][j:j + 1], kc, vc, 64 ** -0.5, 64)[0], verify[j]), j


@needs_kernels
@pytest.mark.parametrize(("d", "dv"), [(80, 80), (128, 128), (256, 256), (32, 16)])  # 8: the CPU engine test
def test_head_dims(d, dv):
    """Head dims padded to a power of two >= 16 inside the kernel; V may be narrower than K."""
    step = make_step([], [(3, 20), (1, 7)], h=4, hkv=2, d=d, dv=dv, tpb=4, dtype=torch.float32, seed=d)
    check(step)


@needs_kernels
@pytest.mark.parametrize("tpb", [1, 128, 256])
def test_page_sizes(tpb):
    step = make_step([], [(2, 40), (4, 140)], h=4, hkv=2, d=16, tpb=tpb, dtype=torch.float32, seed=tpb)
    check(step)


@needs_kernels
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_supports_agrees_with_the_kernel(data):
    """Whatever ``supports`` accepts on this device, the kernel computes right (small shapes)."""
    hkv = data.draw(st.sampled_from([1, 2, 3]))
    h = hkv * data.draw(st.sampled_from([1, 3, 4]))
    d = data.draw(st.sampled_from([8, 16, 24, 64]))
    tpb = data.draw(st.sampled_from([1, 4, 8, 16, 32, 64, 128]))
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    q_lens = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=2))
    kv = [q + data.draw(st.integers(0, 70)) for q in q_lens]
    phase = data.draw(st.sampled_from(["context", "generation"]))
    reqs = list(zip(q_lens, kv))
    shape = AttnShape(phase, "gqa", h, hkv, d, d, tpb, max(q_lens), DTYPE_NAME[dtype], DTYPE_NAME[dtype],
                      DEVICE, sm_of(DEVICE))
    assert TritonGQABackend().supports(shape).ok
    step = make_step(reqs if phase == "context" else [], reqs if phase == "generation" else [],
                     h=h, hkv=hkv, d=d, tpb=tpb, dtype=dtype, seed=sum(kv))
    check(step)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kv_scale_matches_the_reference(dtype):
    """``run(..., kv_scale=s)`` reads the cache as ``s * value``, like the reference."""
    step = make_step([], [(3, 20), (1, 40)], h=4, hkv=2, d=32, tpb=4, dtype=dtype, seed=7)
    _, attn = attend(step, "triton_gqa")  # for its plan
    q, kc, vc = step["q"], step["k_cache"].clone(), step["v_cache"].clone()
    kc.index_copy_(0, step["slot_mapping"], step["k"])
    vc.index_copy_(0, step["slot_mapping"], step["v"])
    ref_backend = selector.get_backend("torch_ref")
    ref_plan = ref_backend.plan(PhaseBatch((3, 1), (20, 40), tuple(t for *_, t in step["generation"]), 4, q.device))
    p = attn.phases[0]
    out = p.backend.run(p.plan, q, kc, vc, 0.2, 32, kv_scale=0.5)
    ref = ref_backend.run(ref_plan, q.float(), kc.float(), vc.float(), 0.2, 32, kv_scale=0.5)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@needs_kernels
def test_plan_packs_the_step_into_one_int32_tensor():
    step = make_step([], [(3, 10), (1, 33)], h=4, hkv=2, d=16, tpb=4, dtype=torch.float32)
    _, attn = attend(step, "triton_gqa")
    plan = attn.phases[0].plan
    assert plan.meta.dtype == torch.int32 and plan.meta.device.type == DEVICE
    assert plan.kv_lens.tolist() == [10, 33] and plan.q_lens.tolist() == [3, 1] and plan.q_start.tolist() == [0, 3]
    assert plan.page_tables.shape == (2, 9)
    assert plan.page_tables[0, 3:].tolist() == [0] * 6  # padding


# --------------------------------------------------------------------------- compiled for the GPU, without one


@pytest.mark.skipif(INTERPRETED, reason="the kernels were built for the interpreter")
@pytest.mark.parametrize(("dtype", "d", "group", "q_len", "splits", "pdl"), [
    ("bf16", 64, 3, 1, 1, True),  # SmolLM2 decode
    ("bf16", 64, 3, 1, 2, True),  # SmolLM2 decode in a 512-key graph bucket: two KV splits
    ("bf16", 64, 3, 9, 4, True),  # SmolLM2 verify, split KV
    ("bf16", 64, 3, 16, 2, False),  # SmolLM2 verify of 15 draft tokens: two 32-row blocks
    ("bf16", 128, 8, 16, 2, False),  # 128 rows in one block
    ("fp32", 64, 3, 9, 1, False),  # lossless tests
])
def test_kernel_compiles_for_sm90(dtype, d, group, q_len, splits, pdl):
    """Lower the real kernel to an sm_90 cubin with ptxas (no GPU needed): catches errors the interpreter cannot."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    kernel = triton_gqa._gqa_attn_kernel
    block_m, block_n = triton_gqa._tile_sizes(dtype == "fp32", d, q_len * group)
    const = dict(GROUP=group, HEAD_DIM=d, V_DIM=d, PAGE=16, NUM_SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n,
                 BLOCK_D=d, BLOCK_DV=d, PRECISION="ieee" if dtype == "fp32" else "tf32", PDL=pdl,
                 stride_qd=1, stride_kd=1, stride_vd=1, stride_od=1)  # unit strides are specialised at launch
    pointers = dict(Q=dtype, K=dtype, V=dtype, O=dtype, O_PART="fp32", LSE_PART="fp32", META="i32")
    sig = {n: "constexpr" if n in const else "*" + pointers[n] if n in pointers else
           "fp32" if n in ("qk_scale", "v_scale") else "i32" for n in kernel.arg_names}
    aligned = [*pointers, "stride_qt", "stride_qh", "stride_ks", "stride_kh", "stride_vs", "stride_vh"]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    try:
        compiled = compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=8 if block_m * d >= 128 * 128 else 4, num_stages=2,
                                        launch_pdl=pdl))
    except RuntimeError as err:
        if "ptxas" in str(err) and "not found" in str(err):
            pytest.skip(f"no ptxas to build a cubin: {err}")
        raise
    assert compiled.asm["cubin"] and compiled.metadata.shared <= 227 * 1024


# --------------------------------------------------------------------------- engine end to end


def greedy_tokens(target, backend, prompts, max_new_tokens, **kw):
    from specdec import SamplingParams, SpecEngine
    from specdec.drafters import SuffixAutomatonDrafter

    engine = SpecEngine(target, SuffixAutomatonDrafter(), attention_backend=backend, **kw)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    return [o.token_ids for o in outs], engine


@pytest.mark.skipif(not INTERPRETED, reason="the CPU end-to-end run needs the interpreter (TRITON_INTERPRET=1)")
def test_engine_greedy_tokens_equal_the_reference_on_cpu(tmp_path):
    target = tiny_llama(tmp_path, "cpu", num_hidden_layers=1)  # the interpreter is slow: one layer, few tokens
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [7, 8, 9]]
    ref, _ = greedy_tokens(target, "torch_ref", prompts, 5, tokens_per_block=4)
    out, engine = greedy_tokens(target, "triton_gqa", prompts, 5, tokens_per_block=4)
    assert out == ref
    assert set(engine.attention_backends.values()) == {"triton_gqa"}


# --------------------------------------------------------------------------- CPU: the interpreter suite


@pytest.mark.skipif(INTERPRETED or HAS_CUDA, reason="the kernel tests run in this process (interpreter or GPU)")
def test_cpu_interpreter_suite():
    """Re-run this file with ``TRITON_INTERPRET=1``, so the kernels are built for Triton's CPU interpreter.

    A warning is fine: the merge of padding tokens reads split partials no program wrote (inf - inf
    in NumPy); those rows are discarded."""
    run_interpreted(__file__, "not sm90 and not interpreter_suite", timeout=600)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETED, reason="needs a CUDA GPU (and kernels compiled for it)")
class TestOnGPU:
    """Large shapes on the GPU: batch 1..32, contexts up to 4K, verify up to 9 tokens, bf16."""

    @pytest.mark.parametrize(("h", "hkv", "d", "tpb"), [(9, 3, 64, 16), (32, 8, 128, 64), (64, 8, 128, 16),
                                                        (16, 16, 64, 32)])
    @pytest.mark.parametrize("batch", [1, 7, 32])
    @pytest.mark.parametrize("q_len", [1, 4, 9])
    def test_generation_bf16_vs_reference(self, h, hkv, d, tpb, batch, q_len):
        g = torch.Generator().manual_seed(batch * 100 + q_len)
        kv = torch.randint(q_len, 4096, (batch,), generator=g).tolist()
        kv[0] = 4096
        step = make_step([], [(q_len, n) for n in kv], h=h, hkv=hkv, d=d, tpb=tpb, dtype=torch.bfloat16,
                         device="cuda")
        check(step)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
    @pytest.mark.parametrize("d", [64, 80, 128, 256])
    def test_dtypes_and_head_dims_in_a_mixed_step(self, dtype, d):
        """Context + verify (16 tokens x group 8 = 128 rows: one full row block) + decode."""
        step = make_step([(300, 300)], [(1, 2000), (16, 3000), (3, 45)], h=16, hkv=2, d=d, tpb=32, dtype=dtype,
                         device="cuda")
        check(step)

    def test_long_context_phase(self):
        step = make_step([(2048, 2048), (700, 1500)], [], h=9, hkv=3, d=64, tpb=16, dtype=torch.bfloat16,
                         device="cuda")
        check(step)

    def test_run_is_graph_capturable_and_sync_free(self):
        step = make_step([], [(4, 1000), (4, 3000), (1, 50)], h=9, hkv=3, d=64, tpb=16, dtype=torch.bfloat16,
                         device="cuda")
        eager, attn = attend(step, "triton_gqa")
        p = attn.phases[0]
        q, kc, vc = step["q"].clone(), step["k_cache"].clone(), step["v_cache"].clone()
        kc.index_copy_(0, step["slot_mapping"], step["k"])
        vc.index_copy_(0, step["slot_mapping"], step["v"])
        torch.cuda.set_sync_debug_mode("error")
        try:
            p.backend.run(p.plan, q, kc, vc, 64 ** -0.5, 64)  # warm-up (compiles), no host-device sync
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = p.backend.run(p.plan, q, kc, vc, 64 ** -0.5, 64)
        graph.replay()
        torch.testing.assert_close(out, eager)
        q.mul_(-1)  # new queries, same plan: the replay follows
        graph.replay()
        q2 = step["q"] * -1
        again = p.backend.run(p.plan, q2, kc, vc, 64 ** -0.5, 64)
        torch.testing.assert_close(out, again)

    def test_engine_greedy_tokens_equal_the_reference(self, tmp_path):
        # SmolLM2-like attention (9 query heads, 3 KV heads, head_dim 64); prompts long enough to split KV.
        target = tiny_llama(tmp_path, "cuda", vocab_size=256, hidden_size=576, intermediate_size=256,
                            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=1024,
                            eos_token_id=255)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 255, (n,), generator=g).tolist() for n in (600, 5, 130)]
        prompts.append([1, 2, 3, 4, 5] * 20)
        for tpb in (16, 64):
            ref, _ = greedy_tokens(target, "torch_ref", prompts, 40, tokens_per_block=tpb)
            out, engine = greedy_tokens(target, "triton_gqa", prompts, 40, tokens_per_block=tpb)
            assert out == ref
            assert set(engine.attention_backends.values()) == {"triton_gqa"}
            auto, engine = greedy_tokens(target, None, prompts, 40, tokens_per_block=tpb)
            assert auto == ref and set(engine.attention_backends.values()) == {"triton_gqa"}


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 200)), min_size=1, max_size=8), st.integers(0, 3),
       st.sampled_from([1, 4, 16]))
def test_pack_meta_into_writes_pack_meta_rows_into_a_reused_buffer(reqs, spare_rows, tpb):
    """What the graph runner writes into its pinned buffer step after step: the rows pack_meta
    gives (page columns up to each kv_len), q_len 0 on the spare rows, whatever the buffer held."""
    import numpy as np

    from specdec.attention.backends.triton_gqa import pack_meta, pack_meta_into

    q_lens = [q for q, _ in reqs]
    kv_lens = [q + extra for q, extra in reqs]
    tables = [tuple(range(100 * i, 100 * i + -(-kv // tpb))) for i, kv in enumerate(kv_lens)]
    width = 3 + max(-(-kv // tpb) for kv in kv_lens) + 2
    want = pack_meta(q_lens, kv_lens, tables, tpb, width)
    buf = np.full((len(reqs) + spare_rows, width), 77, dtype=np.int32)  # stale values of an earlier step
    pack_meta_into(buf, q_lens, kv_lens, tables, tpb)
    for i, (row, kv) in enumerate(zip(want, kv_lens)):
        used = 3 + -(-kv // tpb)
        assert buf[i, :used].tolist() == row[:used]
    assert (buf[len(reqs):, 1] == 0).all()


def test_pack_meta_into_refuses_what_pack_meta_refuses():
    import numpy as np

    from specdec.attention.backends.triton_gqa import pack_meta_into
    from specdec.errors import ConfigError

    buf = np.zeros((2, 3 + 4), dtype=np.int32)
    with pytest.raises(ConfigError, match="q_len <= kv_len"):
        pack_meta_into(buf, [5], [3], [(0,)], 4)
    with pytest.raises(ConfigError, match="page table has 1 pages"):
        pack_meta_into(buf, [1], [9], [(0,)], 4)
    with pytest.raises(ConfigError, match="more than the 4 columns"):
        pack_meta_into(buf, [1], [40], [tuple(range(10))], 4)
    with pytest.raises(ConfigError, match="more than the buffer's 2 rows"):
        pack_meta_into(buf, [1, 1, 1], [4, 4, 4], [(0,)] * 3, 4)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("q_len", "kv_len"), [(20, 200), (300, 300)])
def test_eager_prompt_step_equals_its_prompt_graph(dtype, q_len, kv_len):
    """An eager prompt step (``plan``) and the prompt graph bucket holding it (``graph_plan`` at the
    bucket's tokens, prompt length and context, ``graphs.split_chunk`` offsets) give every row the
    same bits, so turning ``prompt_graphs`` on changes no output.

    20 new tokens (after 180 cached) x group 3 = 60 rows, the bucket's 32 tokens 96: the tiles follow
    the prompt length rounded up to a power of two (chosen on the rows alone, their key tiles differ).
    300 keys: the eager step splits them at the graph's fixed offsets (balanced splits differ)."""
    from specdec.graphs import GraphPolicy, prompt_graph_key, split_chunk

    h, hkv, d, tpb = 9, 3, 64, 16
    step = make_step([(q_len, kv_len)], [], h=h, hkv=hkv, d=d, tpb=tpb, dtype=dtype, seed=q_len)
    kc, vc = _cache_after_writes(step)
    table, backend = step["context"][0][2], TritonGQABackend()
    eager = backend.run(backend.plan(PhaseBatch((q_len,), (kv_len,), (table,), tpb, step["q"].device)),
                        step["q"], kc, vc, d ** -0.5, d)

    key, why = prompt_graph_key(GraphPolicy(4, 3, 4096, prompt_graphs=True), [q_len], [kv_len])
    assert not why and key.max_q_len > q_len
    width = 3 + -(-key.max_kv_len // tpb)
    meta = torch.tensor(backend.pack_meta([q_len], [kv_len], [table], tpb, width), dtype=torch.int32,
                        device=step["q"].device)
    meta = torch.cat([meta, torch.zeros(key.num_seqs - 1, width, dtype=torch.int32, device=meta.device)])
    plan = backend.graph_plan(meta, key.num_tokens, key.max_q_len, key.max_kv_len, tpb,
                              split_chunk=split_chunk(key.max_kv_len))
    q = torch.cat([step["q"], torch.randn(key.num_tokens - q_len, h, d).to(step["q"])])  # padding tokens
    graph = backend.run(plan, q, kc, vc, d ** -0.5, d)[:q_len]
    assert torch.equal(eager, graph)
