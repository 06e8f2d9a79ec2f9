"""Server flags and S5_* variables: one name scheme, defaults written once (the dataclasses), help
that says everything, the weight precision the server picks by default, and `s5serve --help`."""

import argparse
import os
from dataclasses import fields

import pytest

from engine.core.config import EngineConfig
from service.cli import main
from service.settings import (SERVE_OPTIONS, Settings, default_session_db, exposure_warning,
                              parse_serve_args, serve_parser)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No S5_* variable of the machine running the tests leaks into these."""
    import os

    for name in list(os.environ):
        if name.startswith("S5_"):
            monkeypatch.delenv(name)


def _flag_actions():
    return [a for a in serve_parser()._actions if not isinstance(a, argparse._HelpAction)]


def test_every_flag_has_help_with_its_default_and_its_variable():
    for action in _flag_actions():
        flag = action.option_strings[0]
        env = "S5_" + flag[2:].upper().replace("-", "_")
        assert action.help and len(action.help) > 20, flag
        assert "default: " in action.help, flag
        assert f"env {env}" in action.help, flag


def test_variables_are_derived_from_flags_and_every_flag_is_an_option():
    assert {a.option_strings[0] for a in _flag_actions()} == {o.flag for o in SERVE_OPTIONS}
    for opt in SERVE_OPTIONS:
        assert opt.env == "S5_" + opt.flag[2:].upper().replace("-", "_")
    assert len({o.env for o in SERVE_OPTIONS}) == len(SERVE_OPTIONS)
    names = {o.env for o in SERVE_OPTIONS}
    assert {"S5_MAX_NUM_BATCHED_TOKENS", "S5_API_KEYS", "S5_CACHE_DIR", "S5_SESSION_DB"} <= names


def test_defaults_are_the_dataclass_defaults():
    """Only --quantization (auto) and --session-db (a file) have server defaults of their own."""
    s = parse_serve_args([])
    for f in fields(Settings):
        if f.name != "engine":
            assert getattr(s, f.name) == getattr(Settings(), f.name), f.name
    for f in fields(EngineConfig):
        if f.name not in ("quantization", "session_db"):
            assert getattr(s.engine, f.name) == getattr(EngineConfig(), f.name), f.name
    assert s.engine.session_db == default_session_db()
    assert s.host == "127.0.0.1"


def test_every_option_sets_the_field_it_names():
    targets = {o.target for o in SERVE_OPTIONS if o.target}
    engine_fields = {f.name for f in fields(EngineConfig)}
    settings_fields = {f.name for f in fields(Settings)}
    for t in targets:
        assert (t[len("engine."):] in engine_fields) if t.startswith("engine.") else (t in settings_fields), t


def test_environment_and_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("S5_MAX_NUM_BATCHED_TOKENS", "128")
    monkeypatch.setenv("S5_KV_CACHE_BYTES", "64M")
    monkeypatch.setenv("S5_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("S5_API_KEYS", "k1, k2")
    monkeypatch.setenv("S5_SESSION_DB", "none")
    s = parse_serve_args([])
    assert s.engine.max_num_batched_tokens == 128 and s.engine.kv_cache_bytes == 64 << 20
    assert s.engine.cache_dir == str(tmp_path) and s.api_keys == ("k1", "k2") and s.engine.session_db is None
    # a flag wins over its variable; --api-key is --api-keys, repeatable and comma-separated
    s = parse_serve_args(["--max-num-batched-tokens", "256", "--api-key", "a", "--api-keys", "b,c",
                          "--cache-dir", "/x", "--swap-bytes", "0"])
    assert s.engine.max_num_batched_tokens == 256 and s.api_keys == ("a", "b", "c")
    assert s.engine.cache_dir == "/x" and s.engine.swap_bytes == 0


def test_older_variable_name_still_read(monkeypatch):
    monkeypatch.setenv("S5_MAX_BATCHED_TOKENS", "64")
    assert parse_serve_args([]).engine.max_num_batched_tokens == 64
    monkeypatch.setenv("S5_MAX_NUM_BATCHED_TOKENS", "32")  # the current name wins
    assert parse_serve_args([]).engine.max_num_batched_tokens == 32


def test_a_bad_variable_is_an_error_naming_it(monkeypatch, capsys):
    monkeypatch.setenv("S5_KV_POLICY", "bogus")
    with pytest.raises(SystemExit) as e:
        parse_serve_args([])
    assert e.value.code == 2 and "S5_KV_POLICY='bogus'" in capsys.readouterr().err
    monkeypatch.setenv("S5_KV_POLICY", "s5")
    monkeypatch.setenv("S5_ROWS", "many")
    with pytest.raises(SystemExit):
        parse_serve_args([])
    assert "S5_ROWS" in capsys.readouterr().err


def test_help_shows_a_variable_in_effect_but_never_a_key(monkeypatch):
    monkeypatch.setenv("S5_ROWS", "32")
    monkeypatch.setenv("S5_API_KEYS", "secret-key")
    text = " ".join(serve_parser().format_help().split())  # whatever the terminal's width
    assert "S5_ROWS, now 32" in text and "secret-key" not in text


def test_default_weights_are_int8_on_cpu_float32():
    assert parse_serve_args([]).engine.quantization == "int8"


def test_explicit_and_non_cpu_choices():
    assert parse_serve_args(["--quantization", "none"]).engine.quantization is None
    assert parse_serve_args(["--dtype", "bfloat16"]).engine.quantization is None
    assert parse_serve_args(["--device", "cuda"]).engine.quantization is None
    assert parse_serve_args(["--device", "cuda", "--quantization", "bnb-4bit"]).engine.quantization == "bnb-4bit"


def test_pdl_flag_and_environment(monkeypatch):
    assert parse_serve_args([]).engine.pdl is True
    assert parse_serve_args(["--pdl", "off"]).engine.pdl is False
    monkeypatch.setenv("S5_PDL", "off")
    assert parse_serve_args([]).engine.pdl is False
    assert parse_serve_args(["--pdl", "on"]).engine.pdl is True


def test_a_bad_variable_is_refused_only_where_its_flag_is_not_given(monkeypatch, capsys):
    monkeypatch.setenv("S5_WINDOW", "abc")
    monkeypatch.setenv("S5_PORT", "99999")
    settings = parse_serve_args(["--window", "64", "--port", "8012"])  # the flags win
    assert settings.engine.kv_window == 64 and settings.port == 8012
    with pytest.raises(SystemExit) as e:
        parse_serve_args(["--window", "64"])
    assert e.value.code == 2 and "S5_PORT='99999'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])  # help whatever the environment, naming the bad value
    assert e.value.code == 0 and "S5_WINDOW='abc'" in capsys.readouterr().out


def test_model_keywords_are_not_paths_whatever_the_cwd_holds(tmp_path, monkeypatch):
    for name in ("embedded", "tiny-random"):
        (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path)
    assert parse_serve_args([]).engine.model == "embedded"
    assert parse_serve_args(["--model", "tiny-random"]).engine.model == "tiny-random"


def test_listening_is_checked_as_the_server_binds():
    """IPv6 sockets bind v6-only, as asyncio's do: `--host ::` is free where only 0.0.0.0 is taken."""
    import socket

    from service.cli import listen_problem

    with socket.socket() as v4:
        v4.bind(("0.0.0.0", 0))
        v4.listen()
        port = v4.getsockname()[1]
        assert "in use" in listen_problem("0.0.0.0", port)
        free = listen_problem("::", port)  # None, or on a machine without IPv6 that reason, never "in use"
        assert free is None or "in use" not in free, free


