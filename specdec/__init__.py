"""specdec: lossless speculative decoding, centered on drafters.

Quick start::

    from specdec import SpecEngine, SamplingParams
    from specdec.target import load_target
    from specdec.drafters import SuffixAutomatonDrafter

    engine = SpecEngine(load_target("smollm2-135m"), SuffixAutomatonDrafter())
    outs = engine.generate(["def fib(n):"], SamplingParams(max_new_tokens=64))
"""

from specdec.config import EngineConfig, SamplingParams
from specdec.engine import SpecEngine
from specdec.sequence import GenerationOutput, RequestStats, StepOutput

__all__ = ["EngineConfig", "GenerationOutput", "RequestStats", "SamplingParams", "SpecEngine", "StepOutput"]
__version__ = "0.1.0"
