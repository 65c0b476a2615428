"""Block-drafter training: schedule, vectorised anchors and blocks against loop references, the
Markov and confidence heads, validation tau, checkpoints that resume, and the training data format."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import numpy as np
import pytest
import torch
from helpers import needs_cxx, tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import SamplingParams, SpecEngine
from specdec.drafters.block import (BlockDrafterConfig, BlockDrafterNet, block_mask, draft_from_hidden, grow_layers,
                                    init_weights,
                                    label_offsets, slot_logits)
from specdec.drafters.data import TokenData, code_prompts, keep_message
from specdec.drafters.dflash import DFlashDrafter, DSparkDrafter
from specdec.drafters.training import (TrainConfig, anchor_block_mask, anchors_from_uniform, block_hidden, block_labels,
                                       accepted_runs, block_loss, distill_tokens, greedy_block_labels, lr_factor,
                                       new_net, simulated_tau,
                                       target_features, walk_accepted_lengths,
                                       TrainJob, train_block_drafter, train_block_drafters)
from specdec.errors import CheckpointError, ConfigError

VOCAB, HIDDEN = 64, 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random 3-layer Llama with a LM head of usable logit scale."""
    return tiny_llama(tmp_path_factory.mktemp("tiny_target"), "cpu", num_hidden_layers=3,
                      max_position_embeddings=160, initializer_range=0.3)


def cfg(shift: int, **kw) -> BlockDrafterConfig:
    base = dict(block_size=4, shift_label=shift, target_layer_ids=(0, 2), target_hidden_size=HIDDEN, vocab_size=VOCAB,
                hidden_size=HIDDEN, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64)
    return BlockDrafterConfig(**{**base, **kw})


def dspark_cfg(**kw) -> BlockDrafterConfig:
    return cfg(1, markov_rank=8, confidence_head=True, **kw)


def toy_data(n=24, seed=0, lo=24, hi=48) -> TokenData:
    """Periodic sequences (learnable from context): prompt = one period and a token."""
    rng = random.Random(seed)
    seqs, plens = [], []
    for _ in range(n):
        period = rng.randint(2, 5)
        base = [rng.randrange(1, VOCAB - 1) for _ in range(period)]
        seqs.append((base * hi)[: rng.randint(lo, hi)])
        plens.append(period + 1)
    return TokenData.from_lists(seqs, plens, [0] * n, [0.0] * n)


def toy_prompts() -> list[list[int]]:
    d = toy_data(12, seed=0)
    return [d.sequence(i)[: d.prompt_lens[i] + 3].tolist() for i in range(12)]


# -- schedule ---------------------------------------------------------------------------------------
@given(planned=st.integers(2, 3000), warm=st.floats(0, 0.5), floor=st.floats(0, 1))
@settings(max_examples=60, deadline=None)
def test_schedule_warms_up_then_decays_to_the_floor(planned, warm, floor):
    f = [lr_factor(s, planned, warm, floor) for s in range(planned)]
    w = math.ceil(warm * planned)
    assert all(0 <= x <= 1 + 1e-12 for x in f) and all(x > 0 for x in f[:w])
    assert all(f[i] < f[i + 1] for i in range(min(w, planned) - 1))  # linear warm-up
    if w < planned:
        assert f[w] == pytest.approx(1.0)
        tail = f[w:]
        assert all(a >= b - 1e-12 for a, b in zip(tail, tail[1:]))  # cosine: never rises
        if planned - w > 1:
            assert f[-1] == pytest.approx(floor)


def test_time_budget_fixes_the_planned_steps_before_the_schedule(tiny):
    data = toy_data(8)
    net = new_net(cfg(0), tiny)
    _, rec = train_block_drafter(tiny, data, net, TrainConfig(steps=10_000, seqs_per_step=2, anchors_per_seq=4,
                                                              max_seconds=3.0, val_every=0), progress=False)
    planned = rec["planned_steps"]
    assert 1 <= planned < 10_000 and rec["steps_run"] == planned
    assert rec["lr"] == pytest.approx([6e-4 * lr_factor(s, planned, 0.04, 0.1) for s in range(planned)])


def test_a_resumed_run_continues_the_same_curve(tiny, tmp_path):
    data, val = toy_data(12), toy_data(3, seed=9)
    tc = TrainConfig(steps=12, seqs_per_step=2, anchors_per_seq=4, val_every=6)
    _, whole = train_block_drafter(tiny, data, new_net(cfg(0), tiny), tc, val=val, progress=False)

    class Stop(Exception):
        pass

    first = tmp_path / "first"
    calls = []

    def stop_after_first_validation(msg: str) -> None:  # step 0's tau is logged first, then step 6's
        calls.append(msg)
        if "step 6/" in msg:
            raise Stop

    with pytest.raises(Stop):  # a run killed right after its first checkpoint
        train_block_drafter(tiny, data, new_net(cfg(0), tiny), tc, val=val, out=first, progress=False,
                            log=stop_after_first_validation)
    state = json.loads((first / "train_state.json").read_text())
    assert state["step"] == 6 and state["planned"] == 12
    _, resumed = train_block_drafter(tiny, data, BlockDrafterNet.load(first), tc, val=val, out=tmp_path / "second",
                                     resume=first, progress=False)
    assert resumed["steps_run"] == 12 and len(resumed["lr"]) == 12
    assert resumed["lr"] == pytest.approx(whole["lr"])
    assert [v["step"] for v in resumed["val"]] == [0, 6, 12]
    with pytest.raises(CheckpointError, match="resume"):
        train_block_drafter(tiny, data, new_net(cfg(0), tiny), tc, resume=tmp_path / "nothing", progress=False)
    with pytest.raises(ConfigError, match="max_len=1024; resuming it at max_len=512"):  # another cut, another plan
        train_block_drafter(tiny, data, BlockDrafterNet.load(first), dataclasses.replace(tc, max_len=512), val=val,
                            out=tmp_path / "third", resume=first, progress=False)
    with pytest.raises(ConfigError, match="greedy_labels=False; resuming it with greedy_labels=True"):  # another loss
        train_block_drafter(tiny, data, BlockDrafterNet.load(first), dataclasses.replace(tc, greedy_labels=True),
                            val=val, out=tmp_path / "fourth", resume=first, progress=False)


