import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers share the cores (make test): one thread each, in this process and in the servers
    # and engine processes it starts (they inherit the environment). Two threads each would make
    # every OpenMP barrier wait for a thread the other worker's engine holds the core from.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


# make test hands whole modules to two workers in collection order (--dist loadfile
# --no-loadscope-reorder). The directories whose modules run longest (servers, clusters,
# thousands of requests) come first, so the run does not end with one worker on a long module
# while the other has nothing left.
LONG_FIRST = ("reliability", "cluster", "e2e", "equivalence", "bench")


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        parts = item.nodeid.split("/")
        return LONG_FIRST.index(parts[1]) if len(parts) > 2 and parts[1] in LONG_FIRST else len(LONG_FIRST)

    items.sort(key=rank)  # stable: each directory keeps its own order


@pytest.fixture(scope="session")
def embedded_dir():
    from engine.model.source import embedded_dir as _embedded_dir

    return _embedded_dir(progress=False)


@pytest.fixture(scope="session")
def embedded(embedded_dir):
    """The embedded model (float32) with its tokenizer, loaded once for the whole run."""
    from engine import EngineConfig
    from engine.model.loader import load_model

    return load_model(EngineConfig(model="embedded"))


@pytest.fixture(scope="session")
def embedded_reference(embedded_dir):
    """A second copy of the embedded model on stock transformers attention (sdpa)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(embedded_dir), dtype=torch.float32, attn_implementation="sdpa")
    return m.eval()


@pytest.fixture(scope="session")
def tokenizer(embedded):
    return embedded.tokenizer


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server for the whole run (tests/postgres.py); each test takes a fresh
    database of it with `postgres.database()`."""
    from tests.postgres import postgres_server

    with postgres_server() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def session_store(request, tmp_path):
    """A `--session-db` target of each backend: an SQLite file, a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "sessions.sqlite3")
    return request.getfixturevalue("postgres").database()
