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

from specdec.verify import nucleus_prefix, verify_chains

if TYPE_CHECKING:
    from specdec.config import SamplingParams
    from specdec.drafters.base import Draft

__all__ = ["USE_KERNEL", "RowSampling", "apply_cutoffs", "gumbel_noise", "mix32", "request_key", "row_cutoffs",
           "row_uniforms", "sample_rows", "shape_logits", "verify_batch", "warm_up"]

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
        masked: whether any row has a top-k or top-p limit (``False`` skips the cutoffs).

    Returns:
        ``[S, vocab]`` fp32 ``logits / temperature``, with ``-inf`` where top-k or top-p drop a token.
        With ``masked``, reads ``top_k`` and ``top_p`` on the host (one synchronisation);
        :func:`sample_rows` has them on the host already.
    """
    z = logits.float() / temperature[:, None]  # [S, vocab]
    if not masked:
        return z
    return apply_cutoffs(z, row_cutoffs(z, top_k.tolist(), top_p.tolist()))


def row_cutoffs(z: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row cutoffs of top-k and top-p: row ``s`` keeps the tokens ``v`` with ``z[s, v] > thr[s]``,
    or ``z[s, v] == thr[s]`` and ``v <= icut[s]``.

    That is the prefix of the row's stable descending sort that top-k (``top_k`` tokens) and
    top-p (the smallest prefix whose renormalised top-k mass reaches ``top_p``; the top token
    always; exact fixed-point masses, :func:`specdec.verify.nucleus_prefix`) keep, ties at the
    cutoff kept in index order. This is the torch reference: only the rows that ask for top-p are
    sorted; rows with top-k alone take :func:`torch.topk`'s ``k``-th value; rows without limits get
    ``(-inf, vocab)`` (keep all) and cost nothing. The limits are host lists: no synchronisation.

    Args:
        z: ``[S, vocab]`` fp32 ``logits / temperature``.
        top_k: ``S`` ints, 0 (or >= vocab) = no limit; top_p: ``S`` floats in ``(0, 1]``.

    Returns:
        ``(thr [S] fp32, icut [S] int32)``.
    """
    dev, (n_rows, vocab) = z.device, z.shape
    thr = torch.full((n_rows,), float("-inf"), dtype=torch.float32, device=dev)
    icut = torch.full((n_rows,), vocab, dtype=torch.int32, device=dev)
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    by_p = [i for i, p in enumerate(top_p) if p < 1.0]
    by_k = [i for i, (k, p) in enumerate(zip(ks, top_p)) if k < vocab and not p < 1.0]
    if by_p:
        (sel, lims), (ps,) = _to_device([by_p, [ks[i] for i in by_p]], [[top_p[i] for i in by_p]], dev)  # [P] each
        srt, order = _sort_descending(z.index_select(0, sel))  # [P, vocab] each
        last = nucleus_prefix(srt, lims, ps).sum(dim=-1, keepdim=True) - 1  # [P, 1]: the kept prefix is 0..last
        thr.index_copy_(0, sel, srt.gather(1, last)[:, 0])
        icut.index_copy_(0, sel, order.gather(1, last)[:, 0].int())  # stable: the largest kept tie
    if by_k:
        (sel, k), _ = _to_device([by_k, [ks[i] for i in by_k]], [], dev)  # [K] each
        zk = z.index_select(0, sel)  # [K, vocab]
        t = zk.topk(max(ks[i] for i in by_k), dim=-1).values.gather(1, (k - 1)[:, None])  # [K, 1]: k-th value
        ties = k - (zk > t).sum(dim=-1)  # [K]: how many tokens equal to t top-k keeps, in index order
        eq = zk == t
        thr.index_copy_(0, sel, t[:, 0])
        icut.index_copy_(0, sel, (eq.cumsum(dim=-1) < ties[:, None]).sum(dim=-1).int())
    return thr, icut


SORT_ROWS = 127
"""Most rows :func:`row_cutoffs` sorts in one ``torch.sort`` call. On CUDA, torch sorts a batch of 128
rows or more with cub's segmented radix sort, one thread block per row, which is slow for long
rows (a vocabulary), and fewer rows with two device-wide radix sorts (values, then row index); a
stable sort's result is unique, so the chunks give exactly the one-call result."""


