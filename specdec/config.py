"""Small frozen configs, validated on construction (STYLE.md §6)."""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass

import torch

from specdec.errors import ConfigError, InvalidRequestError


def _init_signature(cls):
    """Give ``cls`` its ``__init__``'s signature (less ``self``): a config whose ``__new__`` checks
    the field names (:func:`_check_field_names`) would otherwise show ``(*args, **kwargs)`` to
    ``help()`` and ``inspect``."""
    sig = inspect.signature(cls.__init__)
    cls.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])
    return cls


GREEDY_BELOW = 1e-5
"""Temperatures below this decode greedily (as vLLM's). With logits below ``3e33`` in magnitude,
``logits / temperature`` stays finite in fp32 at every temperature a request samples at."""


@_init_signature
@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request is decoded.

    Attributes:
        max_new_tokens: most tokens to generate (>= 1).
        temperature: 0 means greedy; > 0 samples from softmax(logits / temperature). Below
            :data:`GREEDY_BELOW` (1e-5) the request is greedy too: sampling there is the argmax
            but for exact ties, and ``logits / temperature`` could overflow fp32.
        top_k: keep the k most likely tokens (0 = all).
        top_p: keep the smallest set whose probability is >= top_p, in (0, 1].
        stop: strings that end generation; the stop string is not returned.
        ignore_eos: keep generating past the end-of-sequence token.
        seed: fixes the sampling noise of each output position (sampling only): the same
            seed gives the same tokens with any deterministic drafter (:mod:`specdec.sampling`);
            ``None`` draws a random seed when the request is added.
            An integer in ``[0, 2**64)`` or ``None``; validated for greedy requests too.

    Raises:
        InvalidRequestError: a field has the wrong type or value (the message names it).
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __new__(cls, *args, **kwargs):
        _check_field_names(cls, args, kwargs, InvalidRequestError)  # before a bare TypeError from __init__
        return object.__new__(cls)

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or not self.temperature >= 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0 (0 = no limit), got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, (tuple, list)) or any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError(f"stop must be a tuple of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        # checked even when greedy: a bad seed is a bug whether or not this request samples
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 1 << 64):
            raise InvalidRequestError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """Whether the request takes the argmax: temperature 0 or below :data:`GREEDY_BELOW`."""
        return self.temperature < GREEDY_BELOW


