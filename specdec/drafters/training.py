"""Train a block drafter (DFlash or DSpark) by self-distillation from its target.

Data: :class:`~specdec.drafters.data.TokenData`, token ids of prompts no evaluation uses and the
target's own responses (``python -m specdec.drafters.data``). The target's hidden states are
computed on the fly by the target's own forward (:func:`target_features`), one packed context
pass per batch; the target stays frozen.

One step (:func:`block_loss`), for ``S`` sequences and ``A`` anchors each, all in one pass:

- anchors are drawn uniformly in each response (:func:`anchors_from_uniform`); a block is
  ``[anchor token, mask, ..., mask]`` at positions ``anchor .. anchor + B - 1``; it sees the
  context strictly before its anchor and every slot of its own block, nothing else
  (:func:`anchor_block_mask`): the ``A * B`` slots of a sequence run as one query set over the
  sequence's context keys, so the context K/V are computed once per sequence, not per anchor;
- the loss mix, weighted per drafting slot ``j`` by ``exp(-j / decay)``: cross-entropy to the
  data's next tokens; for DSpark, also the total variation distance to the target's own
  distribution at that position, and the confidence head's binary cross-entropy against
  "the drafted token is the target's" (:attr:`TrainConfig.tv_weight`, ``confidence_weight``);
  logits are made and reduced in chunks of rows (recomputed in the backward pass).
- with ``TrainConfig.greedy_labels`` the labels are the target's own greedy continuation
  (:func:`greedy_block_labels`): a slot past a data token the target would not have chosen (in a
  sampled response) is unlabelled, since a greedy engine never verifies a draft there.

Schedule (:func:`lr_factor`): the number of steps is fixed first (a time budget is converted into
steps by timing a few forward/backward passes); warm-up over ``warmup_frac`` of them, then cosine
to ``min_lr_frac`` of the peak. AdamW with gradient clipping, bf16 autocast on CUDA. The training
code reads nothing back from the GPU within a step: index vectors built on the host go over pinned
memory, unlabelled slot rows are weighted 0 rather than selected out, and losses are read back in
bulk (at validations). With ``TrainConfig.compile_loss`` the loss's passes over the vocabulary run
through ``torch.compile``.

Validation: simulated mean accepted length (tau) on held-out greedy sequences, with the engine's
acceptance rule (drafts accepted while they equal the target's greedy tokens, plus the bonus
token), every ``val_every`` steps; the best checkpoint is kept. A run saves its state
(``train_state.json`` beside the weights: step, planned steps, schedule, histories) and
resumes from it on the same learning-rate curve (AdamW moments restart).
"""

from __future__ import annotations

