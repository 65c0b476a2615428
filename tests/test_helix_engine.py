"""The engine under Helix context parallelism (docs/design.md §7) on real gloo process groups.

A random-weight MLA target at real attention dimensions (48 and 96 heads, kv_lora_rank 512,
rope 64; few layers and a narrow hidden size so CPU runs stay short) generates with
``helix_cp = 2`` (and 4) under spawned CPU processes, with MLA DSpark (which reads the
sharded context) and the suffix drafter, at batch 1 and 4: fp32 greedy outputs are
token-equal to the cp = 1 engine. After every step each rank holds exactly its share of
every request (rollback of rejected drafts released exactly its pages past that share);
a rank's pool holds the positions it owns and nothing else; a drafter that does not read
sharded pages gets its own unsharded pool, and ``kv_layout`` says why.
"""

from __future__ import annotations

import dataclasses
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import SamplingParams, SpecEngine
from specdec.drafters import MLABlockDrafterConfig, MLABlockDrafterNet, MLADSparkDrafter, SuffixAutomatonDrafter
from specdec.drafters.block import init_weights
from specdec.errors import ConfigError, HelixConfigError
from specdec.kvcache import pages_for
from specdec.parallel import HelixPageManager
from specdec.target.mla import MLATarget, random_weights

TPB, NEW, DRAFT = 16, 20, 4
DIST_TIMEOUT_S = 90
# 8 prompts: short (one page, ranks > 0 hold none of it at first), page-straddling, and repetitive
# ones the suffix drafter continues correctly (accepted drafts) or wrongly (rejected: rollback).
PROMPTS = [[5, 6, 7, 8] * 6, [9], list(range(100, 117)), [3, 1, 4, 1, 5, 9, 2, 6] * 5, [42] * 33,
           list(range(300, 340)), [11, 12, 13] * 4, [77, 78]]


def make_target(heads: int, bias: bool = False, q_lora: bool = True) -> MLATarget:
    """``bias``: with attention biases (o_proj's among them), through HF-named weights; ``q_lora``:
    queries through a low-rank ``q_a``/``q_b`` pair (else straight from the fused ``w_a``)."""
    t = MLATarget.random(num_heads=heads, num_layers=2, hidden_size=256, vocab_size=512, intermediate_size=512,
                         q_lora_rank=128 if q_lora else None, kv_lora_rank=512, qk_rope_head_dim=64,
                         max_position_embeddings=512, seed=0)
    if not bias:
        return t
    cfg = dataclasses.replace(t.config, attention_bias=True)
    return MLATarget(cfg, random_weights(cfg, seed=0), name="mla-random-bias")


def make_drafter(kind: str):
    if kind == "suffix":
        return SuffixAutomatonDrafter()
    cfg = MLABlockDrafterConfig(block_size=DRAFT, target_layer_ids=(0, 1), target_hidden_size=256, vocab_size=512,
                                hidden_size=256, num_layers=1, num_heads=4, kv_lora_rank=512, qk_rope_head_dim=64,
                                qk_nope_head_dim=32, v_head_dim=32, intermediate_size=256)
    d = MLADSparkDrafter(init_weights(MLABlockDrafterNet(cfg), seed=1))
    if kind == "dspark_unsharded":  # the same network, declared unable to read sharded pages
        d.reads_helix_sharded_ctx_pages = False
    return d


def engine(target, drafter, cp: int, batch: int, tp: int = 1) -> SpecEngine:
    return SpecEngine(target, drafter, helix_cp=cp, attention_tp=tp, max_num_seqs=batch, num_pages=48,
                      tokens_per_block=TPB, max_draft_tokens=DRAFT, cuda_graphs=False)


def check_shares(e: SpecEngine) -> None:
    """Each running request holds exactly this rank's share of its global length, and the rank's
    free pages are exactly the ones no request holds (nothing leaked by rollback)."""
    m = e.manager
    assert isinstance(m, HelixPageManager)
    held = 0
    for seq in e.scheduler.running:
        n = m.length(seq.req_id)
        assert m.local_length(seq.req_id) == m.layout.local_length(n, m.shard.rank)
        assert len(m.page_table(seq.req_id)) == pages_for(m.local_length(seq.req_id), TPB)
        held += len(m.page_table(seq.req_id))
    assert held + m.helix.num_free_pages == m.local_pages


