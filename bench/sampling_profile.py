"""Where a sampled step's time goes: each part of :func:`specdec.sampling.sample_rows`, then end to end.

    python bench/sampling_profile.py --device cuda --out /root/out/sampling_profile        # the H200
    python bench/sampling_profile.py --device cuda --spec-bench .evaldata/question.jsonl \
        --out /root/out/sampling_profile_specbench              # the H200, the prompts of bench/sampling_mix.py
    python bench/sampling_profile.py --quick                                          # CPU, a check of the script (~20 s)

Part 1, micro: ``S`` sampled rows (``--rows``, default 16, 32, 144, 288: the null and suffix drafters'
sampled rows at batch 32 with half / all requests sampled; 144 and 288 as 16 and 32 requests of
8 drafts + 1 bonus row) of random ``[2 S, --vocab]`` logits (every other row sampled, as in a
half-sampled batch) in each dtype of ``--dtypes``, with two sets of limits:

  top-p    temperature 0.8, top-p 0.95 (what bench/sampling_mix.py samples)
  none     temperature 0.8, no top-k / top-p (no cutoffs)

Timed parts (median of ``--iters`` after one untimed call; device time, synchronised, except
where the column says host):

  h2d            the small host-to-device copy sample_rows makes (host time): one pinned copy of
                 every per-row vector (limits included);
                 "behind busy": the same queued behind ~1 ms of GPU work (torch.cuda._sleep),
                 and the five pageable copies they replaced: a host time near 1 ms means the
                 copy waited for the stream (the GPU then idles while the rest of the sampled
                 path is launched)
  scale          ``logits[rows].float() / temperature``, the input of the cutoffs
  sort           the stable descending sort of every sampled row in one torch.sort call (as
                 row_cutoffs ran it before: 128 rows or more take cub's segmented sort on CUDA)
  sort chunked   the same sort as row_cutoffs runs it now (at most 127 rows a call; same result)
  row_cutoffs    the torch reference's top-p cutoffs in all (sort, fixed-point masses, gathers)
  cutoff kernel  the sort-free Triton cutoffs (specdec.sampling_kernel.row_cutoffs) that sample_rows
                 uses on CUDA, steady state ("1st": its first call, compilation included), and
                 whether they keep exactly the reference's tokens
  kernel 1st     the Triton kernel's first call at this row count (compilation included, CUDA only)
  kernel         the Triton kernel, steady state (CUDA only)
  torch path     the torch reference from the cutoffs: mask, Gumbel noise, argmax
  sample_rows    the whole call (kernel path on CUDA, torch path on the CPU): host launch time and
                 device time

plus a torch.profiler table of ``--profile-calls`` sample_rows calls at the largest row count.

Part 2, end to end: a SpecEngine per drafter of ``--drafters`` (default null, suffix) on
``--batch-size`` prompts (random token ids, ``--prompt-len`` long; or Spec-Bench first turns with
``--spec-bench``) with every other request sampled (temperature 0.8, top-p 0.95, seed = index),
timed after an untimed first pass, once with the sampled path as is and once with the torch
reference (``specdec.sampling.USE_KERNEL = False``), and all-greedy for the baseline: ms per step
and engine.timings' parts per step (forward, draft, verify, host). Target: SmolLM2-135M (``--target``), or with ``--quick`` a
random 2-layer Llama of the same vocabulary on the CPU.

Writes ``sampling_profile.md`` and ``.json`` to ``--out`` (a folder).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import run_header, write_results  # noqa: E402

from specdec import SamplingParams, SpecEngine  # noqa: E402
from specdec import sampling as smp  # noqa: E402
from specdec.drafters import make_drafter  # noqa: E402
from specdec.drafters.base import Draft  # noqa: E402

TEMPERATURE, TOP_P = 0.8, 0.95


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, dev: torch.device, iters: int, warm: bool = True, host_only: bool = False) -> float:
    """Median ms of ``fn()`` over ``iters`` calls, the device queue drained before each (after one
    untimed call if ``warm``); ``host_only``: the host's time to return, not waiting for the device."""
    if warm:
        fn()
    times = []
    for _ in range(iters):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        if not host_only:
            _sync(dev)
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def row_sampling(n_sampled: int, limits: str) -> tuple[smp.RowSampling, int]:
    """``S`` sampled rows among ``2 S`` rows: requests of 9 rows (8 drafts) when ``S`` is a multiple of 9
    and at least 144, else of one row; greedy requests of the same size in between."""
    per = 9 if n_sampled >= 144 and n_sampled % 9 == 0 else 1
    params = SamplingParams(temperature=TEMPERATURE, top_p=TOP_P if limits == "top-p" else 1.0, seed=0)
    sampling, row = smp.RowSampling(), 0
    for i in range(n_sampled // per):
        row += per  # a greedy request first
        sampling.add(row, params, smp.request_key(i), 100 + i, Draft(tuple(range(5, 5 + per - 1))))
        row += per
    return sampling, row


def h2d_copies(sampling: smp.RowSampling, dev: torch.device) -> None:
    """The host-to-device copy sample_rows makes, as it makes it."""
    smp._to_device([sampling.rows, sampling.keys, sampling.positions, sampling.drafts, sampling.top_k],
                   [sampling.temperature, sampling.top_p], dev)


def h2d_pageable(sampling: smp.RowSampling, dev: torch.device) -> None:
    """The copies as sample_rows made them before: five, from pageable memory."""
    torch.tensor([sampling.rows, sampling.keys, sampling.positions, sampling.drafts],
                 dtype=torch.long).to(dev, non_blocking=True)
    torch.tensor(sampling.temperature, dtype=torch.float32).to(dev, non_blocking=True)
    by_p = [i for i, p in enumerate(sampling.top_p) if p < 1.0]
    if by_p:
        torch.tensor(by_p, dtype=torch.long).to(dev, non_blocking=True)
        torch.tensor([[sampling.top_k[i] for i in by_p]], dtype=torch.long).to(dev, non_blocking=True)
        torch.tensor([sampling.top_p[i] for i in by_p], dtype=torch.float32).to(dev, non_blocking=True)


def micro(n_sampled: int, dtype: torch.dtype, limits: str, args, dev: torch.device, has_kernel: bool) -> dict:
    """Times of each part of sample_rows for one (row count, dtype, limits)."""
    sampling, n_rows = row_sampling(n_sampled, limits)
    gen = torch.Generator().manual_seed(n_sampled)
    logits = (torch.randn(n_rows, args.vocab, generator=gen) * 3).to(dev, dtype)  # [rows, vocab]
    rows = torch.tensor(sampling.rows, device=dev)
    temp = torch.tensor(sampling.temperature, device=dev)
    keys = torch.tensor(sampling.keys, device=dev)
    pos = torch.tensor(sampling.positions, device=dev)
    z = smp._scaled(logits, rows, temp)  # [S, vocab]
    cut = smp.row_cutoffs(z, sampling.top_k, sampling.top_p) if limits == "top-p" else None
    out = {"rows": n_sampled, "dtype": str(dtype).removeprefix("torch."), "limits": limits,
           "verified_rows": n_rows}
    it = args.iters
    out["h2d_host_ms"] = timed(lambda: h2d_copies(sampling, dev), dev, it, host_only=True)
    if dev.type == "cuda":  # the same copies queued behind ~1 ms of GPU work: does the host wait for it?
        def behind(copies):
            def run():
                torch.cuda._sleep(2_000_000)  # about 1 ms of clock cycles on the stream
                copies()
            return run
        out["h2d_behind_busy_host_ms"] = timed(behind(lambda: h2d_copies(sampling, dev)), dev, it, host_only=True)
        out["h2d_pageable_behind_busy_host_ms"] = timed(behind(lambda: h2d_pageable(sampling, dev)), dev, it, host_only=True)
    out["scale_ms"] = timed(lambda: smp._scaled(logits, rows, temp), dev, it)
    if cut is not None:
        out["sort_ms"] = timed(lambda: z.sort(dim=-1, descending=True, stable=True), dev, it)
        out["sort_chunked_ms"] = timed(lambda: smp._sort_descending(z), dev, it)
        out["row_cutoffs_ms"] = timed(lambda: smp.row_cutoffs(z, sampling.top_k, sampling.top_p), dev, it)
    if has_kernel:
        from specdec import sampling_kernel as sk

        if cut is not None:
            top_k = torch.tensor(sampling.top_k, device=dev)
            top_p = torch.tensor(sampling.top_p, dtype=torch.float32, device=dev)

            def cutoffs():
                return sk.row_cutoffs(logits, rows, temp, top_k, top_p)

            out["cutoff_kernel_first_ms"] = timed(cutoffs, dev, 1, warm=False)
            out["cutoff_kernel_ms"] = timed(cutoffs, dev, it)
            out["cutoff_kernel_keeps_the_reference"] = bool(torch.equal(
                torch.isfinite(smp.apply_cutoffs(z, cutoffs())), torch.isfinite(smp.apply_cutoffs(z, cut))))

        def kern():
            return sk.sample_tokens(logits, rows, temp, keys, pos, smp._STREAM_SAMPLE, cut)

        out["kernel_first_ms"] = timed(kern, dev, 1, warm=False)
        out["kernel_ms"] = timed(kern, dev, it)

    def torch_path():
        zz = smp._scaled(logits, rows, temp)
        if cut is not None:
            zz = smp.apply_cutoffs(zz, cut)
        return (zz + smp.gumbel_noise(keys, pos, args.vocab)).argmax(dim=-1)

    out["torch_path_ms"] = timed(torch_path, dev, it)
    argmax = logits.argmax(dim=-1)
    out["sample_rows_host_ms"] = timed(lambda: smp.sample_rows(logits, argmax, sampling), dev, it, host_only=True)
    out["sample_rows_ms"] = timed(lambda: smp.sample_rows(logits, argmax, sampling), dev, it)
    if has_kernel:  # the two paths agree (what tests/test_sampling_kernel.py checks)
        a = smp.sample_rows(logits, argmax, sampling, kernel=True)
        b = smp.sample_rows(logits, argmax, sampling, kernel=False)
        out["kernel_equals_torch"] = bool(torch.equal(a, b))
    return out


def profile_table(n_sampled: int, dtype: torch.dtype, args, dev: torch.device) -> str:
    """torch.profiler's table of ``--profile-calls`` sample_rows calls (top-p rows)."""
    from torch.profiler import ProfilerActivity, profile

    sampling, n_rows = row_sampling(n_sampled, "top-p")
    logits = torch.randn(n_rows, args.vocab, generator=torch.Generator().manual_seed(1)).mul(3).to(dev, dtype)
    argmax = logits.argmax(dim=-1)
    smp.sample_rows(logits, argmax, sampling)
    _sync(dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(args.profile_calls):
            smp.sample_rows(logits, argmax, sampling)
        _sync(dev)
    key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60)


def random_target(vocab: int, path: Path):
    """A random 2-layer Llama with the given vocabulary (no tokenizer), for the CPU check."""
    import transformers

    from specdec.target import load_target

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   initializer_range=0.3, eos_token_id=vocab - 1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return load_target(path)


def e2e(target, drafter: str, mix: str, kernel: bool | None, prompts, max_kv_len: int, args) -> dict:
    """One engine run: untimed first pass, then the timed pass; ms per step and the forward share."""
    n = len(prompts)
    params = [SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True,
                             **({"temperature": TEMPERATURE, "top_p": TOP_P, "seed": i}
                                if mix == "half" and i % 2 else {})) for i in range(n)]
    kwargs = {"max_draft_tokens": args.k} if drafter == "suffix" else {}
    engine = SpecEngine(target, make_drafter(drafter, **kwargs), max_draft_tokens=args.k, max_num_seqs=n,
                        draft_gate=False)  # every step drafts: sampled verify is measured
    saved, smp.USE_KERNEL = smp.USE_KERNEL, kernel
    try:
        if hasattr(engine, "capture_graphs") and target.device.type == "cuda":
            engine.capture_graphs(max_kv_len=max_kv_len, progress=False)
        engine.generate(prompts, params)  # untimed: compilation, first-use costs
        engine.timings.update({k: 0 for k in engine.timings})
        _sync(target.device)
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        _sync(target.device)
        wall = time.perf_counter() - t0
        timings = dict(engine.timings)
    finally:
        smp.USE_KERNEL = saved
        if hasattr(engine, "close"):
            engine.close()
    steps = max(1, timings["steps"])
    return {"drafter": drafter, "mix": mix, "path": {None: "as is", False: "torch (USE_KERNEL=False)"}[kernel],
            "steps": timings["steps"], "ms_per_step": 1e3 * wall / steps,
            "forward_ms_per_step": 1e3 * timings["forward_s"] / steps,
            "draft_ms_per_step": 1e3 * timings.get("draft_s", 0.0) / steps,
            "verify_ms_per_step": 1e3 * timings.get("verify_s", 0.0) / steps,
            "host_ms_per_step": 1e3 * timings.get("host_s", 0.0) / steps,
            "tokens": sum(len(o.token_ids) for o in outs), "outputs": [list(o.token_ids) for o in outs]}


