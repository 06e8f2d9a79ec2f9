"""Settings: every flag and S5_* environment variable, read in one place.

Each `s5serve serve` flag is one `Option` in `SERVE_OPTIONS`. Its environment variable is derived
from the flag (`--kv-cache-bytes` <-> `S5_KV_CACHE_BYTES`), and its default is the default of the
dataclass field it sets (`Settings` or `EngineConfig`), so defaults are written once. A value
comes from the command line, else from the environment, else from that default.

Two flags have server defaults of their own, because the library default would be wrong for a
server: `--quantization auto` (int8 weights on the CPU in float32, EngineConfig: none) and
`--session-db` (a file in the user's state directory, EngineConfig: memory only).
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, NamedTuple

from engine.core.config import CPU_KERNELS, DTYPES, KV_POLICIES, EngineConfig

ENV_PREFIX = "S5_"


@dataclass(frozen=True)
class Settings:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"  # loopback only; 0.0.0.0 (all interfaces) is a deliberate choice
    port: int = 8000
    max_queued: int = 256  # requests waiting or running before 429
    # per API key (with keys on): sessions held, and requests waiting or running, before 429
    max_sessions_per_key: int = 4096
    max_requests_per_key: int = 256
    served_model_name: str | None = None  # None: the model's own name
    api_keys: tuple[str, ...] = ()  # empty: no auth
    session_ttl_s: float = 3600.0  # idle sessions older than this are evicted
    max_body_bytes: int = 4 << 20  # larger request bodies get 413
    drain_grace_s: float = 30.0  # SIGTERM: in-flight streams get this long to finish
    # An idle keep-alive connection is closed after this long. It must outlast the idle expiry of
    # client connection pools (httpx and the openai SDK: 5 s; load balancers: often 60 s): when the
    # server closes first, a request the client sends on that connection at the same moment fails.
    keep_alive_s: float = 75.0
    access_log: bool = True  # one line per request on the server's log (uvicorn's access log)
    # HTTP front-end processes sharing the port (each tokenizes, detokenizes and frames SSE for its
    # own connections; one engine process serves them all). None: `front_ends()` decides.
    api_servers: int | None = None

    def front_ends(self) -> int:
        """`api_servers`, or where unset: one on the CPU (the engine wants the cores), on CUDA one
        per 4 cores up to 4 (one front end keeps up with about 64 streams of a small model)."""
        if self.api_servers is not None:
            return self.api_servers
        if not self.engine.device.startswith("cuda"):
            return 1
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, min(4, cores // 4))


def default_session_db() -> str:
    """Where `s5serve serve` keeps session transcripts unless told otherwise: the user's state
    directory (XDG_STATE_HOME, else ~/.local/state)."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "s5serve", "sessions.sqlite3")


# ---- value parsers (command line and environment alike) -------------------------------------------
_BYTE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """"1073741824", "1G", "512MiB", "64m" -> bytes (units are powers of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (e.g. 1073741824, 512M, 4G)")
    return int(float(m.group(1)) * _BYTE_UNITS[m.group(2)])


def show_bytes(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return str(n)


def int_at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    """A parser of whole numbers in [low, high]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low or (high is not None and value > high):
            span = f"of at least {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"expected a whole number {span}, got {text!r}")
        return value
    return parse


def seconds(low: float, *, above: bool = False) -> Callable[[str], float]:
    """A parser of a finite number of seconds (or ms) >= low (> low with `above`)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (above and value == low):
            raise argparse.ArgumentTypeError(f"expected a finite number {'above' if above else 'of at least'} "
                                             f"{low:g}, got {text!r}")
        return value
    return parse


def positive_bytes(text: str) -> int:
    value = parse_bytes(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a byte count of at least 1, got {text!r}")
    return value


def parse_device(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text.strip()):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text.strip()


def parse_model(text: str) -> str:
    """A model: embedded, tiny-random[:seed], random:<config>, a hub id, or a local directory,
    which must exist when the value is written as a path (absolute, ./, ../ or ~) and, as any
    local directory given, hold a Hugging Face model's config.json."""
    if text == "embedded" or text.startswith(("tiny-random", "random:")):  # not paths, whatever lies in the cwd
        return text
    path = os.path.expanduser(text)
    if text.startswith(("/", "./", "../", "~")) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"no model directory at {text!r}")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise argparse.ArgumentTypeError(f"{text!r} holds no config.json: not a Hugging Face model directory")
    return text


