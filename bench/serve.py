"""Served benchmark: what a user gets through the HTTP front door, beside the engine's own rate.

Starts `s5serve serve` (or takes `--base-url` of any OpenAI-compatible server, e.g. llama.cpp's)
and drives streaming `/v1/completions` with token-id prompts, greedy, `ignore_eos`:

    --mode concurrency   N streams started together, each a distinct prompt (decode-1238 served)
    --mode rate          --num-prompts requests arriving as a Poisson process of --rate req/s
    --mode sessions      --sessions conversations of --turns turns: each turn's prompt is the whole
                         conversation so far plus --turn-tokens new tokens (s5serve: the same
                         session_id, so only the new part is prefilled; others: prefix caching)

Per N it reports output tok/s, decode tok/s while all streams decode (from the last stream's first
token to the first stream's last, BENCH.md's definition), TTFT, TPOT and ITL at p50/p90/p99,
errors, goodput under an SLO (--slo-ttft, --slo-tpot), and the server's event-loop lag (its
/metrics). For s5serve it also runs the engine itself on the same model, prompts and settings in
this process (`bench.throughput.run_engine`), with the started server idle beside it, right before
the served run, so `served / engine` is one number from one run. `--rounds K` repeats that pair K
times and reports the median round: on a machine whose speed drifts (a virtual machine whose
hypervisor takes CPU time, recorded per run as `stolen_s`) one pair alone can read 0.8 or 1.2.
Tokens per SSE chunk come from the chunk's `token_ids` (s5serve's `return_token_ids`; a coalesced
chunk carries several), else one token per chunk.

The client is aiohttp, as vLLM's benchmark's is: a burst of requests from one client process
reaches the server two to three times sooner than with httpx, and that client time is part of every
TTFT measured (`--client-procs` spreads the streams over processes). In concurrency mode each
client process opens its streams' keep-alive connections before the timed start, as a client with
a connection pool holds them (`--no-warm-connections`: each request connects when it is sent).

    python -m bench.serve --model embedded --n 1 8 32 --new-tokens 128      # CPU, int8 as served
    python -m bench.serve --shape gemma3-1b --device cuda --dtype bfloat16 --n 64 256 --new-tokens 512
    python -m bench.serve --base-url http://127.0.0.1:8080 --n 1 8           # any OpenAI server

`--targets serve cluster:1 cluster:2` runs each N against `s5serve serve` and against `s5serve
cluster` with 1 and 2 replicas on Ray Serve (same engine settings, all on this machine), and reports
each cluster row's overhead against the `serve` row of the same N (TTFT, ITL, tok/s ratios).

`--targets serve llama.cpp` (with `--model embedded`, on the CPU) runs each N also against llama.cpp's
`llama-server` (bench/llama_cpp.py builds it once into the cache dir) on the same GGUF the embedded
model is converted from, with -np N slots and the same thread count, and reports s5serve's figures
over llama.cpp's (decode and output tok/s, prefill tok/s, TTFT mean and p50). One server runs at a
time. llama.cpp sends no token ids in its OpenAI stream: its chunks are counted from
`timings.predicted_n` (asked for with `timings_per_token`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import date
from pathlib import Path

import aiohttp
import httpx

# ---- one stream -------------------------------------------------------------------------------------


def client_session(base_url: str, streams: int) -> aiohttp.ClientSession:
    """The benchmark's HTTP client: a connection per concurrent stream, no overall timeout, lines
    (SSE events) of up to 16 MiB."""
    return aiohttp.ClientSession(base_url, connector=aiohttp.TCPConnector(limit=streams + 8),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=60), read_bufsize=1 << 24)


async def _stream(client: aiohttp.ClientSession, body: dict, start_at: float) -> dict:
    """One streaming completion; arrival times and token counts of its chunks."""
    delay = start_at - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.monotonic()
    chunks: list[tuple[float, int]] = []  # (arrival, tokens)
    ids: list[int] = []  # the tokens, where the server sends them
    usage, timings, error = None, None, None
    decoded = 0  # llama.cpp: tokens generated so far, from its per-chunk timings
    try:
        async with client.post("/v1/completions", json=body) as r:
            if r.status != 200:
                return {"sent": sent, "chunks": [], "error": f"{r.status} {(await r.read())[:200]!r}"}
            async for raw in r.content:  # one line at a time
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    error = str(obj["error"])
                    break
                now = time.monotonic()
                if obj.get("usage"):
                    usage = obj["usage"]
                if obj.get("timings"):
                    timings = obj["timings"]
                n, got, decoded = chunk_tokens(obj, decoded)
                if n:
                    chunks.append((now, n))
                    ids.extend(got)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    prompt = body.get("prompt")
    return {"sent": sent, "chunks": chunks, "ids": ids, "usage": usage, "timings": timings, "error": error,
            "prompt_tokens": len(prompt) if isinstance(prompt, list) else None}


def chunk_tokens(obj: dict, decoded: int) -> tuple[int, list[int], int]:
    """The tokens one streamed completion chunk carries, their ids where sent, and the tokens
    generated so far. The ids are the choices' `token_ids` (s5serve's `return_token_ids`, vLLM; a
    coalesced chunk carries several) or `tokens`. Without ids, llama.cpp's `timings.predicted_n`
    (every chunk has it with `timings_per_token`) counts them: its server sends a chunk per token,
    except that a token ending inside a UTF-8 character goes out with the next one, and its final
    chunk (no text) repeats the count. Else a choice with text is one token."""
    n, ids = 0, []
    for ch in obj.get("choices", []):
        got = ch.get("token_ids") or ch.get("tokens")
        if got is not None:
            n += len(got)
            ids.extend(got)
        elif ch.get("text"):
            n += 1
    predicted = (obj.get("timings") or {}).get("predicted_n")
    if predicted is not None and not ids:
        n, decoded = max(0, predicted - decoded), max(decoded, predicted)
    else:
        decoded += n
    return n, ids, decoded


async def _open_connections(client: aiohttp.ClientSession, count: int) -> None:
    """`count` keep-alive connections in the client's pool, opened by as many concurrent GET
    /health (any answer will do)."""

    async def one() -> None:
        async with client.get("/health") as r:
            await r.read()

    await asyncio.gather(*(one() for _ in range(count)))


async def _run_streams(base_url: str, bodies: list[dict], starts: list[float], warm: bool) -> list[dict]:
    async with client_session(base_url, len(bodies)) as client:
        if warm:
            await _open_connections(client, len(bodies))
        return await asyncio.gather(*(_stream(client, b, s) for b, s in zip(bodies, starts)))


def _client_proc(base_url: str, bodies: list[dict], starts: list[float], warm: bool) -> list[dict]:
    return asyncio.run(_run_streams(base_url, bodies, starts, warm))


def drive(base_url: str, bodies: list[dict], offsets: list[float], procs: int, warm: bool = False) -> list[dict]:
    """Send `bodies` at `offsets` seconds from now, spread over `procs` client processes (so
    the client is not the limit); CLOCK_MONOTONIC is shared by the processes of one machine.
    With `warm`, each client process first opens a keep-alive connection per stream it will send
    (as a client that holds a connection pool has them), so no request's time includes opening a
    connection; else each request opens its own when it is sent."""
    t0 = time.monotonic() + 1.0 + 0.2 * procs
    starts = [t0 + o for o in offsets]
    if procs <= 1:
        return _client_proc(base_url, bodies, starts, warm)
    parts = [list(range(i, len(bodies), procs)) for i in range(procs)]
    out: list[dict | None] = [None] * len(bodies)
    with ProcessPoolExecutor(procs) as pool:
        futs = [pool.submit(_client_proc, base_url, [bodies[i] for i in p], [starts[i] for i in p], warm)
                for p in parts]
        for p, f in zip(parts, futs):
            for i, res in zip(p, f.result()):
                out[i] = res
    return out


# ---- figures -----------------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summarize(results: list[dict], slo_ttft: float, slo_tpot: float) -> dict:
    ok = [r for r in results if not r["error"] and r["chunks"]]
    errors = [r["error"] for r in results if r["error"]]
    ttft = [r["chunks"][0][0] - r["sent"] for r in ok]
    itl, tpot, good = [], [], 0
    for r in ok:
        times = [t for t, _ in r["chunks"]]
        n = sum(k for _, k in r["chunks"])
        # ITL per chunk, split evenly over the tokens it carried (a coalesced chunk is k tokens)
        for (t_prev, _), (t, k) in zip(r["chunks"], r["chunks"][1:]):
            itl.extend([(t - t_prev) / k] * k)
        tp = (times[-1] - times[0]) / (n - r["chunks"][0][1]) if n > r["chunks"][0][1] else 0.0
        tpot.append(tp)
        good += (times[0] - r["sent"]) <= slo_ttft and tp <= slo_tpot
    total = sum(k for r in ok for _, k in r["chunks"])
    start = min(r["sent"] for r in results)
    end = max(r["chunks"][-1][0] for r in ok) if ok else start
    # BENCH.md: decode rate with every stream decoding, from the last stream's first token to the
    # first stream's last; tokens of a chunk arrive with it (its first token is the one that ends TTFT)
    decode = None
    if ok:
        t_all = max(r["chunks"][0][0] for r in ok)
        t_done = min(r["chunks"][-1][0] for r in ok)
        in_window = sum(k for r in ok for t, k in r["chunks"] if t_all < t <= t_done)
        if t_done > t_all and in_window >= 8 * len(ok):
            decode = in_window / (t_done - t_all)
    span = end - start
    # prefill: the streams' prompt tokens over the time from the first request to the last first token
    prompt_tokens = [r.get("prompt_tokens") for r in ok]
    prefill = None
    if ok and None not in prompt_tokens:
        t_first = max(r["chunks"][0][0] for r in ok)
        prefill = sum(prompt_tokens) / (t_first - start) if t_first > start else None
    # the server's own count: streams whose counted tokens differ from usage.completion_tokens
    counted = [(sum(k for _, k in r["chunks"]), (r.get("usage") or {}).get("completion_tokens")) for r in ok]
    server_prefill = [r["timings"]["prompt_per_second"] for r in ok
                      if (r.get("timings") or {}).get("prompt_per_second") is not None]
    return {
        "requests": len(results), "errors": len(errors), "error_samples": errors[:3],
        "output_tokens": total, "output_tok_s": total / span if span > 0 else None, "decode_tok_s": decode,
        "prefill_tok_s": prefill,
        "token_count_mismatches": sum(u is not None and c != u for c, u in counted),
        "server_prefill_tok_s_mean": sum(server_prefill) / len(server_prefill) if server_prefill else None,
        "ttft_s": {f"p{q}": pct(ttft, q) for q in (50, 90, 99)} | {"mean": sum(ttft) / len(ttft) if ttft else None},
        "tpot_s": {f"p{q}": pct(tpot, q) for q in (50, 90, 99)},
        "itl_s": {f"p{q}": pct(itl, q) for q in (50, 90, 99)},
        "chunks_per_token": sum(len(r["chunks"]) for r in ok) / total if total else None,
        "goodput_req_s": good / span if span > 0 else None, "good_requests": good,
        "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot},
    }


def scrape(base_url: str, client: httpx.Client | None = None) -> dict[str, float]:
    """Counters and histogram sums of the server's /metrics that the run reports (s5serve).
    Repeated scrapes pass one `client`: each new one builds a TLS context (tens of ms of CPU on a
    small machine, taken from the server under test), http:// URLs included."""
    try:
        text = (client.get(f"{base_url}/metrics") if client is not None
                else httpx.get(f"{base_url}/metrics", timeout=10)).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("s5_") and not line.startswith("#"):
            key, _, val = line.rpartition(" ")
            try:
                out[key] = float(val)
            except ValueError:
                pass
    return out


