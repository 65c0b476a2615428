"""Verification of drafted tokens against the target (docs/design.md §6).

Pure functions, no engine state. Words used throughout:

- **accepted tokens**: the leading drafts the target keeps;
- **recovered token**: the token sampled in place of the first rejected draft;
- **bonus token**: the target's own next token after the last draft when every
  draft was accepted.

A verify step over ``k`` drafts therefore emits ``accepted + 1`` tokens, between
1 and ``k + 1``: the accepted drafts, then one recovered or bonus token.

Shapes: ``k`` drafts, ``vocab`` = vocabulary size; the target scores ``k + 1``
positions (the last accepted token and each draft).

This is the reference, one request at a time. The engine runs its batched twin,
:mod:`specdec.sampling` (every row of a step on the device, seeded per position),
which tests check against these functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from specdec.config import GREEDY_BELOW
from specdec.errors import ConfigError

if TYPE_CHECKING:
    from specdec.config import SamplingParams
    from specdec.drafters.base import Draft

__all__ = ["FIXED_POINT_ONE", "fixed_point_weights", "greedy_verify", "logits_to_probs", "nucleus_prefix",
           "rejection_sample", "verify_draft"]


FIXED_POINT_ONE = 2 ** 32
"""The weight of a row's most likely token in the fixed-point masses of top-p (:func:`nucleus_prefix`)."""


def fixed_point_weights(z: torch.Tensor, z_max: torch.Tensor) -> torch.Tensor:
    """``floor(exp(z - z_max) * 2**32)`` as int64: the top-p weights of log-weights ``z``.

    Every weight is computed on its own (fp32 ``exp``, an exact scaling by a power of two, an exact
    truncation), and sums of weights are exact integers (below ``2**53`` for any vocabulary under
    ``2**21`` tokens), so a mass does not depend on the order it is summed in: a sort, a
    parallel reduction and a radix search all find the same nucleus, bit for bit. A token whose
    probability is below ``2**-32`` of the most likely token's weighs 0.

    Args:
        z: ``[..., vocab]`` fp32 log-weights (``logits / temperature``).
        z_max: ``z``'s maximum over the last dimension, broadcastable against ``z`` (a row of
            ``-inf`` only should pass 0).
    """
    return (torch.exp(z - z_max) * float(FIXED_POINT_ONE)).long()


def nucleus_prefix(sorted_z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which ranks of descending-sorted log-weights top-k then top-p keep: a prefix of each row.

    Top-k keeps the first ``top_k`` ranks. Top-p then keeps rank ``r`` while the mass before it
    (the ranks ``< r``, within top-k) is below ``top_p`` of top-k's mass, so the kept set is the
    smallest prefix whose mass reaches ``top_p``; rank 0 always stays. Masses are the exact
    fixed-point sums of :func:`fixed_point_weights` (probabilities to ``2**-32`` of the most likely
    token's), compared in float64 as ``before < top_p * total`` with ``total < 2**53``: exact.

    Args:
        sorted_z: ``[n, vocab]`` fp32, each row sorted descending (ties in index order).
        top_k: ``[n]`` int64 in ``[1, vocab]`` (``vocab`` = no limit).
        top_p: ``[n]`` fp32 in ``(0, 1]``; rows at 1 skip top-p.

    Returns:
        ``[n, vocab]`` bool, True on the kept ranks.
    """
    rank = torch.arange(sorted_z.shape[-1], device=sorted_z.device)  # [vocab]
    keep = rank[None, :] < top_k[:, None]  # [n, vocab]
    z_max = sorted_z[:, :1]
    z_max = torch.where(torch.isfinite(z_max), z_max, torch.zeros_like(z_max))  # [n, 1]
    w = fixed_point_weights(sorted_z, z_max).masked_fill(~keep, 0)  # [n, vocab] int64
    before = w.cumsum(dim=-1) - w  # exact integer prefix masses
    bound = top_p.double()[:, None] * w.sum(dim=-1, keepdim=True).double()  # [n, 1]
    # rank 0 always stays (a row of -inf only has no mass: top-p then keeps just it)
    return keep & ((before.double() < bound) | (top_p[:, None] >= 1.0) | (rank[None, :] == 0))


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn target logits into the distribution ``p`` that sampling draws from.

    Applies, in order: temperature, top-k, top-p (nucleus), then renormalises.
    The baseline (null drafter) and the speculative path both use this shaping, so
    ``p`` is shaped identically in both (docs/design.md §6).

    Tokens are ranked by descending ``logits / temperature``, ties in index order (a stable
    sort). Top-k keeps the first ``top_k`` ranks; top-p keeps the smallest prefix of those
    whose mass reaches ``top_p`` (the most likely token always), masses being exact
    fixed-point sums (:func:`nucleus_prefix`), so that the batched sampler, which finds the
    same prefix without sorting, keeps exactly the same tokens.

    Args:
        logits: ``[n, vocab]`` target logits, any float dtype.
        params: sampling parameters; a sampling temperature (``not params.greedy``).

    Returns:
        ``[n, vocab]`` fp32 probabilities; every row sums to 1.

    Raises:
        ConfigError: ``params`` is greedy (temperature below ``GREEDY_BELOW``: greedy decoding uses argmax).
    """
    if params.greedy:
        raise ConfigError(f"logits_to_probs needs a sampling temperature (>= {GREEDY_BELOW}), "
                          f"got {params.temperature!r}; greedy decoding uses argmax")
    z = logits.float() / params.temperature  # [n, vocab]
    n, vocab = z.shape
    if 0 < params.top_k < vocab or params.top_p < 1.0:
        sorted_z, order = z.sort(dim=-1, descending=True, stable=True)  # [n, vocab] each
        top_k = torch.full((n,), params.top_k if 0 < params.top_k < vocab else vocab, device=z.device)
        top_p = torch.full((n,), float(params.top_p), dtype=torch.float32, device=z.device)
        drop_sorted = ~nucleus_prefix(sorted_z, top_k, top_p)  # [n, vocab], sorted order
        z = z.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), float("-inf"))
    return z.softmax(dim=-1)


