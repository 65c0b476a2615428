"""Pool capacity from a memory budget (docs/design.md §8)."""

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


def allocator_cap_bytes(total: int, free: int, reserved_by_torch: int, outside: int = GiB) -> int:
    """The PyTorch caching-allocator cap that leaves room for the driver and transfers.

    Keeps ``min(outside, free)`` bytes outside the cap (docs/design.md §8), and never
    drops below what PyTorch already holds (``reserved_by_torch``): lowering the
    cap under live allocations would only make the next allocation fail.

    Args:
        total: device memory.
        free: free device memory now (not counting PyTorch's reserved cache).
        reserved_by_torch: bytes PyTorch's allocator holds now.
        outside: headroom to keep outside the cap (1 GiB by default).

    Returns:
        The cap in bytes, in ``[reserved_by_torch, total]``.
    """
    if min(total, free, reserved_by_torch, outside) < 0 or free > total:
        raise ConfigError(f"memory figures must be >= 0 with free <= total, got total={total}, free={free}, "
                          f"reserved_by_torch={reserved_by_torch}, outside={outside}")
    usable = reserved_by_torch + free - min(outside, free)
    return max(reserved_by_torch, min(total, usable))


#: Share of the host's available memory a CPU pool may take by default.
HOST_FRACTION = 0.0625
#: Share of the device's free memory (less ``GiB`` of headroom) a CUDA pool may take by default.
DEVICE_FRACTION = 0.9


def host_available_bytes() -> int:
    """Memory the host can still hand out (``MemAvailable`` on Linux; free pages elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_kv_budget(need_bytes: int, device) -> int:
    """The default KV pool budget: what is needed, within what the device has.

    Args:
        need_bytes: bytes that hold every request the engine may run at once at the
            model's full context (``max_num_seqs`` x context pages, every pooled layer).
        device: where the pool lives.

    Returns:
        ``min(need_bytes, cap)``, where ``cap`` is ``DEVICE_FRACTION`` of the free device
        memory less 1 GiB on CUDA, or ``HOST_FRACTION`` of the host's available memory on
        the CPU (a pool too small for a prompt refuses that request; one that holds no page at
        all is a ``ConfigError`` at engine build).
    """
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cap = int(DEVICE_FRACTION * max(0, free - GiB))
    else:
        cap = int(HOST_FRACTION * host_available_bytes())
    return min(need_bytes, cap)


def kv_budget_bytes(cap: int, reserved_by_torch: int, activation_bytes: int) -> int:
    """Bytes left for the KV pool under ``cap`` after what PyTorch holds and the activations need."""
    return max(0, cap - reserved_by_torch - activation_bytes)


def pool_pages_on_device(bytes_per_token: int, tokens_per_block: int, activation_bytes: int,
                         device: str = "cuda", outside: int = GiB) -> tuple[int, int]:
    """Pages for a pool on a CUDA device, and the allocator cap to set (``torch.cuda.set_per_process_memory_fraction``).

    Raises:
        ConfigError: the device has no room for one page.
    """
    import torch

    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    cap = allocator_cap_bytes(total, free, reserved, outside)
    return num_pages_for_budget(kv_budget_bytes(cap, reserved, activation_bytes), bytes_per_token, tokens_per_block), cap
