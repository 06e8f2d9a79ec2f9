"""Tool calling's front-end parts on the embedded model's real tokenizer: how a conversation with
tools, calls and results is rendered (through a template that takes tools, or the preamble), the
choices' checks, and how a streamed reply is split into text and a call."""

import functools
import json

import pytest
from llguidance import LLMatcher
from transformers import AutoTokenizer

from service.errors import APIError
from service.schemas import ChatCompletionRequest
from service.tools import CallStream, call_text, cut_calls, parse_calls, preamble, setup_of, template_messages
from tests.helpers import byte_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    {"role": "user", "content": "Thanks. And?"},
]
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}{{ m.content }}{% if m.tool_call_id %} [{{ m.tool_call_id }}]"
    "{% endif %}</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tok(embedded_dir):
    return AutoTokenizer.from_pretrained(str(embedded_dir))


@functools.cache
def _byte_tokenizers():
    import llguidance.hf

    tok = byte_tokenizer()
    return tok, llguidance.hf.from_tokenizer(tok, n_vocab=512, eos_token=1)


def accepts(grammar: str, text: str) -> bool:
    """Whether a real matcher takes `text` under `grammar`, token by token, and may end there."""
    tok, lltok = _byte_tokenizers()
    m = LLMatcher(lltok, grammar)
    return m.consume_tokens(tok.encode(text, add_special_tokens=False)) and m.is_accepting()


def _body(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=kw.pop("messages", CONVERSATION), **kw)


def test_preamble_rendering_for_a_template_without_tools(tok):
    body = _body(tools=[WEATHER], tool_choice="required")
    setup = setup_of(body)
    msgs, tools = template_messages(tok, body.messages, setup)
    assert tools is None
    assert msgs == [
        {"role": "system", "content": preamble(setup) + "\n\nBe brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
        {"role": "user", "content": "Result of get_weather (call call_1): Sunny\n\nThanks. And?"},
    ]
    assert '"name": "get_weather"' in preamble(setup) and "You must call one" in preamble(setup)
    tok.apply_chat_template(msgs, tokenize=False)  # Gemma's template takes it (roles alternate)


def test_template_that_takes_tools_gets_them(tok):
    gemma = tok.chat_template
    tok.chat_template = TOOLS_TEMPLATE
    try:
        body = _body(tools=[WEATHER])
        msgs, tools = template_messages(tok, body.messages, setup_of(body))
        text = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
    finally:
        tok.chat_template = gemma
    assert text == ('TOOLS:get_weather;<system>Be brief.</system><user>Weather in Paris?</user>'
                    '<assistant>CALL get_weather {"city": "Paris"}</assistant><tool>Sunny [call_1]</tool>'
                    '<user>Thanks. And?</user><assistant>')


@pytest.mark.parametrize("kw, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tool_requests(kw, param):
    with pytest.raises(APIError) as err:
        setup_of(_body(**kw))
    assert err.value.status == 400 and err.value.param == param


def test_choices_and_their_grammars():
    assert setup_of(_body(tools=[WEATHER], tool_choice="none")) is None
    assert setup_of(_body()) is None
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        setup = setup_of(_body(tools=[WEATHER], tool_choice=choice))
        assert LLMatcher.validate_grammar(setup.grammar()) == ""


def test_streamed_reply_splits_text_and_call():
    auto = setup_of(_body(tools=[WEATHER]))
    s = CallStream(auto)
    assert s.feed("Hello") == "Hello" and s.feed(" there") == " there" and s.end() == ("", None)
    s = CallStream(auto)
    assert s.feed('{"name": "get_weather", ') == "" and s.feed('"arguments": {"city": "Oslo"}}') == ""
    rest, (call,) = s.end()
    assert rest == "" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"} and call["id"].startswith("call_")
    s = CallStream(auto)  # a call cut short is text after all
    assert s.feed('{"name": "get_w') == "" and s.end() == ('{"name": "get_w', None)
    assert parse_calls('{"name": "other", "arguments": {}}', auto) is None


def test_a_forced_call_cut_short_is_still_a_call():
    """Under `required` or a named function the reply is a call, so one that max_tokens cut short
    is answered as the call it began: the function and its arguments so far (unfinished JSON), as
    OpenAI sends one; under `auto` it stays text, as above."""
    forced = setup_of(_body(tools=[WEATHER], tool_choice="required"))
    text = '{"name": "get_weather", "arguments": {"city": "Par'
    (call,) = cut_calls(text, forced)
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}
    s = CallStream(forced)
    assert s.feed(text) == ""
    rest, (streamed,) = s.end(cut_short=True)
    assert rest == "" and streamed["function"] == call["function"]
    assert cut_calls('{"name": "get_weather"', forced)[0]["function"]["arguments"] == ""
    assert cut_calls('{"name": "get_w', forced) is None and cut_calls('{"name": "other", "argu', forced) is None
    auto = setup_of(_body(tools=[WEATHER]))
    assert cut_calls(text, auto) is None
    s = CallStream(auto)
    s.feed(text)
    assert s.end(cut_short=True) == (text, None)


CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


def test_parallel_calls_are_one_per_line_and_only_where_allowed():
    """With `parallel_tool_calls: true` the grammar takes several calls, one per line, and the
    reply parses as that many calls, streamed or not; left out or false it takes exactly one, as
    a named choice does. The grammars are run on a real matcher, token by token."""
    one_call = call_text("get_weather", {"city": "Oslo"})
    two_calls = one_call + "\n" + call_text("get_time", {"zone": "CET"})
    for choice in ("auto", "required"):
        parallel = setup_of(_body(tools=[WEATHER, CLOCK], tool_choice=choice, parallel_tool_calls=True))
        single = setup_of(_body(tools=[WEATHER, CLOCK], tool_choice=choice, parallel_tool_calls=False))
        assert parallel.parallel and not single.parallel
        assert not setup_of(_body(tools=[WEATHER, CLOCK], tool_choice=choice)).parallel
        assert accepts(parallel.grammar(), two_calls) and accepts(parallel.grammar(), one_call)
        assert accepts(single.grammar(), one_call) and not accepts(single.grammar(), two_calls)
        assert not accepts(parallel.grammar(), one_call + "\n" + '{"name": "get_time", "arguments": {}}')
        made = parse_calls(two_calls, parallel)
        assert [c["function"]["name"] for c in made] == ["get_weather", "get_time"]
        assert len({c["id"] for c in made}) == 2 and json.loads(made[1]["function"]["arguments"]) == {"zone": "CET"}
        assert parse_calls(two_calls, single) is None
        s = CallStream(parallel)
        assert s.feed(two_calls[:30]) == "" and s.feed(two_calls[30:]) == ""
        rest, made = s.end()
        assert rest == "" and [c["function"]["name"] for c in made] == ["get_weather", "get_time"]
    assert "on a line of its own" in preamble(parallel) and "on a line of its own" not in preamble(single)
    named = setup_of(_body(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}},
                           parallel_tool_calls=True))
    assert not named.parallel and not accepts(named.grammar(), call_text("get_time", {"zone": "CET"}) + "\n" +
                                                      call_text("get_time", {"zone": "UTC"}))
    with pytest.raises(APIError) as err:
        setup_of(_body(tools=[WEATHER], parallel_tool_calls="yes"))
    assert err.value.status == 400 and err.value.param == "parallel_tool_calls"