def greedy_verify(target_argmax: Sequence[int], draft_tokens: Sequence[int]) -> list[int]:
    """Greedy verification: the longest matching prefix, then the target's token.

    Args:
        target_argmax: ``[k + 1]`` the target's argmax at each verified position.
        draft_tokens: ``[k]`` the drafted tokens.

    Returns:
        The emitted tokens: the accepted drafts (those equal to the target's
        argmax, up to the first mismatch) followed by the target's argmax at the
        next position (the recovered token on a mismatch, the bonus token when
        all drafts match). Length in ``[1, k + 1]``.

    Raises:
        ValueError: ``len(target_argmax) != len(draft_tokens) + 1``.
    """
    target = _as_list(target_argmax)
    drafts = _as_list(draft_tokens)
    if len(target) != len(drafts) + 1:
        raise ValueError(f"target_argmax must have len(draft_tokens) + 1 = {len(drafts) + 1} entries, got {len(target)}")
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return drafts[:n] + [target[n]]


def verify_chains(target_tokens: Sequence[int], row_starts: Sequence[int], drafts: Sequence[Draft]) -> list[list[int]]:
    """:func:`greedy_verify` for every request of a step at once.

    Args:
        target_tokens: ``[rows]`` the target's token at every verified row of the step: the
            argmax of greedy rows, the seeded sample of sampled rows coupled to their drafts
            (:mod:`specdec.sampling`), so one rule verifies both.
        row_starts: ``[R]`` each request's first row in ``target_tokens``; it has
            ``len(drafts[i]) + 1`` rows.
        drafts: ``[R]`` each request's chain draft (empty for a request that drafted nothing).

    Returns:
        Per request, the emitted tokens: its drafts up to the first that differs from the
        target's token, then the target's token there.
    """
    return [greedy_verify(target_tokens[r:r + len(d) + 1], d.token_ids) for r, d in zip(row_starts, drafts)]


