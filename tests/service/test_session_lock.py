"""One server per session file: a SessionDB holds an exclusive lock on its file, and a second
`s5serve serve` on the same file exits at once with a message naming the file and `--session-db`."""

import os
import subprocess
import sys
import textwrap

import httpx
import pytest

from engine.core import session_db
from engine.core.session_db import SessionDB, SessionFileBusy, SessionFileLock
from tests.servers import free_port, server_process

# another process opening the file (session_db.py alone: importing the engine package takes seconds)
HOLD = textwrap.dedent(f"""
    import importlib.util, sys
    spec = importlib.util.spec_from_file_location("session_db", {session_db.__file__!r})
    mod = sys.modules["session_db"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    db = mod.SessionDB(sys.argv[1], "fp")
    print("held", flush=True)
    sys.stdin.read()  # until the test closes our stdin
""")


@pytest.fixture
def other_process_holds(tmp_path):
    path = tmp_path / "sessions.sqlite3"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield path, proc
    proc.stdin.close()
    proc.wait(10)


def test_a_second_process_cannot_open_the_file(other_process_holds):
    path, proc = other_process_holds
    with pytest.raises(SessionFileBusy) as e:
        SessionDB(path, "fp")
    message = str(e.value)
    assert str(path) in message and "--session-db" in message and f"pid {proc.pid}" in message
    proc.stdin.close()
    proc.wait(10)  # the holder ended: the kernel dropped its lock, nothing stale remains
    SessionDB(path, "fp").close()


def test_the_lock_is_held_while_open_and_released_on_close(tmp_path):
    path = tmp_path / "s.sqlite3"
    first = SessionDB(path, "fp")
    with pytest.raises(SessionFileBusy):  # one owner, also within a process
        SessionDB(path, "fp")
    probe = subprocess.run([sys.executable, "-c", HOLD, str(path)], input="", capture_output=True, text=True)
    assert probe.returncode != 0 and "SessionFileBusy" in probe.stderr
    first.close()
    probe = subprocess.run([sys.executable, "-c", HOLD, str(path)], input="", capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr
    with SessionFileLock(path):
        pass


def test_a_second_server_on_the_same_file_exits_at_once(tmp_path):
    db = str(tmp_path / "shared.sqlite3")
    with server_process(tmp_path / "first.log", "--model", "tiny-random", "--session-db", db) as (_, url):
        second = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--model", "tiny-random",
                                 "--session-db", db, "--port", str(free_port())],
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 1
        assert db in second.stderr and "--session-db" in second.stderr, second.stderr
        assert "Uvicorn running" not in second.stderr + second.stdout
        assert httpx.get(f"{url}/ready").status_code == 200  # the first server is untouched


# the engine process with its Engine replaced by one that checks the session file while it would
# load the model, and then fails (the process reports the failure and exits 1)
LOADING = textwrap.dedent("""
    import logging, os, sys
    import zmq
    from engine import ipc, process
    from engine.core import engine as core_engine
    from engine.core.config import EngineConfig
    from engine.core.session_db import SessionFileBusy, SessionFileLock

    def loading(self, config, loaded=None, session_lock=None):
        try:
            SessionFileLock(config.session_db).release()
            print("free while loading", flush=True)
        except SessionFileBusy:
            print("held while loading", flush=True)
        raise RuntimeError("stop here")

    core_engine.Engine.__init__ = loading
    ends = ipc.endpoints(1)
    pull = zmq.Context().socket(zmq.PULL)
    pull.bind(ends.outs[0])
    try:
        process.run_engine(EngineConfig(model="tiny-random", session_db=sys.argv[1]), ends, os.getppid(),
                           logging.WARNING)
    except SystemExit as e:
        print("exit", e.code, type(ipc.decoder(ipc.Failed).decode(pull.recv())).__name__, flush=True)
""")


def test_the_engine_process_holds_the_file_while_the_model_loads(tmp_path):
    """The engine process takes the session file's lock before it loads the model (and passes
    it to the store), so a second server on the file stops at once, not after its own load."""
    run = subprocess.run([sys.executable, "-c", LOADING, str(tmp_path / "s.sqlite3")], capture_output=True,
                         text=True, timeout=120)
    assert run.stdout.split("\n")[:2] == ["held while loading", "exit 1 Failed"], run.stdout + run.stderr


def test_a_store_that_cannot_be_written_or_read_is_refused_at_start_naming_the_file(tmp_path):
    """A session file that opens but cannot be written (a read-only file or mount) would have the
    server report ready and refuse every new session; a file that is not a database would fail
    with a message that does not say which. Both are refused when the store opens, naming it."""
    from engine.core.session_db import SessionStoreError

    path = tmp_path / "sessions.sqlite3"
    SessionDB(path, "fp").close()
    if os.geteuid() == 0:  # root writes through file modes: make the file immutable instead
        if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
            pytest.skip("running as root where chattr cannot make a file immutable")
    else:
        path.chmod(0o444)
    try:
        with pytest.raises(SessionStoreError) as e:
            SessionDB(path, "fp")
        assert str(path) in str(e.value) and "--session-db" in str(e.value)
    finally:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)
        path.chmod(0o644)
    SessionDB(path, "fp").close()  # the lock was released: the file opens once writable again
    bad = tmp_path / "garbage.sqlite3"
    bad.write_bytes(b"not a database " * 100)
    with pytest.raises(SessionStoreError) as e:
        SessionDB(bad, "fp")
    assert str(bad) in str(e.value) and "not a database" in str(e.value)