def _fmt(x) -> str:
    return "-" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="CPU, small: a check of the script (under a minute)")
    ap.add_argument("--rows", default="16,32,144,288", help="sampled row counts")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="logit dtypes")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--profile-calls", type=int, default=5)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16", help="the end-to-end target's dtype")
    ap.add_argument("--drafters", default="null,suffix")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64, help="random token-id prompts of this length")
    ap.add_argument("--spec-bench", default=None, metavar="QUESTION_JSONL",
                    help="Spec-Bench first turns (file order) instead of random prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=8, help="max draft tokens per step")
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument("--out", default=None, help="write sampling_profile.md / .json into this folder")
    args = ap.parse_args()
    if args.quick:
        args.device, args.rows, args.dtypes, args.iters, args.profile_calls = "cpu", "16,32", "float32", 2, 2
        args.batch_size, args.prompt_len, args.max_new_tokens, args.k, args.dtype = 4, 8, 6, 4, "float32"
        torch.set_num_threads(1)
    dev = torch.device(args.device)
    has_kernel = dev.type == "cuda" and smp._kernel_module() is not None
    row_counts = [int(r) for r in args.rows.split(",")]
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]

    micro_res = []
    for dtype in dtypes:
        for limits in ("top-p", "none"):
            for s in row_counts:
                print(f"micro: {s} rows, {dtype}, {limits} ...", file=sys.stderr, flush=True)
                micro_res.append(micro(s, dtype, limits, args, dev, has_kernel))
    table = profile_table(max(row_counts), dtypes[0], args, dev)

    e2e_res = []
    if not args.no_e2e:
        if args.quick:
            import tempfile

            target = random_target(args.vocab, Path(tempfile.mkdtemp()))
        else:
            from specdec.target import load_target

            target = load_target(args.target, dtype=getattr(torch, args.dtype), device=args.device)
        if args.spec_bench:
            with open(args.spec_bench) as f:  # evaluation data: read only
                prompts = [json.loads(line)["turns"][0] for line in f if line.strip()][:args.batch_size]
        else:
            gen = torch.Generator().manual_seed(0)
            prompts = torch.randint(0, min(target.vocab_size, 32000), (args.batch_size, args.prompt_len),
                                    generator=gen).tolist()
        if prompts and isinstance(prompts[0], str):  # the chat prompts' token counts, as the engine builds them
            tok = target.tokenizer
            longest = max(len(tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                          add_generation_prompt=True),
                                  add_special_tokens=False)["input_ids"]) for p in prompts)
        else:
            longest = max(len(p) for p in prompts)
        max_kv_len = longest + args.max_new_tokens + args.k + 1
        for drafter in args.drafters.split(","):
            for mix, kernel in (("greedy", None), ("half", None), ("half", False)):
                print(f"e2e: {drafter} {mix} {kernel} ...", file=sys.stderr, flush=True)
                e2e_res.append(e2e(target, drafter, mix, kernel, prompts, max_kv_len, args))

    header = run_header(args.device, f"vocab {args.vocab}", f"sampled rows {args.rows}",
                        f"temperature {TEMPERATURE}, top-p {TOP_P} / none", f"median of {args.iters}",
                        f"e2e: {'random 2-layer Llama' if args.quick else args.target} {args.dtype}, "
                        f"batch {args.batch_size}, {args.max_new_tokens} new tokens, k {args.k}")
    cols = ["rows", "dtype", "limits", "h2d_host_ms", "h2d_behind_busy_host_ms", "h2d_pageable_behind_busy_host_ms",
            "scale_ms", "sort_ms", "sort_chunked_ms", "row_cutoffs_ms", "cutoff_kernel_first_ms", "cutoff_kernel_ms",
            "cutoff_kernel_keeps_the_reference", "kernel_first_ms",
            "kernel_ms", "torch_path_ms", "sample_rows_host_ms", "sample_rows_ms", "kernel_equals_torch"]
    md = [header, "", "## sample_rows, part by part (ms)", "",
          "| " + " | ".join(c.removesuffix("_ms").replace("_", " ") + (" (host)" if "host" in c else "")
                           for c in cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in micro_res]
    md += ["", f"## torch.profiler: {args.profile_calls} sample_rows calls, {max(row_counts)} top-p rows, {dtypes[0]}",
           "", "```", table, "```"]
    if e2e_res:
        greedy = {r["drafter"]: r["ms_per_step"] for r in e2e_res if r["mix"] == "greedy"}
        as_is = {r["drafter"]: r["outputs"] for r in e2e_res if r["mix"] == "half" and r["path"] == "as is"}
        md += ["", "## end to end (ms per engine step)", "",
               "| drafter | mix | sampled path | ms / step | vs all-greedy | forward ms / step | draft | verify | host | "
               "steps | tokens equal to 'as is' |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in e2e_res:
            same = "-" if r["mix"] == "greedy" else str(r["outputs"] == as_is[r["drafter"]])
            md.append(f"| {r['drafter']} | {r['mix']} | {r['path'] if r['mix'] != 'greedy' else '-'} | "
                      f"{r['ms_per_step']:.3f} | {r['ms_per_step'] / greedy[r['drafter']]:.2f}x | "
                      f"{r['forward_ms_per_step']:.3f} | {r['draft_ms_per_step']:.3f} | {r['verify_ms_per_step']:.3f} | "
                      f"{r['host_ms_per_step']:.3f} | {r['steps']} | {same} |")
    write_results(args.out, "sampling_profile", "\n".join(md),
                  {"header": header, "micro": micro_res, "profile": table,
                   "e2e": [{k: v for k, v in r.items() if k != "outputs"} for r in e2e_res]})


if __name__ == "__main__":
    main()
