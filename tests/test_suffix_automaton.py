"""Suffix automaton, its matcher, the suffix drafter and the replay harness vs brute force."""

from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path

import numpy as np

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from specdec.drafters.base import Draft, Drafter, make_drafter
from specdec.drafters.data import TokenData
from specdec.drafters.replay import ReplayStats, replay
from specdec.drafters.suffix_automaton import Matcher, SuffixAutomaton, SuffixAutomatonDrafter, token_confidence
from specdec.errors import ConfigError, InvalidRequestError, SpecDecError

small_tokens = st.lists(st.integers(0, 3), max_size=60)
SETTINGS = settings(max_examples=150, deadline=None)


# ----------------------------------------------------------------- brute force


def occurs_at(hay: list[int], needle: list[int]) -> list[int]:
    """End indices of every occurrence of ``needle`` in ``hay``."""
    n = len(needle)
    return [i + n - 1 for i in range(len(hay) - n + 1) if hay[i : i + n] == needle]


def is_substring(hay: list[int], needle: list[int]) -> bool:
    return not needle or bool(occurs_at(hay, needle))


def bf_longest_repeated_suffix(text: list[int]) -> tuple[int, int]:
    """Longest suffix with an occurrence ending before the last position, and its first end."""
    n = len(text)
    for length in range(n - 1, 0, -1):
        ends = occurs_at(text[: n - 1], text[n - length :])
        if ends:
            return length, ends[0]
    return 0, -1


def bf_longest_suffix_in(hay: list[int], query: list[int]) -> int:
    """Longest suffix of ``query`` that is a substring of ``hay``."""
    for length in range(len(query), 0, -1):
        if is_substring(hay, query[len(query) - length :]):
            return length
    return 0


# ----------------------------------------------------------------- (a) automaton


@SETTINGS
@given(small_tokens)
def test_longest_repeated_suffix_matches_brute_force(tokens):
    sam = SuffixAutomaton()
    for i, t in enumerate(tokens):
        sam.append(t)
        text = tokens[: i + 1]
        length, end = sam.longest_repeated_suffix()
        assert (length, end) == bf_longest_repeated_suffix(text)
        if length:
            # the continuation it points to follows an occurrence of that suffix
            assert end < len(text) - 1
            assert text[end - length + 1 : end + 1] == text[len(text) - length :]
    assert sam.tokens == tokens


@SETTINGS
@given(small_tokens, st.integers(1, 8))
def test_walk_reads_a_real_continuation(tokens, budget):
    sam = SuffixAutomaton(tokens)
    length, _ = sam.longest_repeated_suffix()
    if length == 0:
        assert sam.match_state() == 0  # the root: the drafter does not draft from it
        return
    draft = sam.walk(sam.match_state(), budget, min_prob=0.0)
    assert draft, "a repeated suffix always has a continuation"
    context = tokens[len(tokens) - length :] + draft
    ends = occurs_at(tokens, context)
    assert ends, "suffix + draft must occur in the text"
    if len(draft) < budget:  # stopped because the continuation ran out: only at the very end
        assert ends == [len(tokens) - 1]


def test_counts_prefer_the_frequent_continuation():
    # "1 2" came before 5 (first, uncounted: it was not yet a repeat), then 3, 3, 4: counts pick 3
    sam = SuffixAutomaton([90, 1, 2, 5, 91, 1, 2, 3, 92, 1, 2, 3, 93, 1, 2, 4, 94, 1, 2])
    assert sam.walk(sam.match_state(), 1) == [3]
    # a tie (3 once, 4 once) goes to the most recent
    sam = SuffixAutomaton([90, 1, 2, 5, 91, 1, 2, 3, 92, 1, 2, 4, 94, 1, 2])
    assert sam.walk(sam.match_state(), 1) == [4]


