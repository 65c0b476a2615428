"""End-to-end benchmark: HF transformers vs specdec, same prompts, same run.

    python bench/e2e.py --problems 0-99 --max-new-tokens 128            # CPU, fp32
    python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --max-new-tokens 256

Systems (each at batch 1 over the same chat-templated HumanEval prompts, greedy):
  hf-greedy        transformers generate, greedy
  hf-prompt-lookup transformers generate with prompt_lookup_num_tokens
  specdec-<name>   SpecEngine with drafter <name> (default: null and suffix)

Reports tokens/s, target forwards per generated token, mean accepted length
(tokens per generation step) and, for each system, how many outputs equal
hf-greedy token for token. Writes a markdown table (and JSON) to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec import SamplingParams, SpecEngine  # noqa: E402
from specdec.drafters import make_drafter  # noqa: E402
from specdec.prompts import humaneval_prompts, parse_range  # noqa: E402
from specdec.target import load_target  # noqa: E402
from specdec.target.loading import cache_dir  # noqa: E402


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_hf(model, tok, prompt_ids, args, lookup: int | None):
    """transformers generate on one prompt at a time; counts forward calls."""
    calls = [0]
    handle = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    outs, t_total = [], 0.0
    eos = tok.eos_token_id
    try:
        for ids in prompt_ids:
            x = torch.tensor([ids], device=args.device)
            kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)
            if lookup:
                kw["prompt_lookup_num_tokens"] = lookup
            _sync(args.device)
            t0 = time.perf_counter()
            with torch.no_grad():
                y = model.generate(x, **kw)
            _sync(args.device)
            t_total += time.perf_counter() - t0
            outs.append(y[0, len(ids):].tolist())
    finally:
        handle.remove()
    tokens = sum(len(o) for o in outs)
    return {"outputs": outs, "time_s": t_total, "tokens": tokens, "forwards": calls[0]}


def run_specdec(target, drafter_name, prompt_ids, args):
    kwargs = {"max_draft_tokens": args.k} if drafter_name == "suffix" else {}
    engine = SpecEngine(target, make_drafter(drafter_name, **kwargs), max_draft_tokens=args.k)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    engine.generate([prompt_ids[0]], SamplingParams(max_new_tokens=4))  # warm-up
    outs, t_total = [], 0.0
    for i in range(0, len(prompt_ids), args.batch_size):
        _sync(args.device)
        t0 = time.perf_counter()
        outs += engine.generate(prompt_ids[i:i + args.batch_size], params)
        _sync(args.device)
        t_total += time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    acc = [a for o in outs for a in o.stats.accepted_lengths]
    return {"outputs": [list(o.token_ids) for o in outs], "time_s": t_total, "tokens": tokens,
            "forwards": sum(o.stats.target_steps for o in outs), "mean_accepted_length": sum(acc) / max(1, len(acc)),
            "timings": {k: v for k, v in engine.timings.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", default="0-99")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--k", type=int, default=8, help="max draft tokens per step")
    ap.add_argument("--batch-size", type=int, default=1, help="specdec batch size")
    ap.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens for HF")
    ap.add_argument("--drafters", default="null,suffix")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="write markdown + JSON here (path without suffix)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target = load_target("smollm2-135m", dtype=dtype, device=args.device)
    tok = target.tokenizer
    prompts = humaneval_prompts(parse_range(args.problems))
    prompt_ids = [tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                              add_generation_prompt=True), add_special_tokens=False)["input_ids"]
                  for p in prompts]
    results = {}
    if not args.skip_hf:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(cache_dir() / "smollm2-135m", dtype=dtype)
        model = model.to(args.device).eval()
        run_hf(model, tok, prompt_ids[:1], argparse.Namespace(**{**vars(args), "max_new_tokens": 4}), None)
        print("hf-greedy ...", file=sys.stderr, flush=True)
        results["hf-greedy"] = run_hf(model, tok, prompt_ids, args, None)
        print("hf-prompt-lookup ...", file=sys.stderr, flush=True)
        results["hf-prompt-lookup"] = run_hf(model, tok, prompt_ids, args, args.lookup)
        del model
    for name in args.drafters.split(","):
        print(f"specdec-{name} ...", file=sys.stderr, flush=True)
        results[f"specdec-{name}"] = run_specdec(target, name, prompt_ids, args)
    ref = results.get("hf-greedy", results.get("specdec-null"))["outputs"]
    base_tps = results["hf-greedy"]["tokens"] / results["hf-greedy"]["time_s"] if "hf-greedy" in results else None
    lines = [f"| system | tokens/s | vs hf-greedy | target forwards / token | mean accepted length | outputs equal to {'hf-greedy' if 'hf-greedy' in results else 'specdec-null'} |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        tps = r["tokens"] / r["time_s"]
        same = sum(a == b for a, b in zip(r["outputs"], ref))
        mal = f"{r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else "-"
        ratio = f"{tps / base_tps:.2f}x" if base_tps else "-"
        lines.append(f"| {name} | {tps:.1f} | {ratio} | {r['forwards'] / r['tokens']:.3f} | {mal} | {same}/{len(ref)} |")
    machine = (f"{platform.machine()}, {torch.get_num_threads()} threads" if args.device == "cpu"
               else torch.cuda.get_device_name())
    head = (f"`python bench/e2e.py {' '.join(sys.argv[1:])}` — {datetime.date.today()}, {machine}, "
            f"torch {torch.__version__}, SmolLM2-135M {args.dtype}, HumanEval {args.problems}, "
            f"{args.max_new_tokens} new tokens, greedy, batch {args.batch_size}")
    table = head + "\n\n" + "\n".join(lines) + "\n"
    print(table)
    if args.out:
        Path(args.out + ".md").write_text(table)
        Path(args.out + ".json").write_text(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "outputs"}
                                                        for k, v in results.items()}, indent=2))


if __name__ == "__main__":
    main()
