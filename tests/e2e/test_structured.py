"""Structured outputs and tool calls through a real server and real clients (LangChain over the
OpenAI SDK, httpx): replies follow their schemas, tool calls round-trip, bad schemas change
nothing."""

import asyncio
import json

import httpx
import jsonschema
import pytest
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["n"],
     "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "size": {"type": "integer", "minimum": 1, "maximum": 9}},
     "required": ["color", "size"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[A-Za-z]{1,8}$"}}, "required": ["name"],
     "additionalProperties": False},
]


def _body(i: int) -> tuple[str, dict]:
    """Generation i: schema i % 5, a seed of its own, through one of the three ways of asking."""
    schema, way = SCHEMAS[i % 5], (i // 5) % 3
    common = {"max_tokens": 40, "temperature": 0.9, "seed": i}
    if way == 0:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": "Reply in JSON."}],
                                        "response_format": {"type": "json_schema",
                                                            "json_schema": {"name": f"s{i % 5}", "schema": schema,
                                                                            "strict": True}}}
    if way == 1:
        return "/v1/completions", {**common, "prompt": "JSON:", "guided_json": schema}
    return "/v1/completions", {**common, "prompt": "Data:", "structured_outputs": {"json": schema}}


def test_100_generations_follow_5_schemas(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            gate = asyncio.Semaphore(16)

            async def one(i):
                path, body = _body(i)
                async with gate:
                    r = await client.post(path, json=body)
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                return i, choice.get("text", (choice.get("message") or {}).get("content")), choice["finish_reason"]
            return await asyncio.gather(*(one(i) for i in range(100)))

    results = asyncio.run(run())
    for i, text, finish in results:
        assert finish == "stop", (i, text)
        jsonschema.validate(json.loads(text), SCHEMAS[i % 5])
    assert len({text for _, text, _ in results}) > 10  # sampled, not one answer per schema
    server.wait_idle()
    server.check_invariants()


def test_bad_schema_is_400_and_changes_nothing(server):
    server.wait_idle()
    before = server.stats()
    bad = [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                     "response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "response_format"),
           ("/v1/completions", {"prompt": "x", "guided_json": {"properties": {"a": {"$ref": "#/nope"}}}}, "guided_json"),
           ("/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": "start: nope"}}, "structured_outputs")]
    for path, body, param in bad:
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    after = server.stats()
    assert after.counters == before.counters and after.rows_used == before.rows_used == 0
    server.check_invariants()


class City(BaseModel):
    name: str = Field(max_length=12)
    population: int = Field(ge=0, le=100_000_000)


def _llm(server, max_tokens=40) -> ChatOpenAI:
    return ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=server.state.model_name,
                      temperature=0, max_tokens=max_tokens, max_retries=0)


def test_langchain_structured_output(server):
    city = _llm(server).with_structured_output(City, method="json_schema").invoke(
        "Name a large city and its population.")
    assert isinstance(city, City) and city.name


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"It is sunny and 21 C in {city}."


def test_langchain_tool_round_trip(server):
    """call -> tool result -> final answer, with LangChain's own tool-calling path; the final
    request's prompt is the conversation rendered as docs/structured-outputs.md says (checked
    against the chat template directly), and a streamed call is the same call."""
    question = HumanMessage("What is the weather in Paris?")
    call_llm = _llm(server).bind_tools([get_weather], tool_choice="get_weather")
    ai = call_llm.invoke([question])
    assert ai.response_metadata["finish_reason"] == "tool_calls" and len(ai.tool_calls) == 1
    call = ai.tool_calls[0]
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and call["id"]
    streamed = None
    for piece in call_llm.stream([question]):
        streamed = piece if streamed is None else streamed + piece
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]

    result = get_weather.invoke(call)  # a ToolMessage answering the call's id
    final = _llm(server, max_tokens=12).bind_tools([get_weather], tool_choice="none").invoke([question, ai, result])
    assert isinstance(final.content, str) and final.content and not final.tool_calls
    tok = server.state.tokenizer
    expected = tok.apply_chat_template(
        [{"role": "user", "content": question.content},
         {"role": "assistant", "content": json.dumps({"name": "get_weather", "arguments": call["args"]})},
         {"role": "user", "content": f"Result of get_weather (call {call['id']}): {result.content}"}],
        add_generation_prompt=True, tokenize=False)
    assert final.usage_metadata["input_tokens"] == len(tok(expected, add_special_tokens=False)["input_ids"])