def mean_of(before: dict, after: dict, name: str) -> float | None:
    """The mean of a histogram's observations between two scrapes."""
    count = after.get(f"{name}_count", 0) - before.get(f"{name}_count", 0)
    return (after.get(f"{name}_sum", 0) - before.get(f"{name}_sum", 0)) / count if count > 0 else None


def loop_lag(before: dict, after: dict) -> dict:
    """Event-loop lag over the run from the s5_event_loop_lag_seconds histogram: samples, mean,
    the bucket bounds under which 99% and all of the run's samples fell (None: some above the
    last bound), the worst since the server started, and the front end's garbage collections in
    the run (count and seconds, from s5_gc_pause_seconds)."""
    name = "s5_event_loop_lag_seconds"
    count = after.get(f"{name}_count", 0) - before.get(f"{name}_count", 0)
    if count <= 0:
        return {}
    total = after.get(f"{name}_sum", 0) - before.get(f"{name}_sum", 0)
    buckets = sorted((float(k.split('le="')[1].rstrip('"}')), after[k] - before.get(k, 0))
                     for k in after if k.startswith(f"{name}_bucket") and "+Inf" not in k)
    p99 = next((le for le, c in buckets if c >= 0.99 * count), None)
    worst = next((le for le, c in buckets if c >= count), None)
    gc_runs = {k: after[k] - before.get(k, 0) for k in after if k.startswith("s5_gc_pause_seconds_")}
    return {"samples": count, "mean_s": total / count, "p99_le_s": p99, "max_le_s": worst,
            "max_since_start_s": after.get("s5_event_loop_lag_max_seconds"),
            "gc_collections": sum(v for k, v in gc_runs.items() if k.startswith("s5_gc_pause_seconds_count")),
            "gc_seconds": sum(v for k, v in gc_runs.items() if k.startswith("s5_gc_pause_seconds_sum"))}


