"""Paged KV pool: the tensors of every layer that keeps context, page by page.

A pool holds several layers, each described by a :class:`LayerSpec`. Target
layers come first; a drafter's layers may be *appended* (docs/design.md §3) so one
page table per request addresses both. Every layer stores its cache flat over
slots, ``[num_pages * tokens_per_block, num_kv_heads, head_dim]``, where slot
``page * tokens_per_block + offset`` holds one token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdec.errors import ConfigError


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One cached layer.

    Attributes:
        kind: ``"gqa"`` (K and V per KV head) or ``"mla"`` (one latent "head").
        num_kv_heads: KV heads stored per token.
        head_dim: width of one K head.
        dtype: storage dtype.
        has_v: False for K-only layers (the MLA latent, kv_factor 1).
        v_head_dim: width of one V head (defaults to ``head_dim``).
        owner: ``"target"`` or ``"draft"``.
        kv_scale: per-tensor dequantization scale of an FP8 E4M3 layer (it stores
            ``value / kv_scale``); 1.0 for every other dtype.
    """

    kind: str
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    has_v: bool = True
    v_head_dim: int | None = None
    owner: str = "target"
    kv_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ("gqa", "mla"):
            raise ConfigError(f"LayerSpec.kind must be 'gqa' or 'mla', got {self.kind!r}")
        if self.num_kv_heads < 1 or self.head_dim < 1:
            raise ConfigError(
                f"LayerSpec.num_kv_heads and head_dim must be >= 1, got {self.num_kv_heads}, {self.head_dim}"
            )
        if self.v_head_dim is not None and self.v_head_dim < 1:
            raise ConfigError(f"LayerSpec.v_head_dim must be >= 1 or None, got {self.v_head_dim}")
        if self.kind == "mla" and self.num_kv_heads != 1:
            raise ConfigError(f"LayerSpec.num_kv_heads must be 1 for an 'mla' latent layer, got {self.num_kv_heads}")
        if self.owner not in ("target", "draft"):
            raise ConfigError(f"LayerSpec.owner must be 'target' or 'draft', got {self.owner!r}")
        if not (math.isfinite(self.kv_scale) and self.kv_scale > 0):
            raise ConfigError(f"LayerSpec.kv_scale must be a finite number > 0, got {self.kv_scale!r}")
        if self.kv_scale != 1.0 and self.dtype != torch.float8_e4m3fn:
            raise ConfigError(f"LayerSpec.kv_scale must be 1.0 unless dtype is torch.float8_e4m3fn, "
                              f"got kv_scale={self.kv_scale!r} with dtype={self.dtype}")

    @property
    def v_dim(self) -> int:
        return self.v_head_dim if self.v_head_dim is not None else self.head_dim

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        values = self.num_kv_heads * (self.head_dim + (self.v_dim if self.has_v else 0))
        return values * elem


def bytes_per_token(specs: tuple[LayerSpec, ...] | list[LayerSpec]) -> int:
    """Bytes one token occupies across ``specs`` (every layer of a pool)."""
    return sum(s.bytes_per_token for s in specs)


def _zeroed_views(layout: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Zeroed contiguous CPU tensors of ``layout`` (``(shape, dtype)`` pairs), all views of one byte
    buffer, each starting at a multiple of 64 bytes."""
    sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in layout]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + -(-n // 64) * 64)
    if not layout:
        return []
    buf = torch.zeros(starts[-1], dtype=torch.uint8)
    return [buf[at:at + n].view(dtype).view(shape) for (shape, dtype), at, n in zip(layout, starts, sizes)]


class KVPool:
    """Cache tensors for a list of layers over ``num_pages`` pages.

    Args:
        specs: the target's layers (appended draft layers come later).
        num_pages: pages in the pool.
        tokens_per_block: tokens per page.
        device: where the tensors live.
    """

    def __init__(self, specs, num_pages: int, tokens_per_block: int, device: str | torch.device = "cpu"):
        if num_pages < 1:
            raise ConfigError(f"num_pages must be >= 1, got {num_pages}")
        if tokens_per_block < 1:
            raise ConfigError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        self.num_pages = num_pages
        self.tokens_per_block = tokens_per_block
        self.device = torch.device(device)
        self.specs: list[LayerSpec] = []
        self.k: list[torch.Tensor] = []  # each [num_slots, num_kv_heads, head_dim]
        self.v: list[torch.Tensor | None] = []  # each [num_slots, num_kv_heads, v_dim] or None
        self.add_layers(specs)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.tokens_per_block

    def add_layers(self, specs) -> range:
        """Append layers (e.g. a drafter's) and return their indices in the pool.

        On the CPU the new layers' tensors are views of one zeroed buffer. As separate tensors of a
        few MB each (a default-sized pool), glibc would serve them from its heap once its mmap
        threshold has risen past their size (it rises to the largest block freed, up to 32 MB), and
        a dropped pool's memory would stay with the process; one large block is mapped on its own
        and returned to the system when its last view is freed.
        """
        specs = list(specs)
        start = len(self.specs)
        layout = []  # K, then V where the layer has one, layer by layer
        for s in specs:
            layout.append(((self.num_slots, s.num_kv_heads, s.head_dim), s.dtype))
            if s.has_v:
                layout.append(((self.num_slots, s.num_kv_heads, s.v_dim), s.dtype))
        if self.device.type == "cpu":
            tensors = iter(_zeroed_views(layout))
        else:
            tensors = iter([torch.zeros(shape, dtype=dtype, device=self.device) for shape, dtype in layout])
        for spec in specs:
            self.specs.append(spec)
            self.k.append(next(tensors))
            self.v.append(next(tensors) if spec.has_v else None)
        return range(start, len(self.specs))

    def layer_ids(self, owner: str) -> list[int]:
        """Indices of the layers owned by ``owner`` (``"target"`` or ``"draft"``)."""
        return [i for i, s in enumerate(self.specs) if s.owner == owner]

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(self.specs)

    @property
    def capacity_tokens(self) -> int:
        return self.num_slots