def test_a_new_plan_keeps_its_starting_weights_unless_a_step_beats_them(tiny):
    """More training from trained weights (``--init``) re-warms the learning rate, which can cost
    tau for a while: the starting weights' tau (validated at step 0) is the bar, and a run that never
    beats it returns them unchanged."""
    train = distill_tokens(tiny, toy_prompts()[:9], max_new_tokens=24)
    tc = TrainConfig(steps=40, seqs_per_step=4, anchors_per_seq=8, lr=1e-2, val_every=0)
    start, _ = train_block_drafter(tiny, train, new_net(cfg(0), tiny), tc, progress=False)
    before = {k: t.clone() for k, t in start.state_dict().items()}
    tau0 = simulated_tau(start, tiny, train, TrainConfig())["tau"]
    wrecked, rec = train_block_drafter(tiny, train, start, dataclasses.replace(tc, steps=3, lr=1.0, val_every=1),
                                       val=train, progress=False)
    assert [v["step"] for v in rec["val"]] == [0, 1, 2, 3]
    assert rec["val"][0]["tau"] == pytest.approx(tau0) and tau0 > 1.1, rec["val"]
    assert max(v["tau"] for v in rec["val"][1:]) < tau0, rec["val"]  # lr 1.0 wrecks the network: no step beats step 0
    assert rec["best"]["step"] == 0
    assert all(torch.equal(wrecked.state_dict()[k], before[k]) for k in before)


def test_validation_reports_tau_per_source_and_plots_it(tiny, tmp_path):
    from specdec.drafters.training import plot_training

    train = distill_tokens(tiny, toy_prompts()[:9], max_new_tokens=24)
    val = TokenData.from_lists([train.sequence(i).tolist() for i in range(9)], train.prompt_lens.tolist(),
                               [0, 1, 4] * 3, [0.0] * 9)
    net, _ = train_block_drafter(tiny, train, new_net(cfg(0), tiny), TrainConfig(steps=40, seqs_per_step=4,
                                 anchors_per_seq=8, lr=1e-2, val_every=0), progress=False)
    out = simulated_tau(net, tiny, val, TrainConfig(val_anchors=5))
    by, n = out["tau_by_source"], out["anchors_by_source"]
    assert set(by) == set(n) == {"magpie", "code", "math"} and sum(n.values()) == out["anchors"]
    assert sum(by[k] * n[k] for k in by) / out["anchors"] == pytest.approx(out["tau"])
    assert len({round(v, 6) for v in by.values()}) > 1  # the sources differ: their means are their own
    record = {"losses": [1.0, 0.9], "lr": [1e-3, 1e-3], "val": [{"step": 1, **out}, {"step": 2, **out}]}
    assert plot_training(record, tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_a_fresh_network_depends_on_its_seed_only(tiny):
    torch.manual_seed(1)
    a = new_net(dspark_cfg(), tiny, seed=3).state_dict()
    torch.manual_seed(2)
    b = new_net(dspark_cfg(), tiny, seed=3).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["fc.weight"], new_net(dspark_cfg(), tiny, seed=4).state_dict()["fc.weight"])


def test_drafters_trained_side_by_side_equal_each_trained_alone(tiny, tmp_path):
    """One target forward a step feeds both kinds; each network ends as it would alone (weights,
    losses, validation), and a joint run cut after its first checkpoint resumes on the same curve."""
    data, val = toy_data(12), toy_data(3, seed=9)
    base = dict(steps=6, seqs_per_step=2, val_every=3)
    tcs = {"dflash": TrainConfig(anchors_per_seq=4, lr=1e-3, **base),
           "dspark": TrainConfig(anchors_per_seq=6, lr=2e-3, tv_weight=0.5, confidence_weight=0.2, **base)}
    cfgs = {"dflash": cfg(0), "dspark": dspark_cfg()}
    alone = [train_block_drafter(tiny, data, new_net(cfgs[k], tiny, seed=1), tcs[k], val=val, progress=False)
             for k in tcs]
    jobs = lambda out, resume=None: [TrainJob(new_net(cfgs[k], tiny, seed=1), tcs[k], out / k,  # noqa: E731
                                              None if resume is None else resume / k, name=k) for k in tcs]
    both = train_block_drafters(tiny, data, jobs(tmp_path / "both"), val=val, progress=False)
    for (net, rec), (net2, rec2) in zip(alone, both):
        sd, sd2 = net.state_dict(), net2.state_dict()
        assert sd.keys() == sd2.keys() and all(torch.equal(sd[n], sd2[n]) for n in sd)
        assert rec2["losses"] == rec["losses"] and rec2["lr"] == rec["lr"] and rec2["val"] == rec["val"]
        assert rec2["networks_per_batch"] == 2 and rec["networks_per_batch"] == 1
    assert (tmp_path / "both" / "dspark" / "training.png").exists()

    class Stop(Exception):
        pass

    def stop_at_the_fourth_log(msg: str, seen=[]) -> None:  # both networks validated at steps 0 and 3
        seen.append(msg)
        if len(seen) == 4:
            raise Stop

    with pytest.raises(Stop):
        train_block_drafters(tiny, data, jobs(tmp_path / "cut"), val=val, progress=False, log=stop_at_the_fourth_log)
    resumed = train_block_drafters(tiny, data, jobs(tmp_path / "more", resume=tmp_path / "cut"), val=val,
                                   progress=False)
    for (_, rec), (_, rec2) in zip(both, resumed):
        assert rec2["lr"] == rec["lr"] and [v["step"] for v in rec2["val"]] == [0, 3, 6]

    # validated every step: wherever a run is cut (before a round's logs), both states name one step
    seen_steps = []

    def look(msg: str, calls=[]) -> None:
        calls.append(msg)
        if len(calls) % 2 == 1 and len(calls) > 3:  # the first log of a round after step 1's: the last round's
                                                     # states are written (step 0 writes none)
            seen_steps.append({k: json.loads((tmp_path / "each" / k / "train_state.json").read_text())["step"]
                               for k in tcs})

    lrs = {"dflash": 1e-7, "dspark": 0.1}  # DFlash hardly moves, DSpark learns: they improve at other steps
    every = [TrainJob(new_net(cfgs[k], tiny, seed=1), dataclasses.replace(tcs[k], val_every=1, lr=lrs[k]),
                      tmp_path / "each" / k, name=k) for k in tcs]
    recs = [rec for _, rec in train_block_drafters(tiny, data, every, val=val, progress=False, log=look)]
    assert len(seen_steps) == 5 and all(st["dflash"] == st["dspark"] for st in seen_steps)
    best_steps = [[v["step"] for i, v in enumerate(rec["val"]) if v["tau"] > max([-1] + [w["tau"] for w in
                                                                                     rec["val"][:i]])] for rec in recs]
    assert best_steps[0] != best_steps[1]  # the networks improved at different steps: the case this covers
    with pytest.raises(ConfigError, match="seqs_per_step"):
        train_block_drafters(tiny, data, [TrainJob(new_net(cfg(0), tiny), tcs["dflash"]),
                                          TrainJob(new_net(cfg(0), tiny), TrainConfig(steps=6, seqs_per_step=3,
                                                                                        val_every=3))])
    with pytest.raises(ConfigError, match="target layers"):
        train_block_drafters(tiny, data, [TrainJob(new_net(cfg(0), tiny), tcs["dflash"]),
                                          TrainJob(new_net(cfg(0, target_layer_ids=(1, 2)), tiny), tcs["dflash"])])
    with pytest.raises(ConfigError, match="or none"):
        train_block_drafters(tiny, data, [TrainJob(new_net(cfg(0), tiny), tcs["dflash"], resume=tmp_path / "cut" / "dflash"),
                                          TrainJob(new_net(dspark_cfg(), tiny), tcs["dspark"])])
    with pytest.raises(ConfigError, match="at least one"):
        train_block_drafters(tiny, data, [])


