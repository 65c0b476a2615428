"""The examples run on the public API and cannot rot: CI executes them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_notebook_executes():
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "target steps:" in outputs


def test_serving_gpu_example_runs_and_reports():
    """examples/serving_gpu.py: on a CPU it captures nothing, runs eagerly and says why."""
    import os

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "serving_gpu.py")], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tokens/s" in done.stdout and "graph steps" in done.stdout and "backends:" in done.stdout
    if not __import__("torch").cuda.is_available():
        assert "captured 0 CUDA graphs" in done.stdout and "graphs need cuda" in done.stdout


def test_cli_generate_and_bench():
    gen = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "def add(a, b):", "--max-new-tokens", "12",
                          "--quiet"], capture_output=True, text=True, timeout=600)
    assert gen.returncode == 0, gen.stderr
    assert "target steps" in gen.stderr and gen.stdout.strip()
    bench = subprocess.run([sys.executable, "-m", "specdec.cli", "bench", "--problems", "0-1", "--max-new-tokens", "8",
                            "--quiet", "--drafter", "null"], capture_output=True, text=True, timeout=600)
    assert bench.returncode == 0, bench.stderr
    assert "tokens/s=" in bench.stdout
    gated = subprocess.run([sys.executable, "-m", "specdec.cli", "bench", "--problems", "0-1", "--max-new-tokens", "16",
                            "--quiet", "--drafter", "suffix", "--draft-gate"], capture_output=True, text=True,
                           timeout=600)
    assert gated.returncode == 0, gated.stderr
    assert "draft gate, batch 1: draft length " in gated.stdout and "steps by length" in gated.stdout
    bad = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "x", "--max-new-tokens", "0"],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "--max-new-tokens" in bad.stderr  # names the flag as typed


def test_serve_and_query_example():
    """examples/serve_and_query.py: a server started, queried streaming, stopped with status 0."""
    import os

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "serve_and_query.py")], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("target steps") == 2 and "mean accepted length" in done.stdout
    assert "specdec_accepted_tokens_total" in done.stdout and "server exit status: 0" in done.stdout