def bf_first_step(text: list[int]) -> tuple[int, float]:
    """The walk's first token and probability from the longest repeated suffix, by brute force.

    An append of ``text[i]`` counts for the context ``c_i`` (longest repeated suffix of
    ``text[:i]``); it counts for the final context ``c`` when ``c`` is a suffix of ``c_i``
    in the same endpos class of ``text[:i]`` (the automaton's state then, later split).
    """
    length, first_end = bf_longest_repeated_suffix(text)
    c = text[len(text) - length :]
    counts: dict[int, int] = {}
    best, best_count = None, 0
    for i in range(1, len(text)):
        li, _ = bf_longest_repeated_suffix(text[:i])
        if li < length or text[i - length : i] != c:
            continue
        if occurs_at(text[:i], c) != occurs_at(text[:i], text[i - li : i]):
            continue
        counts[text[i]] = counts.get(text[i], 0) + 1
        if counts[text[i]] >= best_count:
            best, best_count = text[i], counts[text[i]]
    branching = len({text[e + 1] for e in occurs_at(text[:-1], c)})
    if best is None:
        best = text[first_end + 1]
    return best, (best_count + 1) / (sum(counts.values()) + branching)


@SETTINGS
@given(small_tokens, st.floats(0.0, 1.0))
def test_continuation_counts_match_brute_force(tokens, min_prob):
    sam = SuffixAutomaton(tokens)
    if sam.longest_repeated_suffix()[0] == 0:
        return
    token, prob = bf_first_step(tokens)
    draft = sam.walk(sam.match_state(), 1, min_prob)
    assert draft == ([token] if prob >= min_prob else [])
    assert sam.walk(sam.match_state(), 1) == [token]


def test_walk_confidence_threshold_stops_on_branching():
    sam = SuffixAutomaton([7, 1, 7, 2, 7, 3, 7, 4, 7])  # "7" followed by 4 different tokens
    assert sam.walk(sam.match_state(), 4, min_prob=0.0) != []
    assert sam.walk(sam.match_state(), 4, min_prob=0.5) == []


# ----------------------------------------------------------------- (b) matcher


@SETTINGS
@given(small_tokens, small_tokens)
def test_matcher_matches_brute_force(text, query):
    sam = SuffixAutomaton(text)
    m = Matcher(sam)
    for i, t in enumerate(query):
        assert m.feed(t) == bf_longest_suffix_in(text, query[: i + 1])
        assert m.length <= sam.state_len(m.state)


@SETTINGS
@given(st.lists(st.tuples(small_tokens, small_tokens), min_size=1, max_size=6))
@example([([], []), ([0, 1], [2, 1]), ([0, 1, 0], []), ([], [0])])  # a split under the matcher
def test_matcher_stays_valid_while_the_automaton_grows(rounds):
    sam = SuffixAutomaton()
    m = Matcher(sam)
    docs: list[list[int]] = []
    query: list[int] = []
    for doc, chunk in rounds:
        sam.add_sequence(doc)  # splits states the matcher may point at
        docs.append(doc)
        for t in chunk:
            query.append(t)
            length = m.feed(t)
            matched = query[len(query) - length :]
            assert any(is_substring(d, matched) for d in docs), "the match must occur"
            # never worse than a fresh matcher over the text it started with
            assert length >= bf_longest_suffix_in(docs[0], query)
            assert length <= sam.state_len(m.state)
            if length:
                draft = sam.walk(m.state, 8)
                assert all(x >= 0 for x in draft), "a draft never crosses a separator"
                assert any(is_substring(d, matched + draft) for d in docs)


# ----------------------------------------------------------------- (c) drafter


requests_strategy = st.lists(
    st.tuples(small_tokens, st.lists(st.integers(0, 3), min_size=1, max_size=40)), min_size=1, max_size=5
)


def check_draft(draft: Draft, text: list[int], docs: list[list[int]], k: int, min_len: int) -> None:
    assert len(draft) <= k
    assert draft.probs is None
    if not draft.token_ids:
        return
    d = list(draft.token_ids)
    assert all(isinstance(x, int) and x >= 0 for x in d)
    context = text[len(text) - min_len :] + d
    assert len(text) >= min_len
    assert any(is_substring(h, context) for h in [text, *docs]), (text, docs, d)


