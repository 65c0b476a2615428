"""The draft gate against a simulated drafter and target: how close its choices come to the best
fixed draft length, with and without its optimism (``DraftGate(optimism=...)``), in one run.

The model (the one ``tests/test_draft_gate.py`` drives the gate with): each drafted token is
accepted with probability ``p`` given the ones before it were; a step of ``batch`` requests at draft
length ``L`` costs ``plain * batch + fixed + per_row * batch * L`` seconds (``fixed`` only where it
drafts: the propose). Each case runs ``--steps`` steps; the tokens per second of the steps after
the first 100 are compared with the best fixed length's true rate.

Two sets of cases, drawn with ``--seed``:

- ``broad``: ``max_draft`` 1-16, ``p`` 0.05-0.98, ``fixed`` 0-0.5 or 0-0.02, ``per_row`` 0.0001-0.02,
  batch 1, 3, 8, 24 or 64 (the property test's space);
- ``near``: batch 1 or 3 and ``fixed`` drawn until drafting's best rate is 1.03-1.25x plain steps'
  (where a noisy acceptance estimate decides).

Usage::

    python bench/gate_sim.py --cases 300 --seed 1 [--out DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from specdec.draft_gate import DraftGate  # noqa: E402


class Model:
    """A drafter and target in numbers (see the module docstring); accepted tokens follow a
    low-discrepancy sequence, so runs repeat exactly."""

    def __init__(self, p: float, fixed: float, per_row: float, plain: float = 0.01):
        self.p, self.fixed, self.per_row, self.plain = p, fixed, per_row, plain
        self.u = 0.0

    def accepted(self, batch: int, length: int) -> list[int]:
        out = []
        for _ in range(batch):
            self.u = (self.u + 0.6180339887) % 1.0
            a = 0
            while a < length and self.u < self.p ** (a + 1):
                a += 1
            out.append(a)
        return out

    def new_request(self, p: float) -> None:
        """The next request, accepting each drafted token with ``p``."""
        self.p = p

    def seconds(self, batch: int, length: int) -> float:
        return self.plain * batch + (self.fixed + self.per_row * batch * length if length else 0.0)

    def rate(self, batch: int, length: int) -> float:
        mean = sum(self.p ** j for j in range(1, length + 1))
        return batch * (1 + mean) / self.seconds(batch, length)


def run_case(case: dict, steps: int, optimism: float) -> float:
    """Tokens/s after the first 100 steps over the best fixed length's, for one case."""
    gate = DraftGate(case["max_draft"], optimism=optimism)
    model, batch = Model(case["p"], case["fixed"], case["per_row"]), case["batch"]
    tokens = seconds = 0.0
    for i in range(steps):
        n = gate.draft_length(batch)
        acc = model.accepted(batch, n)
        s = model.seconds(batch, n)
        gate.record(batch, n, acc, s)
        if i >= 100:
            tokens += batch + sum(acc)
            seconds += s
    return tokens / seconds / max(model.rate(batch, n) for n in gate.lengths)


class NoisyModel(Model):
    """:class:`Model` with independent pseudo-random draws (seeded), and answers that start harder:
    a request's first ``start_steps`` steps accept each token with ``start_factor * p`` (on the H100,
    Spec-Bench at batch 1, DFlash drafting 4: 1.01 tokens accepted a step in an answer's first four
    steps against 1.44 after them, about 0.8x ``p``; half of the answers accepted none on their first)."""

    def __init__(self, p: float, fixed: float, per_row: float, seed: int, start_steps: int = 8,
                 start_factor: float = 0.8):
        super().__init__(p, fixed, per_row)
        self.rng = random.Random(seed)
        self.start_steps, self.start_factor, self.step = start_steps, start_factor, 0

    def new_request(self, p: float) -> None:
        super().new_request(p)
        self.step = 0

    def accepted(self, batch: int, length: int) -> list[int]:
        p = self.p * (self.start_factor if self.step < self.start_steps else 1.0)
        self.step += 1
        out = []
        for _ in range(batch):
            a = 0
            while a < length and self.rng.random() < p:
                a += 1
            out.append(a)
        return out


