"""The session route gives the answers of the OpenAI routes for the same input (embedded model,
temperature 0): text on a session's first turn gets the model's BOS as /v1/completions does; chat
messages are rendered with the tokenizer's chat template, turn by turn, into the tokens
/v1/chat/completions renders for the whole conversation; `max_tokens: 0` appends."""

import json

import httpx
import pytest

pytestmark = pytest.mark.slow

U = lambda text: {"role": "user", "content": text}  # noqa: E731
A = lambda text: {"role": "assistant", "content": text}  # noqa: E731
FEW_SHOT = [U("What is the capital of Italy?"), A("The capital of Italy is Rome.")]


def new_session(server) -> str:
    return httpx.post(f"{server.url}/v1/sessions").json()["id"]


def session_turn(server, sid, stream=False, **body) -> dict:
    """One turn; streamed turns are gathered into the non-streaming answer's shape."""
    body = {"temperature": 0, "stream": stream, **body}
    if not stream:
        r = httpx.post(f"{server.url}/v1/sessions/{sid}/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()
    text, ids, done = "", [], None
    with httpx.stream("POST", f"{server.url}/v1/sessions/{sid}/generate", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                ev = json.loads(line[6:])
                if ev["type"] == "token":
                    text, ids = text + ev["text"], ids + ev["token_ids"]
                done = ev if ev["type"] == "done" else done
    return {"text": text, "token_ids": ids, **done}


def completion(server, prompt, max_tokens) -> str:
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                          "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def chat_completion(server, messages, max_tokens) -> str:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, "max_tokens": max_tokens,
                                                               "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def history(server, sid) -> list[int]:
    return server.engine("session_tokens", sid)


def test_text_turns_start_with_bos_like_completions(server):
    tok = server.state.tokenizer
    sid = new_session(server)
    first = session_turn(server, sid, input="The capital of France is", max_tokens=12)
    assert first["text"] == completion(server, "The capital of France is", 12)
    assert first["text"].startswith(" the capital of")  # what the base model says (no BOS: " France of...")
    second = session_turn(server, sid, stream=True, input=" Its largest river is", max_tokens=8)
    held = history(server, sid)
    assert held[0] == tok.bos_token_id and held.count(tok.bos_token_id) == 1  # BOS on the first turn only
    prompt = held[: len(held) - second["completion_tokens"]]
    assert second["text"] == completion(server, prompt, 8)


def test_chat_turns_equal_chat_completions_of_the_whole_conversation(server):
    tok = server.state.tokenizer
    sid = new_session(server)
    conversation = [*FEW_SHOT, U("What is the capital of France?")]
    first = session_turn(server, sid, messages=conversation, max_tokens=7)
    assert first["text"] == chat_completion(server, conversation, 7) == "The capital of France is Paris."
    conversation += [A(first["text"]), U("And of Germany?")]
    second = session_turn(server, sid, stream=True, messages=conversation[-1:], max_tokens=7)
    assert second["text"] == chat_completion(server, conversation, 7) == "The capital of Germany is Berlin."
    # token for token, the session holds what the template renders for the whole conversation
    rendered = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert history(server, sid) == list(rendered) + tok(second["text"], add_special_tokens=False)["input_ids"]


def test_a_reply_that_ended_its_turn_is_closed_once(server):
    """A reply that stops at the end-of-turn token holds it: the next turn feeds only the rest of
    the template's closing markup (token ids in, so the model's stop is certain)."""
    tok = server.state.tokenizer
    eot = tok.convert_tokens_to_ids("<end_of_turn>")
    sid = new_session(server)
    opening = tok.apply_chat_template([U("Hi")], add_generation_prompt=True, tokenize=True, return_dict=False)
    session_turn(server, sid, input=list(opening) + tok("Hello!", add_special_tokens=False)["input_ids"] + [eot],
                 max_tokens=0)
    session_turn(server, sid, messages=[U("Bye")], max_tokens=0)
    want = tok.apply_chat_template([U("Hi"), A("Hello!"), U("Bye")], tokenize=True, return_dict=False)
    assert history(server, sid) == list(want)


def test_append_then_ask_equals_one_turn(server):
    tok = server.state.tokenizer
    doc = "Ada Lovelace was born in London in 1815. She wrote the first computer program."
    question = " Ada Lovelace was born in"
    sid = new_session(server)
    appended = session_turn(server, sid, input=doc, max_tokens=0)
    info = httpx.get(f"{server.url}/v1/sessions/{sid}").json()
    n_doc = len(tok(doc)["input_ids"])
    assert appended["text"] == "" and appended["token_ids"] == [] and appended["completion_tokens"] == 0
    assert appended["appended_tokens"] == appended["prompt_tokens"] == n_doc
    assert appended["history_tokens"] == appended["kv_tokens"] == info["history_tokens"] == info["kv_tokens"] == n_doc
    assert appended["resident_kv_bytes"] == info["resident_kv_bytes"] > 0 and info["turns"] == 1
    asked = session_turn(server, sid, input=question, max_tokens=8)
    assert asked["cached_tokens"] == n_doc
    joined = tok(doc)["input_ids"] + tok(question, add_special_tokens=False)["input_ids"]
    assert asked["text"] == completion(server, joined, 8)
    one = new_session(server)
    assert session_turn(server, one, input=joined, max_tokens=8)["text"] == asked["text"]
    # the prefill's time is reported streamed or not: from the submission to the first output
    for done in (appended, asked, session_turn(server, one, stream=True, input=" And", max_tokens=2)):
        assert 0 < done["prefill_seconds"] <= done["total_seconds"], done


def test_append_messages_streamed_then_ask(server):
    sid = new_session(server)
    appended = session_turn(server, sid, stream=True, messages=FEW_SHOT, max_tokens=0)
    assert appended["finish_reason"] == "length" and appended["text"] == ""
    assert appended["history_tokens"] == appended["kv_tokens"] == appended["appended_tokens"]
    asked = session_turn(server, sid, messages=[U("What is the capital of France?")], max_tokens=7)
    assert asked["text"] == chat_completion(server, [*FEW_SHOT, U("What is the capital of France?")], 7)
    assert asked["cached_tokens"] == appended["kv_tokens"]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_turn_a_stop_string_ended_names_the_tokens_the_session_keeps(server, stream):
    """`token_ids` are the sampled tokens, the one that completed the stop string among them; the
    done event's `kept_token_ids` are what the session keeps of them: the text the client got,
    whether the stop string began at a token's start or inside one (that token's visible part
    encoded anew). A turn no stop string ended has no `kept_token_ids`: it keeps what it sampled."""
    tok = server.state.tokenizer
    prompt = "The three primary colors are"
    free = session_turn(server, new_session(server), stream=stream, input=prompt, max_tokens=12)
    assert "kept_token_ids" not in free
    ids, text = free["token_ids"], free["text"]
    starts = [len(tok.decode(ids[:i], skip_special_tokens=True)) for i in range(len(ids) + 1)]
    j = next(i for i in range(1, len(ids) - 2) if len(text[starts[i]:starts[i + 1]].strip()) >= 3
             and text[starts[i]:starts[i + 1]].isascii())
    whole, inside = text[starts[j]:starts[j + 1]], text[starts[j] + 2:starts[j] + 3]
    for stop, at in ((whole, starts[j]), (inside, starts[j] + 2)):
        assert text.find(stop) == at, (text, stop)
        sid = new_session(server)
        got = session_turn(server, sid, stream=stream, input=prompt, max_tokens=12, stop=[stop])
        assert got["text"] == text[:at] and got["finish_reason"] == "stop"
        assert got["token_ids"] == ids[: j + 1] and got["completion_tokens"] == j + 1
        held = history(server, sid)[len(tok(prompt)["input_ids"]):]
        assert got["kept_token_ids"] == held and tok.decode(held, skip_special_tokens=True) == text[:at]
        assert (held == ids[:j]) == (stop == whole)  # a cut inside token j keeps its start, encoded anew
