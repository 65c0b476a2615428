"""How many of specdec's Triton kernels this process has built so far.

Triton builds a kernel the first time it meets a new specialisation of it (its constexpr values,
its integer arguments' divisibility by 16 or equality to 1, its pointers' alignment): a compile of
about 0.5-1 s on a GPU, or a load from Triton's on-disk cache where an earlier process compiled the
same one (milliseconds). A step that meets one stalls. :meth:`SpecEngine.warm_up` runs every kind of
step so that serving meets none; this count says whether it did: read it after the warm-up and
again after a load (``specdec serve`` exports it as ``specdec_triton_kernels_built``;
``bench/serve.py`` reports it per load).
"""

from __future__ import annotations

import sys

__all__ = ["triton_kernels_built", "triton_kernels", "triton_kernels_built_by_function"]


def triton_kernels() -> list:
    """Every ``@triton.jit`` function defined in a loaded ``specdec`` module (autotuned and
    heuristic wrappers unwrapped), each once, in a fixed order."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return []
    seen, out = set(), []
    # copies: another thread may import (Triton's compiler does, mid-step) while this one reads
    for name in sorted(m for m in list(sys.modules) if m == "specdec" or m.startswith("specdec.")):
        module = sys.modules.get(name)
        if module is None:
            continue
        for value in list(vars(module).values()):
            fn, hops = value, 0
            while not isinstance(fn, JITFunction) and hasattr(fn, "fn") and hops < 4:  # Autotuner, Heuristics
                fn, hops = fn.fn, hops + 1
            if isinstance(fn, JITFunction) and id(fn) not in seen:
                seen.add(id(fn))
                out.append(fn)
    return out


def triton_kernels_built_by_function() -> dict[str, int]:
    """Kernels built so far by each of specdec's Triton functions that built any, by
    ``module:function`` (which kernel a stall came from)."""
    out = {}
    for fn in triton_kernels():
        n = sum(len(entry[0]) for entry in list(getattr(fn, "device_caches", {}).values()))  # (kernels, keys, ...)
        if n:
            out[f"{fn.fn.__module__}:{fn.fn.__name__}"] = n
    return out


def triton_kernels_built() -> int:
    """Kernels built (compiled, or loaded from Triton's on-disk cache) by specdec's Triton functions
    in this process so far, over every device: the sum of their in-memory kernel caches. 0 without
    Triton, and under its CPU interpreter (nothing is built)."""
    return sum(triton_kernels_built_by_function().values())