class FirstFormGate(DraftGate):
    """:meth:`DraftGate.joined`'s first form, for comparison: the acceptance before a join weighed
    ``1 - n / batch`` as much (at least a tenth, never a length below one request-step), the probe a
    step after the join (it was at once)."""

    JOIN_PROBE_AFTER = 1

    def joined(self, batch: int, n: int) -> None:
        acc, keep = self._acceptance, max(1.0 - n / batch, 0.1) if batch else 1.0
        for j in range(1, len(self.lengths)):
            if acc.n[j] > 0:
                f = max(keep, min(1.0, 1.0 / acc.n[j]))
                acc.sum[j] *= f
                acc.n[j] *= f
                acc.sq[j] *= f
                acc.tot[j] *= f
                acc.w2[j] *= f * f
        super().joined(batch, n)


def run_requests(case: dict, tell: bool, noisy: bool = False, first_form: bool = False) -> tuple[float, float]:
    """Batch 1 over a run of requests, each drafted for at its own ``p`` (``case["ps"]``, ``case["tokens"]``
    tokens each), the gate told of each new request (``tell``: :meth:`DraftGate.joined`) or not;
    ``noisy``: :class:`NoisyModel`'s draws and harder starts; ``first_form``: :class:`FirstFormGate`.
    Returns the run's tokens/s over the best fixed length's and over an oracle's that takes each
    request's best length."""
    cls = FirstFormGate if first_form else DraftGate
    gate = cls(case["max_draft"])
    model = (NoisyModel(case["ps"][0], case["fixed"], case["per_row"], seed=int(case["fixed"] * 1e9))
             if noisy else Model(case["ps"][0], case["fixed"], case["per_row"]))
    tokens = seconds = fixed_s = oracle_s = 0.0
    fixed_by_length = [0.0] * len(gate.lengths)
    for p in case["ps"]:
        model.new_request(p)
        got, took = _one_request(gate, model, case["tokens"], tell)
        tokens, seconds = tokens + got, seconds + took
        rates = [model.rate(1, n) for n in gate.lengths]
        fixed_by_length = [t + case["tokens"] / r for t, r in zip(fixed_by_length, rates)]
        oracle_s += case["tokens"] / max(rates)
    fixed_s = min(fixed_by_length)
    rate = tokens / seconds
    return rate / (len(case["ps"]) * case["tokens"] / fixed_s), rate / (len(case["ps"]) * case["tokens"] / oracle_s)


def run_unsuited(fixed: float, tokens: int, tell: bool, requests: int = 200) -> float:
    """Batch 1, ``requests`` requests of ``tokens`` tokens, none of which the drafter suits (``p``
    0.3; ``fixed``: the propose, 2 or 6 plain steps' worth): tokens/s over plain steps'."""
    gate, model = DraftGate(8), Model(0.3, fixed, 0.0005)
    runs = [_one_request(gate, model, tokens, tell) for _ in range(requests)]
    return sum(t for t, _ in runs) / sum(s for _, s in runs) / model.rate(1, 0)


def _one_request(gate: DraftGate, model: Model, tokens: int, tell: bool) -> tuple[int, float]:
    """One request of at least ``tokens`` tokens at batch 1 behind ``gate`` (told of it as it joins,
    ``tell``): the tokens its steps emitted and their seconds."""
    if tell:
        gate.joined(1, 1)
    got, seconds = 0, 0.0
    while got < tokens:
        n = gate.draft_length(1)
        acc = model.accepted(1, n)
        s = model.seconds(1, n)
        gate.record(1, n, acc, s)
        got += 1 + acc[0]
        seconds += s
    return got, seconds


def draw_requests(rng: random.Random, streaks: bool = False) -> dict:
    """A batch-1 run of 40 requests: each accepts drafts at its own ``p`` (0.1-0.95; ``streaks``: four
    runs of ten around a shared ``p``, within 0.07, as Spec-Bench's categories come in file order), a
    drafting step costs 1.2-2.5x a plain one, 64-512 tokens a request."""
    case = dict(max_draft=rng.choice([4, 8, 16]), fixed=rng.uniform(0.002, 0.015), per_row=rng.uniform(0.0001, 0.0005),
                tokens=rng.choice([64, 128, 256, 512]), ps=[rng.uniform(0.1, 0.95) for _ in range(40)])
    if streaks:
        case["ps"] = [min(0.97, max(0.05, m + rng.gauss(0.0, 0.07)))
                      for m in [rng.uniform(0.1, 0.95) for _ in range(4)] for _ in range(10)]
    return case


