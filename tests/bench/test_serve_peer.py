"""bench.serve's accounting of streamed completions, on chunks recorded from the real servers: tokens
per chunk (s5serve's `token_ids`; llama.cpp's `timings.predicted_n`), the usage check, prefill
rate, and the s5serve / llama.cpp comparison. The recorded streams are replayed by a local aiohttp
server, so `_stream` reads them through the same HTTP client as in a run."""

import asyncio
import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench.serve import _stream, client_session, chunk_tokens, overhead, peer_comparison, peer_table, summarize

# llama-server (llama.cpp 0c1e570, built by bench/llama_cpp.py) on the embedded model's GGUF,
# /v1/completions streaming with `timings_per_token`, 24 tokens greedy after a prompt of Egyptian
# hieroglyphs: each character is 4 byte tokens, so the server holds a token's text back until the
# character is complete (a chunk per 4 tokens), and the last 3 tokens (an unfinished character)
# send no text at all
LLAMA_CPP_STREAM = '''data: {"choices":[{"text":" ","index":0,"logprobs":null,"finish_reason":null}],"created":1796178303,"model":"/root/.cache/s5serve/peers/llama.cpp-0.3.36/gemma-3-270m-q4_k_m.gguf","system_fingerprint":"b1-0c1e570","object":"text_completion","id":"chatcmpl-tFOSa2nhPrS0zWkRF1nhkIRy4lIsM6hU","timings":{"cache_n":0,"prompt_n":169,"prompt_ms":491.225,"prompt_per_token_ms":2.906656804733728,"prompt_per_second":344.03786452236756,"predicted_n":1,"predicted_ms":0.001,"predicted_per_token_ms":0.0,"predicted_per_second":0.0}}
data: {"choices":[{"text":"𓀀","index":0,"logprobs":null,"finish_reason":null}],"created":1796178303,"model":"/root/.cache/s5serve/peers/llama.cpp-0.3.36/gemma-3-270m-q4_k_m.gguf","system_fingerprint":"b1-0c1e570","object":"text_completion","id":"chatcmpl-tFOSa2nhPrS0zWkRF1nhkIRy4lIsM6hU","timings":{"cache_n":0,"prompt_n":169,"prompt_ms":491.225,"prompt_per_token_ms":2.906656804733728,"prompt_per_second":344.03786452236756,"predicted_n":5,"predicted_ms":80.206,"predicted_per_token_ms":20.0515,"predicted_per_second":49.87158067974964}}
data: {"choices":[{"text":"𓀁","index":0,"logprobs":null,"finish_reason":null}],"created":1796178303,"model":"/root/.cache/s5serve/peers/llama.cpp-0.3.36/gemma-3-270m-q4_k_m.gguf","system_fingerprint":"b1-0c1e570","object":"text_completion","id":"chatcmpl-tFOSa2nhPrS0zWkRF1nhkIRy4lIsM6hU","timings":{"cache_n":0,"prompt_n":169,"prompt_ms":491.225,"prompt_per_token_ms":2.906656804733728,"prompt_per_second":344.03786452236756,"predicted_n":9,"predicted_ms":146.403,"predicted_per_token_ms":18.300375,"predicted_per_second":54.64368899544409}}
data: {"choices":[{"text":"𓀂","index":0,"logprobs":null,"finish_reason":null}],"created":1796178303,"model":"/root/.cache/s5serve/peers/llama.cpp-0.3.36/gemma-3-270m-q4_k_m.gguf","system_fingerprint":"b1-0c1e570","object":"text_completion","id":"chatcmpl-tFOSa2nhPrS0zWkRF1nhkIRy4lIsM6hU","timings":{"cache_n":0,"prompt_n":169,"prompt_ms":491.225,"prompt_per_token_ms":2.906656804733728,"prompt_per_second":344.03786452236756,"predicted_n":13,"predicted_ms":221.806,"predicted_per_token_ms":18.483833333333333,"predicted_per_second":54.101331794451}}
data: {"choices":[{"text":"𓀃","index":0,"logprobs":null,"finish_reason":null}],"created":1796178303,"model":"/root/.cache/s5serve/peers/llama.cpp-0.3.36/gemma-3-270m-q4_k_m.gguf","system_fingerprint":"b1-0c1e570","object":"text_completion","id":"chatcmpl-tFOSa2nhPrS0zWkRF1nhkIRy4lIsM6hU","timings":{"cache_n":0,"prompt_n":169,"prompt_ms":491.225,"prompt_per_token_ms":2.906656804733728,"prompt_per_second":344.03786452236756,"predicted_n":17,"predicted_ms":292.257,"predicted_per_token_ms":18.2660625,"predicted_per_second":54.74633627252726}}
data: {"choices":[{"text":"𓀄","index":0,"logprobs":null,"finish_reason":null}],"created":1796178303,"model":"/root/.cache/s5serve/peers/llama.cpp-0.3.36/gemma-3-270m-q4_k_m.gguf","system_fingerprint":"b1-0c1e570","object":"text_completion","id":"chatcmpl-tFOSa2nhPrS0zWkRF1nhkIRy4lIsM6hU","timings":{"cache_n":0,"prompt_n":169,"prompt_ms":491.225,"prompt_per_token_ms":2.906656804733728,"prompt_per_second":344.03786452236756,"predicted_n":21,"predicted_ms":375.551,"predicted_per_token_ms":18.777549999999998,"predicted_per_second":53.25508386344332}}
data: {"choices":[{"text":"","index":0,"logprobs":null,"finish_reason":"length"}],"created":1796178303,"model":"/root/.cache/s5serve/peers/llama.cpp-0.3.36/gemma-3-270m-q4_k_m.gguf","system_fingerprint":"b1-0c1e570","object":"text_completion","usage":{"completion_tokens":24,"prompt_tokens":169,"total_tokens":193,"prompt_tokens_details":{"cached_tokens":0}},"id":"chatcmpl-tFOSa2nhPrS0zWkRF1nhkIRy4lIsM6hU","timings":{"cache_n":0,"prompt_n":169,"prompt_ms":491.225,"prompt_per_token_ms":2.906656804733728,"prompt_per_second":344.03786452236756,"predicted_n":24,"predicted_ms":433.977,"predicted_per_token_ms":18.868565217391303,"predicted_per_second":52.99820036545716}}
data: [DONE]
'''

