"""Paged KV cache: the manager against a Python model, layer specs, pools and sizing.

The stateful test drives :class:`KVCacheManager` with random allocate / append /
truncate / free sequences over a few requests and a small pool, and checks the
invariants of docs/design.md §3 and §8 after every operation: a page belongs to at
most one request, owned + free == all pages, each request owns exactly
``ceil(len / tokens_per_block)`` pages, and exhaustion raises
:class:`PoolExhaustedError` exactly when the model says so, changing nothing.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from specdec.errors import ConfigError, InvalidRequestError, PoolExhaustedError
from specdec.kvcache import KVCacheManager, KVPool, LayerSpec, bytes_per_token, num_pages_for_budget, pages_for

REQS = ("a", "b", "c", 7)  # a few request ids, one not a string (ids are any Hashable)
req_ids = st.sampled_from(REQS)
counts = st.integers(0, 30)  # up to 2.5x a 12-page pool of 4-token pages


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


# --------------------------------------------------------------------------- stateful


class ManagerMachine(RuleBasedStateMachine):
    """``KVCacheManager`` vs a model holding only each request's length.

    The model also remembers each request's page table, to check that growing
    keeps the existing pages and that rollback (truncate) keeps a prefix: the
    K/V already written for kept positions must not move.
    """

    @initialize(num_pages=st.sampled_from([12, 12, 1, 3, 7]), tpb=st.sampled_from([4, 4, 1, 5]))
    def setup(self, num_pages: int, tpb: int) -> None:
        self.num_pages, self.tpb = num_pages, tpb
        self.m = KVCacheManager(num_pages, tpb)
        self.lengths: dict = {}  # model: req -> tokens
        self.tables: dict = {}  # last page table seen per request

    # -- model ---------------------------------------------------------------
    def model_free(self) -> int:
        return self.num_pages - sum(ceil_div(n, self.tpb) for n in self.lengths.values())

    def fits(self, req, new_len: int) -> bool:
        have = ceil_div(self.lengths.get(req, 0), self.tpb)
        return ceil_div(new_len, self.tpb) - have <= self.model_free()

    def snapshot(self):
        return (
            self.m.num_free_pages,
            {r: (self.m.length(r), self.m.page_table(r)) for r in REQS if r in self.m},
        )

    # -- rules ---------------------------------------------------------------
    @rule(req=req_ids, n=counts)
    def allocate(self, req, n: int) -> None:
        before = self.snapshot()
        assert self.m.can_grow(None, n) == self.fits(None, n)
        if req in self.lengths:
            with pytest.raises(InvalidRequestError, match="already allocated"):
                self.m.allocate(req, n)
            assert self.snapshot() == before
        elif not self.fits(req, n):
            with pytest.raises(PoolExhaustedError):
                self.m.allocate(req, n)
            assert self.snapshot() == before
            assert req not in self.m
        else:
            self.m.allocate(req, n)
            self.lengths[req] = n
            self.tables[req] = self.m.page_table(req)

    @rule(req=req_ids, n=counts)
    def append(self, req, n: int) -> None:
        before = self.snapshot()
        if req not in self.lengths:
            with pytest.raises(InvalidRequestError, match="holds no pages"):
                self.m.append(req, n)
            assert self.snapshot() == before
            return
        new_len = self.lengths[req] + n
        ok = self.fits(req, new_len)
        assert self.m.can_grow(req, n) == ok
        if not ok:
            with pytest.raises(PoolExhaustedError, match="more page"):
                self.m.append(req, n)
            assert self.snapshot() == before
            return
        self.m.append(req, n)
        table = self.m.page_table(req)
        assert table[: len(self.tables[req])] == self.tables[req], "growing moved existing pages"
        self.lengths[req], self.tables[req] = new_len, table

    @rule(req=req_ids, frac=st.floats(0, 1), overshoot=st.integers(0, 3))
    def truncate(self, req, frac: float, overshoot: int) -> None:
        before = self.snapshot()
        if req not in self.lengths:
            with pytest.raises(InvalidRequestError):
                self.m.truncate(req, 0)
            assert self.snapshot() == before
            return
        cur = self.lengths[req]
        if overshoot:  # past the end, or negative: refused, nothing changes
            for bad in (cur + overshoot, -overshoot):
                with pytest.raises(InvalidRequestError, match="new_length"):
                    self.m.truncate(req, bad)
                assert self.snapshot() == before
        new_len = int(cur * frac)
        slots_kept = self.m.slots(req, 0, new_len)
        self.m.truncate(req, new_len)
        table = self.m.page_table(req)
        assert table == self.tables[req][: len(table)], "rollback must keep a prefix of the pages"
        assert self.m.slots(req, 0, new_len) == slots_kept
        self.lengths[req], self.tables[req] = new_len, table

    @rule(req=req_ids, n=st.integers(-2, 30))
    def resize(self, req, n: int) -> None:
        """Grow or shrink in one call: as append or truncate would, a prefix of the pages kept."""
        before = self.snapshot()
        if req not in self.lengths or n < 0:
            with pytest.raises(InvalidRequestError):
                self.m.resize(req, n)
            assert self.snapshot() == before
            return
        if not self.fits(req, n):
            with pytest.raises(PoolExhaustedError, match="more page"):
                self.m.resize(req, n)
            assert self.snapshot() == before
            return
        self.m.resize(req, n)
        table = self.m.page_table(req)
        keep = min(len(table), len(self.tables[req]))
        assert table[:keep] == self.tables[req][:keep], "resizing moved kept pages"
        assert self.m.page_tuple(req) == tuple(table)
        self.lengths[req], self.tables[req] = n, table

    @rule(req=req_ids)
    def free(self, req) -> None:
        before = self.snapshot()
        if req not in self.lengths:
            with pytest.raises(InvalidRequestError):
                self.m.free(req)
            assert self.snapshot() == before
            return
        self.m.free(req)
        del self.lengths[req], self.tables[req]
        assert req not in self.m
        with pytest.raises(InvalidRequestError):
            self.m.length(req)

    @rule(req=req_ids, n=st.integers(-3, -1))
    def negative_counts_refused(self, req, n: int) -> None:
        before = self.snapshot()
        with pytest.raises(InvalidRequestError):
            if req in self.lengths:
                self.m.append(req, n)
            else:
                self.m.allocate(req, n)
        assert self.snapshot() == before

    @precondition(lambda self: self.lengths)
    @rule()
    def free_everything_returns_all_pages(self) -> None:
        for req in list(self.lengths):
            self.m.free(req)
        self.lengths.clear()
        self.tables.clear()
        assert self.m.num_free_pages == self.num_pages
        assert self.m.can_grow(None, self.num_pages * self.tpb)
        assert not self.m.can_grow(None, self.num_pages * self.tpb + 1)

    # -- invariants ----------------------------------------------------------
    @invariant()
    def pages_are_owned_once_and_none_leak(self) -> None:
        owned = [p for r in self.lengths for p in self.m.page_table(r)]
        assert len(owned) == len(set(owned)), f"a page is owned twice: {owned}"
        assert all(0 <= p < self.num_pages for p in owned)
        assert len(owned) + self.m.num_free_pages == self.num_pages
        assert self.m.num_free_pages == self.model_free()

    @invariant()
    def lengths_and_page_counts_match_model(self) -> None:
        for r in REQS:
            assert (r in self.m) == (r in self.lengths)
        for r, n in self.lengths.items():
            assert self.m.length(r) == n
            assert len(self.m.page_table(r)) == ceil_div(n, self.tpb) == pages_for(n, self.tpb)

    @invariant()
    def slots_are_disjoint_and_in_owned_pages(self) -> None:
        seen: set[int] = set()
        for r, n in self.lengths.items():
            table, slots = self.m.page_table(r), self.m.slots(r, 0, n)
            assert slots == [table[p // self.tpb] * self.tpb + p % self.tpb for p in range(n)]
            assert seen.isdisjoint(slots)
            seen.update(slots)

    @invariant()
    def can_grow_agrees_with_model(self) -> None:
        free_tokens = self.model_free() * self.tpb
        assert self.m.can_grow(None, free_tokens)
        assert not self.m.can_grow(None, free_tokens + 1)
        for r, n in self.lengths.items():
            slack = ceil_div(n, self.tpb) * self.tpb - n  # room left in its last page
            assert self.m.can_grow(r, slack + free_tokens)
            assert not self.m.can_grow(r, slack + free_tokens + 1)


ManagerMachine.TestCase.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)
TestManagerMachine = ManagerMachine.TestCase


# --------------------------------------------------------------------------- manager units


def test_slots_map_positions_to_page_times_tpb_plus_offset():
    m = KVCacheManager(num_pages=8, tokens_per_block=4)
    m.allocate("a", 3)  # page 0
    m.allocate("b", 5)  # pages 1, 2
    m.append("a", 3)  # a: pages 0, 3
    m.free("b")
    m.append("a", 4)  # a takes freed pages
    table = m.page_table("a")
    assert table[:2] == [0, 3] and len(table) == 3
    assert m.slots("a", 0, 10) == [table[p // 4] * 4 + p % 4 for p in range(10)]
    assert m.slots("a", 4, 6) == [12, 13]
    assert m.slots("a", 5, 5) == []
    for start, stop in ((0, 11), (-1, 2), (3, 2)):
        with pytest.raises(IndexError):
            m.slots("a", start, stop)


def test_allocation_id_survives_append_and_truncate_not_a_new_allocation():
    m = KVCacheManager(8, 4)
    m.allocate("a", 5)
    first = m.allocation("a")
    m.append("a", 6)
    m.truncate("a", 2)
    assert m.allocation("a") == first
    m.allocate("b", 3)
    assert m.allocation("b") != first
    m.free("a")
    with pytest.raises(InvalidRequestError, match="holds no pages"):
        m.allocation("a")
    m.allocate("a", 5)  # freed, then allocated again (a preempted request readmitted)
    assert m.allocation("a") not in (first, m.allocation("b"))
    with pytest.raises(PoolExhaustedError):
        m.allocate("c", 100)
    with pytest.raises(InvalidRequestError):  # a failed allocation leaves no id behind
        m.allocation("c")


def test_page_table_is_a_copy():
    m = KVCacheManager(4, 2)
    m.allocate("a", 3)
    m.page_table("a").append(99)
    assert len(m.page_table("a")) == 2


def test_exhaustion_message_and_nothing_changes():
    m = KVCacheManager(num_pages=2, tokens_per_block=4)
    m.allocate("a", 5)
    with pytest.raises(PoolExhaustedError, match="needs 1 more page"):
        m.allocate("b", 1)
    assert "b" not in m and m.num_free_pages == 0 and m.length("a") == 5
    m.append("a", 3)  # fills the last page: no new page needed
    assert m.length("a") == 8


# --------------------------------------------------------------------------- layer specs


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(kind="mha", num_kv_heads=1, head_dim=8), "kind"),
        (dict(kind="gqa", num_kv_heads=0, head_dim=8), "num_kv_heads"),
        (dict(kind="gqa", num_kv_heads=1, head_dim=0), "head_dim"),
        (dict(kind="gqa", num_kv_heads=2, head_dim=8, owner="drafter"), "owner"),
    ],
)
def test_layer_spec_validation_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=rf"LayerSpec\..*{field}"):
        LayerSpec(**kwargs)


@pytest.mark.parametrize("v_head_dim", [0, -64])
def test_layer_spec_rejects_bad_v_head_dim(v_head_dim):
    with pytest.raises(ConfigError, match="v_head_dim"):
        LayerSpec("gqa", 1, 64, v_head_dim=v_head_dim)


def test_bytes_per_token_kv_and_k_only():
    gqa = LayerSpec("gqa", num_kv_heads=3, head_dim=64, dtype=torch.float32)
    mla = LayerSpec("mla", num_kv_heads=1, head_dim=576, dtype=torch.bfloat16, has_v=False, v_head_dim=512)
    assert gqa.bytes_per_token == 3 * (64 + 64) * 4 == 1536
    assert mla.bytes_per_token == 576 * 2 == 1152  # K only: v_head_dim does not count
    narrow_v = LayerSpec("gqa", num_kv_heads=2, head_dim=64, v_head_dim=32, dtype=torch.float16)
    assert narrow_v.bytes_per_token == 2 * (64 + 32) * 2
    assert bytes_per_token([gqa, mla, narrow_v]) == 1536 + 1152 + 384
    assert bytes_per_token(()) == 0


def test_pool_tensors_and_appended_draft_layers():
    target = [LayerSpec("gqa", 3, 64), LayerSpec("gqa", 3, 64)]
    pool = KVPool(target, num_pages=5, tokens_per_block=4)
    assert pool.num_slots == pool.capacity_tokens == 20
    assert [tuple(k.shape) for k in pool.k] == [(20, 3, 64)] * 2
    assert pool.layer_ids("target") == [0, 1] and pool.layer_ids("draft") == []
    assert pool.bytes_per_token == 2 * 1536

    draft = [
        LayerSpec("mla", 1, 40, has_v=False, v_head_dim=32, owner="draft"),
        LayerSpec("gqa", 2, 16, v_head_dim=8, dtype=torch.bfloat16, owner="draft"),
    ]
    ids = pool.add_layers(draft)
    assert list(ids) == [2, 3] and pool.layer_ids("draft") == [2, 3]
    assert pool.layer_ids("target") == [0, 1]
    assert pool.specs[2:] == draft
    assert pool.v[2] is None and tuple(pool.k[2].shape) == (20, 1, 40)
    assert tuple(pool.v[3].shape) == (20, 2, 8) and pool.v[3].dtype == torch.bfloat16
    # Capacity is sized on target + draft bytes per token (docs/design.md §8).
    assert pool.bytes_per_token == 2 * 1536 + 40 * 4 + 2 * (16 + 8) * 2
    assert list(pool.add_layers([])) == []


@pytest.mark.parametrize(
    "make",
    [
        lambda: num_pages_for_budget(1 << 20, 1536, tokens_per_block=0),
        lambda: KVCacheManager(4, tokens_per_block=0).allocate("a", 1),
        lambda: KVPool([LayerSpec("gqa", 1, 8)], num_pages=2, tokens_per_block=0),
    ],
    ids=["sizing", "manager", "pool"],
)
def test_tokens_per_block_must_be_positive(make):
    with pytest.raises(ConfigError, match="tokens_per_block"):
        make()


def test_pool_needs_a_page():
    with pytest.raises(ConfigError, match="num_pages"):
        KVPool([LayerSpec("gqa", 1, 8)], num_pages=0, tokens_per_block=4)


# --------------------------------------------------------------------------- sizing


@pytest.mark.parametrize(
    ("budget", "bpt", "tpb", "margin", "pages"),
    [
        (10 << 20, 1536, 16, 0, (10 << 20) // (1536 * 16)),  # 426
        (10 << 20, 1536, 16, 1 << 20, (9 << 20) // (1536 * 16)),
        (1536 * 16, 1536, 16, 0, 1),  # exactly one page
        (1536 * 16 * 2 - 1, 1536, 16, 0, 1),  # floors
        (8 << 30, 1536 + 1152, 64, 1 << 30, (7 << 30) // ((1536 + 1152) * 64)),
    ],
)
def test_num_pages_for_budget(budget, bpt, tpb, margin, pages):
    assert num_pages_for_budget(budget, bpt, tpb, safety_margin=margin) == pages


@pytest.mark.parametrize(
    ("budget", "bpt", "tpb", "margin", "match"),
    [
        (1536 * 16 - 1, 1536, 16, 0, "holds no page"),
        (10 << 20, 1536, 16, 10 << 20, "holds no page"),  # margin eats it all
        (1 << 20, 1536, 16, 2 << 20, "holds no page"),  # margin above the budget
        (0, 1536, 16, 0, "holds no page"),
        (1 << 20, 0, 16, 0, "bytes_per_token"),
    ],
)
def test_num_pages_for_budget_errors(budget, bpt, tpb, margin, match):
    with pytest.raises(ConfigError, match=match):
        num_pages_for_budget(budget, bpt, tpb, safety_margin=margin)


@settings(max_examples=200, deadline=None)
@given(
    budget=st.integers(0, 1 << 40),
    bpt=st.integers(1, 1 << 16),
    tpb=st.sampled_from([1, 4, 16, 32, 64, 128]),
    margin=st.integers(0, 1 << 32),
)
def test_num_pages_for_budget_is_the_floor(budget, bpt, tpb, margin):
    usable = budget - margin
    if usable < bpt * tpb:
        with pytest.raises(ConfigError):
            num_pages_for_budget(budget, bpt, tpb, margin)
        return
    pages = num_pages_for_budget(budget, bpt, tpb, margin)
    assert pages * bpt * tpb <= usable < (pages + 1) * bpt * tpb


@settings(max_examples=30, deadline=None)
@given(heads=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 40), st.booleans(),
                                st.sampled_from([torch.float32, torch.bfloat16, torch.float16])), min_size=1, max_size=5),
       pages=st.integers(1, 5), block=st.integers(1, 7))
def test_cpu_pool_layers_are_zeroed_aligned_and_disjoint(heads, pages, block):
    """On the CPU a call's K/V tensors are views of one buffer (so a dropped pool's memory goes back
    to the system): each is zero, contiguous, of its layer's shape and dtype, 64-byte aligned, and
    writing one leaves every other unchanged."""
    specs = [LayerSpec("gqa", num_kv_heads=h, head_dim=d, dtype=dt) if has_v else
             LayerSpec("mla", num_kv_heads=1, head_dim=d, dtype=dt, has_v=False, v_head_dim=max(1, d - 1))
             for h, d, has_v, dt in heads]
    pool = KVPool(specs[:1], pages, block)
    pool.add_layers(specs[1:])
    tensors = [t for pair in zip(pool.k, pool.v) for t in pair if t is not None]
    assert len(tensors) == sum(2 if s.has_v else 1 for s in specs)
    for i, s in enumerate(specs):
        assert pool.k[i].shape == (pages * block, s.num_kv_heads, s.head_dim) and pool.k[i].dtype == s.dtype
        assert (pool.v[i] is None) == (not s.has_v)
    for t in tensors:
        assert t.is_contiguous() and t.data_ptr() % 64 == 0 and not t.any()
    for t in tensors:
        t.fill_(1)
        assert sum(bool(u.any()) for u in tensors) == 1
        t.zero_()
