"""The :class:`Drafter` protocol, its typed draft result, and the registry.

A drafter proposes tokens for a request; the target verifies them. The engine
drives every drafter through one explicit request lifecycle::

    start_request(req_id, prompt_token_ids)
    loop:  propose([req_id, ...], max_tokens) -> [Draft, ...]
           on_accepted(req_id, accepted_token_ids)
    stop_request(req_id)

and decides how to cache it only from the hooks below (docs/design.md §3); it
never branches on a drafter's class or name.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence as _SequenceABC
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ClassVar, Sequence

from specdec.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from specdec.kvcache.pool import LayerSpec

HOOKS = ("kv_layer_specs", "reads_managed_ctx_pages", "reads_helix_sharded_ctx_pages", "shift_label")


@dataclass(frozen=True, slots=True)
class Draft:
    """One proposal for one request: a chain of tokens, each continuing the one before it.

    Tree drafts are not offered until the engine verifies trees end to end; every field here
    is one the engine reads.

    Attributes:
        token_ids: drafted token ids, in proposal order. ``[k]``. A drafter on a GPU may leave
            them on the device (a :class:`DeviceIds`, from :class:`DraftsOnDevice`): the engine
            then feeds them to the target without waiting for them.
        probs: the drafter's distribution each token was sampled from,
            ``[k, vocab_size]``; ``None`` means deterministic (one-hot q).
        confidence: each token's probability of being accepted given that the tokens before
            it were, ``[k]`` floats in [0, 1]; ``None``: no estimate. With
            ``EngineConfig.draft_length="confidence"`` the engine cuts the draft by it
            (:mod:`specdec.draft_length`).
    """

    token_ids: tuple[int, ...] = ()
    probs: "torch.Tensor | None" = None
    confidence: tuple[float, ...] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)


EMPTY_DRAFT = Draft()


class DraftsOnDevice:
    """One propose's drafted tokens (and confidences) left on the device, so that the target's
    step can read them there: no host synchronisation between the propose and the step.

    The engine writes the tokens into the step's input on the device (``StepInput.draft_source``)
    and reads them on the host only after the step, through :meth:`host`: copies to pinned host
    memory are queued when the object is made (after the propose, before the step), so once the
    step has been waited for they have landed. A consumer that needs the values before the step
    (a confidence cut, a sampled request's coupling) calls :meth:`host` too: that waits.
    The host buffers belong to the drafter, which reuses them two proposes later (reading
    these values out first, ``BlockDrafter._on_device``).

    Args:
        tokens: ``[rows, width]`` integer token ids on the device. The step reads them clamped to
            ``[0, vocab_size)`` (an id out of range cannot read outside the embedding); the host
            reads them as they are, so the engine sees an id out of range and drops that draft.
        confidence: ``[rows, width]`` per-token acceptance probabilities, or ``None``.
        vocab_size: the target's vocabulary size.
        host_buffer: pinned int64 host memory of at least ``rows * width`` elements (and a float32
            one for the confidences) the drafter reuses between proposes; ``None``: allocated here.
    """

    __slots__ = ("flat", "width", "confidence", "_tokens_host", "_conf_host", "copied", "_host")

    def __init__(self, tokens: "torch.Tensor", confidence: "torch.Tensor | None", vocab_size: int,
                 host_buffer: "torch.Tensor | None" = None, conf_buffer: "torch.Tensor | None" = None):
        import torch

        rows, self.width = tokens.shape
        #: ``[rows * width]`` int64, contiguous, clamped into the vocabulary: what the step's input gathers from
        self.flat = tokens.to(torch.long).clamp(0, vocab_size - 1).reshape(-1)
        self.confidence = None if confidence is None else confidence.float().reshape(-1)
        cuda = self.flat.is_cuda
        n = self.flat.numel()
        if host_buffer is None or host_buffer.numel() < n:
            host_buffer = torch.empty(n, dtype=torch.long, pin_memory=cuda)
        self._tokens_host = host_buffer[:n]
        self._tokens_host.view(rows, self.width).copy_(tokens, non_blocking=cuda)  # as drafted
        self._conf_host = None
        if self.confidence is not None:
            if conf_buffer is None or conf_buffer.numel() < n:
                conf_buffer = torch.empty(n, dtype=torch.float32, pin_memory=cuda)
            self._conf_host = conf_buffer[:n]
            self._conf_host.copy_(self.confidence, non_blocking=cuda)
        #: a CUDA event after the host copies (``None`` on the CPU, where they are done)
        self.copied = None
        if cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()
        self._host = None

    def host(self) -> "tuple[list[int], list[float] | None]":
        """The tokens (and confidences) on the host, flat (``row * width + j``); waits for their
        copy (only the propose's work, or nothing if the step was already waited for)."""
        if self._host is None:
            if self.copied is not None:
                self.copied.synchronize()
            self._host = (self._tokens_host.tolist(),
                          None if self._conf_host is None else self._conf_host.tolist())
        return self._host

    @property
    def fetched(self) -> bool:
        """Whether :meth:`host` has run (its values are then read without waiting)."""
        return self._host is not None

    def ids(self, row: int, n: int) -> "DeviceIds":
        """Row ``row``'s first ``n`` tokens as a lazy sequence (``Draft.token_ids``)."""
        return DeviceIds(self, row * self.width, n, False)

    def confidences(self, row: int, n: int) -> "DeviceIds | None":
        """Row ``row``'s first ``n`` confidences as a lazy sequence, or ``None`` without them."""
        return None if self.confidence is None else DeviceIds(self, row * self.width, n, True)


class DeviceIds(_SequenceABC):
    """Part of a :class:`DraftsOnDevice`: ``n`` values from flat index ``start``, token ids (or
    confidences, ``conf``). Its length and prefixes need nothing from the device; reading a value
    waits for the copy (:meth:`DraftsOnDevice.host`)."""

    __slots__ = ("source", "start", "n", "conf")

    def __init__(self, source: DraftsOnDevice, start: int, n: int, conf: bool):
        self.source, self.start, self.n, self.conf = source, start, n, conf

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        if isinstance(i, slice) and i.start in (None, 0) and i.step in (None, 1):  # a prefix: still lazy
            stop = self.n if i.stop is None else max(0, min(self.n, i.stop if i.stop >= 0 else self.n + i.stop))
            return DeviceIds(self.source, self.start, stop, self.conf)
        return self.values()[i]

    def __iter__(self):
        return iter(self.values())

    def values(self) -> tuple:
        """The values on the host (waits for their copy)."""
        ids, conf = self.source.host()
        return tuple((conf if self.conf else ids)[self.start:self.start + self.n])

    def __eq__(self, other) -> bool:
        return isinstance(other, _SequenceABC) and tuple(self) == tuple(other)

    __hash__ = None

    def __repr__(self) -> str:
        what = "confidences" if self.conf else "token ids"
        if not self.source.fetched:
            return f"DeviceIds({self.n} {what} on the device)"
        return f"DeviceIds({self.values()!r})"


def on_device(draft: Draft) -> DraftsOnDevice | None:
    """The :class:`DraftsOnDevice` ``draft``'s tokens are still on, or ``None`` (host tokens)."""
    ids = draft.token_ids
    return ids.source if isinstance(ids, DeviceIds) else None


def to_host(draft: Draft) -> Draft:
    """``draft`` with its tokens and confidences as host tuples (waits for them if on the device)."""
    if on_device(draft) is None and not isinstance(draft.confidence, DeviceIds):
        return draft
    conf = draft.confidence
    return Draft(tuple(draft.token_ids), draft.probs, None if conf is None else tuple(conf))


class Drafter:
    """Base class of every drafter; defaults describe a model-free drafter.

    Subclasses override :meth:`propose` and whichever lifecycle methods they
    need. The hooks (class attributes and methods named in ``HOOKS``) are read
    by the scheduler at engine build.
    """

    #: Registry name; set by :func:`register_drafter`.
    name: ClassVar[str] = ""
    #: A drafter that never proposes a token (the null drafter): the engine reserves no draft slots
    #: for it and may overlap its decode steps. Declared, so the engine never tests a drafter's class.
    never_drafts: ClassVar[bool] = False
    #: Whether the engine measures each batch size's best draft length (its draft gate,
    #: :class:`specdec.draft_gate.DraftGate`) when ``EngineConfig.draft_gate`` is ``None``, the
    #: default: a drafter whose propose costs about a target step (a learned one on a small target)
    #: pays at small batches and not at large ones. Model-free drafters: ``False``.
    gated_by_default: ClassVar[bool] = False
    #: Output slot ``i`` predicts position ``anchor + i + shift_label`` (docs/design.md §5).
    shift_label: int = 1
    #: Whether its attention can read context pages sharded across Helix ranks.
    reads_helix_sharded_ctx_pages: bool = False
    #: Vocabulary size the drafter proposes over; ``None`` means "any" (model-free).
    vocab_size: int | None = None
    #: Target layers whose hidden states the drafter consumes (empty: none).
    target_layer_ids: tuple[int, ...] = ()

    def kv_layer_specs(self) -> "tuple[LayerSpec, ...]":
        """The drafter's own KV layers; empty for model-free drafters."""
        return ()

    def reads_managed_ctx_pages(self, tokens_per_block: int) -> bool:
        """Whether its attention reads context KV from managed pages of this size."""
        return False

    def bind(self, target, kv) -> None:
        """Called once by the engine: the target (embedding, LM head, sizes) and the
        drafter's KV view (:class:`specdec.kvcache.DraftKV`, or ``None`` without KV layers).
        Raises a ConfigError naming the field if the drafter does not fit the target."""

    def start_request(self, req_id: str, prompt_token_ids: Sequence[int]) -> None:
        """Begin tracking a request whose prompt is ``prompt_token_ids``."""

    def on_context(self, req_id: str, start: int, hidden: "torch.Tensor") -> None:
        """Target hidden states of newly *accepted* positions ``start ..``.

        Args:
            hidden: ``[n, len(target_layer_ids) * hidden_size]``, the chosen layers concatenated.
        """

    def on_contexts(self, spans: Sequence[tuple[str, int, int, int]], hidden: "torch.Tensor") -> None:
        """Many requests' newly accepted positions at once (the engine calls this once per step).

        Args:
            spans: ``(req_id, start, row, n)``: ``hidden[row : row + n]`` are the request's
                positions ``start .. start + n - 1``.
            hidden: ``[num_tokens, len(target_layer_ids) * hidden_size]``.

        The default calls :meth:`on_context` per request; drafters that can batch override it.
        """
        for req_id, start, row, n in spans:
            self.on_context(req_id, start, hidden[row:row + n])

    def propose(self, req_ids: Sequence[str], max_tokens: int) -> list[Draft]:
        """Propose up to ``max_tokens`` tokens for each request (``[] `` drafts allowed)."""
        return [EMPTY_DRAFT for _ in req_ids]

    def on_accepted(self, req_id: str, token_ids: Sequence[int]) -> None:
        """Tokens the target emitted for ``req_id`` this step (accepted + bonus)."""

    def stop_request(self, req_id: str) -> None:
        """Forget a finished request."""

    def abort_request(self, req_id: str) -> None:
        """Forget an aborted request (its output is not a finished response: a drafter that learns
        from responses should not learn from it). Default: :meth:`stop_request`."""
        self.stop_request(req_id)

    def overlap(self) -> None:
        """Host work that does not need the current step's result, run while the device
        computes the step (e.g. indexing a finished response). Called once per step."""

    def capture_graphs(self, max_requests: int, max_context: int) -> int:
        """Prepare (e.g. capture the CUDA graphs of) every propose shape of up to ``max_requests``
        requests and ``max_context`` context tokens now, so that no step pays for it
        (:meth:`SpecEngine.capture_graphs` calls it). Returns how many were prepared; default 0."""
        return 0


_REGISTRY: dict[str, type[Drafter]] = {}


def register_drafter(name: str) -> Callable[[type[Drafter]], type[Drafter]]:
    """Class decorator: make a drafter constructible by ``name``."""

    def wrap(cls: type[Drafter]) -> type[Drafter]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ConfigError(f"drafter name {name!r} is already registered to {_REGISTRY[name].__name__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def available_drafters() -> list[str]:
    """Names accepted by :func:`make_drafter`."""
    return sorted(_REGISTRY)


def make_drafter(name: str, **kwargs) -> Drafter:
    """Build a registered drafter by name.

    Raises:
        ConfigError: ``name`` is not registered (the message lists the names), or an option is not
            one the drafter takes (the message lists its options).
    """
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ConfigError(f"drafter must be one of {available_drafters()}, got {name!r}")
    cls = _REGISTRY[name]
    params = inspect.signature(cls).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        options = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        unknown = sorted(set(kwargs) - set(options))
        if unknown:
            raise ConfigError(f"drafter {name!r} has no option {', '.join(map(repr, unknown))}; "
                              f"its options: {', '.join(options) or 'none'}")
    return cls(**kwargs)


def check_hooks(drafter: object) -> None:
    """Raise :class:`MissingHookError` naming the first hook ``drafter`` lacks."""
    from specdec.errors import MissingHookError

    for hook in HOOKS:
        if not hasattr(drafter, hook):
            raise MissingHookError(
                f"drafter {type(drafter).__name__} does not declare the hook {hook!r} "
                f"(every drafter must declare {', '.join(HOOKS)}; subclass specdec.drafters.Drafter)"
            )


@register_drafter("null")
class NullDrafter(Drafter):
    """Proposes nothing (k = 0): the engine then decodes one token per step.

    Every lossless test compares a drafter against this one on the same engine.
    """

    never_drafts = True
