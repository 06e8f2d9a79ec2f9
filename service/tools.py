"""Tool calling on /v1/chat/completions: `tools`, `tool_choice`, tool results in the messages,
and `tool_calls` in replies.

The model writes a call as one JSON object, `{"name": <function>, "arguments": {...}}`:

- A chat template that takes `tools` (transformers' `apply_chat_template(tools=...)`) gets them
  and the conversation's calls and results in the OpenAI shape, as the template expects.
- Any other template (the embedded Gemma 3 has no tool format) gets a system preamble that lists
  the functions as JSON schemas and asks for that call format; a past call is rendered as that
  JSON in its assistant message, a tool result as a user message naming the function and call id
  (consecutive messages of one role are joined, for templates that want roles to alternate).

`tool_choice` `required` or a named function constrains the reply with a grammar (the JSON
schema of a call to any listed function, or to that one, with its `parameters` schema), so the
call is always valid JSON for the function's parameters. `auto` constrains it to "text that does
not start with `{`, or such a call": a reply that starts a JSON object is a valid call, any other
is plain text. `none` renders no tools and constrains nothing (past calls and results are still
rendered). A reply that is a call answers `tool_calls` (finish reason `tool_calls`).

With `parallel_tool_calls: true` a reply may hold several calls, one JSON object per line; the
grammar lets the model end after any call or start another on a new line, and the reply is calls
only if every line is one. Left out or false, a reply holds one call, as it does under a named
`tool_choice` (that function, once). OpenAI's API defaults to true; this server defaults to one
call because a small model that may add calls tends to repeat its call until max_tokens.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from service.errors import APIError, valid_text
from service.schemas import Message
from service.structured import JSON_OPTIONS, closed_objects, json_grammar

# a function's name, as OpenAI takes it
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")

PARAM = "tools"
NO_ARGS = {"type": "object", "properties": {}}  # a function without `parameters` takes none, as OpenAI reads it


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", "invalid_request", param)


@dataclass(frozen=True)
class ToolSetup:
    """A request's tools and what it lets the model do with them."""

    functions: tuple[dict, ...]  # {"name", "description"?, "parameters"?} per tool, as sent
    choice: str  # "auto" | "required" | "named"
    name: str | None = None  # the function a named choice forces
    parallel: bool = False  # several calls in one reply, one per line

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def call_schema(self) -> dict:
        """The JSON schema of a call this setup allows."""
        fns = [f for f in self.functions if self.name is None or f["name"] == self.name]
        alts = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                  "arguments": closed_objects(f.get("parameters") or NO_ARGS)},
                 "required": ["name", "arguments"], "additionalProperties": False} for f in fns]
        return alts[0] if len(alts) == 1 else {"anyOf": alts}

    def grammar(self) -> str:
        """The llguidance grammar a reply under this setup follows."""
        from llguidance import LLMatcher

        if self.forced and not self.parallel:
            return json_grammar(self.call_schema(), "tool_choice")
        schema = {**self.call_schema(), "x-guidance": JSON_OPTIONS}
        calls = 'calls: call ("\\n" call)*' if self.parallel else "calls: call"
        start = "start: calls" if self.forced else "start: TEXT | calls\nTEXT: /[^{\\s][\\s\\S]*/"
        return LLMatcher.grammar_from_lark(f"{start}\n{calls}\ncall: %json {json.dumps(schema)}\n")


