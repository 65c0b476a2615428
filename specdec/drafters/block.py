"""Block drafters (DFlash, DSpark): one forward pass drafts a whole block.

The network is a few decoder layers of the target's family. Every layer attends
from the block's queries to keys/values built from ``[projected target hidden
states of the context ; the block's own hidden states]``, with no causal mask
inside the block. Target hidden states of ``target_layer_ids`` are
concatenated, projected by ``fc`` and normalised (``hidden_norm``). Embedding
and LM head are the target's (frozen, not stored again).

``shift_label`` (docs/design.md §5): output slot ``i`` predicts position
``anchor + i + shift_label``; :func:`output_slots` is the one place that turns
it into the draft width and the slots that draft.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.errors import CheckpointError, ConfigError
from specdec.layers import fast_rms_norm as _rms  # the drafters' norm (specdec.layers: why not the targets')
from specdec.layers import rope_cos_sin, rotate, swiglu


def output_slots(block_size: int, shift_label: int) -> range:
    """Block slots whose outputs are drafts; ``len()`` of it is the draft width.

    ``shift_label = 0`` (DFlash): slot 0 would re-predict the anchor, so slots
    ``1..B-1`` draft (width ``B - 1``). ``shift_label = 1`` (DSpark): every slot
    predicts its next position, slots ``0..B-1`` (width ``B``).

    Raises:
        ConfigError: ``shift_label`` not 0 or 1, or ``block_size < 2``.
    """
    if shift_label not in (0, 1):
        raise ConfigError(f"shift_label must be 0 (DFlash) or 1 (DSpark), got {shift_label!r}")
    if not isinstance(block_size, int) or block_size < 2:
        raise ConfigError(f"block_size must be an integer >= 2, got {block_size!r}")
    return range(1 - shift_label, block_size)


def label_offsets(block_size: int, shift_label: int) -> list[int]:
    """Distance from the anchor of the token each drafting slot predicts (1, 2, ...)."""
    return [i + shift_label for i in output_slots(block_size, shift_label)]


@dataclass(frozen=True, slots=True)
class BlockDrafterConfig:
    """Shape of a block drafter network (stored as config.json beside the weights).

    Attributes:
        block_size: slots per draft block (B >= 2).
        shift_label: 0 (DFlash) or 1 (DSpark).
        target_layer_ids: target layers whose hidden states condition the drafter.
        target_hidden_size: width of those hidden states.
        vocab_size: the target's vocabulary (its LM head is used).
        hidden_size, num_layers, num_heads, num_kv_heads, head_dim, intermediate_size: the network.
        mask_token_id: token id fed to slots 1..B-1.
        rms_norm_eps, rope_theta: as in the target family.
        qk_norm: Qwen3-style RMSNorm of each query/key head (the public DFlash drafters have it).
        ctx_page_sizes: KV page sizes this drafter's context attention reads.
        markov_rank: DSpark's Markov head: a rank-``markov_rank`` bias from the token before each
            slot's label, added to the slot's hidden state before the LM head (so to its logits),
            decoded slot by slot along the block; 0 = none (DFlash).
        confidence_head: DSpark's confidence head: predicts each drafted token's probability of
            acceptance (given the slots before it were accepted) from the slot's hidden state and
            its logits' top probability and entropy.
    """

    block_size: int
    shift_label: int
    target_layer_ids: tuple[int, ...]
    target_hidden_size: int
    vocab_size: int
    hidden_size: int
    num_layers: int = 1
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    mask_token_id: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    qk_norm: bool = False
    ctx_page_sizes: tuple[int, ...] = (8, 16, 32, 64)
    markov_rank: int = 0
    confidence_head: bool = False

    def __post_init__(self) -> None:
        output_slots(self.block_size, self.shift_label)  # validates both
        if isinstance(self.markov_rank, bool) or not isinstance(self.markov_rank, int) or self.markov_rank < 0:
            raise ConfigError(f"markov_rank must be an integer >= 0 (0 = no Markov head), got {self.markov_rank!r}")
        if not isinstance(self.confidence_head, bool):
            raise ConfigError(f"confidence_head must be True or False, got {self.confidence_head!r}")
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
        object.__setattr__(self, "ctx_page_sizes", tuple(int(i) for i in self.ctx_page_sizes))
        if not self.target_layer_ids:
            raise ConfigError("target_layer_ids must name at least one target layer, got ()")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "target_hidden_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id must be in [0, {self.vocab_size}), got {self.mask_token_id}")

    @property
    def draft_width(self) -> int:
        return len(output_slots(self.block_size, self.shift_label))

    def to_json(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"], d["ctx_page_sizes"] = list(self.target_layer_ids), list(self.ctx_page_sizes)
        return d


def spread_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """``count`` target layers spread over the depth (first shallow, last near the top)."""
    if count < 1 or count > num_target_layers:
        raise ConfigError(f"number of target layers must be in [1, {num_target_layers}], got {count}")
    if count == 1:
        return (num_target_layers // 2,)
    step = (num_target_layers - 2) / (count - 1)
    return tuple(sorted({1 + round(i * step) for i in range(count)}))


class RopeTable:
    """cos / sin of positions ``0 .. length-1``, computed once (:func:`rope_cos_sin`, fp32).

    Looking positions up gives the very numbers :func:`rope_cos_sin` computes per call, on the
    same device, so a drafter reading the table drafts exactly as before.
    """

    def __init__(self, dim: int, theta: float, length: int, device: torch.device | str):
        self.dim, self.theta, self.length = dim, theta, length
        self.cos, self.sin = rope_cos_sin(torch.arange(length, device=device), dim, theta)  # [length, 1, dim] each

    def __call__(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``pos`` ``[...]`` (all ``< length``) → cos, sin ``[..., 1, dim]``."""
        return self.cos[pos], self.sin[pos]


