"""Model-free drafting from suffix automata (Blumer et al. 1985).

A :class:`SuffixAutomaton` indexes every substring of a token sequence and is
built online, one token at a time, in amortised O(1). The drafter keeps one
automaton per request (prompt + generated tokens) and one global automaton over
the responses of finished requests (plus an optional user corpus). To draft, it
finds the longest suffix of the request's tokens that occurred before and
proposes what followed that earlier occurrence (as in prompt-lookup / suffix
decoding, ArcticInference), for as many tokens as the match length and the
continuation's count frequencies justify. Each drafted token carries a calibrated probability of
acceptance (:func:`token_confidence`), which the hybrid drafter and the engine's confidence-driven
draft length read.

Every step of the hot path (append, match, draft) costs amortised O(1) per
token, O(k) per draft of k tokens: nothing is rescanned.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Iterable, Sequence

from specdec.drafters.base import EMPTY_DRAFT, Draft, Drafter, register_drafter
from specdec.errors import ConfigError, InvalidRequestError

__all__ = ["CONFIDENCE_WEIGHTS", "Matcher", "SuffixAutomaton", "SuffixAutomatonDrafter", "token_confidence"]

#: Weights of the logistic model behind :func:`token_confidence`, for the features
#: ``(1, log L, own, unseen, log(1 + hits), log(1 + misses), branching)``. Fitted by
#: ``python bench/suffix_calibration.py --fit`` on SmolLM2-135M-Instruct's greedy responses in the
#: drafter training data (``data/drafter-smollm2-135m*``, never evaluation data); on a held-out
#: part of it the model's log loss is 0.26 against 1.19 for the raw count frequency, which scores
#: 1.0 wherever every continuation so far agreed (a context continued once more after its first
#: occurrence, the same way: 68 % accepted; one never continued again: 83-98 % by match length).
CONFIDENCE_WEIGHTS: tuple[float, ...] = (-2.0950, 0.9866, 1.2509, 0.6086, 1.6121, -0.7392, -1.6582)


def token_confidence(hits: int, total: int, distinct: int, context_len: int, own: bool) -> float:
    """Estimated probability that a suffix-drafted token is accepted, given the ones before it were.

    A logistic model (:data:`CONFIDENCE_WEIGHTS`) of what the continuation rests on: the matched
    context's length ``L`` (longer matches repeat more surely), whether the match is in the
    request's own tokens (``own``) or in other requests' responses, whether the context was ever
    continued again after its first occurrence (``unseen``: ``total == 0``), how often it was
    continued by this token (``hits``) and by others (``misses = total - hits``), and whether more
    than one token ever followed it (``distinct > 1``).

    Args:
        hits: times the drafted token followed the context (after its first occurrence).
        total: times the context was continued (after its first occurrence).
        distinct: different tokens that followed the context (>= 1).
        context_len: the matched context's length in tokens (>= 1).
        own: the match is in the request's own tokens.

    Returns:
        A probability in ``(0, 1)``.
    """
    w = CONFIDENCE_WEIGHTS
    z = (w[0] + w[1] * math.log(max(context_len, 1)) + w[2] * own + w[3] * (total == 0)
         + w[4] * math.log1p(hits) + w[5] * math.log1p(total - hits) + w[6] * (distinct > 1))
    return 1.0 / (1.0 + math.exp(-z))


# token_confidence of the common case, a context never continued again with one continuation
# (9 of 10 drafted tokens), by source and match length: one lookup on the drafting path
_UNSEEN = tuple(tuple(token_confidence(0, 0, 1, n, own) for n in range(1024)) for own in (False, True))
# the other cases repeat too (the same counts at the same match lengths, step after step)
_confidence = functools.lru_cache(maxsize=1 << 14)(token_confidence)


class SuffixAutomaton:
    """Online suffix automaton over integer tokens.

    State ``0`` is the root (the empty string). For every state it keeps the
    transitions (``dict`` token -> state), ``len`` (its longest string),
    ``link`` (suffix link) and ``firstpos`` (end index in :attr:`tokens` of the
    first occurrence of its strings), so a continuation can be read from the
    stored tokens. Negative tokens are reserved for separators
    (:meth:`add_separator`); each one is unique, so no match crosses it.

    Continuation counts: before a token ``t`` is appended, the state of the
    longest repeated suffix (the context a drafter would have matched) records
    that it was followed by ``t``. These counts, kept with the running best
    token, give the confidence of a proposed continuation in O(1).

    Attributes:
        tokens: every appended token, separators included.
    """

    __slots__ = ("tokens", "_next", "_len", "_link", "_pos", "_stats", "_last", "_num_separators")

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.tokens: list[int] = []
        self._next: list[dict[int, int]] = [{}]
        self._len: list[int] = [0]
        self._link: list[int] = [-1]
        self._pos: list[int] = [-1]
        # state -> [total, best_token, best_count, {token: count}]; only states that were matched
        self._stats: dict[int, list] = {}
        self._last = 0
        self._num_separators = 0
        self.extend(tokens)

    @property
    def num_states(self) -> int:
        """Number of states (at most ``2 * len(tokens)`` for ``len(tokens) >= 2``)."""
        return len(self._len)

    @property
    def num_transitions(self) -> int:
        """Number of transitions (at most ``3 * len(tokens)``); computed in O(states)."""
        return sum(len(d) for d in self._next)

    def state_len(self, state: int) -> int:
        """Length of the longest string of ``state``."""
        return self._len[state]

    def append(self, token: int, count: bool = True) -> None:
        """Append one token, in amortised O(1).

        Args:
            token: the token id (negative ids are meant for separators).
            count: whether to record ``token`` as the continuation of the
                current longest repeated suffix (off for separators).
        """
        self._extend((token,), count)

    def _extend(self, tokens: Iterable[int], count: bool) -> None:
        """:meth:`append` for each of ``tokens``, in one loop (the drafter's per-step work at large
        batch: the lists and the counting are looked up once, not per token)."""
        nxt, ln, link, pos, text, stats_of = self._next, self._len, self._link, self._pos, self.tokens, self._stats
        last = self._last
        for token in tokens:
            if count and link[last] > 0:  # the longest repeated suffix was followed by token
                state = link[last]
                stats = stats_of.get(state)
                if stats is None:
                    stats_of[state] = [1, token, 1, {token: 1}]
                else:
                    counts = stats[3]
                    c = counts.get(token, 0) + 1
                    counts[token] = c
                    stats[0] += 1
                    if c >= stats[2]:  # ties go to the most recent continuation
                        stats[1] = token
                        stats[2] = c
            cur = len(ln)
            nxt.append({})
            ln.append(ln[last] + 1)
            link.append(0)
            pos.append(len(text))
            text.append(token)
            p = last
            while p != -1 and token not in nxt[p]:
                nxt[p][token] = cur
                p = link[p]
            if p != -1:
                q = nxt[p][token]
                if ln[p] + 1 == ln[q]:
                    link[cur] = q
                else:
                    link[cur] = self._split(p, q, token)
            last = cur
        self._last = last

    def _split(self, p: int, q: int, token: int) -> int:
        """Clone ``q`` for the strings of length ``<= len[p] + 1``; return the clone."""
        nxt, ln, link, pos = self._next, self._len, self._link, self._pos
        clone = len(ln)
        nxt.append(nxt[q].copy())  # amortised: total transitions stay O(n)
        ln.append(ln[p] + 1)
        link.append(link[q])
        pos.append(pos[q])
        stats = self._stats.get(q)
        if stats is not None:  # the clone's strings are suffixes of q's: same observations
            self._stats[clone] = [stats[0], stats[1], stats[2], stats[3].copy()]
        while p != -1 and nxt[p].get(token) == q:
            nxt[p][token] = clone
            p = link[p]
        link[q] = clone
        return clone

    def extend(self, tokens: Iterable[int]) -> None:
        """Append every token of ``tokens``."""
        self._extend(tokens, True)

    def add_separator(self) -> None:
        """Append a fresh negative token, so no match spans the boundary."""
        self._num_separators += 1
        self.append(-self._num_separators, count=False)

    def add_sequence(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` followed by a separator (one corpus document)."""
        self.extend(tokens)
        self.add_separator()

    def match_state(self) -> int:
        """State of the longest suffix of the text that also occurs earlier (root if none)."""
        return max(self._link[self._last], 0)

    def longest_repeated_suffix(self) -> tuple[int, int]:
        """The longest suffix of the text that has an earlier occurrence.

        Returns:
            ``(match_len, earlier_end_pos)``: its length and the end index of its
            first occurrence, so ``tokens[earlier_end_pos + 1]`` followed it.
            ``(0, -1)`` when no non-empty suffix repeats.
        """
        m = self.match_state()
        if m == 0:
            return 0, -1
        return self._len[m], self._pos[m]

    def walk(self, state: int, max_tokens: int, min_prob: float = 0.0) -> list[int]:
        """Read a likely continuation of the strings of ``state`` (:meth:`walk_scored` without the scores)."""
        return self.walk_scored(state, max_tokens, min_prob)[0]

    def walk_scored(self, state: int, max_tokens: int, min_prob: float = 0.0,
                    counts: list[tuple[int, int, int]] | None = None) -> tuple[list[int], list[float]]:
        """Read a likely continuation of the strings of ``state``, with each token's estimated probability.

        At each step it takes the most often observed continuation (else the
        one after the first occurrence), whose probability is estimated as
        ``(count + 1) / (total + distinct continuations)``. It stops at
        ``max_tokens``, at a separator, when the continuation runs out, or when
        the running product of probabilities drops below ``min_prob``.

        Args:
            state: the context's state (e.g. :meth:`match_state`, :attr:`Matcher.state`).
            max_tokens: the most tokens to return.
            min_prob: confidence threshold in ``[0, 1]``.
            counts: if given, ``(hits, total, distinct)`` behind each returned token is appended to it
                (times the continuation was observed, observations of the state, distinct continuations).

        Returns:
            ``(d, p)``: tokens ``d`` such that (any string of ``state``) + ``d`` occurs in the
            text, and ``p[j]``, the estimated probability of ``d[j]`` after ``d[:j]`` (in (0, 1]).
        """
        nxt, pos, tokens, all_stats = self._next, self._pos, self.tokens, self._stats
        out: list[int] = []
        probs: list[float] = []
        prob = 1.0
        while len(out) < max_tokens:
            trans = nxt[state]
            if not trans:
                break
            stats = all_stats.get(state)
            if stats is None:
                tok, hits, total = tokens[pos[state] + 1], 0, 0
            else:
                total, tok, hits = stats[0], stats[1], stats[2]
            step = (hits + 1) / (total + len(trans))
            prob *= step
            if tok < 0 or prob < min_prob:
                break
            out.append(tok)
            probs.append(step)
            if counts is not None:
                counts.append((hits, total, len(trans)))
            state = trans[tok]
        return out, probs


