"""Bad input, auth, limits, eviction and cancellation over HTTP."""

import json
import threading
import time

import httpx
import pytest

from engine import EngineConfig
from service.settings import Settings
from tests.servers import LiveServer, free_port, live_server

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return {"messages": MSG, "max_tokens": 4, **kw}


# (name, method, path, body or raw bytes, status, code) -- at least 25 bad requests
MATRIX = [
    ("messages missing", "POST", "/v1/chat/completions", {}, 400, "invalid_request"),
    ("messages empty", "POST", "/v1/chat/completions", {"messages": []}, 400, "invalid_request"),
    ("messages not a list", "POST", "/v1/chat/completions", {"messages": "hi"}, 400, "invalid_request"),
    ("bad role", "POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_request"),
    ("content wrong type", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "invalid_request"),
    ("image part", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "invalid_request"),
    ("max_tokens negative", "POST", "/v1/chat/completions", chat(max_tokens=-1), 400, "invalid_request"),
    ("max_tokens zero", "POST", "/v1/chat/completions", chat(max_tokens=0), 400, "invalid_request"),
    ("max_tokens string", "POST", "/v1/chat/completions", chat(max_tokens="many"), 400, "invalid_request"),
    ("max_tokens huge", "POST", "/v1/chat/completions", chat(max_tokens=10**12), 400, "context_length_exceeded"),
    ("max_tokens over KV cache", "POST", "/v1/completions", {"prompt": [5], "max_tokens": 30000}, 400, "kv_capacity_exceeded"),
    ("temperature negative", "POST", "/v1/chat/completions", chat(temperature=-1), 400, "invalid_request"),
    ("temperature string", "POST", "/v1/chat/completions", chat(temperature="hot"), 400, "invalid_request"),
    ("top_p zero", "POST", "/v1/chat/completions", chat(top_p=0), 400, "invalid_request"),
    ("top_p above one", "POST", "/v1/chat/completions", chat(top_p=1.5), 400, "invalid_request"),
    ("top_k below -1", "POST", "/v1/chat/completions", chat(top_k=-5), 400, "invalid_request"),
    ("n = 0", "POST", "/v1/chat/completions", chat(n=0), 400, "invalid_request"),
    ("n over the most", "POST", "/v1/completions", {"prompt": "x", "n": 17}, 400, "invalid_request"),
    ("n on a session", "POST", "/v1/sessions/{sid}/generate", {"input": "hi", "n": 2}, 400, "invalid_request"),
    ("n with a session id", "POST", "/v1/chat/completions", chat(n=2, session_id="{sid}"), 400, "invalid_request"),
    ("top_logprobs 21", "POST", "/v1/chat/completions", chat(logprobs=True, top_logprobs=21), 400, "invalid_request"),
    ("top_logprobs without logprobs", "POST", "/v1/chat/completions", chat(top_logprobs=2), 400, "invalid_request"),
    ("completion logprobs 21", "POST", "/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "invalid_request"),
    ("logprobs with echo", "POST", "/v1/completions", {"prompt": "x", "logprobs": 1, "echo": True}, 400, "invalid_request"),
    ("session logprobs negative", "POST", "/v1/sessions/{sid}/generate", {"input": "hi", "logprobs": -1}, 400, "invalid_request"),
    ("presence_penalty over 2", "POST", "/v1/chat/completions", chat(presence_penalty=2.5), 400, "invalid_request"),
    ("frequency_penalty below -2", "POST", "/v1/completions", {"prompt": "x", "frequency_penalty": -3}, 400, "invalid_request"),
    ("repetition_penalty zero", "POST", "/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "invalid_request"),
    ("logit_bias key not an id", "POST", "/v1/completions", {"prompt": "x", "logit_bias": {"hello": 5}}, 400, "invalid_request"),
    ("logit_bias key a superscript digit", "POST", "/v1/completions", {"prompt": "x", "logit_bias": {"\u00b2": 5}}, 400, "invalid_request"),
    ("logit_bias id past int64", "POST", "/v1/completions", {"prompt": "x", "logit_bias": {"9" * 30: 5}}, 400, "invalid_request"),
    ("logit_bias id out of vocab", "POST", "/v1/completions", {"prompt": "x", "logit_bias": {"999999999": 5}}, 400, "invalid_request"),
    ("logit_bias over 100", "POST", "/v1/chat/completions", chat(logit_bias={"5": 101}), 400, "invalid_request"),
    ("min_tokens over max_tokens", "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, 400, "invalid_request"),
    ("stop empty string", "POST", "/v1/chat/completions", chat(stop=[""]), 400, "invalid_request"),
    ("stop wrong type", "POST", "/v1/chat/completions", chat(stop=5), 400, "invalid_request"),
    ("unknown model", "POST", "/v1/chat/completions", chat(model="gpt-9"), 404, "model_not_found"),
    ("unknown session", "POST", "/v1/chat/completions", chat(session_id="nope"), 404, "session_not_found"),
    ("NaN temperature", "POST", "/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi"}],"temperature":NaN}', 400, "invalid_request"),
    ("Infinity top_p", "POST", "/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi"}],"top_p":Infinity}', 400, "invalid_request"),
    ("lone surrogate", "POST", "/v1/chat/completions", b'{"messages":[{"role":"user","content":"\\ud800"}]}', 400, "invalid_request"),
    ("invalid utf-8 bytes", "POST", "/v1/chat/completions", b'{"messages":[{"role":"user","content":"\xff\xfe"}]}', 400, "invalid_request"),
    ("malformed json", "POST", "/v1/chat/completions", b'{"messages": [', 400, "invalid_request"),
    ("body not an object", "POST", "/v1/chat/completions", b'[1, 2]', 400, "invalid_request"),
    ("oversize body", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * (5 << 20)}]}, 413, "body_too_large"),
    ("prompt over context", "POST", "/v1/completions", {"prompt": [5] * 40000, "max_tokens": 1}, 400, "context_length_exceeded"),
    ("prompt token out of vocab", "POST", "/v1/completions", {"prompt": [10**9], "max_tokens": 1}, 400, "invalid_request"),
    ("prompt empty ids", "POST", "/v1/completions", {"prompt": [], "max_tokens": 1}, 400, "invalid_request"),
    ("a list of prompts, one empty", "POST", "/v1/completions", {"prompt": [[5], []]}, 400, "invalid_request"),
    ("max_tokens a string", "POST", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "invalid_request"),
    ("max_tokens a decimal", "POST", "/v1/completions", {"prompt": "x", "max_tokens": 5.0}, 400, "invalid_request"),
    ("stream a string", "POST", "/v1/chat/completions", chat(stream="yes"), 400, "invalid_request"),
    ("stream_options without stream", "POST", "/v1/chat/completions", chat(stream_options={"include_usage": True}),
     400, "invalid_request"),
    ("responses max_output_tokens a string", "POST", "/v1/responses", {"input": "x", "max_output_tokens": "5"},
     400, "invalid_request"),
    ("session generate no input", "POST", "/v1/sessions/{sid}/generate", {"max_tokens": 2}, 400, "invalid_request"),
    ("session generate unknown", "POST", "/v1/sessions/nope/generate", {"input": "hi"}, 404, "session_not_found"),
    ("get unknown session", "GET", "/v1/sessions/nope", None, 404, "session_not_found"),
    ("cancel unknown request", "POST", "/v1/requests/req-nope/cancel", None, 404, "request_not_found"),
    ("unknown route", "GET", "/v1/nothing", None, 404, "not_found"),
    ("wrong method", "GET", "/v1/chat/completions", None, 405, "method_not_allowed"),
    ("session system message alone", "POST", "/v1/sessions/{sid}/generate",
     {"messages": [{"role": "system", "content": "Answer in French."}], "max_tokens": 0}, 400, "invalid_request"),
    ("chat system message alone", "POST", "/v1/chat/completions",
     {"messages": [{"role": "system", "content": "Answer in French."}], "max_tokens": 4}, 400, "invalid_request"),
    ("session max_tokens negative", "POST", "/v1/sessions/{sid}/generate", {"input": "hi", "max_tokens": -1}, 400, "invalid_request"),
    ("json schema invalid", "POST", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     400, "invalid_request"),
    ("response_format unknown type", "POST", "/v1/completions", {"prompt": "x", "response_format": {"type": "yaml"}},
     400, "invalid_request"),
    ("guided_regex invalid", "POST", "/v1/completions", {"prompt": "x", "guided_regex": "[a-"}, 400, "invalid_request"),
    ("two structured outputs", "POST", "/v1/completions",
     {"prompt": "x", "guided_regex": "a+", "guided_choice": ["a", "b"]}, 400, "invalid_request"),
    ("guided_regex invalid with n and logprobs", "POST", "/v1/completions",
     {"prompt": "x", "guided_regex": "[a-", "n": 2, "logprobs": 1}, 400, "invalid_request"),
    ("tools malformed", "POST", "/v1/chat/completions", chat(tools=[{"type": "function"}]), 400, "invalid_request"),
    ("tool_choice required without tools", "POST", "/v1/chat/completions", chat(tool_choice="required"),
     400, "invalid_request"),
    ("tool_choice unknown function", "POST", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f"}}],
          tool_choice={"type": "function", "function": {"name": "g"}}), 400, "invalid_request"),
    ("tool_choice required with response_format", "POST", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required",
          response_format={"type": "json_object"}), 400, "invalid_request"),
    # asked-for behaviour the server does not implement: an error, never an answer that ignores it
    ("functions (legacy)", "POST", "/v1/chat/completions", chat(functions=[{"name": "f"}]), 400, "unsupported_parameter"),
    ("prompt_logprobs", "POST", "/v1/completions", {"prompt": "x", "prompt_logprobs": 1}, 400, "unsupported_parameter"),
    ("best_of", "POST", "/v1/completions", {"prompt": "x", "best_of": 3}, 400, "unsupported_parameter"),
    ("session tools", "POST", "/v1/sessions/{sid}/generate", {"input": "hi", "tools": [{"type": "function"}]}, 400, "unsupported_parameter"),
    ("include_usage a string", "POST", "/v1/chat/completions",
     chat(stream=True, stream_options={"include_usage": "yes"}), 400, "invalid_request"),
    ("tool name with a space", "POST", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]), 400, "invalid_request"),
]

