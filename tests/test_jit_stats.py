"""``specdec.jit_stats``: the count of Triton kernels built, which ``specdec serve`` exports so that a
load can tell whether its steps met first-time compiles."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="Triton is not installed")

import specdec.attention.backends.triton_gqa as gqa  # noqa: E402
import specdec.sampling_kernel as sk  # noqa: E402
import specdec.target.kernels as kernels  # noqa: E402
from specdec.jit_stats import triton_kernels, triton_kernels_built, triton_kernels_built_by_function  # noqa: E402


def test_the_kernels_listed_are_specdecs_own_each_once():
    fns = triton_kernels()
    assert len({id(f) for f in fns}) == len(fns)
    names = {f"{f.fn.__module__}.{f.fn.__name__}" for f in fns}
    assert "specdec.target.kernels._linear_kernel" in names
    assert "specdec.attention.backends.triton_gqa._merge_splits_kernel" in names
    assert any(n.startswith("specdec.sampling_kernel.") for n in names)
    assert all(n.startswith("specdec.") for n in names)
    assert fns == triton_kernels()  # a fixed order


def test_the_count_is_the_kernels_in_their_caches_over_every_device():
    before = triton_kernels_built()
    assert before >= 0
    fake = "test-device"
    try:  # the cache layout Triton keeps per device: (kernels, keys, target, backend, binder)
        kernels._linear_kernel.device_caches[fake] = ({"a": object(), "b": object()}, {}, None, None, None)
        gqa._merge_splits_kernel.device_caches[fake] = ({"c": object()}, {}, None, None, None)
        assert triton_kernels_built() == before + 3
    finally:
        kernels._linear_kernel.device_caches.pop(fake, None)
        gqa._merge_splits_kernel.device_caches.pop(fake, None)
    assert triton_kernels_built() == before
    assert sk  # imported so that its kernels are listed


def test_by_function_names_only_the_functions_that_built_kernels():
    fake = "test-device"
    before = triton_kernels_built_by_function()
    try:
        kernels._linear_kernel.device_caches[fake] = ({"a": object()}, {}, None, None, None)
        got = triton_kernels_built_by_function()
        name = "specdec.target.kernels:_linear_kernel"
        assert got[name] == before.get(name, 0) + 1
        assert {k: v for k, v in got.items() if k != name} == {k: v for k, v in before.items() if k != name}
    finally:
        kernels._linear_kernel.device_caches.pop(fake, None)
