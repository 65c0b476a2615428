"""DFlash and DSpark: block drafters conditioned on the target's hidden states.

Both run :class:`~specdec.drafters.block.BlockDrafterNet`; they differ in
``shift_label`` (DFlash 0, DSpark 1). The context features live as K/V in the
drafter's own KV layers, page by page, written only for accepted positions
(:meth:`BlockDrafter.on_context`); where those layers live (appended to the
target's pool or a pool of their own) is the scheduler's decision, read from
the hooks below.

``propose`` packs everything it needs from the host into one integer array
(block tokens, slot positions, context lengths, page tables), copies it to the
device once, builds the gather index there, looks RoPE factors up in a table
made at :meth:`BlockDrafter.bind`. On CUDA its drafts stay on the device
(``device_drafts``): the engine feeds them to the target's step there and reads them
after it, so nothing waits between the propose and the step; without it the propose
synchronises once, for the drafted tokens. On CUDA its shapes are padded into buckets (requests to a power of
two, context keys to a multiple of :data:`CTX_BUCKET`, padding masked out) so
that they recur: attention plans are reused and each bucket's forward is
captured once as a CUDA graph and replayed (``cuda_graphs``). On the CPU
nothing is padded and no graph is used.

Context writes ride in the next propose that drafts for the request:
:meth:`BlockDrafter.on_contexts` copies a generation step's hidden states (at most
``block_size + 1`` accepted positions per request) into a staging ring, and the
propose projects them and writes their K/V inside its graph, before the block reads
them; padding rows write to the KV's scratch slot. A request left out of proposes
(the hybrid drafter does that when the suffix draft is better; a draft gate stops
proposing altogether where plain steps pay more) keeps its positions staged, however
many: the propose that next drafts for it writes them at once first if they outgrow the
``block_size + 1`` its graph writes, and when the ring comes round every staged position
is written at once (one write every :data:`STAGE_STEPS` steps of the largest padded batch
at a full block, far more steps of one accepted token each). Prompts (longer spans) are
written at once. Without a scratch slot every write is immediate.
"""

from __future__ import annotations

import contextlib
import time
import types
import warnings
from array import array
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Sequence

import torch

from specdec.capture import capture_graph
from specdec.drafters.base import EMPTY_DRAFT, Draft, Drafter, DraftsOnDevice, register_drafter
from specdec.drafters.block import (BlockDrafterConfig, BlockDrafterNet, RopeTable, block_mask, draft_from_hidden,
                                    output_slots)
from specdec.errors import CheckpointError, ConfigError, InvalidRequestError
from specdec.graphs import next_pow2
from specdec.kvcache.pool import LayerSpec

#: Drafters shipped in the package, by name.
SHIPPED_DIR = Path(__file__).resolve().parent / "checkpoints"

#: Padded proposes read a multiple of this many context keys (CUDA).
CTX_BUCKET = 256
#: Most requests a padded propose (and a captured graph) holds; more run unpadded, eagerly.
MAX_PADDED_REQUESTS = 256
#: The staging ring's size, in steps of :data:`MAX_PADDED_REQUESTS` requests accepting
#: ``block_size + 1`` positions each: when it comes round, every position still staged is written at once.
STAGE_STEPS = 4


def _recompile_limit_raises():
    """A context in which reaching torch's recompile limit raises (instead of silently running
    the function uncompiled), where this torch has the setting."""
    if hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit"):
        return torch._dynamo.config.patch(fail_on_recompile_limit_hit=True)
    return contextlib.nullcontext()


