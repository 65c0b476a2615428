"""CUDA-graph buckets: which generation steps replay a captured graph, which run eagerly.

A captured graph has fixed launch sizes, so a step replays the graph of the
smallest *bucket* that holds it, its inputs padded: extra tokens write to a
scratch slot and are ignored, extra requests have ``q_len = 0``. Buckets:

- requests: the next power of two, at most ``max_num_seqs``;
- tokens per request: 1 (decode) or ``1 + max_draft_tokens`` (verify, any draft length);
- tokens: the next power of two, between the bucket's requests and requests x tokens per request;
- context: the next power of two of the longest request's ``kv_len``, at least
  256 tokens, at most the model's context (it sizes the split-KV launch; the splits
  themselves start at fixed key offsets, :func:`split_chunk`).

With ``batch_invariant`` there is one bucket, the largest (``max_num_seqs``
requests x ``1 + max_draft_tokens`` tokens, the whole context, KV split at
fixed key offsets): every generation step then runs the same kernels, so a
token's logits do not depend on the draft length or on the other requests.

These are pure functions, tested on the CPU; :mod:`specdec.model_runner` uses them.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.errors import ConfigError

MIN_KV_BUCKET = 256
GRAPH_SPLIT_CHUNK = 256  # keys per KV split of graph steps (a multiple of every key tile)
MAX_GRAPH_SPLITS = 16
MAX_PROMPT_GRAPH_TOKENS = 512  # prompt steps up to this many tokens may replay a graph
MIN_PROMPT_BUCKET = 16


@dataclass(frozen=True, slots=True)
class GraphKey:
    """The launch sizes of one captured graph (a bucket), and its attention phase: ``"generation"``
    (decode / verify: logits of every token) or ``"context"`` (prompts: logits of each request's
    last token)."""

    num_seqs: int
    num_tokens: int
    max_q_len: int
    max_kv_len: int
    phase: str = "generation"


@dataclass(frozen=True, slots=True)
class GraphPolicy:
    """What the runner may capture.

    Attributes:
        max_num_seqs: most requests in a step (the engine's ``max_num_seqs``).
        max_draft_tokens: most draft tokens per request (k).
        max_context: most tokens a request may hold.
        batch_invariant: one bucket for every generation step (see module docstring).
        prompt_graphs: prompt-only steps of at most :data:`MAX_PROMPT_GRAPH_TOKENS` tokens replay
            graphs too (:func:`prompt_graph_key`).
    """

    max_num_seqs: int
    max_draft_tokens: int
    max_context: int
    batch_invariant: bool = False
    prompt_graphs: bool = False

    @property
    def verify_len(self) -> int:
        return 1 + self.max_draft_tokens


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (``n >= 1``)."""
    return 1 << max(0, n - 1).bit_length()


def split_chunk(max_kv_len: int) -> int:
    """Keys per KV split of a graph bucket's attention: 256 while that makes at most 16 splits,
    else the smallest power of two that does.

    Splits start at fixed key offsets (multiples of the chunk), so which keys a split sums, and
    in what order, does not depend on the step's other requests or draft lengths: every bucket
    of up to 4,096 keys gives a query row the same bits (a drafter's bf16 greedy output can then
    equal the null drafter's at any batch size). Splits past a request's keys are empty.
    """
    return max(GRAPH_SPLIT_CHUNK, next_pow2(-(-max_kv_len // MAX_GRAPH_SPLITS)))


def graph_key(policy: GraphPolicy, q_lens: list[int] | tuple[int, ...],
              kv_lens: list[int] | tuple[int, ...]) -> tuple[GraphKey | None, str]:
    """The bucket of a generation-only step, or ``None`` and why it must run eagerly.

    Args:
        policy: the runner's limits.
        q_lens: query tokens of each request (1 + its draft length).
        kv_lens: cached tokens of each request after this step's writes.
    """
    n = len(q_lens)
    if n == 0:
        return None, "no generation requests"
    if n > policy.max_num_seqs:
        return None, f"{n} requests > max_num_seqs {policy.max_num_seqs}"
    q = max(q_lens)
    if q > policy.verify_len:
        return None, f"a request feeds {q} tokens > 1 + max_draft_tokens = {policy.verify_len}"
    if max(kv_lens) > policy.max_context:
        return None, f"kv_len {max(kv_lens)} > max_context {policy.max_context}"
    if policy.batch_invariant:
        b, ql = policy.max_num_seqs, policy.verify_len
        return GraphKey(b, b * ql, ql, policy.max_context), ""
    b = min(next_pow2(n), policy.max_num_seqs)
    ql = 1 if q == 1 else policy.verify_len
    tokens = max(b, min(next_pow2(sum(q_lens)), b * ql))
    kv = min(max(next_pow2(max(kv_lens)), MIN_KV_BUCKET), policy.max_context)
    return GraphKey(b, tokens, ql, kv), ""


def prompt_graph_key(policy: GraphPolicy, q_lens: list[int] | tuple[int, ...],
                     kv_lens: list[int] | tuple[int, ...]) -> tuple[GraphKey | None, str]:
    """The bucket of a prompt-only (context) step, or ``None`` and why it must run eagerly.

    Requests round up to a power of two (at most ``max_num_seqs``); tokens to a power of two of at
    least 16, at most :data:`MAX_PROMPT_GRAPH_TOKENS`; the longest prompt to a power of two (at
    most the tokens); the context as for generation steps.
    """
    n = len(q_lens)
    if not policy.prompt_graphs:
        return None, "a context phase in the step"
    if n == 0:
        return None, "no context requests"
    if n > policy.max_num_seqs:
        return None, f"{n} requests > max_num_seqs {policy.max_num_seqs}"
    total = sum(q_lens)
    if total > MAX_PROMPT_GRAPH_TOKENS:
        return None, f"a prompt step of {total} tokens > {MAX_PROMPT_GRAPH_TOKENS}"
    if max(kv_lens) > policy.max_context:
        return None, f"kv_len {max(kv_lens)} > max_context {policy.max_context}"
    tokens = max(MIN_PROMPT_BUCKET, next_pow2(total))
    q = min(tokens, max(MIN_PROMPT_BUCKET, next_pow2(max(q_lens))))
    kv = min(max(next_pow2(max(kv_lens)), MIN_KV_BUCKET), policy.max_context)
    return GraphKey(min(next_pow2(n), policy.max_num_seqs), tokens, q, kv, "context"), ""


def single_prompt_buckets(policy: GraphPolicy, max_kv_len: int | None = None) -> list[tuple[GraphKey, int]]:
    """The buckets of one-request prompt steps (what a batch-1 server replays), each with a prompt
    length that falls in it; empty without ``prompt_graphs``."""
    if not policy.prompt_graphs:
        return []
    top = min(MAX_PROMPT_GRAPH_TOKENS, policy.max_context, max_kv_len or policy.max_context)
    out, length = [], MIN_PROMPT_BUCKET
    while True:
        n = min(length, top)
        key, _ = prompt_graph_key(policy, [n], [n])
        out.append((key, n))
        if n >= top:
            return out
        length *= 2


def all_buckets(policy: GraphPolicy, decode_only: bool = False,
                max_kv_len: int | None = None) -> list[tuple[GraphKey, list[int]]]:
    """Every bucket :func:`graph_key` can return under ``policy``, each with query lengths of a
    step that falls in it (what :meth:`ModelRunner.capture_buckets` runs to capture it).

    Args:
        policy: the runner's limits.
        decode_only: only single-token steps (a drafter that never drafts).
        max_kv_len: only context buckets up to the one holding this many tokens (default: all).

    Raises:
        ConfigError: ``max_kv_len`` is not a positive integer.
    """
    if max_kv_len is not None and (not isinstance(max_kv_len, int) or max_kv_len < 1):
        raise ConfigError(f"max_kv_len must be an integer >= 1 or None, got {max_kv_len!r}")
    kv_top = min(policy.max_context, max(MIN_KV_BUCKET, next_pow2(max_kv_len or policy.max_context)))
    kvs, kv = [], min(MIN_KV_BUCKET, kv_top)
    while True:
        kvs.append(min(kv, policy.max_context))
        if kv >= kv_top:
            break
        kv *= 2
    if policy.batch_invariant:
        b, v = policy.max_num_seqs, policy.verify_len
        return [(GraphKey(b, b * v, v, policy.max_context), [v] * b)]
    out, seen, v = [], set(), policy.verify_len
    for kv in kvs:
        for r in range(1, policy.max_num_seqs + 1):  # steps of r requests, totals r (decode) .. r * v
            for total in range(r, r + 1 if decode_only else r * v + 1):
                q, extra = [1] * r, total - r
                for i in range(r):
                    add = min(extra, v - 1)
                    q[i] += add
                    extra -= add
                key, _ = graph_key(policy, q, [kv] * r)
                if key is not None and key not in seen:
                    seen.add(key)
                    out.append((key, q))
    return out


def pad_step_into(out, key: GraphKey, input_ids: list[int], positions: list[int], slots: list[int],
                  scratch_slot: int) -> None:
    """Write a step's token inputs, padded to the bucket, into ``out`` (``[3, key.num_tokens]``:
    ids, positions, slots; e.g. a NumPy view of a pinned buffer). Padding tokens are token 0 at
    position 0, written to ``scratch_slot``; whatever ``out`` held before is overwritten.

    Raises:
        ValueError: the step has more tokens than the bucket.
    """
    n = len(input_ids)
    if n > key.num_tokens:
        raise ValueError(f"step has {n} tokens, more than its bucket's {key.num_tokens}")
    out[0, :n], out[1, :n], out[2, :n] = input_ids, positions, slots
    out[0, n:], out[1, n:], out[2, n:] = 0, 0, scratch_slot
