"""The specdec exception family.

Every error a user can cause is a subclass of :class:`SpecDecError`, and its
message names the offending field and the values it may take.
"""

from __future__ import annotations


class SpecDecError(Exception):
    """Base class of every error specdec raises on purpose."""


class ConfigError(SpecDecError, ValueError):
    """A configuration or argument is invalid (names the field and allowed values)."""


class InvalidRequestError(ConfigError):
    """A request (prompt, sampling parameters) is invalid."""


class PromptTooLongError(InvalidRequestError):
    """A prompt does not fit in the model's maximum context."""


class UnknownRequestError(InvalidRequestError, KeyError):
    """A request id the engine does not know (never added, or already released).

    Also a ``KeyError``, so code that looked requests up like a dict keeps working."""

    __str__ = Exception.__str__  # KeyError would quote the whole message


class EngineClosedError(SpecDecError, RuntimeError):
    """The engine was closed (:meth:`specdec.SpecEngine.close`); build a new one."""


class UnknownTargetError(ConfigError):
    """A target name is neither a known model name nor an existing path."""


class CheckpointError(SpecDecError, FileNotFoundError):
    """A checkpoint is missing files or has an unexpected layout."""


class VocabMismatchError(ConfigError):
    """A drafter's vocabulary differs from the target's."""


class MissingHookError(ConfigError):
    """A drafter does not declare a hook the scheduler needs."""


class HelixConfigError(ConfigError):
    """A Helix setup that cannot run: ``helix_cp`` with a non-MLA target, heads it does not
    divide, or no process group of ``helix_cp`` ranks (docs/design.md §7)."""


class PoolExhaustedError(SpecDecError, RuntimeError):
    """The KV pool has no free page; the scheduler queues or preempts, never overwrites."""


class UnsupportedShapeError(SpecDecError, RuntimeError):
    """A requested attention backend does not support a batch shape."""
