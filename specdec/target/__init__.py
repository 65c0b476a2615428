"""Targets: the models whose output the engine reproduces."""

from specdec.config import KernelConfig
from specdec.target.base import Target
from specdec.target.llama import LlamaConfig, LlamaTarget
from specdec.target.loading import KNOWN_TARGETS, load_target

__all__ = ["KNOWN_TARGETS", "KernelConfig", "LlamaConfig", "LlamaTarget", "Target", "load_target"]
