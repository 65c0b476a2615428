"""specdec: lossless speculative decoding, centered on drafters.

Quick start::

    from specdec import SpecEngine, SamplingParams
    from specdec.target import load_target
    from specdec.drafters import SuffixAutomatonDrafter

    engine = SpecEngine(load_target("smollm2-135m"), SuffixAutomatonDrafter())
    outs = engine.generate(["def fib(n):"], SamplingParams(max_new_tokens=64))
"""

# Imported on first use (PEP 562), so ``import specdec.errors`` and ``specdec --help`` do not load torch.
_LAZY = {"EngineConfig": "specdec.config", "KernelConfig": "specdec.config", "SamplingParams": "specdec.config",
         "SpecEngine": "specdec.engine",
         "GenerationOutput": "specdec.sequence", "RequestStats": "specdec.sequence", "StepOutput": "specdec.sequence"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = ["EngineConfig", "GenerationOutput", "KernelConfig", "RequestStats", "SamplingParams", "SpecEngine",
           "StepOutput"]
__version__ = "0.1.0"
