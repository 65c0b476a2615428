"""Helix context parallelism (specdec/parallel/helix.py): ownership and rollback, the exact LSE
combine, and the distributed step on real gloo process groups of 2 and 4 ranks against the
single-rank torch_ref result."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.attention.backends.base import PhaseBatch
from specdec.attention.backends.torch_ref import TorchRefBackend
from specdec.errors import ConfigError, InvalidRequestError, PoolExhaustedError
from specdec.kvcache import KVCacheManager, pages_for
from specdec.parallel.helix import (
    HelixKVManager,
    HelixLayout,
    combine_partials,
    gather_heads,
    helix_attention,
    mla_attention_lse,
    plan_shard,
    shard_attention,
)

LATENT, ROPE = 512, 64  # real MLA dims: kv_lora_rank, qk_rope_head_dim
SCALE = 1 / math.sqrt(192)
DIST_TIMEOUT_S = 90


# -- ownership and rollback -----------------------------------------------------------------------
def _check_sharded(layout: HelixLayout, managers: list[HelixKVManager], lengths: dict[int, int], num_pages: int):
    """Invariants of a set of per-rank managers holding requests of global ``lengths``."""
    for m in managers:
        held = 0
        for req, n in lengths.items():
            assert m.length(req) == n
            assert m.local_length(req) == layout.local_length(n, m.rank)
            pages = m.page_table(req)
            assert len(pages) == pages_for(layout.local_length(n, m.rank), layout.tokens_per_block)
            held += len(pages)
        assert held + m.num_free_pages == num_pages, f"rank {m.rank} leaked pages"
    for req, n in lengths.items():
        assert sum(layout.local_length(n, r) for r in range(layout.cp)) == n
        seen: dict[int, set[int]] = {r: set() for r in range(layout.cp)}
        for pos in range(n):
            rank, local_pos = layout.owner(pos)
            assert layout.global_position(rank, local_pos) == pos
            for m in managers:
                if m.rank == rank:
                    slot = m.slot(req, pos)
                    assert slot not in seen[rank]
                    seen[rank].add(slot)
                else:
                    with pytest.raises(InvalidRequestError):
                        m.slot(req, pos)
    # No two requests share a slot on a rank.
    for m in managers:
        slots = [m.slot(req, p) for req, n in lengths.items() for p in range(n) if layout.owner(p)[0] == m.rank]
        assert len(slots) == len(set(slots))


@settings(max_examples=150, deadline=None)
@given(
    cp=st.integers(1, 4),
    tpb=st.sampled_from([1, 2, 4, 16]),
    ops=st.lists(st.tuples(st.integers(0, 1), st.sampled_from(["append", "truncate", "free"]), st.integers(0, 40)),
                 max_size=25),
)
def test_page_ownership_and_rollback(cp, tpb, ops):
    layout, num_pages = HelixLayout(cp, tpb), 64
    managers = [HelixKVManager(layout, r, num_pages) for r in range(cp)]
    lengths: dict[int, int] = {}
    for req, op, n in ops:
        if op == "append":
            fits = [m.can_grow(req if req in lengths else None, n) for m in managers]
            if not all(fits):  # ranks agree before growing; a rank without room raises and stays as it was
                for m, fit in zip(managers, fits):
                    if not fit:
                        with pytest.raises(PoolExhaustedError):
                            m.append(req, n) if req in lengths else m.allocate(req, n)
            elif req not in lengths:
                for m in managers:
                    m.allocate(req, n)
                lengths[req] = n
            else:
                before = {m.rank: m.page_table(req) for m in managers}
                for m in managers:
                    m.append(req, n)
                lengths[req] += n
                for m in managers:  # growing never moves a page already held
                    assert m.page_table(req)[: len(before[m.rank])] == before[m.rank]
        elif op == "truncate" and req in lengths:
            new_len = lengths[req] * n // 40
            kept = {p: managers[layout.owner(p)[0]].slot(req, p) for p in range(new_len)}
            freed_before = [m.num_free_pages for m in managers]
            for m in managers:
                m.truncate(req, new_len)
            for r, m in enumerate(managers):  # exactly the rank-local pages past the rank's share
                want = pages_for(layout.local_length(lengths[req], r), tpb) - pages_for(
                    layout.local_length(new_len, r), tpb)
                assert m.num_free_pages - freed_before[r] == want
            lengths[req] = new_len
            assert all(managers[layout.owner(p)[0]].slot(req, p) == s for p, s in kept.items())
        elif op == "free" and req in lengths:
            for m in managers:
                m.free(req)
            del lengths[req]
        _check_sharded(layout, managers, lengths, num_pages)


def test_owned_slots_and_bad_input():
    layout = HelixLayout(2, 4)
    m0, m1 = HelixKVManager(layout, 0, 8), HelixKVManager(layout, 1, 8)
    for m in (m0, m1):
        m.allocate("a", 11)
    # Positions 0-3, 8-10 on rank 0; 4-7 on rank 1. A verify of rows 6..10 straddles both.
    idx0, slots0 = m0.owned_slots("a", 6, 11)
    idx1, slots1 = m1.owned_slots("a", 6, 11)
    assert idx0 == [2, 3, 4] and idx1 == [0, 1]
    assert slots0 == [m0.slot("a", p) for p in (8, 9, 10)] and slots1 == [m1.slot("a", p) for p in (6, 7)]
    assert layout.local_length(11, 0) == 7 and layout.local_length(11, 1) == 4
    with pytest.raises(IndexError):
        m0.slot("a", 11)
    with pytest.raises(InvalidRequestError):
        m0.truncate("a", 12)
    with pytest.raises(InvalidRequestError):
        HelixKVManager(layout, 2, 8)
    first = m0.allocation("a")  # the rank-local allocation: kept by growth, new after free + allocate
    m0.append("a", 3)
    assert m0.allocation("a") == first
    m0.free("a")
    m0.allocate("a", 4)
    assert m0.allocation("a") != first
    with pytest.raises(ConfigError, match="cp"):
        HelixLayout(0, 4)


# -- attention with LSE and the combine -----------------------------------------------------------
def test_lse_attention_matches_torch_ref_and_definition():
    g = torch.Generator().manual_seed(0)
    tpb, kv_lens, q_lens, H = 16, (1, 20, 70), (1, 4, 8), 16
    full = KVCacheManager(16, tpb)
    cache = torch.zeros(16 * tpb, 1, LATENT + ROPE)
    for i, n in enumerate(kv_lens):
        full.allocate(i, n)
        cache[full.slots(i, 0, n)] = torch.randn(n, 1, LATENT + ROPE, generator=g)
    q = torch.randn(sum(q_lens), H, LATENT + ROPE, generator=g)
    tables = tuple(tuple(full.page_table(i)) for i in range(3))
    ref = TorchRefBackend()
    want = ref.run(ref.plan(PhaseBatch(q_lens, kv_lens, tables, tpb, torch.device("cpu"))), q, cache, None, SCALE, LATENT)
    plan = plan_shard(q_lens, kv_lens, tables, HelixLayout(1, tpb), 0)
    out, lse = shard_attention(plan, q, cache, SCALE, LATENT)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    # LSE by its definition, for the last row of request 2 (it sees all 70 rows).
    k = cache[full.slots(2, 0, 70)][:, 0]  # [70, D]
    torch.testing.assert_close(lse[-1], torch.logsumexp(q[-1] @ k.T * SCALE, dim=-1), rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(
    num_shards=st.integers(1, 5),
    assign=st.lists(st.integers(0, 4), min_size=1, max_size=40),
    q_len=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_combine_equals_full_attention(num_shards, assign, q_len, seed):
    """Any split of the KV into shards (some empty, some invisible to early rows) combines exactly."""
    g = torch.Generator().manual_seed(seed)
    S, H, D, Dv = len(assign), 3, 24, 16
    q_len = min(q_len, S)
    kv = torch.randn(1, S, D, generator=g) * 3  # [1, S, D], wide scores exercise the rescale
    q = torch.randn(1, q_len, H, D, generator=g)
    kv_pos = torch.arange(S)[None]  # [1, S]
    q_pos = torch.arange(S - q_len, S)[None]  # [1, q_len]
    want, want_lse = mla_attention_lse(q, kv, q_pos, kv_pos, 0.3, Dv)
    outs, lses = [], []
    for s in range(num_shards):
        rows = torch.tensor([i for i, a in enumerate(assign) if a % num_shards == s], dtype=torch.long)
        pos = rows[None] if len(rows) else torch.full((1, 1), 10**9)  # an empty shard: one padding row
        o, lse = mla_attention_lse(q, kv[:, rows] if len(rows) else kv[:, :1], q_pos, pos, 0.3, Dv)
        if not len(rows):
            assert torch.isinf(lse).all() and (o == 0).all()
        outs.append(o)
        lses.append(lse)
    got, got_lse = combine_partials(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-5, atol=1e-5)


def test_combine_all_empty_is_zero_with_minus_inf():
    out, lse = combine_partials(torch.zeros(3, 2, 4, 5), torch.full((3, 2, 4), float("-inf")))
    assert (out == 0).all() and torch.isneginf(lse).all()


# -- the distributed step on gloo -----------------------------------------------------------------
def _cases(cp: int):
    """(num_heads, tokens_per_block, q_lens, kv_lens): heads 16/48/96/128, pages 16/32/64/128, q_len
    1-8, mixed lengths in one batch: verify rows straddling a page boundary (rows on two ranks),
    verify rows inside a page, decode rows of a long request and of one shorter than a page (ranks
    > 0 own nothing of it), and a context request."""
    for heads in (16, 48, 96, 128):
        for tpb in (16, 32, 64, 128):
            q = {16: 8, 32: 2}.get(tpb, 4)
            yield heads, tpb, (q, 2, 1, 1, 9), (tpb * 2 + q // 2, tpb + 1, tpb * cp + 5, 3, 9)


def _build(layout: HelixLayout, rank: int, kv_rows: list[torch.Tensor], num_pages: int):
    """Write each request's latent rows into the full cache and into ``rank``'s shard."""
    tpb, D = layout.tokens_per_block, kv_rows[0].shape[-1]
    full, mine = KVCacheManager(num_pages, tpb), HelixKVManager(layout, rank, num_pages)
    full_cache, cache = torch.zeros(num_pages * tpb, 1, D), torch.zeros(num_pages * tpb, 1, D)
    for i, rows in enumerate(kv_rows):
        full.allocate(i, len(rows))
        full_cache[full.slots(i, 0, len(rows))] = rows[:, None]
        mine.allocate(i, len(rows))
        idx, slots = mine.owned_slots(i, 0, len(rows))
        cache[slots] = rows[idx][:, None]
    return full, full_cache, mine, cache


def _reference(full: KVCacheManager, cache, q, q_lens, kv_lens, tpb):
    ref = TorchRefBackend()
    tables = tuple(tuple(full.page_table(i)) for i in range(len(kv_lens)))
    plan = ref.plan(PhaseBatch(tuple(q_lens), tuple(kv_lens), tables, tpb, torch.device("cpu")))
    return ref.run(plan, q, cache, None, SCALE, LATENT)  # [T, H, LATENT]


def _compare(layout, rank, full, full_cache, mine, cache, q, q_lens, kv_lens, what):
    """Helix on this rank vs torch_ref over the whole cache for this rank's heads (attention is
    separable by head, so each rank checks its slice and no rank recomputes all heads)."""
    cp, H, tpb = layout.cp, q.shape[1], layout.tokens_per_block
    heads = slice(rank * H // cp, (rank + 1) * H // cp)
    want = _reference(full, full_cache, q[:, heads].contiguous(), q_lens, kv_lens, tpb)  # [T, H / cp, LATENT]
    plan = plan_shard(q_lens, kv_lens, [mine.page_table(i) for i in range(len(kv_lens))], layout, rank)
    head_slice = helix_attention(plan, q, cache, SCALE, LATENT)
    assert head_slice.shape == (q.shape[0], H // cp, LATENT), what
    torch.testing.assert_close(head_slice, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank}, {what}: {m}")
    gathered = gather_heads(head_slice)  # [T, H, LATENT]
    assert gathered.shape == q.shape[:2] + (LATENT,)
    assert torch.equal(gathered[:, heads], head_slice), f"rank {rank}, {what}: gather_heads out of rank order"


def _worker(rank: int, world: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=DIST_TIMEOUT_S))
    try:
        D = LATENT + ROPE
        for n, (heads, tpb, q_lens, kv_lens) in enumerate(_cases(world)):
            g = torch.Generator().manual_seed(n)  # the same data on every rank
            rows = [torch.randn(k, D, generator=g) for k in kv_lens]
            q = torch.randn(sum(q_lens), heads, D, generator=g)
            layout, num_pages = HelixLayout(world, tpb), sum(pages_for(k, tpb) for k in kv_lens) + 2
            full, full_cache, mine, cache = _build(layout, rank, rows, num_pages)
            what = f"case {n}: H={heads} tpb={tpb} q_lens={q_lens} kv_lens={kv_lens}"
            _compare(layout, rank, full, full_cache, mine, cache, q, q_lens, kv_lens, what)
            if n % 2 == 0:
                # Rollback: reject all but one draft of request 0, then verify new drafts there.
                keep = kv_lens[0] - q_lens[0] + 1
                full.truncate(0, keep)
                mine.truncate(0, keep)
                new = torch.randn(q_lens[0], D, generator=g)
                full.append(0, len(new))
                full_cache[full.slots(0, keep, keep + len(new))] = new[:, None]
                mine.append(0, len(new))
                idx, slots = mine.owned_slots(0, keep, keep + len(new))
                cache[slots] = new[idx][:, None]
                kv2 = (keep + len(new), *kv_lens[1:])
                _compare(layout, rank, full, full_cache, mine, cache, q, q_lens, kv2, what + " after rollback")
        # What travels does not grow with the context: the same batch over 8x the context sends the
        # same all-to-all (partials and LSEs of the rows' heads), and nothing else is exchanged.
        sent, all_to_all, others = [], dist.all_to_all_single, {}

        def counting(out, inp, *args, **kwargs):
            sent.append(inp.numel())
            return all_to_all(out, inp, *args, **kwargs)

        def refused(name):
            def call(*args, **kwargs):
                raise AssertionError(f"helix_attention called {name}")
            return call

        dist.all_to_all_single = counting
        for name in ("all_gather", "all_reduce", "all_gather_into_tensor", "broadcast", "send", "recv"):
            others[name] = getattr(dist, name)
            setattr(dist, name, refused(name))
        try:
            for ctx in (40, 320):
                g = torch.Generator().manual_seed(ctx)
                rows = [torch.randn(ctx, D, generator=g) for _ in range(3)]
                lay = HelixLayout(world, 16)
                _, _, m, c = _build(lay, rank, rows, 3 * pages_for(ctx, 16) + 2)
                plan = plan_shard((1, 2, 1), (ctx,) * 3, [m.page_table(i) for i in range(3)], lay, rank)
                helix_attention(plan, torch.randn(4, 16, D, generator=g), c, SCALE, LATENT)
        finally:
            dist.all_to_all_single = all_to_all
            for name, fn in others.items():
                setattr(dist, name, fn)
        assert len(sent) == 2 and sent[0] == sent[1] == 4 * 16 * (LATENT + 1), sent
        with pytest.raises(ConfigError, match="divisible"):  # raised before any collective
            helix_attention(plan_shard((1,), (1,), [mine.page_table(0)], layout, rank),
                            torch.zeros(1, 4 * world + 1, D), cache, SCALE, LATENT)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_helix_attention_equals_single_rank(world, tmp_path):
    ctx = mp.start_processes(_worker, args=(world, str(tmp_path / "store")), nprocs=world, join=False,
                             start_method="spawn")
    deadline = DIST_TIMEOUT_S + 30
    start = time.monotonic()
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() - start > deadline:
                pytest.fail(f"{world} gloo ranks did not finish within {deadline} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()


@pytest.mark.parametrize("ranks,args", [(2, []), (4, ["--attention-tp", "2"])])
def test_example_helix_cpu_runs(ranks, args):
    """examples/helix_cpu.py under torchrun: the engine with cp = 2 (on 2 processes, and on 4 with
    attention TP 2) is token-equal to cp = 1, exit 0."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
         str(root / "examples" / "helix_cpu.py"), *args],
        capture_output=True, text=True, timeout=DIST_TIMEOUT_S + 30, env=env, cwd=root,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cp=2 vs cp=1: token-equal" in done.stdout and "sharded=True" in done.stdout, done.stdout
    assert f"attention_tp={ranks // 2}" in done.stdout, done.stdout


