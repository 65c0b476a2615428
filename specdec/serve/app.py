"""The FastAPI app: OpenAI routes, ``/health``, ``/metrics``, and the lifespan that runs the driver."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import weakref

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from specdec.errors import EngineClosedError
from specdec.heap import frozen_heap
from specdec.serve.config import ServeConfig
from specdec.serve.driver import EngineDriver, Event, Handle
from specdec.serve.metrics import CONTENT_TYPE, ServeMetrics
from specdec.serve.protocol import APIError, chunk, new_id, parse_job, response, usage_chunk


def create_app(engine, config: ServeConfig) -> FastAPI:
    """An OpenAI-compatible app serving ``engine``.

    The engine is stepped by one task started with the app (its lifespan) and stopped at
    shutdown: admission stops, running requests get ``config.drain_timeout_s`` to finish,
    the rest are aborted. The engine itself is left open (its owner closes it). The app holds the
    engine only while it runs: outside that, weakly (FastAPI caches endpoints for the life of
    the process, and a stopped app must not keep a dropped engine's memory).

    Args:
        engine: a :class:`specdec.SpecEngine`; only this app may call it while the app runs.
        config: the server settings.

    Returns:
        The app; ``app.state.driver`` and ``app.state.metrics`` are its driver and metrics.
    """
    metrics = ServeMetrics(engine)
    engine_ref, max_context = weakref.ref(engine), engine.target.max_context
    del engine  # the closures below hold it weakly

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = engine_ref()
        if engine is None:
            raise EngineClosedError("the engine this app serves was dropped by its owner")
        if engine.target.device.type == "cuda":  # first-time costs (graph captures, kernel compiles for
            engine.warm_up()  # each prompt bucket, mixed steps) before /health says ready; none on the CPU
        driver = EngineDriver(engine, config.max_waiting, metrics)
        app.state.driver = driver
        # what start-up built (model, graphs, pools, the app) is out of the collector's full passes
        # while the server runs (specdec.heap); unfrozen at shutdown
        with frozen_heap(config.freeze_heap, collect=True):
            driver.start()
            try:
                yield
            finally:
                await driver.stop(config.drain_timeout_s)
                app.state.driver = None  # the stopped app holds the engine no longer

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.state.metrics = metrics
    app.state.driver = None

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail), type="invalid_request_error",
                                     code="not_found" if e.status_code == 404 else None).body(),
                            status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return JSONResponse(APIError(400, str(e)).body(), status_code=400)

    @app.get("/health")
    async def health():
        driver = app.state.driver
        if driver is None or not driver.ready:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "specdec", "max_model_len": max_context}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(request, "chat")

    async def _serve(request: Request, kind: str):
        try:
            body = await request.json()
        except ClientDisconnect:  # the client left while sending its request: nothing was admitted
            return Response(status_code=499)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        job = parse_job(body, kind, config.model_name)
        driver: EngineDriver = app.state.driver
        if driver is None:
            raise APIError(503, "the server is starting", type="service_unavailable")
        handle = await driver.submit(job)
        rid = new_id(kind)
        if job.stream:
            return _EventStream(_events(handle, kind, rid), on_close=lambda: driver.abort(handle),
                                media_type="text/event-stream")
        try:
            out = await _wait(handle, request)
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it
        finally:
            driver.abort(handle)  # a no-op once it finished; else the client left (or the task was cancelled)
        return response(kind, rid, config.model_name, out)

    async def _wait(handle: Handle, request: Request):
        poll = config.disconnect_poll_s
        checked = time.monotonic()
        while True:
            try:
                ev = await asyncio.wait_for(handle.events.get(), poll)
            except asyncio.TimeoutError:
                ev = None
            if time.monotonic() - checked >= poll:  # also while events keep coming
                checked = time.monotonic()
                if await request.is_disconnected():
                    raise _ClientGone
            if ev is None:
                continue
            if ev.error is not None:
                raise APIError(500, ev.error, type="server_error")
            if ev.output is not None:
                return ev.output

    async def _events(handle: Handle, kind: str, rid: str):
        model = config.model_name
        if kind == "chat":
            yield _sse(chunk(kind, rid, model, None, [], None, role=True))
        while True:
            ev, failed = await next_events(handle.events)
            if failed is not None:
                if ev.text or ev.token_ids:
                    yield _sse(chunk(kind, rid, model, ev.text, ev.token_ids, None))
                yield _sse(APIError(500, failed.error, type="server_error").body())
                break
            out = ev.output
            if ev.text or ev.token_ids or out is not None:
                yield _sse(chunk(kind, rid, model, ev.text, ev.token_ids, out.finish_reason if out else None))
            if out is not None:
                if handle.job.include_usage:
                    yield _sse(usage_chunk(kind, rid, model, out))
                break
        yield "data: [DONE]\n\n"

    return app


async def next_events(events: asyncio.Queue) -> tuple[Event, Event | None]:
    """The next event of a stream merged with those already waiting behind it, so that a stream
    that fell behind the engine's steps sends one chunk for them, not one per step.

    Returns:
        ``(event, failed)``: the merged text and token ids (and the final output, if one of them
        ended the request); ``failed`` is the event that carried an engine error, if one did
        (the text before it is in ``event``).
    """
    ev = await events.get()
    if ev.error is not None:
        return Event("", []), ev
    text, ids = ev.text, list(ev.token_ids)
    while ev.output is None and not events.empty():
        ev = events.get_nowait()
        if ev.error is not None:
            return Event(text, ids), ev
        text, ids = text + ev.text, ids + ev.token_ids
    return Event(text, ids, ev.output), None


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _EventStream(StreamingResponse):
    """A server-sent-event response that calls ``on_close`` however it ends (a client that
    disconnects aborts its request at once, not when the generator is collected)."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            with contextlib.suppress(RuntimeError):  # already closed, or still running (then it ends by itself)
                await self.body_iterator.aclose()


class _ClientGone(Exception):
    """The client of a non-streamed request disconnected."""

