"""Llama-family target (Llama, Mistral, Qwen2/3, SmolLM) on the paged cache.

Weights are plain tensors in HF layout, with Q/K/V and gate/up fused into one
matmul each. Attention goes through the step's :class:`AttentionMetadata`, so
the same forward serves context, decode, verify and mixed batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from specdec.attention.shapes import AttnShape
from specdec.errors import CheckpointError, ConfigError
from specdec.kvcache.pool import LayerSpec
from specdec.layers import inv_freq, rms_norm, rotate, signed_sin, swiglu

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """The fields of an HF ``config.json`` a Llama-family target needs."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlamaConfig":
        """Read an HF ``config.json`` dict.

        Raises:
            ConfigError: unsupported ``model_type`` or rope scaling.
        """
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"config.json model_type must be one of {SUPPORTED_MODEL_TYPES}, got {model_type!r}")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        rope_params = cfg.get("rope_parameters") or {}
        rope_scaling = cfg.get("rope_scaling") or (rope_params if rope_params.get("rope_type", "default") != "default" else None)
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta") or rope_params.get("rope_theta", 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]``, with linear or Llama-3 scaling."""
    inv = inv_freq(cfg.head_dim, cfg.rope_theta)
    rs = cfg.rope_scaling
    kind = (rs or {}).get("rope_type", (rs or {}).get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / rs["factor"]
    if kind == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(is_mid, mid, scaled)
    raise ConfigError(f"rope_scaling type must be one of ['default', 'linear', 'llama3'], got {kind!r}")


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def fused_gemm_max_tokens(layer) -> int:
    """Most tokens a step may have for the fused GEMM kernels.

    They tile rows 16 at a time and every row block reads the layer's weights again. A small
    model's per-GEMM weights (a few MB) stay in L2, so up to
    :data:`~specdec.target.kernels.FUSED_GEMM_MAX_TOKENS` rows cost little. A large model's
    weights come from HBM each time, so steps above 64 rows (4 row blocks) go to cuBLAS.
    """
    from specdec.target.kernels import FUSED_GEMM_MAX_TOKENS

    if layer is None:
        return FUSED_GEMM_MAX_TOKENS
    biggest = max(t.numel() * t.element_size() for t in (layer.w_qkv, layer.w_o, layer.w_gate_up, layer.w_down))
    return FUSED_GEMM_MAX_TOKENS if biggest <= 8 * 2 ** 20 else 64


@dataclass(slots=True)
class _Layer:
    w_qkv: torch.Tensor  # [(H + 2 Hkv) * D, hidden]
    b_qkv: torch.Tensor | None
    w_o: torch.Tensor  # [hidden, H * D]
    w_gate_up: torch.Tensor  # [2 * inter, hidden]
    w_down: torch.Tensor  # [hidden, inter]
    norm_in: torch.Tensor
    norm_post: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


class LlamaTarget:
    """A Llama-family causal LM on specdec's paged KV cache.

    Args:
        config: model configuration.
        weights: HF-named tensors (``model.layers.0.self_attn.q_proj.weight`` ...).
        tokenizer: a ``transformers`` tokenizer, or ``None``.
        name: shown in stats and errors.
        dtype: compute and cache dtype.
        device: where to run.

    Raises:
        CheckpointError: a weight is missing or has the wrong shape.
    """

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], tokenizer: Any = None,
                 name: str = "llama", dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.config, self.tokenizer, self.name = config, tokenizer, name
        self.dtype, self.device = dtype, torch.device(device)
        self.vocab_size = config.vocab_size
        self.max_context = config.max_position_embeddings
        self.eos_token_ids = config.eos_token_ids
        self.num_layers = config.num_hidden_layers
        self.hidden_size = config.hidden_size
        self._load(weights)
        self.scale = config.head_dim ** -0.5
        pos = torch.arange(self.max_context, dtype=torch.float32)
        freqs = torch.outer(pos, rope_inv_freq(config))
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_context, D]
        self._cos = emb.cos().to(dtype=dtype, device=self.device)
        self._sin = emb.sin().to(dtype=dtype, device=self.device)
        # Fused Triton elementwise kernels on the GPU (a step is launch-bound there); plain
        # PyTorch elsewhere. Tests set it on the CPU under TRITON_INTERPRET=1.
        self.fused = self.device.type == "cuda" and _has_triton()
        # With ``fused``, steps of at most ``fused_gemm_max_tokens`` tokens also fold each norm, RoPE,
        # cache write, activation and residual add into the GEMM beside it (five kernels a layer
        # plus attention; see kernels.py). Needs a cache of the compute dtype and no QK norm.
        self.fused_gemm = True
        self.fused_gemm_max_tokens = fused_gemm_max_tokens(self.layers[0] if self.layers else None)
        # Programmatic dependent launch level of the fused GEMMs (specdec.pdl): on SM90+ each kernel
        # launches while the previous one runs and prefetches its weights into L2 meanwhile.
        self.pdl = 0
        if self.fused:
            from specdec.pdl import pdl_level

            self.pdl = pdl_level(self.device)

    def _load(self, w: dict[str, torch.Tensor]) -> None:
        cfg = self.config

        def get(name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
            if name not in w:
                raise CheckpointError(f"checkpoint is missing weight {name!r}")
            t = w[name]
            if shape is not None and tuple(t.shape) != shape:
                raise CheckpointError(f"weight {name!r} has shape {tuple(t.shape)}, expected {shape}")
            return t.to(dtype=self.dtype, device=self.device)

        hd, H, Hkv, D = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.embed = get("model.embed_tokens.weight", (cfg.vocab_size, hd))
        self.lm_head = self.embed if cfg.tie_word_embeddings else get("lm_head.weight", (cfg.vocab_size, hd))
        self.final_norm = get("model.norm.weight", (hd,))
        self.layers: list[_Layer] = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = [get(a + "q_proj.weight", (H * D, hd)), get(a + "k_proj.weight", (Hkv * D, hd)), get(a + "v_proj.weight", (Hkv * D, hd))]
            bias = None
            if cfg.attention_bias:
                bias = torch.cat([get(a + f"{n}_proj.bias", (s,)) for n, s in (("q", H * D), ("k", Hkv * D), ("v", Hkv * D))])
            self.layers.append(_Layer(
                w_qkv=torch.cat(qkv), b_qkv=bias,
                w_o=get(a + "o_proj.weight", (hd, H * D)),
                w_gate_up=torch.cat([get(p + "mlp.gate_proj.weight", (cfg.intermediate_size, hd)),
                                     get(p + "mlp.up_proj.weight", (cfg.intermediate_size, hd))]),
                w_down=get(p + "mlp.down_proj.weight", (hd, cfg.intermediate_size)),
                norm_in=get(p + "input_layernorm.weight", (hd,)),
                norm_post=get(p + "post_attention_layernorm.weight", (hd,)),
                q_norm=get(a + "q_norm.weight", (D,)) if cfg.qk_norm else None,
                k_norm=get(a + "k_norm.weight", (D,)) if cfg.qk_norm else None,
            ))

    # -- protocol ------------------------------------------------------------
    def layer_specs(self, kv_dtype: torch.dtype | None = None, kv_scale: float = 1.0) -> tuple[LayerSpec, ...]:
        """One K/V layer per decoder layer, stored in ``kv_dtype`` (default: the compute dtype)."""
        c = self.config
        spec = LayerSpec("gqa", c.num_key_value_heads, c.head_dim, kv_dtype or self.dtype, kv_scale=kv_scale)
        return (spec,) * c.num_hidden_layers

    def attn_shape(self, phase: str, max_q_len: int, tokens_per_block: int, mixed: bool = False,
                   kv_dtype: torch.dtype | None = None) -> AttnShape:
        """Queries in the compute dtype, the cache in ``kv_dtype`` (default: the compute dtype)."""
        c, dt = self.config, str(self.dtype).removeprefix("torch.")
        kv_dt = str(kv_dtype or self.dtype).removeprefix("torch.")
        sm = None
        if self.device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(self.device)
            sm = major * 10 + minor
        return AttnShape(phase, "gqa", c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.head_dim,
                         tokens_per_block, max_q_len, kv_dt, dt, self.device.type, sm, 1, mixed)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` → ``[T, hidden_size]``."""
        return self.embed[input_ids]

    def _use_fused_gemm(self, num_tokens: int, pool) -> bool:
        return (self.fused and self.fused_gemm and num_tokens <= self.fused_gemm_max_tokens
                and not self.config.qk_norm and all(k.dtype == self.dtype for k in pool.k[: self.num_layers]))

    def forward(self, input_ids, positions, attn, pool, hidden_layer_ids: Sequence[int] = ()):
        if self._use_fused_gemm(input_ids.shape[0], pool):
            return self._forward_fused_gemm(input_ids, positions, attn, pool, hidden_layer_ids)
        if self.fused:
            return self._forward_fused(input_ids, positions, attn, pool, hidden_layer_ids)
        c = self.config
        T, H, Hkv, D = input_ids.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        cos, sin = self._cos[positions].unsqueeze(1), signed_sin(self._sin[positions]).unsqueeze(1)  # [T, 1, D]
        x = self.embed[input_ids]  # [T, hidden]
        wanted, captured = set(hidden_layer_ids), {}
        for i, L in enumerate(self.layers):
            h = rms_norm(x, L.norm_in, c.rms_norm_eps)
            qkv = F.linear(h, L.w_qkv, L.b_qkv)  # [T, (H + 2 Hkv) * D]
            q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
            q, k, v = q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
            if L.q_norm is not None:
                q, k = rms_norm(q, L.q_norm, c.rms_norm_eps), rms_norm(k, L.k_norm, c.rms_norm_eps)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            o = attn.attend(q, k, v, pool.k[i], pool.v[i], self.scale, D, kv_scale=pool.specs[i].kv_scale)  # [T, H, D]
            x = x + F.linear(o.reshape(T, H * D), L.w_o)
            x = x + swiglu(rms_norm(x, L.norm_post, c.rms_norm_eps), L.w_gate_up, L.w_down)
            if i in wanted:
                captured[i] = x
        return x, captured

    def _forward_fused(self, input_ids, positions, attn, pool, hidden_layer_ids: Sequence[int] = ()):
        """The same decoder with fused norm / RoPE+cache-write / SiLU kernels and each residual
        add folded into the next norm: about nine kernels per layer, no host synchronisation."""
        from specdec.target.kernels import add_rms_norm_, rope_, rope_write_kv_, silu_mul

        c = self.config
        T, H, Hkv, D = input_ids.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        eps, wanted, captured = c.rms_norm_eps, set(hidden_layer_ids), {}
        x = self.embed[input_ids]  # [T, hidden], a fresh tensor: the residual stream, updated in place
        delta = None  # what the last sub-layer adds to x, folded into the next norm
        for i, L in enumerate(self.layers):
            h = add_rms_norm_(x, delta, L.norm_in, eps)
            qkv = F.linear(h, L.w_qkv, L.b_qkv)  # [T, (H + 2 Hkv) * D]
            if L.q_norm is not None:  # Qwen3: per-head norm before RoPE (rare; plain PyTorch)
                q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
                qkv = torch.cat([rms_norm(q.view(T, H, D), L.q_norm, eps).view(T, H * D),
                                 rms_norm(k.view(T, Hkv, D), L.k_norm, eps).view(T, Hkv * D), v], -1)
            kc, vc = pool.k[i], pool.v[i]
            if kc.dtype == qkv.dtype:  # RoPE and the cache write in one kernel; attend only reads
                q = rope_write_kv_(qkv, H, Hkv, D, self._cos, self._sin, positions, attn.slot_mapping, kc, vc)
                o = attn.attend(q, None, None, kc, vc, self.scale, D)
            else:  # an FP8 cache: attend quantizes what it writes
                rope_(qkv, H + Hkv, D, self._cos, self._sin, positions)  # Q heads then K heads, in place
                q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
                o = attn.attend(q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D), kc, vc, self.scale, D,
                                kv_scale=pool.specs[i].kv_scale)
            h = add_rms_norm_(x, F.linear(o.reshape(T, H * D), L.w_o), L.norm_post, eps)
            delta = F.linear(silu_mul(F.linear(h, L.w_gate_up)), L.w_down)
            if i in wanted:
                captured[i] = x + delta
        return x + delta, captured

    def _forward_fused_gemm(self, input_ids, positions, attn, pool, hidden_layer_ids: Sequence[int] = ()):
        """The decoder in five fused kernels a layer plus attention (steps of few tokens): the
        residual stream is updated in place by the O and down projections' epilogues."""
        from specdec.target.kernels import fused_linear, qkv_rope_write_kv, ss_parts

        c = self.config
        T, H, Hkv, D = input_ids.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        eps, wanted, captured, pdl = c.rms_norm_eps, set(hidden_layer_ids), {}, self.pdl
        x = self.embed[input_ids]  # [T, hidden], a fresh tensor: the residual stream
        # partial sums of squares of x's rows, left by the kernel that last wrote x for the next norm
        ss_o = torch.empty(T, ss_parts(c.hidden_size, H * D), dtype=torch.float32, device=x.device)
        ss_down = torch.empty(T, ss_parts(c.hidden_size, c.intermediate_size), dtype=torch.float32, device=x.device)
        for i, L in enumerate(self.layers):
            kc, vc = pool.k[i], pool.v[i]
            q = qkv_rope_write_kv(x, L.w_qkv, L.b_qkv, L.norm_in, eps, H, Hkv, D, self._cos, self._sin,
                                  positions, attn.slot_mapping, kc, vc, norm_ss=ss_down if i else None, pdl=pdl)
            o = attn.attend(q, None, None, kc, vc, self.scale, D)
            fused_linear(o.reshape(T, H * D), L.w_o, residual=x, out=x, ss_out=ss_o, pdl=pdl)
            a = fused_linear(x, L.w_gate_up, norm_weight=L.norm_post, eps=eps, silu_mul=True, norm_ss=ss_o, pdl=pdl)
            fused_linear(a, L.w_down, residual=x, out=x, ss_out=ss_down, pdl=pdl)
            if i in wanted:
                captured[i] = x.clone()
        return x, captured

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.fused and self.fused_gemm and hidden.shape[0] <= self.fused_gemm_max_tokens:
            from specdec.target.kernels import fused_linear

            return fused_linear(hidden.contiguous(), self.lm_head, norm_weight=self.final_norm,
                                eps=self.config.rms_norm_eps, out_dtype=torch.float32, pdl=self.pdl)
        h = rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)
        return F.linear(h, self.lm_head).float()