def rejection_sample(
    target_probs: torch.Tensor,
    draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Speculative sampling: emits tokens distributed exactly as the target's ``p``.

    Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
    Decoding" (arXiv:2211.17192); Chen et al. 2023, "Accelerating Large Language
    Model Decoding with Speculative Sampling" (arXiv:2302.01318).

    Draft ``x_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``.
    The first rejected draft is replaced by a **recovered token** sampled from
    ``norm(max(0, p_i - q_i))`` and verification stops there. If every draft is
    **accepted**, a **bonus token** is sampled from ``p_k``. A deterministic
    drafter (``draft_probs is None``) has a one-hot ``q``: ``x_i`` is accepted
    with probability ``p_i(x_i)`` and the recovered token comes from ``p_i``
    with ``x_i`` zeroed out. If the residual has no mass (``p <= q`` everywhere,
    which only rounding can produce), the recovered token is sampled from ``p_i``.

    Draws ``k`` uniforms and ``vocab`` exponentials from ``generator`` per call, so
    the result is a deterministic function of the generator's state.

    Args:
        target_probs: ``[k + 1, vocab]`` target distributions ``p`` (e.g. from
            :func:`logits_to_probs`), one per verified position.
        draft_tokens: ``[k]`` the drafted tokens, ``x_i ~ q_i``.
        draft_probs: ``[k, vocab]`` the drafter's distributions ``q``, or ``None``
            for a deterministic drafter.
        generator: random generator on ``target_probs.device``; ``None`` uses
            torch's global generator.

    Returns:
        The emitted tokens: accepted drafts, then one recovered or bonus token.
        Length in ``[1, k + 1]``.

    Raises:
        ValueError: the shapes of the arguments disagree.
    """
    p = target_probs.float()  # [k + 1, vocab]
    drafts = _as_list(draft_tokens)
    k = len(drafts)
    _check_shapes(p, k, draft_probs)
    x = torch.tensor(drafts, dtype=torch.long, device=p.device)  # [k]
    rows = torch.arange(k, device=p.device)  # [k]
    p_x = p[rows, x]  # [k]
    q_x = draft_probs.float()[rows, x] if draft_probs is not None else torch.ones_like(p_x)  # [k]
    u = torch.rand(k, generator=generator, device=p.device)  # [k]
    accepted = (u * q_x < p_x).tolist()  # u < p/q: accept w.p. min(1, p/q), and q = 0 never divides
    n = accepted.index(False) if False in accepted else k  # length of the accepted prefix
    if n == k:
        weights = p[k]  # [vocab], bonus
    elif draft_probs is not None:
        weights = (p[n] - draft_probs[n].float()).clamp_min(0.0)  # [vocab], recovered
    else:
        weights = p[n].index_fill(0, x[n : n + 1], 0.0)  # [vocab], max(0, p - onehot(x)) = p with x zeroed
    if n < k and not float(weights.sum()) > 0:
        weights = p[n]  # the residual has no mass only through rounding (p == q)
    return drafts[:n] + [_sample(weights, generator)]


def verify_draft(
    target_logits: torch.Tensor,
    draft: Draft,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Verify one request's chain draft: greedy or sampling, by ``params``.

    Args:
        target_logits: ``[k + 1, vocab]`` target logits at the last accepted token
            and at each draft.
        draft: the request's chain draft (``k`` tokens).
        params: the request's sampling parameters.
        generator: the request's generator (sampling only).

    Returns:
        The emitted tokens (see :func:`rejection_sample`), length in ``[1, k + 1]``.

    Raises:
        ValueError: the shapes disagree.
    """
    if params.greedy:
        return greedy_verify(target_logits.argmax(dim=-1).tolist(), draft.token_ids)
    probs = logits_to_probs(target_logits, params)  # [k + 1, vocab]
    return rejection_sample(probs, draft.token_ids, draft.probs, generator)


def _sample(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token with probability proportional to ``weights`` ``[vocab]`` (need not sum to 1).

    The exponential race: ``argmax(w / E)`` with ``E_i ~ Exp(1)`` i.i.d. picks ``i``
    with probability ``w_i / sum(w)``; no normalisation, zero weights never win.
    """
    race = torch.empty_like(weights).exponential_(generator=generator)  # [vocab]
    race.clamp_min_(torch.finfo(race.dtype).tiny)  # an exact 0 would make 0 / 0 = nan win argmax
    return int((weights / race).argmax())


def _as_list(tokens: Sequence[int] | torch.Tensor) -> list[int]:
    return tokens.tolist() if isinstance(tokens, torch.Tensor) else [int(t) for t in tokens]


def _check_shapes(p: torch.Tensor, k: int, q: torch.Tensor | None) -> None:
    if p.dim() != 2 or p.shape[0] != k + 1:
        raise ValueError(f"target_probs must be [k + 1, vocab] = [{k + 1}, vocab], got {list(p.shape)}")
    if q is not None and tuple(q.shape) != (k, p.shape[1]):
        raise ValueError(f"draft_probs must be [k, vocab] = [{k}, {p.shape[1]}] or None, got {list(q.shape)}")
