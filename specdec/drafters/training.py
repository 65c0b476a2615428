"""Train a block drafter (DFlash or DSpark) by self-distillation from its target.

Data: the target's own greedy responses to training prompts (HumanEval 0-99
and prompts built from real text on the machine: standard-library code and
installed packages' descriptions; never HumanEval 100-163), generated with
:class:`~specdec.SpecEngine` (lossless, so a drafter only makes it faster).
Each sequence's target hidden states at ``target_layer_ids`` are recorded once.

Training: random anchors in the response; the block is ``[anchor, mask, ...]``,
its context the hidden states of every position before the anchor;
cross-entropy over the drafting slots (:func:`output_slots`) with weights
decaying with distance from the anchor. The target stays frozen.
"""

from __future__ import annotations

import math
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.drafters.block import BlockDrafterConfig, BlockDrafterNet, init_weights, label_offsets, output_slots
from specdec.errors import ConfigError


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """Training hyper-parameters.

    Attributes:
        steps: optimizer steps.
        seqs_per_step: sequences per batch.
        anchors_per_seq: random anchors (blocks) per sequence.
        lr: peak AdamW learning rate (linear warm-up, cosine decay).
        decay: loss weight of slot ``j`` (0-based drafting slot) is ``exp(-j / decay)``.
        seed: RNG seed.
        max_seconds: if set, ``steps`` is cut after 10 timed steps so training fits this budget.
    """

    steps: int = 1000
    seqs_per_step: int = 16
    anchors_per_seq: int = 32
    lr: float = 6e-4
    decay: float = 4.0
    seed: int = 0
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "seqs_per_step", "anchors_per_seq"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or not self.decay > 0:
            raise ConfigError(f"lr and decay must be > 0, got {self.lr}, {self.decay}")


def training_prompts(num_text_prompts: int = 400, seed: int = 0) -> list[str]:
    """HumanEval 0-99 plus prompts from real text on this machine (stdlib code, package descriptions)."""
    from importlib import metadata

    from specdec.prompts import DEV_SPLIT, humaneval_prompts

    rng = random.Random(seed)
    prompts = humaneval_prompts(DEV_SPLIT)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    texts = []
    for _ in range(num_text_prompts * 3 // 4):
        lines = rng.choice(files).read_text(errors="ignore").splitlines()
        if len(lines) < 40:
            continue
        start = rng.randrange(0, len(lines) - 30)
        chunk = "\n".join(lines[start:start + rng.randint(12, 30)])
        ask = rng.choice(["Explain what this Python code does.", "Continue this Python code.",
                          "Write a docstring for this code.", "Rewrite this code to be clearer."])
        texts.append(f"{ask}\n\n```python\n{chunk}\n```")
    descs = [d.metadata.get("Summary") or "" for d in metadata.distributions()]
    descs = [d for d in descs if len(d) > 20]
    for d in rng.sample(descs, min(len(descs), num_text_prompts - len(texts))):
        texts.append(rng.choice(["Explain in a paragraph what a Python package described as follows is for: ",
                                 "Write example Python code using a library described as: "]) + d)
    return prompts + texts


@dataclass
class DistillData:
    """Self-distillation data: token ids and target hidden states of each sequence."""

    tokens: list[torch.Tensor]  # each [L] long
    hidden: list[torch.Tensor]  # each [L, len(layer_ids) * hidden]
    prompt_lens: list[int]
    layer_ids: tuple[int, ...]

    def save(self, path: str | Path) -> None:
        torch.save({"tokens": self.tokens, "hidden": self.hidden, "prompt_lens": self.prompt_lens,
                    "layer_ids": self.layer_ids}, path)

    @classmethod
    def load(cls, path: str | Path) -> "DistillData":
        d = torch.load(path, weights_only=True)
        return cls(d["tokens"], d["hidden"], d["prompt_lens"], tuple(d["layer_ids"]))


@torch.inference_mode()
def build_distill_data(target, prompts, layer_ids, max_new_tokens: int = 256, batch_size: int = 64,
                       progress: bool = True) -> DistillData:
    """The target's greedy responses to ``prompts`` and its hidden states over prompt + response."""
    from specdec import SamplingParams, SpecEngine
    from specdec.drafters import SuffixAutomatonDrafter

    engine = SpecEngine(target, SuffixAutomatonDrafter(), max_num_seqs=batch_size)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens), progress=progress)
    data = DistillData([], [], [], tuple(layer_ids))
    it = outs
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(outs, desc="hidden states", unit="seq")
    for out in it:
        ids = list(out.prompt_token_ids) + list(out.token_ids)
        hidden = target_hidden_states(target, ids, layer_ids)
        data.tokens.append(torch.tensor(ids, device=hidden.device))
        data.hidden.append(hidden)
        data.prompt_lens.append(len(out.prompt_token_ids))
    return data


