"""Logprobs, penalties, logit_bias and n > 1 through the served path (the openai SDK against a real
server with the embedded model): logprobs against the HF model's own log-softmax, streamed equal to
not streamed, each choice of n equal to a single request with its seed, the prompt prefilled once,
no row left behind."""

import json

import httpx
import pytest
import torch

pytestmark = pytest.mark.slow
MODEL = "gemma-3-270m"


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def test_completion_logprobs_equal_the_reference_models(server, client, embedded_reference):
    tok = server.state.tokenizer
    prompt = tok("The three primary colors are")["input_ids"]
    comp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=5,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = comp.choices[0]
    ids = choice.model_extra["token_ids"]
    lp = choice.logprobs
    with torch.inference_mode():
        logits = embedded_reference(torch.tensor([prompt + ids])).logits[0].float()
    ref = torch.log_softmax(logits[len(prompt) - 1: -1], dim=-1)  # the distribution each token came from
    for i, t in enumerate(ids):
        assert abs(lp.token_logprobs[i] - ref[i, t].item()) < 1e-3, i
        assert int(ref[i].argmax()) == t  # greedy: the most likely token
        want = torch.topk(ref[i], 5)
        top = lp.top_logprobs[i]
        assert len(top) == 5 and max(top.values()) == lp.token_logprobs[i]
        assert sorted(top.values(), reverse=True) == pytest.approx(want.values.tolist(), abs=1e-3)
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(s) for s in lp.tokens[:i]) for i in range(len(ids))]


def test_completion_logprobs_name_byte_tokens_apart(client):
    """Characters the model writes byte by byte (byte-fallback tokens, whose text alone is U+FFFD):
    each is named `bytes:\\xNN` in `tokens` and `top_logprobs`, as the OpenAI API names them, so
    the top entries stay distinct and the greedy token is the most likely one under its own name;
    its text offset is where its character starts. Streamed equals not streamed."""
    kw = dict(model=MODEL, prompt="\U00020000\U00020040\U00020080\U000200c0 " * 5, max_tokens=6, temperature=0,
              logprobs=3, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    choice = full.choices[0]
    lp = choice.logprobs
    assert any(t.startswith("bytes:\\x") for t in lp.tokens), lp.tokens
    for name, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and top[name] == value == max(top.values())
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(choice.text)
    streamed = {"tokens": [], "top_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            if c.logprobs is not None:
                for key in streamed:
                    streamed[key] += getattr(c.logprobs, key)
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    assert [sorted(t) for t in streamed["top_logprobs"]] == [sorted(t) for t in lp.top_logprobs]


def test_vllm_extras_min_p_and_stop_token_ids(server, client):
    """min_p 1 keeps only the top token, so a hot sample is the greedy text; stop_token_ids end
    the reply at the first of them (finish "stop", the token's text left out); an id past the
    vocabulary, or an extra this server does not implement (typical_p), is a 400 naming it."""
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8)
    greedy = client.completions.create(temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True}, **kw)
    hot = client.completions.create(temperature=1.5, seed=3, extra_body={"min_p": 1.0, "ignore_eos": True}, **kw)
    assert hot.choices[0].text == greedy.choices[0].text
    ids = greedy.choices[0].model_extra["token_ids"]
    k = ids.index(ids[3])
    before = client.completions.create(temperature=0, **{**kw, "max_tokens": k}) if k else None
    stopped = client.completions.create(temperature=0, extra_body={"stop_token_ids": [ids[3]]}, **kw)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == (before.choices[0].text if before else "")
    for extra, param in (({"stop_token_ids": [10**7]}, "stop_token_ids"), ({"typical_p": 0.5}, "typical_p"),
                         ({"min_p": 1.5}, "min_p")):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_chat_logprobs_streamed_equal_not_streamed(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Name three colors."}], max_tokens=6, temperature=0,
              logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content
    assert len(content) == 6 and "".join(c.token for c in content) == full.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token
        assert c.top_logprobs[0].logprob == c.logprob and c.logprob <= 0
        assert bytes(c.bytes).decode("utf-8", errors="replace") == c.token or "\ufffd" in c.token
    streamed = []
    for ch in client.chat.completions.create(stream=True, **kw):
        for c in ch.choices:
            if c.logprobs is not None:
                streamed += c.logprobs.content
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)


