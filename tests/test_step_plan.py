"""The step plan and the scheduler's ownership of KV.

- :meth:`Scheduler.pack` against a plain reference packing, over random mixes of prompts,
  cached lengths, budgets, drafts and sampling modes;
- any sequence of ``add_request`` / ``step`` / ``abort`` (with a pool small enough to
  preempt) leaves no page leaked, keeps every running request's pages equal to its cached
  tokens between steps, and gives every finished greedy request its solo output.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec import EngineConfig, SamplingParams, SpecEngine
from specdec.drafters import Draft, SuffixAutomatonDrafter
from specdec.errors import PoolExhaustedError
from specdec.kvcache import KVCacheManager
from specdec.sampling import request_key
from specdec.scheduler import Scheduler
from specdec.sequence import Sequence, Status


def reference_packing(requests, drafts, manager):
    """What a step feeds, written the plain way: per request its uncached tokens then its draft,
    at consecutive positions from its cached length; slot = page * tokens_per_block + offset of
    the request's page table; verified rows: the last uncached token and each draft token."""
    tpb = manager.tokens_per_block
    ids, positions, slots, rows, fed, token_starts, row_starts = [], [], [], [], [], [], []
    for seq, d in zip(requests, drafts):
        table = manager.page_table(seq.req_id)
        feed = list(seq.tokens[seq.num_cached:]) + list(d.token_ids)
        token_starts.append(len(ids))
        row_starts.append(len(rows))
        fed.append(len(feed))
        for j, tok in enumerate(feed):
            p = seq.num_cached + j
            ids.append(tok)
            positions.append(p)
            slots.append(table[p // tpb] * tpb + p % tpb)
        last = len(ids) - 1 - len(d)  # the row of the last uncached token
        rows += range(last, last + len(d) + 1)
    return ids, positions, slots, rows, fed, token_starts, row_starts


request_st = st.tuples(
    st.integers(1, 20),  # prompt length
    st.integers(0, 12),  # tokens generated before this step (0: the request is admitted now)
    st.integers(0, 5),  # draft budget
    st.booleans(),  # sampled
    st.integers(0, 5),  # draft length wanted (cut to the budget the scheduler grants)
)


@settings(max_examples=150, deadline=None)
@given(reqs=st.lists(request_st, min_size=1, max_size=6), tpb=st.sampled_from([1, 4, 16]),
       num_pages=st.integers(8, 80), seed=st.integers(0, 2**16))
def test_pack_equals_the_reference_packing(reqs, tpb, num_pages, seed):
    manager = KVCacheManager(num_pages, tpb)
    sched = Scheduler(manager, max_num_seqs=8)
    budgets = {}
    seqs = []
    for i, (plen, generated, budget, sampled, _) in enumerate(reqs):
        params = SamplingParams(temperature=1.0, seed=i) if sampled else SamplingParams()
        seq = Sequence(f"r{i}", [(7 * i + j) % 50 for j in range(plen)], params, seed=seed + i)
        seqs.append(seq)
        budgets[seq.req_id] = budget
        sched.add(seq)
    first = sched.schedule(lambda s: budgets[s.req_id])  # admits what fits, as prompts
    sched.pack(first, [])
    assert first.generation == []
    # requests that were admitted generate some tokens, then verify a draft each
    for seq, (_, generated, *_rest) in zip(seqs, reqs):
        if seq.status is Status.RUNNING:
            try:  # as if it had generated more tokens since (where the pool has room)
                manager.append(seq.req_id, generated)
            except PoolExhaustedError:
                generated = 0
            seq.tokens += [(3 * k + 1) % 50 for k in range(generated + 1)]  # the prompt step's token and more
            sched.commit(seq)
            assert manager.length(seq.req_id) == seq.num_cached == len(seq.tokens) - 1
    plan = sched.schedule(lambda s: budgets[s.req_id])
    drafts = [Draft(tuple((5 * k + 2) % 50 for k in range(min(reqs[int(s.req_id[1:])][4], b))))
              for s, b in zip(plan.generation, plan.budgets)]
    sched.pack(plan, drafts)

    want = reference_packing(plan.requests, plan.drafts, manager)
    step = plan.inputs
    assert (step.input_ids, step.positions, step.slots, step.rows) == want[:4]
    assert (plan.fed, plan.token_starts, plan.row_starts) == want[4:]
    assert len(plan.drafts) == len(plan.requests) and all(len(d) == 0 for d in plan.drafts[:len(plan.context)])
    for seq, d in zip(plan.requests, plan.drafts):  # exactly the fed tokens are reserved now
        assert manager.length(seq.req_id) == len(seq.tokens) + len(d)
    phases = [(n, seq.num_cached + n, tuple(manager.page_table(seq.req_id))) for seq, n in zip(plan.requests, plan.fed)]
    assert step.context + step.generation == phases and len(step.context) == len(plan.context)
    sampled = [(i, s) for i, s in enumerate(plan.requests) if not s.params.greedy]
    if not sampled:
        assert step.sampling is None
    else:  # one sampled row per verified row of each sampled request, keyed by its seed, at its positions
        rows, keys, positions = [], [], []
        for i, s in sampled:
            n = len(plan.drafts[i]) + 1
            rows += range(plan.row_starts[i], plan.row_starts[i] + n)
            keys += [request_key(s.seed)] * n
            positions += range(len(s.tokens), len(s.tokens) + n)
        assert (step.sampling.rows, step.sampling.keys, step.sampling.positions) == (rows, keys, positions)


def test_pack_refuses_a_draft_beyond_its_reservation():
    manager = KVCacheManager(16, 4)
    sched = Scheduler(manager, 4)
    seq = Sequence("a", [1, 2, 3], SamplingParams())
    sched.add(seq)
    sched.pack(sched.schedule(lambda s: 2), [])
    seq.tokens.append(9)
    sched.commit(seq)
    plan = sched.schedule(lambda s: 2)
    with pytest.raises(ValueError, match="3 tokens, 2 reserved"):
        sched.pack(plan, [Draft((1, 2, 3))])
    with pytest.raises(ValueError, match="one draft per generation request"):
        sched.pack(plan, [])


# -- engine: any sequence of add_request / step / abort ---------------------------------------------

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18], [5], [40, 41, 40, 41, 40, 41],
           [3, 3, 3, 3], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]]

