"""`ServeConfig`: how the HTTP server admits and drains requests."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """Settings of :func:`specdec.serve.create_app`.

    Attributes:
        model_name: the model id clients name in ``model`` (listed by ``/v1/models``).
        max_waiting: most requests waiting to run; one more is answered HTTP 429.
        drain_timeout_s: at shutdown, how long running requests may still run before they are aborted.
        disconnect_poll_s: how often a non-streamed request checks that its client is still there.
        freeze_heap: after the warm-up, collect once and freeze what survives (:func:`gc.freeze`)
            until shutdown, so that the collector's full passes, which stop every request, walk only
            what serving allocates (:mod:`specdec.heap`). ``False``: the collector as the process has it.

    Raises:
        ConfigError: a field is invalid (the message names it).
    """

    model_name: str
    max_waiting: int = 64
    drain_timeout_s: float = 30.0
    disconnect_poll_s: float = 0.5
    freeze_heap: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ConfigError(f"model_name must be a non-empty string, got {self.model_name!r}")
        if isinstance(self.max_waiting, bool) or not isinstance(self.max_waiting, int) or self.max_waiting < 1:
            raise ConfigError(f"max_waiting must be an integer >= 1, got {self.max_waiting!r}")
        for name in ("drain_timeout_s", "disconnect_poll_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be a number > 0, got {value!r}")
        if not isinstance(self.freeze_heap, bool):
            raise ConfigError(f"freeze_heap must be True or False, got {self.freeze_heap!r}")