def test_n_choices_equal_single_requests_with_their_seeds_and_share_one_prefill(server, client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me about the sea."}], max_tokens=8,
              temperature=1.0, extra_body={"ignore_eos": True})
    before = server.stats().counters["prefill_tokens"], server.metric("s5_prefill_tokens_total")
    many = client.chat.completions.create(n=3, seed=11, **kw)
    prefilled = server.stats().counters["prefill_tokens"] - before[0]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert prefilled == many.usage.prompt_tokens  # the prompt once, not three times
    assert server.metric("s5_prefill_tokens_total") - before[1] == prefilled
    assert many.usage.completion_tokens == 24
    singles = [client.chat.completions.create(seed=11 + i, **kw).choices[0].message.content for i in range(3)]
    assert [c.message.content for c in many.choices] == singles
    assert len(set(singles)) == 3
    # streamed: the chunks of the choices interleave, each under its index
    texts = ["", "", ""]
    for ch in client.chat.completions.create(n=3, seed=11, stream=True, **kw):
        for c in ch.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == singles
    # completions, greedy: every choice is the greedy reply
    comp = client.completions.create(model=MODEL, prompt="Once upon a time", n=2, max_tokens=5, temperature=0)
    one = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert [c.text for c in comp.choices] == [one.choices[0].text] * 2
    server.wait_idle()
    server.check_invariants()
    stats = server.stats()
    assert stats.rows_used == stats.session_rows  # no row left behind


def test_a_list_of_prompts_answers_a_choice_per_prompt_and_n(server, client):
    """OpenAI's list prompts: choice p * n + j is completion j of prompt p, equal to that prompt
    asked alone (greedy, and sampled with the same seed); texts and token ids alike, streamed or
    not; usage counts each prompt once; echo starts each choice with its own prompt."""
    tok = server.state.tokenizer
    prompts = ["The capital of France is", "Once upon a time"]
    kw = dict(model=MODEL, max_tokens=6, extra_body={"ignore_eos": True})
    for sampling in (dict(temperature=0), dict(temperature=1.0, seed=5)):
        alone = [client.completions.create(prompt=p, n=2, **sampling, **kw) for p in prompts]
        want = [c.text for a in alone for c in a.choices]
        many = client.completions.create(prompt=prompts, n=2, **sampling, **kw)
        assert [c.index for c in many.choices] == [0, 1, 2, 3]
        assert [c.text for c in many.choices] == want
        assert many.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
        assert many.usage.completion_tokens == 4 * 6
        texts = [""] * 4
        for ch in client.completions.create(prompt=prompts, n=2, stream=True, **sampling, **kw):
            for c in ch.choices:
                texts[c.index] += c.text
        assert texts == want
        ids = [tok(p)["input_ids"] for p in prompts]
        by_ids = client.completions.create(prompt=ids, n=2, **sampling, **kw)
        assert [c.text for c in by_ids.choices] == want
    echoed = client.completions.create(prompt=prompts, echo=True, temperature=0, **kw)
    assert [c.text for c in echoed.choices] == [p + c.text for p, c in zip(
        prompts, client.completions.create(prompt=prompts, temperature=0, **kw).choices)]
    server.wait_idle()
    server.check_invariants()
    stats = server.stats()
    assert stats.rows_used == stats.session_rows  # no row left behind


