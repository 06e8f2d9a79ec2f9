"""Real servers for tests: `LiveServer` (uvicorn in a thread of the test process, its engine in a
process of its own) and `server_process` (a whole `s5serve serve` process), with small helpers."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

from service.app import create_app
from service.settings import Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """A real uvicorn server on 127.0.0.1 in a thread (its engine in a process of its own)."""

    def __init__(self, settings: Settings):
        self.app = create_app(settings)
        self.state = self.app.state.s5
        self.url = f"http://127.0.0.1:{settings.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=settings.port,
                                                    log_level="warning",
                                                    timeout_keep_alive=int(settings.keep_alive_s)))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self):
        self.thread.start()
        for _ in range(1200):
            try:
                if httpx.get(f"{self.url}/ready").status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.state.load_error:
                raise RuntimeError(f"server failed to start: {self.state.load_error}")
            time.sleep(0.1)
        raise RuntimeError("server not ready")

    def run(self, coro):
        """Await `coro` on the server's event loop (where the engine client lives)."""
        return asyncio.run_coroutine_threadsafe(coro, self.state.loop).result(30)

    def engine(self, method: str, *args):
        """An engine verb (engine/ipc.CALLS) through the server's EngineClient."""
        return self.run(self.state.engine.call(method, *args))

    def stats(self):
        """A fresh snapshot of the engine (ipc.EngineStats)."""
        return self.run(self.state.engine.fresh_stats())

    def check_invariants(self):
        self.run(self.state.engine.check_invariants())

    def wait_idle(self, timeout=30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.stats()
            if st.num_waiting == 0 and st.num_running == 0 and not self.state.active:
                return
            time.sleep(0.05)
        raise AssertionError("engine did not go idle")

    def metric(self, name: str, labels: str = "") -> float:
        for line in httpx.get(f"{self.url}/metrics", headers=self.headers).text.splitlines():
            if line.startswith(name + (labels and "{" + labels + "}")) and not line.startswith("#"):
                key = line.rsplit(" ", 1)[0]
                if key == name + (("{" + labels + "}") if labels else ""):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    headers: dict = {}

    def stop(self):
        self.server.should_exit = True
        self.thread.join(15)


# How long a started server may take to report ready: loading the embedded model while the other
# test worker keeps a core busy. Not its conversion: tests of the embedded model take the
# `embedded_dir` fixture, which converts it once before any server starts.
READY_S = 120


@contextmanager
def server_process(log_path, *args: str, new_group: bool = False):
    """A real `s5serve serve` process on a free port; yields (process, url) once it is ready.
    `new_group`: in a process group of its own (as a shell starts it), for signals to the group."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # sessions go to a file beside the log unless the test names one (`--session-db`)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "S5_SESSION_DB": str(Path(log_path).parent / "sessions.sqlite3")}
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port), *args],
                            env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            process_group=0 if new_group else None)
    deadline = time.monotonic() + READY_S
    try:
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"server not ready in {READY_S} s: " + open(log_path).read())
        if proc.poll() is not None:
            raise AssertionError("server exited: " + open(log_path).read())
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        if new_group:  # whatever of the group is left
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@contextmanager
def live_server(**engine):
    """A LiveServer on `EngineConfig(**engine)`, running while the block runs."""
    from engine import EngineConfig

    srv = LiveServer(Settings(engine=EngineConfig(**engine), port=free_port())).start()
    try:
        yield srv
    finally:
        srv.stop()


def alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie is gone, only not yet reaped)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:  # reaping may remove it after the signal check
            return f.read().split(") ")[-1][0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def engine_alone(config, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """The greedy tokens of each prompt from an Engine in this process, one request at a time:
    what a server on the same config must stream."""
    from engine import Engine, Request, SamplingParams

    engine = Engine(config)
    alone = []
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=n, ignore_eos=True)))
        out = []
        while engine.has_work():
            for o in engine.step():
                out += o.new_token_ids
        alone.append(out)
    return alone


async def stream_ids(client, prompt: list[int], max_tokens: int) -> list[int]:
    """A streamed greedy /v1/completions through `client` (an httpx.AsyncClient): its token ids."""
    import json

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    ids = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    ids += ch["token_ids"]
    return ids


def metric(url: str, name: str, labels: str = "", headers: dict | None = None) -> float:
    """One sample of /metrics, 0.0 when absent."""
    want = name + ("{" + labels + "}" if labels else "")
    r = httpx.get(f"{url}/metrics", headers=headers)
    assert r.status_code == 200, r.text
    for line in r.text.splitlines():
        if not line.startswith("#") and line.rsplit(" ", 1)[0] == want:
            return float(line.rsplit(" ", 1)[1])
    return 0.0
