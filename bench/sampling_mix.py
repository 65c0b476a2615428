"""Greedy and sampled requests in one batch: step time of each mix beside all-greedy, same run.

    python bench/sampling_mix.py --device cpu --dtype float32 --num-prompts 4 --batch-size 4 \\
        --max-new-tokens 8 --problems 100-103                               # CPU, a check of the script
    python bench/sampling_mix.py --spec-bench .evaldata/question.jsonl --batch-size 32 --num-prompts 32 \\
        --max-new-tokens 256 --device cuda --dtype bfloat16 --out OUT/sampling_mix   # the H200

Systems: SpecEngine on SmolLM2-135M with each drafter of ``--drafters`` (default ``null,suffix``),
one engine build, the same prompts, each run with three mixes of sampling parameters at one batch
size (``--batch-size``, default 32):

  greedy   every request greedy (temperature 0)
  half     every other request (odd indices) sampled: temperature 0.8, top-p 0.95, seed
           ``--seed`` + its index; the rest greedy
  sampled  every request sampled (the same parameters and seeds)

Prompts: the first turns of a Spec-Bench ``question.jsonl`` (``--spec-bench``, default
``.evaldata/question.jsonl``; evaluation data, only read) in file order, or HumanEval problems
when ``--problems`` is given (e.g. 100-163, held out; also the default when the Spec-Bench file is
not there); the first ``--num-prompts`` of them, as chat prompts (the engine applies the template).

Reports per (drafter, mix): tokens/s, mean ms per engine step (wall time / engine steps), its
ratio to the same drafter's all-greedy step time, mean accepted length, mean requests per step
(mixes whose requests end earlier run smaller steps), the per-step breakdown of
``engine.timings`` (forward / draft / verify / host), and two checks:

  greedy rows = all-greedy   the greedy requests of a mixed batch whose outputs equal the same
                             drafter's all-greedy outputs for the same prompts (they must: a greedy
                             row is bit-identical to its solo greedy run)
  equal to null              outputs equal to the null drafter's in the same mix, greedy rows and
                             seeded sampled rows counted apart (a seed reproduces whatever the drafter)

Every (drafter, mix) run builds a fresh engine (so the suffix drafter's global automaton starts
the same way in each mix), captures its CUDA graphs (``engine.capture_graphs``, where the engine
offers it), generates one batch of the prompts that follow the timed ones with its own
parameters, untimed (the timed prompts' first batch where none follow), then the timed pass.
``--repeat N`` runs everything N times round-robin: the reported run is the one of median step
time, the ratio the median of the per-round ratios. Writes markdown and JSON to ``--out``
(a path without suffix) after every round.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import run_header  # noqa: E402

from specdec import SamplingParams, SpecEngine  # noqa: E402
from specdec.drafters import make_drafter  # noqa: E402
from specdec.prompts import humaneval_prompts, parse_range  # noqa: E402
from specdec.target import load_target  # noqa: E402

MIXES = ("greedy", "half", "sampled")
TEMPERATURE, TOP_P = 0.8, 0.95


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[(len(s) - 1) // 2]


def sampled_rows(mix: str, n: int) -> list[bool]:
    """Which of ``n`` requests sample in ``mix`` (the rest are greedy)."""
    return [mix == "sampled" or (mix == "half" and i % 2 == 1) for i in range(n)]


def mix_params(mix: str, n: int, args) -> list[SamplingParams]:
    """One ``SamplingParams`` per request: greedy, or temperature 0.8, top-p 0.95 and seed ``seed + i``."""
    return [SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos,
                           **({"temperature": TEMPERATURE, "top_p": TOP_P, "seed": args.seed + i} if s else {}))
            for i, s in enumerate(sampled_rows(mix, n))]


def run_mix(target, drafter: str, mix: str, prompts: list[str], max_prompt_len: int, args,
            warm: list[str] | None = None) -> dict:
    """One (drafter, mix) run on a fresh engine: graphs, an untimed batch of ``warm`` prompts (the
    first batch of ``prompts`` when ``None``), then the timed pass over ``prompts``."""
    kwargs = {"max_draft_tokens": args.k} if drafter == "suffix" else {}
    engine = SpecEngine(target, make_drafter(drafter, **kwargs), max_draft_tokens=args.k,
                        max_num_seqs=args.batch_size, draft_gate=False)  # every step drafts: sampled verify is measured
    params = mix_params(mix, len(prompts), args)
    b = args.batch_size
    try:
        t0 = time.perf_counter()
        captured = 0
        if hasattr(engine, "capture_graphs"):  # every graph bucket these prompts can need, untimed
            captured = engine.capture_graphs(max_kv_len=max_prompt_len + args.max_new_tokens + args.k + 1,
                                             progress=False)
        warm = warm or prompts[:b]  # untimed: kernels, compilation, first-use costs
        engine.generate(warm, mix_params(mix, len(warm), args))
        _sync(args.device)
        warmup_s = time.perf_counter() - t0
        engine.timings.update({k: 0 for k in engine.timings})
        outs, wall = [], 0.0
        for i in range(0, len(prompts), b):
            _sync(args.device)
            t0 = time.perf_counter()
            outs += engine.generate(prompts[i:i + b], params[i:i + b])
            _sync(args.device)
            wall += time.perf_counter() - t0
        timings = dict(engine.timings)
    finally:
        if hasattr(engine, "close"):
            engine.close()
    steps = max(1, timings["steps"])
    acc = [a for o in outs for a in o.stats.accepted_lengths]
    tokens = sum(len(o.token_ids) for o in outs)
    return {"outputs": [list(o.token_ids) for o in outs], "sampled": sampled_rows(mix, len(prompts)),
            "time_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "steps": timings["steps"],
            "ms_per_step": 1e3 * wall / steps, "mean_accepted_length": sum(acc) / max(1, len(acc)),
            "requests_per_step": sum(o.stats.target_steps for o in outs) / steps,
            "per_step_ms": {k.removesuffix("_s"): 1e3 * v / steps for k, v in timings.items() if k.endswith("_s")},
            "finish_reasons": {r: sum(o.finish_reason == r for o in outs) for r in {o.finish_reason for o in outs}},
            "graphs_captured": captured, "warmup_s": warmup_s}


def equal_rows(a: dict, b: dict, sampled: bool) -> tuple[int, int]:
    """(equal, total) over the rows of ``a`` that are sampled (``sampled``) or greedy, compared with ``b``."""
    rows = [i for i, s in enumerate(a["sampled"]) if s == sampled]
    return sum(a["outputs"][i] == b["outputs"][i] for i in rows), len(rows)


def checks(res: dict[tuple[str, str], dict], drafter: str, mix: str) -> dict:
    """(equal, total) of one (drafter, mix): greedy rows vs the same drafter's all-greedy run,
    greedy and sampled rows vs the null drafter's run of the same mix (``None``: no such run)."""
    r, greedy, null = res[(drafter, mix)], res.get((drafter, "greedy")), res.get(("null", mix))
    return {"greedy_rows_equal_all_greedy": equal_rows(r, greedy, False) if greedy else None,
            "greedy_rows_equal_null": equal_rows(r, null, False) if null else None,
            "sampled_rows_equal_null": equal_rows(r, null, True) if null else None}


