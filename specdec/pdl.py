"""Programmatic dependent launch (PDL, SM90+) for the Triton kernels of a decode step.

A CUDA-graph decode step of a small model is a chain of ~150 short kernels, and
between two dependent kernels the GPU idles while the second one launches. With
PDL a kernel may launch while its predecessor still runs; it waits for it
(``griddepcontrol.wait``, after which the predecessor's writes are visible)
before it touches memory the step writes. Levels (the ``pdl`` argument):

- ``PDL_OFF`` (0): a plain launch;
- ``PDL_LAUNCH`` (1): the launch latency overlaps the previous kernel;
- ``PDL_PREFETCH`` (2): as 1, and before waiting the kernel prefetches its
  weights into L2 (a step never writes weights), so the weight read overlaps too.

A kernel lets its successor launch only once it has itself stopped waiting, so
at most one kernel waits ahead of the one running. Kernels compiled with level 0
contain no wait (the CPU interpreter runs them).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

PDL_OFF, PDL_LAUNCH, PDL_PREFETCH = 0, 1, 2


def pdl_level(device: torch.device | str) -> int:
    """The level a step's kernels use on ``device`` by default: 2 on a CUDA SM90+ GPU, else 0."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return PDL_OFF
    return _cuda_level(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_level(index: int) -> int:
    return PDL_PREFETCH if torch.cuda.get_device_capability(index)[0] >= 9 else PDL_OFF


def check_pdl(pdl: int, device: torch.device) -> None:
    """Raise ``ValueError`` for a level that is not 0/1/2, or above 0 where PDL does not exist."""
    if pdl not in (PDL_OFF, PDL_LAUNCH, PDL_PREFETCH):
        raise ValueError(f"pdl must be 0, 1 or 2, got {pdl!r}")
    if pdl and pdl_level(device) == PDL_OFF:
        raise ValueError(f"pdl={pdl} needs a CUDA GPU with SM90 or newer, got {device}")


def prefetch_lines(k: int, element_size: int) -> tuple[int, int]:
    """``(LINES, LINE)`` for :func:`prefetch_rows_l2` over rows of ``k`` elements: 128-byte lines."""
    line = max(1, 128 // element_size)
    return triton.next_power_of_2(triton.cdiv(k, line)), line


@triton.jit
def prefetch_rows_l2(W, rows64, stride_w, K, LINES: tl.constexpr, LINE: tl.constexpr):
    """One L2 prefetch per 128-byte line of the first ``K`` elements of each row of ``W``
    (``rows64`` must be valid rows; line offsets are clamped to ``K - 1``)."""
    off = tl.minimum(tl.arange(0, LINES) * LINE, K - 1)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l",
                              [W + rows64[:, None] * stride_w + off[None, :]],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the previous kernel (its writes are then visible), then let the next one launch."""
    if PDL > 0:
        gdc_wait()
        gdc_launch_dependents()
