"""A real PostgreSQL server for tests: started from the local binaries (initdb, pg_ctl on PATH, or
the PostgreSQL that the `pgserver` package bundles), in a fresh data directory, on a free
loopback port, with trust authentication; stopped and removed afterwards.

PostgreSQL refuses to run as root: under root the server runs as the unprivileged `nobody`."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path

from tests.servers import free_port


def postgres_bin() -> Path | None:
    """The folder holding initdb, pg_ctl and postgres, or None where there is none."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(os.path.realpath(found)).parent
    spec = importlib.util.find_spec("pgserver")  # its binaries only; the package is not imported
    if spec is None or spec.origin is None:
        return None
    bundled = Path(spec.origin).parent / "pginstall" / "bin"
    return bundled if (bundled / "initdb").exists() else None


def _as_server_user() -> dict:
    """subprocess arguments that run a command as the server's user (nobody, under root)."""
    return {"user": "nobody", "group": "nogroup"} if os.geteuid() == 0 else {}


class PostgresServer:
    def __init__(self, bindir: Path):
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="s5-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        if os.geteuid() == 0:
            os.chmod(self.root, 0o755)
            shutil.chown(self.root, "nobody", "nogroup")

    def _run(self, *args: str) -> None:
        subprocess.run([str(self.bindir / args[0]), *args[1:]], check=True, capture_output=True, text=True,
                       **_as_server_user())

    def start(self) -> PostgresServer:
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        opts = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off -c max_connections=100"
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.root / "log"), "-w", "-t", "60", "start")
        return self

    def database(self) -> str:
        """A URL to a new, empty database of this server."""
        import psycopg

        name = "s5_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url.rsplit("/", 1)[0] + "/" + name

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)


@contextmanager
def postgres_server():
    """A running server, or a pytest skip saying why none can be had."""
    import pytest

    bindir = postgres_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL binaries: neither initdb/pg_ctl on PATH nor the pgserver package")
    server = PostgresServer(bindir).start()
    try:
        yield server
    finally:
        server.stop()