def reference(heads: int, bias: bool = False, q_lora: bool = True) -> list[tuple[int, ...]]:
    """The cp = 1 engine (plain decoding: the baseline every drafter must reproduce)."""
    with engine(make_target(heads, bias, q_lora), None, 1, 4) as e:
        return [o.token_ids for o in e.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True)]


def _spawn(fn, world: int, *args) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(fn, args=(world, f"{tmp}/store", *args), nprocs=world, join=False,
                                 start_method="spawn")
        start = time.monotonic()
        try:
            while not ctx.join(timeout=2):
                if time.monotonic() - start > DIST_TIMEOUT_S + 30:
                    pytest.fail(f"{world} gloo ranks did not finish within {DIST_TIMEOUT_S + 30} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()


def _init(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=DIST_TIMEOUT_S))


# -- token equality with cp = 1 -------------------------------------------------------------------
def _equal_worker(rank: int, world: int, store: str, heads: int, runs, want, tp: int = 1,
                  q_lora: bool = True) -> None:
    _init(rank, world, store)
    cp = world // tp
    try:
        target = make_target(heads, q_lora=q_lora)
        for kind, batch in runs:
            with engine(target, make_drafter(kind), cp, batch, tp) as e:
                layout = e.kv_layout
                ids = [e.add_request(p, SamplingParams(max_new_tokens=NEW, ignore_eos=True)) for p in PROMPTS]
                steps = 0
                while e.has_unfinished():
                    e.step()
                    steps += 1
                    check_shares(e)
                outs = [e.release(i) for i in ids]
                backends = e.graph_stats["backends"]
                assert e.draft_gate is None  # a block drafter's default gate stays off across ranks
            got = [o.token_ids for o in outs]
            drafted, accepted = sum(o.stats.drafted for o in outs), sum(o.stats.accepted for o in outs)
            what = f"rank {rank}, cp={cp}, tp={tp}, H={heads}, drafter {kind}, batch {batch}"
            assert got == want, f"{what}: outputs differ from cp = 1"
            assert set(backends) <= {"context:helix_ref", "generation:helix_ref"}, (what, backends)
            assert layout["helix_cp"] == cp and layout["attention_tp"] == tp and layout["pools"][0]["sharded"]
            if kind == "dspark":  # reads sharded pages: its K-only latent layers join the sharded target pool
                assert layout["shared"] and len(layout["pools"]) == 1 and layout["pools"][0]["draft_layers"]
                assert "sharded across the" in layout["reason"], layout
            elif kind == "dspark_unsharded":  # its own pool, holding the whole context on every rank
                assert not layout["shared"] and [p["sharded"] for p in layout["pools"]] == [True, False]
                assert "does not read sharded pages" in layout["reason"], layout
            assert drafted > accepted, f"{what}: no draft was rejected (nothing rolled back)"
            if kind == "suffix":
                assert accepted > 0 and steps < len(PROMPTS) * NEW, f"{what}: no draft was accepted"
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("heads", [48, 96])
def test_helix_engine_equals_cp1(heads):
    """cp = 2 with MLA DSpark (sharded context) and the suffix drafter, batch 1 and 4, token-equal to cp = 1."""
    want = reference(heads)
    # With the four-rank test: each drafter at batch 1 and 4, each head count with both drafters.
    runs = [("dspark", 1), ("suffix", 4)] if heads == 96 else [("suffix", 1), ("dspark", 4), ("dspark_unsharded", 4)]
    _spawn(_equal_worker, 2, heads, runs, want)


def test_helix_engine_four_ranks_equals_cp1():
    """cp = 4 (48 heads: 12 per rank after the exchange), MLA DSpark and the suffix drafter, batch 4."""
    _spawn(_equal_worker, 4, 48, [("dspark", 4), ("suffix", 4)], reference(48))


