"""Every bad input is a typed error (a SpecDecError naming the field) before any heavy work."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest
import torch

from specdec import EngineConfig, SamplingParams, SpecEngine
from specdec.cli import main
from specdec.errors import (CheckpointError, ConfigError, InvalidRequestError, SpecDecError, UnknownRequestError)
from specdec.target import load_target


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty SPECDEC_CACHE, to check that failed loads leave nothing behind."""
    path = tmp_path / "cache"
    path.mkdir()
    monkeypatch.setenv("SPECDEC_CACHE", str(path))
    return path


@pytest.fixture(scope="module")
def tiny_dir(tiny, tmp_path_factory):
    """The tiny checkpoint's files (config.json, model.safetensors), to corrupt copies of."""
    import transformers

    path = tmp_path_factory.mktemp("tiny_ckpt")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature="hot"), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p="high"), "top_p"),
    (dict(top_k=2.5), "top_k"),
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(seed="abc"), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(seed=-1), "seed"),
    (dict(seed=1 << 64), "seed"),
    (dict(stop=[3]), "stop"),
    (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(InvalidRequestError, match=f"{field} must be"):
        SamplingParams(**kwargs)


def test_seed_is_checked_for_greedy_requests_too():
    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams(temperature=0.0, seed="abc")
    assert SamplingParams(temperature=0.5, seed=(1 << 64) - 1).seed == (1 << 64) - 1


@pytest.mark.parametrize("prompt", [42, None, [None], [1, "2"], [1.0], [True], b"bytes", {"a": 1}])
def test_bad_prompts_for_add_request(tiny, prompt):
    engine = SpecEngine(tiny)
    with pytest.raises(InvalidRequestError, match="prompt"):
        engine.add_request(prompt)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("prompts,hint", [(42, "prompts must be"), (None, "prompts must be"),
                                          ([42], "prompt must be"), ([None], "prompt must be"),
                                          ([[1], 42], "prompt must be")])
def test_bad_prompts_for_generate(tiny, prompts, hint):
    engine = SpecEngine(tiny)
    with pytest.raises(InvalidRequestError, match=hint):
        engine.generate(prompts, max_new_tokens=2)
    assert not engine.has_unfinished()  # nothing was queued


def test_token_id_lists_of_any_integer_type_are_prompts(tiny):
    """The rule: a prompt is a string or a non-empty list of integer ids in [0, vocab); [42] is one token."""
    import numpy as np

    engine = SpecEngine(tiny)
    outs = engine.generate([[42], (42,), np.array([42]), torch.tensor([42])], max_new_tokens=3, ignore_eos=True)
    assert len({o.token_ids for o in outs}) == 1 and all(o.prompt_token_ids == (42,) for o in outs)


def test_unknown_sampling_override_in_generate(tiny):
    with pytest.raises(InvalidRequestError, match="temprature.*SamplingParams"):
        SpecEngine(tiny).generate([[1]], temprature=0.5)


def test_fields_a_config_does_not_have_are_typed_errors_naming_its_fields():
    """OpenAI-style sampling fields specdec does not take, and extra positional values, are refused
    by the configs themselves (not a bare TypeError from the dataclass)."""
    for field in ("presence_penalty", "stop_token_ids", "n", "logprobs"):
        with pytest.raises(InvalidRequestError, match=f"no field '{field}'.*max_new_tokens, temperature"):
            SamplingParams(**{field: 1})
    with pytest.raises(InvalidRequestError, match="at most 7 positional"):
        SamplingParams(8, 0.0, 0, 1.0, (), False, None, 3)
    with pytest.raises(ConfigError, match="no field 'bogus'.*max_draft_tokens"):
        EngineConfig(bogus=1)
    assert SamplingParams(16, 0.5).temperature == 0.5 and EngineConfig(max_num_seqs=3).max_num_seqs == 3
    import dataclasses
    import inspect

    for cls in (SamplingParams, EngineConfig):  # help() and inspect still show the fields
        assert list(inspect.signature(cls).parameters) == [f.name for f in dataclasses.fields(cls)]


def test_drafters_by_name_refuse_options_they_do_not_take():
    from specdec.drafters import make_drafter

    with pytest.raises(ConfigError, match="drafter 'suffix' has no option 'bogus'.*max_draft_tokens"):
        make_drafter("suffix", bogus=1)
    with pytest.raises(ConfigError, match="drafter 'null' has no option 'k'"):
        make_drafter("null", k=3)
    with pytest.raises(ConfigError, match="drafter must be one of"):
        make_drafter(["suffix"])
    assert make_drafter("suffix", max_draft_tokens=4) is not None


def test_block_drafter_switches_are_bools():
    from specdec.drafters.dflash import DFlashDrafter

    with pytest.raises(ConfigError, match="cuda_graphs must be True or False"):
        DFlashDrafter(cuda_graphs="x")
    for option in ("torch_compile", "device_drafts"):
        with pytest.raises(ConfigError, match=f"{option} must be True, False or None"):
            DFlashDrafter(**{option: 1})


@pytest.mark.parametrize("target", [None, "smollm2-135m", object()])
def test_an_engine_needs_a_loaded_target(target):
    with pytest.raises(ConfigError, match="target must be a loaded target.*lacks vocab_size") as err:
        SpecEngine(target)
    assert ("load_target('smollm2-135m')" in str(err.value)) == isinstance(target, str)


@pytest.mark.parametrize("target", [None, 42, ["smollm2-135m"]])
def test_a_target_that_is_no_name_or_path(target):
    with pytest.raises(ConfigError, match="target must be a known name"):
        load_target(target)


@pytest.mark.parametrize("chat", ["yes", 1, 0])
def test_chat_is_a_bool_or_none(tiny, chat):
    engine = SpecEngine(tiny)
    with pytest.raises(InvalidRequestError, match="chat must be True, False or None"):
        engine.generate([[1, 2]], max_new_tokens=2, chat=chat)
    with pytest.raises(InvalidRequestError, match="chat must be True, False or None"):
        engine.add_request([1, 2], chat=chat)
    with pytest.raises(InvalidRequestError, match="progress must be True or False"):
        engine.generate([[1, 2]], max_new_tokens=2, progress="yes")
    assert not engine.scheduler.waiting and not engine.scheduler.running  # nothing was queued


def test_unknown_request_id(tiny):
    engine = SpecEngine(tiny)
    with pytest.raises(UnknownRequestError, match="'unknown'"):
        engine.output("unknown")
    with pytest.raises(KeyError):  # still a KeyError for code that caught that
        engine.release("unknown")


def test_unknown_engine_option(tiny):
    with pytest.raises(ConfigError, match="bogus_option.*max_num_seqs"):
        SpecEngine(tiny, bogus_option=1)
    with pytest.raises(ConfigError, match="config must be an EngineConfig"):
        SpecEngine(tiny, config={"max_num_seqs": 2})
    with pytest.raises(ConfigError, match="max_num_seqs must be"):
        SpecEngine(tiny, max_num_seqs="8")
    with pytest.raises(ConfigError, match="kv_cache_bytes must be"):
        SpecEngine(tiny, kv_cache_bytes=0)


def test_corrupt_config_json(tiny_dir, tmp_path):
    bad = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, bad)
    (bad / "config.json").write_text('{"model_type": "llama", ')
    with pytest.raises(CheckpointError, match="config.json.*not valid JSON"):
        load_target(bad)
    (bad / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="lacks the field"):
        load_target(bad)


