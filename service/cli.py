"""`s5serve serve | chat | bench`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time


def _serve(argv: list[str]) -> int:
    import uvicorn

    from engine.core.session_db import SessionFileBusy, SessionFileLock, is_postgres_url
    from service.app import create_app
    from service.settings import exposure_warning, parse_serve_args

    settings = parse_serve_args(argv)
    # Long prompts are tokenized on a worker thread; a shorter GIL switch interval (default 5 ms)
    # lets the event loop thread in sooner meanwhile.
    sys.setswitchinterval(0.001)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("s5serve")
    # One server per session file, checked before anything slow; the engine process's SessionDB
    # then holds the lock for as long as it runs.
    db = settings.engine.session_db
    try:
        if db and not is_postgres_url(db):
            if os.path.isdir(os.path.expanduser(db)):
                raise IsADirectoryError(f"{db} is a directory; --session-db takes a file")
            SessionFileLock(db).release()
    except SessionFileBusy as e:
        print(f"s5serve: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"s5serve: cannot use {db} as the session database: {e}", file=sys.stderr)
        return 2
    if (problem := device_problem(settings.engine.device)) is not None:
        print(f"s5serve: {problem}", file=sys.stderr)
        return 2
    if (problem := listen_problem(settings.host, settings.port)) is not None:
        print(f"s5serve: {problem}", file=sys.stderr)
        return 1
    if (warning := exposure_warning(settings)) is not None:
        log.warning(warning)
    if settings.engine.model == "embedded":
        from engine.model.source import embedded_dir

        print("preparing the embedded model (converted once, then cached)...", flush=True)
        embedded_dir(settings.engine.cache_dir, report=lambda line: print(line, flush=True))
    if settings.front_ends() > 1:
        from service import frontends

        return frontends.serve(settings)
    app = create_app(settings)
    server = DrainingServer(uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info",
                                           access_log=settings.access_log,
                                           timeout_keep_alive=int(settings.keep_alive_s),
                                           timeout_graceful_shutdown=int(settings.drain_grace_s) + 5),
                            app.state.s5)
    app.state.s5.on_fatal = lambda: setattr(server, "should_exit", True)  # the engine died: exit 1
    server.run()
    return 1 if app.state.s5.fatal or app.state.s5.load_error else 0


def listen_problem(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port (another process holds it, the address is not
    this machine's), found before the model loads; None if it can. The server binds as uvicorn
    does (SO_REUSEADDR), so a port left in TIME_WAIT by a server that just stopped is free."""
    import socket

    try:  # every address the host resolves to, each bound as asyncio binds it (IPv6 sockets v6-only)
        for family, kind, proto, _, addr in socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                               flags=socket.AI_PASSIVE):
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(addr)
    except OSError as e:
        return f"cannot listen on {host}:{port}: {e.strerror or e}"
    return None


def device_problem(device: str) -> str | None:
    """Why `device` cannot serve on this machine (a CUDA device torch cannot see), or None."""
    if not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        return (f"--device {device}: torch {torch.__version__} sees no CUDA device on this machine "
                f"(serve on the CPU with --device cpu, or install torch's CUDA build)")
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        return f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def _drain_server_class():
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """SIGTERM/SIGINT: readiness turns 503 and new work is refused at once; streams in flight
        get the grace period to finish; then uvicorn shuts down."""

        def __init__(self, config, state):
            super().__init__(config)
            self.state = state

        def handle_exit(self, sig, frame):
            if self.state.draining:  # a second signal: stop now
                return super().handle_exit(sig, frame)
            self.state.draining = True
            grace = self.state.settings.drain_grace_s

            def wait_then_exit():
                deadline = time.monotonic() + grace
                while time.monotonic() < deadline and self.state.active:
                    time.sleep(0.1)
                if self.state.active and self.state.engine is not None:
                    # past the grace period: end the rest with a final event, then stop
                    for rid in self.state.active.ids():
                        self.state.loop.call_soon_threadsafe(self.state.engine.abort, rid)
                    until = time.monotonic() + 5
                    while time.monotonic() < until and self.state.active:
                        time.sleep(0.05)
                super(DrainingServer, self).handle_exit(sig, frame)
                # drained on purpose: exit 0 instead of re-raising the signal after shutdown
                getattr(self, "_captured_signals", []).clear()

            threading.Thread(target=wait_then_exit, daemon=True).start()

    return DrainingServer


def DrainingServer(config, state):  # noqa: N802 - a factory that keeps uvicorn imports lazy
    return _drain_server_class()(config, state)


def _chat(argv: list[str]) -> int:
    """A terminal chat over one session (deleted on the way out): Ctrl-C cancels a reply, and at
    the prompt ends the chat (exit 130), as Ctrl-D does (exit 0); a server that cannot be reached
    or refuses the key is one line on stderr (exit 1)."""
    from service.client import Client, S5Error
    from service.settings import int_at_least

    p = argparse.ArgumentParser(prog="s5serve chat", description="Chat in the terminal over a session.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server")
    p.add_argument("--api-key", default=None, help="API key, if the server requires one")
    p.add_argument("--max-tokens", type=int_at_least(1), default=256, help="longest reply, in tokens")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (0: greedy)")
    a = p.parse_args(argv)
    try:
        with Client(a.url, a.api_key) as client, client.create_session() as session:
            print(f"session {session.id} (Ctrl-D to quit)")
            while True:
                try:
                    line = input("> ")
                except (EOFError, KeyboardInterrupt) as end:
                    print()
                    return 0 if isinstance(end, EOFError) else 130
                try:
                    for text in session.generate(messages=[{"role": "user", "content": line}],
                                                 max_tokens=a.max_tokens, temperature=a.temperature):
                        print(text, end="", flush=True)
                except S5Error as err:
                    print(f"\n[error] {err}")
                except KeyboardInterrupt:
                    print("\n[cancelled]")
                print()
    except S5Error as err:
        print(f"s5serve chat: {a.url}: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # while the session is made or deleted
        print()
        return 130


def _cluster(argv: list[str]) -> int:
    from service.cluster import main

    return main(argv)


COMMANDS = {
    "serve": (_serve, "serve a model over HTTP (OpenAI-compatible routes and sessions, SSE)"),
    "cluster": (_cluster, "serve from N replicas on Ray Serve, sessions routed to their replica"),
    "chat": (_chat, "chat in the terminal over a session of a running server"),
}


def _usage() -> str:
    lines = ["usage: s5serve COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<9}{about}" for name, (_, about) in COMMANDS.items()]
    lines += ["", "s5serve COMMAND --help shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv and argv[0] == "--version":
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"s5serve {version('s5serve')}")
        except PackageNotFoundError:
            print("s5serve (not installed)")
        return 0
    if not argv or argv[0] not in COMMANDS:
        if argv:
            print(f"s5serve: unknown command {argv[0]!r}", file=sys.stderr)
        print(_usage(), file=sys.stderr)
        return 2
    return COMMANDS[argv[0]][0](argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
