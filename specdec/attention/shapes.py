"""What a backend is asked to run: :class:`AttnShape`, and its answer, :class:`Verdict`.

Backends decide from an ``AttnShape`` alone (docs/design.md §4). One shape describes
one *phase* of a step: the context part or the generation part of a batch
(the generation part of a mixed batch is a generation batch, with
``mixed=True``).
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.errors import ConfigError

PHASES = ("context", "generation")
KINDS = ("gqa", "mla")


@dataclass(frozen=True, slots=True)
class AttnShape:
    """The correctness-relevant facts of one attention phase.

    Attributes:
        phase: ``"context"`` (prompt written into the cache) or ``"generation"``
            (decode, ``max_q_len == 1``, or verify, ``max_q_len > 1``).
        kind: ``"gqa"`` or ``"mla"`` (latent cache, one KV head).
        num_heads: query heads per rank (H).
        num_kv_heads: KV heads per rank (1 for MLA).
        head_dim: Q/K width (576 for absorbed MLA: 512 latent + 64 rope).
        v_head_dim: V/output width (512 for absorbed MLA).
        tokens_per_block: page size in tokens.
        max_q_len: most query tokens of one request in this phase.
        kv_dtype: cache dtype name (``"float32"``, ``"bfloat16"``, ``"float8_e4m3fn"``).
        q_dtype: query dtype name.
        device: ``"cpu"`` or ``"cuda"``.
        sm: GPU compute capability as an int (90 for H100/H200), ``None`` on CPU.
        helix_cp: Helix context-parallel ranks (1 = off).
        mixed: this generation phase shares its step with a context phase.
    """

    phase: str
    kind: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    tokens_per_block: int
    max_q_len: int
    kv_dtype: str = "float32"
    q_dtype: str = "float32"
    device: str = "cpu"
    sm: int | None = None
    helix_cp: int = 1
    mixed: bool = False

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ConfigError(f"AttnShape.phase must be one of {PHASES}, got {self.phase!r}")
        if self.kind not in KINDS:
            raise ConfigError(f"AttnShape.kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("num_heads", "num_kv_heads", "head_dim", "v_head_dim", "tokens_per_block", "max_q_len", "helix_cp"):
            if getattr(self, name) < 1:
                raise ConfigError(f"AttnShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"AttnShape.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )


@dataclass(frozen=True, slots=True)
class Verdict:
    """A backend's answer to "can you run this shape?", with the reason when not."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


YES = Verdict(True)


def no(reason: str) -> Verdict:
    """A refusal with its reason."""
    return Verdict(False, reason)