def slot_logits(net, h: torch.Tensor, prev: torch.Tensor, lm_head: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
    """Logits of drafting slots: ``h`` ``[..., hidden]`` (normalised block output), ``prev`` ``[...]``
    the token before each slot's label (the Markov head's input; ignored without one) → ``[..., vocab]``."""
    if getattr(net, "markov", None) is not None:
        h = h + net.markov_bias(embed[prev].to(h.dtype))
    return F.linear(h, lm_head.to(h.dtype))


def draft_from_hidden(net, h: torch.Tensor, first_prev: torch.Tensor, lm_head: torch.Tensor, embed: torch.Tensor,
                      with_confidence: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Greedy drafts of ``W`` slots: ``h`` ``[N, W, hidden]``, ``first_prev`` ``[N]`` (the anchor token)
    → tokens ``[N, W]`` int64 and, if asked and the net has a confidence head, per-slot acceptance
    probabilities ``[N, W]`` fp32. With a Markov head the slots are decoded in turn (each slot's
    bias comes from the token drafted before it: a gather, one rank-``r`` update of its logits and
    an argmax per slot); without one, in one matmul. Confidences are computed once, for every slot."""
    N, W, _ = h.shape
    markov = getattr(net, "markov", None) is not None
    conf_head = with_confidence and getattr(net, "confidence", None) is not None
    if not markov and not conf_head:
        return F.linear(h.reshape(N * W, -1), lm_head.to(h.dtype)).argmax(-1).view(N, W), None
    lm = lm_head.to(h.dtype)
    logits = F.linear(h, lm)  # [N, W, vocab]: every slot's logits without the Markov bias, one matmul
    if markov:
        # the Markov bias in logit space is rank r: (embed @ down^T)[prev] @ (lm_head @ up)^T
        e_down = _cached_product(net, "_embed_down", embed, net.markov.down.weight.t(), h.dtype)  # [vocab, rank]
        lm_up = _cached_product(net, "_lm_up", lm, net.markov.up.weight, h.dtype)  # [vocab, rank]
        toks, prev = [], first_prev
        for j in range(W):
            lj = logits[:, j]
            lj.addmm_(e_down[prev], lm_up.t())  # in place: logits then hold every slot's biased logits
            prev = lj.argmax(-1)
            toks.append(prev)
        tokens = torch.stack(toks, 1)
    else:
        tokens = logits.argmax(-1)
    conf = torch.sigmoid(net.confidence_logit(h, logits)).float() if conf_head else None
    return tokens, conf


def _cached_product(net, name: str, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` in ``dtype`` (e.g. ``[vocab, hidden] @ [hidden, rank]``), cached on the net until
    either input changes. Not cached while autograd records (a training step)."""
    if torch.is_grad_enabled():
        return a.to(dtype) @ b.to(dtype)
    if torch.compiler.is_compiling():  # a compiled propose reads the cache as its eager run left it
        cached = net.__dict__.get(name)
        return cached[1] if cached is not None else a.to(dtype) @ b.to(dtype)
    key = (a.data_ptr(), a._version, a.shape, b.data_ptr(), b._version, b.shape, b.stride(), dtype, b.device)
    cached = net.__dict__.get(name)
    if cached is None or cached[0] != key:
        cached = (key, a.to(dtype) @ b.to(dtype))
        net.__dict__[name] = cached
    return cached[1]


def _stacked(module: nn.Module, name: str, weights: list[torch.Tensor]) -> torch.Tensor:
    """``weights`` concatenated along their output dimension (one GEMM for several projections),
    cached on ``module`` until one of them changes; made anew while autograd records."""
    if torch.is_grad_enabled():
        return torch.cat(weights, 0)
    if torch.compiler.is_compiling():  # as in _cached_product
        cached = module.__dict__.get(name)
        return cached[1] if cached is not None else torch.cat(weights, 0)
    key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in weights)
    cached = module.__dict__.get(name)
    if cached is None or cached[0] != key:
        cached = (key, torch.cat(weights, 0))
        module.__dict__[name] = cached
    return cached[1]


def block_mask(ctx_valid: torch.Tensor, block_size: int) -> torch.Tensor:
    """Attention mask of a block over ``[context ; block]``: ``[N, Lc]`` → ``[N, 1, 1, Lc + B]``, True = attend.

    Slots see every valid context key and every slot of their block (no causal mask inside it).
    """
    N = ctx_valid.shape[0]
    return torch.cat([ctx_valid, ctx_valid.new_ones(N, block_size)], 1)[:, None, None, :]


def mlp(m: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """SwiGLU MLP of a drafter layer (``gate_proj``, ``up_proj``, ``down_proj``): gate and up in one GEMM."""
    return swiglu(h, _stacked(m, "_gate_up", [m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight)


class _Norm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class _Layer(nn.Module):
    """One decoder layer, with the HF names the public DFlash layout uses."""

    def __init__(self, c: "BlockDrafterConfig"):
        super().__init__()
        D, H, Hkv, hd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.input_layernorm, self.post_attention_layernorm = _Norm(D), _Norm(D)
        self.self_attn = nn.Module()
        a = self.self_attn
        a.q_proj, a.k_proj, a.v_proj, a.o_proj = _linear(D, H * hd), _linear(D, Hkv * hd), _linear(D, Hkv * hd), _linear(H * hd, D)
        if c.qk_norm:
            a.q_norm, a.k_norm = _Norm(hd), _Norm(hd)
        self.mlp = nn.Module()
        m = self.mlp
        m.gate_proj, m.up_proj, m.down_proj = _linear(D, c.intermediate_size), _linear(D, c.intermediate_size), _linear(c.intermediate_size, D)

    def qk(self, h: torch.Tensor, c: "BlockDrafterConfig", heads: int, proj: str) -> torch.Tensor:
        """Project (and, Qwen3-style, normalise) queries or keys: ``[..., heads, hd]``."""
        x = getattr(self.self_attn, f"{proj}_proj")(h).view(*h.shape[:-1], heads, c.head_dim)
        norm = getattr(self.self_attn, f"{proj}_norm", None)
        return _rms(x, norm.weight, c.rms_norm_eps) if norm is not None else x


class BlockDrafterNet(nn.Module):
    """The trainable part of a block drafter (fc, hidden_norm, layers, norm)."""

    #: where every query of a block sees the same keys (the drafter's propose: its mask is
    #: ``[N, 1, 1, keys]``) and a KV head serves several query heads, :meth:`run_block` runs those
    #: query heads as more query rows of the KV head (``[N, Hkv, B * G, hd]``): the same attention,
    #: in G times fewer and G times fuller tiles of the attention kernel than ``B`` rows of each
    #: of ``H`` heads. ``False``: one head at a time (``enable_gqa``), for comparison.
    fold_queries = True
    #: the fewest blocks (requests) a folded attention runs: fewer run one head at a time. The
    #: compiled propose's CUDA graphs on an H100 (DFlash, 2026-12-07, ``bench/drafter_profile.py``):
    #: folded 0.280 / 0.323 / 0.497 ms a propose at 1 / 8 / 32 requests, one head at a time 0.257 /
    #: 0.313 / 0.544 ms.
    fold_min_rows = 16

    def folds_at(self, rows: int) -> bool:
        """Whether a propose of ``rows`` blocks folds its query heads (``fold_queries``,
        ``fold_min_rows``); :meth:`run_block` folds only where a KV head also serves several."""
        return self.fold_queries and rows >= self.fold_min_rows

    def __init__(self, config: BlockDrafterConfig):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(len(c.target_layer_ids) * c.target_hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = _Norm(c.hidden_size)
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.num_layers))
        self.norm = _Norm(c.hidden_size)
        self.markov = None
        if c.markov_rank:
            self.markov = nn.Module()
            self.markov.down, self.markov.up = _linear(c.hidden_size, c.markov_rank), _linear(c.markov_rank, c.hidden_size)
        self.confidence = nn.Linear(c.hidden_size + 2, 1) if c.confidence_head else None

    def markov_bias(self, prev_embed: torch.Tensor) -> torch.Tensor:
        """The Markov head's bias in hidden space from the previous token's embedding:
        ``[..., hidden]`` → ``[..., hidden]`` (rank ``markov_rank``; ``up`` starts at zero)."""
        return self.markov.up(self.markov.down(prev_embed))

    def confidence_logit(self, h: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Acceptance logit of each drafted token: slot hidden states ``[..., hidden]`` and their
        logits ``[..., vocab]`` → ``[...]`` (sigmoid of it: the probability of acceptance)."""
        lsm = torch.log_softmax(logits.float(), -1)
        stats = torch.stack([lsm.max(-1).values, -(lsm.exp() * lsm).sum(-1)], -1)
        return self.confidence(torch.cat([h, stats.to(h.dtype)], -1)).squeeze(-1)

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """``[n, len(target_layer_ids) * target_hidden]`` → context features ``[n, hidden]``."""
        return _rms(self.fc(target_hidden.to(self.fc.weight.dtype)), self.hidden_norm.weight, self.config.rms_norm_eps)

    def context_kv(self, i: int, ctx: torch.Tensor, positions: torch.Tensor, rope=None):
        """Layer ``i``'s K (roped) and V of context features: ``[n, Hkv, hd]`` each.

        ``rope``: the positions' ``(cos, sin)`` if already looked up (:class:`RopeTable`), else computed.
        """
        c, L = self.config, self.layers[i]
        k = L.qk(ctx, c, c.num_kv_heads, "k")
        v = L.self_attn.v_proj(ctx).view(*ctx.shape[:-1], c.num_kv_heads, c.head_dim)
        if rope is None:
            rope = rope_cos_sin(positions, c.head_dim, c.rope_theta, k.device)
        return rotate(k, *rope), v

    def context_kv_all(self, ctx: torch.Tensor, positions: torch.Tensor, rope=None):
        """Every layer's :meth:`context_kv` at once: one projection for all layers' K and V (their
        weights stacked, cached until a weight changes), one RoPE over all layers' keys.

        Returns:
            per layer ``(k, v)``, each ``[n, Hkv, hd]`` (views of one ``[n, layers, 2, Hkv, hd]`` tensor).
        """
        c = self.config
        ws = [w for L in self.layers for w in (L.self_attn.k_proj.weight, L.self_attn.v_proj.weight)]
        n, Lk = ctx.shape[0], c.num_layers
        kv = F.linear(ctx, _stacked(self, "_kv_weight", ws)).view(n, Lk, 2, c.num_kv_heads, c.head_dim)
        k = kv[:, :, 0]
        if c.qk_norm:
            k = torch.stack([_rms(k[:, i], L.self_attn.k_norm.weight, c.rms_norm_eps)
                             for i, L in enumerate(self.layers)], 1)
        if rope is None:
            rope = rope_cos_sin(positions, c.head_dim, c.rope_theta, k.device)
        cos, sin = rope  # [n, 1, hd] each
        k = rotate(k.reshape(n, Lk * c.num_kv_heads, c.head_dim), cos, sin).view(n, Lk, c.num_kv_heads, c.head_dim)
        return [(k[:, i], kv[:, i, 1]) for i in range(Lk)]

    @property
    def rope_dim(self) -> int:
        """Width RoPE rotates (one head)."""
        return self.config.head_dim

    def forward_block(self, x: torch.Tensor, positions: torch.Tensor, ctx_kv, ctx_valid: torch.Tensor) -> torch.Tensor:
        """Run the block through every layer.

        Args:
            x: block embeddings ``[N, B, hidden]``.
            positions: ``[N, B]`` absolute positions of the slots.
            ctx_kv: per layer ``(k, v)``, each ``[N or 1, Lc, Hkv, hd]``.
            ctx_valid: ``[N, Lc]`` which context keys each block may see.

        Returns:
            normalised hidden states ``[N, B, hidden]`` (feed to the target's LM head).
        """
        c = self.config
        rope = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.device)
        return self.run_block(x, rope, ctx_kv, block_mask(ctx_valid, x.shape[1]))

    def run_block(self, x: torch.Tensor, rope, ctx_kv, mask: torch.Tensor) -> torch.Tensor:
        """:meth:`forward_block` with its RoPE factors and mask already made (the drafter's
        inference path: factors looked up in a :class:`RopeTable`, no host work, capturable).

        Args:
            x: block embeddings ``[N, B, hidden]``.
            rope: ``(cos, sin)``, each ``[N, B, 1, head_dim]`` fp32, of the slots' positions.
            ctx_kv: per layer ``(k, v)``, each ``[N or 1, Lc, Hkv, hd]``.
            mask: ``[N, 1, 1, Lc + B]`` (:func:`block_mask`).

        Returns:
            normalised hidden states ``[N, B, hidden]``.
        """
        c = self.config
        N, B, _ = x.shape
        H, Hkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        G = H // Hkv  # query heads per KV head (torch's GQA: query head h reads KV head h // G)
        fold = G > 1 and mask.shape[-2] == 1 and self.folds_at(N)  # see fold_queries
        for i, (L, (kc, vc)) in enumerate(zip(self.layers, ctx_kv)):
            a = L.self_attn
            h = _rms(x, L.input_layernorm.weight, c.rms_norm_eps)
            qkv = F.linear(h, _stacked(L, "_qkv", [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
            qkv = qkv.view(N, B, H + 2 * Hkv, hd)
            if c.qk_norm:
                qk = torch.cat([_rms(qkv[:, :, :H], a.q_norm.weight, c.rms_norm_eps),
                                _rms(qkv[:, :, H:H + Hkv], a.k_norm.weight, c.rms_norm_eps)], 2)
            else:
                qk = qkv[:, :, :H + Hkv]
            qk = rotate(qk, *rope)  # queries and keys in one rotation
            q, k, v = qk[:, :, :H], qk[:, :, H:], qkv[:, :, H + Hkv:]
            k = torch.cat([kc.expand(N, -1, -1, -1).to(k.dtype), k], 1).transpose(1, 2)  # [N, Hkv, Lc + B, hd]
            v = torch.cat([vc.expand(N, -1, -1, -1).to(v.dtype), v], 1).transpose(1, 2)
            if fold:  # [N, B, Hkv, G, hd] -> [N, Hkv, B * G, hd]: one KV head's queries together
                qf = q.reshape(N, B, Hkv, G, hd).permute(0, 2, 1, 3, 4).reshape(N, Hkv, B * G, hd)
                o = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask)  # [N, Hkv, B * G, hd]
                o = o.view(N, Hkv, B, G, hd).permute(0, 2, 1, 3, 4).reshape(N, B, H * hd)
            else:
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
                                                   enable_gqa=H != Hkv)  # [N, H, B, hd]
                o = o.transpose(1, 2).reshape(N, B, H * hd)
            x = x + a.o_proj(o)
            x = x + mlp(L.mlp, _rms(x, L.post_attention_layernorm.weight, c.rms_norm_eps))
        return _rms(x, self.norm.weight, c.rms_norm_eps)

    # -- checkpoints -----------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write ``config.json`` + the weights (:func:`save_net`; the target's embedding/LM head are
        not stored)."""
        save_net(self, path, "SpecdecBlockDrafter")

    @classmethod
    def load(cls, path: str | Path) -> "BlockDrafterNet":
        """Load a checkpoint written by :meth:`save` or in the public DFlash layout.

        Raises:
            CheckpointError: missing files or weights.
        """
        from specdec.drafters.dflash_layout import read_block_checkpoint

        config, weights = read_block_checkpoint(Path(path))
        return load_weights(cls(config), weights, path)


SHARD_BYTES = 15 << 20
"""Largest weights file :func:`save_net` writes (bytes of tensor data): checkpoints travel and are
committed as files of at most 16 MiB."""


def save_net(net: nn.Module, path: str | Path, architecture: str, shard_bytes: int = SHARD_BYTES) -> None:
    """Write a block drafter network as ``config.json`` (``architectures: [architecture]`` and its
    config's fields) + ``model.safetensors``, or, past ``shard_bytes`` of weights, the shards
    ``model-0000i-of-0000n.safetensors`` and their ``model.safetensors.index.json`` (the Hugging Face
    layout). Weights files already in ``path`` are replaced, never mixed with the new ones."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": [architecture], **net.config.to_json()}, indent=2))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, v in net.state_dict().items():
        v = v.detach().contiguous().cpu()
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    for old in [*path.glob("*.safetensors"), path / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    if len(shards) == 1:
        save_file(shards[0], path / "model.safetensors")
        return
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(shard, path / name)
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for sh in shards for v in sh.values())},
             "weight_map": {k: name for name, sh in zip(names, shards) for k in sh}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def load_weights(net: nn.Module, weights: dict[str, torch.Tensor], path: str | Path) -> nn.Module:
    """``net`` with every weight of its state dict taken from ``weights`` (read from ``path``).

    Raises:
        CheckpointError: a weight of ``net`` is missing from ``weights``.
    """
    missing = set(net.state_dict()) - set(weights)
    if missing:
        raise CheckpointError(f"drafter checkpoint {str(path)!r} is missing weights {sorted(missing)[:5]}")
    net.load_state_dict({k: weights[k] for k in net.state_dict()})
    return net


def grow_layers(net: BlockDrafterNet, num_layers: int) -> BlockDrafterNet:
    """A deeper copy of ``net`` that drafts exactly as ``net`` does: its layers, then
    ``num_layers - net.config.num_layers`` new ones, each a copy of the last layer with its
    output projections (``o_proj``, ``down_proj``) at zero, so that each new layer adds nothing
    to the residual stream until training moves them. Training a grown network goes on from
    what ``net`` learned instead of from scratch (depth chosen by measured tau per millisecond
    of propose, without retraining every depth). ``net`` is left as it was.

    Raises:
        ConfigError: ``num_layers`` not above ``net``'s.
    """
    c = net.config
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers <= c.num_layers:
        raise ConfigError(f"grow_layers: num_layers must be an integer above the network's {c.num_layers}, "
                          f"got {num_layers!r}")
    grown = type(net)(replace(c, num_layers=num_layers))
    state = net.state_dict()
    last = c.num_layers - 1
    for k in grown.state_dict():
        if k in state:
            continue
        _, rest = k[len("layers."):].split(".", 1)  # every new weight is a new layer's
        v = state[f"layers.{last}.{rest}"]
        state[k] = torch.zeros_like(v) if rest.endswith(("o_proj.weight", "down_proj.weight")) else v.clone()
    p = next(net.parameters())
    grown.to(p.device, p.dtype).load_state_dict(state)
    return grown


def init_weights(net: BlockDrafterNet, seed: int = 0, std: float = 0.02) -> BlockDrafterNet:
    """Small random init (norms at 1, biases at 0) for training from scratch; the same ``seed``
    gives the same weights, whatever the global RNG."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if p.dim() == 1 and name.endswith("bias"):
                p.zero_()
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.mul_(1 / math.sqrt(2 * net.config.num_layers))
                if name == "markov.up.weight":
                    p.zero_()  # the Markov head starts as no bias
    return net
