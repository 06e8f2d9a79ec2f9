import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

from engine import EngineConfig
from engine.model_loader import LoadedModel
from service.app import create_app
from service.settings import Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """A real uvicorn server on 127.0.0.1 in a thread, with a handle on its engine."""

    def __init__(self, settings: Settings, loaded: LoadedModel):
        self.app = create_app(settings, loaded)
        self.state = self.app.state.s5
        self.url = f"http://127.0.0.1:{settings.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=settings.port,
                                                    log_level="warning",
                                                    timeout_keep_alive=int(settings.keep_alive_s)))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self):
        self.thread.start()
        for _ in range(600):
            try:
                if httpx.get(f"{self.url}/ready").status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server not ready")

    def engine_call(self, fn, *args):
        """Run fn(engine, *args) on the engine thread (between steps)."""
        w = self.state.worker
        return asyncio.run_coroutine_threadsafe(w.call(fn, w.engine, *args), w._loop).result(30)

    def wait_idle(self, timeout=30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.engine_call(lambda e: not e.has_work()) and not self.state.active:
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


@contextmanager
def server_process(log_path, *args: str):
    """A real `s5serve serve` process on a free port; yields (process, url) once it is ready."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # sessions go to a file beside the log unless the test names one (`--session-db`)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "S5_SESSION_DB": str(Path(log_path).parent / "sessions.sqlite3")}
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port), *args],
                            env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("server never became ready: " + open(log_path).read())
        if proc.poll() is not None:
            raise AssertionError("server exited: " + open(log_path).read())
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()


def metric(url: str, name: str, labels: str = "", headers: dict | None = None) -> float:
    """One sample of /metrics, 0.0 when absent."""
    want = name + ("{" + labels + "}" if labels else "")
    r = httpx.get(f"{url}/metrics", headers=headers)
    assert r.status_code == 200, r.text
    for line in r.text.splitlines():
        if not line.startswith("#") and line.rsplit(" ", 1)[0] == want:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="session")
def server(embedded):
    settings = Settings(engine=EngineConfig(model="embedded", max_rows=16, kv_cache_bytes=128 << 20), port=free_port())
    srv = LiveServer(settings, LoadedModel(embedded.model, embedded.tokenizer, "gemma-3-270m")).start()
    yield srv
    srv.stop()