def setup_of(body) -> ToolSetup | None:
    """The body's tools and tool choice, checked; None when no tool may be called."""
    extra = body.model_extra or {}
    tools, choice = extra.get("tools"), extra.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise _bad("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list):
        raise _bad(PARAM, "must be a list of functions")
    functions = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(PARAM, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        if not FUNCTION_NAME.fullmatch(fn["name"]):
            raise _bad(PARAM, f"tools[{i}].function.name must be 1-64 letters, digits, underscores or dashes, "
                              f"not {fn['name']!r}")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise _bad(PARAM, f"tools[{i}].function.parameters must be a JSON schema object")
        functions.append({k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise _bad(PARAM, "function names must be unique")
    parallel = extra.get("parallel_tool_calls", False)
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "must be true or false")
    if choice in (None, "auto"):
        return ToolSetup(tuple(functions), "auto", parallel=parallel)
    if choice == "none":
        return None
    if choice == "required":
        return ToolSetup(tuple(functions), "required", parallel=parallel)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise _bad("tool_choice", "must be none, auto, required or {'type': 'function', 'function': {'name': ...}}")
    if name not in names:
        raise _bad("tool_choice", f"no tool named {name!r}")
    return ToolSetup(tuple(functions), "named", name, parallel=False)  # that function, called once


def uses_tools(messages: list[Message]) -> bool:
    return any(m.role == "tool" or (m.model_extra or {}).get("tool_calls") for m in messages)


def template_takes_tools(tok) -> bool:
    return "tools" in (getattr(tok, "chat_template", None) or "")


def _calls(m: Message) -> list[dict]:
    """An assistant message's tool calls as (name, arguments dict, id)."""
    out = []
    for c in (m.model_extra or {}).get("tool_calls") or []:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad("messages", "an assistant tool call needs function.name and function.arguments")
        args = fn.get("arguments") or "{}"
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError as exc:
            raise _bad("messages", f"tool call arguments are not JSON: {exc}") from exc
        out.append({"id": c.get("id") or "", "name": fn["name"], "arguments": args})
    return out


def call_text(name: str, arguments: Any) -> str:
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


def preamble(setup: ToolSetup) -> str:
    listed = "\n".join(json.dumps(f, ensure_ascii=False) for f in setup.functions)
    ask = (f"You must call the function {setup.name}." if setup.choice == "named" else
           "You must call one of these functions." if setup.choice == "required" else
           "Call a function when it helps; otherwise answer in plain text.")
    several = " To call several at once, put each call's JSON object on a line of its own." if setup.parallel else ""
    return ("You can call functions. To call one, reply with only a JSON object "
            '{"name": <function name>, "arguments": <arguments object>} and nothing else.'
            f"{several} {ask}\nFunctions:\n{listed}")


def template_messages(tok, messages: list[Message], setup: ToolSetup | None) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) as the chat template takes them."""
    text = lambda m: valid_text(m.text(), "messages")  # noqa: E731
    if template_takes_tools(tok):
        out = []
        for m in messages:
            d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": text(m)}
            calls = _calls(m)
            if calls:
                d["tool_calls"] = [{"id": c["id"], "type": "function",
                                    "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
            if m.role == "tool":
                d["tool_call_id"] = (m.model_extra or {}).get("tool_call_id") or ""
            out.append(d)
        tools = [{"type": "function", "function": f} for f in setup.functions] if setup is not None else None
        return out, tools
    names = {c["id"]: c["name"] for m in messages for c in _calls(m)}
    out = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        content = text(m)
        if role == "assistant" and _calls(m):
            content = "\n".join([content] * bool(content) + [call_text(c["name"], c["arguments"]) for c in _calls(m)])
        elif role == "tool":
            cid = (m.model_extra or {}).get("tool_call_id") or ""
            role, content = "user", f"Result of {names.get(cid, 'the function')} (call {cid}): {content}"
        if out and out[-1]["role"] == role:
            out[-1]["content"] += "\n\n" + content
        else:
            out.append({"role": role, "content": content})
    if setup is not None:
        if out and out[0]["role"] == "system":
            out[0]["content"] = preamble(setup) + "\n\n" + out[0]["content"]
        else:
            out.insert(0, {"role": "system", "content": preamble(setup)})
    return out, None


def parse_calls(text: str, setup: ToolSetup) -> list[dict] | None:
    """The reply as OpenAI tool calls (one per line, several only where the setup allows), or
    None when it is not calls (plain text, or a call cut short by max_tokens)."""
    lines = [line.strip() for line in text.strip().split("\n") if line.strip()]
    if not lines or not lines[0].startswith("{") or (len(lines) > 1 and not setup.parallel):
        return None
    names = {f["name"] for f in setup.functions}
    calls = []
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in names or not isinstance(obj.get("arguments"), dict):
            return None
        calls.append(_call(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)))
    return calls


def _call(name: str, arguments: str) -> dict:
    """An OpenAI tool call of `name` with `arguments` (JSON text), under a new id."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


# the start of a call line as the grammar writes it: its name, then (once written) the arguments' key
_CALL_START = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*(,\s*"arguments"\s*:\s*)?')


def cut_calls(text: str, setup: ToolSetup) -> list[dict] | None:
    """A forced call that max_tokens cut short, as the calls it began: each line's function and
    its arguments' text so far (unfinished JSON, as OpenAI sends a call cut short). None where
    the reply is not a forced call or not even a function's name was written."""
    if not setup.forced:
        return None
    names = {f["name"] for f in setup.functions}
    calls = []
    for line in (line.strip() for line in text.strip().split("\n") if line.strip()):
        whole = parse_calls(line, setup)
        if whole is not None:
            calls += whole
            continue
        m = _CALL_START.match(line)
        if m is None:
            break
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            break
        if name not in names:
            break
        calls.append(_call(name, line[m.end():] if m.group(2) else ""))
        break  # the line max_tokens cut: nothing follows it
    return calls or None


def reply_calls(text: str, setup: ToolSetup, cut_short: bool) -> tuple[list[dict] | None, str | None]:
    """A reply under tools as calls, and the finish reason it answers with: whole calls
    `tool_calls`; a forced call that max_tokens cut short (`cut_short`) `length`; (None, None)
    where the reply is text."""
    calls = parse_calls(text, setup)
    if calls is not None:
        return calls, "tool_calls"
    cut = cut_calls(text, setup) if cut_short else None
    return (cut, "length") if cut is not None else (None, None)


class CallStream:
    """A streamed reply under tools: text goes out as it comes until the reply may be a call (a
    forced call from its start; under `auto` once its first character is `{`), which is held and
    sent whole as `tool_calls` at the end."""

    def __init__(self, setup: ToolSetup) -> None:
        self.setup = setup
        self.holding: bool | None = True if setup.forced else None  # None: not decided yet
        self.held = ""
        self.finish: str | None = None  # the calls' finish reason, once `end` found calls

    def feed(self, text: str) -> str:
        """The part of `text` to send now as content."""
        if self.holding is False:
            return text
        self.held += text
        if self.holding is None and self.held.strip():
            self.holding = self.held.lstrip().startswith("{")
            if not self.holding:
                out, self.held = self.held, ""
                return out
        return ""

    def end(self, cut_short: bool = False) -> tuple[str, list[dict] | None]:
        """(content still to send, the calls) once the reply is complete (`cut_short`: ended by
        max_tokens, so a forced call may be unfinished)."""
        calls, self.finish = reply_calls(self.held, self.setup, cut_short) if self.held else (None, None)
        if calls is not None:
            return "", calls
        out, self.held = self.held, ""
        return out, None
