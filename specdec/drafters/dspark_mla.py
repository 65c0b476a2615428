"""DSpark with MLA attention: a block drafter whose context is a K-only latent.

The network is :mod:`specdec.drafters.block`'s DSpark (``shift_label = 1``,
target hidden states projected by ``fc`` into context features, a block of
``B`` slots with no causal mask inside it), but every attention layer is
DeepSeek-style MLA, absorbed as in :mod:`specdec.target.mla` (docs/design.md §4):
a position's context is stored as one latent "head" ``[c_kv, k_rope]`` of
``kv_lora_rank + qk_rope_head_dim`` values, K only (kv_factor 1, ``V = c_kv``).
That is the layout of an MLA target's own layers, so the drafter's layers are
appended to the target's pool (one page table per request, rolled back with
the target's) whenever the page size is one its attention reads.

Its attention reads the latent pages itself (a gather by page table, then
attention over ``[context ; block]``), which works for every page size the
engine allows; ``ctx_page_sizes`` narrows that for a kernel that reads fewer,
and :meth:`reads_managed_ctx_pages` answers from it, nothing else.

Under Helix (docs/design.md §7) it reads a context sharded across the ranks
(``reads_helix_sharded_ctx_pages``): its layers join the target's sharded pool,
each rank writes the context positions it owns, and every block attends over
the rank's shard, producing partial outputs with their log-sum-exp that one
all-gather per layer merges exactly (:func:`~specdec.parallel.helix.merge_over_ranks`)
with the block's attention to itself.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.drafters.base import register_drafter
from specdec.drafters.block import (_linear, _Norm, block_mask, draft_from_hidden, load_weights, mlp, output_slots,
                                    save_net)
from specdec.drafters.dflash import BlockDrafter
from specdec.errors import CheckpointError, ConfigError, InvalidRequestError
from specdec.kvcache.pool import LayerSpec
from specdec.layers import fast_rms_norm as _rms
from specdec.layers import rope_cos_sin, rotate
from specdec.parallel.helix import HelixShard, latent_attention_lse, merge_over_ranks

#: Page sizes the latent gather reads: every size ``EngineConfig.tokens_per_block`` allows.
LATENT_PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True, slots=True)
class MLABlockDrafterConfig:
    """Shape of an MLA block drafter (stored as config.json beside the weights).

    Attributes:
        block_size: slots per draft block (B >= 2).
        target_layer_ids: target layers whose hidden states condition the drafter.
        target_hidden_size: width of those hidden states.
        vocab_size: the target's vocabulary (its embedding and LM head are used).
        hidden_size, num_layers, num_heads, intermediate_size: the network.
        kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: MLA dims, as in DeepSeek-V3.
        mask_token_id: token id fed to slots 1..B-1.
        rms_norm_eps, rope_theta: norms and rope.
        shift_label: 1 (DSpark: every slot drafts); 0 is accepted for a DFlash-style net.
        ctx_page_sizes: KV page sizes its context attention reads (a subset of ``LATENT_PAGE_SIZES``).
    """

    block_size: int
    target_layer_ids: tuple[int, ...]
    target_hidden_size: int
    vocab_size: int
    hidden_size: int
    num_layers: int = 1
    num_heads: int = 4
    kv_lora_rank: int = 64
    qk_nope_head_dim: int = 32
    qk_rope_head_dim: int = 16
    v_head_dim: int = 32
    intermediate_size: int = 256
    mask_token_id: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    shift_label: int = 1
    ctx_page_sizes: tuple[int, ...] = LATENT_PAGE_SIZES

    def __post_init__(self) -> None:
        output_slots(self.block_size, self.shift_label)  # validates both
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        object.__setattr__(self, "ctx_page_sizes", tuple(int(i) for i in self.ctx_page_sizes))
        if not self.target_layer_ids:
            raise ConfigError("target_layer_ids must name at least one target layer, got ()")
        for name in ("target_hidden_size", "vocab_size", "hidden_size", "num_layers", "num_heads",
                     "intermediate_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id must be in [0, {self.vocab_size}), got {self.mask_token_id}")
        bad = [p for p in self.ctx_page_sizes if p not in LATENT_PAGE_SIZES]
        if not self.ctx_page_sizes or bad:
            raise ConfigError(f"ctx_page_sizes must be a non-empty subset of {LATENT_PAGE_SIZES}, "
                              f"got {self.ctx_page_sizes}")

    @property
    def cache_dim(self) -> int:
        """Values cached per token and layer: latent + rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def draft_width(self) -> int:
        return len(output_slots(self.block_size, self.shift_label))

    def to_json(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"], d["ctx_page_sizes"] = list(self.target_layer_ids), list(self.ctx_page_sizes)
        return d


class _MLALayer(nn.Module):
    """One decoder layer with absorbed MLA attention (DeepSeek-V3 weight names, ``q_proj`` without LoRA)."""

    def __init__(self, c: MLABlockDrafterConfig):
        super().__init__()
        D, H, r, rope = c.hidden_size, c.num_heads, c.kv_lora_rank, c.qk_rope_head_dim
        self.c = c
        self.input_layernorm, self.post_attention_layernorm = _Norm(D), _Norm(D)
        a = self.self_attn = nn.Module()
        a.q_proj = _linear(D, H * (c.qk_nope_head_dim + rope))
        a.kv_a_proj_with_mqa = _linear(D, r + rope)
        a.kv_a_layernorm = _Norm(r)
        a.kv_b_proj = _linear(r, H * (c.qk_nope_head_dim + c.v_head_dim))
        a.o_proj = _linear(H * c.v_head_dim, D)
        m = self.mlp = nn.Module()
        m.gate_proj, m.up_proj = _linear(D, c.intermediate_size), _linear(D, c.intermediate_size)
        m.down_proj = _linear(c.intermediate_size, D)

    def latent(self, h: torch.Tensor, rope) -> torch.Tensor:
        """What a position caches: ``[..., hidden]`` → ``[..., 1, r + rope]`` (``c_kv``, then roped ``k_rope``).

        ``rope``: ``(cos, sin)`` ``[..., 1, qk_rope_head_dim]`` of the positions (:func:`rope_cos_sin`).
        """
        c = self.c
        c_kv, k_rope = self.self_attn.kv_a_proj_with_mqa(h).split([c.kv_lora_rank, c.qk_rope_head_dim], -1)
        c_kv = _rms(c_kv, self.self_attn.kv_a_layernorm.weight, c.rms_norm_eps)
        return torch.cat([c_kv[..., None, :], rotate(k_rope[..., None, :], *rope)], -1)

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK`` ``[H, nope, r]`` and ``W_UV`` ``[H, v, r]`` from ``kv_b_proj``."""
        c = self.c
        w = self.self_attn.kv_b_proj.weight.view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        return w[:, : c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]

    def attention(self, h: torch.Tensor, rope, ctx: torch.Tensor, mask: torch.Tensor,
                  shard: HelixShard | None = None) -> torch.Tensor:
        """Absorbed MLA of the block over ``[context ; block]`` latents.

        Args:
            h: normalised block states ``[N, B, hidden]``.
            rope: ``(cos, sin)``, each ``[N, B, 1, qk_rope_head_dim]``, of the slots' positions.
            ctx: context latents ``[N or 1, Lc, 1, r + rope]`` (under Helix: this rank's shard).
            mask: ``[N, 1, 1, Lc + B]``, True = attend.
            shard: under Helix, this rank's part: the context is its shard, and the partial
                attention of every rank is merged with the block's own (one all-gather).

        Returns:
            ``[N, B, hidden]``.
        """
        c = self.c
        N, B, _ = h.shape
        H, nope, r = c.num_heads, c.qk_nope_head_dim, c.kv_lora_rank
        scale = (nope + c.qk_rope_head_dim) ** -0.5
        w_uk, w_uv = self._kv_b()
        q_nope, q_rope = self.self_attn.q_proj(h).view(N, B, H, -1).split([nope, c.qk_rope_head_dim], -1)
        q_lat = torch.einsum("nbhd,hdr->nbhr", q_nope, w_uk)  # [N, B, H, r]
        q = torch.cat([q_lat, rotate(q_rope, *rope)], -1)  # [N, B, H, r + rope]
        ctx, blk = ctx.expand(N, -1, -1, -1).to(q.dtype), self.latent(h, rope)  # [N, Lc, 1, r+rope], [N, B, 1, r+rope]
        if shard is not None:
            Lc = ctx.shape[1]
            part = latent_attention_lse(q, ctx[:, :, 0], mask[:, 0, :, :Lc], scale, r)  # [N, B, H, r], [N, B, H]
            own = latent_attention_lse(q, blk[:, :, 0], mask[:, 0, :, Lc:], scale, r)  # the block, same on every rank
            o = merge_over_ranks(*part, shard.group, extra=own).to(q.dtype)  # [N, B, H, r]
            o = torch.einsum("nbhr,hvr->nbhv", o, w_uv)  # [N, B, H, v]
            return self.self_attn.o_proj(o.reshape(N, B, H * c.v_head_dim))
        k = torch.cat([ctx, blk], 1).transpose(1, 2)  # [N, 1, Lc + B, r + rope]
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k, k[..., :r], attn_mask=mask, scale=scale,
                                           enable_gqa=H > 1)  # [N, H, B, r]
        o = torch.einsum("nhbr,hvr->nbhv", o, w_uv)  # [N, B, H, v]
        return self.self_attn.o_proj(o.reshape(N, B, H * c.v_head_dim))


class MLABlockDrafterNet(nn.Module):
    """The trainable part of an MLA block drafter (fc, hidden_norm, MLA layers, norm).

    Same interface as :class:`~specdec.drafters.block.BlockDrafterNet`, except that
    :meth:`context_kv` returns ``(latent, None)``: there is no V to cache.
    """

    def __init__(self, config: MLABlockDrafterConfig):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(len(c.target_layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = _Norm(c.hidden_size)
        self.layers = nn.ModuleList(_MLALayer(c) for _ in range(c.num_layers))
        self.norm = _Norm(c.hidden_size)

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """``[n, len(target_layer_ids) * target_hidden]`` → context features ``[n, hidden]``."""
        return _rms(self.fc(target_hidden.to(self.fc.weight.dtype)), self.hidden_norm.weight, self.config.rms_norm_eps)

    def context_kv(self, i: int, ctx: torch.Tensor, positions: torch.Tensor, rope=None) -> tuple[torch.Tensor, None]:
        """Layer ``i``'s cached latent of context features ``[..., hidden]``: ``([..., 1, r + rope], None)``.

        ``rope``: the positions' ``(cos, sin)`` if already looked up, else computed.
        """
        c = self.config
        if rope is None:
            rope = rope_cos_sin(positions, c.qk_rope_head_dim, c.rope_theta, ctx.device)
        return self.layers[i].latent(ctx, rope), None

    @property
    def rope_dim(self) -> int:
        """Width RoPE rotates (``qk_rope_head_dim``)."""
        return self.config.qk_rope_head_dim

    def forward_block(self, x: torch.Tensor, positions: torch.Tensor, ctx_kv, ctx_valid: torch.Tensor) -> torch.Tensor:
        """Run the block through every layer.

        Args:
            x: block embeddings ``[N, B, hidden]``.
            positions: ``[N, B]`` absolute positions of the slots.
            ctx_kv: per layer ``(latent, None)``, latent ``[N or 1, Lc, 1, r + rope]``.
            ctx_valid: ``[N, Lc]`` which context keys each block may see.

        Returns:
            normalised hidden states ``[N, B, hidden]`` (feed to the target's LM head).
        """
        c = self.config
        rope = rope_cos_sin(positions, c.qk_rope_head_dim, c.rope_theta, x.device)
        return self.run_block(x, rope, ctx_kv, block_mask(ctx_valid, x.shape[1]))

    def run_block(self, x: torch.Tensor, rope, ctx_kv, mask: torch.Tensor, shard: HelixShard | None = None
                  ) -> torch.Tensor:
        """:meth:`forward_block` with its RoPE factors and mask already made (see
        :meth:`specdec.drafters.block.BlockDrafterNet.run_block`).

        Args:
            x: block embeddings ``[N, B, hidden]``.
            rope: ``(cos, sin)``, each ``[N, B, 1, qk_rope_head_dim]`` fp32.
            ctx_kv: per layer ``(latent, None)``, latent ``[N or 1, Lc, 1, r + rope]``.
            mask: ``[N, 1, 1, Lc + B]`` (:func:`~specdec.drafters.block.block_mask`).
            shard: under Helix, this rank's part (``ctx_kv`` is then its shard; see :meth:`_MLALayer.attention`).
        """
        c = self.config
        for L, (latent, _) in zip(self.layers, ctx_kv):
            x = x + L.attention(_rms(x, L.input_layernorm.weight, c.rms_norm_eps), rope, latent, mask, shard)
            x = x + mlp(L.mlp, _rms(x, L.post_attention_layernorm.weight, c.rms_norm_eps))
        return _rms(x, self.norm.weight, c.rms_norm_eps)

    def save(self, path: str | Path) -> None:
        """Write ``config.json`` + the weights (:func:`specdec.drafters.block.save_net`; the target's
        embedding/LM head are not stored)."""
        save_net(self, path, "SpecdecMLABlockDrafter")

    @classmethod
    def load(cls, path: str | Path) -> "MLABlockDrafterNet":
        """Load a checkpoint written by :meth:`save`.

        Raises:
            CheckpointError: missing files, another architecture, or missing weights.
        """
        from specdec.target.loading import read_safetensors_dir

        path = Path(path)
        if not (path / "config.json").is_file():
            raise CheckpointError(f"drafter checkpoint {str(path)!r} has no config.json")
        cfg = json.loads((path / "config.json").read_text())
        if cfg.pop("architectures", [""])[0] != "SpecdecMLABlockDrafter":
            raise CheckpointError(f"drafter checkpoint {str(path)!r} is not an MLA block drafter "
                                  f"(config.json architectures must be ['SpecdecMLABlockDrafter'])")
        try:
            net = cls(MLABlockDrafterConfig(**cfg))
        except TypeError as e:
            raise CheckpointError(f"drafter config.json in {str(path)!r} has unexpected fields: {e}") from None
        return load_weights(net, read_safetensors_dir(path), path)


@register_drafter("dspark_mla")
class MLADSparkDrafter(BlockDrafter):
    """DSpark (``shift_label = 1``, every slot drafts) with MLA layers over a K-only latent context.

    Args:
        net: an :class:`MLABlockDrafterNet`, or a directory written by its ``save``.
    """

    expected_shift = 1
    shift_label = 1
    net_class = MLABlockDrafterNet
    #: Its attention merges partials over a context sharded across Helix ranks (see the module doc).
    reads_helix_sharded_ctx_pages = True

    def kv_layer_specs(self) -> tuple[LayerSpec, ...]:
        """One K-only latent layer per drafter layer: one "head" of ``kv_lora_rank + rope`` values, no V."""
        c, dtype = self.config, self.net.fc.weight.dtype
        return tuple(LayerSpec("mla", 1, c.cache_dim, dtype, has_v=False, owner="draft") for _ in range(c.num_layers))

    def bind(self, target, kv) -> None:
        super().bind(target, kv)
        if self._shard is not None:  # every propose exchanges partials between ranks: no padded graph buckets
            self.pad_shapes = False

    @property
    def _shard(self) -> HelixShard | None:
        """This rank's Helix part when the context pages are sharded, else ``None``."""
        return getattr(self.kv, "shard", None)

    @torch.inference_mode()
    def on_contexts(self, spans, hidden: torch.Tensor) -> None:
        """As :meth:`BlockDrafter.on_contexts`; under Helix only the positions this rank owns are
        written (split into the page runs it owns), while the context length stays global."""
        shard = self._shard
        if shard is None:
            return super().on_contexts(spans, hidden)
        owned, ends = [], {}
        for req_id, start, row, n in spans:
            if req_id not in self._tokens:
                raise InvalidRequestError(f"unknown request {req_id!r}")
            ends[req_id] = start + n
            owned += [(req_id, a, row + a - start, b - a) for a, b in shard.layout.owned_runs(start, start + n,
                                                                                             shard.rank)]
        if owned:
            super().on_contexts(owned, hidden)
        self._ctx_len.update(ends)

    def _draft(self, packed: torch.Tensor, cols: int, width: int):
        """As :meth:`BlockDrafter._draft`; under Helix each block reads this rank's shard of the
        context (its local pages, masked past each request's global length) and merges."""
        shard = self._shard
        if shard is None:
            return super()._draft(packed, cols, width)
        c, tpb, B = self.config, self.kv.tokens_per_block, self.config.block_size
        ids, pos, lens, pages = packed[:, :B], packed[:, B:2 * B], packed[:, 2 * B:2 * B + 1], packed[:, 2 * B + 1:]
        local_pages = -(-pages.shape[1] // shard.cp)  # a rank holds at most ceil(pages / cp) of a request's pages
        pages, j = pages[:, :local_pages], self._iota[:local_pages * tpb]
        slots = (pages[:, :, None] * tpb + self._iota[:tpb]).flatten(1)  # [rows, local_pages * tpb]
        global_pos = ((j // tpb) * shard.cp + shard.rank) * tpb + j % tpb  # of each local column
        valid = global_pos[None, :] < lens  # [rows, local cols]; pages this rank does not hold are past the end
        ctx_kv = [(self.kv.k(i)[slots], None) for i in range(c.num_layers)]  # [rows, local cols, 1, r + rope]
        h = self.net.run_block(self._embed[ids], self._rope(pos), ctx_kv, block_mask(valid, B), shard)
        first = self._slots.start
        return draft_from_hidden(self.net, h[:, first:first + width], ids[:, 0], self._lm_head, self._embed,
                                 with_confidence=True)
