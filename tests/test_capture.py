"""`specdec.capture`: captures collect garbage first, then hold the collector off (CPU tests;
the captures themselves run in every GPU graph test)."""

import gc

from specdec.capture import gc_held


class _Cycle:
    freed = 0

    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it

    def __del__(self):
        _Cycle.freed += 1


def test_garbage_is_collected_before_the_body_and_none_during_it():
    _Cycle.freed = 0
    _Cycle()  # dead at once, but in a cycle
    assert gc.isenabled()
    with gc_held():
        assert _Cycle.freed == 1  # collected on entry, not later inside someone's capture
        assert not gc.isenabled()
        _Cycle()
        for _ in range(10_000):  # allocations that would trigger the collector
            [[] for _ in range(3)]
        assert _Cycle.freed == 1
    assert gc.isenabled()
    gc.collect()
    assert _Cycle.freed == 2


def test_collect_false_and_a_disabled_collector_stay_as_they_were():
    _Cycle.freed = 0
    gc.disable()
    try:
        _Cycle()
        with gc_held(collect=False):
            assert _Cycle.freed == 0 and not gc.isenabled()
        assert not gc.isenabled()  # the caller had it off: it stays off
    finally:
        gc.enable()
    gc.collect()
    assert _Cycle.freed == 1


def test_the_collector_comes_back_after_an_error():
    try:
        with gc_held():
            raise RuntimeError("capture failed")
    except RuntimeError:
        pass
    assert gc.isenabled()