@SETTINGS
@given(requests_strategy, small_tokens, st.integers(1, 6), st.integers(1, 3), st.randoms(use_true_random=False))
def test_drafts_continue_an_earlier_occurrence(requests, corpus_doc, max_draft, min_len, rnd):
    drafter = SuffixAutomatonDrafter(max_draft_tokens=max_draft, min_match_len=min_len, corpus=[corpus_doc])
    docs = [corpus_doc]
    live: dict[str, tuple[list[int], int]] = {}  # req_id -> (text, prompt length)
    for i, (prompt, response) in enumerate(requests):
        live[f"r{i}"] = (list(prompt), len(prompt))
        drafter.start_request(f"r{i}", prompt)
        pos = 0
        while pos < len(response):
            chunk = response[pos : pos + rnd.randint(1, 4)]
            pos += len(chunk)
            drafter.on_accepted(f"r{i}", chunk)
            live[f"r{i}"][0].extend(chunk)
            ids = list(live)
            max_tokens = rnd.randint(0, 10)
            for rid, draft in zip(ids, drafter.propose(ids, max_tokens)):
                check_draft(draft, live[rid][0], docs, min(max_tokens, max_draft), min_len)
            if i and pos >= len(response) // 2 and f"r{i - 1}" in live:  # overlap two requests
                text, n_prompt = live.pop(f"r{i - 1}")
                drafter.stop_request(f"r{i - 1}")
                docs.append(text[n_prompt:])


@SETTINGS
@given(small_tokens, st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 8), st.integers(1, 3))
def test_local_draft_length_follows_match_length(prompt, response, max_draft, min_len):
    drafter = SuffixAutomatonDrafter(
        max_draft_tokens=max_draft, min_match_len=min_len, use_global=False, min_token_prob=0.0
    )
    drafter.start_request("a", prompt)
    text = list(prompt)
    for t in response:
        drafter.on_accepted("a", [t])
        text.append(t)
        (draft,) = drafter.propose(["a"], 8)
        length, _ = bf_longest_repeated_suffix(text)
        if length < min_len:
            assert draft == Draft()
            continue
        d = list(draft.token_ids)
        ends = occurs_at(text, text[len(text) - length :] + d)
        assert ends and len(d) >= 1
        assert len(d) == min(max_draft, length) or ends == [len(text) - 1]


def test_global_corpus_drafts_and_separators():
    drafter = SuffixAutomatonDrafter(corpus=[[1, 2, 3], [4, 5, 6], [5, 6, 7, 8, 9]], min_token_prob=0.0)
    drafter.start_request("a", [0, 5, 6])
    assert [d.token_ids for d in drafter.propose(["a"], 8)] == [(7, 8)]  # match "5 6" (2 tokens) -> 2 tokens
    drafter.start_request("b", [2, 3])
    assert [d.token_ids for d in drafter.propose(["b"], 8)] == [()]  # "2 3" ended a document: nothing follows
    drafter.start_request("c", [3, 4])
    assert [d.token_ids for d in drafter.propose(["c"], 8)] == [(5,)]  # "3 4" spans a boundary: only "4" matches


@pytest.mark.parametrize("use_global", [True, False])
def test_finished_responses_feed_later_requests(use_global):
    drafter = SuffixAutomatonDrafter(use_global=use_global)
    response = list(range(100, 130))
    drafter.start_request("first", [1, 2, 3])
    drafter.on_accepted("first", response)
    drafter.stop_request("first")
    drafter.start_request("second", [9, 9])
    drafter.on_accepted("second", response[:5])
    (draft,) = drafter.propose(["second"], 8)
    assert draft.token_ids == (tuple(response[5:10]) if use_global else ())


def test_registered_and_request_state_freed():
    drafter = make_drafter("suffix", max_draft_tokens=3)
    assert isinstance(drafter, SuffixAutomatonDrafter)
    drafter.start_request("a", [1, 2, 1, 2])
    assert drafter.propose(["a"], 0) == [Draft()]
    drafter.stop_request("a")
    drafter.stop_request("a")  # idempotent
    with pytest.raises(InvalidRequestError, match="'a'"):
        drafter.propose(["a"], 4)


# ----------------------------------------------------------------- (d) replay


