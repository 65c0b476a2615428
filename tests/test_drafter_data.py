"""The training-data build (``specdec.drafters.data.build``) on the real SmolLM2: a build stopped by
its time budget, by Ctrl-C or by a crash keeps what it finished, and the same call resumes it to the
sequences an uninterrupted build gives."""

from __future__ import annotations

import itertools
import re
import shutil

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import specdec.drafters.data as data_mod
from specdec import SpecEngine
from specdec.drafters.data import JOBS_FILE, TokenData, build, math_prompts
from specdec.errors import ConfigError

SMALL = dict(num_magpie=1, num_code=3, num_humaneval=2, num_grounded=0, num_math=2, sampled_fraction=0.5, max_new_tokens=10,
             magpie_tokens=24, batch_size=3, kv_cache_bytes=64 << 20, progress=False)


def rows(d: TokenData) -> list:
    return [(d.sequence(i).tolist(), int(d.prompt_lens[i]), int(d.source[i]), float(d.temperature[i]))
            for i in range(len(d))]


@pytest.fixture(scope="module")
def whole(smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    return out, build(smollm2, out, **SMALL)


def test_an_uninterrupted_build_is_complete_and_reads_back(whole):
    out, data = whole
    meta = data.meta
    assert meta["complete"] and meta["jobs_done"] == [[0, meta["jobs_total"]]] and len(data) == meta["jobs_total"]
    assert meta["num_code"] == 3 and meta["num_humaneval"] == 2 and meta["num_math"] == 2 and meta["num_magpie"] <= 1
    assert set(data.source.tolist()) >= {1, 2, 4}
    greedy = sum(meta[f"num_{s}"] for s in data_mod.SOURCES)
    assert (data.temperature == 0).sum() == greedy and len(data) > greedy  # sampled responses too
    assert set(data.temperature.tolist()) <= set(np.float32([0.0, 0.7, 0.8, 0.9, 1.0]).tolist())
    assert all(len(s) > p for s, p, _, _ in rows(data))  # every response has tokens
    assert rows(TokenData.load(out)) == rows(data) and (out / JOBS_FILE).exists()
    assert not list(out.glob("*.tmp"))


def same_prompts(whole, folder):
    """Start ``folder`` with the whole build's jobs file: a build there makes no prompts (faster)."""
    shutil.copy(whole[0] / JOBS_FILE, folder / JOBS_FILE)


def test_a_build_cut_by_its_time_budget_resumes_to_the_uninterrupted_one(smollm2, whole, tmp_path, monkeypatch):
    same_prompts(whole, tmp_path)
    clock = itertools.count()  # each reading of the clock is one second later
    monkeypatch.setattr(data_mod, "_now", lambda: float(next(clock)))
    cut = build(smollm2, tmp_path, max_seconds=40, save_every=None, **SMALL)
    total = whole[1].meta["jobs_total"]
    assert 0 < len(cut) < total and not cut.meta["complete"]
    assert rows(TokenData.load(tmp_path)) == rows(cut)
    done = [i for a, b in cut.meta["jobs_done"] for i in range(a, b)]
    assert rows(cut) == [rows(whole[1])[i] for i in done]  # what it kept is what the whole build has there
    monkeypatch.setattr(data_mod, "_now", lambda: float(next(clock)))
    back = build(smollm2, tmp_path, **SMALL)
    assert back.meta["complete"] and back.meta["calls"] == 2 and rows(back) == rows(whole[1])


@pytest.mark.parametrize("stop", [KeyboardInterrupt, RuntimeError])
def test_a_stopped_build_keeps_what_it_saved_and_resumes(smollm2, whole, tmp_path, monkeypatch, stop):
    """Ctrl-C (or SIGTERM under the command) saves what is finished; a crash keeps the last periodic save."""
    same_prompts(whole, tmp_path)
    clock, steps, real_step = itertools.count(), itertools.count(1), SpecEngine.step

    def step(self):
        if (tmp_path / JOBS_FILE).exists() and next(steps) == 25:  # the 25th step of the responses
            raise stop("stopped")
        return real_step(self)

    monkeypatch.setattr(data_mod, "_now", lambda: float(next(clock)))
    monkeypatch.setattr(SpecEngine, "step", step)
    with pytest.raises(stop):
        build(smollm2, tmp_path, save_every=8, **SMALL)
    kept = TokenData.load(tmp_path)
    assert 0 < len(kept) < whole[1].meta["jobs_total"] and not kept.meta["complete"]
    monkeypatch.setattr(SpecEngine, "step", real_step)
    back = build(smollm2, tmp_path, **SMALL)
    assert back.meta["complete"] and rows(back) == rows(whole[1])


def test_a_build_refuses_a_folder_it_cannot_resume(smollm2, whole, tmp_path):
    out, data = whole
    with pytest.raises(ConfigError, match="other settings .*max_new_tokens"):
        build(smollm2, out, **{**SMALL, "max_new_tokens": 11})
    data.save(tmp_path)  # data, but no jobs file
    with pytest.raises(ConfigError, match="cannot resume"):
        build(smollm2, tmp_path, **SMALL)
    with pytest.raises(ConfigError, match="evaluation"):
        build(smollm2, tmp_path / "new", **{**SMALL, "num_humaneval": 101})


@pytest.mark.parametrize("bad", [["--num-humaneval", "101"], ["--max-seconds", "0"], ["--save-every", "-1"]])
def test_the_command_checks_its_budget_flags(tmp_path, bad):
    with pytest.raises(SystemExit):
        data_mod.main(["--out", str(tmp_path), "--device", "cpu", *bad])


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10 ** 6))
def test_math_prompts_are_seeded_distinct_and_have_whole_answers(seed):
    got = math_prompts(300, seed=seed)
    assert got == math_prompts(300, seed=seed) and len(got) == 300 and len(set(got)) == 300
    assert got != math_prompts(300, seed=seed + 1)
    kinds = {re.sub(r"[\d$,.:%-]+|\b(" + "|".join(data_mod._NAMES) + ")\b", "", p)[:25] for p in got}
    assert len(kinds) >= 20  # most of the 24 kinds in 300 problems
    for p in got:
        if m := re.match(r"Solve for x: (\d+)x \+ (\d+) = (-?\d+)\.", p):
            a, c, v = map(int, m.groups())
            assert (v - c) % a == 0
        if m := re.search(r"test scores are ([\d, ]+)\. What", p):
            scores = [int(x) for x in m.group(1).split(", ")]
            assert sum(scores) % len(scores) == 0 and all(0 < x <= 100 for x in scores)
        if m := re.match(r"If (\d+) workers can build a wall in (\d+) days, how many days would (\d+)", p):
            n, d, k = map(int, m.groups())
            assert (n * d) % k == 0 and k != n
        if m := re.search(r"pays with a \$(\d+) bill", p):
            price, n = map(int, re.search(r"for \$(\d+) each\. \w+ buys (\d+)", p).groups())
            assert int(m.group(1)) >= price * n


