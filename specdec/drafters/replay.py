"""Replay harness: measure a drafter's acceptance without a target model.

The ground-truth response stands in for the target (greedy verification): each
step the drafter proposes, the longest prefix of the draft that equals the next
response tokens is accepted, and the response token after it is the bonus.
Those tokens go back to the drafter through ``on_accepted``, exactly as the
engine would send them. Sequences run one after another, so a drafter with
cross-request memory (the suffix drafter's global automaton) learns from the
earlier ones.

Example::

    from specdec.drafters.replay import replay
    from specdec.drafters.suffix_automaton import SuffixAutomatonDrafter

    pairs = [([1, 2, 3, 4, 5, 9], [1, 2, 3, 4, 5, 7]),  # (prompt, response)
             ([8, 8], [1, 2, 3, 4, 5, 7])]
    stats = replay(SuffixAutomatonDrafter(max_draft_tokens=4), pairs, max_tokens=4)
    print(stats.mean_accepted_length, stats.acceptance_rate)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from specdec.drafters.base import Draft, Drafter
from specdec.errors import ConfigError, SpecDecError

__all__ = ["ReplayStats", "replay"]


@dataclass(frozen=True, slots=True)
class ReplayStats:
    """Totals of one :func:`replay` run.

    Attributes:
        steps: verify steps (each emits at least one token).
        tokens: tokens emitted (accepted drafts + bonus tokens) = response tokens.
        drafted: draft tokens proposed.
        accepted: draft tokens accepted.
    """

    steps: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per step (accepted + bonus); 1.0 means no speed-up, 0.0 if no step."""
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted draft tokens; 0.0 if nothing was drafted."""
        return self.accepted / self.drafted if self.drafted else 0.0


def _accepted_count(draft: Draft, truth: Sequence[int], start: int) -> int:
    """Number of draft tokens accepted against the ground truth ``truth[start:]``.

    A chain is accepted up to its first mismatch.
    """
    tokens = draft.token_ids
    remaining = len(truth) - start
    n = 0
    limit = min(len(tokens), remaining)
    while n < limit and tokens[n] == truth[start + n]:
        n += 1
    return n


def replay(drafter: Drafter, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], max_tokens: int) -> ReplayStats:
    """Feed ground-truth ``(prompt, response)`` pairs through ``drafter``.

    For each pair, in order: ``start_request(prompt)``; then until the response
    is consumed: ``propose([req_id], max_tokens)``, accept the matching draft
    prefix, emit accepted + one bonus token (none past the response end) via
    ``on_accepted``; finally ``stop_request``.

    Args:
        drafter: the drafter under test (fresh, or warmed up on purpose).
        sequences: ``(prompt_token_ids, response_token_ids)`` pairs.
        max_tokens: draft budget passed to every ``propose`` call (>= 0).

    Returns:
        The totals over all sequences.

    Raises:
        ConfigError: ``max_tokens`` is negative or not an int.
        SpecDecError: the drafter returned the wrong number of drafts or a
            draft longer than ``max_tokens``.
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise ConfigError(f"max_tokens must be an int >= 0, got {max_tokens!r}")
    steps = tokens = drafted = accepted = 0
    for i, (prompt, response) in enumerate(sequences):
        req_id = f"replay-{i}"
        response = list(response)
        drafter.start_request(req_id, list(prompt))
        pos = 0
        while pos < len(response):
            drafts = drafter.propose([req_id], max_tokens)
            drafter.overlap()  # where the engine calls it: while the target verifies
            if len(drafts) != 1 or len(drafts[0]) > max_tokens:
                raise SpecDecError(
                    f"drafter {type(drafter).__name__} must return one draft of <= {max_tokens} tokens, got {drafts!r}"
                )
            n = _accepted_count(drafts[0], response, pos)
            emitted = response[pos : pos + n + 1]
            drafter.on_accepted(req_id, emitted)
            steps += 1
            tokens += len(emitted)
            drafted += len(drafts[0])
            accepted += n
            pos += len(emitted)
        drafter.stop_request(req_id)
    return ReplayStats(steps=steps, tokens=tokens, drafted=drafted, accepted=accepted)
