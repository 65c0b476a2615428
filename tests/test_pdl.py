"""Programmatic dependent launch (specdec.pdl): the kernels wait before they touch memory, and the
results do not depend on the level.

On a CPU the kernels are compiled for sm_90 (Triton's compiler and ptxas run anywhere) and their PTX
is checked: every global load, store and async copy comes after ``griddepcontrol.wait``, only the
weight prefetches come before it, and the successor is released only after the wait. On an SM90 GPU
the levels are also run and compared bit for bit.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip extra 'gpu')")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from specdec.attention.backends import triton_gqa  # noqa: E402
from specdec.attention.backends.triton_gqa import TritonGQABackend  # noqa: E402
from specdec.errors import ConfigError  # noqa: E402
from specdec.pdl import PDL_LAUNCH, PDL_OFF, PDL_PREFETCH, check_pdl, pdl_level, prefetch_lines  # noqa: E402
from specdec.target import kernels as K  # noqa: E402

INTERPRETED = bool(triton.knobs.runtime.interpret)
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
ACCESS = re.compile(r"\b(ld\.global|st\.global|cp\.async|atom\.global|red\.global)")


def _ptx(kernel, signature: dict, constexprs: dict, num_warps: int = 4) -> str:
    types = {**signature, **{k: "constexpr" for k in constexprs}}
    assert set(types) == set(kernel.arg_names), set(kernel.arg_names) ^ set(types)
    src = ASTSource(fn=kernel, signature=types, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": 3, "launch_pdl": True})
    return compiled.asm["ptx"]


def _linear_ptx(pdl: int, silu_mul: bool) -> str:
    ptrs = {n: "*bf16" for n in ("X", "W", "Y", "NW", "RES")} | {"SS_IN": "*fp32", "SS_OUT": "*fp32"}
    ints = {n: "i32" for n in ("M", "N", "K", "stride_x", "stride_w", "stride_y", "stride_r", "parts_in")}
    lines, line = prefetch_lines(576, 2)
    consts = {"HAS_NORM": True, "SILU_MUL": silu_mul, "HAS_RES": not silu_mul, "PRECISION": "tf32",
              "NORM_FROM_SS": True, "WRITE_SS": not silu_mul, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64,
              "PARTS_BLOCK": 16, "PDL": pdl, "PF_LINES": lines, "PF_LINE": line}
    return _ptx(K._linear_kernel, {**ptrs, **ints, "eps": "fp32"}, consts)


def _qkv_ptx(pdl: int) -> str:
    ptrs = {n: "*bf16" for n in ("X", "W", "BIAS", "NW", "Q", "KC", "VC", "COS", "SIN")}
    ptrs |= {"SS_IN": "*fp32", "POS": "*i64", "SLOTS": "*i64"}
    ints = {n: "i32" for n in ("M", "K", "stride_x", "stride_w", "stride_q", "stride_c", "stride_ks", "stride_kh",
                               "stride_vs", "stride_vh", "num_heads", "num_kv_heads", "parts_in")}
    lines, line = prefetch_lines(576, 2)
    consts = {"HAS_BIAS": False, "PRECISION": "tf32", "NORM_FROM_SS": True, "HEAD_DIM": 64, "HALF": 32,
              "HEAD_SPLIT": 2, "BLOCK_H": 16, "BLOCK_M": 16, "BLOCK_K": 64, "PARTS_BLOCK": 16, "PDL": pdl,
              "PF_LINES": lines, "PF_LINE": line}
    return _ptx(K._qkv_rope_kernel, {**ptrs, **ints, "eps": "fp32"}, consts)


def _attn_ptx(pdl: bool, splits: int) -> str:
    ptrs = {n: "*bf16" for n in ("Q", "K", "V", "O")} | {"O_PART": "*fp32", "LSE_PART": "*fp32", "META": "*i32"}
    strides = [f"stride_{a}{b}" for a in ("q", "k", "v", "o") for b in ("t" if a in "qo" else "s", "h", "d")]
    ints = {n: "i32" for n in ["stride_meta", *strides, "num_heads", "m_blocks", "split_chunk"]}
    consts = {"GROUP": 3, "HEAD_DIM": 64, "V_DIM": 64, "PAGE": 16, "NUM_SPLITS": splits, "BLOCK_M": 16,
              "BLOCK_N": 128, "BLOCK_D": 64, "BLOCK_DV": 64, "PRECISION": "tf32", "PDL": pdl}
    return _ptx(triton_gqa._gqa_attn_kernel, {**ptrs, **ints, "qk_scale": "fp32", "v_scale": "fp32"}, consts)


def _merge_ptx(pdl: bool) -> str:
    sig = {"O": "*bf16", "O_PART": "*fp32", "LSE_PART": "*fp32", "stride_ot": "i32", "stride_oh": "i32",
           "stride_od": "i32", "num_heads": "i32"}
    consts = {"NUM_SPLITS": 4, "V_DIM": 64, "BLOCK_S": 16, "BLOCK_DV": 64, "PDL": pdl}
    return _ptx(triton_gqa._merge_splits_kernel, sig, consts, num_warps=2)


CASES = {
    "linear (residual, writes ss)": lambda p: _linear_ptx(p, silu_mul=False),
    "linear (norm, silu_mul)": lambda p: _linear_ptx(p, silu_mul=True),
    "qkv + rope + cache write": _qkv_ptx,
    "attention (one split)": lambda p: _attn_ptx(p > 0, 1),
    "attention (four splits)": lambda p: _attn_ptx(p > 0, 4),
    "merge splits": lambda p: _merge_ptx(p > 0),
}
PREFETCHING = {"linear (residual, writes ss)", "linear (norm, silu_mul)", "qkv + rope + cache write"}


@pytest.mark.skipif(INTERPRETED, reason="the kernels were built for the interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("case", sorted(CASES))
def test_ptx_waits_for_the_previous_kernel_before_touching_memory(case):
    levels = (PDL_OFF, PDL_LAUNCH, PDL_PREFETCH) if case in PREFETCHING else (PDL_OFF, PDL_LAUNCH)
    for level in levels:
        lines = CASES[case](level).splitlines()
        waits = [i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln]
        releases = [i for i, ln in enumerate(lines) if "griddepcontrol.launch_dependents" in ln]
        accesses = [i for i, ln in enumerate(lines) if ACCESS.search(ln)]
        prefetches = [i for i, ln in enumerate(lines) if "prefetch.global.L2" in ln]
        assert accesses, "no global memory access found: the PTX patterns are stale"
        if level == PDL_OFF:
            assert not waits and not releases and not prefetches, (case, level)
            continue
        assert len(waits) == 1 and len(releases) == 1, (case, level, waits, releases)
        assert waits[0] < releases[0] < accesses[0], (case, level, lines[accesses[0]])
        if level == PDL_PREFETCH:
            assert prefetches and max(prefetches) < waits[0], (case, prefetches, waits)
        else:
            assert not prefetches, (case, level)


def test_levels_are_checked():
    assert pdl_level("cpu") == PDL_OFF
    check_pdl(PDL_OFF, torch.device("cpu"))
    with pytest.raises(ValueError, match="must be 0, 1 or 2"):
        check_pdl(3, torch.device("cpu"))
    with pytest.raises(ValueError, match="SM90"):
        check_pdl(PDL_LAUNCH, torch.device("cpu"))
    with pytest.raises(ValueError, match="SM90"):
        K.fused_linear(torch.zeros(2, 8), torch.zeros(4, 8), pdl=PDL_PREFETCH)
    with pytest.raises(ConfigError, match="pdl must be"):
        TritonGQABackend(pdl="yes")


def test_prefetch_lines_cover_the_row():
    for k, size in ((576, 2), (1536, 2), (100, 4), (64, 2), (1, 2)):
        lines, line = prefetch_lines(k, size)
        assert line * size == 128 and lines & (lines - 1) == 0  # 128-byte lines, a power of two of them
        assert lines * line >= k > (lines // 2) * line  # every line of the row, no more than twice over


@pytest.mark.skipif(not SM90, reason="programmatic dependent launch needs an SM90+ GPU (CPU: the PTX test)")
class TestOnGPU:
    """Each level computes the same bits as a plain launch."""

    def test_fused_kernels(self):
        torch.manual_seed(0)
        x = torch.randn(5, 576, device="cuda", dtype=torch.bfloat16)
        w_gu = torch.randn(3072, 576, device="cuda", dtype=torch.bfloat16) * 0.05
        w_o = torch.randn(576, 576, device="cuda", dtype=torch.bfloat16) * 0.05
        w_qkv = torch.randn(960, 576, device="cuda", dtype=torch.bfloat16) * 0.05
        nw = torch.rand(576, device="cuda", dtype=torch.bfloat16) + 0.5
        cos, sin = torch.rand(64, 64, device="cuda", dtype=torch.bfloat16), torch.rand(64, 64, device="cuda",
                                                                                         dtype=torch.bfloat16)
        pos, slots = torch.arange(5, device="cuda"), torch.tensor([9, 3, 7, 1, 0], device="cuda")
        outs = []
        for level in (PDL_OFF, PDL_LAUNCH, PDL_PREFETCH):
            kc = torch.zeros(16, 3, 64, device="cuda", dtype=torch.bfloat16)
            vc = torch.zeros_like(kc)
            res = x.clone()
            a = K.fused_linear(x, w_gu, norm_weight=nw, silu_mul=True, pdl=level)
            K.fused_linear(x, w_o, residual=res, out=res, pdl=level)
            q = K.qkv_rope_write_kv(x, w_qkv, None, nw, 1e-5, 9, 3, 64, cos, sin, pos, slots, kc, vc, pdl=level)
            logits = K.fused_linear(x, w_o, norm_weight=nw, out_dtype=torch.float32, pdl=level)
            outs.append((a, res, q, kc, vc, logits))
        for got in outs[1:]:
            for g, want in zip(got, outs[0]):
                assert torch.equal(g, want)

    def test_decoder_graph_step(self):
        """The random-weight SmolLM2-shaped model, greedy, graph steps: PDL on and off give the same tokens."""
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
        from step_profile import prompts, random_target

        from specdec import EngineConfig, KernelConfig, SamplingParams, SpecEngine

        runs = []
        for level in (PDL_OFF, PDL_PREFETCH):
            target = random_target("cuda", torch.bfloat16, layers=4, kernels=KernelConfig(pdl=level))
            assert target.kernels.pdl == level
            engine = SpecEngine(target, None, EngineConfig(max_num_seqs=4, attention_pdl=level > 0))
            assert next(b for b in engine.runner.backends if b.name == "triton_gqa").pdl is (level > 0)
            ids = prompts(3, 40, target.config.vocab_size)
            outs = engine.generate(ids, SamplingParams(max_new_tokens=24, ignore_eos=True))
            assert engine.graph_stats["graph_steps"] > 0
            runs.append([o.token_ids for o in outs])
        assert runs[0] == runs[1]
