"""`SpecEngine`: speculative decoding over a target and a drafter.

One step is: schedule, propose, run the target once over every scheduled token,
verify, commit (:meth:`SpecEngine.step`). The scheduler lays the step out once as a
:class:`~specdec.scheduler.StepPlan` and owns every request's KV; an executor
(:mod:`specdec.executor`) decides whether steps overlap on the device. ``generate``
loops steps for a list of prompts; a serving stack calls ``add_request`` / ``step`` /
``abort`` itself.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import os
import secrets
import time
import warnings
from collections.abc import Iterable, Sequence as Seq

import torch

from specdec.attention.selector import get_backend
from specdec.config import EngineConfig, SamplingParams, engine_config
from specdec.draft_gate import DraftGate
from specdec.drafters.base import EMPTY_DRAFT, DeviceIds, Draft, Drafter, NullDrafter, check_hooks, on_device, to_host
from specdec.errors import (ConfigError, EngineClosedError, InvalidRequestError,
                            PromptTooLongError, UnknownRequestError, VocabMismatchError)
from specdec.kvcache import KVCacheManager, KVPool, num_pages_for_budget, pages_for
from specdec.kvcache.sizing import default_kv_budget
from specdec.kvcache.draft_kv import DraftKV
from specdec.executor import OverlapExecutor, PlainExecutor, overlap_wanted
from specdec.graphs import GraphPolicy
from specdec.heap import frozen_heap
from specdec.model_runner import ModelRunner
from specdec.parallel.runtime import helix_shard, local_num_pages, page_manager
from specdec.scheduler import Scheduler, StepPlan, decide_kv_sharing
from specdec.sequence import GenerationOutput, Sequence, Status, StepOutput
from specdec.verify import verify_chains


_SCRATCH = object()  # owns the padding slot in the page manager; never equal to a request id


#: what the engine reads of a target before it builds anything (specdec.target.Target)
_TARGET_API = ("vocab_size", "max_context", "eos_token_ids", "layer_specs", "attn_shape", "forward")


def _check_chat(chat) -> None:
    if chat is not None and not isinstance(chat, bool):
        raise InvalidRequestError(f"chat must be True, False or None (the engine config's choice), got {chat!r}")


class SpecEngine:
    """Speculative decoding engine: lossless with respect to ``target`` alone.

    A drafter is untrusted: every draft is validated (length, ids in ``[0, vocab_size)``,
    ``probs`` shape, confidences), and a drafter that raises or returns a bad draft costs only the
    request concerned its draft for that step (it decodes plainly); a drafter whose lifecycle
    hook (``start_request``, ``on_accepted``, ``on_contexts``) raises for a request no longer
    drafts for it. Each fault counts in ``fault_stats`` and the request's
    ``stats.drafter_faults``; the first fault of a request also gives one ``RuntimeWarning``.
    A step that fails anyway (e.g. the target's forward raises) leaves every request as it was.

    The engine holds its KV pool until it is dropped or :meth:`close` d; ``with SpecEngine(...)
    as engine:`` closes it on exit.

    Args:
        target: the model to reproduce (see :class:`specdec.target.Target`).
        drafter: proposes tokens; ``None`` means :class:`NullDrafter` (plain decoding).
        config: engine settings; keyword ``overrides`` replace its fields.

    Raises:
        ConfigError: ``target`` is not a loaded target (a name or path: load it with
            :func:`~specdec.target.load_target`), ``config`` is not an ``EngineConfig``, an override
            names no field of it, or a value is invalid (the message names the field).
        MissingHookError: the drafter lacks a hook the scheduler needs.
        VocabMismatchError: the drafter's vocabulary differs from the target's.
        ConfigError / UnsupportedShapeError: a forced attention backend is unknown
            or cannot run this target's shapes.
        HelixConfigError: ``helix_cp > 1`` with a non-MLA target, heads ``attention_tp * helix_cp``
            does not divide, no process group of ``attention_tp * helix_cp`` ranks, or
            ``attention_tp > 1`` without Helix (see :mod:`specdec.parallel.runtime`).
    """

    def __init__(self, target, drafter: Drafter | None = None, config: EngineConfig | None = None, **overrides):
        missing = [a for a in _TARGET_API if not hasattr(target, a)]
        if missing:
            hint = f"; load it first: load_target({target!r})" if isinstance(target, (str, os.PathLike)) else ""
            raise ConfigError(f"target must be a loaded target (specdec.target.load_target), got "
                              f"{type(target).__name__}, which lacks {', '.join(missing)}{hint}")
        self.target = target
        self.drafter = drafter if drafter is not None else NullDrafter()
        self.config = cfg = engine_config(config, overrides)
        self._closed = False
        check_hooks(self.drafter)
        if self.drafter.vocab_size is not None and self.drafter.vocab_size != target.vocab_size:
            raise VocabMismatchError(
                f"drafter vocab_size must equal the target's ({target.vocab_size}), got {self.drafter.vocab_size}"
            )
        tpb = cfg.tokens_per_block
        #: this rank's Helix part (docs/design.md §7), ``None`` without Helix (helix_cp == 1)
        self.helix = helix_shard(cfg.helix_cp, target, tpb, cfg.attention_tp)
        draft_specs = tuple(self.drafter.kv_layer_specs())
        self.kv_decision = decide_kv_sharing(draft_specs, self.drafter.reads_managed_ctx_pages,
                                             self.drafter.reads_helix_sharded_ctx_pages, tpb,
                                             target_accepts_appended_layers=cfg.share_draft_kv is not False,
                                             helix_cp=cfg.helix_cp)
        if cfg.share_draft_kv and draft_specs and not self.kv_decision.shared:
            raise ConfigError(f"share_draft_kv=True but the drafter's layers cannot join the target pool: "
                              f"{self.kv_decision.reason}")
        specs = list(target.layer_specs(cfg.kv_dtype, cfg.kv_scale))
        per_token = sum(s.bytes_per_token for s in specs) + (
            sum(s.bytes_per_token for s in draft_specs) if self.kv_decision.shared else 0)
        num_pages = local_num_pages(cfg.num_pages or self._default_num_pages(per_token), self.helix)
        self.pool = KVPool(specs, num_pages, tpb, device=target.device)
        self.manager = page_manager(num_pages, tpb, self.helix)
        self._scratch_slot = None  # one slot no request owns, for padding tokens' writes (graphs on CUDA)
        if cfg.cuda_graphs and target.device.type == "cuda" and self.helix is None:
            self.manager.allocate(_SCRATCH, 1)
            self._scratch_slot = self.manager.slots(_SCRATCH, 0, 1)[0]
        self.draft_kv = self._draft_kv(draft_specs)
        self.drafter.bind(target, self.draft_kv)
        self.scheduler = Scheduler(self.manager, cfg.max_num_seqs, cfg.max_prefill_tokens)
        # most draft tokens a request verifies per step; 0: the drafter never drafts (no slots reserved)
        self._max_draft = 0 if getattr(self.drafter, "never_drafts", False) else cfg.max_draft_tokens
        self._check_forced_backend()
        #: draft_gate: how many tokens steps draft, per batch size, by measured tokens/s (None: max_draft_tokens)
        # None: as the drafter declares, but never across ranks (each would decide from its own step times)
        gated = cfg.draft_gate if cfg.draft_gate is not None else (
            bool(getattr(self.drafter, "gated_by_default", False)) and cfg.helix_cp == 1 and cfg.attention_tp == 1)
        self._gate = DraftGate(self._max_draft) if gated and self._max_draft else None
        self._draft_cap = self._max_draft  # the most tokens a request drafts this step (the gate's choice)
        overlap = overlap_wanted(cfg.overlap_steps, not self._max_draft, target.device.type,
                                 type(self.drafter).__name__, cfg.max_draft_tokens, cfg.helix_cp,
                                 draft_gate=self._gate is not None)
        self.runner = self._model_runner(overlap)
        # where a step's time goes: the drafter, the target's forward (with the one wait), verification,
        # committing the tokens (host) and the scheduler's plan (schedule and pack)
        self.timings = {"steps": 0, "draft_s": 0.0, "forward_s": 0.0, "verify_s": 0.0, "host_s": 0.0,
                        "plan_s": 0.0, "overlapped_steps": 0}
        #: how steps follow each other (:mod:`specdec.executor`): ``plain`` or ``overlap``
        self.executor = (OverlapExecutor(self.scheduler, self.runner, target.max_context, self.timings, self._gate)
                         if overlap else PlainExecutor())
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._last_backends: dict[str, str] = {}
        self._cost_profile = None  # draft_length="confidence": loaded or measured at first use
        #: draft_length="confidence": steps cut, tokens drafted and tokens kept for verification
        self.draft_length_stats = {"steps": 0, "drafted": 0, "kept": 0}
        #: drafter faults the engine contained: ``drafter_errors`` (a drafter call raised),
        #: ``invalid_drafts`` (a draft failed validation)
        self.fault_stats = {"drafter_errors": 0, "invalid_drafts": 0}
        self._plan: StepPlan | None = None  # the plan of the step under way (undone if it fails)
        self._no_draft: set[str] = set()  # requests whose drafter state failed: decoded plainly to the end
        self._joined = 0  # of the last committed step: requests that emitted their first tokens (DraftGate.joined)
        self._warned: set[str] = set()  # requests (or "" for the engine) already warned about

    def _default_num_pages(self, per_token: int) -> int:
        """Pages for ``kv_cache_bytes``, or by default for ``max_num_seqs`` requests of the whole
        context (plus the scratch page), within what the device has; under Helix a rank's share."""
        cfg, tpb = self.config, self.config.tokens_per_block
        budget = cfg.kv_cache_bytes
        if budget is None:  # under Helix rank 0 holds the most: a context's pages over cp, rounded up
            need = (cfg.max_num_seqs * pages_for(self.target.max_context, tpb * cfg.helix_cp) + 1) * tpb * per_token
            budget = default_kv_budget(need, self.target.device)
        return num_pages_for_budget(budget, per_token, tpb)

    def _model_runner(self, overlap: bool) -> ModelRunner:
        """The runner; ``overlap``: steps will be in flight together (see ``ModelRunner.copy_argmax_out``)."""
        cfg = self.config
        policy, scratch = None, self._scratch_slot
        if cfg.cuda_graphs:
            policy = GraphPolicy(cfg.max_num_seqs, cfg.max_draft_tokens, self.target.max_context, cfg.batch_invariant,
                                 cfg.prompt_graphs)
        from specdec.attention.selector import available_backends

        # a partial, not a bound method: the runner must not keep the engine alive (a reference cycle)
        return ModelRunner(self.target, self.pool, policy, cfg.tokens_per_block, self._shape_of(),
                           self.drafter.target_layer_ids, cfg.attention_backend, scratch, shard=self.helix,
                           backends=available_backends(cfg.attention_config), copy_argmax_out=overlap)

    def _shape_of(self):
        """``(phase, max_q_len, mixed) -> AttnShape`` of this target, cache and Helix degree."""
        cfg = self.config
        return functools.partial(_shape_of, self.target, cfg.tokens_per_block, cfg.kv_dtype, cfg.helix_cp,
                                 cfg.attention_tp)

    # -- public API ------------------------------------------------------------
    def _draft_kv(self, draft_specs) -> DraftKV | None:
        """Place the drafter's KV layers as the sharing decision says."""
        if not draft_specs:
            return None
        if self.kv_decision.shared:  # under Helix: sharded like the target's, one page table per request
            return DraftKV(self.pool, self.pool.add_layers(draft_specs), self.manager, shared=True,
                           scratch_slot=self._scratch_slot, shard=self.helix)
        tpb = self.kv_decision.draft_tokens_per_block
        # as many tokens as the target's pages hold (all ranks together under Helix: this pool is
        # unsharded), plus one partly filled page per running request
        pages = -(-self.manager.num_pages * self.config.tokens_per_block // tpb) + self.config.max_num_seqs
        # one page more than its manager hands out: its first slot takes padding writes
        pool = KVPool(draft_specs, pages + 1, tpb, device=self.target.device)
        return DraftKV(pool, range(len(draft_specs)), KVCacheManager(pages, tpb), shared=False,
                       scratch_slot=pages * tpb)

    @property
    def kv_layout(self) -> dict:
        """Which pools exist, which layers each holds, and why (the sharing decision and its reason).

        ``helix_cp`` is the Helix degree and ``attention_tp`` the attention tensor-parallel degree;
        a pool's ``sharded`` says whether it holds only this rank's pages (its ``num_pages`` are then
        this rank's)."""
        def describe(name, pool, sharded):
            return {"name": name, "tokens_per_block": pool.tokens_per_block, "num_pages": pool.num_pages,
                    "target_layers": pool.layer_ids("target"), "draft_layers": pool.layer_ids("draft"),
                    "bytes_per_token": pool.bytes_per_token, "sharded": sharded}

        pools = [describe("target", self.pool, self.helix is not None)]
        if self.draft_kv is not None and not self.draft_kv.shared:
            pools.append(describe("draft", self.draft_kv.pool, False))
        return {"pools": pools, "shared": self.kv_decision.shared, "reason": self.kv_decision.reason,
                "helix_cp": self.config.helix_cp, "attention_tp": self.config.attention_tp}

    @property
    def graph_stats(self) -> dict:
        """CUDA-graph steps vs eager steps (with the reasons), graphs captured and their time,
        and how many steps each ``phase:backend`` ran."""
        st = self.runner.stats
        return {**st, "eager_reasons": dict(st["eager_reasons"]), "backends": dict(st["backends"])}

    def capture_graphs(self, max_kv_len: int | None = None, progress: bool = True) -> int:
        """Capture the CUDA graph of every generation bucket (and, with ``prompt_graphs``, every
        one-request prompt bucket) now, before serving; and the drafter's propose graphs
        (:meth:`Drafter.capture_graphs`); and compile the sampling kernels
        (:func:`specdec.sampling.warm_up`).

        Without it a bucket is captured by the first step that needs it (tens of ms, inside
        that step). Captures use the scratch slot only; no request is touched. A no-op (0)
        where graphs are off (``cuda_graphs=False``, not on CUDA).

        Args:
            max_kv_len: the longest context (prompt + output) to prepare for; buckets for
                longer contexts are still captured on demand (default: the model's context).
            progress: show a progress bar.

        Returns:
            how many graphs were captured.

        Raises:
            ConfigError: ``max_kv_len`` is not a positive integer.
        """
        decode_only = self._max_draft == 0
        bar = None
        if progress and self.runner.graphs_enabled:
            from tqdm.auto import tqdm

            bar = tqdm(unit="graph", desc="capture graphs")

        def tick(done: int, total: int) -> None:
            bar.total = total
            bar.update(1)

        try:
            done = self.runner.capture_buckets(decode_only, max_kv_len, tick if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
        capture = getattr(self.drafter, "capture_graphs", None)  # the drafter's propose shapes too
        if capture is not None and self._max_draft and self.runner.graphs_enabled:
            done += capture(self.config.max_num_seqs, max_kv_len or self.target.max_context)
        if self.runner.graphs_enabled:  # and the sampling kernels, before a sampled request needs them
            from specdec.sampling import warm_up

            warm_up(self.target.vocab_size, self.target.device)
        return done

    def warm_up(self, max_prompt_len: int | None = None, progress: bool = False) -> int:
        """Run every kind of step once now, so that no request meets a first-time cost later.

        Captures the graphs (:meth:`capture_graphs`), then runs throwaway requests through real
        steps: one prompt of each power-of-two length bucket (and one just below it) up to
        ``max_prompt_len``, whose eager prompt steps compile the kernels their tile sizes need
        (Triton compiles a kernel the first time it meets new tile sizes, ~0.5-1 s on a GPU); two
        prompts in one step; and each bucket's prompt again, in a step beside a greedy and a
        sampled request that decode (a mixed step, with their drafts' verify rows). The drafter
        proposes for them as for any request. They are aborted after a few steps (a suffix drafter
        indexes none of them) and forgotten; the engine's timings are left as they were.
        ``specdec serve`` calls it before it reports ready.

        Args:
            max_prompt_len: the longest prompt to prepare for (default: the longest the model
                takes; lengths the KV pool cannot hold are skipped).
            progress: show a progress bar of the warm-up's requests.

        Returns:
            The steps run.

        Raises:
            InvalidRequestError: requests are waiting or running (warm up an idle engine), or
                ``max_prompt_len`` is not a positive integer.
            EngineClosedError: the engine was closed.
        """
        self._check_open()
        if self.has_unfinished():
            raise InvalidRequestError("warm_up needs an idle engine: requests are waiting or running")
        if max_prompt_len is not None and (not isinstance(max_prompt_len, int) or isinstance(max_prompt_len, bool)
                                           or max_prompt_len < 1):
            raise InvalidRequestError(f"max_prompt_len must be a positive integer or None, got {max_prompt_len!r}")
        self.capture_graphs(progress=progress)
        if self.config.draft_length == "confidence" and self._max_draft:
            self.cost_profile()  # measured (or loaded) now, not at the first step that cuts a draft
        limit = self.target.max_context - 3 - self._max_draft  # a prompt, two steps and a draft fit
        limit = min(limit, max_prompt_len) if max_prompt_len is not None else limit
        if limit < 1:
            return 0
        lengths, bucket = [], 16
        while bucket // 2 < limit:  # each power-of-two bucket: just below it, and at it
            lengths += [n for n in (bucket - 1, bucket) if n <= limit]
            bucket *= 2
        lengths = sorted(set(lengths + [limit]))
        vocab = self.target.vocab_size
        # more tokens than a few steps emit: no warm-up request finishes (a finished response could
        # join a drafter's index); the context bound still caps drafts
        greedy = SamplingParams(max_new_tokens=64, ignore_eos=True)
        sampled = SamplingParams(max_new_tokens=64, ignore_eos=True, temperature=0.8, top_p=0.95, seed=0)

        def prompt(n: int, salt: int) -> list[int]:  # repeats, so that a suffix drafter drafts
            period = 13 + salt
            return [(salt * 7919 + 31 * (i % period)) % vocab for i in range(n)]

        # each group: (requests to add, steps to run after adding them) in turn, then all aborted
        groups = [[([(n, greedy)], 2)] for n in lengths]  # one prompt a step, each bucket
        groups.append([([(min(limit, 40), greedy), (min(limit, 24), sampled)], 2)])  # two prompts in one step
        decoding = ([(min(limit, 12), greedy), (min(limit, 10), sampled)], 2)  # prompt step, then a decode step
        groups += [[decoding, ([(n, greedy)], 1)] for n in lengths]  # each bucket's prompt beside them: mixed
        saved = dict(self.timings), dict(self.draft_length_stats)
        bar = _progress(len(groups), unit="group", desc="warm up") if progress else None
        steps, made = 0, []

        def run(group) -> None:
            nonlocal steps
            for batch, after in group:
                for n, params in batch:
                    req_id = f"__warm_up_{len(made)}"
                    try:
                        self.add_request(prompt(n, len(made)), params, req_id=req_id, chat=False)
                    except PromptTooLongError:  # the pool cannot hold it: nothing to prepare for
                        continue
                    made.append(req_id)
                for _ in range(after):
                    if self.has_unfinished():
                        self.step()
                        steps += 1
            for req_id in made:
                self.abort(req_id)
            if bar is not None:
                bar.update(1)

        try:
            for group in groups:
                run(group)
        finally:
            for req_id in made:  # aborted (which forgets their drafter state and warnings), then released
                self.abort(req_id)
                if req_id in self._seqs:
                    self.release(req_id)
            self.timings.update(saved[0])
            self.draft_length_stats.update(saved[1])
            if bar is not None:
                bar.close()
        return steps

    @property
    def attention_backends(self) -> dict[str, str]:
        """Backend that ran each phase of the last step (``{"context": ..., "generation": ...}``)."""
        return dict(self._last_backends)

    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None,
                    req_id: str | None = None, chat: bool | None = None) -> str:
        """Queue one request; running requests are not disturbed if it is invalid.

        Args:
            prompt: a non-empty string, or a non-empty list (tuple, array) of integer token ids in
                ``[0, vocab_size)`` as the target should see them; ``[42]`` is the one-token prompt 42.
            params: sampling parameters (greedy, 256 tokens by default).
            req_id: an id of your own (must be unused).
            chat: apply the target's chat template to a text prompt
                (default: ``EngineConfig.apply_chat_template``).

        Returns:
            The request id.

        Raises:
            InvalidRequestError: a prompt that is neither (e.g. ``42``, ``None``, ``[None]``), empty,
                or with ids outside the vocabulary; params not a ``SamplingParams``; a used ``req_id``;
                ``chat`` not ``True``, ``False`` or ``None``.
            PromptTooLongError: the prompt does not fit the model's context or the pool.
            EngineClosedError: the engine was closed.
        """
        self._check_open()
        _check_chat(chat)
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = self._tokenize(prompt, self.config.apply_chat_template if chat is None else chat)
        req_id = str(next(self._ids)) if req_id is None else str(req_id)
        if req_id in self._seqs:
            raise InvalidRequestError(f"req_id {req_id!r} is already in use")
        # sampling draws its noise from the seed by position; without one, a random seed (specdec.sampling)
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        seq = Sequence(req_id, ids, params, seed=seed)
        self._seqs[req_id] = seq
        self._drafter_call(seq, "start_request", req_id, ids)
        self.scheduler.add(seq)
        return req_id

    def abort(self, req_id: str) -> None:
        """Stop a request now; its pages are freed and its output keeps what it has."""
        seq = self._seqs.get(str(req_id))
        if seq is None or seq.status is Status.FINISHED:
            return
        self._finish(seq, "abort")
        self.executor.settle()  # a step launched ahead for requests that all ended is dropped now

    def has_unfinished(self) -> bool:
        """Whether any request waits or runs."""
        return self.scheduler.has_unfinished()

    def output(self, req_id: str) -> GenerationOutput:
        """The request's output so far (final once it finished).

        Raises:
            UnknownRequestError: no such request (never added, or released); also a ``KeyError``.
        """
        seq = self._seqs.get(str(req_id))
        if seq is None:
            raise UnknownRequestError(f"req_id {str(req_id)!r} is not a request of this engine "
                                      f"(never added, or already released); known: {sorted(self._seqs)[:10]}")
        return GenerationOutput(seq.req_id, tuple(seq.prompt_ids), tuple(seq.output_ids), self._text(seq),
                                seq.finish_reason, seq.stats)

    def release(self, req_id: str) -> GenerationOutput:
        """Return a request's output, and forget the request if it finished.

        Raises:
            UnknownRequestError: no such request.
        """
        out = self.output(req_id)
        if self._seqs[str(req_id)].status is Status.FINISHED:
            del self._seqs[str(req_id)]
        return out

    def step(self) -> list[StepOutput]:
        """Run one engine step and return each scheduled request's new tokens.

        With ``overlap_steps``, the step may finish a decode step launched by the previous call
        and launch the next one before waiting (:class:`specdec.executor.OverlapExecutor`).

        A step is all or nothing for the scheduler: if it raises (the target's forward fails, an
        interrupt), every request is left as before it, and the next step runs them again.
        Drafter faults do not fail a step (see the class docstring).

        Raises:
            EngineClosedError: the engine was closed.
        """
        self._check_open()
        try:
            return self._step()
        except BaseException:
            self._undo_step()
            raise

    def _step(self) -> list[StepOutput]:
        t0, batch = time.perf_counter(), max(1, len(self.scheduler.running))
        plan = self._plan = self.executor.take_launched()  # overlap: a plain decode step already under way
        ahead = plan is not None
        if ahead:
            self._draft_cap = 0
        else:
            self._draft_cap = self._max_draft if self._gate is None else self._gate.draft_length(batch)
            plan = self._plan = self.scheduler.schedule(self._draft_budget)
            if not plan:
                return self._unschedulable()
            t1 = time.perf_counter()
            drafts = self._propose(plan)
            t2 = time.perf_counter()
            self.scheduler.pack(plan, drafts)  # slots, rows and page tables, laid out once
            self.timings["plan_s"] += (t1 - t0) + (time.perf_counter() - t2)
            self._launch(plan)
        self.executor.launched(plan)  # overlap: queue the next decode step before waiting for this one
        self._wait(plan)
        emitted = self._verify(plan)
        outs = self._commit(plan, emitted)
        self._plan = None  # committed: nothing to undo from here on
        self.executor.settle()
        if self._gate is not None and not plan.context:  # a prompt chunk's compute would swamp the comparison
            self._gate.record(batch, self._draft_cap, [max(0, len(o.new_token_ids) - 1) for o in outs],
                              time.perf_counter() - t0, ahead=ahead)
        if self._gate is not None and self._joined:  # requests that emitted their first tokens: new text
            self._gate.joined(max(self._joined, len(self.scheduler.running)), self._joined)
        return outs

    def _undo_step(self) -> None:
        """After a failed step: drop a step launched ahead and give the scheduler back the state
        it had before the step (:meth:`Scheduler.undo`)."""
        plan, self._plan = self._plan, None
        self.executor.reset()
        if plan:
            self.scheduler.undo(plan)

    # -- lifetime --------------------------------------------------------------
    def close(self) -> None:
        """Abort every unfinished request and release the KV cache and CUDA graphs now.

        Outputs stay readable (:meth:`output`, :meth:`release`); ``add_request``, ``step`` and
        ``generate`` then raise :class:`EngineClosedError`. Closing twice does nothing. Dropping
        the last reference to an engine frees the same memory without ``close()``.
        """
        if self._closed:
            return
        self._closed = True
        self._plan = None
        self.executor.reset()
        for seq in list(self._seqs.values()):
            if seq.status is not Status.FINISHED:
                self._finish(seq, "abort")
        self.runner.release_graphs()
        for pool in {id(p): p for p in (self.pool, self.draft_kv.pool if self.draft_kv else None) if p}.values():
            pool.k.clear()
            pool.v.clear()
        if self.target.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> SpecEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("this engine was closed (SpecEngine.close); build a new one")

    def generate(self, prompts: str | Iterable[str | Seq[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 chat: bool | None = None, progress: bool = False, **param_overrides) -> list[GenerationOutput]:
        """Generate for many prompts at once, batching them step by step.

        Args:
            prompts: a list of prompts, each a string or a list of token ids (see :meth:`add_request`);
                one string is one prompt. ``[42]`` is a list holding the prompt ``42``, an error: the
                one-token prompt is ``[[42]]``.
            params: one ``SamplingParams`` for all, or one per prompt.
            chat: apply the chat template (default: the engine config's choice).
            progress: show a progress bar of generated tokens (it completes when requests end early).
            **param_overrides: ``SamplingParams`` fields, e.g. ``max_new_tokens=64``.

        Returns:
            One output per prompt, in order.

        Raises:
            InvalidRequestError: ``prompts`` is not a non-empty list, a prompt is invalid (see
                :meth:`add_request`), or bad parameters (``chat``, ``progress`` included).
            EngineClosedError: the engine was closed.
        """
        self._check_open()
        _check_chat(chat)
        if not isinstance(progress, bool):
            raise InvalidRequestError(f"progress must be True or False, got {progress!r}")
        if isinstance(prompts, str):
            prompts = [prompts]
        elif isinstance(prompts, (bytes, dict)) or not isinstance(prompts, Iterable):
            raise InvalidRequestError(f"prompts must be a non-empty list of strings or token-id lists, "
                                      f"got {type(prompts).__name__} {prompts!r:.50}")
        prompts = list(prompts)
        if not prompts:
            raise InvalidRequestError("prompts must be a non-empty list of strings or token-id lists, got []")
        if param_overrides:  # SamplingParams refuses a field it does not have, naming its fields
            base = params if isinstance(params, SamplingParams) else SamplingParams()
            params = SamplingParams(**{**{f: getattr(base, f) for f in base.__slots__}, **param_overrides})
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequestError(f"params must be one SamplingParams or {len(prompts)} of them, got {len(plist)}")
        for p in prompts:  # validate everything before queueing anything
            self._tokenize(p, self.config.apply_chat_template if chat is None else chat)
        req_ids = [self.add_request(p, sp, chat=chat) for p, sp in zip(prompts, plist)]
        bar = _progress(sum(sp.max_new_tokens for sp in plist)) if progress else None
        pending = set(req_ids)
        with frozen_heap(self.config.freeze_heap):  # full GC passes skip the model, graphs and pools
            while pending:
                for out in self.step():
                    if bar is not None:
                        bar.update(len(out.new_token_ids))
                        if out.finished:  # ended early (eos, stop, ...): the bar's total loses what it will not generate
                            seq = self._seqs[out.req_id]
                            bar.total -= seq.params.max_new_tokens - seq.num_output
                            bar.refresh()
                    if out.finished:
                        pending.discard(out.req_id)
        if bar is not None:
            bar.close()
        return [self.release(r) for r in req_ids]

    # -- step parts ------------------------------------------------------------
    def _draft_budget(self, seq: Sequence) -> int:
        if not self._draft_cap or seq.req_id in self._no_draft:
            return 0
        left = min(seq.params.max_new_tokens - seq.num_output, self.target.max_context - len(seq.tokens))
        return max(0, min(self._draft_cap, left - 1))

    def _propose(self, plan: StepPlan) -> list[Draft]:
        """One validated draft per generation request of ``plan``, each within its budget
        (cut by confidence with ``draft_length="confidence"``)."""
        t0 = time.perf_counter()
        asking = [(s, b) for s, b in zip(plan.generation, plan.budgets) if b > 0]
        if not asking:  # nothing to draft (the null drafter's every step): nothing to check either
            self.timings["draft_s"] += time.perf_counter() - t0
            return [EMPTY_DRAFT] * len(plan.generation)
        k = max(b for _, b in asking)
        proposed = self._drafts_of(asking, k)
        fast = _valid_drafts_fast(proposed, k, [b for _, b in asking], self.target.vocab_size)
        if fast is not None:  # the common case: host drafts, all well formed
            drafts = {s.req_id: d for (s, _), d in zip(asking, fast)}
            out = [drafts.get(s.req_id, EMPTY_DRAFT) for s in plan.generation]
        else:  # one by one: a bad draft costs only its request; drafts may be left on the device
            drafts = {}
            for (s, b), d in zip(asking, proposed):
                try:
                    drafts[s.req_id] = _valid_draft(d, k, b, self.target.vocab_size) if d is not None else Draft()
                except (TypeError, ValueError) as e:  # TypeError: fields of the wrong kind (len(None), ...)
                    drafts[s.req_id] = Draft()
                    self._drafter_fault(s, "invalid_drafts", f"invalid draft ({e}); dropped for this step")
            out = self._device_drafts_fed(plan.generation,
                                          [drafts.get(s.req_id, EMPTY_DRAFT) for s in plan.generation])
        cut = self.config.draft_length == "confidence"
        if cut and any(d.confidence for d in out):
            out = self._cut_drafts(out)
        self.timings["draft_s"] += time.perf_counter() - t0
        return out

    def _device_drafts_fed(self, seqs: list[Sequence], drafts: list[Draft]) -> list[Draft]:
        """Which drafts left on the device the step reads there: those of one propose (the first
        whose values the host has not read), for greedy requests, when no confidence cut reads
        their confidences. Every other one is read and checked on the host now
        (:meth:`_drafts_to_host`; it waits for its propose if not read yet), as
        :meth:`Scheduler.pack` then feeds its values."""
        cut = self.config.draft_length == "confidence"
        source = None
        keep = []
        for seq, d in zip(seqs, drafts):
            src = on_device(d)
            ok = src is not None and not src.fetched and seq.params.greedy and source in (None, src)
            ok = ok and not (cut and isinstance(d.confidence, DeviceIds))
            if ok:
                source = src
            keep.append(ok or (src is None and not isinstance(d.confidence, DeviceIds)))
        if all(keep):
            return drafts
        drafts = list(drafts)
        for want_read in (True, False):  # then those of a propose just read for another request (now free)
            todo = [i for i, k in enumerate(keep) if not k] if want_read else \
                   [i for i, d in enumerate(drafts) if on_device(d) is not None and on_device(d).fetched]
            for i, d in zip(todo, self._drafts_to_host([seqs[i] for i in todo], [drafts[i] for i in todo])):
                drafts[i] = d
        return drafts

    def _drafts_to_host(self, seqs: list[Sequence], drafts: list[Draft]) -> list[Draft]:
        """``drafts`` with the values of those left on the device read on the host (waiting for them
        if the step has not been waited for) and checked: a draft with an id outside the
        vocabulary is dropped (the request decodes plainly this step; the device fed it clamped
        ids, whose rows verification then does not read), a fault counted."""
        out = []
        for seq, d in zip(seqs, drafts):
            if on_device(d) is not None or isinstance(d.confidence, DeviceIds):
                d = to_host(d)
                what = ""
                if d.token_ids and not 0 <= min(d.token_ids) <= max(d.token_ids) < self.target.vocab_size:
                    bad = [t for t in d.token_ids if not 0 <= t < self.target.vocab_size][:5]
                    what = f"draft token ids must be in [0, {self.target.vocab_size}), got {bad}"
                elif d.confidence is not None and not all(0.0 <= c <= 1.0 for c in d.confidence):  # NaN fails too
                    what = f"draft confidence must be numbers in [0, 1], got {d.confidence[:5]}"
                if what:
                    self._drafter_fault(seq, "invalid_drafts", f"invalid draft ({what}); dropped for this step")
                    d = EMPTY_DRAFT
            out.append(d)
        return out

    def _cut_drafts(self, drafts: list[Draft]) -> list[Draft]:
        """Each draft cut where its expected accepted tokens per unit of step cost stop rising
        (:func:`specdec.draft_length.kept_lengths`, over this step's whole batch)."""
        from specdec.draft_length import kept_lengths

        keep = kept_lengths([d.confidence for d in drafts], [len(d) for d in drafts], self.cost_profile())
        stats = self.draft_length_stats
        stats["steps"] += 1
        stats["drafted"] += sum(len(d) for d in drafts)
        stats["kept"] += sum(keep)
        return [d if k == len(d) else Draft(d.token_ids[:k], None if d.probs is None else d.probs[:k],
                                            d.confidence[:k]) for d, k in zip(drafts, keep)]

    @property
    def draft_gate(self) -> DraftGate | None:
        """With ``draft_gate``: the engine's :class:`~specdec.draft_gate.DraftGate` (read its
        :meth:`~specdec.draft_gate.DraftGate.stats`, or :meth:`~specdec.draft_gate.DraftGate.keep_history`
        to see its measured steps); ``None`` without it."""
        return self._gate

    @property
    def draft_gate_stats(self) -> dict | None:
        """With ``draft_gate``: per batch-size bucket (``"5-8"``), the draft length its steps take now
        (0: plain steps), and per length its steps, estimated tokens/s and accepted tokens per request
        (:meth:`specdec.draft_gate.DraftGate.stats`); ``None`` without it."""
        return None if self._gate is None else self._gate.stats()

    def cost_profile(self):
        """The step-cost profile ``draft_length="confidence"`` uses: ``EngineConfig.cost_profile`` if
        given, else one measured for this target, device and page size, cached on disk."""
        if self._cost_profile is None:
            from specdec.draft_length import CostProfile, profile_key
            from specdec.target.loading import cache_dir

            if self.config.cost_profile is not None:
                self._cost_profile = CostProfile.load(self.config.cost_profile)
            else:
                path = cache_dir() / "cost_profiles" / f"{profile_key(self.target, self.config.tokens_per_block)}.json"
                if path.is_file():
                    self._cost_profile = CostProfile.load(path)
                else:
                    self._cost_profile = CostProfile.measure(self.target, self.config.tokens_per_block,
                                                             backends=self.runner.backends)
                    self._cost_profile.save(path)
        return self._cost_profile

    def _drafts_of(self, asking: list[tuple[Sequence, int]], k: int) -> list:
        """The drafter's proposals for ``asking``, ``None`` for a request whose ``propose`` raised.

        ``propose`` is batched; if the batched call raises (or returns a wrong number of drafts),
        it is called again once per request, so that only the culprit loses its draft."""
        try:
            proposed = list(self.drafter.propose([s.req_id for s, _ in asking], k))
            if len(proposed) == len(asking):
                return proposed
        except Exception:
            if len(asking) == 1:
                self._drafter_fault(asking[0][0], "drafter_errors", "propose raised; no draft for this step",
                                    exc_info=True)
                return [None]
        out = []
        for seq, b in asking:
            try:
                one = list(self.drafter.propose([seq.req_id], b))
            except Exception:
                self._drafter_fault(seq, "drafter_errors", "propose raised; no draft for this step", exc_info=True)
                one = [None]
            if len(one) != 1:
                self._drafter_fault(seq, "invalid_drafts", f"propose returned {len(one)} drafts for 1 request")
                one = [None]
            out.append(one[0])
        return out

    def _drafter_call(self, seq: Sequence, hook: str, *args) -> None:
        """Call the drafter's lifecycle ``hook`` for ``seq``; if it raises, the request decodes
        without drafts from now on (the drafter's state for it cannot be trusted)."""
        try:
            getattr(self.drafter, hook)(*args)
        except Exception:
            self._no_draft.add(seq.req_id)
            self._drafter_fault(seq, "drafter_errors", f"{hook} raised; no more drafts for this request",
                                exc_info=True)

    def _drafter_fault(self, seq: Sequence | None, kind: str, what: str, exc_info: bool = False) -> None:
        """Count a contained drafter fault; warn once per request (``None``: the engine)."""
        self.fault_stats[kind] += 1
        key = "" if seq is None else seq.req_id
        if seq is not None:
            seq.stats.drafter_faults += 1
        if key not in self._warned:
            self._warned.add(key)
            import sys

            err = sys.exc_info()[1] if exc_info else None
            cause = f": {type(err).__name__}: {err}" if err is not None else ""
            where = "" if seq is None else f" for request {seq.req_id!r}"
            warnings.warn(f"drafter {type(self.drafter).__name__}{where}: {what}{cause} "
                          f"(further faults of it are only counted in fault_stats)", RuntimeWarning, stacklevel=4)

    def _launch(self, plan: StepPlan) -> None:
        """Queue the target's forward over ``plan`` (graph replay or eager); forward time."""
        t0 = time.perf_counter()
        plan.result = self.runner.launch(plan.inputs)
        self.timings["forward_s"] += time.perf_counter() - t0

    def _wait(self, plan: StepPlan) -> None:
        """Wait for ``plan``'s tokens (the step's one synchronisation), timed as forward.

        While the device computes, the drafter does its host work that does not need this
        step's result (``Drafter.overlap``); that time counts as drafter time."""
        t1 = time.perf_counter()
        try:
            self.drafter.overlap()
        except Exception:
            self._drafter_fault(None, "drafter_errors", "overlap raised", exc_info=True)
        t2 = time.perf_counter()
        self.runner.finish(plan.result)
        self._last_backends = plan.result.backends
        self.timings["forward_s"] += time.perf_counter() - t2
        self.timings["draft_s"] += t2 - t1

    def _verify(self, plan: StepPlan) -> list[list[int]]:
        """Host half of verification: the runner already put the target's token of every row on
        the host, coupled to the row's draft (:mod:`specdec.sampling`), so every request, greedy
        or sampled, keeps its drafts up to the first that differs from the target's token
        (:func:`specdec.verify.verify_chains`)."""
        t0 = time.perf_counter()
        plan.drafts = self._drafts_to_host(plan.requests, plan.drafts)  # those left on the device: copied by now
        emitted = verify_chains(plan.result.argmax, plan.row_starts, plan.drafts)
        self.timings["verify_s"] += time.perf_counter() - t0
        return emitted

    def _commit(self, plan: StepPlan, emitted: list[list[int]]) -> list[StepOutput]:
        """Append each request's emitted tokens, keep exactly their cache (:meth:`Scheduler.commit`),
        and tell the drafter what was accepted."""
        t0 = time.perf_counter()
        outs, spans, hidden = [], [], plan.result.hidden
        ahead = self.executor.ahead_ids()
        self._joined = 0  # requests that emitted their first tokens and go on (not a preempted one's again)
        for i, (seq, d, toks) in enumerate(zip(plan.requests, plan.drafts, emitted)):
            seq.stats.target_steps += 1
            if i < len(plan.context) and not self.scheduler.prompt_done(plan, i):  # a chunk of a long prompt:
                old_cached = seq.num_cached  # cached, and no token yet (its row is not a prediction)
                self.scheduler.commit_chunk(seq, plan.chunks[i])
                if hidden is not None and seq.req_id not in self._no_draft:
                    spans.append((seq.req_id, old_cached, plan.token_starts[i], plan.chunks[i]))
                continue
            if i >= len(plan.context):  # a generation step: record what speculation bought
                seq.stats.accepted_lengths.append(len(toks))
                seq.stats.drafted += len(d)
                seq.stats.accepted += len(toks) - 1
            old_cached = seq.num_cached
            new = self._append(seq, toks)
            if seq.status is not Status.FINISHED:
                self._joined += seq.num_output == len(new)
                self.scheduler.commit(seq, ahead=seq.req_id in ahead)  # keep the slot a step launched ahead writes
                if seq.req_id not in self._no_draft:  # a drafter that failed a request hears no more of it
                    if hidden is not None:  # only accepted positions reach the drafter's context
                        spans.append((seq.req_id, old_cached, plan.token_starts[i], seq.num_cached - old_cached))
                    self._drafter_call(seq, "on_accepted", seq.req_id, new)
            outs.append(StepOutput(seq.req_id, tuple(new), seq.status is Status.FINISHED, seq.finish_reason))
        t1 = time.perf_counter()
        if spans:  # one call for the whole step: block drafters write their context K/V in one pass
            try:
                self.drafter.on_contexts(spans, hidden)
            except Exception:
                for req_id, *_ in spans:
                    self._no_draft.add(req_id)
                    self._drafter_fault(self._seqs[req_id], "drafter_errors",
                                        "on_contexts raised; no more drafts for this request", exc_info=True)
        self.timings["steps"] += 1
        self.timings["host_s"] += t1 - t0
        self.timings["draft_s"] += time.perf_counter() - t1
        return outs

    # -- helpers -------------------------------------------------------------
    def _append(self, seq: Sequence, toks: list[int]) -> list[int]:
        """Append emitted tokens one by one, stopping exactly where a stop rule fires."""
        p, new = seq.params, []
        for tok in toks:
            seq.tokens.append(tok)
            new.append(tok)
            reason = None
            if not p.ignore_eos and tok in self.target.eos_token_ids:
                reason = "eos"
            elif p.stop and self._hits_stop(seq):
                reason = "stop"
            elif seq.num_output >= p.max_new_tokens:
                reason = "length"
            elif len(seq.tokens) >= self.target.max_context:
                reason = "max_context"
            if reason:
                self._finish(seq, reason)
                break
        return new

    def _hits_stop(self, seq: Sequence) -> bool:
        tail = self.target.tokenizer.decode(seq.output_ids[-(8 + max(len(s) for s in seq.params.stop)):])
        return any(s in tail for s in seq.params.stop)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.remove(seq)
        seq.finish(reason)
        aborted = reason == "abort" and hasattr(self.drafter, "abort_request")
        self._drafter_call(seq, "abort_request" if aborted else "stop_request", seq.req_id)
        self._no_draft.discard(seq.req_id)
        self._warned.discard(seq.req_id)

    def _text(self, seq: Sequence) -> str:
        tok = self.target.tokenizer
        if tok is None:
            return ""
        text = tok.decode(seq.output_ids, skip_special_tokens=True)
        if seq.finish_reason == "stop":
            cut = [text.find(s) for s in seq.params.stop if s in text]
            text = text[: min(cut)] if cut else text
        return text

    def _unschedulable(self) -> list[StepOutput]:
        """Nothing fits although requests wait: the head request can never fit the pool."""
        if self.scheduler.waiting and not self.scheduler.running:
            seq = self.scheduler.waiting[0]
            self._finish(seq, "kv_capacity")
            return [StepOutput(seq.req_id, (), True, seq.finish_reason)]
        return []

    def _tokenize(self, prompt, chat: bool) -> list[int]:
        tok = self.target.tokenizer
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt must be a non-empty string or token-id list, got ''")
            if tok is None:
                raise InvalidRequestError("this target has no tokenizer: prompt must be a list of token ids")
            if chat and getattr(tok, "chat_template", None):
                text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True)
                ids = tok(text, add_special_tokens=False)["input_ids"]
            else:
                ids = tok(prompt)["input_ids"]
        else:
            if isinstance(prompt, (bytes, dict)) or not isinstance(prompt, Iterable):
                raise InvalidRequestError(f"prompt must be a non-empty string or a list of token ids, "
                                          f"got {type(prompt).__name__} {prompt!r:.50}")
            ids = list(prompt)
            if not ids:
                raise InvalidRequestError("prompt must be a non-empty string or token-id list, got []")
            raw, ids = ids, [_token_id(t) for t in ids]
            bad = [r for r, t in zip(raw, ids) if t is None or not 0 <= t < self.target.vocab_size]
            if bad:
                raise InvalidRequestError(f"prompt token ids must be ints in [0, {self.target.vocab_size}), got {bad[:5]}")
        if len(ids) >= self.target.max_context:
            raise PromptTooLongError(
                f"prompt length must be < the model's max context {self.target.max_context} tokens, got {len(ids)}")
        if -(-len(ids) // self.config.tokens_per_block) > self.manager.num_pages:
            raise PromptTooLongError(f"prompt of {len(ids)} tokens does not fit the KV pool of "
                                     f"{self.manager.num_pages} pages x {self.config.tokens_per_block} tokens")
        return ids

    def _check_forced_backend(self) -> None:
        name = self.config.attention_backend
        if name is None:
            return
        from specdec.attention.selector import available_backends, select

        get_backend(name)
        backends, shape_of = available_backends(self.config.attention_config), self._shape_of()
        for phase, q in (("context", 1), ("generation", 1), ("generation", 1 + self.config.max_draft_tokens)):
            select(shape_of(phase, q), requested=name, backends=backends)


def _shape_of(target, tokens_per_block: int, kv_dtype, helix_cp: int, attention_tp: int, phase: str, max_q: int,
              mixed: bool = False):
    shape = target.attn_shape(phase, max_q, tokens_per_block, mixed, kv_dtype=kv_dtype)
    if helix_cp == 1:
        return shape
    # under attention tensor parallelism a process attends only its head group's heads
    return dataclasses.replace(shape, helix_cp=helix_cp, num_heads=shape.num_heads // attention_tp)


def _token_id(t) -> int | None:
    """``t`` as a plain int if it is an integer (Python, NumPy or 0-d tensor, not a bool), else ``None``."""
    if isinstance(t, bool):
        return None
    try:
        return operator.index(t)
    except TypeError:
        return None


def _valid_drafts_fast(drafts: list, max_tokens: int, budgets: list[int], vocab_size: int) -> list[Draft] | None:
    """:func:`_valid_draft` for a whole step's drafts at once, in the common case: each a
    :class:`Draft` of at most ``max_tokens`` ids in a tuple, no ``probs``, and a tuple of as many
    confidences or none; every id an ``int`` in ``[0, vocab_size)`` and every confidence a
    ``float`` in ``[0, 1]``, checked over all drafts together at C speed. Each is cut to its
    budget. ``None`` if any draft is not of that kind: then each is checked on its own (which says
    what is wrong, and for which request)."""
    for d in drafts:
        if type(d) is not Draft or type(d.token_ids) is not tuple or len(d.token_ids) > max_tokens \
                or d.probs is not None or not (d.confidence is None or (type(d.confidence) is tuple
                                                                        and len(d.confidence) == len(d.token_ids))):
            return None
    ids = list(itertools.chain.from_iterable(d.token_ids for d in drafts))
    if ids and (set(map(type, ids)) != {int} or min(ids) < 0 or max(ids) >= vocab_size):
        return None  # a bool or another integer type takes the one-by-one path too
    conf = list(itertools.chain.from_iterable(d.confidence for d in drafts if d.confidence is not None))
    if conf and (set(map(type, conf)) != {float} or not all(map(_ZERO.__le__, conf))
                 or not all(map(_ONE.__ge__, conf))):  # NaN fails both
        return None
    return [d if len(d.token_ids) <= b else
            Draft(d.token_ids[:b], None, None if d.confidence is None else d.confidence[:b])
            for d, b in zip(drafts, budgets)]


_ZERO, _ONE = 0.0, 1.0


def _valid_draft(d, max_tokens: int, budget: int, vocab_size: int) -> Draft:
    """``d`` cut to ``budget`` tokens, with plain-int ids, if it is a well-formed draft.

    Raises:
        ValueError: saying what is wrong (not a Draft, too long, an id outside
            ``[0, vocab_size)``, ``probs`` of the wrong shape, bad confidences).
    """
    if not isinstance(d, Draft):
        raise ValueError(f"a draft must be a Draft, got {type(d).__name__}")
    if len(d) > max_tokens:
        raise ValueError(f"draft of {len(d)} tokens, asked for at most {max_tokens}")
    if isinstance(d.token_ids, DeviceIds):
        return _valid_device_draft(d, budget, vocab_size)
    try:
        ids = tuple(operator.index(t) for t in d.token_ids if not isinstance(t, bool))
    except TypeError:
        ids = ()
    if len(ids) != len(d):
        raise ValueError(f"draft token ids must be integers, got {d.token_ids!r}")
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ValueError(f"draft token ids must be in [0, {vocab_size}), got {[t for t in ids if not 0 <= t < vocab_size][:5]}")
    probs = d.probs
    if probs is not None and (not isinstance(probs, torch.Tensor) or tuple(probs.shape) != (len(ids), vocab_size)):
        raise ValueError(f"draft probs must be None or a tensor [{len(ids)}, {vocab_size}], got "
                         f"{tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__}")
    conf = d.confidence
    if conf is not None:
        try:
            conf = tuple(float(c) for c in conf if not isinstance(c, bool))
        except (TypeError, ValueError):
            conf = ()
        if len(conf) != len(ids) or not all(0.0 <= c <= 1.0 for c in conf):
            raise ValueError(f"draft confidence must be None or {len(ids)} numbers in [0, 1], got {d.confidence!r}")
    if len(ids) > budget:
        ids, probs = ids[:budget], None if probs is None else probs[:budget]
        conf = None if conf is None else conf[:budget]
    return Draft(ids, probs, conf)


def _valid_device_draft(d: Draft, budget: int, vocab_size: int) -> Draft:
    """:func:`_valid_draft` for a draft whose tokens are still on the device (their ids were
    clamped into the vocabulary there, see :class:`~specdec.drafters.base.DraftsOnDevice`):
    only what the host knows is checked, and the cut to ``budget`` keeps them there."""
    n = len(d)
    probs = d.probs
    if probs is not None and (not isinstance(probs, torch.Tensor) or tuple(probs.shape) != (n, vocab_size)):
        raise ValueError(f"draft probs must be None or a tensor [{n}, {vocab_size}], got "
                         f"{tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__}")
    conf = d.confidence
    if conf is not None and not isinstance(conf, DeviceIds):
        try:
            conf = tuple(float(c) for c in conf if not isinstance(c, bool))
        except (TypeError, ValueError):
            conf = ()
        if len(conf) != n or not all(0.0 <= c <= 1.0 for c in conf):
            raise ValueError(f"draft confidence must be None or {n} numbers in [0, 1], got {d.confidence!r}")
    elif conf is not None and len(conf) != n:
        raise ValueError(f"draft confidence must be None or {n} numbers in [0, 1], got {len(conf)}")
    if n <= budget and conf is d.confidence:
        return d
    return Draft(d.token_ids[:budget], None if probs is None else probs[:budget],
                 None if conf is None else conf[:budget])


def _progress(total: int, unit: str = "tok", desc: str = "generate"):
    from tqdm.auto import tqdm

    return tqdm(total=total, unit=unit, desc=desc)
