"""How many drafted tokens to verify: cut each request's draft where it stops paying.

A drafter may give each drafted token a confidence ``c_j``: its probability of being accepted
given that the tokens before it were (``Draft.confidence``; DSpark's confidence head supplies
it). Verifying ``k`` tokens of a draft then yields ``1 + sum_{j<=k} prod_{i<=j} c_i`` tokens in
expectation, and a step of ``B`` requests verifying ``R`` rows in all costs ``cost(B, R)``
(:class:`CostProfile`, measured once per target, device and page size, and cached).

:func:`choose_lengths` picks the lengths that maximise expected tokens per unit of step cost
over the whole batch. Each token's marginal gain ``prod_{i<=j} c_i`` never rises along its
draft, so for any total of extra rows ``m`` the best choice is the ``m`` largest gains of the
batch (a draft's own gains come in order); the rule tries every ``m`` (0 included: no draft,
the null drafter's step) and keeps the best ratio. So speculation never makes the step slower
in expectation than not drafting, by the profile's measure.
"""

from __future__ import annotations

import heapq
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from specdec.errors import CheckpointError, ConfigError


def expected_tokens(confidence: Sequence[float], k: int) -> float:
    """Expected tokens a step yields from verifying the first ``k`` drafted tokens (bonus included)."""
    total, run = 1.0, 1.0
    for c in confidence[:k]:
        run *= c
        total += run
    return total


def choose_lengths(confidences: Sequence[Sequence[float]], cost: Callable[[int, int], float],
                   fixed_rows: int = 0) -> list[int]:
    """Draft lengths to verify for one step's requests.

    Args:
        confidences: per request, the confidences of its drafted tokens (each in [0, 1]).
        cost: ``cost(batch, rows)``, the step's time with ``batch`` requests and ``rows`` query
            rows in all (each request verifies its kept tokens plus one row); a
            :class:`CostProfile` is read for every candidate in one call (:meth:`CostProfile.costs`).
        fixed_rows: rows of this step that are not chosen here (drafts kept whole), added to every cost.

    Returns:
        how many tokens of each request's draft to keep: the choice that maximises
        ``(batch + sum of kept tokens' gains) / cost(batch, batch + fixed_rows + kept tokens)``.
    """
    B = len(confidences)
    if B == 0:
        return []
    heap: list[tuple[float, int, int]] = []  # (-gain, request, position) of each request's next token
    runs = [1.0] * B
    for i, c in enumerate(confidences):
        if len(c):
            runs[i] = float(c[0])
            heapq.heappush(heap, (-runs[i], i, 0))
    gains, order = [], []
    while heap:
        g, i, j = heapq.heappop(heap)
        gains.append(-g)
        order.append(i)
        c = confidences[i]
        if j + 1 < len(c):
            runs[i] *= float(c[j + 1])
            heapq.heappush(heap, (-runs[i], i, j + 1))
    rows = [B + fixed_rows + m for m in range(len(gains) + 1)]
    many = getattr(cost, "costs", None)
    step = many(B, rows) if many is not None else [cost(B, r) for r in rows]
    best_m, best_ratio, gained = 0, B / step[0], 0.0
    for m, g in enumerate(gains, 1):
        gained += g
        ratio = (B + gained) / step[m]
        if ratio > best_ratio:
            best_m, best_ratio = m, ratio
    keep = [0] * B
    for i in order[:best_m]:
        keep[i] += 1
    return keep


def kept_lengths(drafts_conf: Sequence[Sequence[float] | None], lengths: Sequence[int],
                 cost: Callable[[int, int], float]) -> list[int]:
    """:func:`choose_lengths` for drafts of ``lengths``, where a draft without confidences keeps all
    its tokens (and its rows count in the cost)."""
    fixed = sum(n for c, n in zip(drafts_conf, lengths) if c is None)
    chosen = choose_lengths([c if c is not None else () for c in drafts_conf], cost, fixed_rows=fixed)
    return [n if c is None else k for c, n, k in zip(drafts_conf, lengths, chosen)]


