"""DFlash and DSpark: block drafters conditioned on the target's hidden states.

Both run :class:`~specdec.drafters.block.BlockDrafterNet`; they differ in
``shift_label`` (DFlash 0, DSpark 1). The context features live as K/V in the
drafter's own KV layers, page by page, written only for accepted positions
(:meth:`BlockDrafter.on_context`); where those layers live (appended to the
target's pool or a pool of their own) is the scheduler's decision, read from
the hooks below.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Sequence

import torch

from specdec.drafters.base import Draft, Drafter, register_drafter
from specdec.drafters.block import BlockDrafterConfig, BlockDrafterNet, output_slots
from specdec.errors import CheckpointError, ConfigError, InvalidRequestError
from specdec.kvcache.pool import LayerSpec

#: Drafters shipped in the package, by name.
SHIPPED_DIR = Path(__file__).resolve().parent / "checkpoints"


class BlockDrafter(Drafter):
    """A block drafter at inference time.

    Args:
        net: the trained network (its config decides block size and shift_label).
    """

    reads_helix_sharded_ctx_pages = False

    #: The network class it runs (the MLA variant swaps in its own, see ``dspark_mla.py``).
    net_class: ClassVar[type] = BlockDrafterNet
    #: Shipped checkpoint used when no network is given.
    default_checkpoint: str | None = None

    def __init__(self, net: BlockDrafterNet | str | Path | None = None):
        if net is None:
            if self.default_checkpoint is None:
                raise ConfigError(f"{type(self).__name__} needs a network or a checkpoint path (net=...)")
            net = self.default_checkpoint
        if not isinstance(net, self.net_class):
            net = type(self).from_pretrained(net).net
        if self.expected_shift is not None and net.config.shift_label != self.expected_shift:
            raise ConfigError(f"{type(self).__name__} needs shift_label={self.expected_shift}, "
                              f"the network has shift_label={net.config.shift_label}")
        self.net = net.eval()
        self.config: BlockDrafterConfig = net.config
        self.shift_label = self.config.shift_label
        self.vocab_size = self.config.vocab_size
        self.target_layer_ids = self.config.target_layer_ids
        self._slots = output_slots(self.config.block_size, self.shift_label)
        self._tokens: dict[str, list[int]] = {}
        self._ctx_len: dict[str, int] = {}
        self.kv = None
        self._embed = self._lm_head = None

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path) -> "BlockDrafter":
        """Load a shipped drafter by name (e.g. ``"smollm2-135m-dflash"``) or a checkpoint directory.

        Raises:
            CheckpointError: neither a shipped name nor a checkpoint directory.
        """
        path = SHIPPED_DIR / str(name_or_path)
        if not path.is_dir():
            path = Path(name_or_path)
        if not path.is_dir():
            shipped = sorted(p.name for p in SHIPPED_DIR.iterdir()) if SHIPPED_DIR.is_dir() else []
            raise CheckpointError(f"drafter must be one of {shipped} or a checkpoint directory, got {str(name_or_path)!r}")
        net = cls.net_class.load(path)
        return cls(net)

    expected_shift: int | None = None

    # -- hooks -------------------------------------------------------------------
    def kv_layer_specs(self) -> tuple[LayerSpec, ...]:
        c = self.config
        dtype = self.net.fc.weight.dtype
        return tuple(LayerSpec("gqa", c.num_kv_heads, c.head_dim, dtype, owner="draft") for _ in range(c.num_layers))

    def reads_managed_ctx_pages(self, tokens_per_block: int) -> bool:
        return tokens_per_block in self.config.ctx_page_sizes

    # -- lifecycle ---------------------------------------------------------------
    def bind(self, target, kv) -> None:
        c = self.config
        if c.target_hidden_size != target.hidden_size:
            raise ConfigError(f"drafter target_hidden_size must equal the target's hidden_size "
                              f"({target.hidden_size}), got {c.target_hidden_size}")
        if c.vocab_size != target.vocab_size:
            raise ConfigError(f"drafter vocab_size must equal the target's ({target.vocab_size}), got {c.vocab_size}")
        bad = [i for i in c.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise ConfigError(f"target_layer_ids must be in [0, {target.num_layers}), got {list(c.target_layer_ids)}")
        self.net.to(device=target.device, dtype=target.dtype)
        self._embed, self._lm_head, self.kv = target.embed, target.lm_head, kv

    def start_request(self, req_id: str, prompt_token_ids: Sequence[int]) -> None:
        self._tokens[req_id] = list(prompt_token_ids)
        self._ctx_len[req_id] = 0

    @torch.inference_mode()
    def on_context(self, req_id: str, start: int, hidden: torch.Tensor) -> None:
        self.on_contexts([(req_id, start, 0, hidden.shape[0])], hidden)

    @torch.inference_mode()
    def on_contexts(self, spans, hidden: torch.Tensor) -> None:
        """Write every request's new context K/V in one pass per layer (one gather, one
        projection, one write per layer for the whole step, whatever the batch)."""
        rows, slots, pos = [], [], []
        for req_id, start, row, n in spans:
            if req_id not in self._tokens:
                raise InvalidRequestError(f"unknown request {req_id!r}")
            self.kv.reserve(req_id, start + n)
            rows += range(row, row + n)
            slots += self.kv.slots(req_id, start, start + n)
            pos += range(start, start + n)
            self._ctx_len[req_id] = start + n
        if not rows:
            return
        dev = hidden.device
        picked = hidden if len(rows) == hidden.shape[0] and rows[-1] == len(rows) - 1 else \
            hidden[torch.tensor(rows, device=dev)]
        ctx = self.net.project_context(picked)  # [n, hidden]
        slots_t, pos_t = torch.tensor(slots, device=dev), torch.tensor(pos, device=dev)
        for i in range(self.config.num_layers):
            k, v = self.net.context_kv(i, ctx, pos_t)  # v is None for a K-only (latent) layer
            self.kv.k(i).index_copy_(0, slots_t, k.to(self.kv.k(i).dtype))
            if v is not None:
                self.kv.v(i).index_copy_(0, slots_t, v.to(self.kv.v(i).dtype))

    def on_accepted(self, req_id: str, token_ids: Sequence[int]) -> None:
        if req_id not in self._tokens:
            raise InvalidRequestError(f"unknown request {req_id!r}")
        self._tokens[req_id] += list(token_ids)

    def stop_request(self, req_id: str) -> None:
        self._tokens.pop(req_id, None)
        self._ctx_len.pop(req_id, None)
        if self.kv is not None:
            self.kv.release(req_id)

    @torch.inference_mode()
    def propose(self, req_ids: Sequence[str], max_tokens: int) -> list[Draft]:
        if self.kv is None:
            raise ConfigError("BlockDrafter.propose before bind(): build a SpecEngine with this drafter")
        c, dev = self.config, self._embed.device
        B, N = c.block_size, len(req_ids)
        anchors = [self._tokens[r][-1] for r in req_ids]
        ctx_lens = [self._ctx_len[r] for r in req_ids]
        ids = torch.full((N, B), c.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = torch.tensor(anchors, device=dev)
        # the anchor sits right after the written context
        positions = torch.tensor(ctx_lens, device=dev)[:, None] + torch.arange(B, device=dev)
        gather, valid = self._gather_index(req_ids, ctx_lens, dev)
        ctx_kv = [(self.kv.k(i)[gather], None if self.kv.v(i) is None else self.kv.v(i)[gather])
                  for i in range(c.num_layers)]
        h = self.net.forward_block(self._embed[ids], positions, ctx_kv, valid)  # [N, B, hidden]
        slots = list(self._slots)[:max_tokens]
        logits = torch.nn.functional.linear(h[:, slots], self._lm_head)  # [N, width, vocab]
        tokens = logits.argmax(-1).tolist()
        return [Draft(tuple(t)) for t in tokens]

    def _gather_index(self, req_ids, ctx_lens, dev):
        """Slots of every request's context, padded: ``[N, max_ctx]`` and its validity mask."""
        tpb, width = self.kv.tokens_per_block, max(1, max(ctx_lens))
        gather = torch.zeros(len(req_ids), width, dtype=torch.long)
        valid = torch.zeros(len(req_ids), width, dtype=torch.bool)
        offs = torch.arange(tpb)
        for i, (r, n) in enumerate(zip(req_ids, ctx_lens)):
            if n:
                pages = torch.tensor(self.kv.page_table(r)[: -(-n // tpb)])
                gather[i, :n] = (pages[:, None] * tpb + offs).flatten()[:n]
                valid[i, :n] = True
        return gather.to(dev), valid.to(dev)


@register_drafter("dflash")
class DFlashDrafter(BlockDrafter):
    """DFlash: ``shift_label = 0``, drafts from slots 1..B-1 (width B - 1)."""

    expected_shift = 0
    shift_label = 0
    default_checkpoint = "smollm2-135m-dflash"


@register_drafter("dspark")
class DSparkDrafter(BlockDrafter):
    """DSpark: ``shift_label = 1``, every slot drafts (width B)."""

    expected_shift = 1
    shift_label = 1
    default_checkpoint = "smollm2-135m-dspark"