def parse_on_off(text: str) -> bool:
    value = text.strip().lower()
    if value in ("on", "true", "1", "yes"):
        return True
    if value in ("off", "false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


def parse_keys(text: str) -> list[str]:
    return [k.strip() for k in text.split(",") if k.strip()]


# ---- the flags ----------------------------------------------------------------------------------
_FROM_FIELD: Any = object()  # Option.default: take the dataclass field's default


@dataclass(frozen=True)
class Option:
    flag: str  # "--kv-policy"; its environment variable is derived from it (S5_KV_POLICY)
    target: str  # the field it sets: "engine.<EngineConfig field>", "<Settings field>", or "" (special)
    help: str
    parse: Callable[[str], Any] = str  # text (command line or environment) -> value
    choices: tuple[str, ...] | None = None
    default: Any = _FROM_FIELD  # only where the server's default differs from the dataclass's
    show: Callable[[Any], str] = str  # how the default reads in --help
    metavar: str | None = None
    aliases: tuple[str, ...] = ()  # other spellings of the flag (same variable)
    old_env: tuple[str, ...] = ()  # variables read when the derived one is unset (older names)

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.flag.lstrip("-").upper().replace("-", "_")

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def builtin_default(self) -> Any:
        if self.default is not _FROM_FIELD:
            return self.default() if callable(self.default) else self.default
        cls, name = (EngineConfig, self.target[len("engine."):]) if self.target.startswith("engine.") \
            else (Settings, self.target)
        f = {f.name: f for f in fields(cls)}[name]
        return f.default_factory() if f.default is MISSING else f.default


def _none_or(show: Callable[[Any], str], none: str) -> Callable[[Any], str]:
    return lambda v: none if v is None else show(v)


def _parse_windows(text: str) -> tuple[int, ...] | None:
    if text.strip().lower() in ("", "none"):
        return None
    try:
        return tuple(int(w) for w in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of windows: {text!r}") from None


def _auto_or_positive_int(text: str) -> int | None:
    """None for auto (or none, or nothing), else a whole number of at least 1."""
    return None if text.strip().lower() in ("", "auto", "none") else int_at_least(1)(text)


SERVE_OPTIONS: tuple[Option, ...] = (
    # model and device
    Option("--model", "engine.model",
           "embedded (Gemma 3 270M base, shipped as Python packages, converted once), a local "
           "directory or hub id that transformers loads, or tiny-random[:seed] (tests)", parse=parse_model),
    Option("--device", "engine.device", "cpu, cuda or cuda:N", parse=parse_device),
    Option("--dtype", "engine.dtype", "weights and activations", choices=DTYPES),
    Option("--quantization", "", "weights: auto (int8 on the CPU in float32, else none), none, "
           "int8 (CPU), bnb-4bit (CUDA, needs the cuda extra)",
           choices=("auto", "none", "int8", "bnb-4bit"), default="auto"),
    Option("--cache-dir", "engine.cache_dir",
           "where the embedded model is converted to and the int8 CPU kernel is built",
           parse=lambda s: s or None, default=None, show=_none_or(str, "$XDG_CACHE_HOME/s5serve or ~/.cache/s5serve"),
           metavar="DIR"),
    Option("--cpu-kernel", "engine.cpu_kernel",
           "int8 CPU kernel: auto (AVX-512 VNNI where the CPU has it, else AVX2), avx512-vnni or avx2; "
           "every choice gives the same results", choices=CPU_KERNELS),
    Option("--max-model-len", "engine.max_model_len", "longest context (prompt + output) in tokens",
           parse=_auto_or_positive_int, show=_none_or(str, "the model's maximum"), metavar="TOKENS"),
    # KV rows and scheduling
    Option("--kv-policy", "engine.kv_policy",
           "s5: sliding layers keep sink + window positions between forwards; native: the model's "
           "own window; full: every layer keeps everything; sink-window: the ablation control",
           choices=KV_POLICIES),
    Option("--sink", "engine.kv_sink", "positions kept at the start of bounded (sliding) layers",
           parse=int_at_least(0), metavar="N"),
    Option("--window", "engine.kv_window", "most recent positions kept on bounded layers between forwards",
           parse=int_at_least(1), metavar="N"),
    Option("--kv-windows", "engine.kv_windows",
           "one window per bounded layer, comma-separated (s5: per sliding layer, in layer order), "
           "instead of --window for all", parse=_parse_windows, show=_none_or(lambda v: ",".join(map(str, v)), "none"),
           metavar="W,W,..."),
    Option("--kv-budget", "engine.kv_budget",
           "K/V bytes per session on the sliding layers (s5): each layer's window is solved from the "
           "model's measured window profile within this budget (e.g. 1M); see docs/fidelity.md",
           parse=lambda t: None if t.strip().lower() in ("", "none") else parse_bytes(t),
           show=_none_or(show_bytes, "none"), metavar="BYTES"),
    Option("--rows", "engine.max_rows", "KV rows: sessions and stateless requests resident at once",
           parse=int_at_least(1), metavar="N"),
    Option("--kv-cache-bytes", "engine.kv_cache_bytes",
           "memory for the paged K/V of exact (full-attention) layers, all rows together (e.g. 2G)",
           parse=positive_bytes, show=show_bytes, metavar="BYTES"),
    Option("--swap-bytes", "engine.swap_bytes",
           "host memory for rows of idle sessions when rows run short (0: rebuild them from the "
           "transcript instead)", parse=parse_bytes, show=show_bytes, metavar="BYTES"),
    Option("--max-num-batched-tokens", "engine.max_num_batched_tokens",
           "tokens per engine step (decodes + prefill chunks; auto: 8192 on CUDA, 512 on the CPU)",
           parse=int_at_least(1), show=lambda v: "auto" if v is None else str(v), metavar="N",
           old_env=("S5_MAX_BATCHED_TOKENS",)),
    Option("--max-decode-stall-ms", "engine.max_decode_stall_ms",
           "while prompts wait to prefill, decoding rows may pause this long so prefill chunks get "
           "the whole step (lower TTFT under bursts, one long gap per stream instead of one per "
           "prefill step); 0: decode every step (auto: 1000 on CUDA, 0 on the CPU)",
           parse=seconds(0.0), show=lambda v: "auto" if v is None else f"{v:g}", metavar="MS"),
    Option("--pdl", "engine.pdl",
           "launch the engine's GPU kernels with programmatic dependent launch where the GPU "
           "supports it (small decode batches; results are the same either way)",
           parse=parse_on_off, show=lambda v: "on" if v else "off", metavar="{on,off}"),
    Option("--nf4-kernels", "engine.nf4_kernels",
           "run bitsandbytes 4-bit models (--quantization bnb-4bit) on the engine's own NF4 "
           "dequantize-and-multiply kernels in its fused forward, instead of bitsandbytes' layers",
           parse=parse_on_off, show=lambda v: "on" if v else "off", metavar="{on,off}"),
    # sessions
    Option("--session-db", "engine.session_db",
           "where session transcripts are kept, so sessions survive restarts: an SQLite file (one "
           "server per file), or a postgresql://user@host/db URL shared by the replicas of a cluster "
           "('none': sessions live in memory only)",
           default=default_session_db, metavar="FILE|URL"),
    Option("--session-ttl", "session_ttl_s", "seconds an idle session is kept", parse=seconds(0.0, above=True),
           metavar="SECONDS"),
    # HTTP
    Option("--host", "host", "address to bind; 0.0.0.0 serves every interface (set API keys then)"),
    Option("--port", "port", "port to bind", parse=int_at_least(1, 65535)),
    Option("--api-keys", "api_keys",
           "accepted API keys, comma-separated; the flag may be repeated. None: no authentication",
           parse=parse_keys, show=lambda v: f"{len(v)} key(s)" if v else "none",
           metavar="KEY[,KEY...]", aliases=("--api-key",)),
    Option("--served-model-name", "served_model_name", "the model name /v1/models reports",
           show=_none_or(str, "the model's own"), metavar="NAME"),
    Option("--queue-size", "max_queued", "requests waiting or running before new ones get 429",
           parse=int_at_least(1), metavar="N"),
    Option("--max-sessions-per-key", "max_sessions_per_key",
           "sessions one API key may hold; more get 429 too_many_sessions", parse=int_at_least(1), metavar="N"),
    Option("--max-requests-per-key", "max_requests_per_key",
           "requests of one API key waiting or running; more get 429 too_many_requests", parse=int_at_least(1),
           metavar="N"),
    Option("--max-body-bytes", "max_body_bytes", "larger request bodies get 413",
           parse=positive_bytes, show=show_bytes, metavar="BYTES"),
    Option("--keep-alive", "keep_alive_s",
           "seconds an idle HTTP connection stays open (keep above clients' pool expiry)",
           parse=seconds(0.0, above=True), metavar="SECONDS"),
    Option("--drain-grace", "drain_grace_s",
           "on SIGTERM, seconds streams in flight get to finish", parse=seconds(0.0), metavar="SECONDS"),
    Option("--access-log", "access_log", "log one line per HTTP request",
           parse=parse_on_off, show=lambda v: "on" if v else "off", metavar="{on,off}"),
    Option("--api-servers", "api_servers",
           "HTTP front-end processes sharing the port, all served by one engine process: more keep up "
           "with more streams (each takes a core)", parse=_auto_or_positive_int,
           show=_none_or(str, "auto: 1 on the CPU; on CUDA 1 per 4 cores, at most 4"), metavar="N|auto"),
)


class BadEnv(NamedTuple):
    """An environment variable's value that does not parse: the option's default in its place, an
    error only where its flag is not given (the flag wins), and never for --help."""

    message: str


def _env_value(opt: Option) -> tuple[bool, Any]:
    for name in (opt.env, *opt.old_env):
        raw = os.environ.get(name)
        if raw is None:
            continue
        try:
            value = opt.parse(raw)
        except (argparse.ArgumentTypeError, ValueError) as e:
            return True, BadEnv(f"{name}={raw!r}: {e}")
        if opt.choices and value not in opt.choices:
            return True, BadEnv(f"{name}={raw!r}: choose from {', '.join(opt.choices)}")
        return True, value
    return False, None


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="s5serve serve", description="Serve a model over HTTP: OpenAI-compatible routes and "
        "sessions, streamed as server-sent events.",
        epilog="Every flag has an environment variable (shown with it): a flag on the command line "
               "wins over the variable, the variable over the default. Byte counts take K, M, G "
               "suffixes (powers of 1024).")
    for opt in SERVE_OPTIONS:
        builtin = opt.builtin_default()
        from_env, env_value = _env_value(opt)
        fallback = env_value if from_env else builtin
        note = f"default: {opt.show(builtin)}; env {opt.env}"
        if from_env:
            note += f", now {env_value.message if isinstance(env_value, BadEnv) else opt.show(env_value)}"
        kw: dict[str, Any] = dict(dest=opt.dest, help=f"{opt.help} [{note}]".replace("%", "%%"),
                                  metavar=opt.metavar, type=opt.parse, choices=opt.choices)
        if opt.target == "api_keys":  # repeatable: each use appends a list; unset, the fallback holds
            kw.update(action="append", default=None)
            p.set_defaults(api_keys_fallback=fallback)
        else:
            kw.update(default=fallback)
        p.add_argument(opt.flag, *opt.aliases, **kw)
    return p


def parse_serve_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> Settings:
    """Settings from the command line and environment; `parser`: serve_parser() with more
    arguments of another command (s5serve cluster), which are left to it."""
    parser = parser or serve_parser()
    a = vars(parser.parse_args(argv))
    for dest, value in a.items():  # a variable that does not parse, whose flag was not given
        if isinstance(value, BadEnv) and not (dest == "api_keys_fallback" and a["api_keys"] is not None):
            parser.error(value.message)
    keys = a["api_keys"]
    a["api_keys"] = tuple(k for group in keys for k in group) if keys is not None else tuple(a["api_keys_fallback"])
    engine_kw: dict[str, Any] = {}
    settings_kw: dict[str, Any] = {}
    for opt in SERVE_OPTIONS:
        if opt.target.startswith("engine."):
            engine_kw[opt.target[len("engine."):]] = a[opt.dest]
        elif opt.target:
            settings_kw[opt.target] = a[opt.dest]
    quantization = a["quantization"]
    if quantization == "auto":
        quantization = "int8" if engine_kw["device"] == "cpu" and engine_kw["dtype"] == "float32" else None
    engine_kw["quantization"] = None if quantization == "none" else quantization
    db = engine_kw["session_db"]
    engine_kw["session_db"] = None if db is None or db.strip().lower() in ("", "none") else db
    try:
        engine = EngineConfig(**engine_kw)
    except ValueError as err:  # a combination of values the engine refuses (each flag alone parsed)
        parser.error(str(err))
    return Settings(engine=engine, **settings_kw)


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost: assume it is reachable from elsewhere


def exposure_warning(settings: Settings) -> str | None:
    """A warning when the server is reachable from other machines and accepts anyone."""
    if settings.api_keys or is_loopback(settings.host):
        return None
    where = "every interface" if settings.host in ("0.0.0.0", "::", "") else settings.host
    return (f"serving on {where} (port {settings.port}) without API keys: anyone who can reach this "
            f"machine can use the server; set --api-keys (S5_API_KEYS) or bind 127.0.0.1")
