"""Read block-drafter checkpoints: ours, and the public DFlash HF layout.

Public DFlash drafters (``architectures: ["DFlashDraftModel"]``) are HF
directories whose ``config.json`` is a Qwen3/Llama decoder config plus
``block_size`` (top level or in ``dflash_config``) and
``dflash_config: {target_layer_ids, mask_token_id}``; weights are
``fc.weight``, ``hidden_norm.weight``, ``layers.N.self_attn.*``,
``layers.N.mlp.*``, ``norm.weight`` (optionally under ``model.``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.drafters.block import BlockDrafterConfig
from specdec.errors import CheckpointError, ConfigError


def _config_from_public(cfg: dict, fc_in: int) -> BlockDrafterConfig:
    sub = cfg.get("dflash_config") or {}
    block = sub.get("block_size", cfg.get("block_size"))
    layer_ids = sub.get("target_layer_ids", cfg.get("target_layer_ids"))
    mask = sub.get("mask_token_id", cfg.get("mask_token_id"))
    for name, value in (("block_size", block), ("target_layer_ids", layer_ids), ("mask_token_id", mask)):
        if value is None:
            raise CheckpointError(f"DFlash config.json must give {name} (top level or in dflash_config)")
    heads = cfg["num_attention_heads"]
    return BlockDrafterConfig(
        block_size=int(block), shift_label=int(cfg.get("shift_label", 0)), target_layer_ids=tuple(layer_ids),
        target_hidden_size=fc_in // len(layer_ids), vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"], num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, intermediate_size=cfg["intermediate_size"],
        mask_token_id=int(mask), rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=cfg.get("rope_theta", 10000.0),
        qk_norm=cfg.get("model_type") == "qwen3")


def read_block_checkpoint(path: Path) -> tuple[BlockDrafterConfig, dict[str, torch.Tensor]]:
    """Config and weights of a block drafter directory (either layout).

    Raises:
        CheckpointError: no config.json / safetensors, or required fields missing.
    """
    from specdec.target.loading import read_safetensors_dir

    if not (path / "config.json").is_file():
        raise CheckpointError(f"drafter checkpoint {str(path)!r} has no config.json")
    cfg = json.loads((path / "config.json").read_text())
    weights = {k.removeprefix("model."): v for k, v in read_safetensors_dir(path).items()}
    if "fc.weight" not in weights:
        raise CheckpointError(f"drafter checkpoint {str(path)!r} has no fc.weight")
    if cfg.get("architectures", [""])[0] == "SpecdecBlockDrafter":
        fields = {k: v for k, v in cfg.items() if k != "architectures"}
        try:
            config = BlockDrafterConfig(**fields)
        except TypeError as e:
            raise CheckpointError(f"drafter config.json in {str(path)!r} has unexpected fields: {e}") from None
    else:
        config = _config_from_public(cfg, weights["fc.weight"].shape[1])
    if weights["fc.weight"].shape[1] != len(config.target_layer_ids) * config.target_hidden_size:
        raise ConfigError(f"fc.weight input width {weights['fc.weight'].shape[1]} must equal "
                          f"len(target_layer_ids) * target_hidden_size")
    return config, weights