def target_hidden_states(target, ids: list[int], layer_ids) -> torch.Tensor:
    """Hidden states of ``layer_ids`` over ``ids`` (one context pass), ``[L, len(layer_ids) * hidden]``."""
    from specdec.attention.metadata import plan_step
    from specdec.kvcache import KVCacheManager, KVPool

    tpb = 16
    pages = -(-len(ids) // tpb)
    pool, mgr = KVPool(target.layer_specs(), pages, tpb, device=target.device), KVCacheManager(pages, tpb)
    mgr.allocate(0, len(ids))
    slots = torch.tensor(mgr.slots(0, 0, len(ids)), device=target.device)
    attn = plan_step([(len(ids), len(ids), tuple(mgr.page_table(0)))], [], slots,
                     lambda p, q, m: target.attn_shape(p, q, tpb, m), tpb)
    x = torch.tensor(ids, device=target.device)
    _, cap = target.forward(x, torch.arange(len(ids), device=target.device), attn, pool, hidden_layer_ids=layer_ids)
    return torch.cat([cap[i] for i in layer_ids], -1)


def block_loss(net: BlockDrafterNet, embed: torch.Tensor, lm_head: torch.Tensor, data: DistillData,
               seq_ids: list[int], rng: random.Random, cfg: TrainConfig) -> torch.Tensor:
    """Weighted cross-entropy of random anchor blocks from ``seq_ids``."""
    c = net.config
    B, dev = c.block_size, embed.device
    offsets = label_offsets(B, c.shift_label)
    slots = list(output_slots(B, c.shift_label))
    lmax = max(len(data.tokens[s]) for s in seq_ids)
    feats = torch.zeros(len(seq_ids), lmax, data.hidden[0].shape[1], device=dev, dtype=data.hidden[0].dtype)
    blocks, anchors, labels, owner = [], [], [], []
    for j, s in enumerate(seq_ids):
        toks, n = data.tokens[s], len(data.tokens[s])
        feats[j, :n] = data.hidden[s]
        lo = max(1, data.prompt_lens[s] - 1)
        for _ in range(cfg.anchors_per_seq):
            a = rng.randrange(lo, n - 1)
            lab = [int(toks[a + o]) if a + o < n else -100 for o in offsets]
            blocks.append([int(toks[a])] + [c.mask_token_id] * (B - 1))
            anchors.append(a)
            labels.append(lab)
            owner.append(j)
    owner_t = torch.tensor(owner, device=dev)
    anchor_t = torch.tensor(anchors, device=dev)
    ctx = net.project_context(feats)  # [S, Lmax, hidden]
    pos = torch.arange(lmax, device=dev)
    ctx_kv = []
    for i in range(c.num_layers):
        k, v = net.context_kv(i, ctx, pos.expand(len(seq_ids), -1))
        ctx_kv.append((k[owner_t], None if v is None else v[owner_t]))  # v None: K-only latent layers
    valid = pos[None, :] < anchor_t[:, None]  # block sees context strictly before its anchor
    ids = torch.tensor(blocks, device=dev)
    h = net.forward_block(embed[ids].to(ctx.dtype), anchor_t[:, None] + torch.arange(B, device=dev), ctx_kv, valid)
    logits = F.linear(h[:, slots], lm_head.to(h.dtype)).float()  # [N, width, vocab]
    lab = torch.tensor(labels, device=dev)
    w = torch.exp(-torch.arange(len(slots), device=dev, dtype=torch.float32) / cfg.decay)
    ce = F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=-100, reduction="none").view_as(lab.float())
    mask = (lab != -100).float() * w
    return (ce * mask).sum() / mask.sum()


def train_block_drafter(target, data: DistillData, config: BlockDrafterConfig, train: TrainConfig,
                        progress: bool = True, log_every: int = 50) -> tuple[BlockDrafterNet, list[float]]:
    """Train a block drafter on ``data`` with the target frozen; returns the network and the loss curve."""
    if tuple(config.target_layer_ids) != tuple(data.layer_ids):
        raise ConfigError(f"target_layer_ids {config.target_layer_ids} must equal the data's {data.layer_ids}")
    torch.manual_seed(train.seed)
    rng = random.Random(train.seed)
    net = init_weights(BlockDrafterNet(config), seed=train.seed)
    with torch.no_grad():  # start from the target's own output norm: the LM head expects its scale
        if config.hidden_size == target.hidden_size and hasattr(target, "final_norm"):
            net.norm.weight.copy_(target.final_norm.float().cpu())
    net = net.to(target.device).train()
    opt = torch.optim.AdamW(net.parameters(), lr=train.lr, weight_decay=0.01, betas=(0.9, 0.95))
    total = [train.steps]  # may shrink to fit max_seconds; the schedule follows it
    warm = max(1, train.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total[0]))))
    embed, lm_head = target.embed.detach(), target.lm_head.detach()
    amp = target.device.type == "cuda"
    losses = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=train.steps, desc=f"train {'dflash' if config.shift_label == 0 else 'dspark'}")
    import time

    t_start, step = time.perf_counter(), 0
    while step < total[0]:
        if step == 10:  # the first steps pay for compilation and allocator warm-up
            t_warm = time.perf_counter()
        if train.max_seconds and step == 30:
            per_step = (time.perf_counter() - t_warm) / 20
            left = train.max_seconds - (time.perf_counter() - t_start)
            total[0] = max(31, min(train.steps, 30 + int(left / per_step)))
            if bar is not None:
                bar.total = total[0]
        seqs = [rng.randrange(len(data.tokens)) for _ in range(train.seqs_per_step)]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = block_loss(net, embed, lm_head, data, seqs, rng, train)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if bar is not None:
            bar.update(1)
            if step % log_every == 0:
                bar.set_postfix(loss=f"{sum(losses[-log_every:]) / len(losses[-log_every:]):.3f}")
        step += 1
    if bar is not None:
        bar.close()
    return net.eval(), losses
