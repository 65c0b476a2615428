"""Pool capacity from a memory budget (DESIGN.md §8)."""

from __future__ import annotations

from specdec.errors import ConfigError

GiB = 1 << 30


def num_pages_for_budget(budget_bytes: int, bytes_per_token: int, tokens_per_block: int, safety_margin: int = 0) -> int:
    """Pages that fit in ``budget_bytes - safety_margin``.

    ``bytes_per_token`` must count every layer in the pool (target and
    appended draft layers).

    Raises:
        ConfigError: the budget does not hold a single page.
    """
    if tokens_per_block < 1:
        raise ConfigError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    if bytes_per_token < 1:
        raise ConfigError(f"bytes_per_token must be >= 1, got {bytes_per_token}")
    usable = budget_bytes - safety_margin
    pages = usable // (bytes_per_token * tokens_per_block) if usable > 0 else 0
    if pages < 1:
        raise ConfigError(
            f"memory budget {budget_bytes} B (minus margin {safety_margin} B) holds no page of "
            f"{tokens_per_block} tokens at {bytes_per_token} B/token"
        )
    return int(pages)
