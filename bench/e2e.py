"""End-to-end benchmark: HF transformers vs specdec, same prompts, same run.

    python bench/e2e.py --problems 0-99 --max-new-tokens 128            # CPU, fp32
    python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --max-new-tokens 256

    python bench/e2e.py --device cuda --dtype bfloat16 --problems 100-163 --max-new-tokens 256 \\
        --batch-sizes 1,8,32 --drafters null,suffix,dflash,dspark --invariant

Systems (over the same chat-templated HumanEval prompts, greedy, per batch size):
  hf-greedy          transformers generate, greedy (left-padded batches)
  hf-prompt-lookup   transformers generate with prompt_lookup_num_tokens (batch 1 only)
  hf-static          transformers generate with cache_implementation="static" (--hf-static;
                     on CUDA transformers compiles the decode step; warmed up untimed)
  specdec-<name>     SpecEngine with drafter <name> (default: null and suffix)
  specdec-<name>-invariant   the same with batch_invariant=True (--invariant)
  specdec-<name>+nopg  the same with prompt_graphs=False (+pg: True, the default), +nooverlap with
                     overlap_steps=False (+overlap: True; the default is on for null on CUDA), +conf
                     with draft_length="confidence" (drafts cut where their expected accepted tokens
                     per unit of step cost stop rising), +gate with draft_gate=True (per batch size, the
                     draft length, 0 included, measured to emit the most tokens/s; the default of the
                     block drafters), +nogate with draft_gate=False (every step drafts), +gate+plain with a gate
                     that never drafts and chains every step (what the drafter costs the plain regime a gate
                     can settle in; overlapped engines only), +nofreeze with freeze_heap=False (the garbage
                     collector's full passes walk the whole heap during generate); its ratio and equality are taken to
                     specdec-null with the same suffixes when the run has it

Reports tokens/s, ratios to hf-greedy and to specdec-null, mean accepted
length, the per-step time breakdown (target forward incl. the one device sync,
drafter, verify, host), the bytes-read floor of one step (weights + mean KV at
4.8 TB/s), graph-replayed steps, and how many outputs equal specdec-null's
(the -invariant rows: specdec-null-invariant's). Each specdec system first
captures every CUDA-graph bucket the prompts can need (``engine.capture_graphs``;
``--no-precapture`` leaves captures inside the timed steps) and generates its
first batch, untimed (compiles kernels; each block drafter compiles its own propose).
``--cprofile N`` adds, below the tables, a cProfile of each specdec system over its first N
prompts (a second, untimed pass). Writes a markdown table (and JSON) to --out.
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

from results_io import GCPauses, format_gpu_state, gpu_state, process_state  # noqa: E402 (bench/, the script's own folder)

from specdec import SamplingParams, SpecEngine  # noqa: E402
from specdec.draft_gate import DraftGate, GateStep, bucket_label, bucket_of  # noqa: E402
from specdec.drafters import make_drafter  # noqa: E402
from specdec.jit_stats import triton_kernels_built  # noqa: E402
from specdec.prompts import humaneval_prompts, parse_range  # noqa: E402
from specdec.target import load_target  # noqa: E402
from specdec.target.loading import cache_dir  # noqa: E402


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_hf(model, tok, prompt_ids, args, lookup: int | None, batch_size: int = 1, static: bool = False):
    """transformers generate, ``batch_size`` prompts at a time (left-padded); counts forward calls.

    ``static``: ``cache_implementation="static"`` (on CUDA transformers then compiles the decode
    step with ``torch.compile``; the caller warms it up untimed)."""
    calls = [0]
    handle = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    outs, t_total = [], 0.0
    eos = tok.eos_token_id
    try:
        for i in range(0, len(prompt_ids), batch_size):
            group = prompt_ids[i:i + batch_size]
            width = max(len(ids) for ids in group)
            x = torch.tensor([[eos] * (width - len(ids)) + ids for ids in group], device=args.device)
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in group], device=args.device)
            kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos,
                      attention_mask=mask)
            if lookup:
                kw["prompt_lookup_num_tokens"] = lookup
            if static:
                kw["cache_implementation"] = "static"
            _sync(args.device)
            t0 = time.perf_counter()
            with torch.no_grad():
                y = model.generate(x, **kw)
            _sync(args.device)
            t_total += time.perf_counter() - t0
            for row in y[:, width:].tolist():
                out = []
                for t in row:  # up to and including the first EOS (later columns are padding)
                    out.append(t)
                    if t == eos:
                        break
                outs.append(out)
    finally:
        handle.remove()
    tokens = sum(len(o) for o in outs)
    return {"outputs": outs, "time_s": t_total, "tokens": tokens, "forwards": calls[0]}


def run_specdec(target, drafter_name, prompt_ids, args, batch_size: int, **engine_kw):
    kind, *variants = drafter_name.split("+")
    kind, _, checkpoint = kind.partition("@")  # 'dflash@FOLDER': a block drafter from another checkpoint
    kwargs = {"max_draft_tokens": args.k, **json.loads(args.suffix_kwargs)} if kind == "suffix" else {}
    if checkpoint:
        if kind not in ("dflash", "dspark", "dspark_mla"):
            raise SystemExit(f"{drafter_name}: '@FOLDER' needs a block drafter (dflash, dspark, dspark_mla)")
        kwargs["net"] = checkpoint
    for variant in variants:
        if variant == "corpus":  # e.g. responses to other prompts (a server's history)
            if kind != "suffix" or not args.suffix_corpus:
                raise SystemExit(f"{drafter_name}: '+corpus' needs the suffix drafter and --suffix-corpus FILE")
            kwargs["corpus"] = [o for _, o in json.loads(Path(args.suffix_corpus).read_text())]
        elif variant in ENGINE_VARIANTS:
            engine_kw = {**engine_kw, **ENGINE_VARIANTS[variant]}
        elif variant in ("cost", "nocost") and kind != "hybrid":
            raise SystemExit(f"{drafter_name}: '+{variant}' is the hybrid drafter's (hybrid+{variant})")
        elif variant == "dflash":  # the hybrid with the shipped DFlash as its learned drafter (no confidence head)
            if kind != "hybrid":
                raise SystemExit(f"{drafter_name}: '+dflash' is the hybrid drafter's (hybrid+dflash)")
            from specdec.drafters.dflash import DFlashDrafter

            kwargs["learned"] = DFlashDrafter()
        elif variant in DRAFTER_VARIANTS:
            if kind not in ("dflash", "dspark", "dspark_mla", "hybrid"):
                raise SystemExit(f"{drafter_name}: '+{variant}' needs a block drafter (dflash, dspark, hybrid)")
            kwargs.update(DRAFTER_VARIANTS[variant])
        else:
            raise SystemExit(f"unknown drafter variant {variant!r} in {drafter_name!r} "
                             f"(corpus, {', '.join([*ENGINE_VARIANTS, *DRAFTER_VARIANTS])})")
    drafter = make_drafter(kind, **kwargs)
    engine = SpecEngine(target, drafter, max_draft_tokens=args.k, max_num_seqs=max(batch_size, 1), **engine_kw)
    if "plain" in variants:  # the gate's plain regime alone: no step drafts, every plain step chains
        if getattr(engine.executor, "gate", None) is None:
            raise SystemExit(f"{drafter_name}: '+plain' needs '+gate' and an overlapped engine (CUDA)")
        engine._gate = engine.executor.gate = _NeverDrafts(args.k)
    if args.gate_history and engine.draft_gate is not None:  # every measured step, the warm-up pass's too
        engine.draft_gate.keep_history(1 << 20)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    # Untimed: every graph bucket these prompts can need, then the first batch in full (compiles kernels).
    t0 = time.perf_counter()
    precaptured = 0 if args.no_precapture else engine.capture_graphs(
        max_kv_len=max(len(p) for p in prompt_ids) + args.max_new_tokens + args.k + 1, progress=False)
    precapture_s = time.perf_counter() - t0
    engine.generate(prompt_ids[:batch_size], params)
    engine.timings.update({k: 0 for k in engine.timings})
    engine.draft_length_stats.update({k: 0 for k in engine.draft_length_stats})
    for k in ("graph_steps", "eager_steps", "graphs_captured", "capture_s"):
        engine.runner.stats[k] = 0
    engine.runner.stats["eager_reasons"].clear()
    engine.runner.stats["backends"].clear()
    # a block drafter's propose graphs (a hybrid's learned drafter's): what the timed run did
    block = getattr(drafter, "learned", drafter)
    dstats = getattr(block, "stats", None) if hasattr(block, "cuda_graphs") else None
    compile_s = dstats.get("compile_s", 0.0) if dstats else 0.0
    if block is not drafter:
        drafter.stats.update({k: 0 for k in drafter.stats})
    if dstats:
        for k in ("graph_proposes", "eager_proposes", "graphs_captured", "capture_s", "device_s", "device_timed"):
            if k in dstats:
                dstats[k] = 0
        dstats["eager_reasons"].clear()
    outs, t_total, batch_s = [], 0.0, []
    history = engine.draft_gate.history if engine.draft_gate is not None else None
    timed_from = len(history) if history is not None else 0
    gpu_before = gpu_state() if args.device.startswith("cuda") else {}
    kernels_before = triton_kernels_built()
    with GCPauses() as gc_pauses:  # the collector's pauses fall inside the steps they interrupt
        for i in range(0, len(prompt_ids), batch_size):
            _sync(args.device)
            t0 = time.perf_counter()
            outs += engine.generate(prompt_ids[i:i + batch_size], params)
            _sync(args.device)
            batch_s.append(time.perf_counter() - t0)
            t_total += batch_s[-1]
    gpu_after = gpu_state() if args.device.startswith("cuda") else {}
    kernels_built = triton_kernels_built() - kernels_before  # first-time compiles inside the timed run
    if dstats is not None and hasattr(block, "propose_device_s"):
        block.propose_device_s  # noqa: B018 - takes the last propose's device time into dstats
        dstats = {**dstats, "eager_reasons": dstats["eager_reasons"].copy()}  # the timed run's, not the cProfile pass's
    gate_history = None if history is None else {"timed_from": timed_from, "fields": list(GateStep._fields),
                                                  "steps": [list(st) for st in history]}
    profile = None
    if args.cprofile:  # untimed: the host's functions over a second pass of the first prompts
        import cProfile

        from results_io import top_functions

        prof = cProfile.Profile()
        prof.enable()
        engine.generate(prompt_ids[:max(batch_size, args.cprofile)], params)
        _sync(args.device)
        prof.disable()
        profile = top_functions(prof, 30)
    tokens = sum(len(o.token_ids) for o in outs)
    acc = [a for o in outs for a in o.stats.accepted_lengths]
    steps = max(1, engine.timings["steps"])
    per_step_ms = {k.removesuffix("_s"): 1e3 * v / steps for k, v in engine.timings.items() if k.endswith("_s")}
    return {"outputs": [list(o.token_ids) for o in outs], "time_s": t_total, "tokens": tokens,
            "forwards": sum(o.stats.target_steps for o in outs), "mean_accepted_length": sum(acc) / max(1, len(acc)),
            "steps": engine.timings["steps"], "per_step_ms": per_step_ms,
            "executor": engine.executor.name, "overlapped_steps": engine.timings["overlapped_steps"], "graphs": engine.graph_stats,
            "precaptured_graphs": precaptured, "precapture_s": precapture_s,
            "mean_context": sum(len(o.prompt_token_ids) + len(o.token_ids) / 2 for o in outs) / len(outs),
            # per request: new tokens, generation steps, tokens those steps emitted (its tau = third / second)
            "per_request": [(len(o.token_ids), len(o.stats.accepted_lengths), sum(o.stats.accepted_lengths))
                            for o in outs],
            "batch_s": batch_s,
            "gc": gc_pauses.as_dict(),  # the collector's pauses in the timed run
            "triton_kernels_built": kernels_built,
            "draft_length_stats": dict(engine.draft_length_stats),  # what the confidence cut kept
            # '+gate': per batch bucket, the length chosen; per length, steps, estimated tokens/s, accepted tokens
            "draft_gate_stats": engine.draft_gate_stats,
            # '--gate-history': every step the gate measured (GateStep fields), the timed run's from timed_from on
            **({"draft_gate_history": gate_history} if gate_history else {}),
            **({"hybrid_stats": dict(drafter.stats)} if block is not drafter else {}),
            **({"drafter_stats": {**dstats, "eager_reasons": dict(dstats["eager_reasons"]),
                                  "compile_s_untimed": compile_s}} if dstats else {}),
            **({"cprofile": profile} if profile else {}),
            "gpu": {"before": gpu_before, "after": gpu_after},  # clocks, temperature, other processes
            "process": process_state()}  # what earlier systems left: GC objects, threads, allocator, engines


class _NeverDrafts(DraftGate):
    """'+plain' (with '+gate'): a gate that never drafts and promises every next step plain, so the
    engine runs the steady state of the plain regime a gate can settle in: the drafter attached and
    hearing every step (``on_accepted``, ``on_contexts``), each step launched ahead of the last. Its
    tokens/s against null's is what a drafter costs a plain step."""

    def draft_length(self, batch: int) -> int:
        return 0

    def plain_next(self, batch: int) -> bool:
        return True

    def record(self, batch: int, length: int, accepted, seconds: float, ahead: bool = False) -> None:
        if self.history is not None and seconds > 0:  # '--gate-history': the plain regime's own steps
            self.history.append(GateStep(batch, 0, bool(ahead), seconds, 0, 0))