def test_a_save_cut_off_before_its_manifest_leaves_the_last_save(tmp_path, monkeypatch):
    monkeypatch.setattr(data_mod, "SHARD_TOKENS", 40)
    one = TokenData.from_lists([[1, 2, 3] * 5] * 4, [2] * 4, [0] * 4, [0.0] * 4)
    two = TokenData.from_lists([[7, 8] * 9] * 6, [3] * 6, [1] * 6, [0.8] * 6)
    one.save(tmp_path)
    real = type(tmp_path).replace

    def cut(self, target):
        if str(target).endswith("manifest.json"):
            raise KeyboardInterrupt
        return real(self, target)

    monkeypatch.setattr(type(tmp_path), "replace", cut)
    with pytest.raises(KeyboardInterrupt):
        two.save(tmp_path)
    assert rows(TokenData.load(tmp_path)) == rows(one)
    monkeypatch.setattr(type(tmp_path), "replace", real)
    paths = two.save(tmp_path)
    assert rows(TokenData.load(tmp_path)) == rows(two)
    assert sorted(p.name for p in tmp_path.glob("shard-*.npz")) == sorted(p.name for p in paths)
    assert rows(TokenData.load(tmp_path)) == rows(two) and len(two.save(tmp_path)) == len(paths)  # names alternate
    manifest = tmp_path / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"sequences": 6', '"sequences": 5'))
    with pytest.raises(data_mod.CheckpointError, match="shards hold 6"):
        TokenData.load(tmp_path)