# -- vectorised pieces against loop references ---------------------------------------------------------
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(-5, 60)), min_size=1, max_size=6),
       st.integers(1, 8), st.integers(0, 2 ** 31 - 1))
@settings(max_examples=80, deadline=None)
def test_vectorised_anchors_equal_a_loop(ranges, A, seed):
    lo = torch.tensor([r[0] for r in ranges])
    hi = torch.tensor([r[1] for r in ranges])
    u = torch.rand(len(ranges), A, generator=torch.Generator().manual_seed(seed))
    got = anchors_from_uniform(lo, hi, u)
    for s, (a, b) in enumerate(ranges):
        for j in range(A):
            want = a + min(int(u[s, j].item() * (b - a + 1)), b - a) if b >= a else -1
            assert got[s, j].item() == want
            if b >= a:
                assert a <= want <= b


@given(st.integers(1, 4), st.integers(2, 30), st.integers(1, 5), st.integers(2, 6), st.integers(0, 1),
       st.integers(0, 2 ** 31 - 1))
@settings(max_examples=60, deadline=None)
def test_block_labels_equal_a_loop(S, L, A, B, shift, seed):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 99, (S, L), generator=g)
    lengths = torch.randint(1, L + 1, (S,), generator=g)
    anchors = torch.randint(-1, L, (S, A), generator=g)
    offs = label_offsets(B, shift)
    got = block_labels(tokens, lengths, anchors, offs)
    for s in range(S):
        for a in range(A):
            for j, o in enumerate(offs):
                p = anchors[s, a].item() + o
                ok = anchors[s, a].item() >= 0 and p < lengths[s].item()
                assert got[s, a, j].item() == (tokens[s, p].item() if ok else -100)