# (method, path, body, param): the error names the field as the request spells it
PARAMS = [
    ("POST", "/v1/completions", {"prompt": [-1]}, "prompt"),
    ("POST", "/v1/sessions/{sid}/generate", {"input": [-1]}, "input"),
    ("POST", "/v1/sessions/{sid}/generate", {"input": "hi", "max_tokens": -1}, "max_tokens"),
    ("GET", "/v1/responses/resp_x/input_items?limit=abc", None, "limit"),
    ("POST", "/v1/chat/completions", chat(stream=True, stream_options={"include_usage": "yes"}),
     "stream_options.include_usage"),
    ("POST", "/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools"),
    ("POST", "/v1/chat/completions", chat(messages=[{"role": "user", "content": 5}]), "messages.0.content"),
    # the length limit past the context, in the name the request gave it
    ("POST", "/v1/chat/completions", chat(max_tokens=None, max_completion_tokens=10**6), "max_completion_tokens"),
    ("POST", "/v1/completions", {"prompt": "x", "max_completion_tokens": 10**6}, "max_completion_tokens"),
    ("POST", "/v1/sessions/{sid}/generate", {"input": "hi", "max_completion_tokens": 10**6}, "max_completion_tokens"),
    ("POST", "/v1/chat/completions", chat(max_tokens=10**6), "max_tokens"),
]