def test_replay_copies_a_repeated_response():
    rnd = random.Random(0)
    response = [rnd.randrange(10**6) for _ in range(300)]
    prompt = [rnd.randrange(10**6) for _ in range(50)] + response + [rnd.randrange(10**6) for _ in range(50)]
    stats = replay(SuffixAutomatonDrafter(), [(prompt, response)], max_tokens=8)
    assert stats.tokens == 300
    assert stats.mean_accepted_length > 4
    assert stats.acceptance_rate > 0.9


def test_replay_random_tokens_accept_nothing():
    rnd = random.Random(1)
    pairs = [([rnd.randrange(10**9) for _ in range(100)], [rnd.randrange(10**9) for _ in range(200)]) for _ in range(3)]
    stats = replay(SuffixAutomatonDrafter(), pairs, max_tokens=8)
    assert stats.tokens == stats.steps == 600
    assert stats.accepted == 0 and stats.acceptance_rate == 0.0 and stats.mean_accepted_length == 1.0


def test_replay_global_automaton_learns_across_sequences():
    rnd = random.Random(2)
    response = [rnd.randrange(10**6) for _ in range(200)]
    pairs = [([1, 2, 3], response), ([4, 5, 6], response)]
    with_global = replay(SuffixAutomatonDrafter(), pairs, max_tokens=8)
    without = replay(SuffixAutomatonDrafter(use_global=False), pairs, max_tokens=8)
    assert without.accepted == 0
    assert with_global.accepted > 150


class _ScriptedDrafter(Drafter):
    """Proposes from the true response: an oracle, a liar, or a draft longer than asked."""

    def __init__(self, responses: dict[tuple[int, ...], list[int]], mode: str) -> None:
        self.responses, self.mode, self.log = responses, mode, []

    def start_request(self, req_id, prompt_token_ids):
        self.req = (list(self.responses[tuple(prompt_token_ids)]), 0)
        self.log.append(("start", req_id))

    def propose(self, req_ids, max_tokens):
        truth, pos = self.req
        nxt = truth[pos : pos + max_tokens]
        if self.mode == "oracle":
            return [Draft(tuple(nxt))]
        if self.mode == "liar":
            return [Draft((-1,) * max_tokens)]
        assert self.mode == "too_long"
        return [Draft((0,) * (max_tokens + 1))]

    def on_accepted(self, req_id, token_ids):
        truth, pos = self.req
        assert list(token_ids) == truth[pos : pos + len(token_ids)] and token_ids
        self.req = (truth, pos + len(token_ids))
        self.log.append(("accepted", len(token_ids)))

    def stop_request(self, req_id):
        assert self.req[1] == len(self.req[0])
        self.log.append(("stop", req_id))


def test_replay_accounting_with_a_perfect_drafter():
    pairs = [((1,), list(range(10))), ((2,), list(range(3)))]
    d = _ScriptedDrafter(dict(pairs), "oracle")
    stats = replay(d, pairs, max_tokens=4)
    # 10 tokens: 4+1, 4+1; 3 tokens: 3 accepted, no bonus past the end
    assert stats == ReplayStats(steps=3, tokens=13, drafted=4 + 4 + 3, accepted=11)
    assert stats.mean_accepted_length == pytest.approx(13 / stats.steps)
    assert d.log[0] == ("start", "replay-0") and d.log[-1] == ("stop", "replay-1")


def test_replay_accounting_with_a_wrong_drafter():
    pairs = [((1,), list(range(7)))]
    stats = replay(_ScriptedDrafter(dict(pairs), "liar"), pairs, max_tokens=3)
    assert stats == ReplayStats(steps=7, tokens=7, drafted=21, accepted=0)
    assert stats.mean_accepted_length == 1.0 and stats.acceptance_rate == 0.0
    assert ReplayStats().mean_accepted_length == 0.0 and ReplayStats().acceptance_rate == 0.0


def test_replay_rejects_bad_drafts_and_budgets():
    pairs = [((1,), [5, 6])]
    with pytest.raises(SpecDecError, match="<= 2 tokens"):
        replay(_ScriptedDrafter(dict(pairs), "too_long"), pairs, max_tokens=2)
    with pytest.raises(ConfigError, match="max_tokens"):
        replay(SuffixAutomatonDrafter(), pairs, max_tokens=-1)


