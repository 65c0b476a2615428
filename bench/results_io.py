"""Where the bench scripts write what they measured: ``NAME.md`` (the table, as printed) and
``NAME.json`` (the raw figures) in one folder."""

from __future__ import annotations

import datetime
import gc
import io
import json
import platform
import pstats
import sys
import threading
from pathlib import Path

import torch


def run_header(device: str, *details: str) -> str:
    """The line a results file starts with: the exact command, the date, the machine, torch's
    version, then ``details`` (dtype, shapes, ...)."""
    script = Path(sys.argv[0])
    machine = (torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available()
               else f"{platform.machine()} CPU, {torch.get_num_threads()} threads")
    parts = [str(datetime.date.today()), machine, f"torch {torch.__version__}", *details]
    return f"`python bench/{script.name} {' '.join(sys.argv[1:])}` — " + ", ".join(parts)


def write_results(out: str | Path | None, name: str, markdown: str, data) -> None:
    """Print ``markdown``; with ``out``, also write ``out/NAME.md`` and ``out/NAME.json`` (``data``)."""
    print(markdown)
    if out is None:
        return
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(markdown + "\n")
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))


def top_functions(profile, n: int) -> str:
    """A ``cProfile.Profile``'s ``n`` functions with the most own time, as pstats prints them."""
    buf = io.StringIO()
    pstats.Stats(profile, stream=buf).sort_stats("tottime").print_stats(n)
    return buf.getvalue().strip()


class GCPauses:
    """The garbage collector's pauses while it is active (``with GCPauses() as gcp: ...``):
    ``gcp.ms`` in all and by generation, ``gcp.collections`` by generation. A full (generation 2)
    collection walks every tracked object of the process, so a run that triggers one pays for all
    the objects the process holds."""

    def __init__(self) -> None:
        self.ms = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        import time

        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            gen = info.get("generation", 2)
            self.ms[gen] += 1e3 * (time.perf_counter() - self._t0)
            self.collections[gen] += 1

    def __enter__(self) -> "GCPauses":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def as_dict(self) -> dict:
        return {"ms": round(sum(self.ms), 3), "ms_by_generation": [round(m, 3) for m in self.ms],
                "collections": self.collections}


ALIVE_TYPES = ("SpecEngine", "CUDAGraph", "KVCacheManager")
"""Objects :func:`process_state` counts: engines (and their graphs and KV pools) an earlier run left alive."""


def process_state() -> dict:
    """What a compile may leave behind in the process."""
    try:
        import psutil

        children = len(psutil.Process().children(recursive=True))
    except ImportError:  # optional: counted only where psutil is installed
        children = None
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    objects = gc.get_objects()  # holds this frame, which holds it: cleared below, or every object lives to the next GC
    alive = {name: sum(type(o).__name__ == name for o in objects) for name in ALIVE_TYPES}
    n_objects = len(objects)
    objects.clear()
    return {"threads": sorted(t.name for t in threading.enumerate()), "child_processes": children,
            "torch_threads": torch.get_num_threads(), "gc_counts": gc.get_count(), "gc_threshold": gc.get_threshold(),
            "function_modes": [type(m).__name__ for m in _get_current_function_mode_stack()],
            "dispatch_modes": [type(m).__name__ for m in _get_current_dispatch_mode_stack()],
            "profile_hook": repr(sys.getprofile()), "trace_hook": repr(sys.gettrace()),
            "grad_enabled": torch.is_grad_enabled(), "gc_tracked_objects": n_objects, "alive": alive,
            "gc_collections": [g["collections"] for g in gc.get_stats()], "gc_frozen": gc.get_freeze_count(),
            **cuda_allocator()}


GPU_FIELDS = ("clocks.sm", "clocks.max.sm", "clocks.mem", "temperature.gpu", "power.draw", "power.limit",
              "utilization.gpu")
"""What :func:`gpu_state` asks ``nvidia-smi`` for, then the active clock-limiting reasons under either
name drivers use (``clocks_event_reasons`` since 535, ``clocks_throttle_reasons`` before)."""
_REASONS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active", None)


def gpu_state(index: int | None = None) -> dict:
    """The GPU's clocks, temperature, power and throttle reasons now, and the other processes on it
    (``nvidia-smi``; empty where it is missing): a timed run that follows heavy work (a training
    run) may meet a throttled or shared GPU, which its figures alone would not tell. The GPU is
    named by its UUID; in a container nvidia-smi may list host process ids, so this process can
    count among the others there."""
    import os
    import subprocess

    if not torch.cuda.is_available():
        return {}
    index = torch.cuda.current_device() if index is None else index
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)  # the same GPU whatever the numbering
    gpu = f"GPU-{uuid}" if uuid else str(index)

    def query(*args: str) -> str | None:
        try:
            out = subprocess.run(["nvidia-smi", f"--id={gpu}", *args, "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    state = {}
    for reason in _REASONS:  # an unknown field fails the whole query: the older name, then none
        fields = [*GPU_FIELDS, *([reason] if reason else [])]
        line = query(f"--query-gpu={','.join(fields)}")
        values = [v.strip() for v in line.split(",")] if line else []
        if len(values) == len(fields):
            state = dict(zip([*GPU_FIELDS, *(["reasons"] if reason else [])], values))
            break
    if not state:
        return {}
    apps = query("--query-compute-apps=pid,used_memory") or ""
    others = [line.split(",")[0].strip() for line in apps.splitlines()
              if line.strip() and line.split(",")[0].strip() != str(os.getpid())]
    return {**state, "other_processes": others}


def format_gpu_state(state: dict) -> str:
    """One line of :func:`gpu_state`: ``SM 1980/1980 MHz, 45 C, 120/700 W, clock limits 0x0, other processes 0``."""
    if not state:
        return "no nvidia-smi"
    return (f"SM {state.get('clocks.sm')}/{state.get('clocks.max.sm')} MHz, {state.get('temperature.gpu')} C, "
            f"{state.get('power.draw')}/{state.get('power.limit')} W, clock limits {state.get('reasons', '?')}, "
            f"other processes {len(state.get('other_processes', []))}")


def cuda_allocator() -> dict:
    """The caching allocator's counters (does a compile leave it allocating from the driver each step?)."""
    if not torch.cuda.is_available():
        return {}
    st = torch.cuda.memory_stats()
    keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "segment.all.current",
            "allocation.all.current", "reserved_bytes.all.current")
    return {f"cuda_{k}": st.get(k) for k in keys}