def summarise(rounds: dict[tuple[str, str], list[dict]]) -> dict[tuple[str, str], dict]:
    """Per (drafter, mix): the run of median step time, with every round's step time and the median
    of the per-round ratios to the same drafter's all-greedy step time."""
    out = {}
    for (drafter, mix), runs in rounds.items():
        order = sorted(range(len(runs)), key=lambda i: runs[i]["ms_per_step"])
        r = dict(runs[order[(len(runs) - 1) // 2]])
        r["ms_per_step_rounds"] = [x["ms_per_step"] for x in runs]
        r["tokens_per_s_rounds"] = [x["tokens_per_s"] for x in runs]
        greedy = rounds.get((drafter, "greedy"), [])
        n = min(len(runs), len(greedy))
        if n:
            ratios = sorted(runs[i]["ms_per_step"] / greedy[i]["ms_per_step"] for i in range(n))
            r["step_vs_greedy_rounds"] = ratios
            r["step_vs_greedy"] = _median(ratios)
        out[(drafter, mix)] = r
    return out


def _per_request(r: dict) -> float:
    """Milliseconds per request-step: a step's time over the requests it verified."""
    return r["ms_per_step"] / r["requests_per_step"]


def report(header: str, res: dict[tuple[str, str], dict], drafters: list[str], done: bool) -> str:
    text = [header, "",
            "| drafter | mix | tokens/s | ms / step | step vs all-greedy | mean accepted length | requests / step "
            "| ms per request-step vs all-greedy | ms / step: forward / draft / verify / host "
            "| greedy rows = all-greedy | equal to null: greedy rows | equal to null: sampled rows |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def frac(pair):
        return f"{pair[0]}/{pair[1]}" if pair[1] else "-"

    for drafter in drafters:
        for mix in MIXES:
            r = res.get((drafter, mix))
            if r is None:
                continue
            rounds = r["ms_per_step_rounds"]
            ms = f"{r['ms_per_step']:.3f}" + (f" ({min(rounds):.3f}–{max(rounds):.3f})" if len(rounds) > 1 else "")
            vs = r.get("step_vs_greedy_rounds", [])
            ratio = (f"{r['step_vs_greedy']:.2f}x" + (f" ({vs[0]:.2f}–{vs[-1]:.2f})" if len(vs) > 1 else "")
                     if vs else "-")
            p = r["per_step_ms"]
            brk = f"{p['forward']:.3f} / {p['draft']:.3f} / {p['verify']:.3f} / {p['host']:.3f}"
            greedy = res.get((drafter, "greedy"))
            # mixes run different numbers of requests per step (sampled requests end at other lengths)
            per_req = (f"{_per_request(r) / _per_request(greedy):.2f}x" if greedy else "-")
            same_greedy = frac(equal_rows(r, greedy, False)) if greedy and mix != "greedy" else "-"
            null = res.get(("null", mix))
            to_null_g = frac(equal_rows(r, null, False)) if null and drafter != "null" else "-"
            to_null_s = frac(equal_rows(r, null, True)) if null and drafter != "null" else "-"
            text.append(f"| {drafter} | {mix} | {r['tokens_per_s']:.1f} | {ms} | {ratio} | "
                        f"{r['mean_accepted_length']:.2f} | {r['requests_per_step']:.1f} | {per_req} | {brk} | "
                        f"{same_greedy} | {to_null_g} | {to_null_s} |")
    text.append("")
    if not done:
        text.append("(incomplete: the run was still going)")
    return "\n".join(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", default="null,suffix", help="comma-separated drafters (null, suffix, ...)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--spec-bench", default=".evaldata/question.jsonl", metavar="QUESTION_JSONL",
                    help="first turns of a Spec-Bench question.jsonl, in file order (read only); '' or a missing "
                         "file: HumanEval --problems instead")
    ap.add_argument("--problems", default=None,
                    help="HumanEval problems instead of Spec-Bench, e.g. 100-163 (the default when the Spec-Bench "
                         "file is not there)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--ignore-eos", action="store_true",
                    help="every request runs --max-new-tokens (full batches in every step of every mix)")
    ap.add_argument("--k", type=int, default=8, help="max draft tokens per step")
    ap.add_argument("--seed", type=int, default=0, help="sampled request i has seed SEED + i")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds, round-robin over every (drafter, mix); report the median")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="write markdown + JSON here (path without suffix)")
    args = ap.parse_args()
    if args.repeat < 1 or args.batch_size < 1 or args.num_prompts < 1:
        ap.error("--repeat, --batch-size and --num-prompts must be >= 1")
    drafters = args.drafters.split(",")
    if "null" not in drafters:
        print("note: without the null drafter there is no 'equal to null' check", file=sys.stderr)
    if args.threads:
        torch.set_num_threads(args.threads)

    spec_bench_given = args.spec_bench != ap.get_default("spec_bench")
    if args.problems is not None and spec_bench_given and args.spec_bench:
        ap.error("give --spec-bench or --problems, not both")
    if spec_bench_given and args.spec_bench and not Path(args.spec_bench).is_file():
        ap.error(f"--spec-bench {args.spec_bench}: no such file")
    if args.problems is None and args.spec_bench and Path(args.spec_bench).is_file():
        with open(args.spec_bench) as f:  # evaluation data: read only
            prompts = [json.loads(line)["turns"][0] for line in f if line.strip()]
        source = f"Spec-Bench {args.spec_bench} (first turns, file order)"
    else:
        args.problems = args.problems or "100-163"
        prompts = humaneval_prompts(parse_range(args.problems))
        source = f"HumanEval {args.problems}"
    if len(prompts) < args.num_prompts:
        ap.error(f"--num-prompts {args.num_prompts}: the prompts give only {len(prompts)}")
    # the untimed first batch: the prompts after the timed ones where there are any, so that the
    # suffix drafter's global automaton has not seen the timed responses (it would then draft them whole)
    warm = prompts[args.num_prompts:args.num_prompts + args.batch_size] or None
    prompts = prompts[:args.num_prompts]

    target = load_target("smollm2-135m", dtype=getattr(torch, args.dtype), device=args.device)
    tok = target.tokenizer
    max_prompt_len = max(len(tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                          add_generation_prompt=True),
                                 add_special_tokens=False)["input_ids"]) for p in prompts + (warm or []))
    header = run_header(args.device, f"SmolLM2-135M {args.dtype}", f"{source}, {args.num_prompts} prompts",
                        f"batch {args.batch_size}", f"{args.max_new_tokens} new tokens"
                        + (" (ignore_eos)" if args.ignore_eos else ""),
                        f"sampled rows: temperature {TEMPERATURE}, top-p {TOP_P}, seed {args.seed} + index",
                        f"{args.repeat} round(s), median step time" + ("; ratios: median of the per-round ratios"
                                                                       if args.repeat > 1 else ""))

    rounds: dict[tuple[str, str], list[dict]] = {}

    def save(done: bool) -> str:
        res = summarise(rounds)
        table = report(header, res, drafters, done)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out + ".md").write_text(table + "\n")
            data = {"header": header, "command": " ".join(["python", "bench/sampling_mix.py", *sys.argv[1:]]),
                    "args": vars(args), "done": done,
                    "results": {f"{d}/{m}": {k: v for k, v in r.items() if k != "outputs"}
                                for (d, m), r in res.items()},
                    "checks": {f"{d}/{m}": checks(res, d, m) for (d, m) in res}}
            Path(args.out + ".json").write_text(json.dumps(data, indent=1, default=str))
        return table

    for rnd in range(args.repeat):
        for drafter in drafters:
            for mix in MIXES:
                print(f"{drafter} {mix} b{args.batch_size} (round {rnd + 1}/{args.repeat}) ...",
                      file=sys.stderr, flush=True)
                rounds.setdefault((drafter, mix), []).append(run_mix(target, drafter, mix, prompts,
                                                                     max_prompt_len, args, warm))
        save(done=False)
    print(save(done=True))


if __name__ == "__main__":
    main()