# ----------------------------------------------------------------- (e) bad inputs


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_draft_tokens": 0}, "max_draft_tokens"),
        ({"max_draft_tokens": 2.5}, "max_draft_tokens"),
        ({"max_draft_tokens": True}, "max_draft_tokens"),
        ({"min_match_len": 0}, "min_match_len"),
        ({"use_global": 1}, "use_global"),
        ({"min_token_prob": 1.5}, "min_token_prob"),
        ({"min_token_prob": -0.1}, "min_token_prob"),
        ({"match_len_factor": 0}, "match_len_factor"),
        ({"match_len_factor": math.inf}, "match_len_factor"),
        ({"corpus": [[1, 2]], "use_global": False}, "corpus"),
        ({"corpus": [[1, 2], [3, -4]]}, r"corpus\[1\]"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        SuffixAutomatonDrafter(**kwargs)


def test_bad_requests_raise_invalid_request():
    drafter = SuffixAutomatonDrafter()
    drafter.start_request("a", [1, 2])
    with pytest.raises(InvalidRequestError, match="'nope'"):
        drafter.propose(["a", "nope"], 4)
    with pytest.raises(InvalidRequestError, match="'nope'"):
        drafter.on_accepted("nope", [1])
    with pytest.raises(InvalidRequestError, match="'a'"):
        drafter.start_request("a", [3])
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        drafter.start_request("b", [3, -1])
    with pytest.raises(InvalidRequestError, match="token_ids"):
        drafter.on_accepted("a", [-2])
    with pytest.raises(ConfigError, match="max_tokens"):
        drafter.propose(["a"], -1)


# ----------------------------------------------------------------- (f) linear size


@pytest.mark.parametrize("kind", ["random4", "constant", "periodic", "large_alphabet"])
def test_build_is_linear(kind):
    n = 200_000
    rnd = random.Random(3)
    gen = {
        "random4": lambda i: rnd.randrange(4),
        "constant": lambda i: 0,
        "periodic": lambda i: i % 17,
        "large_alphabet": lambda i: rnd.randrange(50_000),
    }[kind]
    sam = SuffixAutomaton(gen(i) for i in range(n))
    assert sam.num_states <= 2 * n
    assert sam.num_transitions <= 3 * n
    m = Matcher(sam)
    m.feed_many(gen(i) for i in range(n // 4))
    assert m.length <= n


def test_decode_loop_is_not_quadratic():
    # a long, repetitive response through the whole drafter loop; quadratic work would take minutes
    rnd = random.Random(4)
    block = [rnd.randrange(1000) for _ in range(500)]
    response = [t for _ in range(100) for t in block]
    stats = replay(SuffixAutomatonDrafter(), [([1], response)], max_tokens=8)
    assert stats.tokens == len(response)
    assert stats.mean_accepted_length > 8


def test_finished_responses_are_indexed_by_overlap():
    """``stop_request`` only queues a response; ``overlap`` (run by the engine while the device
    computes a step) indexes it, and a new request flushes the queue first."""
    drafter = SuffixAutomatonDrafter()
    drafter.start_request("a", [1, 2, 3])
    drafter.on_accepted("a", list(range(100, 130)))
    drafter.stop_request("a")
    before = drafter._global.num_states
    drafter.overlap()
    assert drafter._global.num_states > before
    drafter.overlap()  # nothing left to do
    assert drafter._global.num_states > before


def test_walk_scores_are_the_continuation_counts_estimates():
    """walk_scored's estimate of each token is (count + 1) / (total + distinct), and ``counts``
    reports what it rests on."""
    sam = SuffixAutomaton([1, 2, 3, 1, 2, 4, 1, 2, 3, 9, 1, 2])
    counts = []
    toks, probs = sam.walk_scored(sam.match_state(), 4, counts=counts)
    assert toks == sam.walk(sam.match_state(), 4) and len(probs) == len(toks) == len(counts)
    assert toks[0] == 3 and all(0 < p <= 1 for p in probs)  # "1 2" went on to 3, 4 and 3: 3, not sure
    assert all(p == pytest.approx((h + 1) / (t + d)) for p, (h, t, d) in zip(probs, counts))
    assert counts[0] == (1, 2, 2)  # after its first occurrence "1 2" went on to 4, then 3: 3 once of 2
    sure = SuffixAutomaton([5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6])  # "5 6" always went on to 7
    s_toks, s_probs = sure.walk_scored(sure.match_state(), 1)
    assert s_toks == [7] and s_probs[0] > probs[0]


def test_drafts_carry_calibrated_confidences_and_explain_says_why():
    drafter = SuffixAutomatonDrafter(use_global=False)
    prompt = [1, 2, 3, 1, 2, 4, 1, 2, 3, 9, 1, 2]
    drafter.start_request("r", prompt)
    (draft,) = drafter.propose(["r"], 4)
    why = drafter.explain("r", 4)
    assert len(draft) > 0 and draft.token_ids == tuple(w[0] for w in why)
    assert draft.confidence == tuple(w[1] for w in why)
    for j, (tok, conf, hits, total, distinct, match_len, own) in enumerate(why):
        assert own and match_len == 2  # "1 2", in the request's own tokens
        assert conf == token_confidence(hits, total, distinct, match_len + j, own)
    assert drafter.explain("r", 0) == []
    with pytest.raises(InvalidRequestError):
        drafter.explain("nope", 4)
    drafter.start_request("once", [5, 6, 7, 8, 9, 10, 5, 6, 7])  # "5 6 7" occurred once before, never continued again
    why = drafter.explain("once", 3)
    assert [w[0] for w in why] == [8, 9, 10] and all(w[2:5] == (0, 0, 1) for w in why)
    assert [w[1] for w in why] == [token_confidence(0, 0, 1, 3 + j, True) for j in range(3)]


@SETTINGS
@given(hits=st.integers(0, 50), misses=st.integers(0, 50), distinct=st.integers(1, 20),
       length=st.integers(1, 10_000), own=st.booleans())
def test_token_confidence_is_a_probability_that_rises_with_evidence(hits, misses, distinct, length, own):
    """In (0, 1); higher for a longer match, for a match in the request's own tokens, for a
    continuation seen more often, lower for one others followed more often."""
    total = hits + misses
    distinct = max(distinct, 1 + (misses > 0))
    c = token_confidence(hits, total, distinct, length, own)
    assert 0 < c < 1
    assert token_confidence(hits, total, distinct, length + 1, own) > c
    assert own or token_confidence(hits, total, distinct, length, True) > c
    if total:  # seen after its first occurrence: one more hit raises it, one more miss lowers it
        assert token_confidence(hits + 1, total + 1, distinct, length, own) > c
        assert token_confidence(hits, total + 1, distinct + 1, length, own) < c


def test_confidences_are_calibrated_on_the_target_s_own_responses():
    """The target's greedy responses from the shipped training data, replayed as the engine would
    (bench/suffix_calibration.py): per confidence bin, the accepted fraction is within 0.1 of the
    mean confidence, and the log loss is well below the raw count frequency's."""
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("suffix_calibration", root / "bench" / "suffix_calibration.py")
    cal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cal)
    data = TokenData.load(root / "data" / "drafter-smollm2-135m")
    idx = [i for i in range(len(data)) if float(data.temperature[i]) == 0.0][::50][:150]
    rows = cal.replay(data, idx, 8, SuffixAutomatonDrafter(min_token_prob=0.0))
    conf, ok = rows[:, 1], rows[:, 2]
    raw = (rows[:, 3] + 1) / (rows[:, 4] + rows[:, 5])
    assert cal.log_loss(conf, ok) < 0.5 * cal.log_loss(raw, ok)
    edges = np.array([0, .2, .4, .6, .8, .9, .95, 1.0001])
    checked = 0
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (conf >= lo) & (conf < hi)
        if m.sum() >= 500:
            checked += 1
            assert abs(ok[m].mean() - conf[m].mean()) < 0.1, (lo, hi, ok[m].mean(), conf[m].mean())
    assert checked >= 4


def _finish(drafter, rid, prompt, response):
    drafter.start_request(rid, prompt)
    drafter.on_accepted(rid, response)
    drafter.stop_request(rid)
    drafter.overlap()


def test_global_automaton_stays_within_its_budget_and_keeps_the_newest_responses():
    drafter = SuffixAutomatonDrafter(global_budget_tokens=200, corpus=[[900, 901, 902, 903]])
    rng = random.Random(0)
    responses = [[rng.randrange(1000, 5000) for _ in range(30)] for _ in range(40)]
    for i, resp in enumerate(responses):
        _finish(drafter, f"r{i}", [1, 2, 3], resp)
        assert drafter.global_tokens <= 200
    assert drafter.global_rebuilds >= 3
    # the newest response is still there, the oldest is gone, the corpus stays
    drafter.start_request("new", responses[-1][:6])
    got = drafter.propose(["new"], 8)[0].token_ids
    assert len(got) >= 4 and got == tuple(responses[-1][6:6 + len(got)])
    drafter.start_request("old", responses[0][:6])
    assert drafter.propose(["old"], 8)[0].token_ids == ()
    drafter.start_request("corpus", [900, 901])
    assert drafter.propose(["corpus"], 2)[0].token_ids == (902, 903)


def test_an_active_request_drafts_after_a_rebuild_as_from_a_fresh_automaton():
    fillers = [list(range(100 + 20 * i, 115 + 20 * i)) for i in range(6)]
    kept = [10, 11, 12, 13, 14, 15, 16, 17]
    drafter = SuffixAutomatonDrafter(global_budget_tokens=50)
    for i, f in enumerate(fillers[:2]):
        _finish(drafter, f"f{i}", [1], f)
    _finish(drafter, "kept", [1], kept)
    drafter.start_request("live", [5, 10, 11])  # its matcher walks the automaton that is rebuilt next
    _finish(drafter, "push", [1], fillers[2])  # past the budget: the oldest fillers go
    assert drafter.global_rebuilds == 1
    fresh = SuffixAutomatonDrafter(global_budget_tokens=None)
    for name, resp in [("kept", kept), ("push", fillers[2])]:
        _finish(fresh, name, [1], resp)
    fresh.start_request("live", [5, 10, 11])
    for d in (drafter, fresh):
        d.on_accepted("live", [12])
    got = drafter.propose(["live"], 4)
    assert got == fresh.propose(["live"], 4) and got[0].token_ids[:1] == (13,)


def test_aborted_outputs_never_join_the_global_automaton(tiny):
    from specdec import SamplingParams, SpecEngine

    drafter = SuffixAutomatonDrafter()
    engine = SpecEngine(tiny, drafter)
    engine.add_request([1, 2, 3, 4], SamplingParams(max_new_tokens=20, ignore_eos=True), req_id="x")
    engine.step()
    engine.step()
    before = drafter.global_tokens
    engine.abort("x")
    drafter.overlap()
    assert drafter.global_tokens == before
    engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=5, ignore_eos=True))
    drafter.overlap()
    assert drafter.global_tokens > before  # a finished response does join
    with pytest.raises(ConfigError, match="global_budget_tokens"):
        SuffixAutomatonDrafter(global_budget_tokens=0)


def test_a_thousand_responses_leave_the_drafters_memory_flat():
    """A server's soak, drafter side: memory after 1,000 finished responses is what it was after 200."""
    import tracemalloc

    drafter = SuffixAutomatonDrafter(global_budget_tokens=4000)
    rng = random.Random(1)
    tracemalloc.start()
    try:
        for i in range(1000):
            _finish(drafter, f"r{i}", [1, 2, 3], [rng.randrange(5, 3000) for _ in range(80)])
            if i == 199:
                early = tracemalloc.get_traced_memory()[0]
        late = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert drafter.global_tokens <= 4000 and drafter.global_rebuilds > 10
    assert late < 1.5 * early, (early, late)
    unbounded = SuffixAutomatonDrafter(global_budget_tokens=None)
    for i in range(60):
        _finish(unbounded, f"u{i}", [1], [rng.randrange(5, 3000) for _ in range(80)])
    assert unbounded.global_tokens > 4000  # the bound is what keeps it flat
