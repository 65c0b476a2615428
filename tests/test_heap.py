"""`specdec.heap`: the objects that exist before a generation are frozen for the garbage collector
while it runs, and handed back after it, with nothing lost."""

from __future__ import annotations

import gc
import weakref

import pytest

from specdec import SamplingParams, SpecEngine
from specdec.config import EngineConfig
from specdec.drafters.suffix_automaton import SuffixAutomatonDrafter
from specdec.errors import ConfigError
from specdec.heap import frozen_heap


class _Cycle:
    def __init__(self):
        self.me = self


def test_frozen_inside_unfrozen_after_even_on_error():
    assert gc.get_freeze_count() == 0
    with frozen_heap() as froze:
        assert froze and gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError):
        with frozen_heap():
            raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


def test_an_enclosing_freeze_is_left_to_its_owner():
    with frozen_heap() as outer:
        count = gc.get_freeze_count()
        with frozen_heap() as inner:
            assert outer and not inner
        # The inner block did not unfreeze the outer's (that would leave 0) nor freeze anew (that
        # would add the objects made since). Frozen objects that reference counting frees meanwhile
        # (a finished thread's frames, a dropped cache entry) leave the count, so it may fall a little.
        assert count - 1_000 < gc.get_freeze_count() <= count
    assert gc.get_freeze_count() == 0


def test_nothing_when_disabled_or_when_the_collector_is_off():
    with frozen_heap(enabled=False) as froze:
        assert not froze and gc.get_freeze_count() == 0
    gc.disable()
    try:
        with frozen_heap() as froze:
            assert not froze and gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_a_cycle_dropped_while_frozen_is_collected_after():
    """Nothing is lost: a cycle made before the block and dropped inside it outlives a full pass
    inside (it is frozen), and the first pass after the block frees it."""
    obj = _Cycle()
    ref = weakref.ref(obj)
    with frozen_heap():
        del obj
        gc.collect()
        assert ref() is not None  # frozen: the pass inside did not walk it
    gc.collect()
    assert ref() is None


def test_young_objects_are_still_collected_inside_the_block():
    """The collector keeps running over what the block itself allocates."""
    with frozen_heap():
        obj = _Cycle()
        ref = weakref.ref(obj)
        del obj
        gc.collect()
        assert ref() is None


def test_a_collect_first_freezes_no_garbage():
    obj = _Cycle()
    ref = weakref.ref(obj)
    del obj
    with frozen_heap(collect=True):
        assert ref() is None


class _Recording(SuffixAutomatonDrafter):
    """The suffix drafter, recording the freeze count at each propose."""

    def __init__(self):
        super().__init__()
        self.freeze_counts = []

    def propose(self, req_ids, max_tokens):
        self.freeze_counts.append(gc.get_freeze_count())
        return super().propose(req_ids, max_tokens)


@pytest.mark.parametrize("batch", [1, 3])
def test_generate_runs_frozen_and_hands_the_heap_back_with_equal_outputs(tiny, batch):
    prompts = [[1 + i, 2, 3, 4, 1 + i, 2, 3] for i in range(batch)]
    params = SamplingParams(max_new_tokens=12)
    outs = {}
    for freeze in (True, False):
        drafter = _Recording()
        with SpecEngine(tiny, drafter, freeze_heap=freeze, max_num_seqs=4) as engine:
            outs[freeze] = [o.token_ids for o in engine.generate(prompts, params, chat=False)]
        assert drafter.freeze_counts, "no propose ran"
        assert all((c > 0) == freeze for c in drafter.freeze_counts), drafter.freeze_counts
        assert gc.get_freeze_count() == 0
    assert outs[True] == outs[False]


def test_an_engine_dropped_after_generate_is_freed(tiny):
    """A frozen generation leaves no engine behind: after it, a dropped engine's objects are
    reclaimed like any others."""
    engine = SpecEngine(tiny, SuffixAutomatonDrafter())
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4), chat=False)
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None


def test_freeze_heap_must_be_a_bool():
    with pytest.raises(ConfigError, match="freeze_heap"):
        EngineConfig(freeze_heap=1)


def test_the_server_freezes_its_heap_after_warm_up_and_unfreezes_it_at_shutdown(tiny):
    """While the app runs, start-up's objects are out of the collector's full passes; at shutdown they
    are handed back; ``freeze_heap=False`` leaves the collector alone."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from specdec.serve import ServeConfig, create_app

    engine = SpecEngine(tiny, max_num_seqs=2)
    for freeze in (True, False):
        app = create_app(engine, ServeConfig("tiny", freeze_heap=freeze))
        assert gc.get_freeze_count() == 0
        with TestClient(app) as client:
            frozen = gc.get_freeze_count()
            out = client.post("/v1/completions", json={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4,
                                                       "temperature": 0}).json()
            assert len(out["choices"][0]["token_ids"]) == 4
        assert (frozen > 10_000) == freeze, frozen  # torch, the engine and the app: far more than 10K objects
        assert gc.get_freeze_count() == 0