@settings(max_examples=60, deadline=None)
@given(tp=st.integers(1, 4), cp=st.integers(1, 4), per=st.integers(1, 6))
def test_attention_tp_heads_partition_the_heads(tp, cp, per):
    """With attention tensor parallelism, the head groups partition the heads, and the slices the
    exchange leaves the ``tp * cp`` processes partition them too, each inside its process's group."""
    from specdec.parallel import HelixShard

    H = tp * cp * per
    layout = HelixLayout(cp, 16)
    shards = [HelixShard(layout, r % cp, None, tp, r // cp) for r in range(tp * cp)]
    groups = sorted({(s.tp_heads(H).start, s.tp_heads(H).stop) for s in shards})
    assert groups == [(t * H // tp, (t + 1) * H // tp) for t in range(tp)]
    owned = sorted(h for s in shards for h in range(H)[s.exchanged_heads(H)])
    assert owned == list(range(H))
    for s in shards:
        ex, grp = s.exchanged_heads(H), s.tp_heads(H)
        assert grp.start <= ex.start < ex.stop <= grp.stop and ex.stop - ex.start == per
    for bad in ((tp, tp), (True, 0), (tp, 0.5), (0, 0)):
        with pytest.raises(ConfigError, match="tp must be an integer >= 1 and tp_rank in"):
            HelixShard(layout, 0, None, *bad)