def _own_code(fn):
    """``fn`` with a code object of its own. torch keeps what it compiled for a function on the
    function's code object, so drafters compiling the same method would share one cache: a later
    drafter (another engine's, another batch size's) would run graphs compiled for an earlier one's
    sizes, with the dimensions that changed between them made dynamic, and enough drafters in one
    process would reach torch's recompile limit. Each drafter compiles its own copy instead."""
    code = fn.__code__.replace(co_name=fn.__code__.co_name)
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def propose_buckets(max_requests: int, max_context: int) -> list[tuple[int, int]]:
    """Every ``(requests, context keys)`` bucket a padded propose of up to ``max_requests``
    requests and ``max_context`` context tokens can use: requests a power of two (at most
    :data:`MAX_PADDED_REQUESTS`), keys a multiple of :data:`CTX_BUCKET`."""
    top_rows = min(next_pow2(max(1, max_requests)), MAX_PADDED_REQUESTS)
    top_cols = -(-max(1, max_context) // CTX_BUCKET) * CTX_BUCKET
    rows = [1 << i for i in range(top_rows.bit_length()) if 1 << i <= top_rows]
    return [(r, c) for r in rows for c in range(CTX_BUCKET, top_cols + 1, CTX_BUCKET)]


@dataclass(slots=True)
class _ProposeGraph:
    """A captured propose of one bucket: static inputs in, drafted tokens out."""

    host: torch.Tensor  # pinned [rows, 2 * B + 1 + 3 * D + pages] int64, packed inputs (BlockDrafter._pack)
    dev: torch.Tensor  # the same on the device, read by the graph
    graph: "torch.cuda.CUDAGraph | None" = None
    tokens: torch.Tensor | None = None  # [rows, draft_width] int64
    confidence: torch.Tensor | None = None  # [rows, draft_width] fp32, nets with a confidence head
    copied: "torch.cuda.Event | None" = None  # after the last copy of ``host`` to ``dev``


class BlockDrafter(Drafter):
    """A block drafter at inference time.

    Args:
        net: the trained network (its config decides block size and shift_label).
        cuda_graphs: on CUDA, replay a captured graph per bucket of (requests, context
            keys) instead of launching the network eagerly; an attribute, may be changed
            between calls. ``stats`` counts graph and eager proposes (and why eager).
        torch_compile: run the propose's network pass (:meth:`_draft`: staged context writes,
            gathers, layers, drafting head) through ``torch.compile`` (inductor, dynamic sizes,
            one graph), so that its elementwise work is fused into few kernels; on CUDA the
            compiled pass is what each bucket's graph captures. It compiles at the first propose,
            or in :meth:`capture_graphs` before serving (tens of seconds; :meth:`_run_draft`).
            The network's weights, and the target's embedding and LM head, are read as the first
            run after :meth:`bind` finds them: change the weights and build a new drafter. Not
            under Helix (its proposes exchange partials between ranks: they run eagerly).
            ``stats["compile_s"]``: the time of the first compiled run; ``stats["compile_errors"]``:
            compiles that failed (the drafter then runs eagerly). ``None`` (default): on when
            :meth:`bind` finds the target on CUDA (1.2-1.8x cheaper proposes on the H200,
            BENCHMARKS.md), off on the CPU.
        device_drafts: leave the drafted tokens (and confidences) on the device
            (:class:`~specdec.drafters.base.DraftsOnDevice`): the engine feeds them to the target's
            step there, so the host launches the step while the propose still runs, and reads
            them after the step. ``False`` (default): the propose reads them back (one
            synchronisation). Off by default because it measured slower: on the H100 at batch 1
            0.94x the tokens/s of DFlash with it off, 0.93x for the hybrid with DFlash, 0.99x for
            DSpark (BENCHMARKS.md): the propose's host work (about 0.45 ms) outlasts its device
            work (0.26 ms), so the wait it removes is short, and its extra launches cost more.
            ``None``: on when :meth:`bind` finds the target on CUDA. An attribute, may be changed
            between calls.
    """

    reads_helix_sharded_ctx_pages = False
    #: Its propose costs about a target step on a small target: the engine gates its drafts by
    #: measurement unless ``EngineConfig.draft_gate`` says otherwise (on the H100 at batch 32, DFlash
    #: ran 0.80x the null drafter's tokens/s without the gate, 0.99x with it; BENCHMARKS.md).
    gated_by_default: ClassVar[bool] = True

    #: The network class it runs (the MLA variant swaps in its own, see ``dspark_mla.py``).
    net_class: ClassVar[type] = BlockDrafterNet
    #: Shipped checkpoint used when no network is given.
    default_checkpoint: str | None = None

    def __init__(self, net: BlockDrafterNet | str | Path | None = None, cuda_graphs: bool = True,
                 torch_compile: bool | None = None, device_drafts: bool | None = False):
        if not isinstance(cuda_graphs, bool):
            raise ConfigError(f"cuda_graphs must be True or False, got {cuda_graphs!r}")
        for option, value in (("torch_compile", torch_compile), ("device_drafts", device_drafts)):
            if value is not None and not isinstance(value, bool):
                raise ConfigError(f"{option} must be True, False or None, got {value!r}")
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
        self.cuda_graphs = cuda_graphs
        # _graph_key: (requests, keys, compiled, folded: a graph replays the path it captured)
        self._graphs: dict[tuple[int, int, bool, bool], _ProposeGraph] = {}
        self._compiled = None  # the compiled _draft, made on first use
        self.torch_compile = torch_compile
        self.device_drafts = device_drafts
        self._out_buffers: list = [None, None]  # pinned host buffers of device drafts, used in turn
        self._out_turn = 0
        self._timing = None  # (start, end) CUDA events of the last propose with device drafts
        self._device_s: float | None = None
        #: pad shapes into buckets (set at bind: True on CUDA); tests may set it on the CPU
        self.pad_shapes = False
        self.stats = {"graph_proposes": 0, "eager_proposes": 0, "graphs_captured": 0, "capture_s": 0.0,
                      "compile_s": 0.0, "compile_errors": 0, "eager_reasons": Counter(),
                      "device_s": 0.0, "device_timed": 0}
        self._rope: RopeTable | None = None
        self._iota: torch.Tensor | None = None
        self._mempool = None
        # per request, its staged positions: (staging rows, positions) and the KV allocation they were
        # staged in (KVCacheManager.allocation; their cache slots are looked up when they are written)
        self._pending: dict[str, tuple[list[int], list[int], int]] = {}
        self._ctx_stage: torch.Tensor | None = None  # [ring rows, features] hidden states of pending writes
        self._stage_top = 0  # the ring's next free row
        self._defer = 0  # pending positions per request a propose writes inside its graph (0: every write immediate)

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path, cuda_graphs: bool = True,
                        torch_compile: bool | None = None, device_drafts: bool | None = False) -> "BlockDrafter":
        """Load a shipped drafter by name (e.g. ``"smollm2-135m-dflash"``) or a checkpoint directory
        (``cuda_graphs``, ``torch_compile``, ``device_drafts``: as in the constructor).

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
        return cls(net, cuda_graphs=cuda_graphs, torch_compile=torch_compile, device_drafts=device_drafts)

    expected_shift: int | None = None

    @property
    def torch_compile(self) -> bool:
        """Whether proposes run the compiled pass (see the class doc); may be changed between
        calls (graphs are kept per bucket and setting). Set to ``None``, it follows the device
        of the target bound next (on for CUDA); until a bind it reads ``False``."""
        return bool(self._torch_compile)

    @torch_compile.setter
    def torch_compile(self, value: bool | None) -> None:
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"torch_compile must be True, False or None (on for CUDA targets), got {value!r}")
        self._torch_compile = value
        self._compile_auto = value is None

    @property
    def device_drafts(self) -> bool:
        """Whether proposes leave their drafts on the device (see the class doc). Set to ``None``,
        it follows the device of the target bound next (on for CUDA); until a bind it reads ``False``."""
        return bool(self._device_drafts)

    @device_drafts.setter
    def device_drafts(self, value: bool | None) -> None:
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"device_drafts must be True, False or None (on for CUDA targets), got {value!r}")
        self._device_drafts = value
        self._device_drafts_auto = value is None

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
        self.pad_shapes = target.device.type == "cuda"
        if self._compile_auto:
            self._torch_compile = target.device.type == "cuda"
        if self._device_drafts_auto:
            self._device_drafts = target.device.type == "cuda"
        self._compiled = None  # its first run reads the new target's embedding / LM head products afresh
        self._pending.clear()
        self._out_buffers, self._timing, self._device_s = [None, None], None, None
        self._defer, self._ctx_stage, self._stage_top = 0, None, 0
        if getattr(kv, "scratch_slot", None) is not None:
            self._defer = c.block_size + 1  # a verify step accepts at most draft width + 1 positions
            feats = len(c.target_layer_ids) * c.target_hidden_size
            self._ctx_stage = torch.zeros(STAGE_STEPS * MAX_PADDED_REQUESTS * self._defer, feats, dtype=target.dtype,
                                          device=target.device)
        # slot positions reach max_context + block_size - 1
        self._make_tables(target.max_context + c.block_size)

    def _make_tables(self, length: int) -> None:
        """RoPE factors of positions ``< length`` and an index ramp, on the device (drops captured graphs)."""
        dev = self._embed.device
        self._rope = RopeTable(self.net.rope_dim, self.config.rope_theta, length, dev)
        self._iota = torch.arange(length + CTX_BUCKET + self.kv.tokens_per_block, device=dev)
        self._graphs.clear()

    def start_request(self, req_id: str, prompt_token_ids: Sequence[int]) -> None:
        self._tokens[req_id] = list(prompt_token_ids)
        self._ctx_len[req_id] = 0

    @torch.inference_mode()
    def on_context(self, req_id: str, start: int, hidden: torch.Tensor) -> None:
        self.on_contexts([(req_id, start, 0, hidden.shape[0])], hidden)

    @torch.inference_mode()
    def on_contexts(self, spans, hidden: torch.Tensor) -> None:
        """Take every request's new context positions of the step, whatever the batch.

        Short spans (a generation step's accepted positions) are staged: their hidden states are
        copied in one go into the staging ring's next rows, and the next :meth:`propose` for the
        request writes their K/V inside its graph (at once first, if they outgrow what a propose
        writes: ``block_size + 1``). Longer spans (prompts) are written now, and so is every staged
        position when the ring comes round: one gather, one projection of every layer's K and V
        (:meth:`BlockDrafterNet.context_kv_all`), one write per layer and cache.
        """
        tokens, ctx_len, kv, D = self._tokens, self._ctx_len, self.kv, self._defer
        reserve = None if kv.shared else kv.reserve  # shared: the target's pages already hold the positions
        now, later = [], []
        for span in spans:
            req_id, start, _, n = span
            if req_id not in tokens:
                raise InvalidRequestError(f"unknown request {req_id!r}")
            if reserve is not None:
                reserve(req_id, start + n)
            ctx_len[req_id] = start + n
            if n:
                (later if n <= D else now).append(span)
        if later:
            lo, hi = min(s[2] for s in later), max(s[2] + s[3] for s in later)
            ring = self._ctx_stage.shape[0]
            if hi - lo > ring:
                now, later = now + later, []
            elif self._stage_top + hi - lo > ring:  # round again: whatever is staged is written first
                self._flush()
                self._stage_top = 0
        if later:
            top, pending, manager = self._stage_top, self._pending, kv.manager
            self._ctx_stage[top:top + hi - lo].copy_(hidden[lo:hi])
            self._stage_top = top + hi - lo
            base = top - lo
            for r, start, row, n in later:
                run, alloc = pending.get(r), manager.allocation(r)
                if run is None or run[2] != alloc:  # none yet, or stale (see _drop_stale)
                    run = pending[r] = ([], [], alloc)
                run[0].extend(range(base + row, base + row + n))
                run[1].extend(range(start, start + n))
        if now:
            self._write(hidden, [(range(row, row + n), range(start, start + n), self.kv.slots(r, start, start + n))
                                 for r, start, row, n in now])

    def _flush(self, req_ids=None) -> None:
        """Write the staged positions of ``req_ids`` (default: every request) now, from the staging
        buffer (stale ones dropped, :meth:`_drop_stale`)."""
        for r in list(self._pending) if req_ids is None else req_ids:
            self._drop_stale(r)
        runs = []
        for r in list(self._pending) if req_ids is None else req_ids:
            if r in self._pending:
                rows, pos, _ = self._pending.pop(r)
                runs.append((rows, pos, self._staged_slots(r, pos)))
        if runs:
            self._write(self._ctx_stage, runs)

    def _staged_slots(self, req_id: str, positions: list[int]) -> list[int]:
        """The cache slots of a request's staged ``positions`` (ascending).
        Staged positions are accepted ones, which rollback never truncates, so while the request's
        allocation is the one they were staged in (:meth:`_drop_stale`) their slots are the same
        as when they were staged."""
        if positions and positions[-1] - positions[0] == len(positions) - 1:  # the usual case: one run
            return self.kv.slots(req_id, positions[0], positions[-1] + 1)
        return [s for p in positions for s in self.kv.slots(req_id, p, p + 1)]  # a gap (a span written at once)

    def _drop_stale(self, req_id: str) -> None:
        """Forget the request's staged positions if their cache slots may no longer be its own: in a
        pool shared with the target the scheduler frees a preempted request's pages, which another
        request may hold by then (the request's context is computed again when it is readmitted,
        and written again). Staged positions are accepted ones, which rollback never truncates, so
        an unchanged allocation (:meth:`KVCacheManager.allocation`) keeps them valid."""
        run = self._pending.get(req_id)
        manager = self.kv.manager
        if run is not None and (req_id not in manager or manager.allocation(req_id) != run[2]):
            del self._pending[req_id]

    def _write(self, hidden: torch.Tensor, runs) -> None:
        """Write context K/V eagerly: each run ``(rows, positions, slots, ...)`` (equal-length sequences)
        writes the hidden states at ``rows`` of ``hidden``, at those positions, into those cache slots."""
        rows, slots, pos = [], [], []
        for r, p, where, *_ in runs:
            rows += r
            pos += p
            slots += where
        if max(pos) >= self._rope.length:
            self._make_tables(max(pos) + 1)
        dense = len(rows) == hidden.shape[0] and rows == list(range(len(rows)))
        idx = self._to_device(torch.tensor([slots, pos] if dense else [slots, pos, rows], dtype=torch.long))
        self._write_context(hidden if dense else hidden[idx[2]], idx[0], idx[1])

    def _write_context(self, hidden: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> None:
        """Project target hidden states ``[n, features]`` into every layer's K/V and write them at
        ``slots`` ``[n]`` (positions ``pos`` ``[n]``, on the device): no host work, capturable."""
        ctx = self.net.project_context(hidden)  # [n, hidden]
        rope = self._rope(pos)
        fused = getattr(self.net, "context_kv_all", None)
        kvs = fused(ctx, pos, rope) if fused is not None else \
            [self.net.context_kv(i, ctx, pos, rope) for i in range(self.config.num_layers)]
        for i, (k, v) in enumerate(kvs):  # v is None for a K-only (latent) layer
            self.kv.k(i).index_copy_(0, slots, k.to(self.kv.k(i).dtype))
            if v is not None:
                self.kv.v(i).index_copy_(0, slots, v.to(self.kv.v(i).dtype))

    def on_accepted(self, req_id: str, token_ids: Sequence[int]) -> None:
        if req_id not in self._tokens:
            raise InvalidRequestError(f"unknown request {req_id!r}")
        self._tokens[req_id] += list(token_ids)

    def stop_request(self, req_id: str) -> None:
        self._tokens.pop(req_id, None)
        self._ctx_len.pop(req_id, None)
        self._pending.pop(req_id, None)
        if self.kv is not None:
            self.kv.release(req_id)

    @torch.inference_mode()
    def propose(self, req_ids: Sequence[str], max_tokens: int) -> list[Draft]:
        """Draft up to ``max_tokens`` tokens for every request: one network pass over the whole
        batch, one host-to-device copy; with ``device_drafts`` the drafts stay on the device (no
        synchronisation), else one synchronisation (the drafted tokens)."""
        if self.kv is None:
            raise ConfigError("BlockDrafter.propose before bind(): build a SpecEngine with this drafter")
        width = min(max_tokens, self.config.draft_width)
        if not req_ids or width <= 0:
            return [EMPTY_DRAFT for _ in req_ids]
        ctx_lens = [self._ctx_len[r] for r in req_ids]
        n, cols = len(req_ids), max(1, max(ctx_lens))
        on_device = self.device_drafts and getattr(self, "_shard", None) is None
        timed = on_device and self._embed.is_cuda
        if not timed:
            self._timing = self._device_s = None
        if cols + self.config.block_size > self._rope.length:
            self._make_tables(cols + self.config.block_size)
        if D := self._defer:  # staged positions past what the propose writes (left out of proposes): now
            pending = self._pending
            over = [r for r in req_ids if r in pending and len(pending[r][0]) > D]
            if over:
                self._flush(over)
        rows = n
        if self.pad_shapes and n <= MAX_PADDED_REQUESTS:  # shapes recur: plans and graphs are reused
            rows, cols = next_pow2(n), -(-cols // CTX_BUCKET) * CTX_BUCKET
        packed = self._pack(req_ids, ctx_lens, rows, cols)
        if timed:  # from the copy in to the copies out; a propose that captures or compiles is not timed
            self._read_timing()
            one_off = self.stats["capture_s"] + self.stats["compile_s"]
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        why = self._why_eager(n)
        if why:
            self.stats["eager_proposes"] += 1
            self.stats["eager_reasons"][why] += 1
            tokens, conf = self._run_draft(self._to_device(packed), cols, width)
        else:
            self.stats["graph_proposes"] += 1
            tokens, conf = self._replay(packed, cols)
            tokens, conf = tokens[:, :width], None if conf is None else conf[:, :width]
        if on_device:  # no synchronisation: the engine feeds them to the step on the device
            out = self._on_device(tokens[:n], None if conf is None else conf[:n], width)
            if timed and self.stats["capture_s"] + self.stats["compile_s"] == one_off:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self._timing = (start, end)
        elif conf is None:
            out = [Draft(tuple(t)) for t in tokens[:n].tolist()]
        else:
            both = torch.cat([tokens[:n].float(), conf[:n].float()], 1).tolist()  # one sync (ids < 2**24: exact)
            out = [Draft(tuple(int(t) for t in row[:width]), confidence=tuple(row[width:])) for row in both]
        for r in req_ids:  # their staged writes are in the cache now
            self._pending.pop(r, None)
        return out

    def _read_timing(self) -> None:
        """Take the last timed propose's device seconds once its work is done (into ``stats``)."""
        if self._timing is not None and self._timing[1].query():
            self._device_s = self._timing[0].elapsed_time(self._timing[1]) / 1e3
            self._timing = None
            self.stats["device_s"] += self._device_s
            self.stats["device_timed"] += 1

    @property
    def propose_device_s(self) -> float | None:
        """Device seconds of the latest propose with ``device_drafts`` whose work has finished (its
        copy in, network pass and copies out), or ``None`` before one has: with drafts left on
        the device the host returns from :meth:`propose` before that work is done, so its cost
        to a step is this, not the call's wall time."""
        self._read_timing()
        return self._device_s

    def _on_device(self, tokens: torch.Tensor, conf: torch.Tensor | None, width: int) -> list[Draft]:
        """Drafts whose tokens (and confidences) stay on the device (:class:`DraftsOnDevice`),
        their host copies queued into pinned buffers used in turn. Before a buffer is filled
        again, the drafts that last used it are read out of it (:meth:`DraftsOnDevice.host`):
        with one propose a step they were read already, or the step they belonged to has been
        waited for (nothing waits); only several proposes in one step (the engine's fallback to
        one propose per request) wait here."""
        rows = tokens.shape[0]
        turn = self._out_turn = self._out_turn ^ 1
        buf = self._out_buffers[turn]
        need = rows * width
        pin = tokens.is_cuda
        if buf is None or buf[0].numel() < need or buf[0].is_pinned() != pin:
            size = max(need, MAX_PADDED_REQUESTS * self.config.draft_width)  # pinning anew is slow: once
            buf = (torch.empty(size, dtype=torch.long, pin_memory=pin),
                   torch.empty(size, dtype=torch.float32, pin_memory=pin), None)
        elif buf[2] is not None and not buf[2].fetched:
            buf[2].host()  # its values out of the buffer before it is overwritten
        src = DraftsOnDevice(tokens, conf, self.vocab_size, buf[0], buf[1])
        self._out_buffers[turn] = (buf[0], buf[1], src)
        return [Draft(src.ids(i, width), confidence=src.confidences(i, width)) for i in range(rows)]

    def capture_graphs(self, max_requests: int, max_context: int) -> int:
        """Capture the propose graph of every bucket of up to ``max_requests`` requests and
        ``max_context`` context keys (see :meth:`Drafter.capture_graphs`): padding rows only, whose
        context writes go to the scratch slot; no request is touched. 0 where graphs are off."""
        if self.kv is None or self._why_eager(1):
            return 0
        buckets = propose_buckets(max_requests, max_context)
        top_cols = max(cols for _, cols in buckets)
        if top_cols + self.config.block_size > self._rope.length:  # grown before capturing: it drops graphs
            self._make_tables(top_cols + self.config.block_size)
        todo = [key for rows, cols in buckets if (key := self._graph_key(rows, cols)) not in self._graphs]
        for key in todo:
            self._capture(key, self._pack([], [], key[0], key[1]))
        return len(todo)

    def _why_eager(self, n: int) -> str:
        """Why this propose cannot replay a graph ("" when it can)."""
        if not self.cuda_graphs:
            return "cuda_graphs disabled"
        if self._embed.device.type != "cuda":
            return f"device is {self._embed.device.type}, graphs need cuda"
        if n > MAX_PADDED_REQUESTS:
            return f"{n} requests > {MAX_PADDED_REQUESTS}"
        if not self.pad_shapes:
            return "pad_shapes is off"
        return ""

    def _pack(self, req_ids, ctx_lens, rows: int, cols: int) -> torch.Tensor:
        """What propose needs from the host, one int64 row per request, built in one go, with the
        requests' staged context writes (this propose writes them; :meth:`propose` forgets them once
        it has run, so a propose that fails leaves them staged).

        Row: block token ids ``[B]`` (anchor, then mask tokens), slot positions ``[B]``, context
        length ``[1]``; with staged writes (``D = block_size + 1`` per request) their staging rows
        ``[D]``, positions ``[D]`` and cache slots ``[D]`` (padding: row 0, position 0, the scratch
        slot); then the page table ``[ceil(cols / tokens_per_block)]`` (0-padded). Rows past
        ``len(req_ids)`` are padding: an empty context, never read back.

        Returns:
            ``[rows, 2 * B + 1 + 3 * D + pages]`` on the host.
        """
        c, tpb, D, scratch = self.config, self.kv.tokens_per_block, self._defer, self.kv.scratch_slot
        B, P = c.block_size, -(-cols // tpb)
        masks = [c.mask_token_id] * (B - 1)
        no_write = [0] * (2 * D) + [scratch] * D if D else []
        zeros = [0] * P
        out: list[int] = []  # one flat list, converted once: no list of lists for torch to walk
        tokens, pending = self._tokens, self._pending
        for r, n in zip(req_ids, ctx_lens):
            pages = self.kv.page_table(r)[: -(-n // tpb)] if n else []  # no context: maybe no pages either
            self._drop_stale(r)  # stale positions are never written
            run = pending.get(r)  # taken off by propose once the draft has run
            if run is None:
                write = no_write
            else:
                stage_rows, pos, _ = run
                where = self._staged_slots(r, pos)
                gap = [0] * (D - len(where))
                write = [*stage_rows, *gap, *pos, *gap, *where, *[scratch] * len(gap)]
            out += [tokens[r][-1], *masks, *range(n, n + B), n, *write, *pages, *zeros[len(pages):]]
        width = 2 * B + 1 + 3 * D + P
        if rows > len(req_ids):
            out += [c.mask_token_id, *masks, *range(B), 0, *no_write, *zeros] * (rows - len(req_ids))
        if not out:
            return torch.empty(rows, width, dtype=torch.long)
        return torch.frombuffer(array("q", out), dtype=torch.long).view(rows, width)

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """One asynchronous copy, on CUDA from a pinned staging buffer kept between calls (pinning
        anew costs a page-locked allocation every time); the buffer is reused once the copy that
        last read it has finished."""
        dev = self._embed.device
        if dev.type != "cuda":
            return host.to(dev)
        if host.dtype != torch.long:
            return host.pin_memory().to(dev, non_blocking=True)
        n = host.numel()
        stage, done = self.__dict__.get("_host_stage", (None, None))
        if stage is None or stage.numel() < n:
            stage, done = torch.empty(max(2 * n, 4096), dtype=torch.long, pin_memory=True), None
        if done is not None:
            done.synchronize()  # the last copy out of the buffer
        buf = stage[:n].view(host.shape)
        buf.copy_(host)
        out = buf.to(dev, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self.__dict__["_host_stage"] = (stage, done)
        return out

    def _draft(self, packed: torch.Tensor, cols: int | None, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafted tokens ``[rows, width]`` and, with a confidence head, their acceptance
        probabilities ``[rows, width]`` (else ``None``) from packed inputs on the device; no host
        work, no synchronisation (this is what a graph captures).

        Args:
            packed: :meth:`_pack`'s array on the device, ``[rows, 2 * B + 1 + 3 * D + pages]``.
            cols: context keys to read per request (``<= pages * tokens_per_block``; ``None``: all
                of the packed pages' keys).
            width: draft slots to decode (``<= draft_width``).
        """
        c, tpb, B, D = self.config, self.kv.tokens_per_block, self.config.block_size, self._defer
        ids, pos, lens = packed[:, :B], packed[:, B:2 * B], packed[:, 2 * B:2 * B + 1]
        pages = packed[:, 2 * B + 1 + 3 * D:]
        cols = pages.shape[1] * tpb if cols is None else cols
        if D:  # the context positions staged since the last propose, before anything reads them
            w = packed[:, 2 * B + 1:2 * B + 1 + 3 * D]
            self._write_context(self._ctx_stage[w[:, :D].flatten()], w[:, 2 * D:].flatten(), w[:, D:2 * D].flatten())
        slots = (pages[:, :, None] * tpb + self._iota[:tpb]).flatten(1)[:, :cols]  # [rows, cols]
        valid = self._iota[:cols] < lens  # [rows, cols]; keys past a context are read, then masked out
        ctx_kv = [(self.kv.k(i)[slots], None if self.kv.v(i) is None else self.kv.v(i)[slots])
                  for i in range(c.num_layers)]  # [rows, cols, Hkv, hd] each
        h = self.net.run_block(self._embed[ids], self._rope(pos), ctx_kv, block_mask(valid, B))  # [rows, B, hidden]
        first = self._slots.start
        return draft_from_hidden(self.net, h[:, first:first + width], ids[:, 0], self._lm_head, self._embed,
                                 with_confidence=True)

    def _run_draft(self, packed: torch.Tensor, cols: int, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`_draft`, compiled when ``torch_compile`` asks for it (see the class doc).

        The compiled pass reads all keys of the packed pages (those past a context are masked
        anyway) and drafts every slot (sliced after); a single request or page is padded to two
        (a padding row, an unused page), so that only sizes vary and one dynamic graph serves
        every call below the network's ``fold_min_rows`` requests, another every call from there.
        The first call runs the pass eagerly once (the network's stacked weights are
        cached then, so the compiled graph reads them instead of stacking them every call; context
        writes are idempotent), then compiles. Inside a graph capture the compiled pass has run
        on the warm-up with the same inputs, so nothing compiles during a capture. A compile
        failure, or torch's recompile limit, turns ``torch_compile`` off with a warning
        (``stats["compile_errors"]``) and the call runs eagerly.
        """
        if not self.torch_compile or getattr(self, "_shard", None) is not None:
            return self._draft(packed, cols, width)
        rows, c = packed.shape[0], self.config
        try:
            padded = self._at_least_two(packed)
            for dim in (0, 1):  # requests and pages
                torch._dynamo.maybe_mark_dynamic(padded, dim)
            with _recompile_limit_raises():
                if self._compiled is None:
                    t0 = time.perf_counter()
                    self._draft(padded, None, c.draft_width)
                    # unbound (no cycle through self), with a compile cache of its own (see _own_code)
                    self._compiled = torch.compile(_own_code(type(self)._draft))
                    tokens, conf = self._compiled(self, padded, None, c.draft_width)
                    self.stats["compile_s"] += time.perf_counter() - t0
                else:
                    tokens, conf = self._compiled(self, padded, None, c.draft_width)
        except Exception as e:  # noqa: BLE001 - the eager pass is the same computation
            self.torch_compile, self._compiled = False, None
            self.stats["compile_errors"] += 1
            warnings.warn(f"{type(self).__name__}: the compiled propose failed ({type(e).__name__}: {e}); "
                          "torch_compile is now off and proposes run eagerly", RuntimeWarning, stacklevel=2)
            return self._draft(packed, cols, width)
        return tokens[:rows, :width], None if conf is None else conf[:rows, :width]

    def _at_least_two(self, packed: torch.Tensor) -> torch.Tensor:
        """``packed`` with at least two rows and two pages (device ops only: capturable). An added
        row is a padding row (empty context; its staged writes go to the scratch slot); an added
        page column is page 0, whose keys are past every context (masked)."""
        B, D = self.config.block_size, self._defer
        head = 2 * B + 1 + 3 * D
        if packed.shape[1] - head < 2:
            packed = torch.cat([packed, packed.new_zeros(packed.shape[0], head + 2 - packed.shape[1])], 1)
        if packed.shape[0] < 2:
            pad = packed[:1].clone()
            pad[:, 2 * B] = 0
            if D:
                pad[:, 2 * B + 1:2 * B + 1 + 2 * D] = 0
                pad[:, 2 * B + 1 + 2 * D:head] = self.kv.scratch_slot
            packed = torch.cat([packed, pad])
        return packed

    def _graph_key(self, rows: int, cols: int) -> tuple[int, int, bool, bool]:
        """The key of a bucket's propose graph: its requests and keys, and the settings its capture
        fixed (compiled or not; whether the network folds query heads at this many requests:
        ``fold_queries`` and ``fold_min_rows``)."""
        folds_at = getattr(self.net, "folds_at", None)  # an MLA drafter's network never folds
        return rows, cols, self.torch_compile, bool(folds_at and folds_at(rows))

    def _replay(self, packed: torch.Tensor, cols: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Drafted tokens ``[rows, draft_width]`` (and confidences) of the bucket's graph (captured on first use)."""
        key = self._graph_key(packed.shape[0], cols)
        g = self._graphs.get(key)
        if g is None:
            g = self._capture(key, packed)
            return g.tokens, g.confidence
        if g.copied is not None and not g.copied.query():
            g.copied.synchronize()  # the last replay's copy in has read the pinned inputs (several proposes a step)
        g.host.copy_(packed)
        g.dev.copy_(g.host, non_blocking=True)
        g.copied = torch.cuda.Event()
        g.copied.record()
        g.graph.replay()
        return g.tokens, g.confidence

    def _capture(self, key: tuple[int, int, bool, bool], packed: torch.Tensor) -> _ProposeGraph:
        """Capture the bucket's graph; its warm-up (kernels compiled, plans made) runs outside it."""
        t0 = time.perf_counter()
        dev, cols, width = self._embed.device, key[1], self.config.draft_width
        g = _ProposeGraph(packed.pin_memory(), torch.empty(packed.shape, dtype=torch.long, device=dev))
        g.dev.copy_(g.host, non_blocking=True)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        g.graph, (g.tokens, g.confidence) = capture_graph(lambda: self._run_draft(g.dev, cols, width), dev,
                                                          self._mempool)
        self._graphs[key] = g
        self.stats["graphs_captured"] += 1
        self.stats["capture_s"] += time.perf_counter() - t0
        return g


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
