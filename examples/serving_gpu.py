"""Serving on a GPU: CUDA graphs captured before the first request, then where each step's time went.

    python examples/serving_gpu.py            # bf16 on CUDA; on a CPU it runs eagerly in fp32 and says so

Public API only. On CUDA the target runs the fused kernels, every generation bucket up to a
2048-token context is captured first (``capture_graphs``), and ``graph_stats`` / ``timings``
show what ran: graph vs eager steps (and why eager), the attention backend of each phase, host
time to launch a step and to wait for it.
"""

import time

import torch

from specdec import SamplingParams, SpecEngine
from specdec.drafters import SuffixAutomatonDrafter
from specdec.target import load_target

cuda = torch.cuda.is_available()
target = load_target("smollm2-135m", dtype=torch.bfloat16 if cuda else torch.float32,
                     device="cuda" if cuda else "cpu")
engine = SpecEngine(target, SuffixAutomatonDrafter(max_draft_tokens=8), max_num_seqs=4)

t0 = time.perf_counter()
captured = engine.capture_graphs(max_kv_len=2048)  # 0 on a CPU: graphs need CUDA
print(f"captured {captured} CUDA graphs in {time.perf_counter() - t0:.1f} s")

prompts = ["Write a Python function that checks whether a string is a palindrome.",
           "List the planets of the solar system, one per line.",
           "Explain what a hash map is in two sentences.",
           "Repeat three times: the quick brown fox."]
t0 = time.perf_counter()
outs = engine.generate(prompts, SamplingParams(max_new_tokens=48))
wall = time.perf_counter() - t0
tokens = sum(len(o.token_ids) for o in outs)
steps = max(1, engine.timings["steps"])
stats = engine.graph_stats
print(f"{tokens} tokens in {wall:.2f} s ({tokens / wall:.1f} tokens/s), {engine.timings['steps']} engine steps, "
      f"target steps per request: {[o.stats.target_steps for o in outs]}")
print(f"graph steps {stats['graph_steps']}, eager steps {stats['eager_steps']} {stats['eager_reasons']}, "
      f"captured while serving: {stats['graphs_captured'] - captured}")
print(f"backends: {stats['backends']}")
print(f"per step: forward {1e3 * engine.timings['forward_s'] / steps:.3f} ms "
      f"(launch {1e6 * stats['launch_s'] / steps:.0f} µs, wait {1e6 * stats['wait_s'] / steps:.0f} µs), "
      f"draft {1e3 * engine.timings['draft_s'] / steps:.3f} ms")
