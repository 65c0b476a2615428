"""The KV-sharing decision (docs/design.md §3) and pool sizing arithmetic (§8)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.errors import ConfigError
from specdec.kvcache import LayerSpec
from specdec.kvcache.sizing import GiB, allocator_cap_bytes, kv_budget_bytes, num_pages_for_budget
from specdec.scheduler import decide_kv_sharing

PAGES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
KV = LayerSpec("gqa", 2, 64, owner="draft")
K_ONLY = LayerSpec("mla", 1, 576, has_v=False, owner="draft")


@settings(max_examples=300, deadline=None)
@given(layers=st.lists(st.sampled_from([KV, K_ONLY]), max_size=3), reads=st.sets(st.sampled_from(PAGES), min_size=1),
       page=st.sampled_from(PAGES), cp=st.sampled_from([1, 2, 4]), helix_reader=st.booleans(), opt_in=st.booleans())
def test_decision_follows_the_rules(layers, reads, page, cp, helix_reader, opt_in):
    d = decide_kv_sharing(tuple(layers), lambda p: p in reads, helix_reader, page, opt_in, cp)
    if not layers:
        assert not d.shared and "no KV layers" in d.reason
        return
    must_separate = (not opt_in or page not in reads or (cp > 1 and not helix_reader)
                     or (cp > 1 and any(s.has_v for s in layers)))
    assert d.shared == (not must_separate)
    if d.shared:
        assert d.draft_tokens_per_block is None
    else:  # a separate pool always uses a page size the drafter reads, the target's when it can
        assert d.draft_tokens_per_block in reads
        assert d.draft_tokens_per_block == page or page not in reads
        assert not d.sharded
    assert d.reason


def test_named_cases():
    reads_64 = lambda p: p in (16, 32, 64)  # noqa: E731
    d = decide_kv_sharing((KV,), reads_64, False, 128)
    assert not d.shared and "128" in d.reason and d.draft_tokens_per_block == 16
    assert decide_kv_sharing((), reads_64, False, 128).reason.startswith("the drafter has no KV layers")
    d = decide_kv_sharing((K_ONLY,), reads_64, False, 64, helix_cp=2)
    assert not d.shared and "Helix" in d.reason and not d.sharded
    d = decide_kv_sharing((KV,), reads_64, True, 64, helix_cp=2)
    assert not d.shared and "K-only" in d.reason
    assert decide_kv_sharing((K_ONLY,), reads_64, True, 64, helix_cp=2).shared
    d = decide_kv_sharing((KV,), reads_64, False, 64, target_accepts_appended_layers=False)
    assert not d.shared and "does not accept" in d.reason
    with pytest.raises(ConfigError, match="reads_managed_ctx_pages"):
        decide_kv_sharing((KV,), lambda p: False, False, 64)


@pytest.mark.parametrize("total,free,reserved,cap", [
    (80 * GiB, 60 * GiB, 10 * GiB, 69 * GiB),  # big GPU: 1 GiB stays outside
    (8 * GiB, GiB // 2, 6 * GiB, 6 * GiB),  # free < 1 GiB: all of it stays outside, cap = what torch holds
    (2 * GiB, GiB // 4, GiB // 2, GiB // 2),  # small GPU, free + reserved < 1 GiB: never below torch's share
    (4 * GiB, 3 * GiB, 0, 2 * GiB),
])
def test_allocator_cap(total, free, reserved, cap):
    assert allocator_cap_bytes(total, free, reserved) == cap
    assert reserved <= cap <= total


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 200 * GiB), frac=st.floats(0, 1), held=st.floats(0, 1))
def test_allocator_cap_properties(total, frac, held):
    free = int(total * frac)
    reserved = int((total - free) * held)
    cap = allocator_cap_bytes(total, free, reserved)
    assert reserved <= cap <= total
    assert cap == reserved or total - cap >= min(GiB, free) - (total - free - reserved)


def test_pool_capacity_counts_target_and_draft_layers():
    target = [LayerSpec("gqa", 3, 64)] * 30  # SmolLM2 fp32: 46080 B/token
    per_token = sum(s.bytes_per_token for s in target) + KV.bytes_per_token
    assert per_token == 46080 + 1024
    budget = kv_budget_bytes(cap=10 * GiB, reserved_by_torch=GiB, activation_bytes=GiB)
    assert num_pages_for_budget(budget, per_token, 16) == (8 * GiB) // (per_token * 16)
    with pytest.raises(ConfigError, match="holds no page"):
        num_pages_for_budget(kv_budget_bytes(GiB, GiB, 0), per_token, 16)
    with pytest.raises(ConfigError):
        allocator_cap_bytes(GiB, 2 * GiB, 0)