def test_a_port_in_use_stops_serve_before_the_model_loads(capsys):
    import socket
    import time

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        assert main(["serve", "--model", "tiny-random", "--session-db", "none", "--port", str(port)]) == 1
        assert time.monotonic() - t0 < 5
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "in use" in err


def test_binding_beyond_loopback_without_keys_warns():
    assert exposure_warning(parse_serve_args([])) is None
    assert exposure_warning(parse_serve_args(["--host", "::1"])) is None
    assert exposure_warning(parse_serve_args(["--host", "localhost"])) is None
    warning = exposure_warning(parse_serve_args(["--host", "0.0.0.0"]))
    assert warning and "every interface" in warning and "--api-keys" in warning
    assert exposure_warning(parse_serve_args(["--host", "0.0.0.0", "--api-key", "k"])) is None


def test_top_level_help_lists_the_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name}" in out for name in ("serve", "chat"))
    assert main(["--version"]) == 0 and "s5serve" in capsys.readouterr().out
    assert main([]) == 2 and main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0 and "S5_KV_POLICY" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["chat", "--help"])
    assert e.value.code == 0 and "default: http://127.0.0.1:8000" in capsys.readouterr().out


def test_front_ends_one_on_the_cpu_one_per_four_cores_on_cuda(monkeypatch):
    assert parse_serve_args([]).front_ends() == 1  # the CPU: the engine wants the cores
    assert parse_serve_args(["--api-servers", "3"]).front_ends() == 3
    for cores, want in ((2, 1), (8, 2), (16, 4), (64, 4)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert parse_serve_args(["--device", "cuda"]).front_ends() == want
        assert parse_serve_args(["--device", "cuda", "--api-servers", "1"]).front_ends() == 1
    with pytest.raises(SystemExit):
        parse_serve_args(["--api-servers", "0"])


@pytest.mark.parametrize("argv, says", [
    (["--window", "-1"], "--window"), (["--window", "0"], "--window"), (["--sink", "-3"], "--sink"),
    (["--rows", "0"], "--rows"), (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["--max-decode-stall-ms", "-1"], "--max-decode-stall-ms"), (["--queue-size", "0"], "--queue-size"),
    (["--session-ttl", "-1"], "--session-ttl"), (["--session-ttl", "nan"], "--session-ttl"),
    (["--drain-grace", "inf"], "--drain-grace"), (["--keep-alive", "-1"], "--keep-alive"),
    (["--max-body-bytes", "0"], "--max-body-bytes"), (["--max-sessions-per-key", "-1"], "--max-sessions-per-key"),
    (["--max-requests-per-key", "0"], "--max-requests-per-key"), (["--port", "70000"], "--port"),
    (["--max-model-len", "-5"], "--max-model-len"), (["--device", "tpu"], "--device"),
    (["--model", "/nonexistent/model/dir"], "no model directory"),
    (["--model", os.path.dirname(os.path.abspath(__file__))], "holds no config.json"),
    # each value fine alone, refused together by the engine's own checks: a usage error too
    (["--kv-budget", "0"], "kv_budget"), (["--kv-windows", "0,1"], "kv_windows"),
    (["--quantization", "int8", "--device", "cuda"], "int8"),
])
def test_values_out_of_range_are_usage_errors(argv, says, capsys):
    """A value the server cannot run with stops `s5serve serve` at once with a usage error (exit
    2) naming it, instead of a traceback, or a server that reports ready and refuses everything."""
    with pytest.raises(SystemExit) as e:
        parse_serve_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


def test_the_same_values_from_the_environment_are_refused_too(monkeypatch, capsys):
    monkeypatch.setenv("S5_WINDOW", "-1")
    with pytest.raises(SystemExit) as e:
        parse_serve_args([])
    assert e.value.code == 2 and "S5_WINDOW='-1'" in capsys.readouterr().err


@pytest.mark.parametrize("db, says", [("{tmp}", "is a directory"), ("{tmp}/file/sessions.sqlite3", "cannot use")])
def test_a_session_db_that_cannot_be_used_is_a_clear_error(db, says, tmp_path, capsys):
    (tmp_path / "file").write_text("not a directory")
    code = main(["serve", "--model", "tiny-random", "--session-db", db.format(tmp=tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
