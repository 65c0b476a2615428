"""bench/helix.py's logic on the CPU: 2 gloo ranks and 1, tiny shapes, its reference check, its table,
JSON and plot (the H200 runs use the same code with NCCL and triton_mla)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--device", "cpu", "--heads", "4", "--contexts", "48,80", "--batch-sizes", "1,2", "--q-lens", "1,3",
        "--page", "16", "--reps", "1", "--warmup", "1", "--kv", "fp32"]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)


def test_helix_bench_runs_checks_and_plots(tmp_path):
    out = tmp_path / "helix"
    two = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(ROOT / "bench" / "helix.py"), *ARGS, "--out", str(out)])
    assert two.returncode == 0, two.stdout + two.stderr
    one = _run([sys.executable, str(ROOT / "bench" / "helix.py"), *ARGS, "--max-cache-gb", "1e-6", "--out", str(out)])
    assert one.returncode == 0, one.stdout + one.stderr
    rows = json.loads((out / "helix_cp2.json").read_text())["rows"]
    assert len(rows) == 8 and {r["cp"] for r in rows} == {2}
    assert rows[0]["max_abs_err"] < 1e-4  # the first configuration, checked against the whole-context reference
    assert all(r["step_s"] > 0 and r["combine_s"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    skipped = json.loads((out / "helix_cp1.json").read_text())["rows"]
    assert all("skipped" in r for r in skipped)  # the cache budget is honoured
    assert "| 2 | 80 | 2 | 3 |" in (out / "helix_cp2.md").read_text()
    plot = _run([sys.executable, str(ROOT / "bench" / "helix.py"), "--plot", str(out)])
    assert plot.returncode == 0 and (out / "helix.png").stat().st_size > 0, plot.stdout + plot.stderr
