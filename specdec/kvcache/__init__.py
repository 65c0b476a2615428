"""Paged KV cache: layer specs and pools, page tables per request, sizing."""

from specdec.kvcache.manager import KVCacheManager, pages_for
from specdec.kvcache.pool import KVPool, LayerSpec, bytes_per_token
from specdec.kvcache.sizing import num_pages_for_budget

__all__ = ["KVCacheManager", "KVPool", "LayerSpec", "bytes_per_token", "num_pages_for_budget", "pages_for"]