op_st = st.one_of(
    st.tuples(st.just("add"), st.integers(0, len(PROMPTS) - 1), st.integers(1, 24)),
    st.tuples(st.just("step"), st.integers(1, 4), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 11), st.just(0)),
)


_SOLO: dict[tuple, tuple[int, ...]] = {}


def _solo(target, prompt: int, max_new: int) -> tuple[int, ...]:
    """The request alone on a plain engine with the null drafter."""
    key = (id(target), prompt, max_new)
    if key not in _SOLO:
        _SOLO[key] = SpecEngine(target).generate([PROMPTS[prompt]], max_new_tokens=max_new)[0].token_ids
    return _SOLO[key]


@pytest.mark.parametrize("variant", ["null", "suffix", "null-overlap"])
def test_any_sequence_of_calls_leaks_nothing_and_keeps_greedy_outputs(tiny, variant):
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(ops=st.lists(op_st, min_size=1, max_size=14), num_pages=st.integers(4, 12), max_num_seqs=st.integers(1, 4))
    def run(ops, num_pages, max_num_seqs):
        drafter = SuffixAutomatonDrafter() if variant == "suffix" else None
        engine = SpecEngine(tiny, drafter, EngineConfig(tokens_per_block=4, num_pages=num_pages,
                                                        max_num_seqs=max_num_seqs, max_draft_tokens=4,
                                                        overlap_steps=variant == "null-overlap"))
        added, aborted = [], set()

        def check_kv():
            """Between steps: running requests hold their cached tokens' pages (plus the slot of a
            step launched ahead), waiting ones none; no page is both free and held."""
            ahead = engine.executor.ahead_ids()
            held = 0
            for seq in engine.scheduler.running:
                assert engine.manager.length(seq.req_id) == seq.num_cached + (seq.req_id in ahead)
                held += len(engine.manager.page_table(seq.req_id))
            for seq in engine.scheduler.waiting:
                assert seq.req_id not in engine.manager and seq.num_cached == 0
            assert held + engine.manager.num_free_pages == engine.manager.num_pages

        for op, a, b in ops:
            if op == "add":
                added.append((engine.add_request(PROMPTS[a], SamplingParams(max_new_tokens=b)), a, b))
            elif op == "step":
                for _ in range(a):
                    engine.step()
                    check_kv()
            elif added:
                req = added[a % len(added)][0]
                if engine.output(req).finish_reason is None:
                    aborted.add(req)
                engine.abort(req)
                check_kv()
        while engine.has_unfinished():
            engine.step()
            check_kv()
        assert engine.manager.num_free_pages == engine.manager.num_pages  # nothing leaked
        assert not engine.executor.in_flight
        for req, prompt, max_new in added:
            out = engine.output(req)
            if req in aborted:
                assert out.finish_reason == "abort"
                assert out.token_ids == _solo(tiny, prompt, max_new)[:len(out.token_ids)]
            elif out.finish_reason != "kv_capacity":  # a request the whole pool cannot hold ends early
                assert out.token_ids == _solo(tiny, prompt, max_new), (req, out.finish_reason)

    run()