def test_a_bad_prompt_in_a_list_refuses_the_request_and_leaves_nothing_running(server):
    """A prompt the engine refuses refuses the whole request; the prompts started before it are
    aborted at once (no row held, nothing left running)."""
    url = f"{server.url}/v1/completions"
    for prompt in (["fine", [10**9]], [[5, 6], []], ["ok", "x" * 200000]):
        r = httpx.post(url, json={"prompt": prompt, "max_tokens": 4, "ignore_eos": True}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    sid = httpx.post(f"{server.url}/v1/sessions").json()["id"]
    r = httpx.post(url, json={"prompt": ["a", "b"], "max_tokens": 2, "session_id": sid}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(url, json={"prompt": ["a"] * 257, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    server.wait_idle()
    server.check_invariants()
    stats = server.stats()
    assert stats.rows_used == stats.session_rows
    assert (stats.num_running, stats.num_waiting) == (0, 0)


def test_logit_bias_forces_and_bans_a_token_and_penalties_change_the_reply(server):
    tok = server.state.tokenizer
    base = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    url = f"{server.url}/v1/completions"
    plain = httpx.post(url, json=base, timeout=60).json()["choices"][0]["token_ids"]
    forced_id = tok(" banana", add_special_tokens=False)["input_ids"][0]
    forced = httpx.post(url, json={**base, "logit_bias": {str(forced_id): 100}}, timeout=60).json()
    assert forced["choices"][0]["token_ids"] == [forced_id] * 4
    banned = httpx.post(url, json={**base, "logit_bias": {str(plain[0]): -100}}, timeout=60).json()
    assert plain[0] not in banned["choices"][0]["token_ids"]
    repeat = {**base, "prompt": "one one one one one one one", "max_tokens": 6}
    free = httpx.post(url, json=repeat, timeout=60).json()["choices"][0]["token_ids"]
    penalized = httpx.post(url, json={**repeat, "repetition_penalty": 3.0, "frequency_penalty": 2.0},
                           timeout=60).json()["choices"][0]["token_ids"]
    one = tok(" one", add_special_tokens=False)["input_ids"][0]
    assert free.count(one) > penalized.count(one)


def test_session_turn_logprobs_streamed(server):
    sid = httpx.post(f"{server.url}/v1/sessions").json()["id"]
    body = {"input": "The capital of France is", "max_tokens": 4, "temperature": 0, "logprobs": 2}
    events = []
    with httpx.stream("POST", f"{server.url}/v1/sessions/{sid}/generate", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    tokens = [e for e in events if e["type"] == "token"]
    lps = [x for e in tokens for x in e["logprobs"]]
    assert [x["token_id"] for x in lps] == [t for e in tokens for t in e["token_ids"]]
    assert all(x["top_logprobs"][0]["token_id"] == x["token_id"] for x in lps)  # greedy
    httpx.delete(f"{server.url}/v1/sessions/{sid}")


def test_null_parameters_ask_for_their_defaults(server):
    """`null` for `n`, `stream`, `echo`, `ignore_eos`, `return_token_ids` and `store` (the OpenAI API
    types them "or null"; clients that send every field send it) answers as if they were left out."""
    def post(path, body):
        r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r

    chat = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 5, "temperature": 0}
    nulls = {"n": None, "stream": None, "ignore_eos": None, "return_token_ids": None}
    want = post("/v1/chat/completions", chat).json()["choices"]
    got = post("/v1/chat/completions", {**chat, **nulls}).json()["choices"]
    assert [c["message"]["content"] for c in got] == [c["message"]["content"] for c in want] and len(want) == 1
    assert "token_ids" not in got[0]
    comp = {"prompt": "The three primary colors are", "max_tokens": 5, "temperature": 0}
    want = post("/v1/completions", comp).json()["choices"][0]["text"]
    assert post("/v1/completions", {**comp, **nulls, "echo": None}).json()["choices"][0]["text"] == want
    resp = post("/v1/responses", {"input": "Name a color.", "max_output_tokens": 5, "temperature": 0,
                                  "stream": None, "store": None}).json()
    assert resp["object"] == "response" and resp["store"] is True
    httpx.delete(f"{server.url}/v1/responses/{resp['id']}", timeout=30)
    sid = httpx.post(f"{server.url}/v1/sessions").json()["id"]
    r = post(f"/v1/sessions/{sid}/generate", {"input": "Hi", "max_tokens": 2, "stream": None})
    assert r.headers["content-type"].startswith("text/event-stream")  # the session route's default: streamed
    httpx.delete(f"{server.url}/v1/sessions/{sid}", timeout=30)