@pytest.mark.slow
def test_validation_matrix(server):
    sid = httpx.post(f"{server.url}/v1/sessions").json()["id"]
    codes = {code for *_, code in MATRIX}
    counted = {code: server.metric("s5_rejections_total", f'code="{code}"') for code in codes}
    failures = []
    for name, method, path, body, status, code in MATRIX:
        if isinstance(body, dict) and body.get("session_id") == "{sid}":
            body = {**body, "session_id": sid}
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else (
            {"json": body} if body is not None else {})
        try:
            r = httpx.request(method, server.url + path.format(sid=sid), timeout=30, **kw)
            err = r.json()["error"]
            ok = r.status_code == status and err["code"] == code and err["message"] and "type" in err
        except (ValueError, KeyError, TypeError, httpx.HTTPError) as exc:
            ok, r = False, exc
        if not ok:
            failures.append((name, getattr(r, "status_code", None), getattr(r, "text", repr(r))[:200]))
    print(f"\nvalidation matrix: {len(MATRIX)} bad requests, {len(failures)} wrong")
    assert not failures, failures
    # each answered error is counted under its code
    assert {code: server.metric("s5_rejections_total", f'code="{code}"') - counted[code] for code in codes} == \
        {code: sum(c == code for *_, c in MATRIX) for code in codes}
    assert httpx.get(f"{server.url}/health").status_code == 200
    server.wait_idle()
    server.check_invariants()
    assert server.engine("session_tokens", sid, None) == []  # nothing the bad turns asked for stuck
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "ok", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200  # still serving