def gate_history_lines(name: str, hist: dict) -> list[str]:
    """'--gate-history': per batch bucket and kind of step (a draft length; plain steps chained or not),
    the steps' count, median ms and tokens/s, in the warm-up pass and in the timed run."""
    f = {k: i for i, k in enumerate(hist["fields"])}
    groups: dict = {}
    for at, st in enumerate(hist["steps"]):
        length, ahead = st[f["length"]], st[f["ahead"]]
        kind = (length, ahead)
        g = groups.setdefault((bucket_of(st[f["batch"]]), kind), ([], []))
        g[at >= hist["timed_from"]].append(st)
    lines = [f"#### The gate's measured steps: {name}", "",
             "| batch | kind of step | warm-up pass: steps, median ms | timed run: steps, median ms | timed run: tokens/s |",
             "|---|---|---|---|---|"]
    for (bucket, (length, ahead)), parts in sorted(groups.items()):
        cells = []
        for steps in parts:
            ms = sorted(1e3 * st[f["seconds"]] for st in steps)
            cells.append(f"{len(steps):,}, {ms[len(ms) // 2]:.3f}" if steps else "-")
        timed = parts[1]
        secs = sum(st[f["seconds"]] for st in timed)
        toks = sum(st[f["batch"]] + st[f["accepted"]] for st in timed)
        kind = ("plain, chained" if ahead else "plain") if not length else f"{length} tokens"
        lines.append(f"| {bucket_label(bucket)} | {kind} | {cells[0]} | {cells[1]} | "
                     + (f"{toks / secs:,.0f}" if secs > 0 else "-") + " |")
    return lines + [""]