def _sort_descending(z: torch.Tensor, chunk: int = SORT_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """``z.sort(dim=-1, descending=True, stable=True)`` of ``z`` ``[P, vocab]``, at most ``chunk`` rows
    per call (balanced chunks: 144 rows are two sorts of 72)."""
    n_rows = z.shape[0]
    if n_rows <= chunk:
        return z.sort(dim=-1, descending=True, stable=True)
    values, indices = torch.empty_like(z), torch.empty(z.shape, dtype=torch.long, device=z.device)
    start = 0
    for c in z.tensor_split(-(-n_rows // chunk), dim=0):  # sorted in place into row slices: no concatenation
        torch.sort(c, dim=-1, descending=True, stable=True, out=(values[start:start + len(c)],
                                                                  indices[start:start + len(c)]))
        start += len(c)
    return values, indices


def _to_device(ints: Sequence[Sequence[int]], floats: Sequence[Sequence[float]],
               dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Equal-length host lists on the device in one copy: ``(int64 [len(ints), n], fp32 [len(floats), n])``.

    The fp32 values travel as their bits in int64 lanes (exact), so a step makes one small
    host-to-device copy rather than one per list. On CUDA the host side is pinned (torch's caching
    host allocator, which keeps the block until the copy is done): a copy from pageable memory may
    wait for the work already queued on the stream (the step's forward), leaving the GPU idle
    while the rest of the sampled path is launched."""
    n = len(ints[0]) if ints else len(floats[0])
    host = torch.empty(len(ints) + len(floats), n, dtype=torch.long, pin_memory=dev.type == "cuda")
    if ints:
        host[:len(ints)] = torch.tensor(ints, dtype=torch.long)
    if floats:
        host[len(ints):] = torch.tensor(floats, dtype=torch.float32).view(torch.int32)
    packed = host.to(dev, non_blocking=True)  # [ints + floats, n]
    return packed[:len(ints)], packed[len(ints):].to(torch.int32).view(torch.float32)


def apply_cutoffs(z: torch.Tensor, cutoffs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``z`` ``[S, vocab]`` with ``-inf`` at the tokens that :func:`row_cutoffs` drop."""
    thr, icut = cutoffs
    vocab = torch.arange(z.shape[-1], device=z.device)  # [vocab]
    keep = (z > thr[:, None]) | ((z == thr[:, None]) & (vocab[None, :] <= icut[:, None]))  # [S, vocab]
    return z.masked_fill(~keep, float("-inf"))


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


USE_KERNEL: bool | None = None
"""Which path :func:`sample_rows` takes for sampled rows: ``None`` = the fused Triton kernel
(:mod:`specdec.sampling_kernel`) on CUDA when Triton is installed, else torch; ``True`` / ``False``
force the kernel / the torch reference (tests, benchmarks). Both give the same tokens."""


def _kernel_module():
    """:mod:`specdec.sampling_kernel`, or ``None`` without Triton."""
    try:
        from specdec import sampling_kernel
    except ImportError:
        return None
    return sampling_kernel


def _use_kernel(device: torch.device, kernel: bool | None) -> bool:
    kernel = USE_KERNEL if kernel is None else kernel
    if kernel is None:
        return device.type == "cuda" and _kernel_module() is not None
    if kernel and _kernel_module() is None:
        raise RuntimeError("the fused sampling kernel needs Triton (pip extra 'gpu')")
    return kernel


def sample_rows(logits: torch.Tensor, argmax: torch.Tensor | None, sampling: RowSampling | None,
                kernel: bool | None = None) -> torch.Tensor:
    """The target's token at every verified row, on the device (see the module docstring).

    Args:
        logits: ``[rows, vocab]`` target logits of the step's verified rows.
        argmax: ``[rows]`` their argmax if already computed (e.g. inside a CUDA graph), or ``None``.
        sampling: the sampled rows, or ``None`` when every row is greedy.
        kernel: the fused Triton kernel (``True``), the torch reference (``False``), or
            :data:`USE_KERNEL`'s choice (``None``); the tokens are the same.

    Returns:
        ``[rows]`` int64 on ``logits.device``: the argmax at greedy rows, the coupled
        sample at sampled rows. No host synchronisation.
    """
    if argmax is None:
        argmax = logits.argmax(dim=-1)  # [rows]
    if not sampling:
        return argmax
    dev, vocab = logits.device, logits.shape[-1]
    (rows, keys, positions, drafts, top_k), (temperature, top_p) = _to_device(
        [sampling.rows, sampling.keys, sampling.positions, sampling.drafts, sampling.top_k],
        [sampling.temperature, sampling.top_p], dev)  # [S] each
    use_kernel = _use_kernel(dev, kernel)
    limited = [i for i, (k, p) in enumerate(zip(sampling.top_k, sampling.top_p)) if 0 < k < vocab or p < 1.0]
    cutoffs = None
    if limited and use_kernel:  # every row's cutoff in one sort-free kernel (rows without limits cost a load)
        cutoffs = _kernel_module().row_cutoffs(logits, rows, temperature, top_k, top_p, argmax)
    elif limited:  # cutoffs from the rows that ask for a limit (host-known: no synchronisation)
        if len(limited) == len(sampling):
            cutoffs = row_cutoffs(_scaled(logits, rows, temperature), sampling.top_k, sampling.top_p)
        else:
            sel = _to_device([limited], [], dev)[0][0]  # [L]
            sub = row_cutoffs(_scaled(logits, rows.index_select(0, sel), temperature.index_select(0, sel)),
                              [sampling.top_k[i] for i in limited], [sampling.top_p[i] for i in limited])
            cutoffs = (torch.full((len(sampling),), float("-inf"), device=dev).index_copy_(0, sel, sub[0]),
                       torch.full((len(sampling),), vocab, dtype=torch.int32, device=dev).index_copy_(0, sel, sub[1]))
    if use_kernel:
        tokens, _ = _kernel_module().sample_tokens(logits, rows, temperature, keys, positions, _STREAM_SAMPLE, cutoffs)
        z = None
    else:
        z = _scaled(logits, rows, temperature)  # [S, vocab]
        if cutoffs is not None:
            z = apply_cutoffs(z, cutoffs)
        tokens = (z + gumbel_noise(keys, positions, vocab)).argmax(dim=-1)  # [S]
    if sampling.draft_probs:
        sel = _to_device([[first + i for first, q in sampling.draft_probs for i in range(q.shape[0])]], [],
                         dev)[0][0]  # [Q]
        if z is not None:
            zq = z.index_select(0, sel)
        else:
            zq = _scaled(logits, rows.index_select(0, sel), temperature.index_select(0, sel))
            if cutoffs is not None:
                zq = apply_cutoffs(zq, (cutoffs[0].index_select(0, sel), cutoffs[1].index_select(0, sel)))
        tokens = _rejection_rows(zq, sel, tokens, sampling, keys, positions, drafts)
    return argmax.index_copy(0, rows, tokens)


def warm_up(vocab: int, device: torch.device | str) -> bool:
    """Compile the sampling kernels :func:`sample_rows` launches on ``device`` (the cutoff search,
    the Gumbel-max pass with and without cutoffs, the split reduction) on two dummy rows of fp32
    logits, so that the first sampled step does not pay for their compilation (seconds).

    Returns:
        whether anything ran (``False`` where sample_rows takes the torch path: off CUDA, no Triton).
    """
    from specdec.config import SamplingParams

    device = torch.device(device)
    if not _use_kernel(device, None):
        return False
    logits = torch.zeros(4, vocab, dtype=torch.float32, device=device)
    rows = RowSampling()
    rows.add(0, SamplingParams(temperature=1.0, top_p=0.9), request_key(0), 0, None)  # the masked variant
    rows.add(2, SamplingParams(temperature=1.0), request_key(1), 0, None)
    sample_rows(logits, None, rows)
    unmasked = RowSampling()
    unmasked.add(1, SamplingParams(temperature=1.0), request_key(2), 0, None)
    sample_rows(logits, None, unmasked)
    return True


def _scaled(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``[S, vocab]`` fp32 ``logits[rows] / temperature``."""
    return logits.index_select(0, rows).float() / temperature[:, None]


def _rejection_rows(zq: torch.Tensor, sel: torch.Tensor, tokens: torch.Tensor, sampling: RowSampling,
                    keys: torch.Tensor, positions: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """Rejection sampling at the draft rows of requests whose drafts carry ``q``: the row's
    token becomes the draft if accepted, else a recovered token (never the draft).

    Args:
        zq: ``[Q, vocab]`` shaped log-weights of those rows; sel: ``[Q]`` their indices among
        the sampled rows; tokens: ``[S]`` Gumbel-max samples; keys, positions, drafts: ``[S]`` int64.
    """
    dev, vocab = zq.device, zq.shape[-1]
    q = torch.cat([q.to(dev, torch.float32) for _, q in sampling.draft_probs])  # [Q, vocab]
    p = zq.softmax(dim=-1)  # [Q, vocab]
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
        ValueError: the lengths disagree.
    """
    if not len(drafts) == len(params) == len(seeds) == len(positions):
        raise ValueError(f"drafts, params, seeds and positions must have one entry per request, got "
                         f"{len(drafts)}, {len(params)}, {len(seeds)}, {len(positions)}")
    total = sum(len(d) + 1 for d in drafts)
    if logits.dim() != 2 or logits.shape[0] != total:
        raise ValueError(f"logits must be [sum(len(draft) + 1), vocab] = [{total}, vocab], got {list(logits.shape)}")
    sampling, starts, row = RowSampling(), [], 0
    for d, p, seed, pos in zip(drafts, params, seeds, positions):
        if not p.greedy:
            sampling.add(row, p, request_key(seed), pos, d)
        starts.append(row)
        row += len(d) + 1
    tokens = sample_rows(logits, None, sampling).tolist()  # the one synchronisation
    return verify_chains(tokens, starts, drafts)
