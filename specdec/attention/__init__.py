"""Attention: shapes, backends that declare what they support, the selector."""

from specdec.attention.metadata import AttentionMetadata, plan_step
from specdec.attention.selector import available_backends, get_backend, register_backend, select
from specdec.attention.shapes import AttnShape, Verdict

__all__ = [
    "AttentionMetadata",
    "AttnShape",
    "Verdict",
    "available_backends",
    "get_backend",
    "plan_step",
    "register_backend",
    "select",
]