def _tps(r: dict) -> float:
    return r["tokens"] / r["time_s"]


# engine settings a system name may add to its drafter ("suffix+corpus+nopg"); such a system's ratio
# is taken to the null drafter with the same settings ("specdec-null+nopg") when the run has it.
# The defaults: prompt graphs on, overlapped decode steps on for the null drafter on CUDA.
ENGINE_VARIANTS = {"pg": {"prompt_graphs": True}, "nopg": {"prompt_graphs": False},
                   "overlap": {"overlap_steps": True}, "nooverlap": {"overlap_steps": False},
                   "conf": {"draft_length": "confidence"},
                   "gate": {"draft_gate": True},  # '+gate': the draft length measured fastest per batch size
                   "nogate": {"draft_gate": False},  # '+nogate': every step drafts (block drafters gate by default)
                   "plain": {},  # '+plain' (with '+gate'): never draft, chain every step (the plain regime's cost)
                   "nofreeze": {"freeze_heap": False}}  # '+nofreeze': the collector walks the whole heap
# drafter settings a system name may add ("dflash+compile"); ratios are to plain null. A block
# drafter's propose is compiled by default on CUDA and not on the CPU: '+compile' / '+nocompile' force it.
DRAFTER_VARIANTS = {"compile": {"torch_compile": True}, "nocompile": {"torch_compile": False},
                    "cost": {"cost_aware": True},  # '+cost': the hybrid asks DSpark only where it pays (default)
                    "nocost": {"cost_aware": False},  # '+nocost': wherever DSpark could win
                    # '+devdrafts': drafts left on the device and fed to the target's step there (no
                    # synchronisation after the propose); '+hostdrafts': read back after each propose (the default)
                    "devdrafts": {"device_drafts": True}, "hostdrafts": {"device_drafts": False}}


