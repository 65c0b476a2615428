"""DeepSeek-V3 / Kimi-K2 target: Multi-head Latent Attention (MLA) on the paged cache.

The cache keeps one "head" per token: the normalised latent ``c_kv``
(``kv_lora_rank``, 512) followed by the roped shared key ``k_rope``
(``qk_rope_head_dim``, 64), K-only. Attention is *absorbed* in every phase
(docs/design.md §4): ``q_nope`` goes through ``W_UK`` into the latent space, the
backend attends ``[q_lat, q_rope]`` over ``[c_kv, k_rope]`` with ``V = c_kv``,
and ``W_UV`` maps the latent output back to ``v_head_dim`` per head. The math
is the one of ``transformers``' ``DeepseekV3ForCausalLM`` (checked in
``tests/test_target_mla.py``), including YaRN rope and the MoE router.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from specdec.attention.shapes import AttnShape
from specdec.errors import CheckpointError, ConfigError
from specdec.kvcache.pool import LayerSpec
from specdec.layers import rms_norm, rope_factors, rotate, swiglu

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
#: q_a_layernorm / kv_a_layernorm use RMSNorm's default eps in DeepSeek-V3, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """The fields of a DeepSeek-V3 / Kimi-K2 ``config.json`` an MLA target needs.

    Layer ``i`` is a MoE layer when ``n_routed_experts`` is set and
    ``i >= first_k_dense_replace``; otherwise it has a dense SwiGLU MLP.
    ``rope_scaling`` is ``None`` (plain rope) or a YaRN dict.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    first_k_dense_replace: int = 0
    n_routed_experts: int | None = None
    moe_intermediate_size: int = 2048
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    model_type: str = "deepseek_v3"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"MLAConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ConfigError(f"MLAConfig.q_lora_rank must be None or >= 1, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"MLAConfig.qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind != "yarn":
                raise ConfigError(f"MLAConfig.rope_scaling type must be 'yarn' or absent (plain rope), got {kind!r}")
            if not self.rope_scaling.get("factor"):
                raise ConfigError("MLAConfig.rope_scaling.factor must be set for yarn rope scaling")
        if any(self.moe_layers):
            self._check_moe()

    def _check_moe(self) -> None:
        for name in ("n_routed_experts", "moe_intermediate_size", "num_experts_per_tok", "n_group", "topk_group"):
            if getattr(self, name) is None or getattr(self, name) < 1:
                raise ConfigError(f"MLAConfig.{name} must be >= 1 for MoE layers, got {getattr(self, name)}")
        if self.n_routed_experts % self.n_group or self.n_routed_experts // self.n_group < 2:
            raise ConfigError(f"MLAConfig.n_group ({self.n_group}) must split n_routed_experts "
                              f"({self.n_routed_experts}) into groups of >= 2 experts")
        if self.topk_group > self.n_group:
            raise ConfigError(f"MLAConfig.topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ConfigError(f"MLAConfig.num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of "
                              f"the topk_group ({self.topk_group}) groups a token may use")

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer: MoE (True) or dense MLP (False)."""
        moe = self.n_routed_experts is not None
        return tuple(moe and i >= self.first_k_dense_replace for i in range(self.num_hidden_layers))

    @property
    def cache_dim(self) -> int:
        """Values cached per token and layer: latent + rope key (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, cfg: dict) -> "MLAConfig":
        """Read an HF ``config.json`` dict (DeepSeek-V3 or Kimi-K2).

        Accepts the legacy ``rope_scaling`` + ``rope_theta`` fields and the
        ``rope_parameters`` dict of newer ``transformers``.

        Raises:
            ConfigError: unsupported ``model_type``, ``hidden_act``,
                ``scoring_func``, ``topk_method``, ``moe_layer_freq``,
                ``quantization_config`` or rope scaling, or a missing field;
                the message names the field.
        """
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"config.json model_type must be one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}")
        unsupported = {"hidden_act": ("silu",), "scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",),
                       "moe_layer_freq": (1,)}
        for field, allowed in unsupported.items():
            if field in cfg and cfg[field] not in allowed:
                raise ConfigError(f"config.json {field} must be one of {allowed}, got {cfg[field]!r}")
        if cfg.get("quantization_config"):
            raise ConfigError("config.json quantization_config is not supported (FP8 block-quantized weights); "
                              "dequantize the checkpoint to bf16/fp32 first")

        def need(name: str) -> Any:
            if cfg.get(name) is None:
                raise ConfigError(f"config.json must set {name!r} for a {model_type} MLA target")
            return cfg[name]

        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        kind = rope.get("rope_type") or rope.get("type") or "default"
        eos = cfg.get("eos_token_id")
        fields = {name: need(name) for name in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
        optional = {name: cfg[name] for name in (
            "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "attention_bias", "rope_interleave",
            "first_k_dense_replace", "n_routed_experts", "moe_intermediate_size", "n_shared_experts",
            "num_experts_per_tok", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
            "bos_token_id") if cfg.get(name) is not None}
        if kind not in ("default", "yarn"):
            raise ConfigError(f"config.json rope_scaling type must be 'yarn' or absent, got {kind!r}")
        if kind == "yarn":  # transformers defaults the pretraining length to max_position_embeddings
            rope.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 4096))
        return cls(
            **fields, **optional, model_type=model_type, q_lora_rank=cfg.get("q_lora_rank"),
            rope_theta=rope.get("rope_theta") or cfg.get("rope_theta") or 10000.0,
            rope_scaling=rope if kind == "yarn" else None,
            eos_token_ids=tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,)),
        )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(factor) + 1`` (1 when ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(cfg: MLAConfig) -> float:
    """``1/sqrt(qk_nope + qk_rope)``, times YaRN ``mscale(factor, mscale_all_dim)**2`` when set."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rs = cfg.rope_scaling or {}
    if rs.get("mscale_all_dim"):
        scale *= yarn_mscale(rs["factor"], rs["mscale_all_dim"]) ** 2
    return scale


def rope_inv_freq(cfg: MLAConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[qk_rope_head_dim // 2]`` and the cos/sin factor (YaRN, as transformers)."""
    d, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.float) / d)
    rs = cfg.rope_scaling
    if rs is None:
        return 1.0 / pos_freqs, 1.0
    factor, old = rs["factor"], rs["original_max_position_embeddings"]
    mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
    attn_factor = rs.get("attention_factor")
    if attn_factor is None:
        attn_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                       else yarn_mscale(factor))
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the pretrained frequency, 0: interpolate by factor
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attn_factor)


