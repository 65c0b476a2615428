"""MLA DSpark drafter: K-only latent layers in the MLA target's pool, hooks, rollback, strict lossless."""

from __future__ import annotations

import random

import pytest
import torch

from specdec import SamplingParams, SpecEngine
from specdec.drafters import MLABlockDrafterConfig, MLABlockDrafterNet, MLADSparkDrafter, NullDrafter
from specdec.drafters.base import available_drafters, make_drafter
from specdec.drafters.block import init_weights
from specdec.drafters.dspark_mla import LATENT_PAGE_SIZES
from specdec.drafters.training import (TrainConfig, anchor_range, anchors_from_uniform, block_loss, distill_tokens,
                                       target_features, target_hidden_states)
from specdec.errors import ConfigError
from specdec.scheduler import decide_kv_sharing
from specdec.target.mla import MLATarget

VOCAB, HIDDEN, LAYERS = 128, 64, 3
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5], [7, 8, 9], [3] * 5, list(range(20, 50)), [11, 12] * 4, [99], [40, 41, 42]]
PARAMS = SamplingParams(max_new_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def target():
    return MLATarget.random(num_heads=4, num_layers=LAYERS, hidden_size=HIDDEN, vocab_size=VOCAB, kv_lora_rank=32,
                            q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)


def cfg(**kw) -> MLABlockDrafterConfig:
    base = dict(block_size=4, target_layer_ids=(0, 2), target_hidden_size=HIDDEN, vocab_size=VOCAB, hidden_size=HIDDEN,
                num_layers=2, num_heads=4, kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                intermediate_size=128)
    return MLABlockDrafterConfig(**{**base, **kw})


def random_drafter(seed: int = 1, **kw) -> MLADSparkDrafter:
    return MLADSparkDrafter(init_weights(MLABlockDrafterNet(cfg(**kw)), seed=seed))


@pytest.fixture(scope="module")
def trained_net(target):
    """A few seconds of self-distillation, so that some drafts are accepted and some rejected."""
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 12))] for _ in range(24)]
    data = distill_tokens(target, prompts, max_new_tokens=48)
    net = init_weights(MLABlockDrafterNet(cfg(num_layers=1, kv_lora_rank=32)), seed=0)
    with torch.no_grad():
        net.norm.weight.copy_(target.final_norm)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(150):
        idx = [rng.randrange(24) for _ in range(8)]
        batch = target_features(target, [data.sequence(i).tolist() for i in idx],
                                [int(data.prompt_lens[i]) for i in idx], (0, 2), with_final=False)
        anchors = anchors_from_uniform(*anchor_range(batch.prompt_lens, batch.lengths), torch.rand(8, 8, generator=g))
        loss, _ = block_loss(net, target.embed, target.lm_head, batch, anchors, TrainConfig())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net.eval()


def test_hooks_declare_k_only_latent_layers_and_the_page_sizes_read():
    d = random_drafter()
    specs = d.kv_layer_specs()
    assert len(specs) == 2 and all(s.kind == "mla" and s.num_kv_heads == 1 and not s.has_v for s in specs)
    assert all(s.head_dim == 24 + 8 and s.owner == "draft" and s.bytes_per_token == 32 * 4 for s in specs)
    assert d.shift_label == 1 and d.config.draft_width == 4 and d.reads_helix_sharded_ctx_pages
    assert all(d.reads_managed_ctx_pages(p) for p in LATENT_PAGE_SIZES)
    narrow = random_drafter(ctx_page_sizes=(16, 32))
    assert [p for p in (1, 2, 4, 8, 16, 32, 64, 128, 256, 3, 48) if narrow.reads_managed_ctx_pages(p)] == [16, 32]
    assert "dspark_mla" in available_drafters()
    assert isinstance(make_drafter("dspark_mla", net=d.net), MLADSparkDrafter)
    with pytest.raises(ConfigError, match="net="):
        make_drafter("dspark_mla")


@pytest.mark.parametrize("kw,field", [
    ({"block_size": 1}, "block_size"), ({"target_layer_ids": ()}, "target_layer_ids"),
    ({"kv_lora_rank": 0}, "kv_lora_rank"), ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    ({"ctx_page_sizes": (16, 48)}, "ctx_page_sizes"), ({"ctx_page_sizes": ()}, "ctx_page_sizes"),
    ({"mask_token_id": VOCAB}, "mask_token_id"), ({"shift_label": 2}, "shift_label"),
])
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        cfg(**kw)


def test_drafter_must_fit_the_target(target):
    with pytest.raises(ConfigError, match="shift_label=1"):
        MLADSparkDrafter(MLABlockDrafterNet(cfg(shift_label=0)))
    with pytest.raises(ConfigError, match="target_layer_ids"):
        SpecEngine(target, random_drafter(target_layer_ids=(0, LAYERS)), num_pages=8)
    with pytest.raises(ConfigError, match="target_hidden_size"):
        SpecEngine(target, random_drafter(target_hidden_size=32), num_pages=8)


@pytest.mark.parametrize("tpb", [4, 16, 128])
def test_layers_are_appended_to_the_mla_target_pool(target, tpb):
    d = random_drafter()
    engine = SpecEngine(target, d, tokens_per_block=tpb, num_pages=64)
    layout = engine.kv_layout
    assert layout["shared"] and len(layout["pools"]) == 1 and "appended" in layout["reason"]
    assert layout["pools"][0]["target_layers"] == [0, 1, 2] and layout["pools"][0]["draft_layers"] == [3, 4]
    assert engine.pool.bytes_per_token == sum(s.bytes_per_token for s in target.layer_specs() + d.kv_layer_specs())
    assert [engine.pool.v[i] for i in (3, 4)] == [None, None]  # K only: no V tensor at all
    assert engine.draft_kv.shared and engine.draft_kv.manager is engine.manager
    assert engine.draft_kv.k(1) is engine.pool.k[4] and engine.pool.k[4].shape == (64 * tpb, 1, 32)


