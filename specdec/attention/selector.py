"""Pick an attention backend for a phase shape (docs/design.md §4).

``select`` is the only place a backend is chosen. A requested backend is used
if it supports the shape and refused with the reason otherwise; it is never
replaced. Automatic selection takes the cheapest backend whose ``supports``
says yes, so a performance preference can never pick a backend that cannot
run the shape.

The registry holds backend classes, not instances: :func:`available_backends`
builds a fresh set from an :class:`~specdec.config.AttentionConfig`, and each
engine keeps its own set, so no backend option is shared between engines.
"""

from __future__ import annotations

from collections.abc import Iterable

from specdec.attention.backends.base import AttentionBackend
from specdec.attention.backends.helix_ref import HelixRefBackend
from specdec.attention.backends.torch_ref import TorchRefBackend
from specdec.attention.shapes import AttnShape
from specdec.config import AttentionConfig
from specdec.errors import ConfigError, UnsupportedShapeError

_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(backend: type[AttentionBackend]) -> type[AttentionBackend]:
    """Make the backend class ``backend`` available to :func:`select` under ``backend.name``.

    Returns:
        ``backend`` (usable as a class decorator).

    Raises:
        TypeError: ``backend`` is not an :class:`AttentionBackend` subclass (an instance would be
            shared by every engine; register its class).
    """
    if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
        raise TypeError(f"register_backend takes an AttentionBackend subclass (each engine builds its own "
                        f"instance with from_config), got {backend!r}")
    _BACKENDS[backend.name] = backend
    return backend


def available_backends(config: AttentionConfig | None = None) -> list[AttentionBackend]:
    """A new instance of every registered backend, built with ``config`` (each decides its own
    support, device included).

    Args:
        config: options of the backends (default: ``AttentionConfig()``).
    """
    config = config or AttentionConfig()
    return [cls.from_config(config) for cls in _BACKENDS.values()]


def get_backend(name: str, config: AttentionConfig | None = None) -> AttentionBackend:
    """A new instance of the registered backend called ``name``, built with ``config``
    (default: ``AttentionConfig()``).

    Raises:
        ConfigError: no backend has that name (the message lists the names).
    """
    if name not in _BACKENDS:
        raise ConfigError(f"attention_backend must be one of {sorted(_BACKENDS)} or None, got {name!r}")
    return _BACKENDS[name].from_config(config or AttentionConfig())


def select(
    shape: AttnShape,
    requested: str | None = None,
    backends: Iterable[AttentionBackend] | None = None,
) -> AttentionBackend:
    """The backend that runs ``shape``.

    Args:
        shape: one phase of a step.
        requested: a backend name the user forced, or ``None`` for automatic.
        backends: candidates (default: :func:`available_backends` with default options; an engine
            passes its own).

    Returns:
        ``requested`` if it supports ``shape``; otherwise, when nothing was
        requested, the supporting backend of lowest ``cost``.

    Raises:
        ConfigError: ``requested`` names no candidate (the message lists the names).
        UnsupportedShapeError: the requested backend does not support ``shape``,
            or (automatic) no candidate does; the message names backend, shape and reason.
    """
    pool = list(backends) if backends is not None else available_backends()
    if requested is not None:
        by_name = {b.name: b for b in pool}
        if requested not in by_name:
            raise ConfigError(f"attention_backend must be one of {sorted(by_name)} or None, got {requested!r}")
        verdict = by_name[requested].supports(shape)
        if not verdict.ok:
            raise UnsupportedShapeError(f"attention backend {requested!r} cannot run {shape}: {verdict.reason}")
        return by_name[requested]
    ok = [b for b in pool if b.supports(shape).ok]
    if not ok:
        reasons = "; ".join(f"{b.name}: {b.supports(shape).reason}" for b in pool)
        raise UnsupportedShapeError(f"no attention backend supports {shape} ({reasons})")
    return min(ok, key=lambda b: (b.cost(shape), b.name))


register_backend(TorchRefBackend)
register_backend(HelixRefBackend)

try:  # Triton kernels are optional (pip extra "gpu"); without triton only the reference is registered.
    import triton  # noqa: F401
except ImportError:
    triton = None
if triton is not None:
    from specdec.attention.backends.triton_gqa import TritonGQABackend

    register_backend(TritonGQABackend)
    from specdec.attention.backends.triton_mla import TritonMLABackend

    register_backend(TritonMLABackend)

# CuTe DSL MLA kernel (pip extra "cute"): imports without the package; supports() refuses every shape
# until its GPU tests pass (cute_mla.VALIDATED_SM) and cost() ranks it behind triton_mla until measured.
from specdec.attention.backends.cute_mla import CuteMLABackend  # noqa: E402

register_backend(CuteMLABackend)