class LagWatch:
    """Polls the server's event-loop lag histogram through a run (every `period` s, on a thread),
    so `phases` can say when the late wake-ups happened: while requests arrived and prefilled (to
    the last stream's first token), while every stream decoded, or while streams ended."""

    NAME = "s5_event_loop_lag_seconds"

    def __init__(self, base_url: str, period: float = 0.25) -> None:
        import threading

        self.base_url, self.period = base_url, period
        self.polls: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LagWatch:
        self._client = httpx.Client(timeout=10)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._client.close()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            got = scrape(self.base_url, self._client)
            late = {le: got[f"{self.NAME}_count"] - got[f'{self.NAME}_bucket{{le="{le}"}}']
                    for le in ("0.01", "0.025") if f"{self.NAME}_count" in got}
            self.polls.append((time.monotonic(), late))

    def phases(self, results: list[dict]) -> dict | None:
        """Late wake-ups (over 10 ms, over 25 ms) counted per phase of the run."""
        ok = [r for r in results if not r["error"] and r["chunks"]]
        if not ok or len(self.polls) < 2:
            return None
        t_all = max(r["chunks"][0][0] for r in ok)
        t_done = min(r["chunks"][-1][0] for r in ok)
        out = {ph: {"over_10ms": 0, "over_25ms": 0} for ph in ("arriving", "all_decoding", "ending")}
        for (_, before), (t, after) in zip(self.polls, self.polls[1:]):
            ph = "arriving" if t - self.period / 2 <= t_all else "all_decoding" if t - self.period / 2 <= t_done \
                else "ending"
            for le, key in (("0.01", "over_10ms"), ("0.025", "over_25ms")):
                out[ph][key] += int(after.get(le, 0) - before.get(le, 0))
        return out


# ---- the server under test ---------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_spec(a, workdir: Path) -> str:
    """`--model`, or a `random:` directory holding a BENCH.md shape's config (and a tokenizer)."""
    if not a.shape:
        return a.model
    from bench.throughput import shape_model_dir

    return shape_model_dir(a.shape, workdir / a.shape, a.tokenizer)


class EngineBaseline:
    """The engine alone on the same model, prompts and settings, in this process: loaded and
    warmed up once (the server warms its engine up before it serves: first-call costs such as lazy
    initialisation and kernel compilation for the step shapes are not the steady rate), then run
    once per round."""

    def __init__(self, spec: str, a, prompts, n: int) -> None:
        from bench.throughput import run_engine
        from engine import EngineConfig
        from engine.model.loader import load_model

        self.a, self.prompts, self.n = a, prompts, n
        self.loaded = load_model(EngineConfig(model=spec, device=a.device, dtype=a.dtype,
                                              quantization=a.quantization))
        run_engine(self.loaded, "s5", prompts[:2], 8, a.device, **engine_settings(a, n))

    def run(self) -> dict:
        from bench.throughput import run_engine

        with Stolen() as stolen:
            res = run_engine(self.loaded, "s5", self.prompts, self.a.new_tokens, self.a.device,
                             **engine_settings(self.a, self.n))
        return {**res, "stolen_s": stolen.seconds}

    def close(self) -> None:
        import torch

        self.loaded = None
        if self.a.device.startswith("cuda"):
            torch.cuda.empty_cache()


class Stolen:
    """CPU time a hypervisor took from this machine (Linux /proc/stat's steal column, summed over
    the CPUs) while the block ran, in seconds; None where the kernel does not report it."""

    def __enter__(self) -> Stolen:
        self.seconds, self._start = None, self._read()
        return self

    def __exit__(self, *exc) -> None:
        end = self._read()
        if self._start is not None and end is not None:
            self.seconds = (end - self._start) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _read() -> int | None:
        try:
            with open("/proc/stat") as f:
                return int(f.readline().split()[8])
        except (OSError, IndexError, ValueError):
            return None