@_init_signature
@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine schedules and caches.

    Attributes:
        max_draft_tokens: most draft tokens verified per request per step (k).
        tokens_per_block: KV page size in tokens.
        num_pages: KV pool capacity in pages; ``None`` sizes it from ``kv_cache_bytes``.
        max_num_seqs: most requests running at once; the rest wait in a queue.
        attention_backend: a backend name to force, or ``None`` for automatic selection.
        apply_chat_template: wrap prompts in the target's chat template if it has one.
        kv_cache_bytes: memory for the KV pool when ``num_pages`` is not given. ``None``
            (default): what the model and ``max_num_seqs`` need, ``max_num_seqs`` requests of the
            model's whole context, capped by what the device has
            (:func:`specdec.kvcache.sizing.default_kv_budget`).
        share_draft_kv: ``None`` lets the scheduler decide from the drafter's hooks;
            ``True`` requires the drafter's layers in the target pool (error if the hooks
            forbid it); ``False`` always gives the drafter a pool of its own.
        kv_cache_dtype: ``"auto"`` stores the target's KV in its compute dtype;
            ``"fp8_e4m3"`` stores it as FP8 E4M3 (1 byte per value), dequantized by ``kv_scale``.
        kv_scale: per-tensor scale of an FP8 cache (it holds ``value / kv_scale``); 1.0 otherwise.
        cuda_graphs: on CUDA, replay captured graphs for generation-only steps
            (bucketed shapes, see :mod:`specdec.graphs`); other steps run eagerly.
        batch_invariant: run every generation step in one graph bucket, with the KV split
            at fixed key offsets, so a token's logits do not depend on the draft length or
            on the batch (bf16 outputs then equal the null drafter's; costs padding).
        overlap_steps: launch the next plain decode step before the current one's tokens
            reach the host: its input tokens are copied on the device, so the host's work
            between steps overlaps the GPU. For an engine whose steps are plain: the null
            drafter's, or those ``draft_gate`` leaves at no draft (its drafter still hears
            every step). Outputs are unchanged (a request that ends at a step drops the next
            step's token); a request added meanwhile is admitted one step later. ``None``
            (default): on where it helps, on CUDA with the null drafter or the draft gate
            (H200, SmolLM2, null drafter: 1.12x tokens/s at batch 1, 1.35x at 32;
            BENCHMARKS.md, 'Batch 8 and 32: overlapped steps and prompt graphs', with the
            commands); ``True``: required (an error with a drafter that drafts and no gate);
            ``False``: off.
        prompt_graphs: prompt-only steps of at most 512 tokens replay CUDA graphs too
            (bucketed like generation steps; the logits of each request's last token), instead
            of launching some 150 kernels from Python (H200, SmolLM2, batch 1: 1.10x tokens/s
            with the null drafter, 1.20x with the suffix drafter; BENCHMARKS.md, same section).
            ``False``: eager prompt steps.
        draft_length: ``"fixed"`` verifies every drafted token (up to ``max_draft_tokens``);
            ``"confidence"`` cuts each request's draft where expected accepted tokens per unit
            of step cost stop rising, from the drafter's per-token confidences
            (:mod:`specdec.draft_length`; drafts without confidences stay whole).
        cost_profile: a saved :class:`~specdec.draft_length.CostProfile` (JSON) for
            ``draft_length="confidence"``; ``None`` measures one at the first step that needs it
            and caches it under ``~/.cache/specdec/cost_profiles`` (per target, device, page size).
        helix_cp: Helix context-parallel ranks (docs/design.md §7); 1 = off. With ``N > 1`` the
            engine runs on each of ``N`` processes of a ``torch.distributed`` group of ``N`` ranks
            (``torchrun --nproc-per-node N``; gloo on CPU, NCCL on GPU), each holding the KV pages
            it owns; the target must be MLA with heads divisible by ``N``. ``num_pages`` and
            ``kv_cache_bytes`` are then per rank.
        attention_tp: attention tensor parallelism under Helix; 1 = off. With ``T > 1`` the group
            has ``T * helix_cp`` processes: each computes the queries and attention of ``1 / T`` of
            the heads over its context shard (the ``T`` processes of one shard hold the same
            pages), and the output projection is summed over all of them. Needs ``helix_cp > 1`` and
            heads divisible by ``T * helix_cp``.
        max_prefill_tokens: most prompt tokens fed in one step (chunked prefill); a longer prompt,
            or several, is fed over the next steps, each chunk beside the decoding requests, so that
            an arriving long prompt delays their next token by one chunk's compute, not the whole
            prompt's. Outputs are unchanged. ``None`` (default): whole prompts. Not with Helix.
        freeze_heap: :meth:`SpecEngine.generate` runs with the objects that existed before it
            frozen for the garbage collector (:func:`specdec.heap.frozen_heap`): its full passes then
            skip the model, graphs and pools, tens of milliseconds each, and the objects are unfrozen
            when it returns. ``False``: the collector as the process has it. (A serving loop driving
            :meth:`SpecEngine.step` freezes its own heap: ``specdec serve`` does after its warm-up.)
        draft_gate: per batch-size bucket, draft the number of tokens (``0, 1, 2, 4, ...,
            max_draft_tokens``; 0: no propose) with the most estimated tokens per second,
            ``(1 + accepted) / cost`` from the steps measured so far
            (:class:`specdec.draft_gate.DraftGate`). Outputs are unchanged (a shorter draft is a
            prefix, a plain step the null drafter's); its choices are in
            :attr:`SpecEngine.draft_gate_stats`. ``False``: every step drafts up to
            ``max_draft_tokens``. ``None`` (default): as the drafter declares
            (``Drafter.gated_by_default``): on for the block drafters (DFlash, DSpark), whose
            propose costs about a target step, off for the suffix and hybrid drafters, and off
            with ``helix_cp > 1`` or ``attention_tp > 1`` (ranks must draft alike; ``True`` there
            is an error).
        attention_pdl: launch the Triton attention kernels with programmatic dependent launch
            (:mod:`specdec.pdl`); ``None`` (default): where the GPU has it (SM90+). ``True`` on a GPU
            without it is an error when a step runs them. The engine builds its own backends with
            it (:attr:`attention_config`), so engines in one process may differ.
    """

    max_draft_tokens: int = 8
    tokens_per_block: int = 16
    num_pages: int | None = None
    max_num_seqs: int = 64
    attention_backend: str | None = None
    apply_chat_template: bool = True
    kv_cache_bytes: int | None = None
    share_draft_kv: bool | None = None
    kv_cache_dtype: str = "auto"
    kv_scale: float = 1.0
    cuda_graphs: bool = True
    batch_invariant: bool = False
    overlap_steps: bool | None = None
    prompt_graphs: bool = True
    draft_length: str = "fixed"
    cost_profile: str | None = None
    helix_cp: int = 1
    attention_tp: int = 1
    attention_pdl: bool | None = None
    max_prefill_tokens: int | None = None
    freeze_heap: bool = True
    draft_gate: bool | None = None

    def __new__(cls, *args, **kwargs):
        _check_field_names(cls, args, kwargs, ConfigError)  # before a bare TypeError from __init__
        return object.__new__(cls)

    def __post_init__(self) -> None:
        if self.draft_length not in DRAFT_LENGTH_RULES:
            raise ConfigError(f"draft_length must be one of {DRAFT_LENGTH_RULES}, got {self.draft_length!r}")
        if self.cost_profile is not None and not isinstance(self.cost_profile, str):
            raise ConfigError(f"cost_profile must be a path (str) to a saved CostProfile or None, got {self.cost_profile!r}")
        if not _is_int(self.max_draft_tokens) or self.max_draft_tokens < 0:
            raise ConfigError(f"max_draft_tokens must be an integer >= 0, got {self.max_draft_tokens!r}")
        if not _is_int(self.tokens_per_block) or self.tokens_per_block not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ConfigError(f"tokens_per_block must be a power of two in [1, 256], got {self.tokens_per_block!r}")
        if self.num_pages is not None and (not _is_int(self.num_pages) or self.num_pages < 1):
            raise ConfigError(f"num_pages must be an integer >= 1 or None, got {self.num_pages!r}")
        if not _is_int(self.max_num_seqs) or self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        if self.kv_cache_bytes is not None and (not _is_int(self.kv_cache_bytes) or self.kv_cache_bytes < 1):
            raise ConfigError(f"kv_cache_bytes must be an integer >= 1 or None (sized from the model), "
                              f"got {self.kv_cache_bytes!r}")
        if self.attention_backend is not None and not isinstance(self.attention_backend, str):
            raise ConfigError(f"attention_backend must be a backend name or None, got {self.attention_backend!r}")
        if self.attention_pdl is not None and not isinstance(self.attention_pdl, bool):
            raise ConfigError(f"attention_pdl must be True, False or None (where the GPU has it), "
                              f"got {self.attention_pdl!r}")
        if not isinstance(self.apply_chat_template, bool):
            raise ConfigError(f"apply_chat_template must be True or False, got {self.apply_chat_template!r}")
        if self.share_draft_kv is not None and not isinstance(self.share_draft_kv, bool):
            raise ConfigError(f"share_draft_kv must be True, False or None, got {self.share_draft_kv!r}")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {tuple(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if isinstance(self.kv_scale, bool) or not isinstance(self.kv_scale, (int, float)) \
                or not (math.isfinite(self.kv_scale) and self.kv_scale > 0):
            raise ConfigError(f"kv_scale must be a finite number > 0, got {self.kv_scale!r}")
        if self.kv_scale != 1.0 and self.kv_cache_dtype == "auto":
            raise ConfigError(f"kv_scale applies only to kv_cache_dtype='fp8_e4m3' (got kv_cache_dtype='auto'): "
                              f"must be 1.0, got {self.kv_scale!r}")
        for name in ("cuda_graphs", "batch_invariant", "prompt_graphs", "freeze_heap"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.draft_gate is not None and not isinstance(self.draft_gate, bool):
            raise ConfigError(f"draft_gate must be True, False or None (as the drafter declares), got {self.draft_gate!r}")
        if self.overlap_steps is not None and not isinstance(self.overlap_steps, bool):
            raise ConfigError(f"overlap_steps must be True, False or None (where it helps), got {self.overlap_steps!r}")
        if self.max_prefill_tokens is not None and (not _is_int(self.max_prefill_tokens) or self.max_prefill_tokens < 1):
            raise ConfigError(f"max_prefill_tokens must be an integer >= 1 or None (whole prompts), "
                              f"got {self.max_prefill_tokens!r}")
        if not _is_int(self.helix_cp) or self.helix_cp < 1:
            raise ConfigError(f"helix_cp must be an integer >= 1 (1 = no Helix), got {self.helix_cp!r}")
        if self.max_prefill_tokens is not None and self.helix_cp > 1:
            raise ConfigError("max_prefill_tokens (chunked prefill) is not supported with helix_cp > 1 yet")
        if not _is_int(self.attention_tp) or self.attention_tp < 1:
            raise ConfigError(f"attention_tp must be an integer >= 1 (1 = off), got {self.attention_tp!r}")
        if self.draft_gate and (self.helix_cp > 1 or self.attention_tp > 1):
            raise ConfigError("draft_gate=True is not supported with helix_cp > 1 or attention_tp > 1: the gate "
                              "decides from each rank's own step times, and ranks must draft alike "
                              "(None, the default, leaves it off there)")
        if self.batch_invariant and not self.cuda_graphs:
            raise ConfigError("batch_invariant=True needs cuda_graphs=True (the invariant step is a graph bucket)")

    @property
    def kv_dtype(self) -> torch.dtype | None:
        """Storage dtype of the target's KV cache; ``None`` means the target's compute dtype."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype]

    @property
    def attention_config(self) -> AttentionConfig:
        """What the engine's attention backends are built with."""
        return AttentionConfig(pdl=self.attention_pdl)


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    """Options every attention backend of one engine is built with
    (:meth:`specdec.attention.backends.base.AttentionBackend.from_config`); a backend reads the
    ones that apply to it.

    Attributes:
        pdl: launch with programmatic dependent launch (:mod:`specdec.pdl`); ``None``: where the
            GPU has it (SM90+).

    Raises:
        ConfigError: a field of the wrong type (the message names it).
    """

    pdl: bool | None = None

    def __post_init__(self) -> None:
        if self.pdl is not None and not isinstance(self.pdl, bool):
            raise ConfigError(f"AttentionConfig.pdl must be True, False or None, got {self.pdl!r}")


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Which kernels a Llama-family target's forward runs, fixed when the target is built
    (``LlamaTarget(..., kernels=)``, ``load_target(..., kernels=)``). ``None`` fields are chosen
    by the target from its device and weights; ``target.kernels`` shows the choice.

    Attributes:
        fused: fused Triton elementwise kernels (norm, RoPE + cache write, SiLU·up, residual adds
            folded into the next norm). ``None``: on CUDA when Triton is installed. ``True`` on a
            CPU runs them in Triton's interpreter (``TRITON_INTERPRET=1``, as tests do).
        fused_gemm: with ``fused``, steps of at most ``fused_gemm_max_tokens`` tokens also fold
            each norm, RoPE, cache write, activation and residual add into the GEMM beside it
            (five kernels a layer plus attention); they need a cache of the compute dtype and no
            QK norm. Other steps run cuBLAS GEMMs beside the fused elementwise kernels.
        fused_gemm_max_tokens: most tokens a step may have for the fused GEMMs. ``None``: 512, or
            64 for models whose GEMM weights exceed 8 MB
            (:func:`specdec.target.llama.fused_gemm_max_tokens`).
        pdl: programmatic dependent launch level of the fused GEMMs (:mod:`specdec.pdl`): 0 off,
            1 launch early, 2 launch early and prefetch the weights into L2. ``None``: the
            device's level (2 on SM90+, else 0) with the fused GEMMs, else 0. Above 0 it needs
            ``fused`` and ``fused_gemm`` and an SM90+ GPU (checked when the target is built).

    Raises:
        ConfigError: a field of the wrong type or out of range (the message names it).
    """

    fused: bool | None = None
    fused_gemm: bool = True
    fused_gemm_max_tokens: int | None = None
    pdl: int | None = None

    def __post_init__(self) -> None:
        if self.fused is not None and not isinstance(self.fused, bool):
            raise ConfigError(f"KernelConfig.fused must be True, False or None (CUDA with Triton), got {self.fused!r}")
        if not isinstance(self.fused_gemm, bool):
            raise ConfigError(f"KernelConfig.fused_gemm must be True or False, got {self.fused_gemm!r}")
        if self.fused_gemm_max_tokens is not None and (not _is_int(self.fused_gemm_max_tokens)
                                                       or self.fused_gemm_max_tokens < 1):
            raise ConfigError(f"KernelConfig.fused_gemm_max_tokens must be an integer >= 1 or None (from the "
                              f"weight size), got {self.fused_gemm_max_tokens!r}")
        if self.pdl is not None and (not _is_int(self.pdl) or self.pdl not in (0, 1, 2)):
            raise ConfigError(f"KernelConfig.pdl must be 0, 1, 2 or None (the device's level), got {self.pdl!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_field_names(cls, args: tuple, kwargs: dict, error: type[Exception]) -> None:
    """Refuse, with ``error`` naming them, keyword arguments that are no field of the dataclass
    ``cls`` and more positional arguments than it has fields."""
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(kwargs) - set(names))
    if unknown:
        raise error(f"no field {', '.join(map(repr, unknown))} in {cls.__name__}; its fields: {', '.join(names)}")
    if len(args) > len(names):
        raise error(f"{cls.__name__} takes at most {len(names)} positional arguments ({', '.join(names)}), "
                    f"got {len(args)}")


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def engine_config(base: EngineConfig | None, overrides: dict) -> EngineConfig:
    """``base`` (default: ``EngineConfig()``) with ``overrides`` replacing its fields.

    Raises:
        ConfigError: ``base`` is not an ``EngineConfig``, an override names no field (the
            message lists the fields: ``EngineConfig`` itself refuses it), or a value is invalid.
    """
    if base is not None and not isinstance(base, EngineConfig):
        raise ConfigError(f"config must be an EngineConfig or None, got {type(base).__name__}")
    base = base or EngineConfig()
    if not overrides:
        return base
    return EngineConfig(**{**{f: getattr(base, f) for f in base.__slots__}, **overrides})


#: ``EngineConfig.draft_length`` rules.
DRAFT_LENGTH_RULES = ("fixed", "confidence")

#: ``EngineConfig.kv_cache_dtype`` names and the storage dtype each means (``None``: the compute dtype).
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn}
