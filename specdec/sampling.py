"""Batched verification on the device: every row of a step, greedy and sampled, in one pass.

The batched twin of :mod:`specdec.verify` (the pure, per-request reference). For each
verified row it computes **the target's token** at that row, coupled to the row's draft,
so that the host then verifies every request the same way: accept the longest prefix of
drafts equal to the target's tokens, then emit the target's token at the first mismatch
(the recovered token) or after the last draft (the bonus token), as
:func:`specdec.verify.greedy_verify` does. The only device-to-host transfer is the vector
of tokens, ``[rows]``: one synchronisation per step.

The target's token at a row is:

- **greedy row** (temperature 0): the argmax of the row's logits, bit for bit the token a
  solo greedy run computes from the same logits;
- **sampled row, deterministic draft** (``Draft.probs is None``, one-hot ``q``): the
  Gumbel-max sample ``argmax_v(log p(v) + G(seed, position, v))`` of the shaped
  distribution ``p`` (temperature, top-k, top-p as in
  :func:`specdec.verify.logits_to_probs`), where ``G`` is standard Gumbel noise drawn by a
  counter-based hash of the request's seed, the absolute position the row predicts, and
  the vocabulary index (:func:`gumbel_noise`). The draft is accepted exactly when it equals
  this sample. This is lossless: the emitted token at every position is the target's own
  sample, with noise used for that position only (rows after a rejection are dropped, and
  their positions draw the same noise again next step from the right context). It costs
  nothing in acceptance (``P(accept x) = p(x)``, as with rejection sampling against a
  one-hot ``q``), and it makes the output a function of the seed alone: every
  deterministic drafter gives, token for token, the null drafter's output;
- **sampled row, drafter with probabilities** (``Draft.probs`` ``[k, vocab]``): standard
  rejection sampling (Leviathan et al. 2023, arXiv:2211.17192; Chen et al. 2023,
  arXiv:2302.01318), as :func:`specdec.verify.rejection_sample`: ``x`` is accepted when
  ``u * q(x) < p(x)`` (``u`` uniform, keyed by seed and position), and the row's token is
  ``x`` then, else a recovered token drawn from ``norm(max(0, p - q))`` by Gumbel-max with
  its own keyed noise; the bonus row is the Gumbel-max sample of ``p``. Why not couple
  these too: accepting only when the draft equals the target's sample would accept with
  probability ``sum p q``, below the optimal ``sum min(p, q)`` that rejection sampling
  reaches, so a proper ``q`` keeps rejection sampling (lossless, seeded, but its tokens then
  depend on the drafter's own draws). The recovered token is never ``x`` (if the residual
  has no mass, which only rounding causes, it is drawn from ``p`` with ``x`` removed), so
  "the row's token equals the draft" means "accepted" for every row.

Shapes: ``rows`` = verified rows of the step (one per context request, ``k + 1`` per
generation request with ``k`` drafts), ``vocab`` = vocabulary size, ``S`` = sampled rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from specdec.verify import greedy_verify

if TYPE_CHECKING:
    from specdec.config import SamplingParams
    from specdec.drafters.base import Draft

__all__ = ["RowSampling", "gumbel_noise", "mix32", "request_key", "row_uniforms", "sample_rows", "shape_logits",
           "verify_batch"]

_M32 = 0xFFFFFFFF
# Streams of independent noise per (seed, position): the target's sample, the acceptance uniform, the residual.
_STREAM_SAMPLE, _STREAM_ACCEPT, _STREAM_RESIDUAL = 0x1B873593, 0x2C1B3C6D, 0x297A2D39


def mix32(x):
    """A bijective 32-bit mixing function (xorshift-multiply rounds, as in murmur3's finaliser).

    Works on Python ints and on int64 tensors alike; inputs and outputs are in ``[0, 2**32)``.
    Every multiplier is below ``2**31``, so products of 32-bit values stay below ``2**63``:
    no int64 overflow, on any device.
    """
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _M32
    x = x ^ (x >> 13)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def request_key(seed: int) -> int:
    """The 32-bit key of a request's seed (any int; reduced modulo ``2**64``)."""
    seed %= 1 << 64
    return mix32(mix32(seed & _M32) ^ (seed >> 32))


def _row_keys(keys: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """``[S]`` 32-bit keys of (request key, absolute position, stream), one per row."""
    return mix32(mix32(keys ^ stream) ^ (positions & _M32))


def _uniform(h: torch.Tensor) -> torch.Tensor:
    """fp32 uniforms in ``(0, 1)`` from 32-bit hashes, fine-grained near 0 (the Gumbel tail)."""
    return (h.float() * 2.0 ** -32 + 2.0 ** -33).clamp_max(1.0 - 2.0 ** -24)


_VOCAB_HASH: dict[tuple[int, torch.device], torch.Tensor] = {}


def _vocab_hash(vocab: int, device: torch.device) -> torch.Tensor:
    """``[vocab]`` a fixed 32-bit hash of each vocabulary index (cached per size and device)."""
    key = (vocab, device)
    if key not in _VOCAB_HASH:
        _VOCAB_HASH[key] = mix32(torch.arange(vocab, dtype=torch.long, device=device) + 0x61C88647)
    return _VOCAB_HASH[key]


def gumbel_noise(keys: torch.Tensor, positions: torch.Tensor, vocab: int, stream: int = _STREAM_SAMPLE) -> torch.Tensor:
    """Standard Gumbel noise, a pure function of (request key, position, vocabulary index).

    Counter-based: no generator state, so the noise of a position is the same whichever
    step (or drafter) computes it, and rows of many requests are drawn in one pass.

    Args:
        keys: ``[S]`` int64 request keys (:func:`request_key`).
        positions: ``[S]`` int64 absolute positions the rows predict.
        vocab: vocabulary size.
        stream: which independent stream of noise.

    Returns:
        ``[S, vocab]`` fp32 ``-log(E)``, ``E ~ Exp(1)`` i.i.d.
    """
    row = _row_keys(keys, positions, stream)  # [S]
    h = mix32(row[:, None] ^ _vocab_hash(vocab, keys.device)[None, :])  # [S, vocab]
    return -torch.log(-torch.log1p(-_uniform(h)))


def row_uniforms(keys: torch.Tensor, positions: torch.Tensor, stream: int = _STREAM_ACCEPT) -> torch.Tensor:
    """``[S]`` fp32 uniforms in ``(0, 1)``, a pure function of (request key, position, stream)."""
    return _uniform(mix32(_row_keys(keys, positions, stream) ^ 0x3C6EF372))


def shape_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 masked: bool = True) -> torch.Tensor:
    """Per-row temperature, top-k and top-p, as log-weights: ``softmax`` of the result is
    :func:`specdec.verify.logits_to_probs` of each row with its own parameters.

    Args:
        logits: ``[S, vocab]`` target logits, any float dtype.
        temperature: ``[S]`` fp32, > 0.
        top_k: ``[S]`` int64, 0 = no limit.
        top_p: ``[S]`` fp32 in ``(0, 1]``.
        masked: whether any row has a top-k or top-p limit (``False`` skips the sort).

    Returns:
        ``[S, vocab]`` fp32 ``logits / temperature``, with ``-inf`` where top-k or top-p drop a token.
    """
    z = logits.float() / temperature[:, None]  # [S, vocab]
    if not masked:
        return z
    vocab = z.shape[-1]
    srt, order = z.sort(dim=-1, descending=True, stable=True)  # [S, vocab] each
    rank = torch.arange(vocab, device=z.device)  # [vocab]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)  # [S]
    drop = rank[None, :] >= k[:, None]  # [S, vocab], sorted order: top-k
    probs = srt.masked_fill(drop, float("-inf")).softmax(dim=-1)  # [S, vocab], sorted
    cumulative = probs.cumsum(dim=-1)
    mass_before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)  # [S, vocab]
    drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)  # top-p over the top-k renormalised mass
    drop[:, 0] = False  # the top token always survives
    return z.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))


