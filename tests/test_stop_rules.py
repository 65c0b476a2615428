"""Where a step's emitted tokens stop: the first that is an EOS, reaches ``max_new_tokens`` or fills the
context, checked in that order; nothing after it is kept."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings, strategies as st

from specdec import SamplingParams, SpecEngine
from specdec.sequence import Sequence


def _one_by_one(prompt_len, out_len, toks, eos, max_new, max_context, ignore_eos):
    """The rule, token by token: (tokens kept, finish reason or None)."""
    n_out = out_len
    for i, tok in enumerate(toks):
        n_out += 1
        if not ignore_eos and tok in eos:
            return i + 1, "eos"
        if n_out >= max_new:
            return i + 1, "length"
        if prompt_len + n_out >= max_context:
            return i + 1, "max_context"
    return len(toks), None


@settings(max_examples=400, deadline=None)
@given(prompt_len=st.integers(1, 20), out_len=st.integers(0, 20), toks=st.lists(st.integers(0, 9), max_size=12),
       eos=st.sets(st.integers(0, 9), max_size=3), headroom=st.integers(1, 15), ctx_room=st.integers(1, 15),
       ignore_eos=st.booleans())
def test_a_steps_tokens_stop_at_the_first_rule_that_fires(prompt_len, out_len, toks, eos, headroom, ctx_room, ignore_eos):
    max_new = out_len + headroom  # a running request has room for at least one more token
    max_context = prompt_len + out_len + ctx_room
    finished = []
    engine = SimpleNamespace(target=SimpleNamespace(eos_token_ids=tuple(eos), max_context=max_context),
                             _finish=lambda seq, reason: finished.append(reason))
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos)
    seq = Sequence("r", list(range(prompt_len)), params)
    seq.tokens += [7] * out_len
    new = SpecEngine._append(engine, seq, list(toks))
    kept, reason = _one_by_one(prompt_len, out_len, toks, eos, max_new, max_context, ignore_eos)
    assert new == toks[:kept]
    assert seq.tokens == list(range(prompt_len)) + [7] * out_len + toks[:kept]
    assert finished == ([reason] if reason else [])
