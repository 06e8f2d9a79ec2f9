"""Stored responses outlive the process and belong to their API key: a real `s5serve serve` on the
embedded model is killed (SIGKILL) and started again on the same session database; the response
is still there for the key that created it only, and continuing it rebuilds its session's row from
the transcript and answers what /v1/chat/completions says for the whole conversation."""

import signal

import httpx
import openai
import pytest

from tests.servers import metric, server_process

pytestmark = pytest.mark.slow
ARGS = ("--model", "embedded", "--rows", "4", "--kv-cache-bytes", "128M", "--api-key", "key-a", "--api-key", "key-b")
CONVERSATION = [{"role": "user", "content": "What is the capital of Italy?"},
                {"role": "assistant", "content": "The capital of Italy is Rome."},
                {"role": "user", "content": "What is the capital of France?"}]
GERMANY = {"role": "user", "content": "And of Germany?"}
GREEDY = dict(model="", max_output_tokens=7, temperature=0)


def sdk(url, key) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def test_a_stored_response_survives_a_crash_for_its_key_only(tmp_path, embedded_dir):
    db = str(tmp_path / "sessions.sqlite3")
    with server_process(tmp_path / "log1", *ARGS, "--session-db", db) as (proc, url):
        a, b = sdk(url, "key-a"), sdk(url, "key-b")
        first = a.responses.create(input=CONVERSATION, **GREEDY)
        assert first.output_text == "The capital of France is Paris."
        # another key cannot see, list, continue or delete it: it answers as a missing one
        for call in (lambda: b.responses.retrieve(first.id), lambda: b.responses.input_items.list(first.id),
                     lambda: b.responses.create(input=[GERMANY], previous_response_id=first.id, **GREEDY),
                     lambda: b.responses.delete(first.id), lambda: b.responses.retrieve("resp_" + "0" * 32)):
            with pytest.raises(openai.NotFoundError):
                call()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    with server_process(tmp_path / "log2", *ARGS, "--session-db", db) as (proc, url):
        a, b = sdk(url, "key-a"), sdk(url, "key-b")
        assert a.responses.retrieve(first.id).model_dump() == first.model_dump()
        with pytest.raises(openai.NotFoundError):
            b.responses.retrieve(first.id)
        second = a.responses.create(input=[GERMANY], previous_response_id=first.id, **GREEDY)
        whole = CONVERSATION + [{"role": "assistant", "content": first.output_text}, GERMANY]
        chat = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": "Bearer key-a"}, timeout=120,
                          json={"messages": whole, "max_tokens": 7, "temperature": 0}).json()
        assert second.output_text == chat["choices"][0]["message"]["content"] == "The capital of Germany is Berlin."
        # the same session went on: its row was rebuilt from the transcript (one rebuild), and the
        # next response reuses it
        assert metric(url, "s5_session_resumes_total", 'path="rebuild"', {"Authorization": "Bearer key-a"}) == 1
        third = a.responses.create(input="And of Spain?", previous_response_id=second.id, **GREEDY)
        assert third.usage.input_tokens_details.cached_tokens == second.usage.total_tokens - 1
