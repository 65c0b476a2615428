"""`ModelRunner`: one target forward per engine step, eager or by CUDA-graph replay.

The engine hands it a :class:`StepInput` (host lists); it returns the logits of
the rows verification needs, the target's token at each of them on the host
(the argmax of greedy rows, the seeded sample of sampled rows, see
:mod:`specdec.sampling`; the step's one device-to-host synchronisation), and
the drafter's target hidden states.

Generation-only steps on CUDA replay a graph captured for their bucket
(:mod:`specdec.graphs`) when the generation backend is capturable; so do
prompt-only steps of few tokens with ``GraphPolicy.prompt_graphs``. Every
other step runs eagerly, and ``stats["eager_reasons"]`` says why. A step's
host inputs reach the device in two non-blocking copies from pinned buffers.
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from specdec.attention.metadata import AttentionMetadata, PhasePlan, plan_step
from specdec.attention.selector import available_backends, select
from specdec.capture import capture_graph
from specdec.graphs import GraphKey, GraphPolicy, graph_key, pad_step_into, prompt_graph_key, split_chunk
from specdec.sampling import RowSampling, sample_rows


@dataclass(slots=True)
class StepInput:
    """One step's tokens, packed context requests first, then generation requests.

    Attributes:
        input_ids, positions, slots: per token. ``[num_tokens]``
        context, generation: ``(q_len, kv_len, page_table)`` per request of each phase.
        rows: token rows whose logits verification reads, in order.
        sampling: the rows of sampled requests and how to sample them; ``None`` when
            every request is greedy (the argmax is the token of every row).
        draft_source: drafted tokens still on the device (``DraftsOnDevice.flat``, int64), or
            ``None``: an input id ``-1 - i`` stands for its ``i``-th token, written into the step's
            input on the device (no host synchronisation between a propose and the step).
    """

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    context: list[tuple[int, int, tuple[int, ...]]]
    generation: list[tuple[int, int, tuple[int, ...]]]
    rows: list[int]
    sampling: RowSampling | None = None
    draft_source: torch.Tensor | None = None


@dataclass(slots=True)
class StepResult:
    """What one forward produced; device tensors stay valid until the next step (a CUDA graph's
    outputs until its next replay, which an overlapped executor may queue before this step's
    commit: it copies ``hidden`` first, and nothing reads ``logits`` after the launch).

    Attributes:
        logits: fp32 logits of ``StepInput.rows``. ``[num_rows, vocab_size]``
        argmax: the target's token at each row: the argmax of greedy rows, the Gumbel-max
            sample of sampled rows, coupled to their drafts (:func:`specdec.sampling.sample_rows`).
            ``[num_rows]``: a device tensor after :meth:`ModelRunner.launch` (valid until the
            next launch), a host list after :meth:`ModelRunner.finish`.
        hidden: the drafter's target layers, concatenated. ``[num_tokens, L * hidden_size]`` or ``None``
        backends: phase → attention backend that ran it.
        graph: whether a CUDA graph was replayed.
    """

    logits: torch.Tensor
    argmax: torch.Tensor | list[int]
    hidden: torch.Tensor | None
    backends: dict[str, str]
    graph: bool = False
    pending: tuple | None = None  # (pinned host copy of argmax, CUDA event): what finish() waits for


@dataclass(slots=True)
class _Captured:
    key: GraphKey
    backend: object
    tokens_host: torch.Tensor  # pinned [3, num_tokens] int64: ids, positions, slots
    tokens_dev: torch.Tensor
    meta_host: torch.Tensor  # pinned [num_seqs, width] int32
    meta_dev: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None
    outputs: tuple = field(default_factory=tuple)  # logits, argmax, hidden
    tokens_np: object = None  # NumPy views of the pinned buffers (the host writes there)
    meta_np: object = None
    copied: object = None  # CUDA event after the last H2D copies from the pinned buffers (overlapped steps)
    rows_host: torch.Tensor | None = None  # prompt buckets: pinned [num_seqs] int64, the rows whose logits
    rows_dev: torch.Tensor | None = None  # the step needs (each request's last token)
    rows_np: object = None

    def __post_init__(self) -> None:
        self.tokens_np, self.meta_np = self.tokens_host.numpy(), self.meta_host.numpy()
        if self.rows_host is not None:
            self.rows_np = self.rows_host.numpy()


class ModelRunner:
    """Runs the target over a step, replaying CUDA graphs where the step fits one.

    Args:
        target: the model.
        pool: its KV pool.
        policy: graph buckets (``None`` disables graphs).
        tokens_per_block: page size.
        shape_of: ``(phase, max_q_len, mixed) -> AttnShape`` of this target and cache.
        hidden_layer_ids: target layers the drafter reads.
        requested_backend: attention backend the user forced, or ``None``.
        scratch_slot: a cache slot no request owns, for the writes of padding tokens.
        shard: under Helix, this rank's :class:`~specdec.parallel.helix.HelixShard` (page tables
            are rank-local, slots ``-1`` where another rank owns the position); steps then run
            eagerly (attention exchanges partials between ranks). ``None``: no Helix.
        backends: the attention backends this runner selects from, its own instances
            (``available_backends(engine_config.attention_config)``); ``None``: every registered
            backend with default options.
        copy_argmax_out: steps will be in flight together (an overlapped executor): each step's
            tokens leave the device through pinned buffers used in turn, and :meth:`finish` waits
            for that step only.
    """

    def __init__(self, target, pool, policy: GraphPolicy | None, tokens_per_block: int, shape_of,
                 hidden_layer_ids=(), requested_backend: str | None = None, scratch_slot: int | None = None,
                 shard=None, backends=None, copy_argmax_out: bool = False):
        self.target, self.pool, self.policy, self.tpb = target, pool, policy, tokens_per_block
        self.shape_of = shape_of
        self.hidden_layer_ids = tuple(hidden_layer_ids)
        self.requested = requested_backend
        self.scratch_slot = scratch_slot
        self.shard = shard
        self.backends = tuple(backends) if backends is not None else tuple(available_backends())
        self._graphs: dict[GraphKey, _Captured] = {}
        self._mempool = None
        # an engine that launches a step before finishing the one before it (overlap_steps): the
        # argmax then leaves the device through pinned buffers used in turn, and finish() waits on
        # an event for that step only
        self.copy_argmax_out = copy_argmax_out
        self._argmax_host: list[torch.Tensor | None] = [None, None]
        self._ring = 0
        # graph/eager step counts, why steps ran eagerly, captures, and which backend ran each phase
        # host time: queueing a step (inputs, launches) and waiting for its argmax
        # chained_steps: steps whose input tokens came from the previous step's argmax on the device
        self.stats = {"graph_steps": 0, "eager_steps": 0, "graphs_captured": 0, "capture_s": 0.0,
                      "eager_reasons": Counter(), "backends": Counter(), "launch_s": 0.0, "wait_s": 0.0,
                      "chained_steps": 0}
        if shard is not None:
            self._no_graph = "Helix context parallelism runs eagerly"
        elif policy is None:
            self._no_graph = "cuda_graphs disabled"
        elif target.device.type != "cuda":
            self._no_graph = f"device is {target.device.type}, graphs need cuda"
        elif scratch_slot is None:
            self._no_graph = "no scratch slot for padding"
        else:
            self._no_graph = ""

    def release_graphs(self) -> None:
        """Drop every captured graph and the memory pool they share (captured again on demand)."""
        self._graphs.clear()
        self._mempool = None

    @property
    def graphs_enabled(self) -> bool:
        """Whether generation steps may replay CUDA graphs (False: why is in ``eager_reasons``)."""
        return not self._no_graph

    @property
    def meta_width(self) -> int:
        return 3 + -(-self.target.max_context // self.tpb)

    # -- entry points ----------------------------------------------------------
    def execute(self, step: StepInput) -> StepResult:
        """Run the target over ``step`` and wait for it."""
        return self.finish(self.launch(step))

    def finish(self, result: StepResult) -> StepResult:
        """Wait for a launched step: its argmax reaches the host (the step's one synchronisation).

        On CUDA this waits for that step only, not for steps launched after it."""
        if isinstance(result.argmax, torch.Tensor):
            t0 = time.perf_counter()
            if result.pending is not None:
                host, event = result.pending
                event.synchronize()
                result.argmax, result.pending = host.tolist(), None
            else:
                result.argmax = result.argmax.tolist()
            self.stats["wait_s"] += time.perf_counter() - t0
        return result

    def launch(self, step: StepInput, ids_from: torch.Tensor | None = None) -> StepResult:
        """Queue the target's forward over ``step`` on the device and return without waiting:
        ``argmax`` is still a device tensor until :meth:`finish` (host work may run meanwhile).

        Args:
            step: the step's inputs.
            ids_from: the step's input tokens as a device tensor (e.g. the previous step's
                ``argmax``, not yet on the host); ``step.input_ids`` is then ignored. The copy is
                ordered after the step that wrote it, so the two steps may be in flight together.
        """
        t0 = time.perf_counter()
        if ids_from is not None:
            if ids_from.shape[0] < len(step.input_ids):
                raise ValueError(f"ids_from has {ids_from.shape[0]} tokens, the step {len(step.input_ids)}")
            self.stats["chained_steps"] += 1
        why = self._no_graph or ("a context phase in the step" if step.context and step.generation else "")
        key = None
        if not why:
            seqs = step.context or step.generation
            keyer = prompt_graph_key if step.context else graph_key
            key, why = keyer(self.policy, [s[0] for s in seqs], [s[1] for s in seqs])
        captured = self._graphs.get(key) if key is not None else None
        backend = captured.backend if captured is not None else None  # selected when it was captured
        if key is not None and captured is None:
            backend, why = self._graph_backend(key)
        if why:
            self.stats["eager_steps"] += 1
            self.stats["eager_reasons"][why] += 1
            result = self._eager(step, ids_from)
        else:
            self.stats["graph_steps"] += 1
            result = self._replay(key, backend, step, ids_from)
        if step.sampling is not None:  # sampled rows: their tokens, still on the device
            with torch.inference_mode():
                result.argmax = sample_rows(result.logits, result.argmax, step.sampling)
        for phase, name in result.backends.items():
            self.stats["backends"][f"{phase}:{name}"] += 1
        if self.copy_argmax_out and isinstance(result.argmax, torch.Tensor) and result.argmax.is_cuda:
            self._copy_argmax_out(result)
        self.stats["launch_s"] += time.perf_counter() - t0
        return result

    def _copy_argmax_out(self, result: StepResult) -> None:
        """Queue the argmax's copy to pinned host memory and record an event after it, so that
        :meth:`finish` waits for this step only (a graph's argmax buffer is overwritten by the
        next replay of that graph, which may already be queued when this step is finished)."""
        n = result.argmax.shape[0]
        self._ring ^= 1
        host = self._argmax_host[self._ring]
        if host is None or host.shape[0] < n:
            host = self._argmax_host[self._ring] = torch.empty(max(n, 64), dtype=torch.long).pin_memory()
        host = host[:n]
        host.copy_(result.argmax, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        result.pending = (host, event)

    def capture_buckets(self, decode_only: bool = False, max_kv_len: int | None = None, progress=None) -> int:
        """Capture every graph bucket now (not during the first steps that need them): the
        generation buckets and, with ``prompt_graphs``, the one-request prompt buckets.

        Each capture runs a synthetic step whose tokens all write to the scratch slot and whose
        page tables name only the scratch page: no request's cache is touched.

        Args:
            decode_only: only single-token buckets (a drafter that never drafts).
            max_kv_len: only context buckets up to the one holding this many tokens.
            progress: called with ``(done, total)`` after each bucket, or ``None``.

        Returns:
            how many graphs were captured (buckets already captured are skipped).
        """
        from specdec.graphs import all_buckets, single_prompt_buckets

        if self._no_graph:
            return 0
        buckets = all_buckets(self.policy, decode_only, max_kv_len)
        buckets += [(k, [n]) for k, n in single_prompt_buckets(self.policy, max_kv_len)]
        buckets = [(k, q) for k, q in buckets if k not in self._graphs]
        page = self.scratch_slot // self.tpb
        if buckets:
            gc.collect()  # once here; each capture below then only holds the collector off
        for done, (key, q_lens) in enumerate(buckets, 1):
            kv = key.max_kv_len if key.phase == "generation" else max(q_lens)
            table = (page,) * -(-kv // self.tpb)
            n = sum(q_lens)
            seqs = [(q, kv, table) for q in q_lens]
            ctx, gen = (seqs, []) if key.phase == "context" else ([], seqs)
            rows = list(range(n)) if key.phase == "generation" else [n - 1]
            step = StepInput([0] * n, [p for q in q_lens for p in range(kv - q, kv)], [self.scratch_slot] * n,
                             ctx, gen, rows)
            backend, why = self._graph_backend(key)
            if why:
                return done - 1
            self._capture(key, backend, step, collect=False)
            if progress is not None:
                progress(done, len(buckets))
        return len(buckets)

    def _graph_backend(self, key: GraphKey):
        """The attention backend a bucket's graph would launch, and why it cannot ("" if it can)."""
        backend = select(self.shape_of(key.phase, key.max_q_len, False), self.requested, self.backends)
        return backend, "" if getattr(backend, "capturable", False) else f"backend {backend.name} cannot be captured"

    # -- eager -----------------------------------------------------------------
    def _eager(self, step: StepInput, ids_from: torch.Tensor | None = None) -> StepResult:
        dev = self.target.device
        slot_mapping = torch.tensor(step.slots, dtype=torch.long, device=dev)
        attn = plan_step(step.context, step.generation, slot_mapping, self.shape_of, self.tpb, self.requested,
                         self.shard, self.backends)
        if ids_from is not None:
            ids = ids_from[: len(step.input_ids)].to(device=dev, dtype=torch.long)
        else:
            ids = torch.tensor(step.input_ids, dtype=torch.long, device=dev)
            if step.draft_source is not None:
                take_drafts_(ids, step.draft_source)
        pos = torch.tensor(step.positions, dtype=torch.long, device=dev)
        layer_ids = self.hidden_layer_ids
        with torch.inference_mode():
            hidden, captured = self.target.forward(ids, pos, attn, self.pool, hidden_layer_ids=layer_ids)
            rows = hidden if len(step.rows) == len(step.input_ids) else hidden[torch.tensor(step.rows, device=dev)]
            logits = self.target.compute_logits(rows)
            aux = torch.cat([captured[i] for i in layer_ids], -1) if layer_ids else None
            argmax = logits.argmax(-1)
        return StepResult(logits, argmax, aux, attn.backends)

    # -- graphs ----------------------------------------------------------------
    def _replay(self, key: GraphKey, backend, step: StepInput, ids_from: torch.Tensor | None = None) -> StepResult:
        g = self._graphs.get(key)
        if g is None:
            g = self._capture(key, backend, step, ids_from)
        else:
            self._fill(g, step, ids_from)
            g.graph.replay()
        n, rows = len(step.input_ids), len(step.rows)
        logits, argmax, aux = g.outputs
        if rows < logits.shape[0]:  # drop the padding rows (views; no copy)
            logits, argmax = logits[:rows], argmax[:rows]
        if aux is not None and n < aux.shape[0]:
            aux = aux[:n]
        return StepResult(logits, argmax, aux, {g.key.phase: g.backend.name}, graph=True)

    def _fill(self, g: _Captured, step: StepInput, ids_from: torch.Tensor | None = None) -> None:
        """Write the step's (padded) inputs into the graph's pinned buffers (their NumPy views), then
        two async copies to the device (and, with ``ids_from``, a device copy of the input tokens).

        With steps in flight together (``copy_argmax_out``), the previous step of this graph may not
        have read the pinned buffers yet: the host first waits for that copy (recorded as an event)."""
        if g.copied is not None:
            g.copied.synchronize()
        pad_step_into(g.tokens_np, g.key, step.input_ids, step.positions, step.slots, self.scratch_slot)
        seqs = step.context if g.key.phase == "context" else step.generation
        g.backend.pack_meta_into(g.meta_np, [s[0] for s in seqs], [s[1] for s in seqs], [s[2] for s in seqs], self.tpb)
        g.tokens_dev.copy_(g.tokens_host, non_blocking=True)
        g.meta_dev.copy_(g.meta_host, non_blocking=True)
        if g.rows_np is not None:  # a prompt bucket: the rows whose logits the step needs; padding reads row 0
            r = len(step.rows)
            g.rows_np[:r], g.rows_np[r:] = step.rows, 0
            g.rows_dev.copy_(g.rows_host, non_blocking=True)
        if self.copy_argmax_out:
            g.copied = torch.cuda.Event()
            g.copied.record()
        if ids_from is not None:
            n = len(step.input_ids)
            g.tokens_dev[0, :n].copy_(ids_from[:n])
        elif step.draft_source is not None:
            take_drafts_(g.tokens_dev[0], step.draft_source)

    def _capture(self, key: GraphKey, backend, step: StepInput, ids_from: torch.Tensor | None = None,
                 collect: bool = True) -> _Captured:
        """Capture the bucket's graph. Its warm-up runs ``step`` for real (same writes, same result).

        ``collect``: collect Python's garbage first (:func:`specdec.capture.capture`)."""
        t0 = time.perf_counter()
        dev = self.target.device
        width = self.meta_width
        prompt = key.phase == "context"
        g = _Captured(key, backend,
                      torch.empty(3, key.num_tokens, dtype=torch.long).pin_memory(),
                      torch.empty(3, key.num_tokens, dtype=torch.long, device=dev),
                      torch.empty(key.num_seqs, width, dtype=torch.int32).pin_memory(),
                      torch.empty(key.num_seqs, width, dtype=torch.int32, device=dev),
                      rows_host=torch.empty(key.num_seqs, dtype=torch.long).pin_memory() if prompt else None,
                      rows_dev=torch.empty(key.num_seqs, dtype=torch.long, device=dev) if prompt else None)
        self._fill(g, step, ids_from)
        plan = backend.graph_plan(g.meta_dev, key.num_tokens, key.max_q_len, key.max_kv_len, self.tpb,
                                  split_chunk=split_chunk(key.max_kv_len))
        shape = self.shape_of(key.phase, key.max_q_len, False)
        attn = AttentionMetadata(g.tokens_dev[2], (PhasePlan(shape, 0, key.num_tokens, backend, plan),))
        layer_ids = self.hidden_layer_ids

        def forward():
            hidden, captured = self.target.forward(g.tokens_dev[0], g.tokens_dev[1], attn, self.pool,
                                                   hidden_layer_ids=layer_ids)
            logits = self.target.compute_logits(hidden[g.rows_dev] if prompt else hidden)
            aux = torch.cat([captured[i] for i in layer_ids], -1) if layer_ids else None
            return logits, logits.argmax(-1), aux

        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():  # the step's result comes from the graph itself (replayed once)
            g.graph, g.outputs = capture_graph(forward, dev, self._mempool, collect=collect)
        self._graphs[key] = g
        self.stats["graphs_captured"] += 1
        self.stats["capture_s"] += time.perf_counter() - t0
        return g


def take_drafts_(ids: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Replace, in place, every input id ``-1 - i`` of ``ids`` by ``source[i]`` (the drafted tokens
    a propose left on the device, ``StepInput.draft_source``): device work only, queued after the
    propose that wrote ``source``, so the host never waits for it."""
    ids.copy_(torch.where(ids < 0, source.take((-1 - ids).clamp_(min=0)), ids))
    return ids
