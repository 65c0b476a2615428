"""Strict lossless: same engine, null drafter vs suffix drafter, token-for-token equal (fp32 greedy).

The real SmolLM2-135M on the CPU, >= 20 prompts, batch sizes 1, 4 and 8 with
mixed prompt lengths in one batch.
"""

from __future__ import annotations

import pytest

from specdec import SamplingParams, SpecEngine
from specdec.drafters import DFlashDrafter, DSparkDrafter, HybridDrafter, NullDrafter, SuffixAutomatonDrafter
from specdec.prompts import humaneval_prompts

from helpers import needs_cxx

pytestmark = pytest.mark.slow

NEW_TOKENS = 32


def _prompts() -> list[str]:
    code = humaneval_prompts(range(0, 14))
    prose = [
        "Write a Python function that reverses a linked list.",
        "List the first ten prime numbers, one per line, then repeat the list.",
        "Explain what a hash map is in two sentences.",
        "Repeat after me exactly: the quick brown fox jumps over the lazy dog. the quick brown fox",
        "def fib(n):",
        "Write a haiku about caches.",
    ]
    return code + prose  # 20 prompts, lengths from ~10 to ~300 tokens


def _run(target, drafter, prompts, batch_size):
    engine = SpecEngine(target, drafter, max_draft_tokens=6, tokens_per_block=16, draft_gate=False)
    outs = []
    for i in range(0, len(prompts), batch_size):
        outs += engine.generate(prompts[i:i + batch_size], SamplingParams(max_new_tokens=NEW_TOKENS))
    return outs


@pytest.fixture(scope="module")
def baseline(smollm2):
    return _run(smollm2, NullDrafter(), _prompts(), batch_size=1)


@pytest.mark.parametrize("batch_size", [1, 4, 8])
def test_suffix_drafter_is_lossless(smollm2, baseline, batch_size):
    prompts = _prompts()
    assert len(prompts) >= 20
    outs = _run(smollm2, SuffixAutomatonDrafter(max_draft_tokens=6), prompts, batch_size)
    for i, (base, spec) in enumerate(zip(baseline, outs)):
        assert spec.token_ids == base.token_ids, f"prompt {i} diverged at batch size {batch_size}"
        assert spec.finish_reason == base.finish_reason
    # the drafter must have actually speculated, or the test proves nothing
    assert sum(o.stats.accepted for o in outs) > 0.1 * sum(len(o.token_ids) for o in outs)
    assert sum(o.stats.target_steps for o in outs) < sum(o.stats.target_steps for o in baseline)


def test_null_drafter_batched_equals_unbatched(smollm2, baseline):
    outs = _run(smollm2, NullDrafter(), _prompts(), batch_size=8)
    assert [o.token_ids for o in outs] == [o.token_ids for o in baseline]


def test_matches_transformers_greedy(smollm2, baseline):
    """The baseline itself is the target's greedy output, as transformers computes it."""
    import torch
    import transformers

    from specdec.target.loading import cache_dir

    ref = transformers.AutoModelForCausalLM.from_pretrained(cache_dir() / "smollm2-135m", dtype=torch.float32).eval()
    for out in baseline[:3] + baseline[-3:]:
        ids = torch.tensor([list(out.prompt_token_ids)])
        with torch.no_grad():
            want = ref.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=smollm2.eos_token_ids[0],
                                pad_token_id=smollm2.eos_token_ids[0])[0, ids.shape[1]:].tolist()
        assert list(out.token_ids) == want


@pytest.mark.parametrize("drafter_cls,draft_length", [(DFlashDrafter, "fixed"), (DSparkDrafter, "confidence")])
@pytest.mark.parametrize("batch_size,compiled", [(1, False), (4, False), (8, False), (4, True)])
def test_shipped_block_drafters_are_lossless(smollm2, baseline, drafter_cls, draft_length, batch_size, compiled,
                                             tmp_path):
    """The shipped SmolLM2 DFlash / DSpark checkpoints, sharing the target's KV pool; DSpark with its
    drafts cut by confidence (a cost profile where each verified row costs a tenth of a step); at
    batch 4 also with the propose compiled (``torch_compile=True``)."""
    from specdec.draft_length import CostProfile

    if compiled and needs_cxx.args[0]:
        pytest.skip(needs_cxx.kwargs["reason"])
    CostProfile({(1, 1): 1.0, (1, 17): 2.6, (8, 8): 1.0, (8, 136): 13.8}, {}).save(tmp_path / "cost.json")
    prompts = _prompts()
    drafter = drafter_cls(torch_compile=compiled)  # the shipped checkpoint for smollm2-135m
    engine = SpecEngine(smollm2, drafter, max_draft_tokens=7, tokens_per_block=16, draft_length=draft_length, draft_gate=False,
                        cost_profile=str(tmp_path / "cost.json"))
    assert engine.kv_layout["shared"]
    outs = []
    for i in range(0, len(prompts), batch_size):
        outs += engine.generate(prompts[i:i + batch_size], SamplingParams(max_new_tokens=NEW_TOKENS))
    for i, (base, spec) in enumerate(zip(baseline, outs)):
        assert spec.token_ids == base.token_ids, f"prompt {i} diverged ({drafter_cls.__name__}, batch {batch_size})"
    assert sum(o.stats.accepted for o in outs) > 0
    # compiled: it stayed compiled (a failed compile, or torch's recompile limit, would turn it off)
    assert drafter.torch_compile == compiled and drafter.stats["compile_errors"] == 0
    assert (drafter.stats["compile_s"] > 0) == compiled
    if draft_length == "confidence":
        s = engine.draft_length_stats
        assert 0 < s["kept"] < s["drafted"]  # the rule cut some drafts