@pytest.mark.slow
def test_errors_name_the_field_as_the_request_spells_it(server):
    sid = httpx.post(f"{server.url}/v1/sessions").json()["id"]
    got = []
    for method, path, body, param in PARAMS:
        r = httpx.request(method, server.url + path.format(sid=sid), json=body, timeout=30)
        err = r.json()["error"]
        got.append((path, r.status_code, err["param"]))
        if body and 10**6 in body.values():  # past the context: the message names it so too
            assert f"{param} (" in err["message"], err
    assert got == [(path, 400, param) for _, path, _, param in PARAMS]
    assert server.engine("session_tokens", sid, None) == []


@pytest.fixture(scope="module")
def tiny():
    """A tiny-model server with API keys, a queue of 2 and a short session TTL."""
    settings = Settings(engine=EngineConfig(model="tiny-random", max_rows=2, kv_cache_bytes=1 << 22),
                        port=free_port(), api_keys=("key-a", "key-b"), max_queued=2, session_ttl_s=1.5)
    srv = LiveServer(settings)
    srv.headers = {"Authorization": "Bearer key-a"}
    yield srv.start()
    srv.stop()


A = {"Authorization": "Bearer key-a"}
B = {"Authorization": "Bearer key-b"}


def test_auth_matrix(tiny):
    """Every route of the app x {no key, bad key, wrong scheme, other tenant's key, right key}.
    A route the app gains without a case here fails the test. Only /health and /ready are open;
    another tenant's session or request answers exactly as a missing one does."""
    def sid_of(headers):
        return httpx.post(f"{tiny.url}/v1/sessions", headers=headers).json()["id"]

    gen_body = {"input": [5, 6], "max_tokens": 2, "stream": False}
    # (method, route path) -> (concrete path, body, owned by the caller's tenant?)
    a_sid = sid_of(A)
    model = httpx.get(f"{tiny.url}/v1/models", headers=A).json()["data"][0]["id"]
    cases = {
        ("GET", "/v1/models"): ("/v1/models", None, False),
        ("GET", "/v1/models/{model}"): (f"/v1/models/{model}", None, False),
        ("GET", "/metrics"): ("/metrics", None, False),
        ("POST", "/v1/completions"): ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2}, False),
        ("POST", "/v1/chat/completions"): ("/v1/chat/completions", chat(), False),
        ("POST", "/v1/sessions"): ("/v1/sessions", None, False),
        ("GET", "/v1/sessions/{session_id}"): (f"/v1/sessions/{a_sid}", None, True),
        ("POST", "/v1/sessions/{session_id}/generate"): (f"/v1/sessions/{a_sid}/generate", gen_body, True),
        ("DELETE", "/v1/sessions/{session_id}"): (None, None, True),  # below: it ends the session
        ("POST", "/v1/requests/{request_id}/cancel"): (None, None, True),  # below: needs a live request
        ("POST", "/v1/responses"): ("/v1/responses", {"input": "hi", "max_output_tokens": 2}, False),
        # a stored response's routes (its tenancy: tests/reliability/test_durable_responses.py)
        ("GET", "/v1/responses/{response_id}"): ("/v1/responses/resp_x", None, True),
        ("DELETE", "/v1/responses/{response_id}"): ("/v1/responses/resp_x", None, True),
        ("GET", "/v1/responses/{response_id}/input_items"): ("/v1/responses/resp_x/input_items", None, True),
    }
    open_routes = {("GET", "/health"), ("GET", "/ready")}
    schema = tiny.app.openapi()["paths"]  # every route of the app, however its routers are kept
    app_routes = {(m.upper(), path) for path, ops in schema.items() for m in ops}
    assert app_routes == set(cases) | open_routes, f"routes without an auth case: {app_routes - set(cases) - open_routes}"
    for path in ("/docs", "/redoc", "/openapi.json"):  # no schema or docs without a key
        assert httpx.get(tiny.url + path).status_code == 404, path

    bad_keys = ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic key-a"}, {"Authorization": "Bearer key-a-x"})
    unauthorized_successes = checked = 0
    for (method, route), (path, body, owned) in sorted(cases.items()):
        path = path or route.replace("{session_id}", a_sid).replace("{request_id}", "req-x")
        for hdrs in bad_keys:
            r = httpx.request(method, tiny.url + path, json=body, headers=hdrs, timeout=30)
            unauthorized_successes += r.status_code < 400
            checked += 1
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (method, path, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
        if path and not owned:  # any valid key may use it
            for hdrs in (A, B):
                r = httpx.request(method, tiny.url + path, json=body, headers=hdrs, timeout=30)
                # past auth: served, or (chat on this tokenizer-less test model) the handler's own 400
                want = 400 if route in ("/v1/chat/completions", "/v1/responses") else 200
                assert r.status_code == want, (method, path, r.text)
    # owned routes: the other tenant sees exactly what a missing id gives; the owner succeeds
    # (a fresh session: this server expires idle ones after 1.5 s)
    missing = "0" * 32
    a_sid = sid_of(A)
    for method, suffix, body in (("GET", "", None), ("POST", "/generate", gen_body), ("DELETE", "", None)):
        theirs = httpx.request(method, f"{tiny.url}/v1/sessions/{a_sid}{suffix}", json=body, headers=B, timeout=30)
        gone = httpx.request(method, f"{tiny.url}/v1/sessions/{missing}{suffix}", json=body, headers=B, timeout=30)
        assert theirs.status_code == gone.status_code, (method, suffix)
        t, g = theirs.json(), gone.json()
        if "error" in t:
            assert theirs.status_code == 404 and t["error"]["code"] == g["error"]["code"] == "session_not_found"
            assert set(t["error"]) == set(g["error"]) and t["error"]["message"].replace(a_sid, missing) == g["error"]["message"]
        else:  # DELETE is idempotent: both say nothing was deleted
            assert {**t, "id": None} == {**g, "id": None} and t["deleted"] is False
        unauthorized_successes += theirs.status_code < 400 and "error" not in t and t.get("deleted") is not False
    mine = httpx.post(f"{tiny.url}/v1/sessions/{a_sid}/generate", json=gen_body, headers=A, timeout=30)
    assert mine.status_code == 200 and httpx.get(f"{tiny.url}/v1/sessions/{a_sid}", headers=A).status_code == 200
    # cancel: a live request of tenant A
    body = {"prompt": [5, 6, 7], "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{tiny.url}/v1/completions", json=body, headers=A, timeout=60) as stream:
        rid = stream.headers["x-request-id"]
        theirs = httpx.post(f"{tiny.url}/v1/requests/{rid}/cancel", headers=B)
        gone = httpx.post(f"{tiny.url}/v1/requests/req-{missing}/cancel", headers=B)
        assert theirs.status_code == gone.status_code == 404
        assert theirs.json()["error"]["code"] == gone.json()["error"]["code"] == "request_not_found"
        assert httpx.post(f"{tiny.url}/v1/requests/{rid}/cancel", headers=A).json()["cancelled"] is True
        stream.read()
    deleted = httpx.delete(f"{tiny.url}/v1/sessions/{a_sid}", headers=A).json()
    assert deleted["deleted"] is True
    for path in ("/health", "/ready"):
        assert httpx.get(tiny.url + path).status_code == 200
    print(f"\nauth matrix: {len(cases)} routes, {checked} unauthorised calls, {unauthorized_successes} succeeded")
    assert unauthorized_successes == 0


def test_queue_full_gives_429_with_retry_after(tiny):
    body = {"prompt": [5, 6, 7], "max_tokens": 600, "stream": True, "ignore_eos": True}
    holders = []

    def hold():
        with httpx.stream("POST", f"{tiny.url}/v1/completions", json=body, headers=A, timeout=60) as r:
            holders.append(r.status_code)
            for _ in r.iter_lines():
                pass

    threads = [threading.Thread(target=hold) for _ in range(2)]
    for t in threads:
        t.start()
    while len(holders) < 2:
        time.sleep(0.01)
    r = httpx.post(f"{tiny.url}/v1/completions", json={"prompt": [5], "max_tokens": 2}, headers=A)
    for t in threads:
        t.join()
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full"
    tiny.wait_idle()
    tiny.check_invariants()


def test_cancel_by_request_id(tiny):
    body = {"prompt": [5, 6, 7], "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{tiny.url}/v1/completions", json=body, headers=A, timeout=60) as r:
        rid = r.headers["x-request-id"]
        assert httpx.post(f"{tiny.url}/v1/requests/{rid}/cancel", headers=B).status_code == 404  # not theirs
        assert httpx.post(f"{tiny.url}/v1/requests/{rid}/cancel", headers=A).json()["cancelled"]
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"  # ended by the cancel, not by length or a stop
    assert sum(len(c["choices"][0]["text"]) >= 0 for c in chunks) < 3000
    tiny.wait_idle()


def test_cancel_by_request_id_ends_every_prompt_of_a_list(tiny):
    body = {"prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{tiny.url}/v1/completions", json=body, headers=A, timeout=60) as r:
        rid = r.headers["x-request-id"]
        assert httpx.post(f"{tiny.url}/v1/requests/{rid}/cancel", headers=A).json()["cancelled"]
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    ends = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
            if c["choices"][0]["finish_reason"]}
    assert ends == {0: "abort", 1: "abort", 2: "abort", 3: "abort"}
    tiny.wait_idle()
    tiny.check_invariants()