# `s5serve serve --model tiny-random`: 4 tokens, the first chunk coalescing two, then the final
# chunk and the usage chunk
S5SERVE_STREAM = '''data: {"id":"cmpl-c15964a92b2c4b9a90e66f12b9162bc3","object":"text_completion","created":1796178324,"model":"tiny-random","choices":[{"index":0,"text":"","finish_reason":null,"logprobs":null,"token_ids":[10,304]}]}
data: {"id":"cmpl-c15964a92b2c4b9a90e66f12b9162bc3","object":"text_completion","created":1796178324,"model":"tiny-random","choices":[{"index":0,"text":"","finish_reason":null,"logprobs":null,"token_ids":[304]}]}
data: {"id":"cmpl-c15964a92b2c4b9a90e66f12b9162bc3","object":"text_completion","created":1796178324,"model":"tiny-random","choices":[{"index":0,"text":"","finish_reason":null,"logprobs":null,"token_ids":[304]}]}
data: {"id":"cmpl-c15964a92b2c4b9a90e66f12b9162bc3","object":"text_completion","created":1796178324,"model":"tiny-random","choices":[{"index":0,"text":"","finish_reason":"length","logprobs":null,"token_ids":[]}]}
data: {"id":"cmpl-c15964a92b2c4b9a90e66f12b9162bc3","object":"text_completion","created":1796178324,"model":"tiny-random","choices":[],"usage":{"prompt_tokens":6,"completion_tokens":4,"total_tokens":10,"prompt_tokens_details":{"cached_tokens":0}}}
data: [DONE]
'''


def chunks(stream: str) -> list[dict]:
    return [json.loads(line[6:]) for line in stream.strip().splitlines() if line != "data: [DONE]"]


def counts(objs: list[dict]) -> tuple[list[int], list[int]]:
    decoded, ns, ids = 0, [], []
    for obj in objs:
        n, got, decoded = chunk_tokens(obj, decoded)
        ns.append(n)
        ids.extend(got)
    return ns, ids


def streamed(stream: str, prompt_len: int) -> dict:
    """`_stream` reading `stream` as the server's response, in chunks that split lines (as a
    network may)."""

    async def replay(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] and len(body["prompt"]) == prompt_len
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        data = stream.encode()
        for i in range(0, len(data), 700):
            await resp.write(data[i:i + 700])
        await resp.write_eof()
        return resp

    async def run():
        app = web.Application()
        app.router.add_post("/v1/completions", replay)
        async with TestServer(app) as server:
            async with client_session(str(server.make_url("/")), 1) as client:
                return await _stream(client, {"prompt": list(range(prompt_len)), "stream": True}, 0)

    return asyncio.run(run())


def test_llama_cpp_chunks_count_the_tokens_its_timings_report():
    objs = chunks(LLAMA_CPP_STREAM)
    ns, ids = counts(objs)
    assert ns == [1, 4, 4, 4, 4, 4, 3]  # the final chunk carries the 3 tokens whose text never came
    assert sum(ns) == objs[-1]["usage"]["completion_tokens"] == 24
    assert ids == []  # its OpenAI stream has no token ids
    assert sum(bool(o["choices"][0]["text"]) for o in objs) == 6  # one per text chunk would count 6


def test_llama_cpp_without_per_token_timings_settles_on_its_final_count():
    # without `timings_per_token` only the final chunk has timings: one token per text chunk, and
    # the final chunk the rest
    objs = [{k: v for k, v in o.items() if k != "timings"} for o in chunks(LLAMA_CPP_STREAM)[:-1]]
    ns, _ = counts([*objs, chunks(LLAMA_CPP_STREAM)[-1]])
    assert ns == [1, 1, 1, 1, 1, 1, 18]


