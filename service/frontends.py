"""Several HTTP front ends, one engine: `s5serve serve --api-servers N` with N > 1 (on CUDA the
default is one per 4 cores, at most 4: `Settings.front_ends`).

    s5serve serve            the supervisor: starts the rest, serves nothing itself
      |- engine process      python -m engine.process     the model, the KV pool, the device
      |- front end 0         python -m service.frontends  HTTP on the port, attached to the engine
      |  ...
      '- front end N-1

One front end is one event loop: past some tens of thousands of tokens a second it, not the
engine, sets the pace (tokenizing, detokenizing and framing SSE for every stream). Several share
the load. Each binds the same port with SO_REUSEPORT, so the kernel spreads new connections over
them; a request's outputs go back to the front end that took it (ipc.Submit.client). Sessions,
stored responses and admission limits live in the engine, so any front end serves any call, and
/metrics on any of them adds all their measurements up (service/metrics.SharedMetrics).

Lifecycle: on SIGTERM or SIGINT every front end drains its own streams and exits, then the engine
is shut down: exit 0. If the engine dies, each front end sees it at once (engine/client.py),
ends its streams with an error event and exits 1; a front end that dies takes the others down.
Either way the supervisor exits 1. Children die with the supervisor, however it ends.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import msgspec

from engine import ipc
from engine.client import Attach, EngineProcess
from service.app import FrontEnd
from service.settings import Settings

log = logging.getLogger("s5serve")

POLL_S = 0.1


class FrontEndSpec(msgspec.Struct, frozen=True):
    """What one front-end process is given on stdin."""

    settings: Settings
    front_end: FrontEnd
    parent_pid: int
    log_level: int


def listening_socket(host: str, port: int) -> socket.socket:
    """This front end's socket on the shared port (SO_REUSEPORT: one of the group)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(False)
    return sock


class Supervisor:
    """Starts the engine and the front ends, forwards a stop to the front ends, and ends the
    engine once they are gone."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.stop_requested = 0  # SIGTERM/SIGINT received
        self.failed: str | None = None

    def run(self) -> int:
        s = self.settings
        n = s.front_ends()
        level = logging.getLogger().getEffectiveLevel() or logging.INFO
        ends = ipc.endpoints(n)
        metrics_dir = tempfile.mkdtemp(prefix="s5serve-metrics-")
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        engine = EngineProcess(s.engine, ends, level)
        log.info("engine process %d, %d front ends on %s:%d", engine.pid, n, s.host, s.port)
        children = []
        for i in range(n):
            spec = FrontEndSpec(s, FrontEnd(Attach(ends, i, engine.pid), metrics_dir), os.getpid(), level)
            # a session of their own: a terminal's Ctrl-C reaches the supervisor only, which
            # forwards one SIGTERM (two would mean "stop now" to a front end)
            child = subprocess.Popen([sys.executable, "-m", "service.frontends"], stdin=subprocess.PIPE,
                                     start_new_session=True)
            child.stdin.write(msgspec.json.encode(spec))
            child.stdin.close()
            children.append(child)
        forwarded = 0
        try:
            while any(c.poll() is None for c in children):
                if self.stop_requested > forwarded:
                    forwarded = self.stop_requested
                    self._signal_all(children)
                for i, c in enumerate(children):
                    if c.returncode not in (None, 0) and self.failed is None:
                        self.failed = f"front end {i} exited with code {c.returncode}"
                        log.error("%s; stopping the others", self.failed)
                        self._signal_all(children)
                if engine.proc.poll() is not None and self.failed is None:
                    # the front ends see it too: each ends its streams and exits
                    self.failed = f"engine process exited (code {engine.proc.returncode})"
                time.sleep(POLL_S)
        finally:
            for c in children:  # the wait above ended, or was interrupted: none may outlive us
                if c.poll() is None:
                    c.kill()
                c.wait()
            code = engine.shutdown()
            shutil.rmtree(metrics_dir, ignore_errors=True)
        if self.failed is None and any(c.returncode != 0 for c in children):
            self.failed = "a front end failed"
        if self.failed is None and code != 0:
            self.failed = f"engine process exited with code {code}"
        return 1 if self.failed else 0

    def _on_signal(self, sig, frame) -> None:
        self.stop_requested += 1

    @staticmethod
    def _signal_all(children) -> None:
        for c in children:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)


def serve(settings: Settings) -> int:
    """`s5serve serve` with `settings.front_ends()` > 1 (the port checked free by cli.listen_problem);
    the exit code."""
    return Supervisor(settings).run()


def main() -> int:
    """One front-end process (the supervisor starts it with a FrontEndSpec on stdin)."""
    import uvicorn

    from engine.process import die_with_parent
    from service.app import create_app
    from service.cli import DrainingServer

    spec = msgspec.json.decode(sys.stdin.buffer.read(), type=FrontEndSpec)
    die_with_parent(spec.parent_pid)
    index = spec.front_end.attach.index
    sys.setswitchinterval(0.001)  # as `s5serve serve` (cli.py)
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s %(levelname)s %(name)s[front end {index}]: %(message)s")
    s = spec.settings
    sock = listening_socket(s.host, s.port)
    app = create_app(s, spec.front_end)
    # log_config None: uvicorn's lines (access log included) go through the format above, which
    # names the front end
    server = DrainingServer(uvicorn.Config(app, log_config=None, log_level="info", access_log=s.access_log,
                                           timeout_keep_alive=int(s.keep_alive_s),
                                           timeout_graceful_shutdown=int(s.drain_grace_s) + 5),
                            app.state.s5)
    app.state.s5.on_fatal = lambda: setattr(server, "should_exit", True)
    server.run(sockets=[sock])
    return 1 if app.state.s5.fatal or app.state.s5.load_error else 0


if __name__ == "__main__":
    raise SystemExit(main())