@pytest.mark.parametrize("system,batch_size", [("dflash", 1), ("dflash", 8), ("dspark", 4), ("hybrid-dflash", 4)])
def test_shipped_block_drafters_with_drafts_on_the_device_are_lossless(smollm2, baseline, system, batch_size):
    """The shipped checkpoints with ``device_drafts=True`` (their drafts fed to the target's step
    on the device): token for token null's, over the 20 prompts."""
    learned = (DSparkDrafter if system == "dspark" else DFlashDrafter)(device_drafts=True)
    drafter = HybridDrafter(learned, cost_aware=False) if system.startswith("hybrid") else learned
    engine = SpecEngine(smollm2, drafter, max_draft_tokens=7, tokens_per_block=16, draft_gate=False)
    prompts = _prompts()
    outs = []
    for i in range(0, len(prompts), batch_size):
        outs += engine.generate(prompts[i:i + batch_size], SamplingParams(max_new_tokens=NEW_TOKENS))
    for i, (base, spec) in enumerate(zip(baseline, outs)):
        assert spec.token_ids == base.token_ids, f"prompt {i} diverged ({system}, batch {batch_size})"
    assert sum(o.stats.accepted for o in outs) > 0


def test_stop_strings_end_generation_identically(smollm2):
    prompts = ["List three fruits, one per line.", "Write a Python function that adds two numbers."]
    params = SamplingParams(max_new_tokens=40, stop=("\n\n", "banana"))
    base = SpecEngine(smollm2, NullDrafter()).generate(prompts, params)
    spec = SpecEngine(smollm2, SuffixAutomatonDrafter()).generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in base]
    assert [o.text for o in spec] == [o.text for o in base]
    stopped = [o for o in base if o.finish_reason == "stop"]
    assert stopped, "no prompt hit a stop string: the test would prove nothing"
    for o in stopped:
        assert "\n\n" not in o.text and "banana" not in o.text
        full = smollm2.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        assert any(s in full for s in params.stop)  # the stop string was generated, then cut from .text


def test_raw_text_prompt_skips_the_chat_template(smollm2):
    engine = SpecEngine(smollm2, SuffixAutomatonDrafter())
    raw = engine.generate(["def fib(n):"], SamplingParams(max_new_tokens=4), chat=False)[0]
    chat = engine.generate(["def fib(n):"], SamplingParams(max_new_tokens=4))[0]
    assert raw.prompt_token_ids == tuple(smollm2.tokenizer("def fib(n):")["input_ids"])
    assert len(chat.prompt_token_ids) > len(raw.prompt_token_ids)


@pytest.mark.parametrize("system,chunk", [("suffix", 48), ("dflash", 37)])
def test_chunked_prefill_is_lossless(smollm2, baseline, system, chunk):
    """Prompts fed in chunks of ``chunk`` tokens (``max_prefill_tokens``), batch 4: the outputs of
    whole prompts with the null drafter; DFlash reads its context from the chunks' hidden states."""
    prompts = _prompts()
    drafter = SuffixAutomatonDrafter(max_draft_tokens=6) if system == "suffix" else DFlashDrafter()
    engine = SpecEngine(smollm2, drafter, max_draft_tokens=6, tokens_per_block=16, max_prefill_tokens=chunk,
                        draft_gate=False)
    outs = []
    for i in range(0, len(prompts), 4):
        outs += engine.generate(prompts[i:i + 4], SamplingParams(max_new_tokens=NEW_TOKENS))
    assert [o.token_ids for o in outs] == [o.token_ids for o in baseline]
    assert sum(o.stats.accepted for o in outs) > 0
    assert max(len(o.prompt_token_ids) for o in outs) > 2 * chunk  # prompts that took several chunks
