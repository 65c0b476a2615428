"""Command line: ``specdec generate``, ``specdec bench`` and ``specdec train-drafter``.

Every flag is checked before the model loads (a bad flag is a one-line error, exit status 2),
and torch / transformers are imported only once a command runs, so ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from specdec.errors import SpecDecError


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2-135m", help="model name, HF checkpoint dir or .gguf file")
    p.add_argument("--drafter", default="suffix", help="registered drafter name (null, suffix, ...)")
    p.add_argument("--max-draft-tokens", type=int, default=8, help="most draft tokens per step (k)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="most tokens generated per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold in (0, 1]")
    p.add_argument("--seed", type=int, default=None, help="seed of each request's sampling (None = random)")
    p.add_argument("--raw", action="store_true", help="send raw text, without the chat template")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="compute dtype")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")


def _check_flags(args) -> None:
    """Everything about the flags that can be wrong, before any model is loaded.

    Raises:
        ConfigError: a flag's value is invalid (the message names the flag).
    """
    from specdec.errors import ConfigError

    for flag in ("batch_size", "max_new_tokens", "steps", "num_layers", "num_target_layers", "block_size"):
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


def _engine(args):
    import torch

    from specdec import SpecEngine
    from specdec.config import EngineConfig
    from specdec.drafters import make_drafter
    from specdec.target import load_target

    config = EngineConfig(max_draft_tokens=args.max_draft_tokens, apply_chat_template=not args.raw)  # checked first
    target = load_target(args.target, dtype=getattr(torch, args.dtype), device=args.device)
    drafter = make_drafter(args.drafter) if args.drafter != "suffix" else make_drafter(
        "suffix", max_draft_tokens=max(1, args.max_draft_tokens))
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
    return 0


def cmd_train_drafter(args) -> int:
    import json

    import torch

    from specdec.drafters.block import BlockDrafterConfig, spread_layer_ids
    from specdec.drafters.training import (DistillData, TrainConfig, build_distill_data, train_block_drafter,
                                           training_prompts)
    from specdec.target import load_target

    _check_flags(args)
    target = load_target(args.target, dtype=getattr(torch, args.dtype), device=args.device)
    layer_ids = spread_layer_ids(target.num_layers, args.num_target_layers)
    data_path = Path(args.data) if args.data else None
    if data_path is not None and data_path.is_file():
        data = DistillData.load(data_path)
        data.hidden = [h.to(target.device) for h in data.hidden]
        data.tokens = [t.to(target.device) for t in data.tokens]
    else:
        prompts = training_prompts(args.num_text_prompts, seed=args.seed)
        if args.limit_prompts:
            prompts = prompts[: args.limit_prompts]
        print(f"self-distillation: {len(prompts)} prompts, {args.max_new_tokens} new tokens each", file=sys.stderr)
        data = build_distill_data(target, prompts, layer_ids, args.max_new_tokens, batch_size=args.batch_size)
        if data_path is not None:
            data.save(data_path)
    kinds = ["dflash", "dspark"] if args.kind == "both" else [args.kind]
    tc = target.config
    for kind in kinds:
        cfg = BlockDrafterConfig(block_size=args.block_size, shift_label=0 if kind == "dflash" else 1,
                                 target_layer_ids=data.layer_ids, target_hidden_size=target.hidden_size,
                                 vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                                 num_layers=args.num_layers, num_heads=tc.num_attention_heads,
                                 num_kv_heads=tc.num_key_value_heads, head_dim=tc.head_dim,
                                 intermediate_size=tc.intermediate_size, mask_token_id=args.mask_token_id,
                                 rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta)
        train = TrainConfig(steps=args.steps, seqs_per_step=args.seqs_per_step, anchors_per_seq=args.anchors,
                            lr=args.lr, seed=args.seed, max_seconds=args.max_seconds)
        net, losses = train_block_drafter(target, data, cfg, train)
        out = Path(args.out) / f"{Path(str(args.target)).name}-{kind}" if args.kind == "both" else Path(args.out)
        net.to(torch.bfloat16).save(out)
        (out / "training.json").write_text(json.dumps({"target": str(args.target), "train": {
            k: getattr(train, k) for k in train.__slots__}, "sequences": len(data.tokens),
            "steps_run": len(losses), "loss_first_50": sum(losses[:50]) / len(losses[:50]),
            "loss_last_50": sum(losses[-50:]) / len(losses[-50:])},
            indent=2))
        print(f"{kind}: loss {losses[0]:.3f} -> {sum(losses[-50:]) / len(losses[-50:]):.3f}, saved to {out}")
    return 0


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
    t = sub.add_parser("train-drafter", help="train a DFlash / DSpark drafter by self-distillation (use a GPU)",
                       formatter_class=fmt)
    t.add_argument("--target", default="smollm2-135m", help="model name, HF checkpoint dir or .gguf file")
    t.add_argument("--kind", choices=["dflash", "dspark", "both"], default="dflash", help="which drafter to train")
    t.add_argument("--out", required=True, help="checkpoint directory (a parent directory with --kind both)")
    t.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    t.add_argument("--block-size", type=int, default=8, help="tokens drafted per block")
    t.add_argument("--num-layers", type=int, default=2, help="drafter decoder layers")
    t.add_argument("--num-target-layers", type=int, default=3, help="target layers tapped, spread over the depth")
    t.add_argument("--num-text-prompts", type=int, default=400, help="prompts built from real text besides HumanEval 0-99")
    t.add_argument("--max-new-tokens", type=int, default=256, help="tokens of each distilled response")
    t.add_argument("--limit-prompts", type=int, default=None, help="use only the first N prompts (smoke runs)")
    t.add_argument("--batch-size", type=int, default=64, help="generation batch for the distillation data")
    t.add_argument("--seqs-per-step", type=int, default=16, help="sequences per optimizer step")
    t.add_argument("--anchors", type=int, default=32, help="block anchors per sequence")
    t.add_argument("--lr", type=float, default=6e-4, help="learning rate")
    t.add_argument("--mask-token-id", type=int, default=0, help="token id of the mask slots")
    t.add_argument("--data", default=None, help="cache file for the distillation data (reused if present)")
    t.add_argument("--seed", type=int, default=0, help="seed of prompts and training")
    t.add_argument("--max-seconds", type=float, default=None, help="time budget per drafter (cuts --steps)")
    t.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="compute dtype")
    t.add_argument("--device", default="cuda", help="cpu, cuda or cuda:N")
    args = parser.parse_args(argv)
    try:
        return {"generate": cmd_generate, "bench": cmd_bench, "train-drafter": cmd_train_drafter}[args.cmd](args)
    except SpecDecError as e:
        print(f"specdec: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
