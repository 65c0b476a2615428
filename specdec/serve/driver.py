"""`EngineDriver`: one asyncio task that steps the engine and hands each request its tokens.

The engine is not thread-safe, so every engine call happens on the event loop between steps;
the blocking ``step()`` runs in a worker thread, one at a time. Requests join (``submit``) and
leave (``abort``, or by finishing) only between steps: continuous batching.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace

from specdec.errors import InvalidRequestError, PromptTooLongError, SpecDecError
from specdec.sequence import GenerationOutput
from specdec.serve.metrics import ServeMetrics
from specdec.serve.protocol import APIError, Job, bad

log = logging.getLogger("specdec.serve")


@dataclass(frozen=True, slots=True)
class Event:
    """What one step gave a request.

    Attributes:
        text: new text (held back while it could still become a stop string).
        token_ids: new token ids.
        output: the final output once the request ended, else ``None``.
        error: set when the engine failed the request (the server answers 500).
    """

    text: str
    token_ids: list[int]
    output: GenerationOutput | None = None
    error: str | None = None


@dataclass(eq=False, slots=True)
class Handle:
    """A request admitted into the engine, as the HTTP handler sees it."""

    req_id: str
    job: Job
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    token_ids: list[int] = field(default_factory=list)
    sent: str = ""
    done: bool = False
    #: incremental detokenisation: the text of ``token_ids[:read]``, built from windows that
    #: start at ``prefix`` (a few tokens back, so a character split across tokens decodes whole)
    text: str = ""
    prefix: int = 0
    read: int = 0
    whole: bool = False  # the tokenizer rewrote text across a window: decode the whole output from now on


class EngineDriver:
    """Drives ``engine.step()`` continuously while requests are unfinished.

    Args:
        engine: a :class:`specdec.SpecEngine`; the driver does not close it.
        max_waiting: most requests waiting to run (not yet scheduled); past it ``submit``
            answers HTTP 429.
        metrics: where steps and ended requests are recorded.
    """

    def __init__(self, engine, max_waiting: int, metrics: ServeMetrics):
        self.engine, self.max_waiting, self.metrics = engine, max_waiting, metrics
        self.tokenizer = engine.target.tokenizer
        self._pending: list[tuple[Job, asyncio.Future]] = []
        self._aborts: list[Handle] = []
        self._handles: dict[str, Handle] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._deadline = 0.0

    @property
    def ready(self) -> bool:
        """Whether requests are admitted (started, not stopping)."""
        return self._task is not None and not self._task.done() and not self._stopping

    @property
    def num_waiting(self) -> int:
        """Requests submitted but not yet running."""
        return len(self._pending) + len(self.engine.scheduler.waiting)

    def start(self) -> None:
        """Start the stepping task on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="specdec-engine-driver")

    async def stop(self, timeout_s: float) -> None:
        """Stop admitting, let running requests finish for up to ``timeout_s``, abort the rest, and
        end the stepping task (after the step under way)."""
        self._stopping = True
        self._deadline = time.monotonic() + timeout_s
        self._wake.set()
        if self._task is not None:
            await self._task

    async def submit(self, job: Job) -> Handle:
        """Admit a request between steps.

        Raises:
            APIError: 429 if ``max_waiting`` requests already wait; 503 if the server is stopping;
                400 if the engine refuses the prompt (the message names the field).
        """
        if not self.ready:
            raise APIError(503, "the server is shutting down", type="service_unavailable", code="shutting_down")
        if self.num_waiting >= self.max_waiting:
            self.metrics.rejected.labels("429").inc()
            raise APIError(429, f"too many requests waiting ({self.num_waiting}, the bound is {self.max_waiting}); "
                                f"retry later", type="rate_limit_error", code="rate_limit_exceeded")
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((job, fut))
        self._wake.set()
        try:
            return await fut
        except asyncio.CancelledError:  # the client left while admission was under way
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.abort(fut.result())
            raise

    def abort(self, handle: Handle) -> None:
        """Abort a request (its client left); its pages are freed before the next step."""
        if not handle.done:
            handle.done = True
            self._aborts.append(handle)
            self._wake.set()

    # -- the loop --------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            self._admit()
            self._apply_aborts()
            if self._stopping and (not self._handles or time.monotonic() >= self._deadline):
                for h in list(self._handles.values()):
                    self._end(h, self._release(h.req_id, abort=True))
                return
            self.metrics.queue(self.num_waiting, len(self.engine.scheduler.running))
            if not self.engine.has_unfinished():
                self._wake.clear()
                if self._stopping:
                    await asyncio.sleep(0.05)
                else:
                    await self._wake.wait()
                continue
            t0 = time.perf_counter()
            try:
                outs = await asyncio.to_thread(self.engine.step)
            except Exception as e:  # the engine left every request as before the step: fail them all
                log.exception("engine step failed")
                for h in list(self._handles.values()):
                    out = self._release(h.req_id, abort=True)
                    self._handles.pop(h.req_id, None)
                    h.done = True
                    h.events.put_nowait(Event("", [], out, f"engine step failed: {type(e).__name__}: {e}"))
                continue
            self.metrics.step(time.perf_counter() - t0, len(outs))
            for out in outs:
                h = self._handles.get(out.req_id)
                if h is not None:
                    self._deliver(h, list(out.new_token_ids), out.finished)

    def _admit(self) -> None:
        pending, self._pending = self._pending, []
        for job, fut in pending:
            if fut.done():  # the client left before admission
                continue
            try:
                ids, params = self._prepare(job)
                req_id = self.engine.add_request(ids, params)
            except APIError as e:
                self.metrics.rejected.labels("400").inc()
                fut.set_exception(e)
                continue
            except InvalidRequestError as e:
                self.metrics.rejected.labels("400").inc()
                code = "context_length_exceeded" if isinstance(e, PromptTooLongError) else "invalid_value"
                fut.set_exception(bad(str(e), job.prompt_param, code))
                continue
            except SpecDecError as e:
                fut.set_exception(APIError(500, f"{type(e).__name__}: {e}", type="server_error"))
                continue
            h = Handle(req_id, job)
            self._handles[req_id] = h
            fut.set_result(h)

    def _prepare(self, job: Job):
        """The prompt's token ids and the final sampling parameters.

        Raises:
            APIError: the prompt cannot be tokenized or ``max_tokens`` runs past the context.
        """
        tok, ctx = self.tokenizer, self.engine.target.max_context
        param = job.prompt_param
        if job.kind == "chat":
            if tok is None or not getattr(tok, "chat_template", None):
                raise bad("this model has no chat template: use /v1/completions", param, "unsupported_value")
            text = tok.apply_chat_template(job.prompt, tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]
        elif isinstance(job.prompt, str):
            if tok is None:
                raise bad("this model has no tokenizer: prompt must be a list of token ids", param)
            ids = tok(job.prompt)["input_ids"]
        else:
            ids = job.prompt
        if job.params.stop and tok is None:
            raise bad("stop strings need a tokenizer; this model has none", "stop", "unsupported_value")
        n = len(ids)
        if n >= ctx:
            raise bad(f"the prompt must be shorter than the model's context of {ctx} tokens, got {n} tokens",
                      param, "context_length_exceeded")
        if job.max_tokens is None:
            return ids, replace(job.params, max_new_tokens=ctx - n)
        if n + job.max_tokens > ctx:
            raise bad(f"max_tokens must be <= {ctx - n} (the model's context of {ctx} tokens minus the "
                      f"prompt's {n}), got {job.max_tokens}", "max_tokens", "context_length_exceeded")
        return ids, job.params

    def _apply_aborts(self) -> None:
        aborts, self._aborts = self._aborts, []
        for h in aborts:
            if self._handles.pop(h.req_id, None) is not None:
                self.metrics.request_end(self._release(h.req_id, abort=True))

    def _release(self, req_id: str, abort: bool) -> GenerationOutput:
        if abort:
            self.engine.abort(req_id)
        return self.engine.release(req_id)

    def _deliver(self, h: Handle, new_ids: list[int], finished: bool) -> None:
        h.token_ids += new_ids
        if finished:
            out = self.engine.release(h.req_id)
            self._handles.pop(h.req_id, None)
            h.done = True
            text = out.text[len(h.sent):] if out.text.startswith(h.sent) else ""
            self.metrics.request_end(out)
            h.events.put_nowait(Event(text, new_ids, out))
            return
        text, delta = self._safe_text(h), ""
        if text.startswith(h.sent):  # a decode that rewrites sent text (rare) waits for the final text
            delta, h.sent = text[len(h.sent):], text
        h.events.put_nowait(Event(delta, new_ids))

    def _safe_text(self, h: Handle) -> str:
        """The output text that can be sent now: without a trailing partial character, and without
        a tail that could still grow into a stop string (the engine cuts stop strings at the end).

        Decoded incrementally: each step decodes only the tokens since the last step that ended
        on a complete character (and the window before them), not the whole output, so its cost
        does not grow with the output. A window whose decode does not extend the one before (a
        tokenizer that rewrites text across tokens) falls back to decoding the whole output."""
        if self.tokenizer is None:
            return ""
        decode, ids = self.tokenizer.decode, h.token_ids
        tail = ""  # the new complete characters before a partial one (released, not yet committed)
        if not h.whole:
            before = decode(ids[h.prefix : h.read], skip_special_tokens=True)
            window = decode(ids[h.prefix :], skip_special_tokens=True)
            h.whole = not window.startswith(before)
            if not h.whole and window.endswith("\ufffd"):
                tail = window[len(before):].rstrip("\ufffd")
            elif not h.whole and len(window) > len(before):
                h.text += window[len(before):]
                h.prefix, h.read = h.read, len(ids)
        if h.whole:
            h.text = decode(ids, skip_special_tokens=True).rstrip("\ufffd")
        text = h.text + tail
        hold = 0
        for s in h.job.params.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return text[:len(text) - hold]

    def _end(self, h: Handle, out: GenerationOutput) -> None:
        self._handles.pop(h.req_id, None)
        h.done = True
        self.metrics.request_end(out)
        h.events.put_nowait(Event("", [], out))
