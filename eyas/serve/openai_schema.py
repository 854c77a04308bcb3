"""OpenAI wire format: request validation with OpenAI-style errors, and response/chunk builders.

Requests are parsed from raw bytes here (not by FastAPI) so that every bad input gets the OpenAI error
shape {"error": {"message", "type", "param", "code"}} with status 400, never FastAPI's 422 body.
Parameters eyas cannot honour (n > 1, penalties, logprobs, tools, ...) are refused loudly rather than
silently ignored: a client that asks for them would otherwise get an answer it did not ask for.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

from ..engine.params import SEED_MAX, SEED_MIN

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_DEPTH = 32  # JSON nesting; the deepest OpenAI request field (messages[i].content[j].text) is 5 levels down


class APIError(Exception):
    """An error answered to the client as OpenAI-style JSON."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after  # seconds, sent as Retry-After (a 503 that a later retry may pass)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": _printable(self.message), "type": self.type,
                          "param": None if self.param is None else _printable(self.param), "code": self.code}}


def _printable(text: str) -> str:
    # an error quoting the client's input may quote a lone surrogate, which UTF-8 cannot encode: escape it
    # rather than fail to send the answer
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# ---- request models ------------------------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            kinds = sorted({p.get("type") for p in v if isinstance(p, dict)} - {"text"}, key=str)
            if kinds:
                raise ValueError(f"only text content parts are supported (found type {kinds}); this model reads text")
        return v


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: StrictStr
    max_tokens: StrictInt | None = Field(None, ge=1)
    # strict: a JSON number only (an int is one); true or "0.5" is a client bug to report, not to coerce
    temperature: StrictFloat = Field(1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(0, ge=0)  # extension (vLLM/SGLang have it); 0 = off
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    n: StrictInt = Field(1, ge=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # accepted only at their neutral values (checked in `_refuse_unsupported`)
    presence_penalty: StrictFloat = 0.0
    frequency_penalty: StrictFloat = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    user: StrictStr | None = None  # OpenAI bookkeeping, harmless to ignore
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None


# ---- what the server needs from a request --------------------------------------------------------

@dataclass
class GenRequest:
    """A validated request, reduced to what the generation path needs."""
    kind: Literal["chat", "completion"]
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    messages: list[dict[str, str]] | None = None  # chat
    prompt: str | list[int] | None = None  # completion: text or token ids


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        # pydantic names union members in the path ("str", "list[str]"); they are not parameters
        if isinstance(part, str) and ("[" in part or part in ("str", "int", "bool", "float", "function-after")):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _validation_error(e: ValidationError) -> APIError:
    errs = e.errors(include_url=False)
    first = errs[0]
    param = _loc(tuple(first["loc"]))
    if first["type"] == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    if first["type"] == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: '{param}'. eyas does not support it; "
                             "remove it from the request.", param=param, code="unknown_parameter")
    # a union reports one error per member; the member messages together say what was expected
    msgs = sorted({x["msg"] for x in errs if _loc(tuple(x["loc"])) == param}) or [first["msg"]]
    found = json.dumps(first.get("input"), default=str)
    if len(found) > 120:
        found = found[:117] + "..."
    return APIError(400, f"Invalid value for '{param}': {'; or '.join(msgs)} (found {found}).", param=param,
                    code="invalid_value")


def _refuse_unsupported(r: _Common) -> None:
    def refuse(param: str, why: str) -> None:
        raise APIError(400, f"'{param}' {why}", param=param, code="unsupported_parameter")

    if r.n != 1:
        refuse("n", f"must be 1: eyas serves one choice per request (got n={r.n}); send {r.n} requests instead.")
    if r.presence_penalty != 0 or r.frequency_penalty != 0:
        refuse("presence_penalty" if r.presence_penalty else "frequency_penalty",
               "is not supported: speculative verification here samples from the target's plain distribution; "
               "leave it at 0.")
    if r.logit_bias:
        refuse("logit_bias", "is not supported; remove it.")
    if r.logprobs not in (None, False, 0):
        refuse("logprobs", "is not supported; remove it.")
    if r.stream_options is not None and not r.stream:
        refuse("stream_options", "is only allowed when 'stream' is true.")


def _stop_list(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP:
        raise APIError(400, f"'stop' takes at most {MAX_STOP} sequences, got {len(stops)}.", param="stop",
                       code="invalid_value")
    if any(s == "" for s in stops):
        raise APIError(400, "'stop' sequences must be non-empty strings.", param="stop", code="invalid_value")
    return stops


def _path(parts: list[str | int]) -> str:
    text = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(parts))
    return _printable(text) or "body"


def _check_tree(obj: Any) -> None:
    """Refuse what json.loads accepts but nothing downstream can handle: nesting deeper than MAX_DEPTH
    (recursive code past this point, pydantic's and json.dumps', would hit Python's recursion limit) and
    strings holding a lone UTF-16 surrogate ("\\ud800" is valid JSON, but not Unicode: the tokenizer
    refuses it and the error answer could not even be encoded as UTF-8). Iterative: a hostile body must not
    be able to exhaust the stack here either."""
    stack: list[tuple[Any, list[str | int]]] = [(obj, [])]
    while stack:
        node, path = stack.pop()
        if len(path) > MAX_DEPTH:
            raise APIError(400, f"The request body nests JSON more than {MAX_DEPTH} levels deep (at "
                                f"'{_path(path[:8])}...'); OpenAI requests nest a few levels. Flatten it.",
                           code="invalid_json")
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            where = [*path, key]
            for text, what in ((key, "key"), (value, "value")):
                if isinstance(text, str):
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError as e:
                        bad = f"\\u{ord(text[e.start]):04x}"
                        raise APIError(400, f"The request body's {what} at '{_path(where)}' holds a lone UTF-16 "
                                            f"surrogate ({bad} at character {e.start}), which is not Unicode text. "
                                            "Send characters outside the BMP as a complete surrogate pair, or "
                                            "as raw UTF-8.", param=_path(where), code="invalid_value") from None
            if isinstance(value, (dict, list)):
                stack.append((value, where))


def _load_json(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"The request body is not valid JSON ({e}). Send a JSON object with "
                            "Content-Type: application/json.", code="invalid_json") from e
    except RecursionError:
        raise APIError(400, f"The request body nests JSON too deeply to parse; at most {MAX_DEPTH} levels are "
                            "accepted and OpenAI requests nest a few. Flatten it.", code="invalid_json") from None
    except ValueError as e:  # Python refuses to read an integer of more than 4300 digits
        raise APIError(400, f"The request body holds a number too long to read ({e}). Every numeric parameter "
                            "here fits in 20 digits; send a smaller number.", code="invalid_value") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"The request body must be a JSON object, found {type(obj).__name__}.",
                       code="invalid_json")
    _check_tree(obj)
    return obj


