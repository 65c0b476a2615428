"""Where the bench scripts write what they measured: ``NAME.md`` (the table, as printed) and
``NAME.json`` (the raw figures) in one folder."""

from __future__ import annotations

import datetime
import io
import json
import platform
import pstats
import sys
from pathlib import Path

import torch


def run_header(device: str, *details: str) -> str:
    """The line a results file starts with: the exact command, the date, the machine, torch's
    version, then ``details`` (dtype, shapes, ...)."""
    script = Path(sys.argv[0])
    machine = (torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available()
               else f"{platform.machine()} CPU, {torch.get_num_threads()} threads")
    parts = [str(datetime.date.today()), machine, f"torch {torch.__version__}", *details]
    return f"`python bench/{script.name} {' '.join(sys.argv[1:])}` — " + ", ".join(parts)


def write_results(out: str | Path | None, name: str, markdown: str, data) -> None:
    """Print ``markdown``; with ``out``, also write ``out/NAME.md`` and ``out/NAME.json`` (``data``)."""
    print(markdown)
    if out is None:
        return
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(markdown + "\n")
    (out / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))


def top_functions(profile, n: int) -> str:
    """A ``cProfile.Profile``'s ``n`` functions with the most own time, as pstats prints them."""
    buf = io.StringIO()
    pstats.Stats(profile, stream=buf).sort_stats("tottime").print_stats(n)
    return buf.getvalue().strip()