def test_object_schemas_that_list_their_properties_take_only_those():
    """At every depth (properties, items, anyOf, $defs), an object schema with `properties` and
    nothing said of others gets `additionalProperties: false`; one that says, or lists none,
    keeps its meaning; a property named like a keyword stays a property."""
    from service.structured import closed_objects

    leaf = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {"type": "object",
              "properties": {"a": leaf, "properties": {"type": "string"},
                             "list": {"type": "array", "items": leaf},
                             "either": {"anyOf": [leaf, {"type": "null"}]},
                             "open": {**leaf, "additionalProperties": True}, "any": {"type": "object"}},
              "$defs": {"d": leaf}}
    closed = {**leaf, "additionalProperties": False}
    assert closed_objects(schema) == {
        "type": "object", "additionalProperties": False,
        "properties": {"a": closed, "properties": {"type": "string"}, "list": {"type": "array", "items": closed},
                       "either": {"anyOf": [closed, {"type": "null"}]},
                       "open": {**leaf, "additionalProperties": True}, "any": {"type": "object"}},
        "$defs": {"d": closed}}
    assert leaf == {"type": "object", "properties": {"x": {"type": "integer"}}}  # the request's own left as sent
    assert closed_objects(closed_objects(schema)) == closed_objects(schema)
    # a function sent without parameters takes none: its only arguments are {}
    setup = setup_of(_body(tools=[{"type": "function", "function": {"name": "ping"}}], tool_choice="required"))
    assert accepts(setup.grammar(), call_text("ping", {}))
    assert not accepts(setup.grammar(), call_text("ping", {"host": "x"}))