class ServerCPU:
    """CPU time (user + system, from /proc) that the server's processes and this benchmark's own
    process spent while the block ran, by role: `front_end` (the server process and any further
    front-end processes), `engine` (engine.process), `tokenizer` (service.tokenize_worker) and
    `client` (this process: the streams' client, with the lag poll beside it). On a machine whose
    cores the engine shares with the rest, what the others take is what the engine loses.
    Processes are found when the block starts (for a cluster, Ray's own processes count as front
    end); the block holds the run's start delay and prefill too. Linux only (empty elsewhere)."""

    ROLES = (("engine.process", "engine"), ("service.tokenize_worker", "tokenizer"))  # `python -m` modules

    def __init__(self, root_pid: int | None) -> None:
        self.root_pid = root_pid
        self.seconds: dict[str, float] = {}

    def __enter__(self) -> ServerCPU:
        self._pids = self._tree(self.root_pid) if self.root_pid is not None else {}
        self._start = self._read()
        return self

    def __exit__(self, *exc) -> None:
        end = self._read()
        self.seconds = {role: end[role] - self._start[role] for role in end if role in self._start}

    def per_token_ms(self, tokens: int) -> dict[str, float] | None:
        return {role: 1e3 * s / tokens for role, s in self.seconds.items()} if self.seconds and tokens else None

    def _read(self) -> dict[str, float]:
        out: dict[str, float] = {}
        tick = os.sysconf("SC_CLK_TCK")
        for pid, role in [*self._pids.items(), (os.getpid(), "client")]:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
        return out

    @classmethod
    def _tree(cls, root: int) -> dict[int, str]:
        """`root` and its descendants (the children of each of their threads), each with its role."""
        roles, frontier = {}, [root]
        while frontier:
            pid = frontier.pop()
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().decode(errors="replace").split("\0")
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{tid}/children") as f:
                        frontier += [int(c) for c in f.read().split()]
            except OSError:  # gone meanwhile
                continue
            roles[pid] = next((role for module, role in cls.ROLES if module in argv), "front_end")
        return roles