class Matcher:
    """Longest suffix of a token stream that is a substring of an automaton.

    Standard suffix-automaton matching with suffix-link fallback, amortised
    O(1) per token. The automaton may grow between calls: states split by the
    growth are re-normalised lazily, and the match stays valid (it may then be
    shorter than the longest possible until the stream moves on).

    Attributes:
        state: state of the matched suffix (root when ``length == 0``).
        length: length of the matched suffix.
    """

    __slots__ = ("sam", "state", "length")

    def __init__(self, sam: SuffixAutomaton) -> None:
        self.sam = sam
        self.state = 0
        self.length = 0

    def feed(self, token: int) -> int:
        """Extend the stream by ``token``; return the new match length."""
        return self.feed_many((token,))

    def feed_many(self, tokens: Iterable[int]) -> int:
        """Feed every token of ``tokens``; return the final match length (:meth:`feed`'s steps in
        one loop)."""
        nxt, ln, link = self.sam._next, self.sam._len, self.sam._link
        s, length = self.state, self.length
        for token in tokens:
            while s > 0 and length <= ln[link[s]]:  # growth split s: move to the true state
                s = link[s]
            while s > 0 and token not in nxt[s]:
                s = link[s]
                length = ln[s]
            t = nxt[s].get(token)
            if t is None:
                s, length = 0, 0
            else:
                s, length = t, length + 1
        self.state, self.length = s, length
        return length


