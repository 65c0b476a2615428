"""Llama-family target (Llama, Mistral, Qwen2/3, SmolLM) on the paged cache.

Weights are plain tensors in HF layout, with Q/K/V and gate/up fused into one
matmul each. Attention goes through the step's :class:`AttentionMetadata`, so
the same forward serves context, decode, verify and mixed batches.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from specdec.attention.shapes import AttnShape
from specdec.config import KernelConfig
from specdec.errors import CheckpointError, ConfigError
from specdec.kvcache.pool import LayerSpec
from specdec.layers import inv_freq
from specdec.target.llama_ops import FusedGemmOps, FusedOps, LayerOps, TorchOps

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


class _KernelChoice:
    """A field of :attr:`LlamaTarget.kernels` under its older attribute name: readable, and an
    error to assign (kernels are chosen when the target is built)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, target, owner=None):
        return self if target is None else getattr(target.kernels, self.name)

    def __set__(self, target, value) -> None:
        raise AttributeError(f"LlamaTarget.{self.name} is read-only: kernels are chosen when the target is built; "
                             f"pass kernels=KernelConfig({self.name}={value!r}) to LlamaTarget(...) or load_target(...)")


class LlamaTarget:
    """A Llama-family causal LM on specdec's paged KV cache.

    Args:
        config: model configuration.
        weights: HF-named tensors (``model.layers.0.self_attn.q_proj.weight`` ...).
        tokenizer: a ``transformers`` tokenizer, or ``None``.
        name: shown in stats and errors.
        dtype: compute and cache dtype.
        device: where to run.
        kernels: which kernels the forward runs (default ``KernelConfig()``: fused Triton kernels on
            CUDA, plain PyTorch elsewhere); :attr:`kernels` holds the resolved choice.

    Attributes:
        kernels: the kernels it runs (read-only; every ``None`` resolved).
        fused, fused_gemm, fused_gemm_max_tokens, pdl: the same fields of :attr:`kernels`, under
            their older names; read-only (assigning one raises ``AttributeError``).

    Raises:
        ConfigError: ``kernels`` is not a :class:`~specdec.config.KernelConfig`, or asks for what
            this machine lacks (Triton, its CPU interpreter, PDL on an SM90+ GPU), checked before
            the weights are copied.
        CheckpointError: a weight is missing or has the wrong shape.
    """

    fused = _KernelChoice()
    fused_gemm = _KernelChoice()
    fused_gemm_max_tokens = _KernelChoice()
    pdl = _KernelChoice()

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], tokenizer: Any = None,
                 name: str = "llama", dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 kernels: KernelConfig | None = None):
        self.config, self.tokenizer, self.name = config, tokenizer, name
        self.dtype, self.device = dtype, torch.device(device)
        self.vocab_size = config.vocab_size
        self.max_context = config.max_position_embeddings
        self.eos_token_ids = config.eos_token_ids
        self.num_layers = config.num_hidden_layers
        self.hidden_size = config.hidden_size
        kernels = resolve_kernels(KernelConfig() if kernels is None else kernels, self.device)
        self._load(weights)
        max_tokens = kernels.fused_gemm_max_tokens or fused_gemm_max_tokens(self.layers[0] if self.layers else None)
        self._kernels = dataclasses.replace(kernels, fused_gemm_max_tokens=max_tokens)
        self.scale = config.head_dim ** -0.5
        pos = torch.arange(self.max_context, dtype=torch.float32)
        freqs = torch.outer(pos, rope_inv_freq(config))
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_context, D]
        #: RoPE tables ``[max_context, D]`` in the compute dtype; the sine's halves both positive, as
        #: the fused kernels read it
        self.rope_cos = emb.cos().to(dtype=dtype, device=self.device)
        self.rope_sin = emb.sin().to(dtype=dtype, device=self.device)

    @property
    def kernels(self) -> KernelConfig:
        """The kernels this target runs, every ``None`` of the given config resolved (read-only)."""
        return self._kernels

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

    def forward(self, input_ids, positions, attn, pool, hidden_layer_ids: Sequence[int] = ()):
        """See :meth:`specdec.target.base.Target.forward`. One loop over the layers; each step of a
        layer comes from the op set :meth:`_ops` picks for this forward (their results agree to
        rounding: the fused kernels round as the PyTorch forward does, in another order)."""
        D = self.config.head_dim
        x = self.embed[input_ids]  # [T, hidden], a fresh tensor: the residual stream
        ops = self._ops(input_ids.shape[0], pool)(self, positions, attn, pool)
        wanted, captured = set(hidden_layer_ids), {}
        for i, L in enumerate(self.layers):
            q, k, v = ops.attention_in(i, L, x)
            o = attn.attend(q, k, v, pool.k[i], pool.v[i], self.scale, D, kv_scale=pool.specs[i].kv_scale)  # [T, H, D]
            x = ops.attention_out(L, o, x)
            x = ops.mlp(L, x)
            if i in wanted:
                captured[i] = ops.layer_output(x)
        return ops.output(x), captured

    def _ops(self, num_tokens: int, pool) -> type[LayerOps]:
        """The op set of a forward over ``num_tokens`` tokens and ``pool``'s cache."""
        k = self._kernels
        if not k.fused:
            return TorchOps
        if (k.fused_gemm and num_tokens <= k.fused_gemm_max_tokens and not self.config.qk_norm
                and all(t.dtype == self.dtype for t in pool.k[: self.num_layers])):
            return FusedGemmOps
        return FusedOps

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` → fp32 logits ``[n, vocab_size]`` (final norm, then LM head)."""
        k = self._kernels
        gemm = k.fused and k.fused_gemm and hidden.shape[0] <= k.fused_gemm_max_tokens
        return (FusedGemmOps if gemm else LayerOps).logits(self, hidden)


def resolve_kernels(kernels: KernelConfig, device: torch.device) -> KernelConfig:
    """``kernels`` with ``fused`` and ``pdl`` chosen for ``device`` where ``None`` (the automatic
    ``fused_gemm_max_tokens`` needs the weights: :class:`LlamaTarget` chooses it).

    Args:
        kernels: the asked-for kernels.
        device: where the target runs.

    Returns:
        ``kernels`` with ``fused`` a bool and ``pdl`` a level.

    Raises:
        ConfigError: not a ``KernelConfig``; fused kernels without Triton, or on a CPU outside
            Triton's interpreter; a PDL level without the fused GEMMs or without an SM90+ GPU.
    """
    if not isinstance(kernels, KernelConfig):
        raise ConfigError(f"kernels must be a KernelConfig or None, got {type(kernels).__name__}")
    fused = kernels.fused if kernels.fused is not None else device.type == "cuda" and _has_triton()
    if fused and not _has_triton():
        raise ConfigError("KernelConfig.fused=True needs Triton, which is not installed (pip extra 'gpu')")
    if fused and device.type == "cpu":
        import triton

        if not triton.knobs.runtime.interpret:
            raise ConfigError("KernelConfig.fused=True on a CPU runs the kernels in Triton's interpreter: "
                              "set TRITON_INTERPRET=1 before specdec is imported, or use fused=False")
    gemm = fused and kernels.fused_gemm
    if kernels.pdl and not gemm:
        raise ConfigError(f"KernelConfig.pdl={kernels.pdl} applies to the fused GEMMs: it needs fused=True and "
                          f"fused_gemm=True, got fused={fused}, fused_gemm={kernels.fused_gemm}")
    pdl = 0
    if gemm and kernels.pdl != 0:
        from specdec.pdl import pdl_level

        pdl = pdl_level(device)
        if kernels.pdl is not None and not pdl:
            raise ConfigError(f"KernelConfig.pdl={kernels.pdl} needs a CUDA GPU with SM90 or newer, got {device}")
    return dataclasses.replace(kernels, fused=fused, pdl=pdl if kernels.pdl is None else kernels.pdl)