def test_a_list_of_prompts_counts_once_against_the_queue(tiny):
    """The tiny server queues 2 requests; 5 prompts in one request are one request (choices in
    prompt order, each equal to its prompt asked alone)."""
    prompts = [[5, 6 + i] for i in range(5)]
    body = {"prompt": prompts, "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    r = httpx.post(f"{tiny.url}/v1/completions", json=body, headers=A, timeout=60)
    assert r.status_code == 200, r.text
    got = [c["token_ids"] for c in r.json()["choices"]]
    alone = [httpx.post(f"{tiny.url}/v1/completions", json={**body, "prompt": p}, headers=A,
                        timeout=60).json()["choices"][0]["token_ids"] for p in prompts]
    assert got == alone
    tiny.wait_idle()
    tiny.check_invariants()


def test_max_tokens_left_out_generates_what_the_context_leaves(tiny):
    """max_tokens left out asks for 256 tokens, lowered to the room the context leaves (4,096 on
    the tiny model); the same 256 asked for is refused."""
    near = {"prompt": [5] * 4000, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{tiny.url}/v1/completions", json={**near, "max_tokens": 256}, headers=A, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    r = httpx.post(f"{tiny.url}/v1/completions", json=near, headers=A, timeout=60)
    assert r.status_code == 200, r.text
    usage, choice = r.json()["usage"], r.json()["choices"][0]
    assert (usage["prompt_tokens"], usage["completion_tokens"], choice["finish_reason"]) == (4000, 96, "length")
    far = httpx.post(f"{tiny.url}/v1/completions", json={**near, "prompt": [5] * 10}, headers=A, timeout=60)
    assert far.json()["usage"]["completion_tokens"] == 256
    tiny.wait_idle()
    tiny.check_invariants()


def test_idle_sessions_expire_and_answer_session_evicted(tiny):
    sid = httpx.post(f"{tiny.url}/v1/sessions", headers=A).json()["id"]
    r = httpx.post(f"{tiny.url}/v1/sessions/{sid}/generate", json={"input": [5, 6], "max_tokens": 2, "stream": False},
                   headers=A)
    assert r.status_code == 200
    time.sleep(3.5)
    r = httpx.get(f"{tiny.url}/v1/sessions/{sid}", headers=A)
    assert r.status_code == 410 and r.json()["error"]["code"] == "session_evicted"
    assert tiny.metric("s5_session_evictions_total", 'reason="ttl"') >= 1
    tiny.check_invariants()


@pytest.mark.parametrize("n", [1, 2])
def test_non_streaming_client_disconnect_aborts(tiny, n):
    """A client that leaves before its whole reply is ready gets every choice aborted."""
    before = tiny.metric("s5_requests_finished_total", 'finish_reason="abort"')
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{tiny.url}/v1/completions",
                   json={"prompt": [5, 6], "max_tokens": 4000, "ignore_eos": True, "n": n}, headers=A, timeout=1.0)
    tiny.wait_idle(timeout=20)
    assert tiny.metric("s5_requests_finished_total", 'finish_reason="abort"') == before + n
    tiny.check_invariants()


def test_sdk_leaving_generate_early_cancels_and_rolls_back(tiny):
    from service.client import Client, SessionBusy

    before = tiny.metric("s5_requests_finished_total", 'finish_reason="abort"')
    with Client(tiny.url, api_key="key-a") as client, client.create_session() as session:
        list(session.generate([5, 6, 7], max_tokens=4, ignore_eos=True))
        history = session.info()["history_tokens"]
        stream = session.generate([8, 9], max_tokens=3000, ignore_eos=True)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        tiny.wait_idle()
        assert session.info()["history_tokens"] == history  # rolled back to the last completed turn
        assert tiny.metric("s5_requests_finished_total", 'finish_reason="abort"') == before + 1
        busy = session.generate([1], max_tokens=3000, ignore_eos=True)
        next(busy)
        with pytest.raises(SessionBusy):
            list(session.generate([2], max_tokens=2))
        busy.close()
    tiny.wait_idle()
    tiny.check_invariants()


def test_per_key_limits_answer_429_and_leave_other_keys_alone():
    settings = Settings(engine=EngineConfig(model="tiny-random", max_rows=4, kv_cache_bytes=1 << 22),
                        port=free_port(), api_keys=("key-a", "key-b"), max_sessions_per_key=3,
                        max_requests_per_key=1)
    srv = LiveServer(settings).start()
    srv.headers = A
    try:
        sids = [httpx.post(f"{srv.url}/v1/sessions", headers=A).json()["id"] for _ in range(3)]
        r = httpx.post(f"{srv.url}/v1/sessions", headers=A)
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_sessions"
        assert "retry-after" not in r.headers  # only deletes and expiry free a key's sessions
        assert httpx.post(f"{srv.url}/v1/sessions", headers=B).status_code == 200  # another key
        httpx.delete(f"{srv.url}/v1/sessions/{sids[0]}", headers=A)
        assert httpx.post(f"{srv.url}/v1/sessions", headers=A).status_code == 200  # room again
        body = {"prompt": [5, 6, 7], "max_tokens": 3000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, headers=A, timeout=60) as live:
            lines = live.iter_lines()  # held: a dropped iterator closes the connection (an abort)
            next(lines)  # streaming
            r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [5], "max_tokens": 2}, headers=A)
            assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_requests"
            r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [5], "max_tokens": 2}, headers=B)
            assert r.status_code == 200
        assert srv.metric("s5_rejections_total", 'code="too_many_sessions"') == 1
        assert srv.metric("s5_rejections_total", 'code="too_many_requests"') == 1
        srv.wait_idle()
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [5], "max_tokens": 2}, headers=A)
        assert r.status_code == 200  # the stream ended: the key may send again
        srv.check_invariants()
    finally:
        srv.stop()