def _common_fields(r: _Common, kind: str, max_tokens: int | None) -> dict[str, Any]:
    return dict(kind=kind, model=r.model, stream=r.stream,
                include_usage=bool(r.stream_options and r.stream_options.include_usage), max_tokens=max_tokens,
                temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, stop=_stop_list(r.stop), seed=r.seed)


def _validated(model: type[_Common], body: bytes) -> Any:
    """The body as `model` (400 on bad JSON or fields), refusing what neither endpoint supports."""
    try:
        r = model.model_validate(_load_json(body))
    except ValidationError as e:
        raise _validation_error(e) from None
    _refuse_unsupported(r)
    return r


def parse_chat(body: bytes) -> GenRequest:
    r = _validated(ChatRequest, body)
    if r.tools or r.tool_choice not in (None, "none"):
        raise APIError(400, "'tools' are not supported by eyas; remove them.", param="tools",
                       code="unsupported_parameter")
    if r.top_logprobs:
        raise APIError(400, "'top_logprobs' is not supported; remove it.", param="top_logprobs",
                       code="unsupported_parameter")
    if r.response_format and r.response_format.get("type", "text") != "text":
        raise APIError(400, "'response_format' other than {\"type\": \"text\"} is not supported.",
                       param="response_format", code="unsupported_parameter")
    if r.max_tokens is not None and r.max_completion_tokens is not None and r.max_tokens != r.max_completion_tokens:
        raise APIError(400, f"'max_tokens' ({r.max_tokens}) and 'max_completion_tokens' ({r.max_completion_tokens}) "
                            "disagree; send only one.", param="max_completion_tokens", code="invalid_value")
    messages = []
    for m in r.messages:
        text = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
        # "developer" is OpenAI's newer name for the system role
        messages.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    return GenRequest(messages=messages, **_common_fields(r, "chat", r.max_completion_tokens or r.max_tokens))


def parse_completion(body: bytes) -> GenRequest:
    r = _validated(CompletionRequest, body)
    if r.echo or r.suffix or (r.best_of not in (None, 1)):
        param = "echo" if r.echo else ("suffix" if r.suffix else "best_of")
        raise APIError(400, f"'{param}' is not supported; remove it.", param=param, code="unsupported_parameter")
    prompt: Any = r.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"'prompt' holds {len(prompt)} prompts; eyas serves one prompt per request. "
                                "Send them as separate requests.", param="prompt", code="unsupported_parameter")
        prompt = prompt[0]
    if len(prompt) == 0:
        raise APIError(400, "'prompt' is empty; send a non-empty string or list of token ids.", param="prompt",
                       code="invalid_value")
    return GenRequest(prompt=prompt, **_common_fields(r, "completion", r.max_tokens))


# ---- responses -----------------------------------------------------------------------------------

def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(kind: str, rid: str, created: int, model: str, text: str, finish_reason: str,
                    prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                  "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens), "system_fingerprint": None}


def chunk_body(kind: str, rid: str, created: int, model: str, text: str | None, finish_reason: str | None,
               include_usage: bool, first: bool = False) -> dict[str, Any]:
    """One streamed chunk. Chat: the first chunk carries the role; the last an empty delta + finish_reason."""
    if kind == "chat":
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    out: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
                           "system_fingerprint": None}
    if include_usage:
        out["usage"] = None  # OpenAI: null on every chunk but the final usage chunk
    return out


def usage_chunk(kind: str, rid: str, created: int, model: str, prompt_tokens: int,
                completion_tokens: int) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created, "model": model, "choices": [], "system_fingerprint": None,
            "usage": usage(prompt_tokens, completion_tokens)}


def model_card(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "eyas"}


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def now() -> int:
    return int(time.time())
