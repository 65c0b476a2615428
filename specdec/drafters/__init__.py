"""Drafters: they propose, the target verifies. Registered by name."""

from specdec.drafters.base import (
    Draft,
    Drafter,
    NullDrafter,
    available_drafters,
    check_hooks,
    make_drafter,
    register_drafter,
)
from specdec.drafters.dflash import BlockDrafter, DFlashDrafter, DSparkDrafter
from specdec.drafters.dspark_mla import MLABlockDrafterConfig, MLABlockDrafterNet, MLADSparkDrafter
from specdec.drafters.hybrid import HybridDrafter
from specdec.drafters.suffix_automaton import SuffixAutomatonDrafter

__all__ = [
    "BlockDrafter",
    "DFlashDrafter",
    "DSparkDrafter",
    "MLABlockDrafterConfig",
    "MLABlockDrafterNet",
    "MLADSparkDrafter",
    "Draft",
    "Drafter",
    "HybridDrafter",
    "NullDrafter",
    "SuffixAutomatonDrafter",
    "available_drafters",
    "check_hooks",
    "make_drafter",
    "register_drafter",
]
