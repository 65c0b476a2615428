"""Quickstart: speculative decoding with the suffix-automaton drafter, on the public API only.

    python examples/quickstart.py
"""

from specdec import SamplingParams, SpecEngine
from specdec.drafters import SuffixAutomatonDrafter
from specdec.target import load_target

target = load_target("smollm2-135m")  # first call converts the GGUF once (~1 min), then seconds
engine = SpecEngine(target, SuffixAutomatonDrafter(max_draft_tokens=8))

prompts = [
    "Write a Python function that reverses a linked list.",
    "Repeat this list twice: apples, pears, plums, cherries.",
]
outs = engine.generate(prompts, SamplingParams(max_new_tokens=96))
for out in outs:
    print(out.text)
    print(f"-- {len(out.token_ids)} tokens in {out.stats.target_steps} target steps, "
          f"mean accepted length {out.stats.mean_accepted_length:.2f}, finish: {out.finish_reason}\n")

# Serving stacks drive the same engine step by step and stream tokens:
req = engine.add_request("Count from 1 to 10.", SamplingParams(max_new_tokens=48))
while engine.has_unfinished():
    for delta in engine.step():
        print(target.tokenizer.decode(delta.new_token_ids), end="", flush=True)
print()