def _null_of(label: str, labels=()) -> str:
    """The null system a system's ratio and output equality are taken to: the invariant null for
    invariant systems, plain null for null's variants, the null with the same engine variants
    where the run has it, else plain null."""
    if label.endswith("-invariant"):
        return "specdec-null-invariant"
    if label.startswith("specdec-null"):  # a null variant is compared with plain null
        return "specdec-null"
    mine = [v for v in label.removeprefix("specdec-").split("+")[1:] if v in ENGINE_VARIANTS]
    same = "+".join(["specdec-null", *mine])
    return same if same in labels else "specdec-null"


def median_run(runs: list[dict], nulls: list[dict] | None) -> dict:
    """The run of median tokens/s, with every round's tokens/s and (given the null drafter's runs
    of the same rounds) the median of the per-round ratios to it."""
    order = sorted(range(len(runs)), key=lambda i: _tps(runs[i]))
    out = dict(runs[order[(len(runs) - 1) // 2]])
    out["tokens_per_s_rounds"] = [_tps(r) for r in runs]
    if nulls is not None and len(nulls) == len(runs):
        ratios = sorted(_tps(r) / _tps(n) for r, n in zip(runs, nulls))
        out["vs_null_rounds"] = ratios
        out["vs_null_median"] = ratios[(len(ratios) - 1) // 2]
    return out


def step_floor_us(target, batch: int, mean_context: float) -> float:
    """Bytes one target step must read (weights once, each request's KV) over 4.8 TB/s, in µs."""
    weights = sum(t.numel() * t.element_size() for L in target.layers
                  for t in (L.w_qkv, L.w_o, L.w_gate_up, L.w_down))
    weights += target.embed.numel() * target.embed.element_size()  # the tied LM head
    kv = sum(s.bytes_per_token for s in target.layer_specs()) * batch * mean_context
    return (weights + kv) / 4.8e12 * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", default="0-99")
    ap.add_argument("--hf-problems", default=None, help="HF's prompts at batch 1 (default: --problems)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--k", type=int, default=8, help="max draft tokens per step")
    ap.add_argument("--batch-size", "--batch-sizes", dest="batch_sizes", default="1",
                    help="comma-separated batch sizes, e.g. 1,8,32")
    ap.add_argument("--lookup", type=int, default=10, help="prompt_lookup_num_tokens for HF")
    ap.add_argument("--drafters", default="null,suffix",
                    help="comma-separated: null, suffix, suffix+corpus (preloaded with --suffix-corpus), dflash, "
                         "dspark (dflash@FOLDER: from that checkpoint folder instead of the shipped one); '+pg' / '+nopg' set prompt_graphs=True / False and '+overlap' / '+nooverlap' "
                         "overlap_steps=True / False for one system (e.g. null+nopg,suffix+nopg: ratios are then "
                         "to null+nopg); '+conf' cuts drafts by confidence; '+gate' drafts, per batch size, the length "
                         "(0 included) measured to emit the most tokens/s (draft_gate=True; '+gate+plain': never drafts, every step chained); '+compile' / '+nocompile' run a block drafter's "
                         "propose through torch.compile or not (default: compiled on CUDA; e.g. dflash+nocompile); "
                         "'+cost' / '+nocost' make the hybrid cost-aware (the default) or not; '+dflash' gives "
                         "the hybrid the shipped DFlash instead of DSpark (hybrid+dflash); '+devdrafts' leaves a "
                         "block drafter's drafts on the device for the target's step, '+hostdrafts' reads them "
                         "back after each propose (the default)")
    ap.add_argument("--suffix-kwargs", default="{}",
                    help='more SuffixAutomatonDrafter arguments, JSON (e.g. \'{"match_len_factor": 16}\')')
    ap.add_argument("--suffix-corpus", default=None,
                    help="a bench/replay_study.py --save file whose responses preload the 'suffix+corpus' drafter")
    ap.add_argument("--invariant", action="store_true",
                    help="also run each drafter with batch_invariant=True (GPU bf16 losslessness study)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every specdec system this many times, round-robin; report the median run and the "
                         "median of the per-round ratios to specdec-null (host noise on shared machines)")
    ap.add_argument("--no-graphs", action="store_true", help="cuda_graphs=False")
    ap.add_argument("--no-precapture", action="store_true",
                    help="capture graph buckets on demand (inside timed steps) instead of before the run")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--hf-static", action="store_true",
                    help="also HF generate with a static cache (compiled by transformers on CUDA)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="after each specdec system's timed pass, cProfile it over its first N prompts (at least "
                         "one batch), untimed; the top 30 functions by own time go below the tables")
    ap.add_argument("--gate-history", action="store_true",
                    help="'+gate' systems: keep every step the gate measures (DraftGate.keep_history) in the JSON, "
                         "and below the tables each batch bucket's median step time by draft length, plain "
                         "steps chained or not, in the warm-up pass and the timed run")
    ap.add_argument("--spec-bench", default=None, metavar="QUESTION_JSONL",
                    help="use the first turns of a Spec-Bench question.jsonl instead of HumanEval (--problems then "
                         "picks questions by index, e.g. 0-479)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="write markdown + JSON here (path without suffix)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target = load_target("smollm2-135m", dtype=dtype, device=args.device)
    tok = target.tokenizer

    categories: list[str] = []  # Spec-Bench category of each prompt (the per-category tables)

    def texts(problems):
        if args.spec_bench:  # evaluation only: first turns of the questions, in file order
            with open(args.spec_bench) as f:
                qs = [json.loads(line) for line in f if line.strip()]
            picked = [qs[i] for i in parse_range(problems)]
            if not categories:
                categories.extend(q.get("category", "?") for q in picked)
            return [q["turns"][0] for q in picked]
        return humaneval_prompts(parse_range(problems))

    def encode(problems):
        return [tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                            add_generation_prompt=True), add_special_tokens=False)["input_ids"]
                for p in texts(problems)]

    prompt_ids = encode(args.problems)
    hf_b1_ids = encode(args.hf_problems) if args.hf_problems else prompt_ids
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    results: dict[int, dict[str, dict]] = {b: {} for b in batch_sizes}
    if not args.skip_hf:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(cache_dir() / "smollm2-135m", dtype=dtype)
        model = model.to(args.device).eval()
        run_hf(model, tok, prompt_ids[:1], argparse.Namespace(**{**vars(args), "max_new_tokens": 4}), None)
        for b in batch_sizes:
            ids = hf_b1_ids if b == 1 else prompt_ids
            print(f"hf-greedy b{b} ...", file=sys.stderr, flush=True)
            results[b]["hf-greedy"] = run_hf(model, tok, ids, args, None, b)
            if b == 1:  # prompt lookup in transformers is batch-1 only
                print("hf-prompt-lookup b1 ...", file=sys.stderr, flush=True)
                results[b]["hf-prompt-lookup"] = run_hf(model, tok, ids, args, args.lookup, 1)
            if args.hf_static:
                print(f"hf-static b{b} ...", file=sys.stderr, flush=True)
                try:  # warm-up, untimed: the compile of the static-cache decode step
                    run_hf(model, tok, ids[:b], args, None, b, static=True)
                    results[b]["hf-static"] = run_hf(model, tok, ids, args, None, b, static=True)
                except Exception as e:  # noqa: BLE001 - "static cache where it works": say why not
                    print(f"hf-static b{b} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        del model

    def report(done: bool) -> str:
        """The tables so far (every system that has finished a round; ``done``: all of them)."""
        machine = (f"{platform.machine()}, {torch.get_num_threads()} threads" if args.device == "cpu"
                   else torch.cuda.get_device_name())
        head = (f"`python bench/e2e.py {' '.join(sys.argv[1:])}` — {datetime.date.today()}, {machine}, "
                f"torch {torch.__version__}, SmolLM2-135M {args.dtype}, "
                f"{'Spec-Bench first turns' if args.spec_bench else 'HumanEval'} {args.problems}"
                f"{f' (HF at batch 1: {args.hf_problems})' if args.hf_problems else ''}, "
                f"{args.max_new_tokens} new tokens, greedy"
                + (f"; specdec systems run {args.repeat} times round-robin: tokens/s is the median run (range), "
                   "vs specdec-null the median of the per-round ratios (range)" if args.repeat > 1 else ""))
        text = [head, ""]
        for b in batch_sizes:
            res = results[b]
            base = res.get("hf-greedy")
            base_tps = base["tokens"] / base["time_s"] if base else None
            text += [f"### batch {b}", "",
                     "| system | tokens/s | vs hf-greedy | vs specdec-null | mean accepted length | ms / step: forward"
                     " / draft / verify / host | floor µs / step | graph steps | outputs equal to null |",
                     "|---|---|---|---|---|---|---|---|---|"]
            for name, r in res.items():
                tps = r["tokens"] / r["time_s"]
                ratio = f"{tps / base_tps:.2f}x" if base_tps else "-"
                ref = res.get(_null_of(name, res))
                vs_null = f"{tps / (ref['tokens'] / ref['time_s']):.2f}x" if ref and name.startswith("specdec") else "-"
                if len(r.get("tokens_per_s_rounds", ())) > 1:  # median of rounds, then the range
                    rounds = r["tokens_per_s_rounds"]
                    tps_text = f"{tps:.1f} ({min(rounds):.0f}–{max(rounds):.0f})"
                    if "vs_null_median" in r:
                        vs = r["vs_null_rounds"]
                        vs_null = f"{r['vs_null_median']:.2f}x ({vs[0]:.2f}–{vs[-1]:.2f})"
                else:
                    tps_text = f"{tps:.1f}"
                mal = f"{r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else "-"
                if "per_step_ms" in r:
                    p = r["per_step_ms"]
                    brk = f"{p['forward']:.3f} / {p['draft']:.3f} / {p['verify']:.3f} / {p['host']:.3f}" + (
                        f" (+ plan {p['plan']:.3f})" if "plan" in p else "")  # schedule and pack
                    floor = f"{step_floor_us(target, b, r['mean_context']):.0f}"
                    g = r["graphs"]
                    graphs = f"{g['graph_steps']}/{g['graph_steps'] + g['eager_steps']}"
                else:
                    brk = floor = graphs = "-"
                same = (f"{sum(a == c for a, c in zip(r['outputs'], ref['outputs']))}/{len(ref['outputs'])}"
                        if ref and name.startswith("specdec") else "-")
                text.append(f"| {name} | {tps_text} | {ratio} | {vs_null} | {mal} | {brk} | {floor} | {graphs} | {same} |")
            text.append("")
            gate_tables = []  # '--gate-history', after the bullets
            for name, r in res.items():
                dl = r.get("draft_length_stats") or {}
                if dl.get("steps"):
                    text.append(f"- {name}: the confidence cut kept {dl['kept']:,} of {dl['drafted']:,} drafted tokens "
                                f"over {dl['steps']:,} steps")
                if r.get("draft_gate_stats") is not None:
                    text.append(f"- {name}: {r['executor']} steps; {r['overlapped_steps']:,} of {r['steps']:,} "
                                "launched ahead (the plain steps the gate takes chain)")
                for bucket, g in (r.get("draft_gate_stats") or {}).items():
                    by = ", ".join(f"{n}: {g['steps'].get(n, 0):,} steps, {t:,.0f} tokens/s"
                                   + (f", {g['accepted'][n]:.2f} accepted" if n in g["accepted"] else "")
                                   for n, t in g["tok_s"].items())
                    text.append(f"- {name}: the draft gate at batch {bucket}: draft length {g['draft_length']} "
                                f"(by length: steps, estimated tokens/s, accepted drafts per request: {by}; "
                                f"{g.get('chained', 0):,} plain steps chained)")
                if r.get("draft_gate_history"):
                    gate_tables += gate_history_lines(name, r["draft_gate_history"])
                hs = r.get("hybrid_stats")
                if hs:
                    text.append(f"- {name}: drafts taken from the learned drafter {hs['learned']:,}, from the suffix "
                                f"drafter {hs['suffix']:,} ({hs.get('learned_skipped', 0):,} without asking the "
                                f"learned one), neither drafted {hs['none']:,}")
                ps = r.get("process")
                if ps and name.startswith("specdec-null"):  # where a slower null after other systems may come from
                    text.append(f"- {name}: process after it: {ps['gc_tracked_objects']:,} GC-tracked objects, "
                                f"{len(ps['threads'])} threads, {ps['child_processes']} child processes, CUDA device "
                                f"allocations {ps.get('cuda_num_device_alloc')}, allocator retries "
                                f"{ps.get('cuda_num_alloc_retries')}, alive {ps.get('alive')}")
                gp = r.get("gc")
                if gp and gp["ms"] >= 1:
                    text.append(f"- {name}: the garbage collector paused the timed run {gp['ms']:.0f} ms "
                                f"({gp['ms'] / max(1, r['steps']):.3f} ms a step) in {sum(gp['collections']):,} "
                                f"collections, {gp['collections'][2]} of them full ({gp['ms_by_generation'][2]:.0f} ms)")
                if r.get("triton_kernels_built"):
                    text.append(f"- {name}: {r['triton_kernels_built']} Triton kernels were built inside the timed run "
                                f"(first-time compiles or loads from Triton's disk cache)")
                gs = r.get("gpu")
                if gs and (gs["before"] or gs["after"]):
                    text.append(f"- {name}: GPU before the timed run: {format_gpu_state(gs['before'])}; "
                                f"after: {format_gpu_state(gs['after'])}")
                ds = r.get("drafter_stats")
                if ds:
                    text.append(f"- {name}: propose graphs {ds['graph_proposes']:,}/"
                                f"{ds['graph_proposes'] + ds['eager_proposes']:,} (captured in the timed run: "
                                f"{ds['graphs_captured']}, {ds['capture_s']:.2f} s); compile before it "
                                f"{ds['compile_s_untimed']:.1f} s")
                    if ds.get("device_timed"):  # drafts left on the device: the propose's cost is its device time
                        text.append(f"- {name}: propose on the device {1e3 * ds['device_s'] / ds['device_timed']:.3f} ms "
                                    f"a propose, {1e3 * ds['device_s'] / max(1, r['steps']):.3f} ms a step "
                                    f"({ds['device_timed']:,} proposes timed; the forward column includes it)")
            text += category_table(res, b)
            if gate_tables:
                text += [""] + gate_tables
            for name, r in res.items():
                if r.get("cprofile"):
                    text += [f"#### cProfile: {name}, batch {b} (top 30 by own time)", "", "```", r["cprofile"], "```", ""]
        return "\n".join(text) + "\n" + ("" if done else "\n(incomplete: the run was still going)\n")

    def category_table(res: dict, b: int) -> list[str]:
        """Spec-Bench per category, as Spec-Bench reports it: each system's tau (tokens per target
        step) and, at batch 1 (where every request is timed alone), tokens/s against null."""
        names = [n for n, r in res.items() if "per_request" in r]
        if not categories or not names:
            return []
        cats = list(dict.fromkeys(categories))
        null = res.get("specdec-null")
        head = "| category | prompts | " + " | ".join(f"{n.removeprefix('specdec-')} tau" for n in names)
        if b == 1 and null:
            head += " | " + " | ".join(f"{n.removeprefix('specdec-')} vs null" for n in names if n != "specdec-null")
        lines = [f"#### Spec-Bench per category, batch {b}", "", head + " |",
                 "|" + "---|" * head.count("|")]

        def tau(r, idx):
            steps = sum(r["per_request"][i][1] for i in idx)
            return sum(r["per_request"][i][2] for i in idx) / max(1, steps)

        def tps(r, idx):
            return sum(r["per_request"][i][0] for i in idx) / max(1e-9, sum(r["batch_s"][i] for i in idx))

        for cat in cats + ["overall"]:
            idx = [i for i, c in enumerate(categories) if c == cat or cat == "overall"]
            row = f"| {cat} | {len(idx)} | " + " | ".join(f"{tau(res[n], idx):.2f}" for n in names)
            if b == 1 and null:
                row += " | " + " | ".join(f"{tps(res[n], idx) / tps(null, idx):.2f}x" for n in names
                                          if n != "specdec-null")
            lines.append(row + " |")
        return lines + [""]

    def save(done: bool) -> str:
        """Write the tables so far to --out (after every round: a run cut short keeps what it measured)."""
        table = report(done)
        if args.out:
            Path(args.out + ".md").write_text(table)
            Path(args.out + ".json").write_text(json.dumps(
                {str(b): {k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in res.items()}
                 for b, res in results.items()}, indent=2, default=str))
        return table

    save(done=False)  # HF's figures, before the specdec systems
    engine_kw = {"cuda_graphs": False} if args.no_graphs else {}
    if args.repeat < 1:
        ap.error("--repeat must be >= 1")
    for b in batch_sizes:
        rounds: dict[str, list[dict]] = {}
        for rnd in range(args.repeat):  # round-robin: every system sees the same drift of the machine
            for name in args.drafters.split(","):
                systems = [(f"specdec-{name}", engine_kw)]
                if args.invariant:
                    systems.append((f"specdec-{name}-invariant", {"batch_invariant": True}))
                for label, kw in systems:
                    print(f"{label} b{b} (round {rnd + 1}/{args.repeat}) ...", file=sys.stderr, flush=True)
                    rounds.setdefault(label, []).append(run_specdec(target, name, prompt_ids, args, b, **kw))
            for label, runs in rounds.items():  # after every round: the median of the rounds so far
                results[b][label] = median_run(runs, rounds.get(_null_of(label, rounds)))
            save(done=False)
    print(save(done=True))


if __name__ == "__main__":
    main()
