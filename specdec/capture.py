"""CUDA-graph capture that no garbage collection can break.

A capture in ``"global"`` mode fails (``cudaErrorStreamCaptureInvalidated``) when
any CUDA call that is unsafe during a capture runs meanwhile. Python's cyclic
garbage collector may run at any allocation, and when it frees a dead engine or
drafter (their CUDA graphs, events, pinned buffers), that free may make such a call
in the middle of someone else's capture. On the H200 this broke a capture after
several engines had been built and dropped in one process (``bench/e2e.py``
with ``--repeat 2``). So captures collect first, then hold the collector off.
"""

from __future__ import annotations

import contextlib
import gc

import torch


@contextlib.contextmanager
def gc_held(collect: bool = True):
    """Run the body with Python's cyclic garbage collector off (restored after).

    Args:
        collect: first collect what is already garbage (so nothing dead is freed later,
            in someone's capture).
    """
    if collect:
        gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def capture(graph: "torch.cuda.CUDAGraph", pool=None, collect: bool = True):
    """``torch.cuda.graph(graph, pool=pool)`` inside :func:`gc_held`.

    Args:
        graph: the graph to capture into.
        pool: memory pool handle shared with other graphs, or ``None``.
        collect: collect garbage first (a caller capturing many graphs in a row collects once,
            then passes ``False``).
    """
    with gc_held(collect), torch.cuda.graph(graph, pool=pool):
        yield


def capture_graph(fn, device: torch.device, pool=None, collect: bool = True):
    """Capture ``fn`` (no arguments; returns its output tensors) as a CUDA graph: the one capture
    path of target steps and drafter proposes.

    ``fn`` first runs once on a side stream (a warm-up: kernels compiled, cuBLAS handles and
    attention plans made, never inside a capture), then is captured with the collector held off
    (:func:`capture`), and the graph is replayed once so that its outputs hold ``fn``'s result.
    Warm-up and capture run in inference mode (no autograd history, whatever the caller's mode).

    Args:
        fn: the work to capture; it must read its inputs from, and write its outputs to, tensors
            that outlive the graph (static buffers).
        device: the CUDA device.
        pool: the memory pool handle the graph shares (``torch.cuda.graph_pool_handle()``), or ``None``.
        collect: collect garbage first (see :func:`capture`).

    Returns:
        ``(graph, outputs)``: replay ``graph`` to recompute ``outputs`` in place.
    """
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.inference_mode():  # a replayed step records no autograd history, whoever captures it
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capture(graph, pool, collect=collect):
            outputs = fn()
    graph.replay()
    return graph, outputs
