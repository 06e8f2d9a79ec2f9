"""/v1/responses through the openai SDK against a live server on the embedded model: a response
that continues another reuses its session's row (cached tokens reported) and says what
/v1/chat/completions says for the whole conversation, branches included; streaming (both SDK
faces) gives the non-streamed text; stored responses are retrieved, listed and deleted, unstored
ones cannot be; bad input answers 400 naming the parameter and leaves no session behind."""

import json
import time

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow
FEW_SHOT = [{"role": "user", "content": "What is the capital of Italy?"},
            {"role": "assistant", "content": "The capital of Italy is Rome."}]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = dict(model="", max_output_tokens=7, temperature=0)


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(server, messages) -> dict:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"messages": messages, "max_tokens": 7, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def chat_text(server, messages) -> str:
    return chat(server, messages)["choices"][0]["message"]["content"]


def reply(response) -> dict:
    return {"role": "assistant", "content": response.output_text}


def sessions(server, expect: int | None = None) -> int:
    """Open sessions once the server is idle (given `expect`: once they are that many, within a
    few seconds: a session dropped after a stream ends is closed just after the engine idles)."""
    server.wait_idle()
    deadline = time.monotonic() + 5
    while (n := server.stats().num_sessions) != expect and expect is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def test_a_continued_response_reuses_its_row_and_answers_as_chat_completions(server):
    client = sdk(server)
    first = client.responses.create(input=FEW_SHOT + FRANCE, **GREEDY)
    assert first.output_text == chat_text(server, FEW_SHOT + FRANCE) == "The capital of France is Paris."
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.usage.input_tokens_details.cached_tokens == 0 and first.usage.output_tokens == 7

    second = client.responses.create(input="And of Germany?", previous_response_id=first.id, **GREEDY)
    conversation = FEW_SHOT + FRANCE + [reply(first), {"role": "user", "content": "And of Germany?"}]
    whole = chat(server, conversation)
    assert second.output_text == whole["choices"][0]["message"]["content"] == "The capital of Germany is Berlin."
    assert second.usage.input_tokens == whole["usage"]["prompt_tokens"]
    # the row holds every token of the first response but its last reply token (fed by this turn)
    assert second.usage.input_tokens_details.cached_tokens == first.usage.total_tokens - 1
    assert second.previous_response_id == first.id

    # a branch: the first response again, after its session moved on to the second
    spain = {"role": "user", "content": "And of Spain?"}
    branch = client.responses.create(input=[spain], previous_response_id=first.id, **GREEDY)
    assert branch.output_text == chat_text(server, FEW_SHOT + FRANCE + [reply(first), spain])
    assert branch.usage.input_tokens_details.cached_tokens == 0  # rebuilt from the stored responses
    # ... and the second is still its session's latest: continued in place
    third = client.responses.create(input=[spain], previous_response_id=second.id, **GREEDY)
    assert third.output_text == chat_text(server, conversation + [reply(second), spain])
    assert third.usage.input_tokens_details.cached_tokens == second.usage.total_tokens - 1
    # the branch has a session of its own: it continues in place too
    fourth = client.responses.create(input="And of Germany?", previous_response_id=branch.id, **GREEDY)
    assert fourth.output_text == chat_text(server, FEW_SHOT + FRANCE + [reply(first), spain, reply(branch),
                                                                        {"role": "user", "content": "And of Germany?"}])
    assert fourth.usage.input_tokens_details.cached_tokens == branch.usage.total_tokens - 1


def test_streamed_through_both_sdk_faces_equals_not_streamed(server):
    client = sdk(server)
    first = client.responses.create(input=FEW_SHOT + FRANCE, instructions="Answer in one sentence.", **GREEDY)
    ask = dict(input="And of Germany?", previous_response_id=first.id, **GREEDY)
    plain = client.responses.create(**ask)

    events = list(client.responses.create(stream=True, **ask))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == events[-4].text == final.output_text == plain.output_text and plain.output_text.strip()
    assert final.status == plain.status == "incomplete"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (plain.usage.input_tokens, 7)
    # the plain response moved the session on: the streamed one branched off (rebuilt, nothing cached)
    assert plain.usage.input_tokens_details.cached_tokens > 0 == final.usage.input_tokens_details.cached_tokens
    assert client.responses.retrieve(final.id).output_text == plain.output_text  # stored, as streamed

    with client.responses.stream(**ask) as stream:
        streamed = [e for e in stream]
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == plain.output_text
    assert streamed[-1].type == "response.incomplete" and streamed[-1].response.output_text == plain.output_text