def median_round(rounds: list[dict]) -> int:
    """The index of the round whose served/engine ratio (served decode tok/s without an engine
    baseline) is the median (the lower one of an even count)."""
    key = [r["ratio"] if r["ratio"] is not None else (r["served_decode_tok_s"] or 0.0) for r in rounds]
    order = sorted(range(len(rounds)), key=key.__getitem__)
    return order[(len(order) - 1) // 2]


def engine_settings(a, n: int) -> dict:
    return {"max_rows": max(n, 1), "max_num_batched_tokens": a.max_batched_tokens,
            "max_decode_stall_ms": a.max_decode_stall_ms,
            "kv_cache_bytes": max(2 << 30, n * (64 << 20)) if a.device.startswith("cuda") else max(1 << 30, n * (32 << 20))}


def start_server(spec: str, a, n: int, port: int, log: Path, target: str = "serve") -> subprocess.Popen:
    """`s5serve serve`; for `serve:K` with K front-end processes (`--api-servers K`); for
    `cluster:R` `s5serve cluster` with R replicas (every replica with the engine settings of N
    rows, as `serve` has)."""
    es = engine_settings(a, n)
    command = ["serve"]
    if target.startswith("serve:"):
        command += ["--api-servers", target.split(":", 1)[1]]
    if target.startswith("cluster:"):
        replicas = int(target.split(":", 1)[1])
        command = ["cluster", "--replicas", str(replicas), "--replica-cpus", "0"]
        if a.device == "cuda":  # more replicas than GPUs share them (two on one GPU: 0.5 each)
            import torch

            command += ["--replica-gpus", str(min(1.0, torch.cuda.device_count() / replicas))]
    args = [sys.executable, "-m", "service.cli", *command, "--model", spec, "--device", a.device, "--dtype", a.dtype,
            "--quantization", a.quantization or "none", "--rows", str(es["max_rows"]),
            "--kv-cache-bytes", str(es["kv_cache_bytes"]),
            "--queue-size", str(max(256, 4 * n)), "--session-db", "none", "--port", str(port)]
    if es["max_decode_stall_ms"] is not None:
        args += ["--max-decode-stall-ms", str(es["max_decode_stall_ms"])]
    if es["max_num_batched_tokens"] is not None:
        args += ["--max-num-batched-tokens", str(es["max_num_batched_tokens"])]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if a.threads:  # the server's (every replica's) engine threads; Ray gives an actor 1 unless told
        env["OMP_NUM_THREADS"] = str(a.threads)
    proc = subprocess.Popen(args, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    from bench.llama_cpp import wait_until_up

    return wait_until_up(proc, f"http://127.0.0.1:{port}/ready", log, 900, "server")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(120)  # a cluster drains its replicas and stops Ray
    except subprocess.TimeoutExpired:
        proc.kill()


def overhead(row: dict, base: dict) -> dict:
    """A row's figures over those of `base`: a cluster row over the `s5serve serve` row of the same
    N, or the `serve` row over a peer's (llama.cpp's)."""
    def ratio(x, y):
        return x / y if x is not None and y else None

    return {"ttft_p50": ratio(row["ttft_s"]["p50"], base["ttft_s"]["p50"]),
            "ttft_mean": ratio(row["ttft_s"]["mean"], base["ttft_s"]["mean"]),
            "itl_p50": ratio(row["itl_s"]["p50"], base["itl_s"]["p50"]),
            "itl_p99": ratio(row["itl_s"]["p99"], base["itl_s"]["p99"]),
            "output_tok_s": ratio(row["output_tok_s"], base["output_tok_s"]),
            "decode_tok_s": ratio(row["decode_tok_s"], base["decode_tok_s"]),
            "prefill_tok_s": ratio(row.get("prefill_tok_s"), base.get("prefill_tok_s"))}


# ---- workloads ---------------------------------------------------------------------------------------


def completion(prompt: list[int], a, model: str | None, **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": a.new_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True, "return_tokens": True, **extra}
    if model:
        body["model"] = model
    return body


def run_sessions(url: str, a, vocab: int, model: str | None) -> dict:
    """Multi-turn: every turn of a conversation waits for the one before; conversations run
    concurrently, arrivals staggered over the first second."""
    rng = random.Random(1)

    async def conversation(client: aiohttp.ClientSession, c: int) -> list[dict]:
        await asyncio.sleep(rng.random())
        history: list[int] = []
        turns = []
        sid = None
        if a.session_ids:
            async with client.post("/v1/sessions") as r:
                sid = (await r.json())["id"] if r.status == 200 else None
        for _ in range(a.turns):
            new = [rng.randrange(3, vocab) for _ in range(a.turn_tokens)]
            prompt = history + new
            body = completion(prompt, a, model, **({"session_id": sid} if sid else {}))
            res = await _stream(client, body, 0)
            res["prompt_tokens"] = len(prompt)
            res["cached"] = ((res.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
            turns.append(res)
            if res["error"]:
                break
            history = prompt + res["ids"]  # the conversation goes on from what the model said
        return turns

    async def main():
        async with client_session(url, a.sessions) as client:
            return await asyncio.gather(*(conversation(client, c) for c in range(a.sessions)))

    convs = asyncio.run(main())
    per_turn = []
    for t in range(a.turns):
        rs = [c[t] for c in convs if len(c) > t]
        ok = [r for r in rs if not r["error"] and r["chunks"]]
        ttft = [r["chunks"][0][0] - r["sent"] for r in ok]
        cached = [r["cached"] for r in ok if r["cached"] is not None]
        per_turn.append({"turn": t + 1, "requests": len(rs), "errors": len(rs) - len(ok),
                         "ttft_s": {f"p{q}": pct(ttft, q) for q in (50, 90, 99)},
                         "prompt_tokens_mean": sum(r["prompt_tokens"] for r in ok) / max(len(ok), 1),
                         "cached_tokens_mean": sum(cached) / len(cached) if cached else None})
    flat = [r for c in convs for r in c]
    return {"per_turn": per_turn, "all": summarize(flat, a.slo_ttft, a.slo_tpot)}


def http_stack_versions() -> dict[str, str | None]:
    """The server's HTTP stack as installed here (uvicorn runs on uvloop and httptools where they
    are installed, else on asyncio's loop and h11): None for a package that is not."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("uvicorn", "uvloop", "httptools", "starlette", "pyzmq"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--shape", default=None, help="random-weight BENCH.md shape (bench.throughput.SHAPES)")
    ap.add_argument("--tokenizer", default=None, help="a directory whose tokenizer the --shape model uses")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default=None, help="engine weights: int8 (CPU), bnb-4bit (CUDA); "
                    "default: int8 on the CPU with float32 (as served), else none")
    ap.add_argument("--base-url", default=None, help="measure this server instead of starting s5serve")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads of each engine (OMP_NUM_THREADS of every server and replica, and the "
                         "engine baseline's); compare serve with cluster at the same count")
    ap.add_argument("--targets", nargs="+", default=["serve"],
                    help="what to start and measure: serve (s5serve serve), serve:K (with K front-end "
                         "processes, --api-servers K), cluster:R (s5serve cluster "
                         "with R replicas on Ray Serve), llama.cpp (its llama-server on the embedded model's "
                         "GGUF, built once: bench/llama_cpp.py); cluster rows report their overhead vs serve, "
                         "serve reports its figures over llama.cpp's")
    ap.add_argument("--served-model", default=None, help="the `model` field to send (peers that need one)")
    ap.add_argument("--mode", choices=["concurrency", "rate", "sessions"], default="concurrency")
    ap.add_argument("--n", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second (--mode rate)")
    ap.add_argument("--num-prompts", type=int, default=64, help="requests (--mode rate)")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=200)
    ap.add_argument("--session-ids", action=argparse.BooleanOptionalAction, default=True,
                    help="sessions mode: send s5serve session ids (off for peers)")
    ap.add_argument("--prompt-len", type=int, default=1238)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--max-batched-tokens", type=int, default=None,
                    help="the server's and the engine baseline's tokens per step (default: the server's)")
    ap.add_argument("--max-decode-stall-ms", type=float, default=None,
                    help="the server's and the engine baseline's decode stall bound (default: the server's)")
    ap.add_argument("--client-procs", type=int, default=1, help="client processes sharing the streams")
    ap.add_argument("--warm-connections", action=argparse.BooleanOptionalAction, default=True,
                    help="--mode concurrency: open each stream's keep-alive connection before the timed start (as "
                         "a client with a connection pool has them); --no-warm-connections: every request connects "
                         "when sent (rate mode always does: a server closes connections idle for seconds)")
    ap.add_argument("--slo-ttft", type=float, default=2.0)
    ap.add_argument("--slo-tpot", type=float, default=0.1)
    ap.add_argument("--engine-baseline", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the engine alone on the same workload (s5serve only)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="concurrency mode: per N and target, this many rounds of the engine alone then the "
                         "same workload served, back to back; the row is the median round by served/engine, "
                         "every round's figures are kept (for machines whose speed drifts during a run)")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    warm_connections = a.warm_connections and a.mode == "concurrency"  # rate mode connects per request
    if a.quantization is None and a.device == "cpu" and a.dtype == "float32" and not a.shape:
        a.quantization = "int8"  # what `s5serve serve` runs on the CPU
    if a.base_url:
        a.engine_baseline = False
    if a.rounds < 1 or (a.rounds > 1 and a.mode != "concurrency"):
        ap.error("--rounds: at least 1, and more only in concurrency mode")

    from bench.throughput import cpu_name, git_commit, prompts_for, source_digest

    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    load_before = os.getloadavg()

    work = Path(tempfile.mkdtemp(prefix="s5bench-"))
    spec = model_spec(a, work) if not a.base_url else None
    vocab, tokenizer = 32000, None
    if spec:
        from transformers import AutoConfig

        from engine import EngineConfig
        from engine.model.source import embedded_dir, load_tokenizer

        cfg = EngineConfig(model=spec, device=a.device, dtype=a.dtype)
        tokenizer = load_tokenizer(cfg)
        if spec.startswith("tiny-random"):
            from engine.model.loader import tiny_random_config

            vocab = tiny_random_config().vocab_size
        else:
            path = str(embedded_dir()) if spec == "embedded" else spec.removeprefix("random:")
            vocab = AutoConfig.from_pretrained(path).get_text_config().vocab_size
    rows = []
    targets = [None] if a.base_url else a.targets
    for t in targets:
        if t is not None and t not in ("serve", "llama.cpp") and not (t.startswith(("cluster:", "serve:"))
                                                                   and t.split(":", 1)[1].isdigit()):
            ap.error(f"--targets: {t!r} is neither serve, serve:K, cluster:R nor llama.cpp")
    peer = None  # llama.cpp's server: its binary, the GGUF, its threads
    if "llama.cpp" in targets:
        if a.model != "embedded" or a.shape or a.device != "cpu":
            ap.error("--targets llama.cpp: only with --model embedded on the CPU (its GGUF, a CPU build)")
        if a.mode == "sessions":
            ap.error("--targets llama.cpp: not in sessions mode (its stream carries no token ids for the "
                     "conversation to go on from)")
        import torch

        from bench import llama_cpp

        # the thread count s5serve's engine runs with: OMP_NUM_THREADS=--threads, else torch's default
        peer = {"binary": llama_cpp.build(), "gguf": llama_cpp.gguf_path(),
                "threads": a.threads or torch.get_num_threads()}
        peer["build"] = llama_cpp.build_info()
    head = (f"{'target':>9} {'mode':>11} {'N':>4} {'served dec tok/s':>16} {'engine dec tok/s':>16} {'served/engine':>13} "
            f"{'out tok/s':>9} {'TTFT p50 s':>10} {'eng p50 s':>10} {'ITL p50 ms':>10} {'ITL p99 ms':>10} "
            f"{'eng ITL p99':>11} "
            f"{'lag p99 ms':>10} {'lag max ms':>10} {'GC s':>5} {'errors':>6}")
    print(head, flush=True)

    def f(x, scale=1.0, fmt=".1f"):
        return format(x * scale, fmt) if x is not None else "-"

    ns = a.n if a.mode == "concurrency" else [a.sessions if a.mode == "sessions" else max(a.n)]
    for n in ns:
        prompts = prompts_for(tokenizer, vocab, n if a.mode == "concurrency" else a.num_prompts, a.prompt_len,
                              seed=n)
        baseline = EngineBaseline(spec, a, prompts, n) if a.engine_baseline and a.mode == "concurrency" else None
        first_row = len(rows)
        for target in targets:
            proc, url, extra, server = None, a.base_url, {}, None
            if not url:
                port = free_port()
                slots = n if a.mode != "rate" else max(a.n)
                log = work / f"server-{n}-{target.replace(':', '')}.log"
                if target == "llama.cpp":
                    ctx = llama_cpp.context_size(slots, a.prompt_len, a.new_tokens)
                    proc = llama_cpp.start(peer["binary"], peer["gguf"], port, slots, peer["threads"], ctx, log)
                    server = {"n_parallel": slots, "ctx": ctx, "threads": peer["threads"],
                              "llama_cpp_commit": peer["build"].get("llama_cpp_commit")}
                    extra = {"timings_per_token": True}  # its chunks carry no token ids: count by predicted_n
                else:
                    proc = start_server(spec, a, slots, port, log, target)
                url = f"http://127.0.0.1:{port}"
            eng_runs = baseline if target != "llama.cpp" else None  # the engine baseline is s5serve's
            try:
                warm = [completion(prompts[0][:16], a, a.served_model, max_tokens=4, **extra)]
                drive(url, warm, [0.0], 1)
                if a.mode == "sessions":
                    before = scrape(url)
                    res = run_sessions(url, a, vocab, a.served_model)
                    summ, eng, rounds = res["all"], None, []
                    after = scrape(url)
                else:
                    bodies = [completion(p, a, a.served_model, **extra) for p in prompts]
                    if a.mode == "rate":
                        rng = random.Random(0)
                        offsets, t = [], 0.0
                        for _ in bodies:
                            offsets.append(t)
                            t += rng.expovariate(a.rate)
                    else:
                        offsets = [0.0] * len(bodies)
                    # each round: the engine alone (the server idle beside it), then the same
                    # workload served; the row reports the median round, every round is kept
                    rounds, runs = [], []
                    for k in range(a.rounds):
                        eng = eng_runs.run() if eng_runs is not None else None
                        before = scrape(url)
                        cpu = ServerCPU(proc.pid if proc is not None and target != "llama.cpp" else None)
                        with LagWatch(url) as watch, Stolen() as stolen, cpu:
                            results = drive(url, bodies, offsets, a.client_procs, warm_connections)
                        after = scrape(url)
                        summ = summarize(results, a.slo_ttft, a.slo_tpot)
                        summ["cpu_ms_per_token"] = cpu.per_token_ms(summ["output_tokens"])
                        if a.client_procs > 1 and summ["cpu_ms_per_token"]:  # the clients ran in pool processes, not counted
                            summ["cpu_ms_per_token"].pop("client", None)
                        ratio = (summ["decode_tok_s"] / eng["decode_tok_s"]
                                 if eng and eng.get("decode_tok_s") and summ["decode_tok_s"] else None)
                        rounds.append({"served_decode_tok_s": summ["decode_tok_s"],
                                       "engine_decode_tok_s": eng["decode_tok_s"] if eng else None, "ratio": ratio,
                                       "served_itl_p50_s": summ["itl_s"]["p50"],
                                       "engine_itl_p50_s": eng["itl_p50_s"] if eng else None,
                                       "served_itl_p99_s": summ["itl_s"]["p99"],
                                       "engine_itl_p99_s": eng["itl_p99_s"] if eng else None,
                                       "served_ttft_p50_s": summ["ttft_s"]["p50"],
                                       "engine_ttft_p50_s": eng["ttft_p50_s"] if eng else None,
                                       "served_stolen_s": stolen.seconds, "engine_stolen_s": eng and eng["stolen_s"],
                                       "served_cpu_ms_per_token": summ["cpu_ms_per_token"]})
                        runs.append((summ, eng, before, after, watch.phases(results)))
                        if a.rounds > 1:
                            print(f"   round {k + 1}: served {f(summ['decode_tok_s'])} tok/s, engine "
                                  f"{f(eng and eng['decode_tok_s'])}, served/engine {f(ratio, fmt='.3f')}; TTFT p50 "
                                  f"{f(summ['ttft_s']['p50'], fmt='.3f')} s served, "
                                  f"{f(eng and eng['ttft_p50_s'], fmt='.3f')} s engine; ITL p99 "
                                  f"{f(summ['itl_s']['p99'], 1e3, '.2f')} ms served, "
                                  f"{f(eng and eng['itl_p99_s'], 1e3, '.2f')} ms engine; CPU time "
                                  f"stolen by the hypervisor {f(stolen.seconds, fmt='.2f')} s served, "
                                  f"{f(eng and eng['stolen_s'], fmt='.2f')} s engine", flush=True)
                    res = None
                    summ, eng, before, after, late_by_phase = runs[median_round(rounds)]
            finally:
                if proc is not None:
                    stop_server(proc)
            lag = loop_lag(before, after)
            if a.mode != "sessions" and late_by_phase is not None:
                lag["late_by_phase"] = late_by_phase
            server_ttft = mean_of(before, after, "s5_time_to_first_token_seconds")
            row = {"target": target, "mode": a.mode, "n": n, **summ, "event_loop_lag": lag, "engine": eng,
                   "served_over_engine_decode": (summ["decode_tok_s"] / eng["decode_tok_s"]
                                                 if eng and eng.get("decode_tok_s") and summ["decode_tok_s"] else None),
                   # p50 against p50 (files before the engine reported its p50 held its mean)
                   "served_over_engine_ttft": (summ["ttft_s"]["p50"] / eng["ttft_p50_s"]
                                               if eng and summ["ttft_s"]["p50"] is not None else None)}
            # the server's own TTFT (from the request's submission to the engine to its first token
            # in the front end): the rest of the client's is HTTP, tokenizing, the client and the SSE write
            row["server_ttft_mean_s"] = server_ttft
            if res is not None:
                row["per_turn"] = res["per_turn"]
            if len(rounds) > 1:
                row["rounds"] = rounds
                row["served_over_engine_decode_rounds"] = [r["ratio"] for r in rounds]
            if server is not None:
                row["server"] = server
            rows.append(row)
            print(f"{target or 'peer':>9} {a.mode:>11} {n:>4} {f(summ['decode_tok_s']):>16} {f(eng and eng['decode_tok_s']):>16} "
                  f"{f(row['served_over_engine_decode'], fmt='.3f'):>13} {f(summ['output_tok_s']):>9} "
                  f"{f(summ['ttft_s']['p50'], fmt='.3f'):>10} {f(eng and eng['ttft_p50_s'], fmt='.3f'):>10} "
                  f"{f(summ['itl_s']['p50'], 1e3, '.2f'):>10} {f(summ['itl_s']['p99'], 1e3, '.2f'):>10} "
                  f"{f(eng and eng['itl_p99_s'], 1e3, '.2f'):>11} "
                  f"{f(lag.get('p99_le_s'), 1e3, '.0f'):>10} {f(lag.get('max_le_s'), 1e3, '.0f'):>10} "
                  f"{f(lag.get('gc_seconds'), fmt='.2f'):>5} {summ['errors']:>6}", flush=True)
            if summ.get("cpu_ms_per_token"):
                print("   CPU per output token (ms): " + ", ".join(
                    f"{role.replace('_', ' ')} {ms:.3f}" for role, ms in summ["cpu_ms_per_token"].items()), flush=True)
            if server_ttft is not None and summ["ttft_s"]["mean"] is not None:
                print(f"   TTFT mean {summ['ttft_s']['mean']:.3f} s at the client, {server_ttft:.3f} s in the server "
                      f"(submission to first token)" + (f", engine alone {eng['ttft_s']:.3f} s" if eng else ""), flush=True)
            if lag.get("late_by_phase"):
                print("   event-loop wake-ups late > 10 ms (> 25 ms): " + ", ".join(
                    f"{ph.replace('_', ' ')} {c['over_10ms']} ({c['over_25ms']})"
                    for ph, c in lag["late_by_phase"].items()) + f" of {lag['samples']:.0f}", flush=True)
            if res is not None:
                for t in res["per_turn"]:
                    print(f"   turn {t['turn']}: TTFT p50 {f(t['ttft_s']['p50'], fmt='.3f')} s, prompt "
                          f"{t['prompt_tokens_mean']:.0f} tokens, cached {f(t['cached_tokens_mean'], fmt='.0f')}")
        if baseline is not None:
            baseline.close()
        # each other target of this N against `serve`: a cluster's overhead over it, serve over a peer
        base_row = next((r for r in rows[first_row:] if r["target"] == "serve"), None)
        for row in rows[first_row:] if base_row else []:
            if row["target"] == "llama.cpp":
                o = row["serve_over_peer"] = overhead(base_row, row)
                print(f"{'':>9} {'serve/llama':>11} {n:>4}  decode tok/s x{f(o['decode_tok_s'], fmt='.2f')}, out tok/s "
                      f"x{f(o['output_tok_s'], fmt='.2f')}, prefill tok/s x{f(o['prefill_tok_s'], fmt='.2f')}, TTFT "
                      f"mean x{f(o['ttft_mean'], fmt='.2f')}, TTFT p50 x{f(o['ttft_p50'], fmt='.2f')}", flush=True)
            elif row is not base_row:
                o = row["over_serve"] = overhead(row, base_row)
                print(f"{'':>9} {'vs serve':>11} {n:>4}  TTFT p50 x{f(o['ttft_p50'], fmt='.2f')}, ITL p50 "
                      f"x{f(o['itl_p50'], fmt='.2f')}, ITL p99 x{f(o['itl_p99'], fmt='.2f')}, out tok/s "
                      f"x{f(o['output_tok_s'], fmt='.2f')}, decode tok/s x{f(o['decode_tok_s'], fmt='.2f')}",
                      flush=True)
    comparison = peer_comparison(rows)
    if comparison:
        print("\ns5serve serve beside llama.cpp's llama-server (same GGUF, prompts and threads; "
              "x = s5serve / llama.cpp)")
        for line in peer_table(comparison):
            print(line)
    shutil.rmtree(work, ignore_errors=True)
    import torch

    device = torch.cuda.get_device_name() if a.device.startswith("cuda") else cpu_name()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = a.shape or (a.model if not a.base_url else "peer")
    stem = f"serve-{a.device.split(':')[0]}-{Path(name).name}-{date.today().isoformat()}{'-' + a.tag if a.tag else ''}"
    import transformers

    (out / f"{stem}.json").write_text(json.dumps({
        "bench": "serve", "device": device, "model": name, "dtype": a.dtype, "quantization": a.quantization,
        "base_url": a.base_url, "policy": "s5" if not a.base_url else None,
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                     "transformers": transformers.__version__, "commit": git_commit(),
                     "source_digest": source_digest(), **http_stack_versions()},
        "load_average": {"before": load_before, "after": os.getloadavg()}, "threads": a.threads,
        "workload": {"mode": a.mode, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "greedy": True,
                     "ignore_eos": True, "client_procs": a.client_procs,
                     "warm_connections": warm_connections, "targets": targets,
                     "max_batched_tokens": a.max_batched_tokens, "max_decode_stall_ms": a.max_decode_stall_ms},
        "peers": {"llama.cpp": {**peer["build"], "binary": str(peer["binary"]), "gguf": str(peer["gguf"]),
                                "threads": peer["threads"]}} if peer else {},
        "peer_comparison": comparison,
        "rows": rows}, indent=1))
    print(f"wrote {out / stem}.json")
    plain = [r for r in rows if r["target"] in (None, "serve")]
    if a.mode == "concurrency" and len(plain) > 1:
        plot(plain, out / f"{stem}.png", name)


PEER_FIGURES = {  # the figures set beside llama.cpp's: label, format
    "decode_tok_s": ("decode tok/s", ".1f"), "output_tok_s": ("out tok/s", ".1f"),
    "prefill_tok_s": ("prefill tok/s", ".0f"), "ttft_mean": ("TTFT mean s", ".3f"), "ttft_p50": ("TTFT p50 s", ".3f"),
}


def peer_comparison(rows: list[dict]) -> list[dict]:
    """Per N with both a `serve` and a `llama.cpp` row: each side's figures and the ratio
    s5serve / llama.cpp (above 1 for tok/s, below 1 for TTFT: s5serve ahead)."""
    def figures(r: dict) -> dict:
        return {"decode_tok_s": r["decode_tok_s"], "output_tok_s": r["output_tok_s"], "prefill_tok_s": r.get("prefill_tok_s"),
                "ttft_mean": r["ttft_s"]["mean"], "ttft_p50": r["ttft_s"]["p50"]}

    out = []
    for peer in (r for r in rows if r["target"] == "llama.cpp"):
        base = next((r for r in rows if r["target"] == "serve" and r["n"] == peer["n"]), None)
        if base is None:
            continue
        ratio = peer.get("serve_over_peer") or overhead(base, peer)
        out.append({"n": peer["n"], "s5serve": figures(base), "llama.cpp": figures(peer),
                    "s5serve_over_llama_cpp": {k: ratio[k] for k in PEER_FIGURES},
                    "llama_cpp_server_prefill_tok_s_mean": peer.get("server_prefill_tok_s_mean")})
    return out


def peer_table(comparison: list[dict]) -> list[str]:
    """`peer_comparison` as text: per figure s5serve's, llama.cpp's and the ratio."""
    def f(x, fmt):
        return format(x, fmt) if x is not None else "-"

    head = f"{'N':>4}" + "".join(f" | {label + ' s5 / llama.cpp / x':>34}" for label, _ in PEER_FIGURES.values())
    lines = [head]
    for c in comparison:
        cells = [f"{f(c['s5serve'][k], fmt):>10} {f(c['llama.cpp'][k], fmt):>10} "
                 f"{'x' + f(c['s5serve_over_llama_cpp'][k], '.2f'):>6}" for k, (_, fmt) in PEER_FIGURES.items()]
        lines.append(f"{c['n']:>4}" + "".join(f" | {cell:>34}" for cell in cells))
    return lines


def plot(rows: list[dict], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no plot")
        return
    ns = [r["n"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(ns, [r["decode_tok_s"] or 0 for r in rows], "o-", label="served (HTTP, SSE)")
    if any(r["engine"] for r in rows):
        ax1.plot(ns, [(r["engine"] or {}).get("decode_tok_s") or 0 for r in rows], "s--", label="engine alone")
    ax1.set_xlabel("concurrent streams")
    ax1.set_ylabel("decode tok/s (all streams decoding)")
    ax1.set_xscale("log", base=2)
    ax1.legend()
    for q in ("p50", "p99"):
        ax2.plot(ns, [(r["itl_s"][q] or 0) * 1e3 for r in rows], "o-", label=f"ITL {q}")
    ax2.set_xlabel("concurrent streams")
    ax2.set_ylabel("ms")
    ax2.set_xscale("log", base=2)
    ax2.legend()
    fig.suptitle(f"served throughput and inter-token latency: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