class _Request:
    __slots__ = ("sam", "matcher", "num_prompt")

    def __init__(self, sam: SuffixAutomaton, matcher: Matcher | None, num_prompt: int) -> None:
        self.sam = sam
        self.matcher = matcher
        self.num_prompt = num_prompt


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be an int >= {low}, got {value!r}")


def _token_list(tokens: Sequence[int], field: str, error: type[ConfigError]) -> list[int]:
    """Tokens as plain ints; negative ids are reserved for separators."""
    out = [int(t) for t in tokens]
    if out and min(out) < 0:
        raise error(f"{field} must hold token ids >= 0, got {min(out)}")
    return out


@register_drafter("suffix")
class SuffixAutomatonDrafter(Drafter):
    """Drafts the continuation of the longest earlier occurrence of the current suffix.

    Sources: the request's own tokens (prompt + generated), and, with
    ``use_global``, the responses of earlier finished requests plus ``corpus``.
    The source with the longer match wins (the request's own on ties). A match
    of length ``L`` allows ``ceil(match_len_factor * L)`` tokens, capped at
    ``max_tokens`` (the engine's ``max_draft_tokens``) and ``max_draft_tokens``; the draft also stops when the
    continuation runs out or its estimated probability falls below
    ``min_token_prob``.

    Args:
        max_draft_tokens: the most tokens per draft (>= 1) of this drafter's own; ``None``
            (default): only the engine's ``EngineConfig.max_draft_tokens`` caps drafts.
        min_match_len: shortest suffix match that is used (>= 1).
        use_global: also match against finished responses and ``corpus``.
        corpus: token sequences added to the global automaton, one document each.
        min_token_prob: threshold in ``[0, 1]`` on the running product of the continuations'
            count frequencies (:meth:`SuffixAutomaton.walk_scored`) where the draft stops (0 drafts
            whenever matched). The draft's ``confidence`` is the calibrated :func:`token_confidence`.
        match_len_factor: draft tokens allowed per matched token (> 0).
        global_budget_tokens: most tokens the global automaton indexes (corpus included), so that
            a long-running server's memory stays bounded (about 1 KB of RSS per indexed token):
            past it, the oldest responses are dropped down to half the budget and the automaton
            is rebuilt from the rest (amortised: each token is re-indexed at most a few times).
            ``None``: unbounded. Aborted requests' outputs never join it.

    Raises:
        ConfigError: an argument is out of range (the message names it).
    """

    def __init__(
        self,
        *,
        max_draft_tokens: int | None = None,
        min_match_len: int = 1,
        use_global: bool = True,
        corpus: Sequence[Sequence[int]] | None = None,
        min_token_prob: float = 0.1,
        match_len_factor: float = 1.0,
        global_budget_tokens: int | None = 1 << 18,
    ) -> None:
        if max_draft_tokens is not None:
            _check_int("max_draft_tokens", max_draft_tokens, 1)
        _check_int("min_match_len", min_match_len, 1)
        if not isinstance(use_global, bool):
            raise ConfigError(f"use_global must be a bool, got {use_global!r}")
        if not isinstance(min_token_prob, (int, float)) or not 0.0 <= min_token_prob <= 1.0:
            raise ConfigError(f"min_token_prob must be a float in [0, 1], got {min_token_prob!r}")
        if not isinstance(match_len_factor, (int, float)) or not 0.0 < match_len_factor < math.inf:
            raise ConfigError(f"match_len_factor must be a finite float > 0, got {match_len_factor!r}")
        if global_budget_tokens is not None:
            _check_int("global_budget_tokens", global_budget_tokens, 1)
        if corpus is not None and not use_global:
            raise ConfigError("corpus needs use_global=True (the corpus lives in the global automaton)")
        self.max_draft_tokens = max_draft_tokens
        self.min_match_len = min_match_len
        self.use_global = use_global
        self.min_token_prob = float(min_token_prob)
        self.match_len_factor = float(match_len_factor)
        self._global = SuffixAutomaton() if use_global else None
        self._requests: dict[str, _Request] = {}
        self._finished: list[list[int]] = []  # responses waiting for overlap() to index them
        self.global_budget_tokens = global_budget_tokens
        self._corpus = [_token_list(doc, f"corpus[{i}]", ConfigError) for i, doc in enumerate(corpus or ())]
        self._responses: collections.deque[list[int]] = collections.deque()  # indexed, oldest first
        self._response_tokens = 0
        #: global automaton rebuilds (each dropped the oldest responses to stay within the budget)
        self.global_rebuilds = 0
        for doc in self._corpus:
            self._global.add_sequence(doc)

    def start_request(self, req_id: str, prompt_token_ids: Sequence[int]) -> None:
        """Index the prompt of a new request.

        Raises:
            InvalidRequestError: ``req_id`` is already active, or a token is negative.
        """
        if req_id in self._requests:
            raise InvalidRequestError(f"req_id {req_id!r} is already active")
        prompt = _token_list(prompt_token_ids, "prompt_token_ids", InvalidRequestError)
        matcher = None
        if self._global is not None:
            self.overlap()  # a new request's matcher starts over every finished response
            matcher = Matcher(self._global)
            matcher.feed_many(prompt)
        self._requests[req_id] = _Request(SuffixAutomaton(prompt), matcher, len(prompt))

    def propose(self, req_ids: Sequence[str], max_tokens: int) -> list[Draft]:
        """One chain draft per request, of at most ``min(max_tokens, max_draft_tokens)`` tokens.

        Raises:
            ConfigError: ``max_tokens`` is negative.
            InvalidRequestError: a ``req_id`` was not started.
        """
        _check_int("max_tokens", max_tokens, 0)
        k = max_tokens if self.max_draft_tokens is None else min(max_tokens, self.max_draft_tokens)
        return [self._propose_one(self._get(r), k) for r in req_ids]

    def _propose_one(self, req: _Request, k: int, explain: list | None = None) -> Draft:
        if k == 0:
            return EMPTY_DRAFT
        sam = req.sam
        state = sam.match_state()
        sources = [(sam.state_len(state), sam, state)]
        m = req.matcher
        if m is not None and m.length > sources[0][0]:
            sources.insert(0, (m.length, self._global, m.state))
        for length, automaton, state in sources:
            if length < self.min_match_len:
                continue
            budget = min(k, math.ceil(self.match_len_factor * length))
            counts: list[tuple[int, int, int]] = []
            tokens, _ = automaton.walk_scored(state, budget, self.min_token_prob, counts)
            if tokens:  # each token's calibrated probability of acceptance (hybrid, draft_length="confidence")
                own = automaton is sam
                unseen = _UNSEEN[own]
                conf = [unseen[n] if t == 0 and d == 1 and n < 1024 else _confidence(h, t, d, n, own)
                        for n, (h, t, d) in enumerate(counts, length)]
                if explain is not None:
                    explain += [(tok, c, *n, length, own) for tok, c, n in zip(tokens, conf, counts)]
                return Draft(tuple(tokens), confidence=tuple(conf))
        return EMPTY_DRAFT

    def explain(self, req_id: str, max_tokens: int) -> list[tuple[int, float, int, int, int, int, bool]]:
        """The draft :meth:`propose` would make for ``req_id`` now, token by token, with what it rests on.

        Returns:
            One tuple per drafted token: ``(token, confidence, hits, total, distinct, match_len, own)``,
            where ``hits`` is how often the continuation followed the matched context, ``total`` how
            often the context was continued at all, ``distinct`` by how many different tokens,
            ``match_len`` the matched suffix's length and ``own`` whether the match is in the request's
            own tokens (else in the global automaton).

        Raises:
            ConfigError: ``max_tokens`` is negative.
            InvalidRequestError: ``req_id`` was not started.
        """
        _check_int("max_tokens", max_tokens, 0)
        k = max_tokens if self.max_draft_tokens is None else min(max_tokens, self.max_draft_tokens)
        out: list = []
        self._propose_one(self._get(req_id), k, out)
        return out

    def on_accepted(self, req_id: str, token_ids: Sequence[int]) -> None:
        """Append the tokens the target emitted for ``req_id`` this step.

        Raises:
            InvalidRequestError: ``req_id`` was not started, or a token is negative (then none of them is appended).
        """
        req = self._get(req_id)
        toks = [int(t) for t in token_ids]
        if toks and min(toks) < 0:
            raise InvalidRequestError(f"token_ids for req_id {req_id!r} must be >= 0, got {min(toks)}")
        req.sam.extend(toks)
        if req.matcher is not None:
            req.matcher.feed_many(toks)

    def stop_request(self, req_id: str) -> None:
        """Free the request; with ``use_global`` its response joins the global automaton.

        Unknown ids are ignored, so aborting twice is harmless.
        """
        req = self._requests.pop(req_id, None)
        if req is None or self._global is None:
            return
        response = req.sam.tokens[req.num_prompt :]
        if response:  # indexed by the next overlap(), while the device runs a step
            self._finished.append(response)

    def abort_request(self, req_id: str) -> None:
        """Free an aborted request; its partial output does not join the global automaton."""
        self._requests.pop(req_id, None)

    @property
    def global_tokens(self) -> int:
        """Tokens the global automaton indexes now (corpus and kept responses, separators included)."""
        return 0 if self._global is None else len(self._global.tokens)

    def overlap(self) -> None:
        """Add the responses finished since the last call to the global automaton (and keep it within
        ``global_budget_tokens``). The engine calls this while the target computes a step; a new
        request flushes them first."""
        for response in self._finished:
            self._global.add_sequence(response)
            self._responses.append(response)
            self._response_tokens += len(response) + 1
        self._finished.clear()
        budget = self.global_budget_tokens
        if budget is not None and self._global is not None and self.global_tokens > budget:
            self._rebuild_global(budget // 2)

    def _rebuild_global(self, target_tokens: int) -> None:
        """Drop the oldest responses until at most ``target_tokens`` remain indexed (corpus first, it
        stays), rebuild the automaton, and restart every active request's matcher on it."""
        corpus_tokens = sum(len(d) + 1 for d in self._corpus)
        while self._responses and corpus_tokens + self._response_tokens > target_tokens:
            self._response_tokens -= len(self._responses.popleft()) + 1
        sam = SuffixAutomaton()
        for doc in self._corpus:
            sam.add_sequence(doc)
        for response in self._responses:
            sam.add_sequence(response)
        self._global = sam
        for req in self._requests.values():
            req.matcher = Matcher(sam)
            req.matcher.feed_many(req.sam.tokens)
        self.global_rebuilds += 1

    def _get(self, req_id: str) -> _Request:
        req = self._requests.get(req_id)
        if req is None:
            raise InvalidRequestError(f"req_id {req_id!r} is not active (call start_request first)")
        return req
