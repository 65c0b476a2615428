"""The steps of a Llama decoder layer, one op set per kernel choice (:class:`~specdec.config.KernelConfig`).

:meth:`specdec.target.llama.LlamaTarget.forward` is one loop over the layers::

    q, k, v = ops.attention_in(i, layer, x)   # input norm, QKV, RoPE (+ the cache write)
    o = attn.attend(q, k, v, ...)              # K, V None: already in the cache
    x = ops.attention_out(layer, o, x)         # O projection + residual
    x = ops.mlp(layer, x)                      # post-attention norm, SwiGLU MLP, residual

and the op set, picked once per forward, decides how each step runs:

- :class:`TorchOps`: plain PyTorch, as HF Llama computes it (any device; the reference);
- :class:`FusedOps`: fused Triton norm / RoPE+cache-write / SiLU kernels beside cuBLAS GEMMs;
- :class:`FusedGemmOps`: each GEMM with what surrounds it in one kernel (steps of few tokens).

The fused sets round as the PyTorch forward does, in another order of operations, so their
results agree with :class:`TorchOps` to rounding (``tests/test_target_kernels.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specdec.layers import rms_norm, rotate, signed_sin, swiglu

if TYPE_CHECKING:
    from specdec.target.llama import LlamaTarget, _Layer


class LayerOps:
    """What every op set shares: the step's shapes, and the layer outputs and logits of a
    forward whose residual stream is a new tensor after each layer.

    Built once per forward. ``attention_in`` returns Q ``[T, H, D]``, K and V ``[T, Hkv, D]`` for
    :meth:`~specdec.attention.metadata.AttentionMetadata.attend` (K and V ``None`` when it wrote
    them into the cache itself); ``attention_out`` and ``mlp`` return the residual stream ``[T, hidden]``.

    Args:
        target: the model.
        positions: the step's absolute positions. ``[T]``
        attn: the step's attention metadata.
        pool: the KV pool (layer ``i`` at ``pool.k[i]``, ``pool.v[i]``).
    """

    def __init__(self, target: LlamaTarget, positions: torch.Tensor, attn, pool):
        c = target.config
        self.target, self.positions, self.attn, self.pool = target, positions, attn, pool
        self.T, self.H, self.Hkv, self.D, self.eps = (positions.shape[0], c.num_attention_heads,
                                                      c.num_key_value_heads, c.head_dim, c.rms_norm_eps)

    def layer_output(self, x: torch.Tensor) -> torch.Tensor:
        """A layer's output hidden states, as later layers leave them. ``[T, hidden]``"""
        return x

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output hidden states. ``[T, hidden]``"""
        return x

    @staticmethod
    def logits(target: LlamaTarget, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head in PyTorch: ``[n, hidden]`` → fp32 ``[n, vocab]``."""
        return F.linear(rms_norm(hidden, target.final_norm, target.config.rms_norm_eps), target.lm_head).float()