@dataclass(slots=True)
class RowSampling:
    """The sampled rows of one step, on the host (built by the engine, read by :func:`sample_rows`).

    Greedy rows are not listed: their token is the argmax. Per sampled row (``[S]`` lists):

    Attributes:
        rows: the row's index among the step's verified rows.
        temperature, top_k, top_p: the request's sampling parameters.
        keys: the request's key (:func:`request_key` of its seed).
        positions: the absolute position (index in prompt + output) of the token the row predicts.
        drafts: the draft token the row verifies; -1 for a row with none (bonus or context row).
        draft_probs: ``(first row, q)`` per request whose draft carries probabilities: its
            ``k`` draft rows are the ``k`` sampled rows starting at ``first row`` (an index into
            these lists), ``q`` is ``Draft.probs`` ``[k, vocab]``.
    """

    rows: list[int] = field(default_factory=list)
    temperature: list[float] = field(default_factory=list)
    top_k: list[int] = field(default_factory=list)
    top_p: list[float] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    draft_probs: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def add(self, first_row: int, params: SamplingParams, key: int, position: int, draft: Draft | None) -> None:
        """List a sampled request's rows: ``first_row`` .. ``first_row + len(draft)``, predicting
        positions ``position`` .. ``position + len(draft)``."""
        tokens = tuple(draft.token_ids) if draft is not None else ()
        if draft is not None and draft.probs is not None and tokens:
            self.draft_probs.append((len(self.rows), draft.probs))
        n = len(tokens) + 1
        self.rows += range(first_row, first_row + n)
        self.temperature += [float(params.temperature)] * n
        self.top_k += [params.top_k] * n
        self.top_p += [float(params.top_p)] * n
        self.keys += [key] * n
        self.positions += range(position, position + n)
        self.drafts += [*tokens, -1]

    def __len__(self) -> int:
        return len(self.rows)


