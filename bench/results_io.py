"""Where the bench scripts write what they measured: ``NAME.md`` (the table, as printed) and
``NAME.json`` (the raw figures) in one folder."""

from __future__ import annotations

import json
from pathlib import Path


def write_results(out: str | Path | None, name: str, markdown: str, data) -> None:
    """Print ``markdown``; with ``out``, also write ``out/NAME.md`` and ``out/NAME.json`` (``data``)."""
    print(markdown)
    if out is None:
        return
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(markdown + "\n")
    (out / f"{name}.json").write_text(json.dumps(data, indent=1))
