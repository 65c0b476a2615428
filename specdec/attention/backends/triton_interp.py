"""Triton's CPU interpreter (``TRITON_INTERPRET=1``): its known bugs, a probe, and the test-only fix.

The Triton backends run on the CPU only through Triton's interpreter, which
Triton chooses when a kernel is *decorated* (``TRITON_INTERPRET=1`` before the
backend module is imported). Triton 3.6's interpreter has two bugs that are
not kernel bugs (the compiled kernels are right):

- ``LOOP_BOUNDS``: loops whose bounds are runtime tensors fail with NumPy >= 2.4,
  the interpreter calling ``int()`` on a 1-element array
  (triton-lang/triton#9171, fixed upstream by the same ``reshape``);
- ``BF16_DOT``: ``tl.dot`` of bfloat16 operands multiplies their raw uint16
  bit patterns (triton-lang/triton#11584); tensor cores form the exact bf16
  products and accumulate them in fp32, which upcasting to fp32 first reproduces.

One mechanism for every backend:

- a backend's ``supports`` asks :func:`interpreter_refusal` (which probes the
  interpreter *as it is now*, :func:`interpreter_bugs`, cached) and refuses the
  CPU shapes the interpreter would get wrong, with the reason; importing a
  backend never changes Triton;
- tests (and ``bench/mla_decode.py --smoke``) fix the interpreter explicitly:
  :func:`fixed_interpreter` (a context manager; the ``fixed_triton_interpreter``
  fixture in ``tests/conftest.py`` wraps it), or :func:`fix_interpreter` /
  :func:`unfix_interpreter`. Both fixes are harmless where a bug is absent.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import triton.language as tl

LOOP_BOUNDS = "loop_bounds"
BF16_DOT = "bf16_dot"
BUGS: dict[str, str] = {
    LOOP_BOUNDS: "this Triton interpreter cannot run loops with runtime bounds (triton-lang/triton#9171, NumPy >= 2.4)",
    BF16_DOT: "this Triton interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584)",
}


def is_interpreted(kernel) -> bool:
    """Whether ``kernel`` (a ``@triton.jit`` object) was built for the CPU interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


# Probe kernels: plain functions, wrapped for the interpreter on first use (whatever TRITON_INTERPRET says).
def _probe_loop(X, n):
    acc = tl.load(X)
    for _ in range(0, n):
        acc += 1
    tl.store(X, acc)


def _probe_bf16_dot(A, C):
    offs = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
    a = tl.load(A + offs)
    tl.store(C + offs, tl.dot(a, a))



@functools.cache
def _interpreted(fn):
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn)


@functools.cache
def interpreter_bugs() -> frozenset[str]:
    """The known bugs (``LOOP_BOUNDS``, ``BF16_DOT``) present in Triton's interpreter as it is now.

    Probed once with two tiny kernels; :func:`fix_interpreter` / :func:`unfix_interpreter`
    clear the cache. Says nothing about compiled kernels (they have neither bug).
    """
    bugs = set()
    x = torch.zeros(1, dtype=torch.int32)
    try:
        _interpreted(_probe_loop)[(1,)](x, 3)
        loops_ok = int(x) == 3
    except Exception:  # the interpreter's error types vary across versions
        loops_ok = False
    if not loops_ok:
        bugs.add(LOOP_BOUNDS)
    a, c = torch.eye(16, dtype=torch.bfloat16) * 2, torch.zeros(16, 16)
    try:
        _interpreted(_probe_bf16_dot)[(1,)](a, c)
        dot_ok = bool(torch.equal(c, torch.eye(16) * 4))
    except Exception:
        dot_ok = False
    if not dot_ok:
        bugs.add(BF16_DOT)
    return frozenset(bugs)


def interpreter_refusal(*, loops: bool = True, bf16_dot: bool = False) -> str | None:
    """For a backend's ``supports`` on an interpreted (CPU) shape: why the interpreter would fail it, or None.

    Args:
        loops: the kernels have loops with runtime bounds (every attention kernel does).
        bf16_dot: the shape feeds bfloat16 operands to ``tl.dot``.
    """
    needed = ([LOOP_BOUNDS] if loops else []) + ([BF16_DOT] if bf16_dot else [])
    present = [b for b in needed if b in interpreter_bugs()]
    if not present:
        return None
    return "; ".join(BUGS[b] for b in present) + " (tests fix it: specdec.attention.backends.triton_interp)"


# --------------------------------------------------------------------------- the fix (tests, smoke benchmarks)

_ORIGINAL: dict[str, object] = {}  # the interpreter's own functions while our fix is installed


def fix_interpreter() -> frozenset[str]:
    """Patch Triton's interpreter so that both bugs are gone; idempotent.

    Returns the bugs present before the fix. Process-wide: call it from tests and
    tools, never from library code (a backend must not change Triton on import).
    """
    from triton.runtime import interpreter

    before = interpreter_bugs()
    if _ORIGINAL:
        return before
    patch_tensor, create_dot = interpreter._patch_lang_tensor, interpreter.InterpreterBuilder.create_dot

    def patched_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def patched_dot(self, a, b, d, *args):
        a = self.cast_impl(a, tl.float32) if a.dtype.scalar == tl.bfloat16 else a
        b = self.cast_impl(b, tl.float32) if b.dtype.scalar == tl.bfloat16 else b
        return create_dot(self, a, b, d, *args)

    _ORIGINAL.update(patch_lang_tensor=patch_tensor, create_dot=create_dot)
    interpreter._patch_lang_tensor, interpreter.InterpreterBuilder.create_dot = patched_lang_tensor, patched_dot
    interpreter_bugs.cache_clear()
    return before


def unfix_interpreter() -> None:
    """Undo :func:`fix_interpreter` (no-op when not installed)."""
    from triton.runtime import interpreter

    if not _ORIGINAL:
        return
    interpreter._patch_lang_tensor = _ORIGINAL.pop("patch_lang_tensor")
    interpreter.InterpreterBuilder.create_dot = _ORIGINAL.pop("create_dot")
    interpreter_bugs.cache_clear()


@contextlib.contextmanager
def fixed_interpreter() -> Iterator[frozenset[str]]:
    """``with fixed_interpreter() as bugs_before:`` the interpreter without its bugs; restored on exit
    (left fixed if it already was on entry)."""
    installed_here = not _ORIGINAL
    before = fix_interpreter()
    try:
        yield before
    finally:
        if installed_here:
            unfix_interpreter()
