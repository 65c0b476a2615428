"""A request's state inside the engine, and what the engine hands back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from specdec.config import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class RequestStats:
    """Per-request speculation figures.

    Attributes:
        target_steps: target forwards this request took part in (prefill included).
        accepted_lengths: tokens emitted by each generation step (accepted drafts + 1).
        drafted: draft tokens proposed.
        accepted: draft tokens accepted.
        elapsed_s: wall time from admission to finish.
        num_output_tokens: tokens generated (set when the request finishes).
        drafter_faults: steps where the drafter raised or gave an invalid draft for this
            request (the request then decoded without that draft; see ``SpecEngine``).
    """

    target_steps: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    elapsed_s: float = 0.0
    num_output_tokens: int = 0
    drafter_faults: int = 0

    def __str__(self) -> str:
        return (f"{self.num_output_tokens} tokens in {self.elapsed_s:.2f} s ({self.tokens_per_s:.1f} tokens/s), "
                f"{self.target_steps} target steps, mean accepted length {self.mean_accepted_length:.2f}, "
                f"acceptance rate {self.acceptance_rate:.2f}" + (f", {self.drafter_faults} drafter faults"
                                                                 if self.drafter_faults else ""))

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per generation step (1.0 for plain decoding)."""
        return sum(self.accepted_lengths) / len(self.accepted_lengths) if self.accepted_lengths else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass(frozen=True, slots=True)
class GenerationOutput:
    """The result of one request.

    Attributes:
        req_id: the request's id.
        prompt_token_ids: the prompt as the target saw it (chat template applied).
        token_ids: generated tokens (an end-of-sequence token included, as HF does).
        text: generated text (special tokens skipped, cut before a stop string).
        finish_reason: why the request ended, ``None`` while it runs:

            - ``"eos"``: the target emitted an end-of-sequence token (kept in ``token_ids``);
            - ``"stop"``: a ``SamplingParams.stop`` string appeared (cut from ``text``);
            - ``"length"``: ``max_new_tokens`` tokens were generated;
            - ``"max_context"``: prompt + output reached the model's maximum context;
            - ``"kv_capacity"``: the request alone needs more KV pages than the whole pool
              holds (its prompt fit, its output outgrew the pool); raise ``num_pages`` /
              ``kv_cache_bytes`` or lower ``max_new_tokens``;
            - ``"abort"``: :meth:`SpecEngine.abort` or :meth:`SpecEngine.close` stopped it.
        stats: speculation figures.
    """

    req_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    stats: RequestStats


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What one ``step()`` produced for one request (for streaming)."""

    req_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None


@dataclass(eq=False, slots=True)
class Sequence:
    """A request inside the engine.

    ``tokens`` is prompt + output. The KV cache holds the first ``num_cached``
    of them; the next forward feeds ``tokens[num_cached:]`` (the whole prompt
    when prefilling, else the last token) plus any drafts.
    """

    req_id: str
    prompt_ids: list[int]
    params: SamplingParams
    tokens: list[int] = field(default_factory=list)
    num_cached: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    text: str = ""
    seed: int = 0  # the sampling seed: params.seed, or one drawn at add_request (see specdec.sampling)
    stats: RequestStats = field(default_factory=RequestStats)
    started_at: float = 0.0

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids):]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def is_prefill(self) -> bool:
        return self.num_cached < len(self.tokens) - 1

    def start(self) -> None:
        self.status = Status.RUNNING
        if not self.started_at:
            self.started_at = time.perf_counter()

    def finish(self, reason: str) -> None:
        self.status, self.finish_reason = Status.FINISHED, reason
        self.stats.elapsed_s = time.perf_counter() - self.started_at if self.started_at else 0.0
        self.stats.num_output_tokens = self.num_output