def test_a_streamed_body_over_the_limit_gets_413_and_a_form_body_is_named(tiny):
    """A chunked body (no Content-Length) past --max-body-bytes gets the same 413 as a declared
    one; a JSON body sent as a form (curl -d without a header) is told to use application/json."""
    body = json.dumps({"prompt": "x" * (5 << 20), "max_tokens": 1}).encode()

    def chunked():
        for i in range(0, len(body), 1 << 16):
            yield body[i:i + (1 << 16)]

    counts = {code: tiny.metric("s5_rejections_total", f'code="{code}"') for code in ("body_too_large", "invalid_request")}
    r = httpx.post(f"{tiny.url}/v1/completions", content=chunked(), headers={**A, "content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
    # counted once, as the answer the client got
    assert {code: tiny.metric("s5_rejections_total", f'code="{code}"') - n for code, n in counts.items()} == \
        {"body_too_large": 1, "invalid_request": 0}
    form = {**A, "content-type": "application/x-www-form-urlencoded"}
    r = httpx.post(f"{tiny.url}/v1/completions", content=b'{"prompt": [5], "max_tokens": 1}', headers=form)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "invalid_request"
    assert "Content-Type: application/json" in err["message"] and "x-www-form-urlencoded" in err["message"]
    ok = httpx.post(f"{tiny.url}/v1/completions", json={"prompt": [5], "max_tokens": 1}, headers=A, timeout=30)
    assert ok.status_code == 200
    tiny.check_invariants()


def test_a_session_stored_under_other_kv_settings_answers_409_naming_them(tmp_path):
    """A server started on a session database with another window leaves its sessions there and
    answers them 409 `session_incompatible` (the SDK's SessionIncompatible), naming the setting;
    started again with the session's settings, it serves the session; its owner may delete it
    from the other server."""
    from service.client import Client, Session, SessionIncompatible

    def serve(window: int):
        return live_server(model="tiny-random", max_rows=2, kv_cache_bytes=1 << 22, kv_window=window,
                           session_db=str(tmp_path / "s.sqlite3"))

    with serve(5) as srv:
        sid, gone = (httpx.post(f"{srv.url}/v1/sessions").json()["id"] for _ in range(2))
        for s in (sid, gone):
            r = httpx.post(f"{srv.url}/v1/sessions/{s}/generate", json={"input": [5, 6, 7], "max_tokens": 3})
            assert r.status_code == 200, r.text
        held = httpx.get(f"{srv.url}/v1/sessions/{sid}").json()["history_tokens"]
    with serve(6) as srv:
        r = httpx.post(f"{srv.url}/v1/sessions/{sid}/generate", json={"input": [8], "max_tokens": 2})
        err = r.json()["error"]
        assert r.status_code == 409 and err["code"] == "session_incompatible" and err["param"] == "session_id"
        assert "kv_window 5 (this server: 6)" in err["message"], err
        with pytest.raises(SessionIncompatible, match="kv_window 5"):
            Session(Client(srv.url), sid).info()
        assert httpx.get(f"{srv.url}/v1/sessions/{'0' * 32}").json()["error"]["code"] == "session_not_found"
        assert httpx.delete(f"{srv.url}/v1/sessions/{gone}").json()["deleted"] is True
        assert httpx.delete(f"{srv.url}/v1/sessions/{gone}").json()["deleted"] is False
    with serve(5) as srv:
        assert httpx.get(f"{srv.url}/v1/sessions/{sid}").json()["history_tokens"] == held
        assert httpx.get(f"{srv.url}/v1/sessions/{gone}").status_code == 404