def test_s5serve_chunks_count_their_token_ids():
    ns, ids = counts(chunks(S5SERVE_STREAM))
    assert ns == [2, 1, 1, 0, 0]
    assert ids == [10, 304, 304, 304]


@pytest.mark.parametrize("stream, prompt_len, tokens", [(LLAMA_CPP_STREAM, 169, 24), (S5SERVE_STREAM, 6, 4)])
def test_a_stream_keeps_usage_timings_and_prompt_length(stream, prompt_len, tokens):
    res = streamed(stream, prompt_len)
    assert res["error"] is None and res["prompt_tokens"] == prompt_len
    assert sum(k for _, k in res["chunks"]) == res["usage"]["completion_tokens"] == tokens
    summ = summarize([res], slo_ttft=2.0, slo_tpot=0.1)
    assert summ["output_tokens"] == tokens and summ["token_count_mismatches"] == 0
    if stream is LLAMA_CPP_STREAM:
        assert summ["server_prefill_tok_s_mean"] == pytest.approx(344.03786452236756)
    else:
        assert summ["server_prefill_tok_s_mean"] is None


def test_prefill_rate_and_usage_mismatches():
    def result(sent, first, prompt, tokens, usage):
        return {"sent": sent, "chunks": [(first + 0.1 * i, 1) for i in range(tokens)], "ids": [], "error": None,
                "usage": {"completion_tokens": usage}, "timings": None, "prompt_tokens": prompt}

    summ = summarize([result(10.0, 11.0, 100, 20, 20), result(10.5, 12.0, 300, 20, 21)], 2.0, 0.1)
    assert summ["prefill_tok_s"] == pytest.approx(400 / 2.0)  # prompt tokens up to the last first token
    assert summ["token_count_mismatches"] == 1


def row(target: str, n: int, decode: float, out: float, prefill: float, ttft_mean: float, ttft_p50: float) -> dict:
    return {"target": target, "n": n, "decode_tok_s": decode, "output_tok_s": out, "prefill_tok_s": prefill,
            "ttft_s": {"mean": ttft_mean, "p50": ttft_p50}, "itl_s": {"p50": 0.02, "p99": 0.03}}


def test_the_comparison_is_s5serve_over_llama_cpp_per_n():
    rows = [row("llama.cpp", 1, 50.0, 20.0, 400.0, 0.5, 0.5), row("serve", 1, 60.0, 25.0, 300.0, 0.6, 0.6),
            row("serve", 8, 150.0, 100.0, 350.0, 4.0, 3.0), row("llama.cpp", 8, 100.0, 80.0, 350.0, 5.0, 6.0),
            row("serve", 16, 1.0, 1.0, 1.0, 1.0, 1.0)]  # no llama.cpp row at N=16: not compared
    comp = peer_comparison(rows)
    assert [c["n"] for c in comp] == [1, 8]
    assert comp[0]["s5serve_over_llama_cpp"] == pytest.approx(
        {"decode_tok_s": 1.2, "output_tok_s": 1.25, "prefill_tok_s": 0.75, "ttft_mean": 1.2, "ttft_p50": 1.2})
    assert comp[1]["s5serve_over_llama_cpp"]["ttft_p50"] == pytest.approx(0.5)
    assert overhead(rows[1], rows[0])["decode_tok_s"] == pytest.approx(1.2)  # the same ratios as a cluster row's
    table = peer_table(comp)
    assert len(table) == 3 and "x1.20" in table[1] and "x0.50" in table[2]


@pytest.mark.parametrize("warm", [True, False])
def test_warm_streams_are_sent_on_connections_opened_before_the_start(warm):
    """With `warm`, every stream's request goes out on a keep-alive connection the client opened
    (GET /health) before the start; without, on one opened when it was sent."""
    from bench.serve import _run_streams

    peers: dict[str, set] = {"/health": set(), "/v1/completions": set()}

    async def handle(request: web.Request) -> web.StreamResponse:
        peers[request.path].add(request.transport.get_extra_info("peername"))
        if request.path == "/health":
            return web.json_response({"status": "ok"})
        return web.Response(text=S5SERVE_STREAM, content_type="text/event-stream")

    async def run():
        app = web.Application()
        app.router.add_get("/health", handle)
        app.router.add_post("/v1/completions", handle)
        async with TestServer(app) as server:
            bodies = [{"prompt": [1, 2, 3], "stream": True} for _ in range(6)]
            return await _run_streams(str(server.make_url("")).rstrip("/"), bodies, [0.0] * 6, warm)

    results = asyncio.run(run())
    assert [sum(n for _, n in r["chunks"]) for r in results] == [4] * 6
    assert len(peers["/v1/completions"]) == 6  # six concurrent streams, a connection each
    if warm:
        assert peers["/v1/completions"] == peers["/health"]
    else:
        assert not peers["/health"]
