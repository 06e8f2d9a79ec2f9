"""The README's curl and SDK examples run against a live server and give the answers they
promise: the SDK example's text is what /v1/completions says for the same prompt at temperature
0, and each chat turn of the session example is what /v1/chat/completions says for the whole
conversation so far."""

import ast
import json
import re
import subprocess
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow
README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
LOCAL = "http://127.0.0.1:8000"


def blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def curl_calls(script: str) -> list[tuple[str, dict]]:
    """(path, JSON body) of every curl in the script that sends one, in order."""
    calls = []
    for line in script.replace("\\\n", " ").splitlines():
        url, body = re.search(rf"{LOCAL}(/v1/\S+)", line), re.search(r"-d '([^']*)'", line)
        if url and body:
            calls.append((url.group(1), json.loads(body.group(1))))
    return calls


def post(server, path, body) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def completion_text(server, body) -> str:
    return post(server, "/v1/completions", {**body, "stream": False})["choices"][0]["text"]


def chat_text(server, body) -> str:
    return post(server, "/v1/chat/completions", {**body, "stream": False})["choices"][0]["message"]["content"]


def test_readme_curl_examples_run(server):
    script = blocks("bash")[1].replace(LOCAL, server.url)
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "data: [DONE]" in out.stdout and '"history_tokens"' in out.stdout and '"appended_tokens"' in out.stdout


def test_readme_curl_examples_answer_alike(server):
    calls = curl_calls(blocks("bash")[1])
    completions = [b for p, b in calls if p == "/v1/completions"]
    chats = [b for p, b in calls if p == "/v1/chat/completions"]
    turns = [b for p, b in calls if p.endswith("/generate")]
    assert completions and chats and len(turns) >= 3 and any(b["max_tokens"] == 0 for b in turns)
    for body in completions:  # streamed or not, the same text
        chunks = httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=120).text
        streamed = "".join(json.loads(line[6:])["choices"][0]["text"] for line in chunks.splitlines()
                           if line.startswith("data: {"))
        assert streamed == completion_text(server, body) and streamed.strip()
    assert chat_text(server, chats[0]) == "The capital of France is Paris."

    # the session example, turn by turn, against /v1/chat/completions of the conversation so far
    sid = httpx.post(server.url + "/v1/sessions").json()["id"]
    conversation, replies = [], []
    for body in turns:
        done = post(server, f"/v1/sessions/{sid}/generate", {**body, "stream": False})
        conversation += body["messages"]
        if body["max_tokens"] == 0:
            assert done["text"] == "" and done["appended_tokens"] == done["history_tokens"] > 0
            continue
        assert done["text"] == chat_text(server, {**body, "messages": conversation})
        replies.append(done["text"])
        conversation.append({"role": "assistant", "content": done["text"]})
    assert replies == ["The capital of France is Paris.", "The capital of Germany is Berlin."]


def test_readme_sdk_example(server, capsys):
    code = blocks("python")[0]
    call = next(n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call)
                and getattr(n.func, "attr", None) == "generate")
    prompt = ast.literal_eval(call.args[0])
    params = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    assert params.get("temperature") == 0
    exec(compile(code.replace(LOCAL, server.url), "README.md", "exec"), {})
    printed = capsys.readouterr().out
    want = completion_text(server, {"prompt": prompt, **params})
    assert want.strip() and printed.startswith(want + "\n "), (printed, want)
    assert int(printed[len(want):].split()[0]) > 0  # the KV bytes the session holds


def test_readme_responses_examples(server, capsys):
    """The Responses example: the curl continuation and the SDK's second response each say what
    /v1/chat/completions says for the whole conversation, reusing the first response's row."""
    script = blocks("bash")[2]
    assert "previous_response_id" in script
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", script.replace(LOCAL, server.url)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rest, objs = out.stdout.strip(), []
    while rest:  # the JSON objects the curls print, one after the other
        obj, end = json.JSONDecoder().raw_decode(rest)
        objs.append(obj)
        rest = rest[end:].strip()
    second, stored = objs
    first_body = json.loads(re.search(r"-d '([^']*)'", script.replace("\\\n", " ")).group(1))
    whole = first_body["input"] + [{"role": "assistant", "content": stored["output"][0]["content"][0]["text"]},
                                   {"role": "user", "content": "And of Germany?"}]
    want = chat_text(server, {"messages": whole, "max_tokens": 7, "temperature": 0})
    assert second["output"][0]["content"][0]["text"] == want == "The capital of Germany is Berlin."
    assert second["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert stored["previous_response_id"] is None and second["previous_response_id"] == stored["id"]

    code = blocks("python")[1]
    assert "previous_response_id" in code
    exec(compile(code.replace(LOCAL, server.url), "README.md", "exec"), {})
    text, cached = capsys.readouterr().out.splitlines()
    assert text == want and int(cached.split()[0]) > 0, (text, cached)


def test_readme_structured_output_example_parses_to_its_schema(server):
    """The README's json_schema request, greedy and sampled: the reply parses and follows the
    schema (the bounds in it keep a base model's reply short)."""
    (body,) = [json.loads(b) for b in blocks("json") if "response_format" in b]
    schema = body["response_format"]["json_schema"]["schema"]
    for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
        r = post(server, "/v1/chat/completions", {**body, **extra})
        choice = r["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        obj = json.loads(choice["message"]["content"])
        assert set(obj) == set(schema["required"])
        assert isinstance(obj["name"], str) and len(obj["name"]) <= schema["properties"]["name"]["maxLength"]
        pop = schema["properties"]["population"]
        assert isinstance(obj["population"], int) and pop["minimum"] <= obj["population"] <= pop["maximum"]
