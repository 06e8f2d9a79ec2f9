"""`s5serve cluster`'s flags and `serve run service.cluster:build`'s arguments (nothing started),
and how the gateway finds a request's session."""

import subprocess
import sys
from pathlib import Path

import pytest
from ray.serve import Application
from starlette.datastructures import Headers

from service.cluster import build, parse_cluster_args, runtime_env, send_interval, session_key


def test_flags_are_serve_s_plus_the_cluster_s():
    c = parse_cluster_args(["--model", "tiny-random", "--replicas", "3", "--session-db", "postgresql://u@h/db",
                            "--port", "9000", "--replica-cpus", "0.5"])
    assert (c.replicas, c.replica_cpus, c.replica_gpus, c.serve.port) == (3, 0.5, 0.0, 9000)
    assert c.serve.engine.session_db == "postgresql://u@h/db" and c.serve.engine.model == "tiny-random"
    gpu = parse_cluster_args(["--device", "cuda", "--session-db", "none"])
    assert gpu.replica_gpus == 1.0 and gpu.serve.engine.session_db is None
    assert parse_cluster_args(["--device", "cuda", "--replica-gpus", "0.5", "--session-db", "none"]).replica_gpus == 0.5
    assert (c.stream_interval_s, c.stream_messages_per_s) == (0.02, 3000.0)
    assert parse_cluster_args(["--stream-interval-ms", "0", "--session-db", "none"]).stream_interval_s == 0.0
    assert parse_cluster_args(["--stream-messages-per-s", "0", "--session-db", "none"]).stream_messages_per_s == 0
    for bad in (["--stream-interval-ms", "-1"], ["--stream-messages-per-s", "-5"]):
        with pytest.raises(SystemExit):
            parse_cluster_args(bad)


def test_a_streams_send_interval_follows_the_replicas_stream_count():
    """One stream sends each token as it comes; many keep the replica's messages within its rate;
    the interval never exceeds --stream-interval-ms; a rate of 0 is the fixed interval."""
    for streams, want in [(1, 1 / 3000), (30, 0.01), (64, 0.02), (500, 0.02)]:
        assert send_interval(streams, 0.02, 3000.0) == pytest.approx(want)
    assert send_interval(1, 0.02, 0.0) == 0.02


def test_workers_import_path_keeps_the_drivers(monkeypatch, tmp_path):
    """Ray's workers get the project's root first and then the driver's PYTHONPATH, where Ray and
    the other packages may be installed (the env var replaces what the workers would inherit)."""
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'site'}:{tmp_path / 'more'}")
    path = runtime_env()["env_vars"]["PYTHONPATH"].split(":")
    assert Path(path[0], "service", "cluster.py").is_file()
    assert path[1:] == [str(tmp_path / "site"), str(tmp_path / "more")]
    monkeypatch.delenv("PYTHONPATH")
    assert len(runtime_env()["env_vars"]["PYTHONPATH"].split(":")) == 1


def test_replicas_do_not_share_an_sqlite_file():
    out = subprocess.run([sys.executable, "-m", "service.cli", "cluster", "--replicas", "2", "--session-db",
                          "/tmp/sessions.sqlite3"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "postgresql://" in out.stderr
    out = subprocess.run([sys.executable, "-m", "service.cli", "cluster", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "--replicas" in out.stdout and "--session-db" in out.stdout


def test_serve_run_builder_takes_the_flags_as_arguments():
    app = build({"replicas": "2", "session-db": "postgresql://u@h/db", "model": "tiny-random"})
    assert isinstance(app, Application)
    with pytest.raises(SystemExit):
        build({"replicas": "0", "session-db": "none"})


@pytest.mark.parametrize(("path", "headers", "body", "key"), [
    ("/v1/sessions/abc/generate", {}, b"{}", "abc"),
    ("/v1/sessions/abc", {"x-session-id": "other"}, b"", "abc"),
    ("/v1/sessions", {}, b"", ""),
    ("/v1/completions", {}, b'{"prompt": "x", "session_id": "s1"}', "s1"),
    ("/v1/chat/completions", {"x-session-id": "h1"}, b'{"messages": []}', "h1"),
    ("/v1/completions", {"x-session-id": "h1"}, b'{"session_id": "s1"}', "s1"),  # the body wins, as in the routes
    ("/v1/completions", {}, b'{"session_id": 5}', ""),
    ("/v1/completions", {}, b'{not json "session_id"', ""),
    ("/v1/models", {"x-session-id": "h1"}, b"", ""),
    ("/health", {}, b"", ""),
])
def test_the_session_a_request_belongs_to(path, headers, body, key):
    assert session_key(path, Headers(headers), body) == key


def test_replicas_that_cannot_all_be_placed_are_refused_up_front(monkeypatch):
    """Ray Serve would wait forever for a replica no machine can hold: the CPUs and GPUs the
    replicas reserve are checked against the Ray cluster's before they are asked for."""
    import ray

    from service.cluster import resource_problem

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    problem = resource_problem(parse_cluster_args(["--replicas", "3", "--session-db", "none"]))
    assert "3 replicas" in problem and "2" in problem and "--replica-cpus" in problem
    assert resource_problem(parse_cluster_args(["--replicas", "2", "--session-db", "none"])) is None
    assert resource_problem(parse_cluster_args(["--replicas", "3", "--replica-cpus", "0", "--session-db", "none"])) is None
    gpus = resource_problem(parse_cluster_args(["--replicas", "2", "--device", "cuda", "--replica-cpus", "0",
                                                "--session-db", "none"]))
    assert "GPUs" in gpus and "--replica-gpus" in gpus