class TorchOps(LayerOps):
    """Every step in plain PyTorch, as HF Llama computes it: any device, any cache."""

    def __init__(self, target: LlamaTarget, positions: torch.Tensor, attn, pool):
        super().__init__(target, positions, attn, pool)
        self.cos = target.rope_cos[positions].unsqueeze(1)  # [T, 1, D]
        self.sin = signed_sin(target.rope_sin[positions]).unsqueeze(1)

    def attention_in(self, i: int, L: _Layer, x: torch.Tensor):
        """Input norm, QKV (and Qwen3's per-head QK norm), RoPE; attention writes K and V."""
        T, H, Hkv, D = self.T, self.H, self.Hkv, self.D
        qkv = F.linear(rms_norm(x, L.norm_in, self.eps), L.w_qkv, L.b_qkv)  # [T, (H + 2 Hkv) * D]
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
        if L.q_norm is not None:
            q, k = rms_norm(q, L.q_norm, self.eps), rms_norm(k, L.k_norm, self.eps)
        return rotate(q, self.cos, self.sin), rotate(k, self.cos, self.sin), v

    def attention_out(self, L: _Layer, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus the O projection of ``o`` ``[T, H, D]``."""
        return x + F.linear(o.reshape(self.T, self.H * self.D), L.w_o)

    def mlp(self, L: _Layer, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus the SwiGLU MLP of its post-attention norm."""
        return x + swiglu(rms_norm(x, L.norm_post, self.eps), L.w_gate_up, L.w_down)


class FusedOps(LayerOps):
    """Fused norm / RoPE+cache-write / SiLU kernels beside cuBLAS GEMMs, each residual add folded
    into the next norm: about nine kernels per layer, no host synchronisation. The residual
    stream is updated in place; what the MLP adds waits in ``delta`` for the next layer's norm."""

    def __init__(self, target: LlamaTarget, positions: torch.Tensor, attn, pool):
        from specdec.target import kernels

        super().__init__(target, positions, attn, pool)
        self.K = kernels
        self.delta = None  # what the last sub-layer adds to x, folded into the next norm
        self.h = None  # the MLP's normed input

    def attention_in(self, i: int, L: _Layer, x: torch.Tensor):
        """``x`` += ``delta`` and the input norm in one kernel, QKV, then RoPE with the cache write
        in one kernel (an FP8 cache: RoPE alone, attention quantizes and writes)."""
        T, H, Hkv, D, eps, t = self.T, self.H, self.Hkv, self.D, self.eps, self.target
        qkv = F.linear(self.K.add_rms_norm_(x, self.delta, L.norm_in, eps), L.w_qkv, L.b_qkv)  # [T, (H + 2 Hkv) * D]
        if L.q_norm is not None:  # Qwen3: per-head norm before RoPE (rare; plain PyTorch)
            q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
            qkv = torch.cat([rms_norm(q.view(T, H, D), L.q_norm, eps).view(T, H * D),
                             rms_norm(k.view(T, Hkv, D), L.k_norm, eps).view(T, Hkv * D), v], -1)
        kc, vc = self.pool.k[i], self.pool.v[i]
        if kc.dtype == qkv.dtype:
            q = self.K.rope_write_kv_(qkv, H, Hkv, D, t.rope_cos, t.rope_sin, self.positions,
                                      self.attn.slot_mapping, kc, vc)
            return q, None, None
        self.K.rope_(qkv, H + Hkv, D, t.rope_cos, t.rope_sin, self.positions)  # Q heads then K heads, in place
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        return q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)

    def attention_out(self, L: _Layer, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x`` += the O projection of ``o``, in place, and the post-attention norm of the sum."""
        self.h = self.K.add_rms_norm_(x, F.linear(o.reshape(self.T, self.H * self.D), L.w_o), L.norm_post, self.eps)
        return x

    def mlp(self, L: _Layer, x: torch.Tensor) -> torch.Tensor:
        """The MLP of the normed input, kept in ``delta`` for the next norm to add to ``x``."""
        self.delta = F.linear(self.K.silu_mul(F.linear(self.h, L.w_gate_up)), L.w_down)
        return x

    def layer_output(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.delta

    output = layer_output


class FusedGemmOps(LayerOps):
    """Five fused kernels a layer plus attention, for steps of few tokens: each norm, RoPE, cache
    write, activation and residual add inside the GEMM beside it. The O and down projections
    update the residual stream in place and leave its rows' partial sums of squares for the
    next norm. Needs a cache of the compute dtype and no QK norm."""

    def __init__(self, target: LlamaTarget, positions: torch.Tensor, attn, pool):
        from specdec.target import kernels

        super().__init__(target, positions, attn, pool)
        c, dev, T = target.config, target.device, self.T
        self.K, self.pdl = kernels, target.kernels.pdl
        # partial sums of squares of x's rows, left by the kernel that last wrote x, for the next norm
        self.ss_o = torch.empty(T, kernels.ss_parts(c.hidden_size, self.H * self.D), dtype=torch.float32, device=dev)
        self.ss_down = torch.empty(T, kernels.ss_parts(c.hidden_size, c.intermediate_size), dtype=torch.float32,
                                   device=dev)

    def attention_in(self, i: int, L: _Layer, x: torch.Tensor):
        """Input norm, QKV, RoPE and the cache write in one kernel."""
        t = self.target
        q = self.K.qkv_rope_write_kv(x, L.w_qkv, L.b_qkv, L.norm_in, self.eps, self.H, self.Hkv, self.D, t.rope_cos,
                                     t.rope_sin, self.positions, self.attn.slot_mapping, self.pool.k[i],
                                     self.pool.v[i], norm_ss=self.ss_down if i else None, pdl=self.pdl)
        return q, None, None

    def attention_out(self, L: _Layer, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x`` += the O projection of ``o``, in the GEMM's epilogue."""
        self.K.fused_linear(o.reshape(self.T, self.H * self.D), L.w_o, residual=x, out=x, ss_out=self.ss_o,
                            pdl=self.pdl)
        return x

    def mlp(self, L: _Layer, x: torch.Tensor) -> torch.Tensor:
        """Post-attention norm, gate/up and SiLU·up in one kernel; ``x`` += the down projection in another."""
        a = self.K.fused_linear(x, L.w_gate_up, norm_weight=L.norm_post, eps=self.eps, silu_mul=True,
                                norm_ss=self.ss_o, pdl=self.pdl)
        self.K.fused_linear(a, L.w_down, residual=x, out=x, ss_out=self.ss_down, pdl=self.pdl)
        return x

    def layer_output(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()  # later layers update x in place

    @staticmethod
    def logits(target: LlamaTarget, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head and fp32 logits in one kernel."""
        from specdec.target.kernels import fused_linear

        return fused_linear(hidden.contiguous(), target.lm_head, norm_weight=target.final_norm,
                            eps=target.config.rms_norm_eps, out_dtype=torch.float32, pdl=target.kernels.pdl)