def test_page_sizes_it_does_not_read_give_a_separate_pool(target):
    d = random_drafter(ctx_page_sizes=(16,))
    decision = decide_kv_sharing(d.kv_layer_specs(), d.reads_managed_ctx_pages, False, 64)
    assert not decision.shared and decision.draft_tokens_per_block == 16
    engine = SpecEngine(target, d, tokens_per_block=64, num_pages=16)
    assert not engine.kv_layout["shared"] and engine.kv_layout["pools"][1]["tokens_per_block"] == 16
    with pytest.raises(ConfigError, match="share_draft_kv"):
        SpecEngine(target, d, tokens_per_block=64, num_pages=16, share_draft_kv=True)
    out = engine.generate(PROMPTS[:2], PARAMS)
    base = SpecEngine(target, NullDrafter(), tokens_per_block=64, num_pages=16).generate(PROMPTS[:2], PARAMS)
    assert [o.token_ids for o in out] == [o.token_ids for o in base]


def _generate(target, drafter, batch_size, **kw):
    engine = SpecEngine(target, drafter, max_draft_tokens=4, **{"tokens_per_block": 4, "num_pages": 64,
                                                                 "draft_gate": False, **kw})
    return [o for i in range(0, len(PROMPTS), batch_size) for o in engine.generate(PROMPTS[i:i + batch_size], PARAMS)]


@pytest.fixture(scope="module")
def baseline(target):
    return _generate(target, NullDrafter(), batch_size=1)


@pytest.mark.parametrize("kind", ["random", "trained"])
@pytest.mark.parametrize("batch_size,tpb", [(1, 4), (3, 4), (3, 16)])
def test_lossless_null_vs_mla_dspark(target, baseline, trained_net, kind, batch_size, tpb):
    """fp32 greedy, token for token: whatever the drafter drafts, the output is the target's."""
    drafter = random_drafter() if kind == "random" else MLADSparkDrafter(trained_net)
    outs = _generate(target, drafter, batch_size, tokens_per_block=tpb)
    for i, (base, spec) in enumerate(zip(baseline, outs)):
        assert spec.token_ids == base.token_ids, f"prompt {i} diverged ({kind} drafter, batch {batch_size}, tpb {tpb})"
        assert spec.finish_reason == base.finish_reason
    drafted, accepted = sum(o.stats.drafted for o in outs), sum(o.stats.accepted for o in outs)
    assert drafted > accepted  # drafts were rejected and rolled back
    if kind == "trained":
        assert accepted > 0  # and some were accepted: both verify paths ran


def test_lossless_with_an_fp8_target_cache(target, trained_net):
    """FP8 target layers and fp32 draft latents in one pool; lossless against the same FP8 engine."""
    base = _generate(target, NullDrafter(), 3, kv_cache_dtype="fp8_e4m3")
    engine = SpecEngine(target, MLADSparkDrafter(trained_net), tokens_per_block=4, num_pages=8,
                        kv_cache_dtype="fp8_e4m3")
    assert engine.kv_layout["shared"] and engine.pool.k[0].dtype == torch.float8_e4m3fn
    assert engine.pool.k[LAYERS].dtype == torch.float32
    outs = _generate(target, MLADSparkDrafter(trained_net), 3, kv_cache_dtype="fp8_e4m3")
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]


def test_latents_live_in_the_target_pool_and_roll_back_with_it(target, trained_net):
    drafter = MLADSparkDrafter(trained_net)
    engine = SpecEngine(target, drafter, tokens_per_block=4, num_pages=40, max_draft_tokens=4, draft_gate=False)
    rid = engine.add_request(PROMPTS[3], SamplingParams(max_new_tokens=24, ignore_eos=True))
    seq, layer = engine._seqs[rid], engine.draft_kv.layer_ids[0]
    rejected = 0
    while engine.has_unfinished():
        engine.step()
        if not engine.has_unfinished():
            break
        n = seq.num_cached
        # one length, one page table: the target's, truncated past the accepted tokens after every verify
        assert engine.manager.length(rid) == n == drafter._ctx_len[rid]
        assert engine.draft_kv.page_table(rid) == engine.manager.page_table(rid)
        assert engine.manager.num_free_pages == 40 - -(-n // 4)
        rejected += seq.stats.drafted - seq.stats.accepted
        # the latents at accepted positions are exactly what a fresh pass over the accepted tokens writes
        hidden = target_hidden_states(target, seq.tokens[:n], drafter.target_layer_ids)
        with torch.inference_mode():
            want, _ = drafter.net.context_kv(0, drafter.net.project_context(hidden), torch.arange(n))
        slots = engine.manager.slots(rid, 0, n)
        torch.testing.assert_close(engine.pool.k[layer][slots], want, rtol=1e-4, atol=1e-5)
    assert rejected > 0
    assert engine.manager.num_free_pages == 40  # finished: its target and draft pages are free together


def test_checkpoint_round_trip(target, tmp_path):
    d = random_drafter(seed=3)
    d.net.save(tmp_path / "ckpt")
    loaded = MLADSparkDrafter.from_pretrained(tmp_path / "ckpt")
    assert loaded.config == d.config
    for k, v in d.net.state_dict().items():
        assert torch.equal(loaded.net.state_dict()[k], v)
    a, b = (SpecEngine(target, x, tokens_per_block=4, num_pages=16) for x in (d, loaded))
    for e in (a, b):
        e.add_request(PROMPTS[0], PARAMS, req_id="x")
        e.step()
    assert d.propose(["x"], 4) == loaded.propose(["x"], 4)
