"""The garbage collector and a running engine.

CPython's full (generation 2) collection is stop-the-world and walks every tracked object of the
process: with a model, its CUDA graphs, a tokenizer and torch loaded, some 300-500K objects, tens of
milliseconds a pass, none of them garbage. A step's own allocations (drafts, batches, outputs) are
freed by reference counting; it is only their number that triggers the passes. So while the engine
generates, the objects that existed before are frozen (:func:`gc.freeze`): the collector still runs,
over what the generation itself allocates, and skips the rest. Everything is unfrozen when the
generation returns, so nothing stays out of the collector's reach for longer (a cycle dropped
meanwhile is collected later, as usual).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["frozen_heap"]


@contextlib.contextmanager
def frozen_heap(enabled: bool = True, collect: bool = False) -> Iterator[bool]:
    """Run the block with the objects tracked before it frozen, unfreezing them after it.

    Does nothing (yields ``False``) when ``enabled`` is false, when the collector is disabled, or
    when something else already froze objects (an enclosing ``frozen_heap``, the application's own
    :func:`gc.freeze`): their freeze is theirs to undo.

    Args:
        enabled: freeze at all.
        collect: collect first (a full pass), so that no garbage of before is frozen with the rest:
            for a long block (a server's life; ``specdec serve`` freezes after its warm-up), not for
            a short one (:meth:`SpecEngine.generate`, where the pass would cost more than it saves).

    Yields:
        Whether this block froze the heap.
    """
    if not enabled or not gc.isenabled() or gc.get_freeze_count():
        yield False
        return
    if collect:
        gc.collect()
    gc.freeze()  # O(1): the generations are spliced into the permanent one
    try:
        yield True
    finally:
        gc.unfreeze()