def sample_rows(logits: torch.Tensor, argmax: torch.Tensor | None, sampling: RowSampling | None) -> torch.Tensor:
    """The target's token at every verified row, on the device (see the module docstring).

    Args:
        logits: ``[rows, vocab]`` target logits of the step's verified rows.
        argmax: ``[rows]`` their argmax if already computed (e.g. inside a CUDA graph), or ``None``.
        sampling: the sampled rows, or ``None`` when every row is greedy.

    Returns:
        ``[rows]`` int64 on ``logits.device``: the argmax at greedy rows, the coupled
        sample at sampled rows. No host synchronisation.
    """
    if argmax is None:
        argmax = logits.argmax(dim=-1)  # [rows]
    if not sampling:
        return argmax
    dev, vocab = logits.device, logits.shape[-1]
    ints = torch.tensor([sampling.rows, sampling.top_k, sampling.keys, sampling.positions, sampling.drafts],
                        dtype=torch.long).to(dev, non_blocking=True)  # [5, S]
    floats = torch.tensor([sampling.temperature, sampling.top_p], dtype=torch.float32).to(dev, non_blocking=True)
    rows, top_k, keys, positions, drafts = ints
    masked = any(k > 0 for k in sampling.top_k) or any(p < 1.0 for p in sampling.top_p)
    z = shape_logits(logits.index_select(0, rows), floats[0], top_k, floats[1], masked)  # [S, vocab]
    tokens = (z + gumbel_noise(keys, positions, vocab)).argmax(dim=-1)  # [S]
    if sampling.draft_probs:
        tokens = _rejection_rows(z, tokens, sampling, keys, positions, drafts)
    return argmax.index_copy(0, rows, tokens)