def test_retrieve_list_delete_and_unstored_responses(server):
    client = sdk(server)
    before = sessions(server)
    made = client.responses.create(input=FRANCE, metadata={"case": "retrieve"}, user="u-1", **GREEDY)
    got = client.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump() and got.metadata == {"case": "retrieve"} and got.user == "u-1"
    items = client.responses.input_items.list(made.id)
    assert [(i.role, i.content[0].text) for i in items.data] == [("user", FRANCE[0]["content"])]
    assert sessions(server) == before + 1

    client.responses.delete(made.id)
    for call in (lambda: client.responses.retrieve(made.id), lambda: client.responses.delete(made.id),
                 lambda: client.responses.create(input="And?", previous_response_id=made.id, **GREEDY)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert sessions(server) == before  # its session went with it

    # store false: answered, not kept, not continuable, no session left behind
    unstored = client.responses.create(input=FEW_SHOT + FRANCE, store=False, **GREEDY)
    assert unstored.output_text == "The capital of France is Paris."
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="And?", previous_response_id=unstored.id, **GREEDY)
    # ... also when it continues a stored response, whose session it leaves as it was
    kept = client.responses.create(input=FEW_SHOT + FRANCE, **GREEDY)
    germany = {"role": "user", "content": "And of Germany?"}
    aside = client.responses.create(input=[germany], previous_response_id=kept.id, store=False, **GREEDY)
    assert aside.output_text == chat_text(server, FEW_SHOT + FRANCE + [reply(kept), germany])
    after = client.responses.create(input=[germany], previous_response_id=kept.id, **GREEDY)
    assert after.output_text == aside.output_text
    assert after.usage.input_tokens_details.cached_tokens == kept.usage.total_tokens - 1  # still the latest
    assert sessions(server) == before + 1
    client.responses.delete(after.id)
    client.responses.delete(kept.id)
    assert sessions(server) == before


BAD = [
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"text": {"format": {"type": "json_schema", "name": "r", "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"text": {"format": {"type": "text"}, "verbosity": "low"}}, "text.verbosity"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"background": True}, "background"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"temperature": 3}, "temperature"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"max_output_tokens": 10**9}, "max_output_tokens"),  # refused by the engine, after the session was made
    ({"previous_response_id": "resp_missing"}, "previous_response_id"),
    ({"model": "another-model"}, "model"),
]


@pytest.mark.parametrize("extra,param", BAD, ids=[p for _, p in BAD])
def test_bad_input_answers_400_naming_the_parameter_and_leaks_nothing(server, extra, param):
    before = sessions(server)
    for stream in (False, True):
        r = httpx.post(server.url + "/v1/responses", timeout=60,
                       json={"input": "What is the capital of France?", "stream": stream, **extra})
        error = r.json()["error"]
        assert r.status_code == (404 if param in ("previous_response_id", "model") else 400), r.text
        assert error["param"] == param and error["message"] and error["type"] and error["code"]
    assert sessions(server) == before
    server.check_invariants()


def test_a_client_that_leaves_mid_stream_leaves_no_response_and_no_session(server):
    client = sdk(server)
    before = sessions(server)
    with client.responses.stream(input=FEW_SHOT + FRANCE, model="", max_output_tokens=200, temperature=0) as stream:
        for event in stream:
            if event.type == "response.created":
                response_id = event.response.id
            if event.type == "response.output_text.delta":
                break  # leaves with the reply under way
    assert sessions(server, expect=before) == before
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response_id)
    server.check_invariants()


def test_instructions_and_input_parts_render_as_chat_messages(server):
    """`instructions` is a system message before the input; `developer` is the system role; text
    parts join into one message; input_items lists the input without the instructions."""
    client = sdk(server)
    made = client.responses.create(
        instructions="You answer with the capital only.",
        input=[{"role": "developer", "content": "Answer in English."},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is the capital "},
                                                               {"type": "input_text", "text": "of France?"}]}],
        **GREEDY)
    assert made.output_text == chat_text(server, [
        {"role": "system", "content": "You answer with the capital only."},
        {"role": "system", "content": "Answer in English."},
        {"role": "user", "content": "What is the capital of France?"}]) and made.output_text.strip()
    assert made.instructions == "You answer with the capital only."
    items = client.responses.input_items.list(made.id, order="asc")
    assert [(i.role, i.content[0].text) for i in items.data] == [("system", "Answer in English."),
                                                                  ("user", "What is the capital of France?")]
    client.responses.delete(made.id)


def test_a_response_whose_session_is_gone_is_continued_from_the_stored_conversation(server):
    client = sdk(server)
    first = client.responses.create(input=FEW_SHOT + FRANCE, **GREEDY)
    session_id = server.engine("get_response", first.id, None)["session_id"]
    assert server.engine("close_session", session_id, None)  # as the idle TTL would
    germany = {"role": "user", "content": "And of Germany?"}
    second = client.responses.create(input=[germany], previous_response_id=first.id, **GREEDY)
    assert second.output_text == chat_text(server, FEW_SHOT + FRANCE + [reply(first), germany])
    assert second.output_text == "The capital of Germany is Berlin."
    assert second.usage.input_tokens_details.cached_tokens == 0  # rebuilt, in a new session
    third = client.responses.create(input="And of Spain?", previous_response_id=second.id, **GREEDY)
    assert third.usage.input_tokens_details.cached_tokens == second.usage.total_tokens - 1