def test_session_turn_follows_its_grammar(server):
    """The session route takes structured outputs too: the turn's reply is one of the choices and
    the session holds it (the next turn sees it)."""
    sid = httpx.post(f"{server.url}/v1/sessions").json()["id"]
    try:
        r = httpx.post(f"{server.url}/v1/sessions/{sid}/generate", timeout=120,
                       json={"messages": [{"role": "user", "content": "Pick a colour."}], "stream": False,
                             "max_tokens": 8, "temperature": 0.9, "seed": 3, "guided_choice": ["red", "green", "blue"]})
        assert r.status_code == 200, r.text
        reply = r.json()
        assert reply["text"] in ("red", "green", "blue") and reply["finish_reason"] == "stop"
        info = httpx.get(f"{server.url}/v1/sessions/{sid}").json()
        assert info["history_tokens"] == reply["prompt_tokens"] + reply["completion_tokens"]
    finally:
        httpx.delete(f"{server.url}/v1/sessions/{sid}")


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def test_tool_calls_with_n_and_logprobs_whole_and_streamed(server):
    """A required tool call with n = 2 and logprobs: each choice is a call with arguments valid
    for the function, and its logprobs cover every token it generated; streamed, each choice
    brings the same call and the same logprobs (held with the call's text, sent with the call)."""
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [WEATHER],
            "tool_choice": "required", "n": 2, "temperature": 0.9, "seed": 4, "max_tokens": 40,
            "logprobs": True, "top_logprobs": 2}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    whole = r.json()
    assert [c["index"] for c in whole["choices"]] == [0, 1]
    calls, lps = {}, {}
    for c in whole["choices"]:
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
        (call,) = c["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert isinstance(json.loads(call["function"]["arguments"])["city"], str)
        calls[c["index"]] = call["function"]["arguments"]
        lps[c["index"]] = [(e["token"], e["logprob"]) for e in c["logprobs"]["content"]]
        assert lps[c["index"]] and all(lp <= 0 for _, lp in lps[c["index"]])
        assert all(len(e["top_logprobs"]) == 2 for e in c["logprobs"]["content"])
    assert whole["usage"]["completion_tokens"] == sum(len(v) for v in lps.values())

    streamed_args, streamed_lps, finishes = {0: "", 1: ""}, {0: [], 1: []}, {}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
        for line in s.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                i = c["index"]
                assert c["delta"].get("content") in (None, "")  # a call: no text goes out
                for tc in c["delta"].get("tool_calls") or []:
                    streamed_args[i] += tc["function"].get("arguments", "")
                streamed_lps[i] += [(e["token"], e["logprob"]) for e in (c["logprobs"] or {}).get("content", [])]
                if c["finish_reason"]:
                    finishes[i] = c["finish_reason"]
    assert finishes == {0: "tool_calls", 1: "tool_calls"}
    assert streamed_args == calls
    for i in (0, 1):
        assert [t for t, _ in streamed_lps[i]] == [t for t, _ in lps[i]]
        assert max(abs(a - b) for (_, a), (_, b) in zip(streamed_lps[i], lps[i])) < 1e-4
    server.wait_idle()
    server.check_invariants()


def test_a_required_call_cut_short_by_max_tokens_is_still_a_call(server):
    """`required` makes the reply a call; cut short by max_tokens it is answered as the call it
    began (finish reason `length`, the arguments so far, never the call's text as content), and
    streamed it brings the same function and arguments."""
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [WEATHER],
            "tool_choice": "required", "temperature": 0, "max_tokens": 12}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    args = call["function"]["arguments"]
    assert args.startswith("{") and not args.endswith("}}")  # unfinished, as cut

    name, streamed, finish = "", "", None
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as s:
        for line in s.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                assert c["delta"].get("content") in (None, "")
                for tc in c["delta"].get("tool_calls") or []:
                    name += tc["function"].get("name") or ""
                    streamed += tc["function"].get("arguments", "")
                finish = c["finish_reason"] or finish
    assert (name, streamed, finish) == ("get_weather", args, "length")


def test_objects_take_only_their_listed_properties_and_a_function_without_parameters_none(server):
    """A schema that lists its properties and says nothing of others gets exactly those (a small
    model otherwise adds properties until max_tokens); a function sent without `parameters` is
    called with `{}`."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "A city as JSON."}], "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "strict": True, "schema": schema}}})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert list(json.loads(choice["message"]["content"])) == ["city"]
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Ping the server."}], "max_tokens": 30, "temperature": 0,
        "tools": [{"type": "function", "function": {"name": "ping"}}], "tool_choice": "required"})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == \
        [("ping", "{}")]