@dataclass(frozen=True)
class CostProfile:
    """Step time over (requests, query rows), measured on a grid and interpolated.

    Attributes:
        points: ``{(batch, rows): seconds}``; rows = requests x rows per request on the grid.
        meta: what was measured (device, target, page size, date).
    """

    points: dict[tuple[int, int], float]
    meta: dict

    def __post_init__(self) -> None:
        if not self.points:
            raise ConfigError("a cost profile needs at least one measured point")
        if any(not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0) for v in self.points.values()):
            raise ConfigError("cost profile times must be finite numbers > 0")
        grid = {}  # batch -> (rows ascending, seconds): made once, read at every step
        for (b, r), t in sorted(self.points.items()):
            grid.setdefault(b, ([], []))
            grid[b][0].append(float(r))
            grid[b][1].append(float(t))
        object.__setattr__(self, "_grid", {b: (np.array(r), np.array(t)) for b, (r, t) in grid.items()})
        object.__setattr__(self, "_batches", np.array(sorted(grid)))

    @classmethod
    def flat(cls) -> "CostProfile":
        """A profile where rows cost nothing: every confident token is kept."""
        return cls({(1, 1): 1.0}, {"kind": "flat"})

    def __call__(self, batch: int, rows: int) -> float:
        """Interpolated seconds: linear in rows at the two nearest measured batch sizes, then in batch
        (clamped to the grid's ends; beyond the largest rows, extrapolated from the last segment)."""
        return float(self.costs(batch, [rows])[0])

    def costs(self, batch: int, rows: Sequence[float]) -> np.ndarray:
        """:meth:`__call__` at many row counts of one batch size at once (what a step's rule needs)."""
        rows = np.asarray(rows, dtype=np.float64)
        bs = self._batches
        lo = int(bs[bs <= batch].max()) if (bs <= batch).any() else int(bs[0])
        hi = int(bs[bs >= batch].min()) if (bs >= batch).any() else int(bs[-1])
        t_lo = self._at(lo, rows * lo / max(1, batch))
        if hi == lo:
            return t_lo
        w = (batch - lo) / (hi - lo)
        return t_lo + w * (self._at(hi, rows * hi / max(1, batch)) - t_lo)

    def _at(self, batch: int, rows: np.ndarray) -> np.ndarray:
        r, t = self._grid[batch]
        if len(r) == 1:
            return np.full_like(rows, t[0])
        out = np.interp(rows, r, t)  # clamped at both ends
        past = rows > r[-1]  # beyond the grid: the last segment's slope, never below its end
        out[past] = np.maximum(t[-1], t[-1] + (rows[past] - r[-1]) / (r[-1] - r[-2]) * (t[-1] - t[-2]))
        return out

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"meta": self.meta, "points": [[b, r, t] for (b, r), t in
                                                                         sorted(self.points.items())]}, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "CostProfile":
        """Read what :meth:`save` wrote.

        Raises:
            CheckpointError: missing or malformed file.
        """
        try:
            d = json.loads(Path(path).read_text())
            return cls({(int(b), int(r)): float(t) for b, r, t in d["points"]}, dict(d.get("meta", {})))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"cost profile {str(path)!r} is missing or malformed: {e}") from None

    @classmethod
    @torch.inference_mode()
    def measure(cls, target, tokens_per_block: int = 16, batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
                rows_per_request: Sequence[int] = (1, 2, 4, 8, 12, 16), context: int = 512,
                repeats: int = 5, backends=None) -> "CostProfile":
        """Time the target's verify step (forward and logits) at each grid point, over a scratch KV
        pool whose requests hold ``context`` tokens each; the median of ``repeats`` runs.
        ``backends``: the attention backends to select from (an engine's own, with its options);
        ``None``: a default set."""
        from specdec.attention.metadata import plan_step
        from specdec.kvcache import KVCacheManager, KVPool

        dev, tpb = target.device, tokens_per_block
        points = {}
        for B in batch_sizes:
            per = -(-(context + max(rows_per_request)) // tpb)
            pool, mgr = KVPool(target.layer_specs(), per * B, tpb, device=dev), KVCacheManager(per * B, tpb)
            for i in range(B):
                mgr.allocate(i, context + max(rows_per_request))
            for q in rows_per_request:
                gen = [(q, context + q, tuple(mgr.page_table(i))) for i in range(B)]
                slots = torch.tensor([s for i in range(B) for s in mgr.slots(i, context, context + q)], device=dev)
                pos = torch.tensor([p for _ in range(B) for p in range(context, context + q)], device=dev)
                ids = torch.zeros(B * q, dtype=torch.long, device=dev)
                attn = plan_step([], gen, slots, lambda p, m, x: target.attn_shape(p, m, tpb, x), tpb,
                                 backends=backends)
                times = []
                for r in range(repeats + 1):
                    _sync(dev)
                    t0 = time.perf_counter()
                    hidden, _ = target.forward(ids, pos, attn, pool)
                    target.compute_logits(hidden).argmax(-1)
                    _sync(dev)
                    if r:  # the first run compiles and plans
                        times.append(time.perf_counter() - t0)
                points[(B, B * q)] = sorted(times)[len(times) // 2]
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        return cls(points, {"device": name, "dtype": str(target.dtype), "tokens_per_block": tpb, "context": context,
                            "target": profile_key(target, tpb), "measured": time.strftime("%Y-%m-%d")})


def profile_key(target, tokens_per_block: int) -> str:
    """What a profile depends on: the target's shape and dtype, the device and the page size."""
    dev = target.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    parts = [name, str(target.dtype), f"L{target.num_layers}", f"H{target.hidden_size}", f"V{target.vocab_size}",
             f"P{tokens_per_block}"]
    return "-".join(p.replace(" ", "_").replace("torch.", "") for p in parts)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
