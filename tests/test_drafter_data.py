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


# -- the documents source: long inputs that answers copy from ----------------------------------------
@pytest.fixture(scope="module")
def real_docs():
    return data_mod.real_documents()


def test_real_documents_are_long_prose_found_on_the_machine(real_docs):
    assert len(real_docs) >= 50 and all(len(d.split()) >= 150 for d in real_docs)
    assert real_docs == data_mod.real_documents()  # a fixed order
    assert not any("[![" in d or "HumanEval" in d or "shields.io" in d for d in real_docs)
    assert not any(re.search(r"^\s*(:target:|\.\. \|[^|]+\| image::|\[[^\]]+\]:\s*https?://\S+\s*$)", d, re.M)
                   for d in real_docs)


PASSAGES = [f"Passage {i}: the river {w} runs past the old mill and the bakery, where people meet on market days "
            f"to trade grain, talk about the weather and watch the boats go by. In winter {w} freezes over, the "
            f"children skate from the bridge to the church, and the miller sells hot cider at {i + 2} pennies a cup."
            for i, w in enumerate(["Alder", "Birch", "Cedar", "Dogwood", "Elm", "Fir"])]
SECOND = ("The mill itself was built in 1820 by two brothers from the coast, who ground barley for the abbey "
          "until a flood took the wheel; their grandchildren rebuilt it in stone and painted the door blue.")
TRANSLATIONS = [("French", f"Le marché {i} ouvre le matin et les gens achètent du pain frais pour la journée.")
                for i in range(40)]


INSTRUCTION = re.compile("|".join(re.escape(f.strip()).replace(r"\{k\}", r"\d") for t in
                                  data_mod._SUMMARY_TASKS + data_mod._EXTRACT_TASKS for f in t.split("{d}") if f.strip()))
TRANSLATE = r"^Translate French to English: |^Translate the following French text|French text into English\.$|^English translation of: "


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10 ** 6), with_passages=st.booleans(), with_translations=st.booleans())
def test_document_prompts_are_seeded_distinct_and_copy_their_text(real_docs, seed, with_passages, with_translations):
    passages = PASSAGES if with_passages else []
    translations = TRANSLATIONS * 30 if with_translations else []  # 1,200: weight 0.2
    got = data_mod.document_prompts(60, seed=seed, docs=real_docs, passages=passages, translations=translations)
    assert got == data_mod.document_prompts(60, seed=seed, docs=real_docs, passages=passages, translations=translations)
    assert len(got) == 60 and len(set(got)) == 60
    flat_docs = [" ".join(d.split()) for d in real_docs + passages]
    longest_task = max(map(len, data_mod._SUMMARY_TASKS + data_mod._EXTRACT_TASKS + data_mod._QUESTIONS)) + 30
    for p in got:
        if re.search(TRANSLATE, p):
            assert with_translations and any(t in p for _, t in TRANSLATIONS)
            continue
        assert len(p) <= data_mod.MAX_DOCUMENT_CHARS + longest_task
        # every paragraph of the input is a paragraph (or a sentence-cut start) of a document or a passage
        body = [q for q in INSTRUCTION.sub("", p).split("\n\n") if len(q.split()) > 3]
        assert body
        for para in body:
            para = re.sub(r"^(Document \[\d\]: |TL;DR:|Summarize: )", "", para.strip()).strip()
            para = para.rsplit("\n", 1)[0] if re.search(r"\?$", para) else para  # a question's last line
            # its first line's first words (a paragraph cut at a sentence end has its spacing collapsed)
            first = " ".join(para.split("\n")[0].split()[:10])
            assert any(first in d for d in flat_docs), first
    kinds = {("translate" if re.search(TRANSLATE, p) else "question" if p.rstrip().endswith("?") else "long")
             for p in got}
    assert "long" in kinds and "question" in kinds
    assert "translate" in kinds or not with_translations


