"""Our absorbed-MLA target against transformers' DeepseekV3ForCausalLM on the same weights (fp32)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers
from transformers.initialization import no_init_weights

from specdec.errors import CheckpointError, ConfigError
from specdec.target import load_target
from specdec.target.mla import MLAConfig, MLATarget, random_weights

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=2, max_position_embeddings=64,
            rms_norm_eps=1e-5, tie_word_embeddings=False)
MOE = dict(first_k_dense_replace=1, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=3,
           n_shared_experts=1, routed_scaling_factor=2.5)
YARN = dict(type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32, beta_slow=1)


def write_checkpoint(path, **extra) -> transformers.DeepseekV3ForCausalLM:
    """A real DeepSeek-V3 HF checkpoint directory with random weights (norms, biases, router made non-trivial)."""
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(**copy.deepcopy({**TINY, **extra}))  # it fills rope dicts in place
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("bias") or "gate.weight" in n:
                p.normal_(0, 0.5)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.5)
    model.save_pretrained(path)
    return model


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("extra", [
    {},
    {"rope_scaling": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.8}, "tie_word_embeddings": True},
    {"rope_scaling": YARN, "q_lora_rank": None, "attention_bias": True, "rope_interleave": False},
    MOE,
], ids=["dense", "yarn-mscale-tied", "yarn-qproj-bias-noninterleaved", "moe"])
def test_logits_match_transformers_context_decode_verify_mixed(tmp_path, paged_runner, extra):
    ref_model = write_checkpoint(tmp_path, **extra)
    target = load_target(tmp_path)
    assert isinstance(target, MLATarget)
    g = torch.Generator().manual_seed(1)
    seqs = {f"r{i}": torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for i, n in enumerate((13, 5, 22))}
    runner = paged_runner(target, num_pages=32, tokens_per_block=4)
    # context (all three prompts in one batch), then decode, then a 4-token verify mixed with a context chunk
    cuts = {"r0": [0, 9, 10, 13], "r1": [0, 3, 4, 5], "r2": [0, 17, 18, 22]}
    for s in range(3):
        chunks = {r: seqs[r][cuts[r][s]:cuts[r][s + 1]] for r in seqs}
        ctx = {"r0", "r1", "r2"} if s == 0 else ({"r1"} if s == 2 else set())
        got = runner.step(chunks, context=ctx)
        for r, logits in got.items():
            want = reference_logits(ref_model, seqs[r][:cuts[r][s + 1]])[cuts[r][s]:]
            torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


def test_hidden_states_of_chosen_layers_and_layout(tmp_path, paged_runner):
    ref_model = write_checkpoint(tmp_path, **MOE)
    target = load_target(tmp_path)
    specs = target.layer_specs()
    assert len(specs) == 2 and all(s.kind == "mla" and s.num_kv_heads == 1 and s.head_dim == 40 and not s.has_v
                                   for s in specs)
    runner = paged_runner(target)
    assert runner.pool.v[0] is None and runner.pool.k[0].shape[1:] == (1, 40)
    ids = list(range(1, 12))
    from specdec.attention.metadata import plan_step

    runner.manager.allocate("a", len(ids))
    attn = plan_step([(len(ids), len(ids), tuple(runner.manager.page_table("a")))], [],
                     torch.tensor(runner.manager.slots("a", 0, len(ids))),
                     lambda p, q, m: target.attn_shape(p, q, 4, m), 4)
    with torch.no_grad():
        _, hidden = target.forward(torch.tensor(ids), torch.arange(len(ids)), attn, runner.pool, hidden_layer_ids=(0, 1))
        want = ref_model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(hidden[0], want[1][0], rtol=1e-4, atol=1e-4)
    assert set(hidden) == {0, 1}


def test_fused_expert_weights_load_the_same(tmp_path, paged_runner):
    from safetensors.torch import load_file

    write_checkpoint(tmp_path, **MOE)
    w = load_file(next(tmp_path.glob("*.safetensors")))
    m = "model.layers.1.mlp."
    fused = {k: t for k, t in w.items() if ".experts." not in k}
    fused[m + "experts.gate_up_proj"] = torch.stack(
        [torch.cat([w[f"{m}experts.{e}.gate_proj.weight"], w[f"{m}experts.{e}.up_proj.weight"]]) for e in range(8)])
    fused[m + "experts.down_proj"] = torch.stack([w[f"{m}experts.{e}.down_proj.weight"] for e in range(8)])
    config = MLAConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
    ids = list(range(5, 18))
    got = [paged_runner(t).step({"a": ids}, context={"a"})["a"] for t in (load_target(tmp_path), MLATarget(config, fused))]
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=1e-6)


def test_bf16_runs_close_to_fp32(tmp_path, paged_runner):
    write_checkpoint(tmp_path, **MOE, rope_scaling={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0})
    ids = list(range(3, 20))
    logits = {}
    for dt in (torch.float32, torch.bfloat16):
        runner = paged_runner(load_target(tmp_path, dtype=dt))
        logits[dt] = torch.cat([runner.step({"a": ids[:12]}, context={"a"})["a"], runner.step({"a": ids[12:]})["a"]])
    assert logits[torch.bfloat16].dtype == torch.float32
    torch.testing.assert_close(logits[torch.bfloat16], logits[torch.float32], rtol=0.05, atol=0.05)


def test_random_h96_real_mla_dims_verify_matches_transformers(paged_runner):
    """H = 96 at DeepSeek dims (latent 512, rope 64, nope 128, v 128, q_lora 1536): engine path vs non-absorbed HF."""
    target = MLATarget.random(num_heads=96, num_layers=1, hidden_size=128, vocab_size=128, seed=0)
    shape = target.attn_shape("generation", 4, 16)
    assert (shape.kind, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.v_head_dim) == ("mla", 96, 1, 576, 512)
    assert target.layer_specs()[0].bytes_per_token == 576 * 4
    c = target.config
    hf_cfg = transformers.DeepseekV3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=1, num_attention_heads=96, num_key_value_heads=96, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=1,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps)
    with no_init_weights():  # the weights come from random_weights; skip transformers' slow init
        ref = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    missing, unexpected = ref.load_state_dict(random_weights(c, seed=0), strict=False)
    assert not missing and not unexpected
    g = torch.Generator().manual_seed(2)
    seqs = {r: torch.randint(0, 128, (n,), generator=g).tolist() for r, n in (("a", 21), ("b", 9))}
    runner = paged_runner(target, num_pages=16, tokens_per_block=16)
    runner.step({r: s[:-4] for r, s in seqs.items()}, context=set(seqs))
    got = runner.step({r: s[-4:] for r, s in seqs.items()})  # a 4-token verify for both requests
    for r, s in seqs.items():
        torch.testing.assert_close(got[r], reference_logits(ref, s)[-4:], rtol=1e-4, atol=1e-4)


def _hf_config(**over) -> dict:
    cfg = transformers.DeepseekV3Config(**TINY).to_dict()
    cfg.update(copy.deepcopy(over))
    return cfg


@pytest.mark.parametrize("over,field", [
    ({"model_type": "deepseek_v2"}, "model_type"),
    ({"kv_lora_rank": None}, "kv_lora_rank"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
    ({**MOE, "n_group": 3}, "n_group"),
    ({**MOE, "topk_group": 4}, "topk_group"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
])
def test_config_errors_name_the_field(over, field):
    with pytest.raises(ConfigError, match=field):
        MLAConfig.from_hf(_hf_config(**over))


def test_direct_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="num_attention_heads"):
        MLATarget.random(num_heads=0, num_layers=1, hidden_size=32, vocab_size=32)
    with pytest.raises(ConfigError, match="rope_scaling.factor"):
        MLAConfig(32, 32, 64, 1, 2, rope_scaling={"rope_type": "yarn"})
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        MLAConfig(32, 32, 64, 1, 2, n_routed_experts=8, n_group=4, topk_group=1, num_experts_per_tok=3)


def test_kimi_k2_legacy_rope_scaling_fields():
    cfg = _hf_config(model_type="kimi_k2", rope_theta=50000.0, rope_scaling={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0})
    del cfg["rope_parameters"]
    c = MLAConfig.from_hf(cfg)
    assert c.rope_theta == 50000.0 and c.rope_scaling["factor"] == 4.0
    assert c.model_type == "kimi_k2" and not any(c.moe_layers)


def test_missing_weight_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    write_checkpoint(tmp_path, **MOE)
    f = next(tmp_path.glob("*.safetensors"))
    w = load_file(f)
    del w["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(w, f)
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.experts.5.up_proj.weight"):
        load_target(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3"


def test_kernels_are_refused_for_an_mla_checkpoint(tmp_path):
    """MLA targets run PyTorch only: a KernelConfig for one is an error, not ignored."""
    from specdec.config import KernelConfig

    write_checkpoint(tmp_path)
    with pytest.raises(ConfigError, match="kernels applies to Llama-family targets.*deepseek_v3"):
        load_target(tmp_path, kernels=KernelConfig(fused=False))
    assert isinstance(load_target(tmp_path), MLATarget)
