"""A drafter's view of its KV layers: appended to the target's pool, or a pool of its own.

Either way the drafter asks the same questions (which slots hold positions
``start..stop`` of a request, which pages form its table) and never learns
which case it is in. In the shared case the page table is the target's, so
truncating or freeing a request frees its draft pages too.
"""

from __future__ import annotations

from specdec.kvcache.manager import KVCacheManager
from specdec.kvcache.pool import KVPool


class DraftKV:
    """Slots and tensors of a drafter's KV layers.

    Args:
        pool: the pool holding the drafter's layers.
        layer_ids: indices of the drafter's layers in ``pool``.
        manager: the page manager of ``pool``.
        shared: the manager is the target's (lengths follow the target's requests).
        scratch_slot: a slot of ``pool`` no request owns, for the writes of padding rows (a
            captured propose writes a fixed number of context positions); ``None``: there is none,
            and the drafter writes only real positions.
        shard: under Helix, when the layers share the target's sharded pool, this rank's
            :class:`~specdec.parallel.helix.HelixShard`: pages then hold only the positions
            this rank owns and ``slots`` is ``-1`` for the others. ``None``: whole context.
    """

    def __init__(self, pool: KVPool, layer_ids, manager: KVCacheManager, shared: bool,
                 scratch_slot: int | None = None, shard=None):
        self.pool, self.layer_ids, self.manager, self.shared = pool, list(layer_ids), manager, shared
        self.scratch_slot, self.shard = scratch_slot, shard

    @property
    def tokens_per_block(self) -> int:
        return self.pool.tokens_per_block

    def k(self, i: int):
        """K cache of the drafter's ``i``-th layer, ``[num_slots, kv_heads, head_dim]``."""
        return self.pool.k[self.layer_ids[i]]

    def v(self, i: int):
        return self.pool.v[self.layer_ids[i]]

    def reserve(self, req_id, length: int) -> None:
        """Make positions ``0..length-1`` of ``req_id`` addressable (own pool: grow or shrink)."""
        if self.shared:
            return
        if req_id not in self.manager:
            self.manager.allocate(req_id, length)
        elif self.manager.length(req_id) < length:
            self.manager.append(req_id, length - self.manager.length(req_id))
        else:
            self.manager.truncate(req_id, length)

    def slots(self, req_id, start: int, stop: int) -> list[int]:
        return self.manager.slots(req_id, start, stop)

    def page_table(self, req_id) -> list[int]:
        return self.manager.page_table(req_id)

    def release(self, req_id) -> None:
        """Forget ``req_id`` (own pool only; shared pages go with the target's request)."""
        if not self.shared and req_id in self.manager:
            self.manager.free(req_id)
