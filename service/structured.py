"""Structured outputs at the front end: a request's `response_format` (OpenAI), vLLM's
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, or vLLM's
`structured_outputs: {json | regex | choice | grammar | json_object}`, turned into one llguidance
grammar (its JSON text) that the engine enforces token by token (engine/core/structured.py).

The grammar is checked here, before the request reaches the engine: an invalid schema, regex or
grammar answers 400 with the parameter it came from, and nothing is submitted. Checks are cached
by the grammar's text (a schema sent again costs nothing) and run on a worker thread for large
schemas. JSON is generated compactly (`", "` and `": "` separators, no other whitespace), which
keeps a small model from wandering into whitespace.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from service.errors import APIError

# JSON output: the separators a model most often writes, and no free whitespace
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}
OFF_LOOP_CHARS = 4096  # grammars longer than this are checked on a worker thread


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", "invalid_request", param)


# keywords whose value is a schema, a list of schemas, or a map of names to schemas
_SUBSCHEMA = ("items", "additionalItems", "contains", "propertyNames", "not", "if", "then", "else",
              "additionalProperties", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMAS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: Any) -> Any:
    """`schema` with every object schema that lists its `properties`, and says nothing of
    others, taking only those (`additionalProperties: false`), as OpenAI's strict mode and
    vLLM's default backend read a schema: otherwise a model free to add properties writes on
    until max_tokens. A schema that allows others says so (`additionalProperties: true`)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in _SUBSCHEMA:
        if k in out:
            out[k] = closed_objects(out[k])
    for k in _SUBSCHEMAS:
        if isinstance(out.get(k), list):
            out[k] = [closed_objects(s) for s in out[k]]
    for k in _SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: closed_objects(s) for name, s in out[k].items()}
    if isinstance(out.get("properties"), dict) and not any(k in out for k in _OPEN):
        out["additionalProperties"] = False
    return out


def json_grammar(schema: Any, param: str) -> str:
    """An llguidance grammar for JSON that follows `schema` (a dict, or its JSON text; its
    objects closed, `closed_objects`)."""
    from llguidance import LLMatcher

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise _bad(param, f"the schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise _bad(param, "the schema must be a JSON object")
    try:
        return LLMatcher.grammar_from_json_schema(json.dumps(closed_objects(schema)), defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise _bad(param, str(exc)) from exc


def regex_grammar(regex: Any, param: str) -> str:
    from llguidance import LLMatcher

    if not isinstance(regex, str) or not regex:
        raise _bad(param, "the regex must be a non-empty string")
    return LLMatcher.grammar_from_regex(regex)


def choice_grammar(choices: Any, param: str) -> str:
    """Exactly one of the strings in `choices`."""
    from llguidance import LLMatcher

    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise _bad(param, "choice must be a non-empty list of non-empty strings")
    return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def lark_grammar(grammar: Any, param: str) -> str:
    """A Lark grammar (llguidance's dialect), or a GBNF one (rules written `name ::= ...`)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if not isinstance(grammar, str) or not grammar.strip():
        raise _bad(param, "the grammar must be a non-empty string")
    try:
        return LLMatcher.grammar_from_lark(any_to_lark(grammar))
    except Exception as exc:  # the GBNF conversion's own errors
        raise _bad(param, f"invalid grammar: {exc}") from exc


def _response_format(rf: Any) -> str | None:
    param = "response_format"
    if not isinstance(rf, dict):
        raise _bad(param, "must be an object with a type")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar(ANY_OBJECT, param)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad(param, "json_schema must be an object with a name and a schema")
        schema = spec.get("schema", ANY_OBJECT)
        return json_grammar(schema if schema is not None else ANY_OBJECT, param)
    raise _bad(param, f"type must be text, json_object or json_schema, not {kind!r}")


def _structured_outputs(so: Any) -> str | None:
    param = "structured_outputs"
    if not isinstance(so, dict):
        raise _bad(param, "must be an object")
    given = {k: v for k, v in so.items() if k in ("json", "regex", "choice", "grammar", "json_object")
             and v not in (None, False)}
    if len(given) > 1:
        raise _bad(param, f"give one of json, regex, choice, grammar, json_object (got {sorted(given)})")
    if not given:
        return None
    (kind, value), = given.items()
    if kind == "json_object":
        return json_grammar(ANY_OBJECT, param)
    return {"json": json_grammar, "regex": regex_grammar, "choice": choice_grammar,
            "grammar": lark_grammar}[kind](value, param)


_GUIDED = {"guided_json": json_grammar, "guided_regex": regex_grammar, "guided_choice": choice_grammar,
           "guided_grammar": lark_grammar}


def requested(body) -> tuple[str, str] | None:
    """(grammar, the parameter it came from) for what the body asks, or None for free text.
    Raises APIError (400) for a malformed request or more than one way of asking."""
    extra = body.model_extra or {}
    asked = [name for name in ("response_format", "structured_outputs", *_GUIDED)
             if extra.get(name) is not None]
    found = []
    for name in asked:
        value = extra[name]
        if name == "response_format":
            grammar = _response_format(value)
        elif name == "structured_outputs":
            grammar = _structured_outputs(value)
        else:
            grammar = _GUIDED[name](value, name)
        if grammar is not None:
            found.append((grammar, name))
    if len(found) > 1:
        raise _bad(found[1][1], f"only one structured output per request (also asked: {found[0][1]})")
    return found[0] if found else None


@lru_cache(maxsize=256)
def check(grammar: str) -> str:
    """'' when the grammar is valid, else why not (cached by the grammar's text)."""
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(grammar)


async def checked(state, grammar: str, param: str) -> str:
    """`grammar`, once it is valid (400 against `param` otherwise); large ones are checked off the
    event loop."""
    if len(grammar) > OFF_LOOP_CHARS:
        problem = await state.tokenizer_pool.run(check, grammar)
    else:
        problem = check(grammar)
    if problem:
        raise _bad(param, f"invalid: {problem}")
    return grammar


async def grammar_of(state, body) -> str | None:
    """The checked grammar the body asks for, or None."""
    asked = requested(body)
    if asked is None:
        return None
    return await checked(state, *asked)