class LatencyModel(Model):
    """A latency-bound GPU step (SmolLM2-135M on an H100, roughly): a plain step costs ``base +
    row * batch`` seconds (0.66 ms at batch 1, 0.81 ms at 32); a drafting step adds the propose,
    ``fixed + per_row * batch * L`` (1.2 ms at batch 1 and 3.7 ms at 32 with 8 tokens)."""

    def __init__(self, p: float, base: float = 0.65e-3, row: float = 0.005e-3, fixed: float = 0.45e-3,
                 per_row: float = 0.0095e-3):
        super().__init__(p, fixed, per_row)
        self.base, self.row = base, row

    def seconds(self, batch: int, length: int) -> float:
        return self.base + self.row * batch + (self.fixed + self.per_row * batch * length if length else 0.0)


def run_batch_moves(case: dict, policy: str) -> float:
    """A generate of ``case["requests"]`` requests (``case["tokens"]`` tokens each, drawn) at most
    ``case["max_batch"]`` at a time on a :class:`LatencyModel`: the batch fills, holds while requests
    wait, then shrinks to none. ``policy``: ``gate`` (told of joining requests), ``gate-per-request``
    (its steps' seconds per request taken as measured, whatever the batch: the gate before
    ``DraftGate._exponent``), ``plain`` (no draft), ``best`` (the true best length at each step's
    batch). Returns tokens per second."""
    model = LatencyModel(case["p"])
    gate = None
    if policy.startswith("gate"):
        as_measured = {"_exponent": lambda self, key, i: 1.0}
        cls = DraftGate if policy == "gate" else type("Gate", (DraftGate,), as_measured)
        gate = cls(case["max_draft"])
    waiting, running = list(case["tokens"]), []
    tokens = seconds = 0.0
    while waiting or running:
        joined = 0
        while waiting and len(running) < case["max_batch"]:
            running.append(waiting.pop(0))
            joined += 1
        batch = len(running)
        if gate is not None and joined:
            gate.joined(batch, joined)
        if gate is not None:
            n = gate.draft_length(batch)
        elif policy == "plain":
            n = 0
        else:
            n = max(DraftGate(case["max_draft"]).lengths, key=lambda L: model.rate(batch, L))
        acc = model.accepted(batch, n)
        s = model.seconds(batch, n)
        if gate is not None:
            gate.record(batch, n, acc, s)
        seconds += s
        left = []
        for need, a in zip(running, acc):
            tokens += min(need, 1 + a)
            if need > 1 + a:
                left.append(need - 1 - a)
        running = left
    return tokens / seconds


def draw_batch_moves(rng: random.Random) -> dict:
    """96 requests of 64-256 tokens, 32 at a time (or 16), acceptance 0.3-0.9 a token, 8-token drafts."""
    return dict(p=rng.uniform(0.3, 0.9), max_draft=8, max_batch=rng.choice([16, 32]),
                tokens=[rng.randint(64, 256) for _ in range(96)])