def test_helix_with_attention_tp_equals_cp1():
    """Attention tensor parallelism 2 x context parallelism 2 on four processes (96 heads: 48 a head
    group, 24 a process after the exchange; the latent cache's shards duplicated across the head
    groups): MLA DSpark (sharded context) at batch 1 and the suffix drafter at batch 4, token-equal to
    cp = 1."""
    _spawn(_equal_worker, 4, 96, [("dspark", 1), ("suffix", 4)], reference(96), 2)


def test_helix_with_attention_tp_equals_cp1_without_q_lora():
    """The same with queries straight from the fused ``w_a`` (no ``q_lora_rank``): each head group
    projects only its rows of it."""
    _spawn(_equal_worker, 4, 48, [("suffix", 4)], reference(48, q_lora=False), 2, False)


# -- rank-owned writes ----------------------------------------------------------------------------
def _writes_worker(rank: int, world: int, store: str) -> None:
    _init(rank, world, store)
    try:
        target, prompt = make_target(48), list(range(200, 237))  # 37 tokens: pages 0, 1 (rank 0, 1), 2 (rank 0)
        with engine(target, None, world, 1) as e, engine(target, None, 1, 1) as full, \
                engine(target, make_drafter("dspark"), world, 1) as d:
            for eng in (e, full, d):
                eng.add_request(prompt, req_id="r")
                for _ in range(3):
                    eng.step()
            m, n = e.manager, e.manager.length("r")
            owned = [p for p in range(n) if m.layout.owner(p)[0] == rank]
            local = m.slots("r", 0, n)
            assert [s for s in local if s >= 0] == [m.helix.slot("r", p) for p in owned]
            assert all((s >= 0) == (p in owned) for p, s in enumerate(local))
            ref_slots = full.manager.slots("r", 0, n)
            for layer in range(target.num_layers):
                k = e.pool.k[layer][:, 0]  # [local slots, 576]
                want = torch.zeros(k.shape[0], dtype=torch.bool)
                want[[m.helix.slot("r", p) for p in owned]] = True
                assert torch.equal(k.abs().sum(-1) != 0, want), f"rank {rank}, layer {layer}: a slot it does not own"
            # The prompt step is the same at cp = 1: layer 0's owned rows are the cp = 1 cache's rows.
            rows = [p for p in owned if p < len(prompt)]
            torch.testing.assert_close(e.pool.k[0][[m.helix.slot("r", p) for p in rows], 0],
                                       full.pool.k[0][[ref_slots[p] for p in rows], 0], rtol=0, atol=0)
            # MLA DSpark's latent layer in the same sharded pool: the owned accepted positions only.
            m, ctx = d.manager, d.drafter._ctx_len["r"]
            k = d.pool.k[d.pool.layer_ids("draft")[0]][:, 0]
            want = torch.zeros(k.shape[0], dtype=torch.bool)
            want[[m.helix.slot("r", p) for p in range(ctx) if m.layout.owner(p)[0] == rank]] = True
            assert ctx >= len(prompt) and torch.equal(k.abs().sum(-1) != 0, want)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_helix_rank_writes_only_owned_positions():
    """Reference 004 (rank-owned page writes): target and drafter layers hold exactly the owned positions."""
    _spawn(_writes_worker, 2)


# -- head-parallel output projection -------------------------------------------------------------
def _head_parallel_worker(rank: int, world: int, store: str, want) -> None:
    import specdec.attention.backends.helix_ref as helix_ref

    def no_gather(*args, **kwargs):
        raise AssertionError("the heads were gathered: the output projection is not head-parallel")

    helix_ref.gather_heads = no_gather  # the target's layers must project their own heads and all-reduce
    try:
        import specdec.attention.backends.triton_mla as triton_mla

        triton_mla.gather_heads = no_gather  # whichever Helix backend the selector takes
    except ImportError:
        pass
    _init(rank, world, store)
    try:
        with engine(make_target(48, bias=True), SuffixAutomatonDrafter(), world, 4) as e:
            outs = e.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True)
            assert [o.token_ids for o in outs] == want
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_helix_output_projection_is_head_parallel():
    """Each rank projects only the heads the exchange left it (its columns of o_proj) and one all-reduce of
    ``[T, hidden]`` sums the parts (o_proj's bias added once, after it): no all-gather of
    ``[T, H, kv_lora_rank]``; tokens equal to cp = 1."""
    _spawn(_head_parallel_worker, 2, reference(48, bias=True))