def test_truncated_safetensors(tiny_dir, tmp_path):
    bad = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="model.safetensors.*truncated or corrupt"):
        load_target(bad)


def test_text_file_named_gguf_fails_fast_and_leaves_the_cache_clean(tmp_path, cache):
    fake = tmp_path / "model.gguf"
    fake.write_text("this is not a model\n")
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load_target(fake)
    assert time.perf_counter() - t0 < 1.0  # no conversion was tried
    assert list(cache.iterdir()) == []


def test_bad_device_and_dtype_before_loading(tiny_dir):
    with pytest.raises(ConfigError, match="device must be"):
        load_target(tiny_dir, device="tpu")
    with pytest.raises(ConfigError, match="dtype must be"):
        load_target(tiny_dir, dtype=torch.int8)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="needs CUDA"):
            load_target("/no/such/model", device="cuda")  # the device is checked first


def _cli(argv, capsys) -> tuple[int, str]:
    rc = main(argv)
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["bench", "--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
    (["generate", "x", "--max-new-tokens", "0"], "--max-new-tokens must be"),
    (["generate", "x", "--drafter", "nope"], "--drafter must be one of"),
    (["generate", "x", "--temperature", "-1"], "temperature must be"),
    (["generate", "x", "--device", "tpu"], "device must be"),
    (["generate", "x", "--target", "/no/such/model"], "UnknownTargetError"),
    (["serve", "--drafter", "null", "--global-budget-tokens", "100"], "it needs --drafter suffix, got 'null'"),
    (["serve", "--global-budget-tokens", "0"], "--global-budget-tokens must be an integer >= 1 or 'none'"),
    (["serve", "--global-budget-tokens", "lots"], "--global-budget-tokens must be an integer >= 1 or 'none'"),
    (["serve", "--global-budget-tokens", "\u00b2"], "--global-budget-tokens must be an integer >= 1 or 'none'"),
])
def test_cli_reports_bad_flags_before_loading_the_model(argv, message, capsys):
    # --target points nowhere unless the case is about it: any load would fail differently
    argv = argv + ([] if "--target" in argv else ["--target", "/no/such/model"])
    t0 = time.perf_counter()
    rc, err = _cli(argv, capsys)
    assert rc == 2 and message in err and "Traceback" not in err
    assert time.perf_counter() - t0 < 5.0


