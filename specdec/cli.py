"""Command line: ``specdec generate``, ``bench``, ``serve``, ``drafter-data`` and ``train-drafter``.

Every flag is checked before the model loads (a bad flag is a one-line error, exit status 2),
and torch / transformers are imported only once a command runs, so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import sys
import time

from specdec.errors import SpecDecError


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2-135m", help="model name, HF checkpoint dir or .gguf file")
    p.add_argument("--drafter", default="suffix", help="registered drafter name (null, suffix, ...)")
    p.add_argument("--max-draft-tokens", type=int, default=8, help="most draft tokens per step (k)")
    p.add_argument("--draft-gate", action=argparse.BooleanOptionalAction, default=None, help=DRAFT_GATE_HELP)
    p.add_argument("--max-new-tokens", type=int, default=256, help="most tokens generated per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="seed of each request's sampling (None = random)")
    p.add_argument("--raw", action="store_true", help="send raw text, without the chat template")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="compute dtype")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")


DRAFT_GATE_HELP = ("per batch size, draft the number of tokens (0 = none) measured to emit the most tokens/s "
                   "(EngineConfig.draft_gate; outputs are unchanged); default: as the drafter declares (on for "
                   "dflash and dspark, off for suffix and hybrid)")


def _check_flags(args) -> None:
    """Everything about the flags that can be wrong, before any model is loaded.

    Raises:
        ConfigError: a flag's value is invalid (the message names the flag).
    """
    from specdec.errors import ConfigError

    for flag in ("batch_size", "max_new_tokens", "steps", "num_layers", "num_target_layers", "block_size",
                 "max_waiting", "max_num_seqs", "max_prefill_tokens"):
        value = getattr(args, flag, 1)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be an integer >= 1, got {value}")
    if getattr(args, "max_draft_tokens", 0) < 0:
        raise ConfigError(f"--max-draft-tokens must be an integer >= 0, got {args.max_draft_tokens}")
    from specdec.target.loading import check_device

    check_device(args.device)
    if getattr(args, "drafter", None) is not None:
        from specdec.drafters import available_drafters

        if args.drafter not in available_drafters():
            raise ConfigError(f"--drafter must be one of {available_drafters()}, got {args.drafter!r}")
    _drafter_kwargs(args)


def _drafter_kwargs(args) -> dict:
    """The drafter's own settings from the flags (``--global-budget-tokens``).

    Raises:
        ConfigError: a setting for a drafter that has none, or an invalid value.
    """
    from specdec.errors import ConfigError

    budget = getattr(args, "global_budget_tokens", None)
    if budget is None:
        return {}
    if args.drafter != "suffix":
        raise ConfigError(f"--global-budget-tokens sets the suffix drafter's global automaton: it needs "
                          f"--drafter suffix, got {args.drafter!r}")
    if budget.lower() == "none":
        return {"global_budget_tokens": None}
    if not (budget.isascii() and budget.isdigit()) or int(budget) < 1:
        raise ConfigError(f"--global-budget-tokens must be an integer >= 1 or 'none' (unbounded), got {budget!r}")
    return {"global_budget_tokens": int(budget)}


def _engine(args, **overrides):
    import torch

    from specdec import SpecEngine
    from specdec.config import EngineConfig
    from specdec.drafters import make_drafter
    from specdec.target import load_target

    config = EngineConfig(max_draft_tokens=args.max_draft_tokens, apply_chat_template=not args.raw,
                          draft_gate=args.draft_gate, **overrides)  # checked first
    target = load_target(args.target, dtype=getattr(torch, args.dtype), device=args.device)
    drafter = make_drafter(args.drafter, **_drafter_kwargs(args))  # the engine's max_draft_tokens caps its drafts
    return SpecEngine(target, drafter, config)


def _params(args):
    from specdec import SamplingParams

    return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed)


def cmd_generate(args) -> int:
    _check_flags(args)
    params = _params(args)
    engine = _engine(args)
    t0 = time.perf_counter()
    outs = engine.generate(args.prompts, params, progress=not args.quiet)
    dt = time.perf_counter() - t0
    for o in outs:
        print(o.text)
        s = o.stats
        print(f"\n[{len(o.token_ids)} tokens, {s.target_steps} target steps, mean accepted length "
              f"{s.mean_accepted_length:.2f}, {s.tokens_per_s:.1f} tokens/s, finish: {o.finish_reason}]", file=sys.stderr)
    if len(outs) > 1:
        total = sum(len(o.token_ids) for o in outs)
        print(f"[all: {total} tokens in {dt:.1f} s = {total / dt:.1f} tokens/s]", file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from specdec.prompts import humaneval_prompts, parse_range

    _check_flags(args)
    prompts = humaneval_prompts(parse_range(args.problems))
    params = _params(args)
    engine = _engine(args)
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), args.batch_size):
        outs += engine.generate(prompts[i:i + args.batch_size], params, progress=not args.quiet)
    dt = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    steps = sum(len(o.stats.accepted_lengths) + 1 for o in outs)
    acc = [x for o in outs for x in o.stats.accepted_lengths]
    print(f"drafter={args.drafter} prompts={len(prompts)} batch={args.batch_size} tokens={tokens} "
          f"time={dt:.1f}s tokens/s={tokens / dt:.1f} target_steps/token={steps / tokens:.3f} "
          f"mean_accepted_length={sum(acc) / max(1, len(acc)):.2f}")
    for bucket, g in (engine.draft_gate_stats or {}).items():
        steps = ", ".join(f"{n}: {s}" for n, s in g["steps"].items())
        print(f"draft gate, batch {bucket}: draft length {g['draft_length']} (steps by length {steps})")
    return 0


def cmd_serve(args) -> int:
    """Serve the engine over HTTP (OpenAI-compatible) until SIGINT / SIGTERM; then stop admitting,
    give running requests ``--drain-timeout`` seconds, abort the rest and exit 0."""
    from specdec.errors import ConfigError

    _check_flags(args)
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be an integer in [1, 65535], got {args.port}")
    from specdec.serve import ServeConfig, create_app  # checks --max-waiting / --drain-timeout first

    config = ServeConfig(args.served_model_name or args.target, args.max_waiting, args.drain_timeout,
                         freeze_heap=not args.no_freeze_heap)
    import uvicorn

    engine = _engine(args, max_num_seqs=args.max_num_seqs, max_prefill_tokens=args.max_prefill_tokens)
    # uvicorn handles SIGINT / SIGTERM while it runs, then raises the signal again for the handler
    # found before it: this one makes a drained shutdown end with exit status 0
    import signal

    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        uvicorn.run(create_app(engine, config), host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=max(1, int(args.drain_timeout)))
    finally:
        engine.close()
    return 0


def cmd_train_drafter(rest: list[str]) -> int:
    from specdec.drafters.training import main as train_main

    return train_main(rest)


def cmd_drafter_data(rest: list[str]) -> int:
    from specdec.drafters.data import main as data_main

    return data_main(rest)


#: Subcommands whose own parser takes every argument after the name (``specdec NAME --help``).
FORWARDED = {"train-drafter": cmd_train_drafter, "drafter-data": cmd_drafter_data}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``specdec`` command."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="specdec", description="Lossless speculative decoding", formatter_class=fmt)
    sub = parser.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text for one or more prompts", formatter_class=fmt)
    g.add_argument("prompts", nargs="+")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    _common(g)
    b = sub.add_parser("bench", help="tokens/s and acceptance on HumanEval prompts", formatter_class=fmt)
    b.add_argument("--problems", default="0-9", help="HumanEval problem range, e.g. 0-99 or 100-163")
    b.add_argument("--batch-size", type=int, default=1, help="prompts generated together")
    b.add_argument("--quiet", action="store_true", help="no progress bar")
    _common(b)
    b.set_defaults(max_new_tokens=128)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the serve extra)", formatter_class=fmt)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="port to listen on")
    s.add_argument("--served-model-name", default=None, help="the model id clients send (default: --target)")
    s.add_argument("--max-waiting", type=int, default=64, help="most waiting requests; more are answered 429")
    s.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds running requests may finish at shutdown before they are aborted")
    s.add_argument("--max-prefill-tokens", type=int, default=None, metavar="N",
                   help="feed prompts N tokens a step beside the decoding requests (chunked prefill; default: "
                        "whole prompts)")
    s.add_argument("--no-freeze-heap", action="store_true",
                   help="leave start-up's objects to the garbage collector's full passes (default: frozen after warm-up)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    # sampling is per request (the request body); the engine's flags only
    s.add_argument("--target", default="smollm2-135m", help="model name, HF checkpoint dir or .gguf file")
    s.add_argument("--drafter", default="suffix", help="registered drafter name (null, suffix, ...)")
    s.add_argument("--global-budget-tokens", default=None, metavar="N|none",
                   help="the suffix drafter's global automaton: most tokens of finished responses it indexes, "
                        "oldest dropped first (default: the drafter's, 262144, about 256 MB; none: unbounded)")
    s.add_argument("--max-draft-tokens", type=int, default=8, help="most draft tokens per step (k)")
    s.add_argument("--draft-gate", action=argparse.BooleanOptionalAction, default=None, help=DRAFT_GATE_HELP)
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="compute dtype")
    s.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    s.set_defaults(raw=False)
    t = sub.add_parser("train-drafter", add_help=False,
                       help="train a DFlash / DSpark drafter on data from drafter-data (use a GPU; --help for options)")
    t.add_argument("rest", nargs=argparse.REMAINDER)
    d = sub.add_parser("drafter-data", add_help=False,
                       help="build drafter training data: prompts and the target's own responses (--help for options)")
    d.add_argument("rest", nargs=argparse.REMAINDER)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in FORWARDED:
        try:
            return FORWARDED[argv[0]](argv[1:])
        except SpecDecError as e:
            print(f"specdec: error: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
    args = parser.parse_args(argv)
    try:
        return {"generate": cmd_generate, "bench": cmd_bench, "serve": cmd_serve}[args.cmd](args)
    except SpecDecError as e:
        print(f"specdec: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
