"""Our paged Llama-family target against transformers' own models on the same weights (fp32)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from specdec.config import KernelConfig
from specdec.errors import CheckpointError, ConfigError, UnknownTargetError
from specdec.target import load_target

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)


def write_checkpoint(path, model_type: str, **extra):
    """A real HF checkpoint directory (config.json + safetensors) with random weights."""
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
           "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[model_type]
    torch.manual_seed(0)
    cfg = cls[0](**{**TINY, **extra})
    model = cls[1](cfg).eval()
    with torch.no_grad():  # make norms non-trivial so a wrong norm is caught
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            if n.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(path)
    return model


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("model_type,extra", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    ("qwen2", {}),
    ("qwen3", {"head_dim": 32}),
    ("mistral", {"sliding_window": None}),
])
def test_logits_match_transformers_context_decode_verify(tmp_path, paged_runner, model_type, extra):
    ref_model = write_checkpoint(tmp_path, model_type, **extra)
    target = load_target(tmp_path)
    g = torch.Generator().manual_seed(1)
    seqs = {f"r{i}": torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist() for i, n in enumerate((13, 5, 22))}
    runner = paged_runner(target, num_pages=64, tokens_per_block=4)
    # context (all three prompts in one batch), then decode, then a 4-token verify and a mixed step
    cuts = {"r0": [0, 9, 10, 13], "r1": [0, 3, 4, 5], "r2": [0, 17, 18, 22]}
    for s in range(3):
        chunks = {r: seqs[r][cuts[r][s]:cuts[r][s + 1]] for r in seqs}
        ctx = {"r0", "r1", "r2"} if s == 0 else ({"r1"} if s == 2 else set())
        got = runner.step(chunks, context=ctx)
        for r, logits in got.items():
            want = reference_logits(ref_model, seqs[r][:cuts[r][s + 1]])[cuts[r][s]:]
            torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)


def test_hidden_states_of_chosen_layers(tmp_path, paged_runner):
    ref_model = write_checkpoint(tmp_path, "llama")
    target = load_target(tmp_path)
    ids = list(range(1, 12))
    runner = paged_runner(target)
    from specdec.attention.metadata import plan_step

    runner.manager.allocate("a", len(ids))
    attn = plan_step([(len(ids), len(ids), tuple(runner.manager.page_table("a")))], [],
                     torch.tensor(runner.manager.slots("a", 0, len(ids))),
                     lambda p, q, m: target.attn_shape(p, q, 4, m), 4)
    _, hidden = target.forward(torch.tensor(ids), torch.arange(len(ids)), attn, runner.pool, hidden_layer_ids=(0, 1))
    with torch.no_grad():
        want = ref_model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(hidden[0], want[1][0], rtol=1e-4, atol=1e-4)
    assert set(hidden) == {0, 1}


def test_loader_errors(tmp_path):
    with pytest.raises(UnknownTargetError, match="target must be one of"):
        load_target("no-such-model")
    with pytest.raises(CheckpointError, match="config.json"):
        load_target(tmp_path)
    write_checkpoint(tmp_path, "llama")
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CheckpointError, match="safetensors"):
        load_target(tmp_path)
    (tmp_path / "x.bin").write_text("")
    with pytest.raises(CheckpointError, match=".gguf"):
        load_target(tmp_path / "x.bin")


def test_loader_rejects_missing_weight_and_bad_model_type(tmp_path):
    from safetensors.torch import load_file, save_file

    write_checkpoint(tmp_path, "llama")
    f = next(tmp_path.glob("*.safetensors"))
    w = load_file(f)
    del w["model.layers.1.mlp.up_proj.weight"]
    save_file(w, f)
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.up_proj.weight"):
        load_target(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type"):
        load_target(tmp_path)


def test_kernels_are_fixed_when_the_target_is_built(tmp_path):
    """A target's kernels come from the ``KernelConfig`` it is built with; ``target.kernels`` holds the
    resolved choice, and assigning an older attribute name is an error that points at the config."""
    write_checkpoint(tmp_path, "llama")
    target = load_target(tmp_path)
    assert target.kernels == KernelConfig(fused=False, fused_gemm=True, fused_gemm_max_tokens=512, pdl=0)  # a CPU
    assert (target.fused, target.fused_gemm, target.fused_gemm_max_tokens, target.pdl) == (False, True, 512, 0)
    for name, value in (("fused", True), ("fused_gemm", False), ("fused_gemm_max_tokens", 64), ("pdl", 0)):
        with pytest.raises(AttributeError, match=rf"LlamaTarget\.{name} is read-only.*"
                                                 rf"kernels=KernelConfig\({name}={value}\).*load_target"):
            setattr(target, name, value)
    with pytest.raises(AttributeError):
        target.kernels = KernelConfig(fused=True)
    with pytest.raises(AttributeError):
        target.kernels.fused = True  # frozen
    assert target.kernels.fused is False
    chosen = KernelConfig(fused=False, fused_gemm=False, fused_gemm_max_tokens=16, pdl=0)
    assert load_target(tmp_path, kernels=chosen).kernels == chosen


@pytest.mark.parametrize(("kw", "field"), [
    (dict(fused="yes"), "fused"), (dict(fused=1), "fused"), (dict(fused_gemm=None), "fused_gemm"),
    (dict(fused_gemm_max_tokens=0), "fused_gemm_max_tokens"), (dict(fused_gemm_max_tokens=True), "fused_gemm_max_tokens"),
    (dict(fused_gemm_max_tokens=64.0), "fused_gemm_max_tokens"), (dict(pdl=3), "pdl"), (dict(pdl=True), "pdl"),
])
def test_kernel_config_names_the_bad_field(kw, field):
    with pytest.raises(ConfigError, match=rf"KernelConfig\.{field} must be"):
        KernelConfig(**kw)


def test_kernels_this_machine_cannot_run_are_refused_before_the_weights_are_read(tmp_path):
    write_checkpoint(tmp_path, "llama")
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()  # reading the weights would fail with a CheckpointError
    with pytest.raises(ConfigError, match="kernels must be a KernelConfig"):
        load_target(tmp_path, kernels={"fused": False})
    with pytest.raises(ConfigError, match=r"KernelConfig.pdl=2 applies to the fused GEMMs.*fused=False"):
        load_target(tmp_path, kernels=KernelConfig(pdl=2))  # a CPU: no fused kernels by default
    if not os.environ.get("TRITON_INTERPRET"):  # outside the interpreter Triton's kernels cannot run on a CPU
        with pytest.raises(ConfigError, match=r"KernelConfig.fused=True"):
            load_target(tmp_path, kernels=KernelConfig(fused=True))


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2, paged_runner):
    """The real model: our paged forward vs transformers on the converted safetensors."""
    from specdec.target.loading import cache_dir

    ref = transformers.AutoModelForCausalLM.from_pretrained(cache_dir() / "smollm2-135m", dtype=torch.float32).eval()
    ids = smollm2.tokenizer("def reverse(head):\n    prev = None\n")["input_ids"]
    runner = paged_runner(smollm2, num_pages=16, tokens_per_block=16)
    n = len(ids)
    got = [runner.step({"a": ids[: n - 5]}, context={"a"}), runner.step({"a": ids[n - 5: n - 4]}),
           runner.step({"a": ids[n - 4:]})]
    want = reference_logits(ref, ids)
    torch.testing.assert_close(torch.cat([g["a"] for g in got]), want, rtol=1e-3, atol=1e-3)
    assert smollm2.vocab_size == 49152 and smollm2.num_layers == 30
