"""Attention backends; each declares what it supports."""

from specdec.attention.backends.base import AttentionBackend, PhaseBatch
from specdec.attention.backends.torch_ref import TorchRefBackend

__all__ = ["AttentionBackend", "PhaseBatch", "TorchRefBackend"]
