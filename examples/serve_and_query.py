"""Start `specdec serve` on SmolLM2 with the suffix drafter, query it streaming with the `openai` client,
print the speculation figures from `usage` and `/metrics`, then stop the server with SIGTERM.

    python examples/serve_and_query.py
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
from openai import OpenAI

with socket.socket() as s:  # a free port
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
server = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--target", "smollm2-135m",
                           "--drafter", "suffix", "--port", str(port), "--log-level", "warning"])
url = f"http://127.0.0.1:{port}"
try:
    deadline = time.monotonic() + 300
    while True:  # wait until the model is loaded and /health says ready
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the server did not start")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)

    client = OpenAI(base_url=url + "/v1", api_key="unused")
    for question in ("Write a Python function that reverses a string.", "Write a Python function that reverses a list."):
        stream = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": question}],
                                                max_tokens=96, temperature=0, stream=True,
                                                stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices:
                print(chunk.choices[0].delta.content or "", end="", flush=True)
            else:
                u = chunk.usage
                print(f"\n[{u.completion_tokens} tokens, {u.target_steps} target steps, "
                      f"mean accepted length {u.mean_accepted_length:.2f}]\n")
    metrics = httpx.get(url + "/metrics").text
    print("\n".join(line for line in metrics.splitlines()
                    if line.startswith(("specdec_draft_tokens_total", "specdec_accepted_tokens_total"))))
finally:
    server.send_signal(signal.SIGTERM)
    print(f"server exit status: {server.wait(60)}")
