"""The OpenAI request and response shapes: parsing a request body into a :class:`Job`, errors
as OpenAI error bodies, and the response / stream-chunk dictionaries.

Only what the engine can do is accepted: one choice (``n = 1``), no logprobs, no echo, no
penalties or logit bias. Anything else is an :class:`APIError` (HTTP 400) naming the field.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from specdec.config import SamplingParams
from specdec.errors import InvalidRequestError
from specdec.sequence import GenerationOutput, RequestStats

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
           "n", "user", "ignore_eos", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs"}
FIELDS = {
    "completion": _COMMON | {"prompt", "echo", "best_of", "suffix"},
    "chat": _COMMON | {"messages", "max_completion_tokens", "top_logprobs"},
}
# SamplingParams field -> the request field a user wrote
_PARAM_OF = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
             "stop": "stop", "ignore_eos": "ignore_eos", "seed": "seed"}
_ROLES = ("system", "user", "assistant")
#: engine finish reasons as OpenAI names them
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "max_context": "length",
                  "kv_capacity": "length", "abort": "abort"}


class APIError(Exception):
    """An error answered as an OpenAI error body (``{"error": {message, type, param, code}}``).

    Args:
        status: the HTTP status (400 bad input, 429 overload, 503 shutting down, ...).
        message: what is wrong and the values allowed.
        param: the request field at fault, if one is.
        type: the OpenAI error type.
        code: a short machine-readable code.
    """

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        """The JSON body of the error response."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    """An HTTP 400 error naming ``param``."""
    return APIError(400, message, param, code=code)


@dataclass(frozen=True, slots=True)
class Job:
    """One validated request, before tokenization.

    Attributes:
        kind: ``"completion"`` or ``"chat"``.
        prompt: a string or token ids (completion), or ``[{"role", "content"}]`` messages (chat).
        params: sampling parameters; ``max_new_tokens`` is a placeholder when ``max_tokens`` is None.
        max_tokens: the most tokens asked for; ``None`` means up to the model's context.
        stream: answer as server-sent events.
        include_usage: a streamed answer ends with a chunk holding ``usage``.
    """

    kind: str
    prompt: str | list
    params: SamplingParams
    max_tokens: int | None
    stream: bool
    include_usage: bool

    @property
    def prompt_param(self) -> str:
        """The request field holding the prompt."""
        return "prompt" if self.kind == "completion" else "messages"


def parse_job(body: object, kind: str, model_name: str) -> Job:
    """Validate a request body of ``/v1/completions`` (``kind="completion"``) or
    ``/v1/chat/completions`` (``kind="chat"``).

    Raises:
        APIError: HTTP 400 naming the field: not a JSON object, an unknown or unsupported field,
            a wrong model, a missing or malformed prompt, an invalid sampling parameter.
    """
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}", None, "invalid_json")
    unknown = sorted(set(body) - FIELDS[kind])
    if unknown:
        raise bad(f"unsupported field(s) {unknown}; supported: {sorted(FIELDS[kind])}", unknown[0],
                  "unsupported_field")
    model = body.get("model")
    if model != model_name:
        raise APIError(400, f"model must be {model_name!r} (see /v1/models), got {model!r}", "model",
                       code="model_not_found")
    _check_unsupported(body, kind)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad(f"stream must be true or false, got {stream!r}", "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(opts, dict) or set(opts) - {"include_usage"} or not isinstance(
                opts.get("include_usage", False), bool):
            raise bad(f"stream_options must be {{\"include_usage\": true|false}}, got {opts!r}", "stream_options")
        include_usage = opts.get("include_usage", False)
    prompt = _prompt(body) if kind == "completion" else _messages(body)
    max_key = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = body.get(max_key, 16 if kind == "completion" else None)
    return Job(kind, prompt, sampling_params(body, max_tokens, max_key), max_tokens, stream, include_usage)


def sampling_params(body: dict, max_tokens, max_key: str = "max_tokens") -> SamplingParams:
    """The request's :class:`SamplingParams` (OpenAI defaults: temperature 1, top-p 1).

    Raises:
        APIError: HTTP 400 naming the field ``SamplingParams`` refused.
    """
    stop = body.get("stop")
    kw = dict(max_new_tokens=1 if max_tokens is None else max_tokens,
              temperature=_default(body, "temperature", 1.0), top_p=_default(body, "top_p", 1.0),
              top_k=_default(body, "top_k", 0), stop=() if stop is None else stop,
              ignore_eos=_default(body, "ignore_eos", False), seed=body.get("seed"))
    if isinstance(kw["stop"], list):
        kw["stop"] = tuple(kw["stop"])
    try:
        return SamplingParams(**kw)
    except InvalidRequestError as e:
        field = str(e).split()[0]
        param = max_key if field == "max_new_tokens" else _PARAM_OF.get(field)
        message = str(e).replace("max_new_tokens", max_key, 1)
        raise bad(message, param) from None


def _default(body: dict, key: str, value):
    return value if body.get(key) is None else body[key]


def _check_unsupported(body: dict, kind: str) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise bad(f"n must be 1 (this server returns one choice per request), got {n!r}", "n", "unsupported_value")
    if kind == "completion":
        if body.get("best_of") not in (None, 1):
            raise bad(f"best_of must be 1, got {body['best_of']!r}", "best_of", "unsupported_value")
        if body.get("echo") not in (None, False):
            raise bad(f"echo must be false (not supported), got {body['echo']!r}", "echo", "unsupported_value")
        if body.get("suffix") is not None:
            raise bad("suffix is not supported", "suffix", "unsupported_value")
    for key in ("logprobs", "top_logprobs"):
        if body.get(key) not in (None, False):
            raise bad(f"{key} is not supported (must be null or false), got {body[key]!r}", key, "unsupported_value")
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise bad(f"{key} must be 0 (penalties are not supported: they would change the target's "
                      f"distribution), got {body[key]!r}", key, "unsupported_value")
    if body.get("logit_bias"):
        raise bad("logit_bias must be empty (not supported)", "logit_bias", "unsupported_value")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad(f"user must be a string, got {body['user']!r}", "user")


def _prompt(body: dict) -> str | list:
    """``prompt``: a string or a list of token ids; a one-element list of either is that prompt."""
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt is required: a non-empty string or a list of token ids", "prompt", "missing_field")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise bad(f"prompt must be one prompt (a string or a list of token ids); this server takes one "
                      f"prompt per request, got a batch of {len(prompt)}", "prompt", "unsupported_value")
        prompt = prompt[0]
    if not isinstance(prompt, (str, list)):
        raise bad(f"prompt must be a non-empty string or a list of token ids, got {type(prompt).__name__}", "prompt")
    if not prompt:
        raise bad(f"prompt must be a non-empty string or token-id list, got {prompt!r}", "prompt")
    return prompt


def _messages(body: dict) -> list[dict]:
    """``messages``: ``[{"role": system|user|assistant, "content": text or [{"type": "text", "text"}]}]``."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad(f"messages must be a non-empty list of {{\"role\", \"content\"}} objects, got {msgs!r:.80}",
                  "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise bad(f"messages[{i}] must be an object with role in {list(_ROLES)}, got {m!r:.80}", f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"messages[{i}].content parts must be {{\"type\": \"text\", \"text\": ...}} "
                          f"(text only), got {content!r:.80}", f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string, got {content!r:.80}", f"messages[{i}].content")
        out.append({"role": m["role"], "content": content})
    if not any(m["content"] for m in out):
        raise bad("messages must hold some text, got only empty contents", "messages")
    return out


# -- responses -----------------------------------------------------------------
def new_id(kind: str) -> str:
    """A response id: ``cmpl-...`` or ``chatcmpl-...``."""
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex[:24]


def usage(out: GenerationOutput) -> dict:
    """OpenAI ``usage`` plus the request's speculation figures."""
    s: RequestStats = out.stats
    n_prompt, n_out = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "target_steps": s.target_steps, "drafted_tokens": s.drafted, "accepted_tokens": s.accepted,
            "mean_accepted_length": round(s.mean_accepted_length, 4)}


def response(kind: str, rid: str, model: str, out: GenerationOutput) -> dict:
    """The whole (non-streamed) answer."""
    reason = FINISH_REASONS.get(out.finish_reason, out.finish_reason)
    if kind == "completion":
        choice = {"index": 0, "text": out.text, "token_ids": list(out.token_ids), "logprobs": None,
                  "finish_reason": reason}
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
                  "finish_reason": reason}
    return {"id": rid, "object": "text_completion" if kind == "completion" else "chat.completion",
            "created": int(time.time()), "model": model, "choices": [choice], "usage": usage(out)}


def chunk(kind: str, rid: str, model: str, text: str | None, token_ids: list[int], finish_reason: str | None,
          role: bool = False) -> dict:
    """One streamed chunk; ``text=None`` with ``role`` is a chat stream's opening chunk."""
    reason = FINISH_REASONS.get(finish_reason, finish_reason)
    if kind == "completion":
        choice = {"index": 0, "text": text or "", "token_ids": token_ids, "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    else:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "token_ids": token_ids, "logprobs": None, "finish_reason": reason}
        obj = "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(kind: str, rid: str, model: str, out: GenerationOutput) -> dict:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(out)}