# -- configuration errors -------------------------------------------------------------------------
def test_helix_config_errors(tiny, tmp_path):
    with pytest.raises(ConfigError, match="helix_cp must be an integer >= 1"):
        SpecEngine(tiny, helix_cp=0)
    with pytest.raises(HelixConfigError, match="needs an MLA target"):
        SpecEngine(tiny, helix_cp=2)
    mla = MLATarget.random(num_heads=6, num_layers=1, hidden_size=64, vocab_size=64, kv_lora_rank=32, q_lora_rank=None,
                           qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)
    with pytest.raises(HelixConfigError, match=r"\(4\) must divide the target's attention heads \(6\)"):
        SpecEngine(mla, helix_cp=4)
    with pytest.raises(HelixConfigError, match=r"\(12\) must divide the target's attention heads \(6\)"):
        SpecEngine(mla, helix_cp=3, attention_tp=4)
    with pytest.raises(ConfigError, match="attention_tp must be an integer >= 1"):
        SpecEngine(mla, attention_tp=0)
    with pytest.raises(HelixConfigError, match="attention_tp=2 .* needs helix_cp > 1"):
        SpecEngine(mla, attention_tp=2)
    with pytest.raises(HelixConfigError, match="torchrun --nproc-per-node 2"):
        SpecEngine(mla, helix_cp=2)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(HelixConfigError, match=r"equal the process group's size \(1\), got helix_cp=3"):
            SpecEngine(mla, helix_cp=3)
        with pytest.raises(HelixConfigError, match=r"size \(1\), got helix_cp=2 with attention_tp=3"):
            SpecEngine(mla, helix_cp=2, attention_tp=3)
    finally:
        dist.destroy_process_group()


# -- the rank's page manager ----------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(cp=st.integers(2, 4), tpb=st.sampled_from([1, 4, 16]), pages=st.integers(1, 12),
       ops=st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["grow", "truncate", "free", "resize"]),
                              st.integers(0, 40)), max_size=30))
def test_page_manager_ranks_decide_room_alike(cp, tpb, pages, ops):
    """Driven by the same calls, every rank's manager accepts or refuses together (no collective),
    holds exactly its share, and rolls back to exactly its share."""
    from specdec.errors import PoolExhaustedError
    from specdec.parallel import HelixLayout, HelixShard

    layout = HelixLayout(cp, tpb)
    ms = [HelixPageManager(HelixShard(layout, r), pages) for r in range(cp)]
    for req, op, n in ops:
        if op == "grow":
            verdicts = []
            for m in ms:
                try:
                    m.append(req, n) if req in m else m.allocate(req, n)
                    verdicts.append(True)
                except PoolExhaustedError:
                    verdicts.append(False)
            assert len(set(verdicts)) == 1, f"ranks disagree about room: {verdicts}"
        elif op == "truncate" and req in ms[0]:
            for m in ms:
                m.truncate(req, m.length(req) * n // 40)
        elif op == "free" and req in ms[0]:
            for m in ms:
                m.free(req)
        elif op == "resize" and req in ms[0]:  # grow or shrink in one call, to n tokens
            verdicts = []
            for m in ms:
                try:
                    m.resize(req, n)
                    verdicts.append(True)
                except PoolExhaustedError:
                    verdicts.append(False)
            assert len(set(verdicts)) == 1, f"ranks disagree about room: {verdicts}"
            assert all(m.page_tuple(req) == tuple(m.page_table(req)) for m in ms)
        for m in ms:
            held = 0
            for r in range(3):
                if r in m:
                    n_tok = m.length(r)
                    assert m.local_length(r) == layout.local_length(n_tok, m.shard.rank)
                    slots = m.slots(r, 0, n_tok)
                    assert [p for p, s in enumerate(slots) if s >= 0] == \
                        [p for p in range(n_tok) if layout.owner(p)[0] == m.shard.rank]
                    held += len(m.page_table(r))
            assert held + m.helix.num_free_pages == pages
        assert all(m.num_free_pages == ms[0].num_free_pages for m in ms) and ms[0].num_free_pages >= 0