@pytest.mark.parametrize("shift", [0, 1])
def test_all_anchors_in_one_pass_equal_one_block_at_a_time(tiny, shift):
    """The A*B-query pass with its block-diagonal mask gives each block what a lone block
    (the inference path's forward_block over the context before its anchor) gives."""
    net = init_weights(BlockDrafterNet(cfg(shift, num_layers=2)), seed=3).eval()
    data = toy_data(3, seed=4)
    seqs = [data.sequence(i).tolist() for i in range(3)]
    batch = target_features(tiny, seqs, data.prompt_lens.tolist(), (0, 2))
    anchors = torch.tensor([[5, 9, 1, 20], [3, 3, 17, -1], [10, 2, 7, 11]])
    with torch.no_grad():
        h = block_hidden(net, tiny.embed, batch, anchors)  # [S, A, B, D]
        L, B = batch.feats.shape[1], net.config.block_size
        ctx = net.project_context(batch.feats)
        for s in range(3):
            kv = [net.context_kv(i, ctx[s:s + 1], torch.arange(L)) for i in range(2)]
            for a in range(4):
                anc = anchors[s, a].item()
                if anc < 0:
                    continue
                ids = torch.tensor([[batch.tokens[s, anc].item()] + [net.config.mask_token_id] * (B - 1)])
                lone = net.forward_block(tiny.embed[ids], anc + torch.arange(B)[None], kv, torch.arange(L)[None] < anc)
                torch.testing.assert_close(h[s, a], lone[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("make", [lambda: cfg(0, num_layers=2), lambda: dspark_cfg(num_layers=2)], ids=["dflash", "dspark"])
def test_a_grown_network_drafts_as_before_and_its_new_layers_learn(tiny, make):
    """grow_layers: more layers, the same block hidden states (so the same drafts) at once; the new
    layers then take gradients (their output projections first) and a step moves the output."""
    net = init_weights(BlockDrafterNet(make()), seed=5)
    data = toy_data(3, seed=6)
    batch = target_features(tiny, [data.sequence(i).tolist() for i in range(3)], data.prompt_lens.tolist(), (0, 2))
    anchors = torch.tensor([[5, 9, 1, 20], [3, 3, 17, -1], [10, 2, 7, 11]])
    grown = grow_layers(net, 4)
    assert grown.config.num_layers == 4 and net.config.num_layers == 2 and len(net.layers) == 2
    assert grown.config == BlockDrafterConfig(**{**net.config.to_json(), "num_layers": 4})
    with torch.no_grad():
        before = block_hidden(net, tiny.embed, batch, anchors)
        torch.testing.assert_close(block_hidden(grown, tiny.embed, batch, anchors), before, rtol=0, atol=0)
    # a grown network is not the old one in disguise: its new layers are trainable copies of the last
    assert grown.layers[3].self_attn.q_proj.weight.data_ptr() != grown.layers[1].self_attn.q_proj.weight.data_ptr()
    torch.testing.assert_close(grown.layers[3].mlp.up_proj.weight, net.layers[1].mlp.up_proj.weight)
    tc = TrainConfig(steps=1, seqs_per_step=3, anchors_per_seq=4)
    loss, _ = block_loss(grown, tiny.embed, tiny.lm_head, batch, anchors, tc)
    loss.backward()
    new = grown.layers[2]
    assert new.self_attn.o_proj.weight.grad.abs().sum() > 0 and new.mlp.down_proj.weight.grad.abs().sum() > 0
    opt = torch.optim.SGD(grown.parameters(), lr=1.0)
    opt.step()
    with torch.no_grad():
        assert (block_hidden(grown, tiny.embed, batch, anchors) - before).abs().max() > 1e-4
    with pytest.raises(ConfigError, match="num_layers"):
        grow_layers(net, 2)


@pytest.mark.parametrize("shift", [0, 1])
def test_greedy_labels_follow_the_targets_greedy_path(tiny, shift):
    """greedy_block_labels against a walk along each block: slot j is labelled with the target's
    argmax after the data's prefix while every data token before it in the block is the argmax of
    its own position, and unlabelled from the first token the target would not have chosen on.
    On the target's own greedy responses the labels are the data's; a block whose data leaves the
    greedy path keeps the slots up to that token."""
    from specdec import SamplingParams, SpecEngine

    prompts = toy_prompts()[:3]
    outs = SpecEngine(tiny, None).generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    seqs = [list(p) + list(o.token_ids) for p, o in zip(prompts, outs)]
    plens = [len(p) for p in prompts]
    B = 4
    offsets = label_offsets(B, shift)
    anchors = torch.tensor([[plens[0], plens[0] + 3, plens[0] + 7, -1], [plens[1] + 1, plens[1] + 5, plens[1] + 2, plens[1]],
                            [plens[2] + 4, plens[2], plens[2] + 9, plens[2] + 12]])
    off_path = [list(s) for s in seqs]
    for s, a in ((0, plens[0] + 3), (1, plens[1] + 5), (2, plens[2] + 9)):  # the block's second data token leaves the path
        off_path[s][a + 2] = (off_path[s][a + 2] + 1) % VOCAB
    for data in (seqs, off_path):
        batch = target_features(tiny, data, plens, (0, 2))
        with torch.no_grad():
            argmax = [tiny.compute_logits(batch.final[s, :len(data[s])]).argmax(-1).tolist() for s in range(3)]
        labels = block_labels(batch.tokens, batch.lengths, anchors, offsets)
        got = greedy_block_labels(labels, batch.final, anchors, offsets, tiny.compute_logits, chunk_rows=5)
        want = torch.full_like(labels, -100)
        for s in range(3):
            for i, a in enumerate(anchors[s].tolist()):
                for j, o in enumerate(offsets):
                    if a < 0 or a + o >= len(data[s]):
                        break
                    want[s, i, j] = argmax[s][a + o - 1]
                    if data[s][a + o] != argmax[s][a + o - 1]:
                        break  # the slots after a token the target would not have chosen have no label
        assert torch.equal(got, want)
        if data is seqs:  # the target's own greedy responses: their labels as they were
            assert torch.equal(got, labels)
        else:
            assert (got[0, 1, 2:] == -100).all() and (got[0, 1, :2] != -100).all()
    with pytest.raises(ConfigError, match="greedy_labels"):
        block_loss(init_weights(BlockDrafterNet(cfg(shift)), seed=0), tiny.embed, tiny.lm_head,
                   target_features(tiny, seqs, plens, (0, 2), with_final=False), anchors,
                   TrainConfig(greedy_labels=True), tiny.compute_logits)
    with pytest.raises(ConfigError, match="greedy_labels"):
        TrainConfig(greedy_labels=1)


def test_block_loss_trains_on_the_greedy_labels(tiny, monkeypatch):
    """With ``greedy_labels`` the loss is the plain loss over greedy_block_labels' labels, and on
    data off the target's greedy path (toy sequences) that differs from the loss over the data."""
    from specdec.drafters import training

    net = init_weights(BlockDrafterNet(cfg(0)), seed=2)
    data = toy_data(3, seed=5)
    seqs, plens = [data.sequence(i).tolist() for i in range(3)], data.prompt_lens.tolist()
    batch = target_features(tiny, seqs, plens, (0, 2))
    anchors = torch.tensor([[5, 9, 1, 20], [3, 3, 17, -1], [10, 2, 7, 11]])
    with torch.no_grad():
        greedy, _ = block_loss(net, tiny.embed, tiny.lm_head, batch, anchors, TrainConfig(greedy_labels=True),
                               tiny.compute_logits)
        plain, _ = block_loss(net, tiny.embed, tiny.lm_head, batch, anchors, TrainConfig(), tiny.compute_logits)
        data_labels = training.block_labels
        monkeypatch.setattr(training, "block_labels", lambda *a: greedy_block_labels(
            data_labels(*a), batch.final, anchors, label_offsets(4, 0), tiny.compute_logits))
        relabelled, _ = block_loss(net, tiny.embed, tiny.lm_head, batch, anchors, TrainConfig(), tiny.compute_logits)
    torch.testing.assert_close(greedy, relabelled)
    assert abs(greedy.item() - plain.item()) > 1e-3


def test_mask_sees_context_before_the_anchor_and_its_own_block_only():
    m = anchor_block_mask(torch.tensor([[2, 5]]), 3, 6)[0, 0]  # [6 queries, 6 ctx + 6 block keys]
    assert m[:3, :6].tolist() == [[True, True, False, False, False, False]] * 3
    assert m[3:, :6].tolist() == [[True] * 5 + [False]] * 3
    assert m[:3, 6:].tolist() == [[True] * 3 + [False] * 3] * 3 and m[3:, 6:].tolist() == [[False] * 3 + [True] * 3] * 3
    assert block_mask(torch.tensor([[True, False]]), 2).shape == (1, 1, 1, 4)


def test_loss_uses_only_context_before_each_anchor(tiny):
    net = init_weights(BlockDrafterNet(dspark_cfg()), seed=1)
    data = toy_data(2, seed=2)
    seqs = [data.sequence(i).tolist() for i in range(2)]
    batch = target_features(tiny, seqs, data.prompt_lens.tolist(), (0, 2))
    anchors = torch.tensor([[9], [12]])
    tc = TrainConfig(tv_weight=1.0, confidence_weight=1.0)
    l1, _ = block_loss(net, tiny.embed, tiny.lm_head, batch, anchors, tc, tiny.compute_logits)
    g = torch.Generator().manual_seed(0)
    batch.feats[0, 9:] += 10 * torch.randn(batch.feats[0, 9:].shape, generator=g)
    batch.feats[1, 12:] += 10 * torch.randn(batch.feats[1, 12:].shape, generator=g)
    l2, _ = block_loss(net, tiny.embed, tiny.lm_head, batch, anchors, tc, tiny.compute_logits)
    assert l1.item() == pytest.approx(l2.item(), rel=1e-6)
    batch.feats[0, 8] += 10 * torch.randn(batch.feats[0, 8].shape, generator=g)
    l3, _ = block_loss(net, tiny.embed, tiny.lm_head, batch, anchors, tc, tiny.compute_logits)
    assert l1.item() != pytest.approx(l3.item(), rel=1e-6)


def _dspark_loss_case(tiny, net_seed: int, data_seed: int):
    """A DSpark-like net with a live Markov head, 3 toy sequences with 5 anchors each, every loss term on."""
    net = init_weights(BlockDrafterNet(dspark_cfg()), seed=net_seed)
    with torch.no_grad():
        net.markov.up.weight.normal_(0, 0.2)
    data = toy_data(3, seed=data_seed)
    batch = target_features(tiny, [data.sequence(i).tolist() for i in range(3)], data.prompt_lens.tolist(), (0, 2))
    anchors = anchors_from_uniform(torch.tensor([6, 6, 6]), batch.lengths - 2, torch.rand(3, 5))
    return net, batch, anchors, TrainConfig(tv_weight=0.5, confidence_weight=0.3)


def _loss_grads(tiny, net, batch, anchors, tc, **kw):
    """``(loss, metrics, gradients)`` of one block_loss and its backward."""
    net.zero_grad()
    loss, m = block_loss(net, tiny.embed, tiny.lm_head, batch, anchors, tc, tiny.compute_logits, **kw)
    loss.backward()
    return loss.item(), m, [p.grad.clone() for p in net.parameters()]


def test_chunked_loss_equals_one_chunk_and_its_gradients(tiny):
    net, batch, anchors, tc = _dspark_loss_case(tiny, 1, 5)
    (l0, m0, g0), (l1, _, g1) = [_loss_grads(tiny, net, batch, anchors, tc, chunk_rows=rows) for rows in (7, 10_000)]
    assert l0 == pytest.approx(l1, rel=1e-5)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert m0["tv"] > 0 and m0["conf"] > 0


@needs_cxx
def test_compiled_loss_terms_equal_the_eager_ones_and_their_gradients(tiny):
    """``compile_terms=True`` (TrainConfig.compile_loss) runs chunk_terms through torch.compile: the
    same loss, metrics and gradients as the eager terms, with every term on (cross-entropy, total
    variation, confidence, Markov head) and chunks of different row counts (a dynamic shape)."""
    net, batch, anchors, tc = _dspark_loss_case(tiny, 3, 6)
    (l0, m0, g0), (l1, m1, g1) = [_loss_grads(tiny, net, batch, anchors, tc, chunk_rows=11, compile_terms=compiled)
                                  for compiled in (False, True)]
    assert l1 == pytest.approx(l0, rel=1e-5)
    assert m1 == pytest.approx(m0, rel=1e-5, abs=1e-7) and m0["tv"] > 0 and m0["conf"] > 0
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    with pytest.raises(ConfigError):
        TrainConfig(compile_loss="yes")


class _FailingBackward(torch.autograd.Function):
    """Passes its input through; its backward fails as a lazily compiled backward may."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("no compiler here")


@pytest.mark.parametrize("fails_in", ["forward", "backward"])
def test_a_failed_loss_compile_warns_once_and_the_loss_runs_eagerly(tiny, monkeypatch, fails_in):
    """A compile that fails, in the forward or (compiled lazily) in the backward, costs one warning;
    the loss and its backward then run eagerly, with the eager loss's value."""
    import specdec.drafters.training as tr

    def broken(fn, **kw):
        def f(*a, **k):
            if fails_in == "forward":
                raise RuntimeError("no compiler here")
            return _FailingBackward.apply(fn(*a, **k))
        return f

    monkeypatch.setattr(tr, "_COMPILED_TERMS", [])
    monkeypatch.setattr(tr, "_COMPILE_FAILED", [])
    monkeypatch.setattr(tr, "_COMPILE_PROBED", [])
    monkeypatch.setattr(tr.torch, "compile", broken)
    net, batch, anchors, tc = _dspark_loss_case(tiny, 4, 7)
    eager, _ = block_loss(net, tiny.embed, tiny.lm_head, batch, anchors, tc, tiny.compute_logits)
    with pytest.warns(RuntimeWarning, match="compile_loss: torch.compile failed"):
        first, _ = block_loss(net, tiny.embed, tiny.lm_head, batch, anchors, tc, tiny.compute_logits, chunk_rows=5,
                              compile_terms=True)
    first.backward()
    assert first.item() == pytest.approx(eager.item(), rel=1e-5)
    assert tr._COMPILE_FAILED == ["RuntimeError: no compiler here"]
    import warnings as w
    with w.catch_warnings():
        w.simplefilter("error")  # no second warning: the eager terms from then on
        again, _ = block_loss(net, tiny.embed, tiny.lm_head, batch, anchors, tc, tiny.compute_logits, compile_terms=True)
    assert again.item() == pytest.approx(eager.item(), rel=1e-5)


# -- the Markov head -----------------------------------------------------------------------------------
def test_markov_block_logits_equal_a_token_by_token_reference(tiny):
    net = init_weights(BlockDrafterNet(dspark_cfg()), seed=2).eval()
    with torch.no_grad():
        net.markov.up.weight.normal_(0, 0.5)  # a bias that matters
    g = torch.Generator().manual_seed(1)
    h = torch.randn(5, 4, HIDDEN, generator=g)
    first = torch.randint(0, VOCAB, (5,), generator=g)
    with torch.no_grad():
        toks, conf = draft_from_hidden(net, h, first, tiny.lm_head, tiny.embed, with_confidence=True)
        for n in range(5):
            prev = first[n].item()
            for j in range(4):
                bias = net.markov.up(net.markov.down(tiny.embed[prev]))
                logits = tiny.lm_head @ (h[n, j] + bias)
                assert toks[n, j].item() == logits.argmax().item()
                p = torch.sigmoid(net.confidence(torch.cat([h[n, j], torch.stack([
                    torch.log_softmax(logits, -1).max(), -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum()])])))
                assert conf[n, j].item() == pytest.approx(p.item(), rel=1e-4, abs=1e-6)
                prev = toks[n, j].item()
        # teacher forcing with the drafted tokens gives the same logits in one batched call
        prev = torch.cat([first[:, None], toks[:, :-1]], 1)
        batched = slot_logits(net, h, prev, tiny.lm_head, tiny.embed)
        assert torch.equal(batched.argmax(-1), toks)
    plain = init_weights(BlockDrafterNet(cfg(1)), seed=2)
    assert plain.markov is None and plain.confidence is None
    assert draft_from_hidden(plain, h, first, tiny.lm_head, tiny.embed, with_confidence=True)[1] is None


def test_markov_head_starts_as_no_bias():
    net = init_weights(BlockDrafterNet(dspark_cfg()), seed=0)
    assert torch.count_nonzero(net.markov_bias(torch.randn(3, HIDDEN))) == 0


@pytest.mark.parametrize("kw,field", [({"markov_rank": -1}, "markov_rank"), ({"markov_rank": 1.5}, "markov_rank"),
                                      ({"confidence_head": 1}, "confidence_head")])
def test_head_config_errors_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        cfg(1, **kw)


# -- training end to end ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    out = {}
    train = distill_tokens(tiny, toy_prompts(), max_new_tokens=40)  # the target's own greedy responses
    val = train.subset(range(6))  # memorising 12 sequences is what a tiny drafter can show in seconds
    for name, c, tc in [("dflash", cfg(0), TrainConfig(steps=120, seqs_per_step=4, anchors_per_seq=8, lr=1e-2,
                                                        val_every=60)),
                        ("dspark", dspark_cfg(), TrainConfig(steps=120, seqs_per_step=4, anchors_per_seq=8, lr=1e-2,
                                                             val_every=60, tv_weight=0.5, confidence_weight=0.2))]:
        folder = tmp_path_factory.mktemp(name)
        before = simulated_tau(new_net(c, tiny), tiny, val, tc)["tau"]
        net, rec = train_block_drafter(tiny, train, new_net(c, tiny), tc, val=val, out=folder, progress=False)
        out[name] = (net, rec, folder, before)
    return out


@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_training_converges_and_validation_tau_rises(trained, name):
    net, rec, folder, before = trained[name]
    losses = rec["losses"]
    assert sum(losses[-10:]) / 10 < 0.7 * sum(losses[:10]) / 10
    assert rec["best"]["tau"] > before + 0.3
    assert rec["tokens_seen"] > 0 and len(rec["lr"]) == rec["steps_run"] == 120
    saved = json.loads((folder / "training.json").read_text())
    assert saved["best"] == rec["best"]
    assert (folder / "training.png").read_bytes()[:4] == b"\x89PNG"
    if name == "dspark":
        assert 0 <= rec["best"]["conf_ece"] < 0.25  # calibrated roughly, even this small


@pytest.mark.parametrize("name", ["dflash", "dspark"])
@pytest.mark.parametrize("batch", [1, 4])
def test_trained_drafters_are_lossless(tiny, trained, name, batch):
    net, _, folder, _ = trained[name]
    cls = DFlashDrafter if name == "dflash" else DSparkDrafter
    loaded = cls.from_pretrained(folder)
    assert loaded.config == net.config
    prompts = toy_prompts()[:8]  # prompts whose continuations it learnt
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    base = SpecEngine(tiny, max_num_seqs=batch).generate(prompts, params)
    engine = SpecEngine(tiny, loaded, max_num_seqs=batch, draft_gate=False)  # every step drafts
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    acc = [a for o in outs for a in o.stats.accepted_lengths]
    assert sum(acc) / len(acc) > 1.3  # it drafts something right


@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_the_engines_steps_equal_the_walk_replayed_from_training_code(tiny, trained, name):
    """The engine's accepted tokens per step (fp32, greedy, batch 1) equal the walk replayed
    offline over its outputs with the training code's drafter pass: the inference path drafts what
    training measures, and the walk's τ (bench/walk_tau.py) is the engine's."""
    _, _, folder, _ = trained[name]
    cls = DFlashDrafter if name == "dflash" else DSparkDrafter
    net = BlockDrafterNet.load(folder).float().eval()
    prompts = toy_prompts()[:8]
    outs = SpecEngine(tiny, cls.from_pretrained(folder), max_num_seqs=1, draft_gate=False).generate(
        prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    walks = []
    for prompt, out in zip(prompts, outs):
        walk = walk_accepted_lengths(accepted_runs(net, tiny, prompt, out.token_ids), len(out.token_ids))
        assert out.stats.accepted_lengths == walk
        walks += walk
    assert sum(walks) / len(walks) > 1.3  # drafts that land: the walks are not all ones
    assert walk_accepted_lengths([7, 0, 3, 0, 0, 0, 0, 0, 0], 10) == [8, 1]  # capped at the output's end
    assert walk_accepted_lengths([0, 2, 0, 1, 0], 6) == [1, 3, 1]


# -- training data ------------------------------------------------------------------------------------------
def test_token_data_round_trip_in_shards(tmp_path, monkeypatch):
    import specdec.drafters.data as data_mod

    monkeypatch.setattr(data_mod, "SHARD_TOKENS", 50)
    rng = random.Random(0)
    seqs = [[rng.randrange(49152) for _ in range(rng.randint(1, 30))] for _ in range(20)]
    d = TokenData.from_lists(seqs, [1] * 20, [i % 3 for i in range(20)], [0.0, 0.8] * 10, {"seed": 3})
    paths = d.save(tmp_path)
    assert len(paths) > 2 and all(p.suffix == ".npz" for p in paths)
    back = TokenData.load(tmp_path)
    assert [back.sequence(i).tolist() for i in range(20)] == seqs
    assert back.source.tolist() == d.source.tolist() and back.meta["seed"] == 3
    assert back.tokens.dtype == np.uint16
    train, val = back.split(0.3, seed=1)
    assert len(train) + len(val) == 20 and (val.temperature == 0).all()
    assert back.split(0.3, seed=1)[1].tokens.tolist() == val.tokens.tolist()
    # a prompt answered greedily and sampled: its sampled answers never train once its greedy one validates
    prompts = [[rng.randrange(49152) for _ in range(5)] for _ in range(30)]
    twins = TokenData.from_lists([p + [rng.randrange(49152) for _ in range(8)] for p in prompts for _ in range(3)],
                                 [5] * 90, [0] * 90, [0.0, 0.7, 0.9] * 30)
    train, val = twins.split(0.3, seed=2)
    held = {tuple(val.sequence(i)[:5].tolist()) for i in range(len(val))}
    assert 0 < len(val) < 30 and (val.temperature == 0).all()
    assert not held & {tuple(train.sequence(i)[:5].tolist()) for i in range(len(train))}
    assert len(train) + 3 * len(val) == 90
    with pytest.raises(ConfigError, match="uint16"):
        TokenData.from_lists([[70000]], [1], [0], [0.0])
    (tmp_path / paths[0].name).write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match="shard"):
        TokenData.load(tmp_path)
    with pytest.raises(CheckpointError, match="manifest"):
        TokenData.load(tmp_path / "none")


def test_code_prompts_are_seeded_and_come_from_library_functions():
    a, b = code_prompts(30, seed=4, workers=1), code_prompts(30, seed=4, workers=2)
    assert a == b and len(a) == 30 and len(set(a)) == 30
    assert all("```python\n" in p and p.split("\n")[0] in {
        "Implement this Python function.", "Explain what this Python function does.", "Continue this Python code.",
        "Add type hints to this Python function."} for p in a)
    assert code_prompts(30, seed=5, workers=1) != a


def test_grounded_prompts_put_a_self_written_passage_in_a_seeded_task(smollm2):
    """The ``grounded`` source: the target writes passages, each becomes one task over it (the
    passage verbatim in the prompt); the same seed gives the same tasks."""
    from specdec import SpecEngine
    from specdec.drafters.data import _GROUNDED_TASKS, grounded_prompt, grounded_prompts

    a, b = random.Random(3), random.Random(3)
    passage = "The river rose after three days of rain. " * 6
    got = [grounded_prompt(passage, "rivers", a) for _ in range(40)]
    assert got == [grounded_prompt(passage, "rivers", b) for _ in range(40)]
    assert all(passage.strip() in g for g in got) and len({g.split("\n")[0] for g in got}) > 5
    assert len({t.split("{p}")[0] for t in _GROUNDED_TASKS}) == len(_GROUNDED_TASKS)
    with SpecEngine(smollm2, max_num_seqs=8) as engine:
        tasks = grounded_prompts(engine, 3, seed=1, passage_tokens=96, progress=False)
    assert 1 <= len(tasks) <= 3 and len(set(tasks)) == len(tasks)
    heads = {t.split("{p}")[0].split("{")[0] for t in _GROUNDED_TASKS}
    for t in tasks:  # a task (one of the templates) over a passage of >= 40 words
        assert any(t.startswith(h) for h in heads) and len(t.split()) >= 40 + 5


@pytest.mark.parametrize("text,ok", [("Write a short poem about the sea at night", True), ("Hi", False),
                                     ("the the the the the the the the", False), ("<|im_start|>user write a poem", False),
                                     ("1234 5678 9012 3456 7890", False)])
def test_magpie_filter(text, ok):
    assert keep_message(text) is ok


@pytest.fixture(scope="module")
def cli_args(tmp_path_factory) -> list[str]:
    """The training command's flags for a tiny target and toy data, both written here."""
    tpath = tmp_path_factory.mktemp("cli_target")
    tiny_llama(tpath, "cpu")
    data_dir = tmp_path_factory.mktemp("cli_data")
    toy_data(16).save(data_dir)
    return ["--data", str(data_dir), "--target", str(tpath), "--num-layers", "1", "--intermediate-size", "32",
            "--num-target-layers", "2", "--device", "cpu", "--dtype", "float32", "--seqs-per-step", "2",
            "--anchors", "2", "--val-every", "2", "--val-fraction", "0.3", "--block-size", "4"]


def test_training_command_trains_resumes_and_refuses_bad_flags(tmp_path_factory, capsys, cli_args):
    from specdec.drafters.training import main

    out = tmp_path_factory.mktemp("cli_out")
    common = cli_args
    assert main(common + ["--kind", "dspark", "--out", str(out), "--steps", "4"]) == 0
    rec = json.loads((out / "training.json").read_text())
    assert rec["steps_run"] == 4 and rec["planned_steps"] == 4 and len(rec["val"]) == 3
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["kind"] == "dspark"
    net = BlockDrafterNet.load(out)
    assert net.config.markov_rank == 64 and net.config.confidence_head and net.config.num_layers == 1
    more = tmp_path_factory.mktemp("cli_more")
    assert main(common + ["--kind", "dspark", "--out", str(more), "--steps", "2", "--init", str(out)]) == 0
    assert json.loads((more / "training.json").read_text())["steps_run"] == 2
    with pytest.raises(SystemExit):
        main(common + ["--kind", "dflash", "--out", str(more), "--init", str(out)])  # not a DFlash checkpoint
    with pytest.raises(SystemExit):
        main(common + ["--kind", "dspark", "--out", str(more), "--init", str(out), "--resume", str(out)])
    grown = tmp_path_factory.mktemp("cli_grown")
    assert main(common + ["--kind", "dspark", "--out", str(grown), "--steps", "2", "--init", str(out),
                          "--grow-layers", "3"]) == 0
    assert BlockDrafterNet.load(grown).config.num_layers == 3
    relabelled = tmp_path_factory.mktemp("cli_greedy")
    assert main(common + ["--kind", "dflash", "--out", str(relabelled), "--steps", "2", "--greedy-labels"]) == 0
    assert json.loads((relabelled / "training.json").read_text())["train"]["greedy_labels"] is True
    cut = tmp_path_factory.mktemp("cli_greedy_cut")  # a cut run resumes with its own labels, flag or not
    assert main(common + ["--kind", "dflash", "--out", str(cut), "--steps", "4", "--greedy-labels",
                          "--stop-after", "1e-9"]) == 0
    assert json.loads((cut / "train_state.json").read_text())["step"] < 4
    assert main(common + ["--kind", "dflash", "--out", str(cut), "--resume", str(cut)]) == 0
    assert json.loads((cut / "training.json").read_text())["steps_run"] == 4
    for bad in (["--grow-layers", "3"], ["--grow-layers", "1", "--init", str(out)]):  # no --init; not deeper
        with pytest.raises(SystemExit):
            main(common + ["--kind", "dspark", "--out", str(more), *bad])
    with pytest.raises(CheckpointError, match="manifest"):
        main(["--data", str(tmp_path_factory.mktemp("empty")), "--out", str(more), "--device", "cpu"])


def test_training_command_trains_two_kinds_side_by_side(tmp_path_factory, capsys, cli_args):
    from specdec.drafters.training import main

    out = tmp_path_factory.mktemp("cli2_out")
    common = cli_args + ["--steps", "2"]
    assert main(common + ["--kind", "dflash,dspark", "--out", str(out / "ck-{kind}")]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()[-2:]]
    assert [x["kind"] for x in lines] == ["dflash", "dspark"] and all(x["steps_run"] == 2 for x in lines)
    assert BlockDrafterNet.load(out / "ck-dspark").config.markov_rank == 64
    assert BlockDrafterNet.load(out / "ck-dflash").config.shift_label == 0
    rec = json.loads((out / "ck-dflash" / "training.json").read_text())
    assert rec["networks_per_batch"] == 2
    assert main(common + ["--kind", "dspark,dflash", "--out", str(out / "more-{kind}"),
                          "--init", str(out / "ck-{kind}")]) == 0
    for bad in (["--kind", "dflash,dspark", "--out", str(out / "one")], ["--kind", "dflash,eagle", "--out", str(out)],
                ["--kind", "dflash,dflash", "--out", str(out / "{kind}")],
                ["--kind", "dflash,dspark", "--out", str(out / "x-{kind}"), "--init", str(out / "ck-dflash")]):
        with pytest.raises(SystemExit):
            main(common + bad)


def test_parts_of_a_data_set_join_and_the_command_checks_its_flags(tmp_path):
    from specdec.drafters.data import main as data_main

    a, b = toy_data(5, seed=1), toy_data(3, seed=2)
    a.save(tmp_path / "a")
    b.save(tmp_path / "b")
    both = TokenData.concat([TokenData.load(tmp_path / "a"), TokenData.load(tmp_path / "b")])
    assert len(both) == 8 and [both.sequence(i).tolist() for i in range(8)] == \
        [a.sequence(i).tolist() for i in range(5)] + [b.sequence(i).tolist() for i in range(3)]
    assert both.prompt_lens.tolist() == a.prompt_lens.tolist() + b.prompt_lens.tolist()
    for bad in (["--part", "2/2"], ["--part", "x"], ["--num-code", "-1"], ["--sampled-fraction", "2"]):
        with pytest.raises(SystemExit):
            data_main(["--out", str(tmp_path / "c"), "--device", "cpu", *bad])
    with pytest.raises(ConfigError):
        TokenData.concat([])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_loss_and_its_backward_never_wait_for_the_gpu(tmp_path):
    """On CUDA the training loss (every term, the Markov head, several chunks) and its backward run
    without a host synchronisation when its metrics stay on the device (the training loop reads
    them back in bulk): torch's sync debug mode raises on any synchronising call."""
    target = tiny_llama(tmp_path / "t", "cuda", num_hidden_layers=3, max_position_embeddings=160,
                        initializer_range=0.3)
    net = init_weights(BlockDrafterNet(dspark_cfg()), seed=1).cuda()
    data = toy_data(3, seed=5)
    batch = target_features(target, [data.sequence(i).tolist() for i in range(3)], data.prompt_lens.tolist(), (0, 2))
    anchors = anchors_from_uniform(torch.full((3,), 6, device="cuda"), batch.lengths - 2, torch.rand(3, 5, device="cuda"))
    tc = TrainConfig(tv_weight=0.5, confidence_weight=0.3)
    block_loss(net, target.embed, target.lm_head, batch, anchors, tc, target.compute_logits, chunk_rows=16)  # warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, m = block_loss(net, target.embed, target.lm_head, batch, anchors, tc, target.compute_logits,
                                 chunk_rows=16, metrics_on_device=True)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert set(m) == {"ce", "tv", "conf", "acc"} and all(v.device.type == "cuda" for v in m.values())
    assert math.isfinite(loss.item()) and 0 <= m["acc"].item() <= 1