import copy
import json
import math
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from specdec.drafters.block import draft_from_hidden, init_weights, label_offsets, output_slots, slot_logits
from specdec.drafters.data import SOURCES, TokenData
from specdec.errors import CheckpointError, ConfigError
from specdec.layers import rope_cos_sin


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Training hyper-parameters.

    Attributes:
        steps: planned optimizer steps (the schedule's length).
        seqs_per_step: sequences per batch (``S``).
        anchors_per_seq: anchors (blocks) per sequence (``A``).
        lr: peak AdamW learning rate.
        warmup_frac: share of the planned steps spent warming up linearly.
        min_lr_frac: the cosine ends at this share of ``lr``.
        weight_decay: AdamW weight decay.
        decay: loss weight of drafting slot ``j`` (0-based) is ``exp(-j / decay)``.
        tv_weight: weight of the total-variation loss against the target's distribution.
        confidence_weight: weight of the confidence head's loss (nets with a confidence head).
        max_len: sequences are cut to their first ``max_len`` tokens.
        max_seconds: if set, ``steps`` becomes what fits this budget (timed before the schedule
            is built; validation time included).
        val_every: validate every this many steps (and at the end); 0 = only at the end.
        val_anchors: anchors per validation sequence.
        seed: RNG seed (init, batches, anchors).
        compile_loss: run the loss's passes over the vocabulary through ``torch.compile``
            (:func:`block_loss`'s ``compile_terms``): fewer, fused kernels on the GPU, a compile
            (seconds to a minute) first; the same loss up to floating-point reassociation.
        greedy_labels: label each slot with the target's own greedy token after the data's prefix
            (:func:`greedy_block_labels`), and none past a data token the target would not have
            chosen: a sampled response keeps its contexts but teaches only the greedy drafts the
            engine verifies (its sampled tokens are the target's argmax about 63 % of the time
            for SmolLM2-135M at temperature 0.7-1.0). Greedy data is hardly changed.
    """

    steps: int = 1000
    seqs_per_step: int = 16
    anchors_per_seq: int = 32
    lr: float = 6e-4
    warmup_frac: float = 0.04
    min_lr_frac: float = 0.1
    weight_decay: float = 0.01
    decay: float = 4.0
    tv_weight: float = 0.0
    confidence_weight: float = 0.0
    max_len: int = 1024
    max_seconds: float | None = None
    val_every: int = 200
    val_anchors: int = 16
    seed: int = 0
    compile_loss: bool = False
    greedy_labels: bool = False

    def __post_init__(self) -> None:
        for name in ("steps", "seqs_per_step", "anchors_per_seq", "max_len", "val_anchors"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if not isinstance(self.val_every, int) or self.val_every < 0:
            raise ConfigError(f"val_every must be an integer >= 0, got {self.val_every!r}")
        if not self.lr > 0 or not self.decay > 0:
            raise ConfigError(f"lr and decay must be > 0, got {self.lr}, {self.decay}")
        if not 0 <= self.warmup_frac < 1 or not 0 <= self.min_lr_frac <= 1:
            raise ConfigError(f"warmup_frac must be in [0, 1) and min_lr_frac in [0, 1], "
                              f"got {self.warmup_frac}, {self.min_lr_frac}")
        if self.tv_weight < 0 or self.confidence_weight < 0 or self.weight_decay < 0:
            raise ConfigError("tv_weight, confidence_weight and weight_decay must be >= 0")
        for name in ("compile_loss", "greedy_labels"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise ConfigError(f"max_seconds must be > 0 or None, got {self.max_seconds!r}")


def lr_factor(step: int, planned: int, warmup_frac: float, min_lr_frac: float) -> float:
    """Share of the peak learning rate at ``step`` (0-based) of ``planned`` steps: linear warm-up
    over ``ceil(warmup_frac * planned)`` steps, then cosine from 1 to ``min_lr_frac`` at the last step."""
    warm = math.ceil(warmup_frac * planned)
    if step < warm:
        return (step + 1) / warm
    span = max(1, planned - 1 - warm)
    t = min(1.0, (step - warm) / span)
    return min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t))


# -- batches ----------------------------------------------------------------------------------------
@dataclass
class FeatureBatch:
    """``S`` sequences, padded to ``L`` positions, with the target's features.

    Attributes:
        tokens: ``[S, L]`` int64 ids (0 past each length).
        lengths: ``[S]`` int64.
        prompt_lens: ``[S]`` int64.
        feats: ``[S, L, len(layer_ids) * hidden]`` target hidden states of the tapped layers.
        final: ``[S, L, hidden]`` the target's last hidden state (before its final norm), or ``None``.
        num_tokens: the sum of ``lengths``, known on the host (``None`` if not given).
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    prompt_lens: torch.Tensor
    feats: torch.Tensor
    final: torch.Tensor | None = None
    num_tokens: int | None = None


def to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """A host tensor on ``dev`` without waiting for the GPU: through pinned memory, non-blocking, on
    CUDA (a copy from pageable memory first waits for every kernel queued before it)."""
    if dev.type == "cuda":
        return t.pin_memory().to(dev, non_blocking=True)
    return t.to(dev)


@torch.no_grad()
def target_features(target, seqs: list[list[int]], prompt_lens: list[int], layer_ids, pad_to: int = 64,
                    with_final: bool = True) -> FeatureBatch:
    """Run the target once over ``seqs`` (one packed context step over a scratch KV pool) and
    return their tapped hidden states, padded to a multiple of ``pad_to`` positions."""
    from specdec.attention.metadata import plan_step
    from specdec.kvcache import KVCacheManager, KVPool

    tpb, dev = 16, target.device
    pages = sum(-(-len(s) // tpb) for s in seqs)
    pool, mgr = KVPool(target.layer_specs(), pages, tpb, device=dev), KVCacheManager(pages, tpb)
    S, L = len(seqs), -(-max(len(s) for s in seqs) // pad_to) * pad_to
    ctx, slots, pos, ids, dest = [], [], [], [], []
    for i, s in enumerate(seqs):
        mgr.allocate(i, len(s))
        slots += mgr.slots(i, 0, len(s))
        ctx.append((len(s), len(s), tuple(mgr.page_table(i))))
        pos += range(len(s))
        ids += s
        dest += range(i * L, i * L + len(s))  # where each packed token sits in the padded [S * L]
    # host-built index vectors go over pinned and non-blocking, and the padded tensors are filled by
    # index (not by a boolean mask, which would read its count back): the step never waits for the GPU
    slots_d, ids_d, pos_d, dest_d, lengths, plens = (
        to_device(torch.tensor(v, dtype=torch.long), dev)
        for v in (slots, ids, pos, dest, [len(s) for s in seqs], prompt_lens))
    attn = plan_step(ctx, [], slots_d, lambda p, q, m: target.attn_shape(p, q, tpb, m), tpb)
    final, cap = target.forward(ids_d, pos_d, attn, pool, hidden_layer_ids=tuple(layer_ids))
    packed = torch.cat([cap[i] for i in layer_ids], -1)  # [T, F]
    feats = packed.new_zeros(S * L, packed.shape[-1]).index_copy_(0, dest_d, packed).view(S, L, -1)
    tokens = torch.zeros(S * L, dtype=torch.long, device=dev).index_copy_(0, dest_d, ids_d).view(S, L)
    fin = None
    if with_final:
        fin = final.new_zeros(S * L, final.shape[-1]).index_copy_(0, dest_d, final).view(S, L, -1)
    return FeatureBatch(tokens, lengths, plens, feats, fin, len(ids))


def target_hidden_states(target, ids: list[int], layer_ids) -> torch.Tensor:
    """Hidden states of ``layer_ids`` over one sequence ``ids``: ``[len(ids), len(layer_ids) * hidden]``."""
    return target_features(target, [list(ids)], [0], layer_ids, pad_to=1, with_final=False).feats[0]


def anchors_from_uniform(lo: torch.Tensor, hi: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Anchors ``[S, A]`` uniform in ``[lo, hi]`` (inclusive, per sequence) from uniforms ``u`` ``[S, A]``
    in ``[0, 1)``; a sequence with ``hi < lo`` gets ``-1`` (no anchor)."""
    span = (hi - lo + 1).clamp(min=0)[:, None]
    a = lo[:, None] + (u * span).floor().long().clamp(max=(span - 1).clamp(min=0))
    return torch.where(span > 0, a, torch.full_like(a, -1))


def anchor_range(prompt_lens: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where anchors may sit: from the first response position (the first token the engine drafts
    after; at least 1, so that there is context) to the second-to-last position (one label)."""
    return prompt_lens.clamp(min=1), lengths - 2


def block_labels(tokens: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """The token each drafting slot predicts: ``tokens[s, anchor + offset]``, ``-100`` past the
    sequence (or for a missing anchor). Shapes: ``[S, L]``, ``[S]``, ``[S, A]`` → ``[S, A, W]``."""
    off = to_device(torch.tensor(offsets, dtype=torch.long), tokens.device)
    pos = anchors[..., None] + off  # [S, A, W]
    ok = (anchors[..., None] >= 0) & (pos < lengths[:, None, None])
    lab = tokens.gather(1, pos.clamp(0, tokens.shape[1] - 1).flatten(1)).view_as(pos)
    return torch.where(ok, lab, torch.full_like(lab, -100))


@torch.no_grad()
def greedy_block_labels(labels: torch.Tensor, final: torch.Tensor, anchors: torch.Tensor, offsets: list[int],
                        target_logits: Callable[[torch.Tensor], torch.Tensor], chunk_rows: int = 2048) -> torch.Tensor:
    """The slots' labels (:func:`block_labels`, ``[S, A, W]``, ``-100``: none) made the target's
    greedy continuation: slot ``j`` is labelled with the argmax of the target's logits at the
    position before its token (``anchor + offsets[j] - 1``, from ``final`` ``[S, L, hidden]``, its
    final hidden states) if every data token of the block before it is that position's own argmax
    (the data is on the greedy path up to the slot), else ``-100``. What a greedy engine verifies:
    the drafts after an anchor are compared with the target's argmax along its greedy continuation.
    """
    S, A, W = labels.shape
    if list(offsets) != list(range(1, W + 1)):
        raise ValueError(f"greedy_block_labels needs the slots to label the tokens after the anchor in turn, got {offsets}")
    pos = anchors.clamp(min=0)[..., None] + to_device(torch.arange(W, dtype=torch.long), final.device)  # [S, A, W]
    rows = final.gather(1, pos.clamp(max=final.shape[1] - 1).flatten(1)[..., None]
                        .expand(-1, -1, final.shape[-1])).flatten(0, 1)  # [S * A * W, hidden]
    greedy = torch.cat([target_logits(rows[a:a + chunk_rows]).argmax(-1)
                        for a in range(0, rows.shape[0], chunk_rows)]).view(S, A, W)
    on_path = labels == greedy  # [S, A, W]; an unlabelled slot (-100) never is
    before = torch.cat([on_path.new_ones(S, A, 1), on_path[..., :-1]], -1).int().cumprod(-1).bool()
    return torch.where(before & (labels != -100), greedy, torch.full_like(labels, -100))


def anchor_block_mask(anchors: torch.Tensor, block_size: int, ctx_len: int) -> torch.Tensor:
    """Attention mask of ``A`` blocks of one sequence run as ``A * B`` queries over ``[context ;
    all blocks]``: ``[S, A]`` → ``[S, 1, A * B, ctx_len + A * B]``, True = attend. A slot sees the
    context strictly before its block's anchor and every slot of its own block."""
    S, A = anchors.shape
    dev = anchors.device
    q_anchor = anchors.repeat_interleave(block_size, 1)  # [S, A*B]
    ctx = torch.arange(ctx_len, device=dev)[None, None, :] < q_anchor[..., None]  # [S, A*B, Lc]
    blk = torch.arange(A, device=dev).repeat_interleave(block_size)
    own = (blk[:, None] == blk[None, :]).expand(S, -1, -1)  # [S, A*B, A*B]
    return torch.cat([ctx, own], -1)[:, None]


# -- the loss -----------------------------------------------------------------------------------------
def block_hidden(net, embed: torch.Tensor, batch: FeatureBatch, anchors: torch.Tensor) -> torch.Tensor:
    """Every block of every anchor through the network in one pass: ``[S, A, B, hidden]``."""
    c = net.config
    S, A = anchors.shape
    B = c.block_size
    ctx = net.project_context(batch.feats)  # [S, L, hidden]
    L = ctx.shape[1]
    pos_ctx = torch.arange(L, device=ctx.device).expand(S, -1)
    ctx_kv = [net.context_kv(i, ctx, pos_ctx) for i in range(c.num_layers)]
    safe = anchors.clamp(min=0)
    first = batch.tokens.gather(1, safe)  # [S, A] anchor tokens
    ids = torch.full((S, A, B), c.mask_token_id, dtype=torch.long, device=ctx.device)
    ids[:, :, 0] = first
    pos = safe[..., None] + torch.arange(B, device=ctx.device)  # [S, A, B]
    rope = rope_cos_sin(pos.flatten(1), net.rope_dim, c.rope_theta, ctx.device)
    mask = anchor_block_mask(anchors, B, L)
    # not cuDNN: it plans anew for every key count (44-763 ms each on the H200), and L varies by batch
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        h = net.run_block(embed[ids.flatten(1)].to(ctx.dtype), rope, ctx_kv, mask)  # [S, A*B, hidden]
    return h.view(S, A, B, -1)


def chunk_terms(net, hc: torch.Tensor, lab: torch.Tensor, pv: torch.Tensor, wc: torch.Tensor,
                fin: torch.Tensor | None, lm_head: torch.Tensor, embed: torch.Tensor,
                target_logits: Callable[[torch.Tensor], torch.Tensor] | None, use_conf: bool) -> torch.Tensor:
    """The loss sums of one chunk of ``n`` slot rows: ``[4]`` = weighted cross-entropy, weighted
    total variation to the target (0 without ``fin``), weighted confidence BCE (0 unless
    ``use_conf``), and the number of rows whose greedy draft is right. A row labelled ``-100``
    (no label) has weight 0: it adds nothing and is never right.

    Shapes: ``hc`` ``[n, hidden]`` slot states, ``lab`` / ``pv`` ``[n]`` labels and the tokens before
    them, ``wc`` ``[n]`` slot weights, ``fin`` ``[n, hidden]`` the target's final hidden states at
    the label positions (or ``None``)."""
    logits = slot_logits(net, hc, pv, lm_head, embed).float()  # [n, vocab]
    ce = F.cross_entropy(logits, lab, reduction="none")
    hit = (logits.argmax(-1) == lab).float()
    tv = torch.zeros((), device=hc.device)
    if fin is not None and target_logits is not None:
        p = torch.softmax(target_logits(fin).float(), -1)
        tv = (0.5 * (torch.softmax(logits, -1) - p).abs().sum(-1) * wc).sum()
    conf = torch.zeros((), device=hc.device)
    if use_conf:
        conf = (F.binary_cross_entropy_with_logits(net.confidence_logit(hc, logits.detach()).float(), hit,
                                                   reduction="none") * wc).sum()
    return torch.stack([(ce * wc).sum(), tv, conf, hit.sum()])


_COMPILED_TERMS: list = []  # the compiled chunk_terms, once built
_COMPILE_FAILED: list[str] = []  # why compiling failed, if it did: the eager terms from then on
_COMPILE_PROBED: list[bool] = []  # non-empty once a compiled forward and backward have run


def _probe_backward(terms, args) -> None:
    """One forward and backward of the compiled ``terms`` on a chunk's ``args``, untracked by the
    caller: torch compiles the backward only when it first runs, and a failure there should fall
    back to the eager terms like a failure in the forward, not break ``loss.backward()``."""
    hc = args[1].detach().requires_grad_()  # a leaf: the probe's backward stays inside the terms
    out = terms(args[0], hc, *args[2:])
    torch.autograd.grad(out.sum(), [hc, *(p for p in args[0].parameters() if p.requires_grad)], allow_unused=True)
    _COMPILE_PROBED.append(True)


def _compiled_chunk_terms():
    """:func:`chunk_terms` through ``torch.compile`` (built once; row counts vary, so dynamic), or
    the eager :func:`chunk_terms` after a failed compile."""
    if _COMPILE_FAILED:
        return chunk_terms
    if not _COMPILED_TERMS:
        _COMPILED_TERMS.append(torch.compile(chunk_terms, dynamic=True))
    return _COMPILED_TERMS[0]


METRICS = ("ce", "tv", "conf", "acc")
"""The metrics :func:`block_loss` returns, in order."""


def block_loss(net, embed: torch.Tensor, lm_head: torch.Tensor, batch: FeatureBatch, anchors: torch.Tensor,
               tc: TrainConfig, target_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
               chunk_rows: int = 2048, compile_terms: bool = False,
               metrics_on_device: bool = False) -> tuple[torch.Tensor, dict]:
    """The weighted loss of the blocks at ``anchors`` ``[S, A]`` (``-1``: none) over ``batch``.

    Args:
        target_logits: the target's logits of its final hidden states (``target.compute_logits``);
            needed for the total-variation term (``tc.tv_weight > 0``) and ``tc.greedy_labels``.
        chunk_rows: logits are made ``chunk_rows`` rows at a time and recomputed in backward.
        compile_terms: run each chunk's terms (:func:`chunk_terms`) through ``torch.compile``, which
            fuses the passes over ``[rows, vocab]`` (casts, softmaxes, reductions) into fewer kernels;
            the same sums up to floating-point reassociation.
        metrics_on_device: the metrics as 0-dim tensors on the device (no transfer: the training
            loop reads them later), not floats.

    Returns:
        ``(loss, metrics)``; metrics (:data:`METRICS`): ``ce``, ``tv``, ``conf`` (per weighted slot),
        ``acc`` (share of labelled slots whose greedy draft is right).
    """
    c = net.config
    offsets = label_offsets(c.block_size, c.shift_label)
    slots = list(output_slots(c.block_size, c.shift_label))
    W = len(slots)
    h = block_hidden(net, embed, batch, anchors)[:, :, slots]  # [S, A, W, hidden]
    labels = block_labels(batch.tokens, batch.lengths, anchors, offsets)  # [S, A, W]
    if tc.greedy_labels:
        if target_logits is None or batch.final is None:
            raise ConfigError("greedy_labels needs the target's final hidden states (with_final) and target_logits")
        labels = greedy_block_labels(labels, batch.final, anchors, offsets, target_logits)
    prev_pos = anchors.clamp(min=0)[..., None] + to_device(torch.tensor(offsets, dtype=torch.long), h.device) - 1
    prev = batch.tokens.gather(1, prev_pos.clamp(max=batch.tokens.shape[1] - 1).flatten(1)).view_as(prev_pos)
    keep = labels != -100  # [S, A, W]
    w = torch.exp(-torch.arange(W, device=h.device, dtype=torch.float32) / tc.decay) * keep  # [S, A, W]
    # every slot row, the unlabelled ones with weight 0 and label -100 (no cross-entropy, never a hit):
    # selecting the labelled rows instead would read their count back from the GPU
    rows_h, rows_lab, rows_prev, rows_w = h.flatten(0, 2), labels.flatten(), prev.flatten(), w.flatten()
    use_tv = tc.tv_weight > 0 and target_logits is not None and batch.final is not None
    use_conf = tc.confidence_weight > 0 and getattr(net, "confidence", None) is not None
    rows_fin = batch.final.gather(1, prev_pos.clamp(max=batch.tokens.shape[1] - 1).flatten(1)[..., None]
                                  .expand(-1, -1, batch.final.shape[-1])).flatten(0, 1) if use_tv else None

    terms = _compiled_chunk_terms() if compile_terms else chunk_terms
    n = rows_h.shape[0]
    totals = torch.zeros(4, device=h.device)
    for a in range(0, n, chunk_rows):
        sl = slice(a, a + chunk_rows)
        args = (net, rows_h[sl], rows_lab[sl], rows_prev[sl], rows_w[sl], None if rows_fin is None else rows_fin[sl],
                lm_head, embed, target_logits if use_tv else None, use_conf)
        run = (lambda f: checkpoint(f, *args, use_reentrant=False)) if torch.is_grad_enabled() else (lambda f: f(*args))
        try:
            if terms is not chunk_terms and not _COMPILE_PROBED and torch.is_grad_enabled():
                _probe_backward(terms, args)  # the backward compiles lazily: fail here, not in loss.backward()
            part = run(terms)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - a compiler failure: warn once, then the eager terms
            if terms is chunk_terms:
                raise
            _COMPILE_FAILED.append(f"{type(e).__name__}: {e}")
            warnings.warn(f"compile_loss: torch.compile failed ({_COMPILE_FAILED[-1][:300]}); "
                          "the loss runs eagerly from now on", RuntimeWarning, stacklevel=2)
            terms = chunk_terms
            part = run(terms)
        totals = totals + part
    wsum = rows_w.sum().clamp(min=1e-6)
    ce, tv, conf = totals[0] / wsum, totals[1] / wsum, totals[2] / wsum
    loss = ce + (tc.tv_weight * tv if use_tv else 0) + (tc.confidence_weight * conf if use_conf else 0)
    stats = torch.stack([ce, tv, conf, totals[3] / keep.sum().clamp(min=1)]).detach()
    if metrics_on_device:
        return loss, dict(zip(METRICS, stats.unbind()))
    return loss, dict(zip(METRICS, stats.tolist()))  # one transfer


# -- validation -----------------------------------------------------------------------------------------
@torch.no_grad()
def simulated_tau(net, target, data: TokenData, tc: TrainConfig, seqs_per_batch: int = 16) -> dict[str, float]:
    """Mean accepted length on ``data`` (greedy sequences) with the engine's rule: each anchor's draft
    is accepted while it equals the data's next tokens (the target's greedy continuation), plus one
    bonus token; drafts are decoded as at inference (:func:`draft_from_hidden`).

    Returns:
        ``tau``, ``anchors``, ``tau_by_source`` and ``anchors_by_source`` (the mean and the anchors
        per prompt source of ``data``, e.g. code or math, for the sources it holds), and with a
        confidence head ``conf_ece`` (expected calibration error of the per-slot acceptance
        probabilities, 10 bins) and ``conf_mean`` / ``hit_mean``.
    """
    return simulated_taus([net], target, data, [tc], seqs_per_batch)[0]


class _TauCounts:
    """One network's validation tallies (:func:`simulated_taus`)."""

    def __init__(self, net, tc: TrainConfig):
        self.net, self.tc = net, tc
        self.offsets = label_offsets(net.config.block_size, net.config.shift_label)
        self.slots = list(output_slots(net.config.block_size, net.config.shift_label))
        self.g = torch.Generator(device="cpu").manual_seed(tc.seed + 1)
        self.taus, self.confs, self.hits, self.sources = [], [], [], []

    def add(self, target, batch: FeatureBatch, source: torch.Tensor) -> None:
        """Draft at fresh anchors of ``batch`` (whose sequences came from ``source`` ``[S]``)."""
        net, tc = self.net, self.tc
        batch = FeatureBatch(batch.tokens, batch.lengths, batch.prompt_lens, batch.feats.to(net.fc.weight.dtype))
        lo, hi = anchor_range(batch.prompt_lens, batch.lengths)
        u = torch.rand(len(lo), tc.val_anchors, generator=self.g).to(lo.device)
        anchors = anchors_from_uniform(lo, hi, u)
        with _autocast(target.device):
            h = block_hidden(net, target.embed, batch, anchors)[:, :, self.slots]  # [S, A, W, D]
            S, A, W, D = h.shape
            first = batch.tokens.gather(1, anchors.clamp(min=0))
            toks, conf = draft_from_hidden(net, h.reshape(S * A, W, D), first.flatten(), target.lm_head,
                                           target.embed, with_confidence=True)
        labels = block_labels(batch.tokens, batch.lengths, anchors, self.offsets).view(S * A, W)
        ok = anchors.flatten() >= 0
        run = _matched(toks, labels)
        self.taus.append((1 + run.sum(1))[ok].float().cpu())
        self.sources.append(source.repeat_interleave(tc.val_anchors)[ok.cpu()])
        if conf is not None:  # calibration of P(accept slot j | slots < j accepted)
            prior = torch.cat([torch.ones_like(run[:, :1]), run[:, :-1]], 1).bool() & (labels != -100)
            sel = prior & ok[:, None]
            self.confs.append(conf[sel].float().cpu())
            self.hits.append(run[sel].float().cpu())  # where every earlier slot matched, run is this slot's match

    def result(self) -> dict[str, float]:
        tau = torch.cat(self.taus) if self.taus else torch.zeros(0)
        out = {"tau": tau.mean().item() if len(tau) else float("nan"), "anchors": len(tau)}
        if self.taus:
            src = torch.cat(self.sources)
            kinds = sorted(set(src.tolist()))
            out["tau_by_source"] = {SOURCES[k]: tau[src == k].mean().item() for k in kinds}
            out["anchors_by_source"] = {SOURCES[k]: int((src == k).sum()) for k in kinds}
        if self.confs:
            cf, ht = torch.cat(self.confs), torch.cat(self.hits)
            bins = (cf * 10).clamp(max=9.999).long()
            ece = sum((cf[bins == b].mean() - ht[bins == b].mean()).abs().item() * (bins == b).sum().item()
                      for b in range(10) if (bins == b).any()) / max(1, len(cf))
            out.update(conf_ece=ece, conf_mean=cf.mean().item(), hit_mean=ht.mean().item())
        return out


def _matched(drafts: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[N, W]`` → 1 while every draft so far equals its label (``-100``: past the sequence, never)."""
    return ((drafts == labels) & (labels != -100)).long().cumprod(1)


@torch.no_grad()
def accepted_runs(net, target, prompt: list[int], output: list[int], chunk: int = 64) -> list[int]:
    """How many drafted tokens equal ``output``'s, at every response anchor: entry ``i`` is the
    run drafted after output token ``i`` (``i = 0 .. len(output) - 2``), from one target forward
    over ``prompt + output`` and one drafter pass per ``chunk`` anchors (as in training)."""
    seq, P = list(prompt) + list(output), len(prompt)
    c = net.config
    slots, offsets = list(output_slots(c.block_size, c.shift_label)), label_offsets(c.block_size, c.shift_label)
    batch = target_features(target, [seq], [P], c.target_layer_ids, with_final=False)
    batch = FeatureBatch(batch.tokens, batch.lengths, batch.prompt_lens, batch.feats.to(net.fc.weight.dtype))
    runs = []
    for start in range(P, len(seq) - 1, chunk):
        a = torch.arange(start, min(len(seq) - 1, start + chunk), device=batch.tokens.device)[None]
        with _autocast(target.device):
            h = block_hidden(net, target.embed, batch, a)[0][:, slots]
            drafts, _ = draft_from_hidden(net, h, batch.tokens[0, a[0]], target.lm_head, target.embed)
        runs += _matched(drafts, block_labels(batch.tokens, batch.lengths, a, offsets)[0]).sum(1).tolist()
    return runs


def walk_accepted_lengths(runs: list[int], n_output: int) -> list[int]:
    """The engine's greedy steps over an output of ``n_output`` tokens, full-width drafts: tokens
    per step (``k + 1``: the accepted drafts and the target's own token). The first output token
    comes from the prompt step, so the first anchor is output token 0; a step moves the anchor
    ``k + 1`` on, and a draft never reaches past the output's last token. ``runs`` from
    :func:`accepted_runs`. Its mean is the engine's τ on this output; the mean of ``1 + runs``
    (every anchor, validation's estimator) sits above it, as each walk anchor follows a miss."""
    steps, a = [], 0
    while a < n_output - 1:
        k = min(runs[a], n_output - 2 - a)
        steps.append(k + 1)
        a += k + 1
    return steps


@torch.no_grad()
def simulated_taus(nets, target, data: TokenData, tcs: list[TrainConfig], seqs_per_batch: int = 16) -> list[dict]:
    """:func:`simulated_tau` of several networks that read the same target layers, with one target
    forward per batch of ``data`` for all of them (each draws its anchors as it would alone, so
    each result equals its own :func:`simulated_tau`). The sequences are cut to the first config's
    ``max_len``."""
    counts = [_TauCounts(net, tc) for net, tc in zip(nets, tcs)]
    was_training = [net.training for net in nets]
    for net in nets:
        net.eval()
    layer_ids, max_len = nets[0].config.target_layer_ids, tcs[0].max_len
    for start in range(0, len(data), seqs_per_batch):
        idx = list(range(start, min(len(data), start + seqs_per_batch)))
        seqs = [data.sequence(i)[:max_len].tolist() for i in idx]
        batch = target_features(target, seqs, [int(data.prompt_lens[i]) for i in idx], layer_ids, with_final=False)
        for cnt in counts:
            cnt.add(target, batch, torch.as_tensor(data.source[idx]))
    for net, was in zip(nets, was_training):
        net.train(was)
    return [cnt.result() for cnt in counts]


def _autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


# -- the loop -----------------------------------------------------------------------------------------------
def _sample_batch(target, data: TokenData, order: list[int], cursor: int, tc: TrainConfig, layer_ids,
                  with_final: bool) -> FeatureBatch:
    idx = [order[(cursor + j) % len(order)] for j in range(tc.seqs_per_step)]
    seqs = [data.sequence(i)[: tc.max_len].tolist() for i in idx]
    return target_features(target, seqs, [int(data.prompt_lens[i]) for i in idx], layer_ids, with_final=with_final)


def _order(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n, generator=g).tolist()


def train_block_drafter(target, data: TokenData, net, tc: TrainConfig, val: TokenData | None = None,
                        out: str | Path | None = None, resume: str | Path | None = None, progress: bool = True,
                        log: Callable[[str], None] | None = None,
                        stop_after_seconds: float | None = None) -> tuple[object, dict]:
    """Train ``net`` (a block drafter network, freshly made or loaded) on ``data``.

    Args:
        data: training sequences; ``val``: held-out greedy sequences for simulated tau.
        out: folder for the best checkpoint (weights + ``training.json`` + ``train_state.json``);
            ``None`` keeps it in memory only.
        resume: a folder written by an earlier run (``out`` of it): weights, step, planned steps
            and histories are taken from it and training continues on the same curve.
        stop_after_seconds: stop (and save the state) after this much wall time, whatever the
            plan: a plan longer than one machine's lease runs over several resumed runs.

    Returns:
        ``(net, record)``: the best network by validation tau (the last one without ``val``) and the
        training record (the contents of ``training.json``).
    """
    return train_block_drafters(target, data, [TrainJob(net, tc, out, resume)], val=val, progress=progress, log=log,
                                stop_after_seconds=stop_after_seconds)[0]


@dataclass
class TrainJob:
    """One network of :func:`train_block_drafters`: its configuration, checkpoint folder and the
    folder of an earlier run to resume (see :func:`train_block_drafter`)."""

    net: object
    config: TrainConfig
    out: str | Path | None = None
    resume: str | Path | None = None
    name: str = ""


#: What networks trained side by side share: their batches (order, size, length) and their plan.
SHARED_SETTINGS = ("steps", "seqs_per_step", "max_len", "max_seconds", "val_every", "seed")


class _Run:
    """One network's part of the loop: its optimizer, anchor generator, record and best weights."""

    def __init__(self, job: TrainJob, dev: torch.device, data_len: int):
        self.job, self.tc, self.name = job, job.config, job.name
        self.state = _read_state(job.resume) if job.resume is not None else None
        net = job.net
        if self.state is not None:
            was = self.state["record"].get("train", {}).get("max_len", self.tc.max_len)
            if was != self.tc.max_len:
                raise ConfigError(f"{str(job.resume)!r} was trained on sequences cut at max_len={was}; resuming it "
                                  f"at max_len={self.tc.max_len} would change its plan (pass {was}, or start a new "
                                  f"plan from it with --init)")
            was = self.state["record"].get("train", {}).get("greedy_labels", False)
            if was != self.tc.greedy_labels:
                raise ConfigError(f"{str(job.resume)!r} was trained with greedy_labels={was}; resuming it with "
                                  f"greedy_labels={self.tc.greedy_labels} would change its loss mid-plan (resume "
                                  f"with the same setting, or start a new plan from it with --init)")
            net.load_state_dict(type(net).load(job.resume).state_dict())
        self.net = net.to(device=dev, dtype=torch.float32).train()
        decay, no_decay = [], []
        for _, p in self.net.named_parameters():
            (decay if p.dim() >= 2 else no_decay).append(p)
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": self.tc.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=self.tc.lr, betas=(0.9, 0.95))
        self.record = self.state["record"] if self.state else {
            "train": asdict(self.tc), "losses": [], "lr": [], "val": [], "tokens_seen": 0, "seconds": 0.0,
            "sequences": data_len}
        self.best = max((v["tau"] for v in self.record["val"]), default=-1.0)
        self.best_state = None
        self.gen: torch.Generator | None = None
        self.t_start = 0.0


def train_block_drafters(target, data: TokenData, jobs: list[TrainJob], val: TokenData | None = None,
                         progress: bool = True, log: Callable[[str], None] | None = None,
                         stop_after_seconds: float | None = None) -> list[tuple[object, dict]]:
    """Train several block drafter networks side by side (e.g. DFlash and DSpark): every step runs
    the target once over the batch and each network learns from the same hidden states, so a
    network costs its own forward and backward only. Each network's result equals training it
    alone (:func:`train_block_drafter`) with the same settings: its anchors come from its own
    generator, seeded as in a run of its own.

    The networks share :data:`SHARED_SETTINGS` of their :class:`TrainConfig` and the target layers
    they read; learning rate, anchors per sequence and the loss mix are each one's own. With
    ``max_seconds`` the plan is what fits the budget at the joint step's time. A new plan validates
    the starting weights at step 0: they are the best until a step beats them (so more training
    from trained weights never returns worse ones by validation tau). At every validation every
    network's state moves to that step (its folder keeps its best weights), so a run cut off
    anywhere resumes all of them from one step, each from its best weights. Resumed jobs must come
    from one joint run (the same step and plan); ``resume`` all of them or none.

    Returns:
        ``(net, record)`` per job, in order (see :func:`train_block_drafter`).

    Raises:
        ConfigError: no jobs, or jobs that differ in a shared setting or in their target layers,
            or resumed states that do not match.
        CheckpointError: a ``resume`` folder without a readable state.
    """
    log = log or (lambda s: None)
    if not jobs:
        raise ConfigError("train_block_drafters needs at least one TrainJob")
    dev = target.device
    first = jobs[0]
    layer_ids = tuple(first.net.config.target_layer_ids)
    for j in jobs[1:]:
        for name in SHARED_SETTINGS:
            if getattr(j.config, name) != getattr(first.config, name):
                raise ConfigError(f"networks trained side by side share their batches and plan: {name} is "
                                  f"{getattr(first.config, name)!r} for the first, {getattr(j.config, name)!r} for another")
        if tuple(j.net.config.target_layer_ids) != layer_ids:
            raise ConfigError(f"networks trained side by side read the same target layers: {layer_ids} and "
                              f"{tuple(j.net.config.target_layer_ids)}")
    tc0 = first.config
    torch.manual_seed(tc0.seed)
    runs = [_Run(j, dev, len(data)) for j in jobs]
    states = [r.state for r in runs]
    if any(s is not None for s in states) and any(s is None for s in states):
        raise ConfigError("resume every network trained side by side, or none")
    plan_keys = ("step", "planned", "epoch", "cursor")
    if states[0] is not None and any({k: s[k] for k in plan_keys} != {k: states[0][k] for k in plan_keys}
                                     for s in states):
        raise ConfigError("the resumed networks were not trained side by side: their steps or plans differ "
                          f"({[{k: s[k] for k in plan_keys} for s in states]})")
    state = states[0]
    embed, lm_head = target.embed.detach(), target.lm_head.detach()
    with_final = any(r.tc.tv_weight > 0 or r.tc.greedy_labels for r in runs)
    tlogits = target.compute_logits if with_final else None
    step = state["step"] if state else 0
    planned = state["planned"] if state else tc0.steps
    epoch, cursor = (state["epoch"], state["cursor"]) if state else (0, 0)
    order = _order(len(data), tc0.seed, epoch)
    for r in runs:
        r.gen = torch.Generator(device="cpu").manual_seed(r.tc.seed * 7919 + step)

    def one_step(update: bool) -> tuple[list[tuple[torch.Tensor, dict]], int]:
        """One batch through every network: per network (loss, metrics) as device tensors (read
        back later, in bulk), and the batch's token count."""
        nonlocal cursor, epoch, order
        batch = _sample_batch(target, data, order, cursor, tc0, layer_ids, with_final)
        cursor += tc0.seqs_per_step
        if cursor >= len(order):
            epoch, cursor = epoch + 1, 0
            order = _order(len(data), tc0.seed, epoch)
        lo, hi = anchor_range(batch.prompt_lens, batch.lengths)
        out = []
        for r in runs:
            u = torch.rand(len(lo), r.tc.anchors_per_seq, generator=r.gen)
            anchors = anchors_from_uniform(lo, hi, to_device(u, dev))
            with _autocast(dev):
                loss, m = block_loss(r.net, embed, lm_head, batch, anchors, r.tc, tlogits,
                                     compile_terms=r.tc.compile_loss, metrics_on_device=True)
            r.opt.zero_grad(set_to_none=True)
            loss.backward()
            if update:
                torch.nn.utils.clip_grad_norm_(r.net.parameters(), 1.0)
                r.opt.step()
            r.opt.zero_grad(set_to_none=True)
            out.append((loss.detach(), m))
        return out, batch.num_tokens

    if state is None and tc0.max_seconds:  # turn the time budget into planned steps, before any update
        snap = (cursor, epoch, order)
        for _ in range(5):
            one_step(False)  # warm-up: kernels, allocator, attention plans of the first shapes
        _sync(dev)
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            one_step(False)
            _sync(dev)
            times.append(time.perf_counter() - t0)
        per_step = sorted(times)[len(times) // 2]  # the median: a first-seen shape's one-off cost is not a step's
        val_s = 0.0
        if val is not None and len(val):
            t1 = time.perf_counter()
            simulated_taus([r.net for r in runs], target, val, [r.tc for r in runs])
            _sync(dev)
            val_s = time.perf_counter() - t1
        n_val = lambda n: (n // tc0.val_every if tc0.val_every else 0) + 2  # noqa: E731  (with step 0's)
        planned = tc0.steps
        while planned > 1 and planned * per_step + n_val(planned) * val_s > tc0.max_seconds:
            planned = int(planned * 0.97)
        cursor, epoch, order = snap
        log(f"time budget {tc0.max_seconds:.0f} s: {per_step * 1000:.0f} ms a step"
            f"{f' ({len(runs)} networks)' if len(runs) > 1 else ''}, {val_s:.1f} s a validation "
            f"-> {planned} planned steps")
    for r in runs:
        r.record["planned_steps"] = planned
        r.record["networks_per_batch"] = len(runs)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=planned, initial=step, desc="train drafter" + ("s" if len(runs) > 1 else ""), unit="step")
    pending: list[torch.Tensor] = []  # per step not yet read back: every network's (loss, acc)

    def flush() -> list[float] | None:
        """Read back the pending steps in one transfer, record their losses; the last step's values."""
        if not pending:
            return None
        rows = torch.stack(pending).tolist()  # [steps, 2 * networks]
        pending.clear()
        for row in rows:
            for j, r in enumerate(runs):
                r.record["losses"].append(round(row[2 * j], 5))
        return rows[-1]

    t_wall = time.perf_counter()
    for r in runs:
        r.t_start = t_wall - r.record["seconds"]
    if state is None and val is not None and len(val):  # a new plan starts from these weights: their tau
        taus = simulated_taus([r.net for r in runs], target, val, [r.tc for r in runs])  # is the bar to beat,
        for r, tau in zip(runs, taus):                    # and they are kept if no later step beats it
            _validated(r, {"step": 0, **tau})
            if r.job.out is not None:
                _save(r.net, r.job.out, r.record, 0, planned, epoch, cursor)
        for r in runs:
            log(f"{r.name + ': ' if r.name else ''}step 0/{planned}: val tau {r.best:.3f}")
    while step < planned:
        for r in runs:
            f = lr_factor(step, planned, r.tc.warmup_frac, r.tc.min_lr_frac)
            for gp in r.opt.param_groups:
                gp["lr"] = r.tc.lr * f
            r.record["lr"].append(r.tc.lr * f)
        results, toks = one_step(True)
        pending.append(torch.stack([t for loss, m in results for t in (loss, m["acc"])]))
        for r in runs:
            r.record["tokens_seen"] += toks
        step += 1
        last = step == planned
        validate = val is not None and len(val) and (last or (tc0.val_every and step % tc0.val_every == 0))
        if bar is not None:
            bar.update(1)
            if validate or step % 25 == 0:
                now = flush()
                bar.set_postfix(loss="/".join(f"{now[2 * j]:.3f}" for j in range(len(runs))),
                                acc="/".join(f"{now[2 * j + 1]:.2f}" for j in range(len(runs))))
        if validate:
            now = flush() or now
            taus = simulated_taus([r.net for r in runs], target, val, [r.tc for r in runs])
            improved = [_validated(r, {"step": step, **tau}) for r, tau in zip(runs, taus)]
            for r, better in zip(runs, improved):  # every state at this step before any log: one resume point
                if r.job.out is not None:         # (a folder keeps its best weights; the state moves on)
                    if better:
                        _save(r.net, r.job.out, r.record, step, planned, epoch, cursor)
                    else:
                        _write_state(Path(r.job.out), r.record, step, planned, epoch, cursor)
            for j, r in enumerate(runs):
                log(f"{r.name + ': ' if r.name else ''}step {step}/{planned}: loss {now[2 * j]:.3f}, "
                    f"val tau {r.record['val'][-1]['tau']:.3f} (best {r.best:.3f})")
        if stop_after_seconds is not None and time.perf_counter() - t_wall > stop_after_seconds:
            log(f"stopping at step {step} of {planned} after {stop_after_seconds:.0f} s: resume to continue")
            break
    flush()
    if bar is not None:
        bar.close()
    for r in runs:
        r.record["seconds"] = time.perf_counter() - r.t_start
        r.record["steps_run"] = step
        if r.best_state is not None:
            r.net.load_state_dict(r.best_state)
        elif r.state is not None and r.record["val"]:  # no better weights this time: the earlier best stays
            r.net.load_state_dict(type(r.net).load(r.job.resume).state_dict())
        if r.job.out is not None:
            _save(r.net, r.job.out, r.record, step, planned, epoch, cursor)
            plot_training(r.record, Path(r.job.out) / "training.png")
    return [(r.net.eval(), r.record) for r in runs]


def _validated(r: _Run, v: dict) -> bool:
    """Record validation ``v`` of ``r``'s network; True (its weights kept as the best) if it beats the best."""
    r.record["val"].append(v)
    if v["tau"] <= r.best:
        return False
    r.best, r.record["best"] = v["tau"], v
    r.best_state = {k: t.detach().clone() for k, t in r.net.state_dict().items()}
    r.record["seconds"] = time.perf_counter() - r.t_start
    r.record["steps_run"] = v["step"]
    return True


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _save(net, out, record, step, planned, epoch, cursor) -> None:
    """The weights in bf16 (a copy: the network in training keeps its fp32 weights) and the state."""
    out = Path(out)
    copy.deepcopy(net).to(torch.bfloat16).save(out)
    _write_state(out, record, step, planned, epoch, cursor)


def _write_state(out: Path, record, step, planned, epoch, cursor) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "training.json").write_text(json.dumps(record, indent=1))
    (out / "train_state.json").write_text(json.dumps({"step": step, "planned": planned, "epoch": epoch,
                                                      "cursor": cursor}, indent=1))


def _read_state(folder) -> dict:
    folder = Path(folder)
    try:
        st = json.loads((folder / "train_state.json").read_text())
        st["record"] = json.loads((folder / "training.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot resume from {str(folder)!r}: no readable train_state.json / training.json "
                              f"({e})") from None
    return st


def plot_training(record: dict, path: str | Path) -> Path | None:
    """A PNG of the loss (smoothed), the learning rate and the validation tau against the step
    (``None`` if matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    losses = record["losses"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    k = max(1, len(losses) // 100)
    sm = [sum(losses[i:i + k]) / len(losses[i:i + k]) for i in range(0, len(losses), k)]
    axes[0].plot([i + k for i in range(0, len(losses), k)], sm)
    axes[0].set(title="training loss", xlabel="step")
    axes[1].plot(range(1, len(record["lr"]) + 1), record["lr"])
    axes[1].set(title="learning rate", xlabel="step")
    if record["val"]:
        axes[2].plot([v["step"] for v in record["val"]], [v["tau"] for v in record["val"]], marker="o", label="all")
        names = sorted({n for v in record["val"] for n in v.get("tau_by_source", {})})
        for name in names if len(names) > 1 else ():
            pts = [(v["step"], v["tau_by_source"][name]) for v in record["val"] if name in v.get("tau_by_source", {})]
            axes[2].plot(*zip(*pts), linestyle="--", linewidth=1, label=name)
        if len(names) > 1:
            axes[2].legend(fontsize=7)
    axes[2].set(title="validation tau (simulated)", xlabel="step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return Path(path)


def new_net(config, target, seed: int = 0):
    """A freshly initialised network for ``config`` (GQA or MLA block drafter), its output norm
    started from the target's (the LM head expects that scale)."""
    from specdec.drafters.block import BlockDrafterNet
    from specdec.drafters.dspark_mla import MLABlockDrafterConfig, MLABlockDrafterNet

    net_cls = MLABlockDrafterNet if isinstance(config, MLABlockDrafterConfig) else BlockDrafterNet
    net = init_weights(net_cls(config), seed=seed)
    with torch.no_grad():
        if config.hidden_size == target.hidden_size and hasattr(target, "final_norm"):
            net.norm.weight.copy_(target.final_norm.float().cpu())
    return net


def distill_tokens(target, prompts, max_new_tokens: int = 256, batch_size: int = 64, progress: bool = False) -> TokenData:
    """The target's greedy responses to ``prompts`` as :class:`TokenData` (small runs and tests;
    the full recipe is ``python -m specdec.drafters.data``)."""
    from specdec import SamplingParams, SpecEngine

    engine = SpecEngine(target, None, max_num_seqs=batch_size)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens), progress=progress)
    return TokenData.from_lists([list(o.prompt_token_ids) + list(o.token_ids) for o in outs],
                                [len(o.prompt_token_ids) for o in outs], [0] * len(outs), [0.0] * len(outs))


#: The recipe's loss mix and heads of each kind (DFlash: the plain configuration of the same network).
KIND_SETTINGS = {
    "dflash": dict(shift_label=0, markov_rank=0, confidence_head=False, tv_weight=0.0, confidence_weight=0.0),
    "dspark": dict(shift_label=1, markov_rank=64, confidence_head=True, tv_weight=0.5, confidence_weight=0.2),
}


def main(argv: list[str] | None = None) -> int:
    """``python -m specdec.drafters.training`` (also ``specdec train-drafter``): train a drafter (or
    several kinds side by side, ``--kind dflash,dspark``) on data built by ``python -m
    specdec.drafters.data``, or resume a run."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="specdec train-drafter", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", required=True, nargs="+",
                   help="folder(s) written by python -m specdec.drafters.data (several: the parts of one set)")
    p.add_argument("--kind", default="dspark",
                   help=f"{' or '.join(sorted(KIND_SETTINGS))}, or several comma-separated (trained side by side, "
                        "one target forward a step; --out, --resume and --init then name a folder per kind with {kind})")
    p.add_argument("--out", required=True, help="checkpoint folder (best weights, training.json, training.png)")
    p.add_argument("--resume", default=None, help="a checkpoint folder of an earlier, unfinished run: continue its plan")
    p.add_argument("--init", default=None, help="start from this checkpoint's weights with a new plan (more training "
                                                "for a drafter whose plan is done)")
    p.add_argument("--stop-after", type=float, default=None,
                   help="stop (and save the state) after this many seconds, whatever the plan; --resume continues")
    p.add_argument("--grow-layers", type=int, default=None,
                   help="with --init: deepen the network to this many layers first, each new layer a copy of the last "
                        "with its output projections at zero (drafts as before at step 0; block.grow_layers)")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--num-layers", type=int, default=3, help="drafter decoder layers")
    p.add_argument("--intermediate-size", type=int, default=1024, help="drafter MLP width")
    p.add_argument("--num-target-layers", type=int, default=3, help="target layers tapped, spread over the depth")
    p.add_argument("--steps", type=int, default=4000, help="planned steps (cut to fit --max-seconds)")
    p.add_argument("--max-seconds", type=float, default=None)
    p.add_argument("--seqs-per-step", type=int, default=16)
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--max-len", type=int, default=None,
                   help="tokens of each sequence trained on, its first ones (long-document prompts need more); "
                        "default 1024, or with --resume the run's own")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--val-fraction", type=float, default=0.01)
    p.add_argument("--val-every", type=int, default=250)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--compile-loss", action="store_true",
                   help="fuse the loss's passes over the vocabulary with torch.compile (TrainConfig.compile_loss)")
    p.add_argument("--greedy-labels", action="store_true", default=None,
                   help="label each slot with the target's greedy token after the data's prefix, none past a data token "
                        "the target would not have chosen (sampled responses teach only greedy drafts); a resumed run "
                        "keeps its own setting")
    p.add_argument("--device", default="cuda")
    args = p.parse_args(argv)
    from specdec.drafters.block import BlockDrafterConfig, BlockDrafterNet, grow_layers, spread_layer_ids
    from specdec.target import load_target

    from specdec.target.loading import check_device

    kinds = [k.strip() for k in args.kind.split(",")]
    bad = [k for k in kinds if k not in KIND_SETTINGS]
    if bad or not kinds or len(set(kinds)) != len(kinds):
        p.error(f"--kind must be one or more distinct of {sorted(KIND_SETTINGS)}, comma-separated; got {args.kind!r}")
    if args.resume and args.init:
        p.error("--resume and --init exclude each other")
    if args.grow_layers is not None and not args.init:
        p.error("--grow-layers deepens the network of --init; give --init")
    for flag in ("out", "resume", "init"):
        if len(kinds) > 1 and getattr(args, flag) is not None and "{kind}" not in getattr(args, flag):
            p.error(f"--{flag} must name a folder per kind with {{kind}} (e.g. ckpt-{{kind}}) when several kinds train")
    folder = lambda path, kind: None if path is None else path.replace("{kind}", kind)  # noqa: E731
    check_device(args.device)  # typed errors before the model loads
    max_len = args.max_len
    if max_len is None:  # a resumed run keeps the cut it was planned with
        max_len = (_read_state(folder(args.resume, kinds[0]))["record"]["train"].get("max_len", 1024)
                   if args.resume else 1024)
    if max_len < 2:
        p.error(f"--max-len must be >= 2, got {max_len}")
    greedy_labels = args.greedy_labels  # a resumed run keeps the labels it was planned with
    if greedy_labels is None:
        greedy_labels = bool(args.resume and _read_state(folder(args.resume, kinds[0]))["record"]["train"]
                             .get("greedy_labels", False))
    data = TokenData.concat([TokenData.load(d) for d in args.data])
    target = load_target(args.target, dtype=getattr(torch, args.dtype), device=args.device)
    train, val = data.split(args.val_fraction, seed=args.seed)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    cut = int((train.prompt_lens >= max_len - 1).sum())
    if cut:
        log(f"{cut} of {len(train)} training sequences have no response token within --max-len {max_len}: "
            f"they train nothing")
    jobs = []
    for kind in kinds:
        k = KIND_SETTINGS[kind]
        tc = TrainConfig(steps=args.steps, seqs_per_step=args.seqs_per_step, anchors_per_seq=args.anchors, lr=args.lr,
                         tv_weight=k["tv_weight"], confidence_weight=k["confidence_weight"],
                         max_seconds=args.max_seconds, val_every=args.val_every, seed=args.seed,
                         compile_loss=args.compile_loss, max_len=max_len, greedy_labels=greedy_labels)
        start = folder(args.resume or args.init, kind)
        if start is not None:
            net = BlockDrafterNet.load(start)
            if net.config.shift_label != k["shift_label"]:
                p.error(f"{start} is not a {kind} drafter (shift_label {net.config.shift_label})")
            if args.grow_layers is not None:
                if args.grow_layers <= net.config.num_layers:
                    p.error(f"--grow-layers {args.grow_layers}: {start} already has {net.config.num_layers} layers")
                net = grow_layers(net, args.grow_layers)
        else:
            tcfg = target.config
            net = new_net(BlockDrafterConfig(
                block_size=args.block_size, shift_label=k["shift_label"],
                target_layer_ids=spread_layer_ids(target.num_layers, args.num_target_layers),
                target_hidden_size=target.hidden_size, vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                num_layers=args.num_layers, num_heads=tcfg.num_attention_heads, num_kv_heads=tcfg.num_key_value_heads,
                head_dim=tcfg.head_dim, intermediate_size=args.intermediate_size, rms_norm_eps=tcfg.rms_norm_eps,
                rope_theta=tcfg.rope_theta, markov_rank=k["markov_rank"], confidence_head=k["confidence_head"]),
                target, seed=args.seed)
        log(f"{kind}: {len(train)} training sequences, {len(val)} validation; "
            f"{sum(p.numel() for p in net.parameters()) / 1e6:.1f}M parameters")
        jobs.append(TrainJob(net, tc, folder(args.out, kind), folder(args.resume, kind), name=kind if len(kinds) > 1 else ""))
    results = train_block_drafters(target, train, jobs, val=val, progress=sys.stderr.isatty(), log=log,
                                   stop_after_seconds=args.stop_after)
    for kind, (net, record) in zip(kinds, results):
        print(json.dumps({"kind": kind, "steps_run": record["steps_run"], "planned_steps": record["planned_steps"],
                          "seconds": round(record["seconds"], 1), "best": record.get("best", {}),
                          "tokens_seen": record["tokens_seen"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
