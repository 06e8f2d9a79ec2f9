"""The OpenAI Responses API's data: the request body, its input as chat messages, and the
response object and stream events as OpenAI writes them (the routes: service/routes/responses.py).

A response's input is a string (one user message) or a list of message items (role user, system,
developer or assistant; content a string or `input_text` parts); `instructions` is a system
message before it. Everything is rendered with the tokenizer's chat template, as
/v1/chat/completions renders messages. Parameters of the API that this server does not implement
answer 400 `unsupported_parameter` naming the parameter when they ask for something.
`text.format` `json_object` and `json_schema` constrain the reply as `response_format` does on
/v1/chat/completions (service/structured.py).
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import ConfigDict, Field, field_validator

from engine import FinishReason, SamplingParams
from service.errors import APIError, valid_text
from service.schemas import DEFAULT_MAX_TOKENS, INT64, NullIsDefault
from service.structured import ANY_OBJECT, json_grammar


# Parameters of the Responses API that this server does not implement, each with the values that
# ask for nothing (and so are accepted).
UNSUPPORTED: dict[str, Any] = {
    "tools": lambda v: not v,
    "tool_choice": lambda v: v in ("none", "auto"),
    "max_tool_calls": lambda v: True,  # no tools: nothing to bound
    "parallel_tool_calls": lambda v: True,
    "reasoning": lambda v: not v or (isinstance(v, dict) and all(x is None for x in v.values())),
    "text": lambda v: isinstance(v, dict) and _text_refused(v) is None,
    "include": lambda v: not v,
    "truncation": lambda v: v == "disabled",
    "background": lambda v: not v,
    "prompt": lambda v: not v,
    "conversation": lambda v: not v,
    "top_logprobs": lambda v: not v,
    "context_management": lambda v: not v,
    "service_tier": lambda v: v in ("auto", "default"),
}


def _text_refused(text: dict) -> str | None:
    """The part of `text` that asks for something this server does not do, if any."""
    fmt = text.get("format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") in ("text", "json_object", "json_schema")):
        return "text.format"
    return next((f"text.{k}" for k, v in text.items() if k != "format" and v is not None), None)


def text_format(body: ResponsesRequest) -> dict:
    """`text.format` as the response echoes it (plain text when the body names none)."""
    fmt = ((body.model_extra or {}).get("text") or {}).get("format")
    return fmt if isinstance(fmt, dict) else {"type": "text"}


def text_grammar(body: ResponsesRequest) -> str | None:
    """The grammar `text.format` asks for: any JSON object (`json_object`), JSON that follows
    `schema` (`json_schema`, which names its format in `name`), or None for plain text."""
    fmt = text_format(body)
    if fmt["type"] == "json_object":
        return json_grammar(ANY_OBJECT, "text.format")
    if fmt["type"] != "json_schema":
        return None
    if not isinstance(fmt.get("name"), str) or not fmt["name"]:
        raise APIError(400, "text.format: a json_schema format needs a name", "invalid_request", "text.format.name")
    schema = fmt.get("schema")
    return json_grammar(ANY_OBJECT if schema is None else schema, "text.format")


class ResponsesRequest(NullIsDefault):
    """POST /v1/responses. Unknown fields are accepted (and ignored), as on the other routes."""

    model_config = ConfigDict(extra="allow", strict=True)  # as the other routes' (schemas._Body)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64["le"])
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):
        if v is not None and (len(v) > 16 or any(len(k) > 64 or len(x) > 512 for k, x in v.items())):
            raise ValueError("up to 16 pairs, keys up to 64 characters, values up to 512")
        return v

    def unsupported(self) -> str | None:
        """The first parameter this request asks for that the server does not implement, if any."""
        for name, value in (self.model_extra or {}).items():
            accepts = UNSUPPORTED.get(name)
            if accepts is not None and value is not None and not accepts(value):
                return (isinstance(value, dict) and name == "text" and _text_refused(value)) or name
        return None


def check_supported(body: ResponsesRequest) -> None:
    name = body.unsupported()
    if name is not None:
        raise APIError(400, f"{name} is not supported by this server; leave it out (or at its default)",
                       "unsupported_parameter", name)


def _text(content, where: str, part_types: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return valid_text(content, where)
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of parts", "invalid_request", where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in part_types:
            raise APIError(400, f"{where}[{j}]: content parts of type {kind!r} are not supported (only "
                           f"{' and '.join(part_types)})", "unsupported_parameter", f"{where}[{j}].type")
        if not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}[{j}].text must be a string", "invalid_request", f"{where}[{j}].text")
        out.append(valid_text(part["text"], where))
    return "".join(out)


def input_messages(body: ResponsesRequest) -> list[dict[str, str]]:
    """The messages this response adds to its conversation: the instructions (a system message),
    then the input, as the chat template takes them (`developer` is the system role)."""
    messages = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": valid_text(body.instructions, "instructions")})
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": valid_text(body.input, "input")}]
    if not body.input:
        raise APIError(400, "input: give a string or at least one message", "invalid_request", "input")
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        if kind != "message":
            raise APIError(400, f"input[{i}]: items of type {kind!r} are not supported (only messages)",
                           "unsupported_parameter", f"input[{i}].type")
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise APIError(400, f"input[{i}].role must be user, system, developer or assistant",
                           "invalid_request", f"input[{i}].role")
        parts = ("output_text",) if role == "assistant" else ("input_text",)
        text = _text(item.get("content"), f"input[{i}].content", parts)
        messages.append({"role": "system" if role == "developer" else role, "content": text})
    return messages


def sampling(body: ResponsesRequest, stop_token_ids: tuple[int, ...], grammar: str | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=body.max_output_tokens or DEFAULT_MAX_TOKENS,
        max_tokens_fit=not body.max_output_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        stop_token_ids=stop_token_ids,
        grammar=grammar,
    )


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" \
        else []
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def usage(input_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def status_of(reason: FinishReason | None) -> str:
    return "incomplete" if reason == FinishReason.LENGTH else "completed"


def response_object(response_id: str, created: int, model: str, body: ResponsesRequest, params: SamplingParams,
                    status: str, output: list[dict], usage_: dict | None = None, error: dict | None = None) -> dict:
    """The response object as OpenAI's API answers it (`status`: in_progress, completed,
    incomplete or failed)."""
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status,
        "background": False, "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "max_tool_calls": None,
        "model": model, "output": output, "parallel_tool_calls": True,
        "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
        "service_tier": "default", "store": body.store, "temperature": params.temperature,
        "text": {"format": text_format(body)}, "tool_choice": "auto", "tools": [], "top_logprobs": 0,
        "top_p": params.top_p, "truncation": "disabled", "usage": usage_, "user": body.user,
        "metadata": body.metadata or {},
    }


def output_text(obj: dict) -> str:
    """The text of a response object's message items (the SDK's `output_text`)."""
    return "".join(c["text"] for item in obj["output"] if item["type"] == "message"
                   for c in item["content"] if c["type"] == "output_text")


def input_item(response_id: str, index: int, message: dict[str, str]) -> dict:
    """A stored input message as `GET /v1/responses/{id}/input_items` lists it."""
    part = {"type": "input_text", "text": message["content"]}
    if message["role"] == "assistant":  # an output part has its annotations (none), as in a response's output
        part = {"type": "output_text", "text": message["content"], "annotations": []}
    return {"id": f"msg_{response_id.removeprefix('resp_')}{index:04d}", "type": "message", "status": "completed",
            "role": message["role"], "content": [part]}