def _rejection_rows(z: torch.Tensor, tokens: torch.Tensor, sampling: RowSampling, keys: torch.Tensor,
                    positions: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """Rejection sampling at the draft rows of requests whose drafts carry ``q``: the row's
    token becomes the draft if accepted, else a recovered token (never the draft).

    Args:
        z: ``[S, vocab]`` shaped log-weights; tokens: ``[S]`` their Gumbel-max samples;
        keys, positions, drafts: ``[S]`` int64.
    """
    dev, vocab = z.device, z.shape[-1]
    sel = torch.tensor([first + i for first, q in sampling.draft_probs for i in range(q.shape[0])],
                       dtype=torch.long).to(dev, non_blocking=True)  # [Q]
    q = torch.cat([q.to(dev, torch.float32) for _, q in sampling.draft_probs])  # [Q, vocab]
    p = z.index_select(0, sel).softmax(dim=-1)  # [Q, vocab]
    x = drafts.index_select(0, sel)  # [Q]
    valid = (x >= 0) & (x < vocab)  # an out-of-vocabulary draft is rejected, never gathered
    xc = x.clamp(0, vocab - 1)[:, None]  # [Q, 1]
    p_x = torch.where(valid, p.gather(1, xc)[:, 0], 0.0)  # [Q]
    q_x = torch.where(valid, q.gather(1, xc)[:, 0], 1.0)  # [Q]
    k_sel, pos_sel = keys.index_select(0, sel), positions.index_select(0, sel)
    accept = row_uniforms(k_sel, pos_sel) * q_x < p_x  # [Q], u < p/q without dividing
    residual = (p - q).clamp_min(0.0)  # [Q, vocab]
    drop_x = torch.zeros_like(p, dtype=torch.bool).scatter(1, xc, valid[:, None])  # [Q, vocab]
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # only rounding empties it
    residual = torch.where(empty, p.masked_fill(drop_x, 0.0), residual.masked_fill(drop_x, 0.0))
    recovered = (residual.log() + gumbel_noise(k_sel, pos_sel, vocab, _STREAM_RESIDUAL)).argmax(dim=-1)  # [Q]
    return tokens.index_copy(0, sel, torch.where(accept, x, recovered))


def verify_batch(logits: torch.Tensor, drafts: Sequence[Draft], params: Sequence[SamplingParams],
                 seeds: Sequence[int], positions: Sequence[int]) -> list[list[int]]:
    """Verify the chain drafts of many requests from one step's logits, greedy or sampled.

    The engine runs the same two halves (:func:`sample_rows` inside the model runner's
    step, :func:`specdec.verify.greedy_verify` on the host afterwards); this function is
    the two together, for tests and for callers without an engine.

    Args:
        logits: ``[rows, vocab]``: per request, ``len(draft) + 1`` consecutive rows (the
            last accepted token and each draft), requests in order.
        drafts: one chain draft per request (``Draft()`` for none).
        params: one ``SamplingParams`` per request.
        seeds: one seed per request (sampled requests; ignored for greedy ones).
        positions: per request, the absolute position of the first token it emits.

    Returns:
        Per request, the emitted tokens: accepted drafts, then one recovered or bonus
        token. One device-to-host transfer in all.

    Raises:
        ValueError: the lengths disagree, or a draft is a tree.
    """
    if not len(drafts) == len(params) == len(seeds) == len(positions):
        raise ValueError(f"drafts, params, seeds and positions must have one entry per request, got "
                         f"{len(drafts)}, {len(params)}, {len(seeds)}, {len(positions)}")
    if any(d.parents is not None for d in drafts):
        raise ValueError("verify_batch verifies chain drafts only; got a tree draft (parents is set)")
    total = sum(len(d) + 1 for d in drafts)
    if logits.dim() != 2 or logits.shape[0] != total:
        raise ValueError(f"logits must be [sum(len(draft) + 1), vocab] = [{total}, vocab], got {list(logits.shape)}")
    sampling, row = RowSampling(), 0
    for d, p, seed, pos in zip(drafts, params, seeds, positions):
        if not p.greedy:
            sampling.add(row, p, request_key(seed), pos, d)
        row += len(d) + 1
    tokens = sample_rows(logits, None, sampling).tolist()  # the one synchronisation
    out, row = [], 0
    for d in drafts:
        out.append(greedy_verify(tokens[row:row + len(d) + 1], d.token_ids))
        row += len(d) + 1
    return out
