"""Block drafters (DFlash / DSpark): shift_label, hooks and pool placement, lossless, checkpoints (training:
test_drafter_training.py)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from specdec import SamplingParams, SpecEngine
from specdec.drafters import NullDrafter
from specdec.drafters.block import BlockDrafterConfig, BlockDrafterNet, init_weights, label_offsets, output_slots
from specdec.drafters.dflash import DFlashDrafter, DSparkDrafter
from specdec.drafters.training import target_hidden_states
from specdec.errors import CheckpointError, ConfigError
from specdec.target import load_target

VOCAB, HIDDEN = 64, 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_target")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=160,
                                   initializer_range=0.3)  # a LM head with usable logit scale
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return load_target(path)


def cfg(shift: int, **kw) -> BlockDrafterConfig:
    base = dict(block_size=4, shift_label=shift, target_layer_ids=(0, 2), target_hidden_size=HIDDEN, vocab_size=VOCAB,
                hidden_size=HIDDEN, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64)
    return BlockDrafterConfig(**{**base, **kw})


@pytest.mark.parametrize("B", [2, 4, 8, 16])
def test_shift_label_width_and_slots(B):
    assert list(output_slots(B, 0)) == list(range(1, B)) and len(output_slots(B, 0)) == B - 1
    assert list(output_slots(B, 1)) == list(range(0, B)) and len(output_slots(B, 1)) == B
    assert label_offsets(B, 0) == list(range(1, B)) == label_offsets(B, 1)[:-1]
    assert label_offsets(B, 1) == list(range(1, B + 1))


@pytest.mark.parametrize("shift", [-1, 2, 0.5, None])
def test_shift_label_other_values_rejected(shift):
    with pytest.raises(ConfigError, match="shift_label"):
        output_slots(8, shift)


def test_config_errors_name_the_field(tiny):
    with pytest.raises(ConfigError, match="block_size"):
        cfg(0, block_size=1)
    with pytest.raises(ConfigError, match="target_layer_ids"):
        cfg(0, target_layer_ids=())
    engine_err = DFlashDrafter(init_weights(BlockDrafterNet(cfg(0, target_layer_ids=(0, 7)))))
    with pytest.raises(ConfigError, match="target_layer_ids"):
        SpecEngine(tiny, engine_err)
    with pytest.raises(ConfigError, match="target_hidden_size"):
        SpecEngine(tiny, DFlashDrafter(BlockDrafterNet(cfg(0, target_hidden_size=48))))
    with pytest.raises(ConfigError, match="vocab_size"):
        SpecEngine(tiny, DFlashDrafter(BlockDrafterNet(cfg(0, vocab_size=65, mask_token_id=0))))
    with pytest.raises(ConfigError, match="shift_label=1"):
        DSparkDrafter(BlockDrafterNet(cfg(0)))


PROMPTS = [[1, 2, 3, 4, 5, 6, 1, 2, 3, 4], [7, 8, 9], list(range(10, 40)), [5, 5]]


@pytest.mark.parametrize("cls,shift", [(DFlashDrafter, 0), (DSparkDrafter, 1)])
@pytest.mark.parametrize("tpb", [16, 128])
def test_block_drafters_are_lossless_shared_or_separate(tiny, cls, shift, tpb):
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    base = SpecEngine(tiny, NullDrafter(), tokens_per_block=tpb).generate(PROMPTS, params)
    drafter = cls(init_weights(BlockDrafterNet(cfg(shift)), seed=1))
    engine = SpecEngine(tiny, drafter, tokens_per_block=tpb, max_draft_tokens=4, draft_gate=False)
    outs = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    layout = engine.kv_layout
    if tpb == 16:  # the drafter reads 16-token pages: its layers join the target pool
        assert layout["shared"] and layout["pools"][0]["draft_layers"] == [3] and len(layout["pools"]) == 1
    else:  # it does not read 128-token pages: a pool of its own, with a page size it reads
        assert not layout["shared"] and "128" in layout["reason"]
        assert layout["pools"][1]["tokens_per_block"] in drafter.config.ctx_page_sizes


def test_context_features_written_only_for_accepted_positions(tiny):
    """The drafter's KV for position p equals what a fresh context pass over the accepted tokens gives."""
    drafter = DSparkDrafter(init_weights(BlockDrafterNet(cfg(1)), seed=2))
    engine = SpecEngine(tiny, drafter, tokens_per_block=4, max_draft_tokens=4, draft_gate=False)
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=12, ignore_eos=True))
    for _ in range(4):
        engine.step()
    seq = engine._seqs[rid]
    n = seq.num_cached
    assert rid in drafter._pending  # the last step's positions are staged, for the next propose to write
    drafter.propose([rid], 1)
    assert not drafter._pending
    hidden = target_hidden_states(tiny, seq.tokens[:n], drafter.target_layer_ids)
    with torch.inference_mode():
        k, v = drafter.net.context_kv(0, drafter.net.project_context(hidden), torch.arange(n))
    slots = engine.draft_kv.slots(rid, 0, n)
    torch.testing.assert_close(engine.draft_kv.k(0)[slots], k, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(engine.draft_kv.v(0)[slots], v, rtol=1e-4, atol=1e-5)


def test_appended_draft_layers_share_pages_and_free_together(tiny):
    drafter = DFlashDrafter(init_weights(BlockDrafterNet(cfg(0))))
    engine = SpecEngine(tiny, drafter, tokens_per_block=16, num_pages=20, draft_gate=False)
    tb, db = engine.pool.specs[0].bytes_per_token, drafter.kv_layer_specs()[0].bytes_per_token
    assert engine.pool.bytes_per_token == 3 * tb + db  # capacity counts target + draft layers
    engine.add_request(PROMPTS[2], SamplingParams(max_new_tokens=8, ignore_eos=True))
    engine.step()
    assert engine.manager.num_free_pages < 20 and engine.draft_kv.manager is engine.manager
    while engine.has_unfinished():
        engine.step()
    assert engine.manager.num_free_pages == 20


def test_public_dflash_layout_loads(tiny, tmp_path):
    """An HF directory in the public DFlash layout (dflash_config, model.-prefixed weights) loads and drafts."""
    from safetensors.torch import save_file

    net = init_weights(BlockDrafterNet(cfg(0, block_size=4, qk_norm=True, mask_token_id=5)), seed=3)
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": HIDDEN, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
        "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "block_size": 4, "num_target_layers": 3,
        "dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 5}}))
    save_file({f"model.{k}": v.contiguous() for k, v in net.state_dict().items()}, tmp_path / "model.safetensors")
    loaded = DFlashDrafter.from_pretrained(tmp_path)
    assert loaded.config.block_size == 4 and loaded.config.mask_token_id == 5 and loaded.config.qk_norm
    for k, v in net.state_dict().items():
        assert torch.equal(loaded.net.state_dict()[k], v)
    outs = SpecEngine(tiny, loaded).generate(PROMPTS[:2], SamplingParams(max_new_tokens=10, ignore_eos=True))
    base = SpecEngine(tiny).generate(PROMPTS[:2], SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], "hidden_size": 32}))
    with pytest.raises(CheckpointError, match="block_size"):
        DFlashDrafter.from_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="drafter must be one of"):
        DFlashDrafter.from_pretrained(tmp_path / "nope")


