"""Errors raised before a route runs (the body does not parse, no such route or method) read like
every other error: a message a person can act on, the field it is about as `param` (or null),
and the type of their status. No model is loaded: these never reach the engine."""

import pytest
from fastapi.testclient import TestClient

from engine import EngineConfig
from service.app import create_app
from service.settings import Settings


@pytest.fixture(scope="module")
def client():
    return TestClient(create_app(Settings(engine=EngineConfig(model="tiny-random"))))  # no lifespan: no engine


def post(client, path, raw: bytes):
    return client.post(path, content=raw, headers={"content-type": "application/json"})


# (body, message, param)
CASES = [
    (b'{"messages": [', "the request body is not valid JSON: Expecting value at character 14", None),
    (b'{"prompt": "a",}', "the request body is not valid JSON: Expecting property name enclosed in double quotes "
     "at character 15", None),
    (b"", "the request body must be a JSON object (it is empty)", None),
    (b"[1, 2]", "the request body must be a JSON object", None),
    (b'{"prompt": 5}', "prompt: invalid type or value (Input should be a valid string)", "prompt"),
    (b'{"prompt": "a", "temperature": "hot"}',
     "temperature: Input should be a valid number", "temperature"),
]


@pytest.mark.parametrize(("raw", "message", "param"), CASES)
def test_bodies_that_do_not_parse(client, raw, message, param):
    r = post(client, "/v1/completions", raw)
    assert r.status_code == 400
    assert r.json() == {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                  "code": "invalid_request"}}


def test_a_nested_field_is_named_by_its_path(client):
    r = post(client, "/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"
    assert r.json()["error"]["message"].startswith("messages.0.content: invalid type or value")


def test_wrong_method_and_unknown_route(client):
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json() == {"error": {"message": "method GET is not allowed on /v1/chat/completions (allowed: POST)",
                                  "type": "invalid_request_error", "param": None, "code": "method_not_allowed"}}
    r = client.delete("/v1/models")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    # a path that two routes serve: Allow names both methods (RFC 9110), not the first route's
    for path in ("/v1/sessions/x", "/v1/responses/resp_x"):
        r = client.put(path)
        assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET", (path, r.headers)
        assert r.json()["error"]["message"].endswith("(allowed: DELETE, GET)")
    r = client.get("/v1/nothing")
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "no route GET /v1/nothing", "type": "not_found_error", "param": None,
                                  "code": "not_found"}}