def test_cli_device_cuda_without_cuda(capsys):
    if torch.cuda.is_available():
        rc, err = _cli(["generate", "x", "--device", "cuda:4096", "--target", "/no/such/model"], capsys)
        assert rc == 2 and "device index must be" in err
    else:
        rc, err = _cli(["generate", "x", "--device", "cuda", "--target", "/no/such/model"], capsys)
        assert rc == 2 and "needs CUDA" in err


def test_cli_corrupt_checkpoint_is_one_line(tiny_dir, tmp_path, capsys):
    bad = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, bad)
    (bad / "config.json").write_text("{")
    rc, err = _cli(["generate", "x", "--target", str(bad), "--quiet"], capsys)
    assert rc == 2 and "CheckpointError" in err and "Traceback" not in err


def test_cli_help_shows_defaults_without_importing_torch():
    code = ("import sys\nfrom specdec.cli import main\ntry:\n    main(['bench', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--batch-size BATCH_SIZE" in done.stdout and "(default: 1)" in done.stdout
    assert "smollm2-135m)" in done.stdout  # the --target default (the line may wrap before it)
    assert done.stdout.strip().endswith("False False")


def test_every_error_is_a_specdec_error():
    from specdec import errors

    for name in dir(errors):
        obj = getattr(errors, name)
        if isinstance(obj, type) and issubclass(obj, Exception) and obj.__module__ == errors.__name__:
            assert issubclass(obj, SpecDecError), name


def test_progress_bar_completes_when_requests_end_on_eos(tiny, capsys):
    import re

    prompts = [[8], [7, 8, 9], [5]]  # [8] ends on end-of-sequence after 3 tokens
    outs = SpecEngine(tiny).generate(prompts, max_new_tokens=40, progress=True)
    assert any(o.finish_reason == "eos" for o in outs)  # else this test shows nothing
    done, total = map(int, re.findall(r"(\d+)/(\d+)", capsys.readouterr().err)[-1])
    assert done == total == sum(len(o.token_ids) for o in outs)


def test_printed_stats_show_tokens_per_second(tiny):
    out = SpecEngine(tiny).generate([[1, 2, 3]], max_new_tokens=5, ignore_eos=True)[0]
    assert "5 tokens" in str(out.stats) and "tokens/s" in str(out.stats) and "mean accepted length" in str(out.stats)


@pytest.mark.parametrize("text,want", [("100-103", [100, 101, 102, 103]), ("0:3", [0, 1, 2]), ("5", [5]),
                                       ("0-1,10-11,20", [0, 1, 10, 11, 20])])
def test_problem_ranges(text, want):
    from specdec.prompts import parse_range

    assert parse_range(text) == want


@pytest.mark.parametrize("text", ["", "a-b", "1-2-3", "0-3,", "1;2", "5-3"])
def test_bad_problem_ranges_are_config_errors(text):
    from specdec.prompts import parse_range

    with pytest.raises(ConfigError, match="problem range"):
        parse_range(text)


def test_cli_global_budget_tokens_reaches_the_suffix_drafter():
    """``specdec serve --global-budget-tokens``: a count, ``none`` (unbounded), or the drafter's default."""
    import argparse

    from specdec.cli import _drafter_kwargs
    from specdec.drafters import make_drafter

    for flag, want in (("1024", 1024), ("none", None), ("NONE", None)):
        kwargs = _drafter_kwargs(argparse.Namespace(drafter="suffix", global_budget_tokens=flag))
        assert kwargs == {"global_budget_tokens": want}
        assert make_drafter("suffix", **kwargs).global_budget_tokens == want
    assert _drafter_kwargs(argparse.Namespace(drafter="null", global_budget_tokens=None)) == {}