def test_forced_sharing_with_a_page_size_the_drafter_cannot_read(tiny):
    drafter = DFlashDrafter(init_weights(BlockDrafterNet(cfg(0))))
    with pytest.raises(ConfigError, match="share_draft_kv.*128"):
        SpecEngine(tiny, drafter, tokens_per_block=128, share_draft_kv=True)
    assert SpecEngine(tiny, drafter, tokens_per_block=16, share_draft_kv=True).kv_layout["shared"]
    separate = SpecEngine(tiny, drafter, tokens_per_block=16, share_draft_kv=False).kv_layout
    assert not separate["shared"] and len(separate["pools"]) == 2


def test_suffix_and_null_drafters_share_nothing(tiny):
    from specdec.drafters import SuffixAutomatonDrafter

    for d in (NullDrafter(), SuffixAutomatonDrafter()):
        layout = SpecEngine(tiny, d, share_draft_kv=True).kv_layout
        assert not layout["shared"] and "no KV layers" in layout["reason"] and len(layout["pools"]) == 1


def test_large_checkpoints_are_saved_in_shards_that_load_back(tmp_path):
    """Past shard_bytes the weights go into several files (each within the limit) with an HF index;
    a later save replaces every weights file, so shards of an older save never mix in."""
    from specdec.drafters.block import save_net

    net = init_weights(BlockDrafterNet(cfg(1, block_size=4)), seed=4)
    limit = max(v.numel() * v.element_size() for v in net.state_dict().values()) * 3
    save_net(net, tmp_path, "SpecdecBlockDrafter", shard_bytes=limit)
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(net.state_dict()) and set(index["weight_map"].values()) == {
        s.name for s in shards}
    assert all(s.stat().st_size < limit + 4096 for s in shards)  # tensor data + a small header
    loaded = BlockDrafterNet.load(tmp_path)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in net.state_dict().items())
    other = init_weights(BlockDrafterNet(cfg(1, block_size=4)), seed=5)
    other.save(tmp_path)  # one file now: the shards and the index are gone
    assert [p.name for p in tmp_path.glob("*.safetensors")] == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()
    assert all(torch.equal(BlockDrafterNet.load(tmp_path).state_dict()[k], v) for k, v in other.state_dict().items())