def test_document_prompts_need_some_text():
    with pytest.raises(ConfigError, match="no text"):
        data_mod.document_prompts(3, docs=[], passages=[])
    with pytest.raises(ConfigError, match="no text"):
        data_mod.document_prompt(__import__("random").Random(0), [], [], [])
    assert data_mod.document_prompts(0, docs=[], passages=[]) == []


def grounded_build(tokenizer, folder):
    """An earlier build's ``grounded`` sequences, written with the real chat template."""
    def chat(msg):
        return tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": msg}], tokenize=False,
                                                       add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    passage = PASSAGES[0]
    looping = "the same words again " * 30
    cases = [  # (task, answer)
        (f"Translate the following text into French.\n\n{passage}", TRANSLATIONS[0][1] + " Il fait beau."),
        (f"Translate the following text into German.\n\n{PASSAGES[1]}", "The river runs past the mill, as the passage said."),
        (f"Translate the following text into Japanese.\n\n{PASSAGES[2]}", "川は古い水車小屋を通り過ぎる。"),
        (f"Summarize the following text in 2 sentences.\n\n{looping}", "It repeats."),
        (f"Read the passage and answer the question.\n\nPassage: {PASSAGES[3]}\n\n{SECOND}\n\nQuestion: What "
         f"does the passage say about rivers?", "It says the river runs past the mill."),  # two paragraphs
    ]
    seqs, lens = [], []
    for task, answer in cases:
        ids = chat(task)
        seqs.append(ids + tokenizer(answer, add_special_tokens=False)["input_ids"])
        lens.append(len(ids))
    seqs.append(seqs[0])  # a sampled twin: not read again
    lens.append(lens[0])
    TokenData.from_lists(seqs, lens, [3] * 5 + [3], [0.0] * 5 + [0.8]).save(folder)


def test_self_written_texts_reads_passages_and_foreign_translations_back(smollm2, tmp_path):
    grounded_build(smollm2.tokenizer, tmp_path)
    passages, translations = data_mod.self_written_texts([tmp_path], smollm2.tokenizer)
    # every paragraph of each passage; the looping one dropped
    assert passages == [PASSAGES[0], PASSAGES[1], PASSAGES[2], PASSAGES[3] + "\n\n" + SECOND]
    # French kept (its first sentences); the "German" answer in English and the unspaced Japanese dropped
    assert translations == [("French", TRANSLATIONS[0][1] + " Il fait beau.")]


def test_a_build_with_documents_uses_an_earlier_builds_text(smollm2, tmp_path):
    grounded_build(smollm2.tokenizer, tmp_path / "earlier")
    small = {**SMALL, "num_magpie": 0, "num_code": 0, "num_humaneval": 0, "num_math": 0, "sampled_fraction": 0.0,
             "max_new_tokens": 4, "kv_cache_bytes": 256 << 20}
    data = build(smollm2, tmp_path / "new", num_documents=3, document_sources=[tmp_path / "earlier"], **small)
    # three tasks drawn; one over MAX_DOCUMENT_TOKENS (which the machine's documents decide) is dropped
    n = data.meta["num_documents"]
    assert data.meta["complete"] and 1 <= n <= 3 and data.source.tolist() == [5] * n
    assert data.meta["document_sources"] == [str(tmp_path / "earlier")]
    assert all(int(p) <= data_mod.MAX_DOCUMENT_TOKENS for p in data.prompt_lens)
    with pytest.raises(ConfigError, match="no training data"):
        build(smollm2, tmp_path / "other", num_documents=3, document_sources=[tmp_path / "missing"], **small)


def test_a_build_from_before_the_documents_source_still_resumes(tmp_path):
    settings_now = {"seed": 0, "num_documents": 0, "document_sources": []}
    jobs = [{"prompt": "p", "source": 0, "temperature": 0.0, "seed": None}]
    data_mod._save_jobs(tmp_path, {"seed": 0}, jobs)  # its settings lack the keys added since
    assert data_mod._load_jobs(tmp_path, settings_now) == jobs
    with pytest.raises(ConfigError, match="num_documents"):
        data_mod._load_jobs(tmp_path, {**settings_now, "num_documents": 5})