def draw(rng: random.Random, kind: str) -> dict:
    while True:
        case = dict(max_draft=rng.randint(1, 16), p=rng.uniform(0.05, 0.98))
        if kind == "broad":
            case.update(fixed=rng.choice([rng.uniform(0, 0.5), rng.uniform(0, 0.02)]),
                        per_row=rng.uniform(0.0001, 0.02) if rng.random() < 0.5 else 0.0001,
                        batch=rng.choice([1, 3, 8, 24, 64]))
            return case
        case.update(fixed=rng.uniform(0, 0.03), per_row=0.0001, batch=rng.choice([1, 1, 3]))
        model = Model(case["p"], case["fixed"], case["per_row"])
        rates = [model.rate(case["batch"], n) for n in DraftGate(case["max_draft"]).lengths]
        if 1.03 < max(rates) / rates[0] < 1.25:
            return case


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=300, help="cases per set")
    ap.add_argument("--steps", type=int, default=700, help="steps per case")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--optimism", default=f"0,{DraftGate.OPTIMISM}", help="DraftGate(optimism=...) values compared, comma-separated")
    ap.add_argument("--request-cases", type=int, default=100,
                    help="batch-1 runs of 40 requests, each with its own acceptance (0: none)")
    ap.add_argument("--unsuited-requests", type=int, default=200,
                    help="requests of the batch-1 runs the drafter suits in none (with --request-cases)")
    ap.add_argument("--batch-cases", type=int, default=40,
                    help="generates of 96 requests whose batch fills and shrinks, latency-bound steps (0: none)")
    ap.add_argument("--out", default=None, help="folder for gate_sim.md / gate_sim.json")
    args = ap.parse_args(argv)
    if args.cases < 1 or args.steps <= 100:
        ap.error("--cases must be >= 1 and --steps > 100")
    values = [float(v) for v in args.optimism.split(",")]
    rng = random.Random(args.seed)
    sets = {kind: [draw(rng, kind) for _ in range(args.cases)] for kind in ("broad", "near")}
    lines = [f"`python bench/gate_sim.py --cases {args.cases} --steps {args.steps} --seed {args.seed} "
             f"--optimism {args.optimism} --request-cases {args.request_cases} --batch-cases {args.batch_cases}`", "",
             "| cases | optimism (standard errors) | below 0.9x the best | mean of best | worst |",
             "|---|---|---|---|---|"]
    results = {}
    for kind, cases in sets.items():
        for value in values:
            ratios = [run_case(c, args.steps, value) for c in cases]
            results[f"{kind}/{value}"] = ratios
            lines.append(f"| {kind} ({len(cases)}) | {value:g} | {sum(r < 0.9 for r in ratios)} | "
                         f"{statistics.mean(ratios):.4f} | {min(ratios):.3f} |")
            print(lines[-1], flush=True)
    runs = [draw_requests(rng) for _ in range(args.request_cases)]
    streak_runs = [draw_requests(rng, streaks=True) for _ in range(args.request_cases)]
    if runs:
        lines += ["", f"Batch 1, {args.request_cases} runs of 40 requests each its own acceptance ('streaks': four "
                  "runs of ten alike; 'noisy': NoisyModel's draws and harder starts):", "",
                  "| requests | the gate | mean of the best fixed length | below 0.9x it | mean of the per-request best "
                  "| worst of it |",
                  "|---|---|---|---|---|---|"]
        for set_name, cases in (("independent", runs), ("streaks", streak_runs)):
            for noisy in (False, True):
                for label, tell, first in (("not told of new requests", False, False),
                                           ("told, first form (FirstFormGate)", True, True),
                                           ("told (the default)", True, False)):
                    pairs = [run_requests(c, tell, noisy, first) for c in cases]
                    key = f"{set_name}{', noisy' if noisy else ''}"
                    results[f"requests/{key}/{label}"] = pairs
                    fixed, oracle = [a for a, _ in pairs], [b for _, b in pairs]
                    lines.append(f"| {key} | {label} | {statistics.mean(fixed):.4f} | {sum(r < 0.9 for r in fixed)} | "
                                 f"{statistics.mean(oracle):.4f} | {min(oracle):.3f} |")
                    print(lines[-1], flush=True)
    if args.request_cases:
        lines += ["", f"Batch 1, {args.unsuited_requests} requests the drafter suits in none (acceptance 0.3 a token): "
                  "tokens/s over "
                  "plain steps', the gate told of new requests / not:", "",
                  "| propose (plain steps) | 16 tokens a request | 64 | 256 |", "|---|---|---|---|"]
        for fixed in (0.02, 0.06):
            pairs = [(run_unsuited(fixed, t, True, args.unsuited_requests),
                      run_unsuited(fixed, t, False, args.unsuited_requests)) for t in (16, 64, 256)]
            results[f"unsuited/{fixed}"] = pairs
            lines.append(f"| {fixed / 0.01:g} | " + " | ".join(f"{a:.3f} / {b:.3f}" for a, b in pairs) + " |")
            print(lines[-1], flush=True)
    moves = [draw_batch_moves(rng) for _ in range(args.batch_cases)]
    if moves:
        lines += ["", f"Generates whose batch fills and shrinks, latency-bound steps ({args.batch_cases} runs "
                  "of 96 requests, 16 or 32 at a time); tokens/s over the true best length at each step's batch:", "",
                  "| policy | mean | below 0.95x | worst | over no draft: mean, worst |", "|---|---|---|---|---|"]
        best = [run_batch_moves(c, "best") for c in moves]
        plain = [run_batch_moves(c, "plain") for c in moves]
        for policy in ("gate-per-request", "gate", "plain"):
            got = [run_batch_moves(c, policy) for c in moves]
            ratios, over = [g / b for g, b in zip(got, best)], [g / p for g, p in zip(got, plain)]
            results[f"batch_moves/{policy}"] = ratios
            lines.append(f"| {policy} | {statistics.mean(ratios):.4f} | {sum(r < 0.95 for r in ratios)} | "
                         f"{min(ratios):.3f} | {statistics.mean(over):.3f}, {min(over):.3f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        import json

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gate_sim.md").write_text(text)
        (out / "gate_sim.json").write_text(json.dumps({"args": vars(args), "cases": sets, "request_runs": runs,
                                                       "batch_runs": moves, "ratios": results}))
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
