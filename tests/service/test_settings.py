"""Server flags: the weight precision the server picks by default, and explicit choices."""

from service.settings import parse_serve_args


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