def weight_shapes(cfg: MLAConfig) -> dict[str, tuple[int, ...]]:
    """Every weight of an HF DeepSeek-V3 checkpoint for ``cfg``, name → shape (experts unfused)."""
    hd, H, r, rope = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    qk, v = cfg.qk_nope_head_dim + rope, cfg.v_head_dim
    s = {"model.embed_tokens.weight": (cfg.vocab_size, hd), "model.norm.weight": (hd,)}
    if not cfg.tie_word_embeddings:
        s["lm_head.weight"] = (cfg.vocab_size, hd)
    for i, moe in enumerate(cfg.moe_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        s[p + "input_layernorm.weight"] = s[p + "post_attention_layernorm.weight"] = (hd,)
        if cfg.q_lora_rank is None:
            s[a + "q_proj.weight"] = (H * qk, hd)
        else:
            q = cfg.q_lora_rank
            s |= {a + "q_a_proj.weight": (q, hd), a + "q_a_layernorm.weight": (q,), a + "q_b_proj.weight": (H * qk, q)}
            if cfg.attention_bias:
                s[a + "q_a_proj.bias"] = (q,)
        s |= {a + "kv_a_proj_with_mqa.weight": (r + rope, hd), a + "kv_a_layernorm.weight": (r,),
              a + "kv_b_proj.weight": (H * (qk - rope + v), r), a + "o_proj.weight": (hd, H * v)}
        if cfg.attention_bias:
            s |= {a + "kv_a_proj_with_mqa.bias": (r + rope,), a + "o_proj.bias": (hd,)}
        mlps = [(p + "mlp.", cfg.intermediate_size)]
        if moe:
            inter = cfg.moe_intermediate_size
            s |= {p + "mlp.gate.weight": (cfg.n_routed_experts, hd),
                  p + "mlp.gate.e_score_correction_bias": (cfg.n_routed_experts,)}
            mlps = [(p + f"mlp.experts.{e}.", inter) for e in range(cfg.n_routed_experts)]
            if cfg.n_shared_experts:
                mlps.append((p + "mlp.shared_experts.", inter * cfg.n_shared_experts))
        for m, inter in mlps:
            s |= {m + "gate_proj.weight": (inter, hd), m + "up_proj.weight": (inter, hd),
                  m + "down_proj.weight": (hd, inter)}
    return s


def random_weights(cfg: MLAConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 weights in HF layout: matrices ``N(0, 1/fan_in)``, norms ``U(0.5, 1.5)``, biases ``N(0, 0.1)``."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in weight_shapes(cfg).items():
        if len(shape) == 2:
            out[name] = torch.randn(shape, generator=g) * shape[1] ** -0.5
        elif "norm" in name:
            out[name] = torch.rand(shape, generator=g) + 0.5
        else:
            out[name] = torch.randn(shape, generator=g) * 0.1
    return out


def _rope_rows(rows: int, d: int, blocks: int = 1) -> torch.Tensor:
    """Row order that turns the last ``d`` rows of each of ``blocks`` blocks of ``rows`` rows
    from interleaved pairs ``(x0, x1), (x2, x3), ...`` into halves ``(x0, x2, ..., x1, x3, ...)``."""
    one = torch.cat([torch.arange(rows - d), rows - d + torch.arange(0, d, 2), rows - d + torch.arange(1, d, 2)])
    return (one[None, :] + rows * torch.arange(blocks)[:, None]).flatten()


@dataclass(slots=True)
class _MoE:
    w_router: torch.Tensor  # [E, hidden], fp32 like transformers
    bias: torch.Tensor  # [E] e_score_correction_bias, fp32
    w_gate_up: torch.Tensor  # [E, 2 * moe_inter, hidden]
    w_down: torch.Tensor  # [E, hidden, moe_inter]
    shared_gate_up: torch.Tensor | None  # [2 * moe_inter * n_shared, hidden]
    shared_down: torch.Tensor | None  # [hidden, moe_inter * n_shared]


@dataclass(slots=True)
class _Layer:
    w_a: torch.Tensor  # [q_dim + kv_lora_rank + rope, hidden]: q_a_proj (or q_proj) and kv_a_proj_with_mqa fused
    b_a: torch.Tensor | None
    q_a_norm: torch.Tensor | None  # [q_lora_rank]
    w_q_b: torch.Tensor | None  # [H * (nope + rope), q_lora_rank]
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    w_uk: torch.Tensor  # [H, nope, kv_lora_rank]
    w_uv: torch.Tensor  # [H, v_head_dim, kv_lora_rank]
    w_o: torch.Tensor  # [hidden, H * v_head_dim]
    b_o: torch.Tensor | None
    norm_in: torch.Tensor
    norm_post: torch.Tensor
    w_gate_up: torch.Tensor | None  # [2 * inter, hidden] (dense layers)
    w_down: torch.Tensor | None  # [hidden, inter]
    moe: _MoE | None


class MLATarget:
    """A DeepSeek-V3 / Kimi-K2 causal LM with absorbed MLA on specdec's paged KV cache.

    With ``rope_interleave`` (the DeepSeek default) the rope rows of ``q_b_proj``
    (or ``q_proj``) and ``kv_a_proj_with_mqa`` are reordered once at load, so
    projections come out in rotate-half layout and no per-step permutation is
    needed; the cached ``k_rope`` is in that layout.

    Args:
        config: model configuration.
        weights: HF-named tensors (``model.layers.0.self_attn.kv_b_proj.weight`` ...);
            experts either per expert (``mlp.experts.3.up_proj.weight``) or fused
            (``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``).
        tokenizer: a ``transformers`` tokenizer, or ``None``.
        name: shown in stats and errors.
        dtype: compute and cache dtype (the MoE router always runs in fp32).
        device: where to run.

    Raises:
        CheckpointError: a weight is missing or has the wrong shape.
    """

    def __init__(self, config: MLAConfig, weights: dict[str, torch.Tensor], tokenizer: Any = None,
                 name: str = "mla", dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.config, self.tokenizer, self.name = config, tokenizer, name
        self.dtype, self.device = dtype, torch.device(device)
        self.vocab_size = config.vocab_size
        self.max_context = config.max_position_embeddings
        self.eos_token_ids = config.eos_token_ids
        self.num_layers = config.num_hidden_layers
        self.hidden_size = config.hidden_size
        self.scale = softmax_scale(config)
        inv_freq, self._rope_factor = rope_inv_freq(config)
        self._inv_freq = inv_freq.to(self.device)  # [rope / 2], fp32
        self._load(weights)

    @classmethod
    def random(cls, num_heads: int = 96, num_layers: int = 2, hidden_size: int = 1024, vocab_size: int = 1024,
               intermediate_size: int | None = None, kv_lora_rank: int = 512, q_lora_rank: int | None = 1536,
               qk_rope_head_dim: int = 64, qk_nope_head_dim: int = 128, v_head_dim: int = 128,
               max_position_embeddings: int = 4096, rope_scaling: dict | None = None,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0) -> "MLATarget":
        """A dense MLA target with :func:`random_weights`, at real MLA dims by default (kernel work, lossless tests).

        Args:
            num_heads: query heads (H); the cache always has one latent head.
            intermediate_size: dense MLP width (default ``2 * hidden_size``).
            others: as in :class:`MLAConfig`.

        Returns:
            The target; ``random_weights(target.config, seed)`` gives its HF-named weights again.

        Raises:
            ConfigError: a dimension is invalid (named in the message).
        """
        config = MLAConfig(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size or 2 * hidden_size,
            num_hidden_layers=num_layers, num_attention_heads=num_heads, kv_lora_rank=kv_lora_rank,
            q_lora_rank=q_lora_rank, qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim, max_position_embeddings=max_position_embeddings, rope_scaling=rope_scaling)
        return cls(config, random_weights(config, seed), name=f"mla-random-h{num_heads}", dtype=dtype, device=device)

    def _load(self, w: dict[str, torch.Tensor]) -> None:
        cfg, shapes = self.config, weight_shapes(self.config)

        def get(name: str, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
            if name not in w:
                raise CheckpointError(f"checkpoint is missing weight {name!r}")
            want = shape or shapes[name]
            if tuple(w[name].shape) != want:
                raise CheckpointError(f"weight {name!r} has shape {tuple(w[name].shape)}, expected {want}")
            return w[name].to(dtype=dtype or self.dtype, device=self.device)

        self.embed = get("model.embed_tokens.weight")
        self.lm_head = self.embed if cfg.tie_word_embeddings else get("lm_head.weight")
        self.final_norm = get("model.norm.weight")
        self.layers = [self._load_layer(i, moe, get, w) for i, moe in enumerate(cfg.moe_layers)]

    def _load_layer(self, i: int, moe: bool, get, w) -> _Layer:
        cfg, p, a = self.config, f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        H, nope, rope, r, v = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                               cfg.kv_lora_rank, cfg.v_head_dim)
        # Reorder rope rows once so rotate-half rope reproduces DeepSeek's interleaved rope.
        q_rows = _rope_rows(nope + rope, rope, H) if cfg.rope_interleave else slice(None)
        kv_rows = _rope_rows(r + rope, rope) if cfg.rope_interleave else slice(None)
        kv_a = get(a + "kv_a_proj_with_mqa.weight")[kv_rows]
        if cfg.q_lora_rank is None:
            w_a, w_q_b, q_a_norm = torch.cat([get(a + "q_proj.weight")[q_rows], kv_a]), None, None
        else:
            w_a, w_q_b = torch.cat([get(a + "q_a_proj.weight"), kv_a]), get(a + "q_b_proj.weight")[q_rows]
            q_a_norm = get(a + "q_a_layernorm.weight")
        b_a = b_o = None
        if cfg.attention_bias:
            q_dim = w_a.shape[0] - r - rope
            b_q = get(a + "q_a_proj.bias") if cfg.q_lora_rank is not None else w_a.new_zeros(q_dim)
            b_a, b_o = torch.cat([b_q, get(a + "kv_a_proj_with_mqa.bias")[kv_rows]]), get(a + "o_proj.bias")
        kv_b = get(a + "kv_b_proj.weight").reshape(H, nope + v, r)
        dense = None if moe else torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
        return _Layer(
            w_a=w_a, b_a=b_a, q_a_norm=q_a_norm, w_q_b=w_q_b, kv_a_norm=get(a + "kv_a_layernorm.weight"),
            w_uk=kv_b[:, :nope].contiguous(), w_uv=kv_b[:, nope:].contiguous(),
            w_o=get(a + "o_proj.weight"), b_o=b_o,
            norm_in=get(p + "input_layernorm.weight"), norm_post=get(p + "post_attention_layernorm.weight"),
            w_gate_up=dense, w_down=None if moe else get(p + "mlp.down_proj.weight"),
            moe=self._load_moe(p + "mlp.", get, w) if moe else None,
        )

    def _load_moe(self, m: str, get, w) -> _MoE:
        cfg = self.config
        E, inter, hd = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        if m + "experts.gate_up_proj" in w:  # fused, as transformers >= 5 holds them in memory
            gate_up = get(m + "experts.gate_up_proj", shape=(E, 2 * inter, hd))
            down = get(m + "experts.down_proj", shape=(E, hd, inter))
        else:  # one by one, as checkpoints on the Hub store them
            e = [f"{m}experts.{j}." for j in range(E)]
            gate_up = torch.stack([torch.cat([get(x + "gate_proj.weight"), get(x + "up_proj.weight")]) for x in e])
            down = torch.stack([get(x + "down_proj.weight") for x in e])
        shared = cfg.n_shared_experts > 0
        s = m + "shared_experts."
        return _MoE(
            w_router=get(m + "gate.weight", torch.float32), bias=get(m + "gate.e_score_correction_bias", torch.float32),
            w_gate_up=gate_up, w_down=down,
            shared_gate_up=torch.cat([get(s + "gate_proj.weight"), get(s + "up_proj.weight")]) if shared else None,
            shared_down=get(s + "down_proj.weight") if shared else None,
        )

    # -- protocol ------------------------------------------------------------
    def layer_specs(self, kv_dtype: torch.dtype | None = None, kv_scale: float = 1.0) -> tuple[LayerSpec, ...]:
        """One K-only latent layer per decoder layer: ``[c_kv, k_rope]``, ``kv_lora_rank + rope`` values,
        stored in ``kv_dtype`` (default: the compute dtype)."""
        spec = LayerSpec("mla", 1, self.config.cache_dim, kv_dtype or self.dtype, has_v=False, kv_scale=kv_scale)
        return (spec,) * self.num_layers

    def attn_shape(self, phase: str, max_q_len: int, tokens_per_block: int, mixed: bool = False,
                   kv_dtype: torch.dtype | None = None) -> AttnShape:
        """Absorbed MLA: H query heads, one KV head of ``kv_lora_rank + rope``, output ``kv_lora_rank``;
        the cache in ``kv_dtype`` (default: the compute dtype)."""
        c, dt = self.config, str(self.dtype).removeprefix("torch.")
        kv_dt = str(kv_dtype or self.dtype).removeprefix("torch.")
        sm = None
        if self.device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(self.device)
            sm = major * 10 + minor
        return AttnShape(phase, "mla", c.num_attention_heads, 1, c.cache_dim, c.kv_lora_rank,
                         tokens_per_block, max_q_len, kv_dt, dt, self.device.type, sm, 1, mixed)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` → ``[T, hidden_size]``."""
        return self.embed[input_ids]

    def forward(self, input_ids, positions, attn, pool, hidden_layer_ids: Sequence[int] = ()):
        """See :meth:`specdec.target.base.Target.forward`; layer ``i`` uses ``pool.k[i]``."""
        c = self.config
        freqs = positions.to(self.device).float()[:, None] * self._inv_freq  # [T, rope / 2]
        cos, sin = rope_factors(freqs[:, None, :], self.dtype, self._rope_factor)  # [T, 1, rope] each
        x = self.embed[input_ids]  # [T, hidden]
        wanted, captured = set(hidden_layer_ids), {}
        for i, L in enumerate(self.layers):
            h = rms_norm(x, L.norm_in, c.rms_norm_eps)
            x = x + self._attention(L, h, cos, sin, attn, pool.k[i], pool.specs[i].kv_scale)
            h = rms_norm(x, L.norm_post, c.rms_norm_eps)
            x = x + (self._moe(L.moe, h) if L.moe is not None else swiglu(h, L.w_gate_up, L.w_down))
            if i in wanted:
                captured[i] = x
        return x, captured

    def _attention(self, L: _Layer, h, cos, sin, attn, k_cache, kv_scale: float = 1.0) -> torch.Tensor:
        """Absorbed MLA of one layer. ``h``: ``[T, hidden]`` → ``[T, hidden]``; ``kv_scale``: of an FP8 cache."""
        c = self.config
        T, H, nope, rope, r = h.shape[0], c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        shard = getattr(attn, "shard", None)
        # attention tensor parallelism (Helix with tp > 1): this process's queries are its head group's
        heads = slice(0, H) if shard is None else shard.tp_heads(H)
        Hq = heads.stop - heads.start
        rows = slice(heads.start * (nope + rope), heads.stop * (nope + rope))  # its head group's q rows
        if L.w_q_b is None and Hq < H:  # q comes from w_a: only its head group's rows, and the latent's
            n_q, b = L.w_a.shape[0] - r - rope, L.b_a
            q = F.linear(h, L.w_a[rows], None if b is None else b[rows]).view(T, Hq, nope + rope)
            kv = F.linear(h, L.w_a[n_q:], None if b is None else b[n_q:])
        else:
            q, kv = F.linear(h, L.w_a, L.b_a).split([L.w_a.shape[0] - r - rope, r + rope], dim=-1)
            if L.w_q_b is not None:  # only its head group's rows of q_b
                q = F.linear(rms_norm(q, L.q_a_norm, LATENT_NORM_EPS), L.w_q_b if Hq == H else L.w_q_b[rows])
            q = q.view(T, Hq, nope + rope)
        q_nope, q_rope = q.split([nope, rope], dim=-1)  # [T, Hq, nope], [T, Hq, rope]
        c_kv, k_rope = kv.split([r, rope], dim=-1)
        c_kv = rms_norm(c_kv, L.kv_a_norm, LATENT_NORM_EPS)  # [T, r]
        q_rope, k_rope = rotate(q_rope, cos, sin), rotate(k_rope[:, None, :], cos, sin)  # [T, 1, rope]
        q_lat = torch.einsum("thn,hnr->thr", q_nope, L.w_uk[heads])  # [T, Hq, r]
        q = torch.cat([q_lat, q_rope], dim=-1)  # [T, Hq, r + rope]
        k = torch.cat([c_kv[:, None, :], k_rope], dim=-1)  # [T, 1, r + rope]
        if shard is None:
            o_lat = attn.attend(q, k, None, k_cache, None, self.scale, r, kv_scale=kv_scale)  # [T, H, r]
            o = torch.einsum("thr,hvr->thv", o_lat, L.w_uv)  # [T, H, v]
            return F.linear(o.reshape(T, H * c.v_head_dim), L.w_o, L.b_o)
        # Helix: head-parallel output projection. The exchange by head left this process its heads'
        # outputs over the whole context; it projects them with its columns of o_proj, and one
        # all-reduce of [T, hidden] over all tp * cp processes sums the parts (instead of gathering
        # [T, H, r] first).
        out = attn.attend(q, k, None, k_cache, None, self.scale, r, kv_scale=kv_scale, local_heads=True)  # [T, H/(tp cp), r]
        own = attn.local_heads(H)
        o = torch.einsum("thr,hvr->thv", out, L.w_uv[own])  # [T, H/(tp cp), v]
        cols = slice(own.start * c.v_head_dim, own.stop * c.v_head_dim)
        # [T, hidden]: each process's part in the compute dtype, the sum over processes in fp32
        part = F.linear(o.reshape(T, -1), L.w_o[:, cols]).float()
        dist.all_reduce(part, group=shard.world_group)
        out = part.to(h.dtype)
        return out if L.b_o is None else out + L.b_o

    def _moe(self, m: _MoE, h: torch.Tensor) -> torch.Tensor:
        """DeepSeek-V3 MoE: sigmoid router, group-limited top-k (noaux_tc), shared experts. ``[T, hidden]``."""
        c = self.config
        T, E, G = h.shape[0], c.n_routed_experts, c.n_group
        scores = F.linear(h.float(), m.w_router).sigmoid()  # [T, E]
        choice = scores + m.bias  # the bias steers selection only, not the weights
        group_scores = choice.view(T, G, E // G).topk(2, dim=-1).values.sum(-1)  # [T, G]
        groups = group_scores.topk(c.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)  # [T, G]
        choice = choice.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
        idx = choice.topk(c.num_experts_per_tok, dim=-1, sorted=False).indices  # [T, k]
        wts = scores.gather(1, idx)  # [T, k] fp32
        if c.norm_topk_prob:
            wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        wts = wts * c.routed_scaling_factor
        out = torch.zeros_like(h)
        for e in idx.unique().tolist():
            tok, slot = (idx == e).nonzero(as_tuple=True)
            y = swiglu(h[tok], m.w_gate_up[e], m.w_down[e]) * wts[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        if m.shared_gate_up is not None:
            out = out + swiglu(h, m.shared_gate_up, m.shared_down)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` → fp32 logits ``[n, vocab_size]`` (final norm, then LM head)."""
        h = rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)
        return F.linear(h, self.lm_head).float()
