"""Request bodies. Unknown fields are accepted (and ignored), as OpenAI clients send many."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal


from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from engine.core.types import MAX_LOGPROBS, MAX_N, MAX_REPETITION_PENALTY
from service.errors import APIError

# Integers the engine takes travel as 64-bit values: larger ones are invalid input (400), not a
# failure to encode. Token ids keep the engine's own range check (below 0 or past the vocabulary).
INT64 = dict(ge=-(1 << 63), le=(1 << 63) - 1)
# the tokens a generation route asks for when the request names none; where the context or the
# KV cache leaves less room, the request generates what fits instead of being refused
DEFAULT_MAX_TOKENS = 256
TokenId = Annotated[StrictInt, Field(**INT64)]
COUNT_MAX = (1 << 31) - 1

_NUM = dict(allow_inf_nan=False)

# Parameters of the OpenAI API (and vLLM's extras) that this server does not implement yet, each
# with the values that ask for nothing (and so are accepted). A request that asks for one gets 400
# `unsupported_parameter` instead of an answer that silently ignores it. (Structured outputs and
# tools are implemented: service/structured.py, service/tools.py; so are logprobs, penalties,
# logit_bias, min_tokens and n: service/turns.py `sampling_params`.)
UNSUPPORTED: dict[str, Any] = {
    "functions": lambda v: not v,
    "function_call": lambda v: v in ("none", "auto"),
    "prompt_logprobs": lambda v: not v,
    "best_of": lambda v: v == 1,
    "suffix": lambda v: not v,
    # vLLM's and llama.cpp's sampling extras beyond those implemented (min_p, top_k,
    # repetition_penalty, stop_token_ids, min_tokens, ignore_eos)
    "typical_p": lambda v: v == 1,
    "use_beam_search": lambda v: not v,
    "length_penalty": lambda v: v == 1,
    "include_stop_str_in_output": lambda v: not v,
    "repeat_penalty": lambda v: v == 1,  # llama.cpp's name; this server's is repetition_penalty
    "mirostat": lambda v: not v,
    "tfs_z": lambda v: v == 1,
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    include_usage: bool | None = None  # a last chunk with the usage, and `usage: null` on the others


class NullIsDefault(BaseModel):
    """A request body in which an explicit null for a parameter with a default (`n`, `stream`,
    `echo`, `store`, ...) asks for that default, as the OpenAI API types them ("or null") and as
    clients that send every field, nulls included, expect."""

    _defaulted: ClassVar[frozenset[str]] = frozenset()  # the fields with a default other than None

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls._defaulted = frozenset(name for name, f in cls.model_fields.items()
                                   if not f.is_required() and f.default is not None)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        if isinstance(data, dict) and None in data.values():
            data = {k: v for k, v in data.items() if v is not None or k not in cls._defaulted}
        return data


class _Body(NullIsDefault):
    # strict: a number or boolean of another type ("5", 5.0 for an integer; "yes", 1 for a
    # boolean) is refused, as OpenAI refuses it, rather than coerced (an integer is a number)
    model_config = ConfigDict(extra="allow", ser_json_inf_nan="strings", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=INT64["le"])
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64["le"])
    temperature: float | None = Field(None, ge=0.0, le=2.0, **_NUM)
    top_p: float | None = Field(None, gt=0.0, le=1.0, **_NUM)
    top_k: int | None = Field(None, ge=-1, le=COUNT_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0, **_NUM)  # vLLM's; 0 = off
    seed: int | None = Field(None, **INT64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, **_NUM)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, **_NUM)
    # vLLM's extras: a repetition penalty over prompt and output (1 = off), EOS and stop token
    # ids banned until min_tokens tokens are generated, token ids that end the reply as EOS does
    repetition_penalty: float | None = Field(None, ge=1 / MAX_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY, **_NUM)
    min_tokens: int | None = Field(None, ge=0, le=INT64["le"])
    stop_token_ids: list[Annotated[int, Field(ge=0, le=COUNT_MAX)]] | None = Field(None, max_length=64)
    # token id (a string, as JSON object keys are) -> bias added to its logit
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0, **_NUM)]] | None = None
    session_id: str | None = None
    # each choice (streamed chunk or whole reply) also carries the ids of its tokens (`token_ids`)
    return_token_ids: bool = False

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 8 or any(not s for s in items):
            raise ValueError("stop must be up to 8 non-empty strings")
        return items

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v, info):
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only for stream: true")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        for key in v or {}:
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise ValueError(f"keys must be token ids (non-negative integers as strings), not {key!r}")
        return v

    def unsupported(self) -> str | None:
        """The first parameter this request asks for that the server does not implement, if any."""
        for name, value in (self.model_extra or {}).items():
            accepts = UNSUPPORTED.get(name)
            if accepts is not None and value is not None and not accepts(value):
                return name
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options is not None and self.stream_options.include_usage)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            if any(p.type != "text" for p in self.content):
                raise ValueError("only text content parts are supported")
            return "".join(p.text or "" for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Body):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool | None = False  # each token's logprob in choice.logprobs.content
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # and its most likely alternatives

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None (off) or how many top logprobs each token carries."""
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", "invalid_request", "top_logprobs")
            return None
        return self.top_logprobs or 0


# prompts in one completions request (each its own request to the engine, with its n choices)
MAX_PROMPTS = 256


class CompletionRequest(_Body):
    # a text, token ids (integers, not booleans), or a list of either: a choice per prompt
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # top logprobs per token (0: the token's own)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


# parameters the OpenAI routes implement and the session route does not (tools: a session turn
# renders only the messages it adds)
SESSION_UNSUPPORTED: dict[str, Any] = {
    "tools": lambda v: not v,
    "tool_choice": lambda v: v in ("none", "auto"),
}


class SessionGenerateRequest(_Body):
    # text (with BOS on the session's first turn) or token ids (appended as they are)
    input: str | list[TokenId] | None = None
    messages: list[Message] | None = Field(None, min_length=1)  # rendered with the chat template
    stream: bool = True
    # 0: append the input to the session without generating (the reply reports what it holds)
    max_tokens: int | None = Field(None, ge=0, le=INT64["le"])
    max_completion_tokens: int | None = Field(None, ge=0, le=INT64["le"])
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # as /v1/completions: top logprobs per token

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def unsupported(self) -> str | None:
        for name, value in (self.model_extra or {}).items():
            accepts = SESSION_UNSUPPORTED.get(name)
            if accepts is not None and value is not None and not accepts(value):
                return name
        return super().unsupported()


# ---- documented responses (the OpenAPI schema says what every route can answer) ----------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorEnvelope(BaseModel):
    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorEnvelope, "description": why}
    for status, why in [(400, "invalid request"), (401, "missing or invalid API key"),
                        (404, "unknown model, session or request"), (409, "the session has a turn in flight, or was stored under other model or KV settings"),
                        (410, "the session was evicted"), (413, "request body too large"),
                        (429, "queue or token budget full (see Retry-After), or the key's sessions at their limit"),
                        (503, "loading, draining, or the engine is dead")]
}
# generation routes answer JSON, or server-sent events when `stream` is true
STREAM_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "JSON, or server-sent events when stream is true: each event's data a JSON chunk, "
                         "the last `[DONE]`",
          "content": {"text/event-stream": {"schema": {  # one event
              "type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                             "retry": {"type": "integer"}}}}}},
}