def test_deleting_a_response_keeps_the_session_its_continuations_use(server):
    client = sdk(server)
    first = client.responses.create(input=FEW_SHOT + FRANCE, **GREEDY)
    second = client.responses.create(input="And of Germany?", previous_response_id=first.id, **GREEDY)
    client.responses.delete(first.id)
    # the second still refers to the session: it continues in place
    third = client.responses.create(input="And of Spain?", previous_response_id=second.id, **GREEDY)
    assert third.usage.input_tokens_details.cached_tokens == second.usage.total_tokens - 1
    # a branch off the second would rebuild the conversation from the first, which is gone
    with pytest.raises(openai.NotFoundError, match=first.id):
        client.responses.create(input="And of Spain?", previous_response_id=second.id, **GREEDY)
    before = sessions(server)
    client.responses.delete(second.id)
    assert sessions(server) == before  # the third still uses the session
    client.responses.delete(third.id)
    assert sessions(server) == before - 1


RECORD = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string",
                                                                                                "maxLength": 20}},
          "required": ["city", "country"], "additionalProperties": False}


def test_text_format_json_schema_follows_the_schema_as_chat_response_format_does(server):
    """`text.format` json_schema (the Responses API's flat form) constrains the reply to the
    schema; the text equals /v1/chat/completions with `response_format` json_schema on the same
    conversation, streamed or not, and the response echoes its format. The SDK's `parse` reads it
    back into a model."""
    from pydantic import BaseModel

    client = sdk(server)
    fmt = {"type": "json_schema", "name": "record", "schema": RECORD, "strict": True}
    ask = [{"role": "user", "content": "Name a city and its country as JSON."}]
    got = client.responses.create(input=ask, text={"format": fmt}, model="", max_output_tokens=40, temperature=0)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": ask, "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD}}})
    assert r.status_code == 200, r.text
    assert got.output_text == r.json()["choices"][0]["message"]["content"]
    record = json.loads(got.output_text)
    jsonschema.validate(record, RECORD)
    assert got.status == "completed" and got.text.format.type == "json_schema" and got.text.format.name == "record"
    with client.responses.stream(input=ask, text={"format": fmt}, model="", max_output_tokens=40,
                                 temperature=0) as stream:
        assert stream.get_final_response().output_text == got.output_text

    class Record(BaseModel):
        city: str
        country: str

    parsed = client.responses.parse(input=ask, text_format=Record, model="", max_output_tokens=40, temperature=0)
    assert isinstance(parsed.output_parsed, Record) and parsed.output_parsed.city
    free = client.responses.create(input=ask, text={"format": {"type": "json_object"}}, model="",
                                   max_output_tokens=40, temperature=0)
    assert free.output_text.startswith("{") and free.text.format.type == "json_object"
    if free.status == "completed":  # else cut by max_output_tokens (an object with no schema can run on)
        assert isinstance(json.loads(free.output_text), dict)


def test_input_items_list_an_assistant_message_as_an_output_part(server):
    """An assistant message of the input is listed as a response's output is: an `output_text`
    part with its annotations (none), which the SDK reads as a list."""
    client = sdk(server)
    made = client.responses.create(input=FEW_SHOT + FRANCE, **GREEDY)
    items = client.responses.input_items.list(made.id, order="asc").data
    assert [i.role for i in items] == ["user", "assistant", "user"]
    part = items[1].content[0]
    assert (part.type, part.text, part.annotations) == ("output_text", FEW_SHOT[1]["content"], [])
    assert [p.type for i in (items[0], items[2]) for p in i.content] == ["input_text", "input_text"]
    client.responses.delete(made.id)


def test_a_response_continued_on_a_server_with_other_kv_settings_is_rebuilt(tmp_path):
    """Stored responses outlive a restart with another window: their session is kept under the
    old settings, so the continuation is rebuilt from the stored conversation, in a new session,
    and answers as /v1/chat/completions does there for the whole conversation."""
    from tests.servers import live_server

    def serve(window: int):
        return live_server(model="embedded", max_rows=4, kv_cache_bytes=64 << 20, kv_window=window,
                           session_db=str(tmp_path / "s.sqlite3"))

    with serve(64) as srv:
        first = sdk(srv).responses.create(input=FEW_SHOT + FRANCE, **GREEDY)
    with serve(32) as srv:
        germany = {"role": "user", "content": "And of Germany?"}
        second = sdk(srv).responses.create(input=[germany], previous_response_id=first.id, **GREEDY)
        assert second.output_text == chat_text(srv, FEW_SHOT + FRANCE + [reply(first), germany])
        assert second.usage.input_tokens_details.cached_tokens == 0  # rebuilt, in a new session
