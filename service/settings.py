"""Settings: every flag and S5_* environment variable, read in one place."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from engine.config import KV_POLICIES, EngineConfig


@dataclass(frozen=True)
class Settings:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    max_queued: int = 256  # requests waiting or running before 429
    served_model_name: str | None = None
    api_keys: tuple[str, ...] = ()  # empty: no auth
    session_ttl_s: float = 3600.0  # idle sessions older than this are evicted
    max_body_bytes: int = 4 << 20  # larger request bodies get 413
    drain_grace_s: float = 30.0  # SIGTERM: in-flight streams get this long to finish
    # An idle keep-alive connection is closed after this long. It must outlast the idle expiry of
    # client connection pools (httpx and the openai SDK: 5 s; load balancers: often 60 s): when the
    # server closes first, a request the client sends on that connection at the same moment fails.
    keep_alive_s: float = 75.0


def default_session_db() -> str:
    """Where `s5serve serve` keeps session transcripts unless told otherwise: the user's state
    directory (XDG_STATE_HOME, else ~/.local/state)."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "s5serve", "sessions.sqlite3")


def _env(name: str, default, cast=str):
    raw = os.environ.get(f"S5_{name}")
    return default if raw is None else cast(raw)


def parse_serve_args(argv: list[str] | None = None) -> Settings:
    d = EngineConfig()
    p = argparse.ArgumentParser(prog="s5serve serve", description="Serve a model over HTTP (SSE).")
    p.add_argument("--model", default=_env("MODEL", d.model))
    p.add_argument("--device", default=_env("DEVICE", d.device))
    p.add_argument("--dtype", default=_env("DTYPE", d.dtype))
    p.add_argument("--kv-policy", default=_env("KV_POLICY", d.kv_policy), choices=KV_POLICIES)
    p.add_argument("--sink", type=int, default=_env("SINK", d.kv_sink, int))
    p.add_argument("--window", type=int, default=_env("WINDOW", d.kv_window, int))
    p.add_argument("--rows", type=int, default=_env("ROWS", d.max_rows, int))
    p.add_argument("--kv-cache-bytes", type=int, default=_env("KV_CACHE_BYTES", d.kv_cache_bytes, int))
    p.add_argument("--swap-bytes", type=int, default=_env("SWAP_BYTES", d.swap_bytes, int),
                   help="host memory for rows of idle sessions when rows run short (0: close them instead)")
    p.add_argument("--max-num-batched-tokens", type=int, default=_env("MAX_BATCHED_TOKENS", d.max_num_batched_tokens, int))
    p.add_argument("--max-model-len", type=int, default=_env("MAX_MODEL_LEN", None, int))
    p.add_argument("--quantization", default=_env("QUANTIZATION", "auto"), choices=["auto", "none", "int8", "bnb-4bit"],
                   help="weights: auto (int8 on the CPU with float32 dtype, else none), none, int8 (CPU), "
                        "bnb-4bit (CUDA)")
    p.add_argument("--queue-size", type=int, default=_env("QUEUE_SIZE", 256, int))
    p.add_argument("--api-key", action="append", default=None,
                   help="accepted API key (repeatable); S5_API_KEYS takes a comma-separated list")
    p.add_argument("--session-ttl", type=float, default=_env("SESSION_TTL", 3600.0, float))
    p.add_argument("--max-body-bytes", type=int, default=_env("MAX_BODY_BYTES", 4 << 20, int))
    p.add_argument("--drain-grace", type=float, default=_env("DRAIN_GRACE", 30.0, float))
    p.add_argument("--session-db", default=_env("SESSION_DB", default_session_db()),
                   help="SQLite file keeping session transcripts, so sessions survive restarts "
                        "('none': sessions live in memory only)")
    p.add_argument("--keep-alive", type=float, default=_env("KEEP_ALIVE", 75.0, float),
                   help="seconds an idle HTTP connection stays open (keep above clients' pool expiry)")
    p.add_argument("--pdl", default=_env("PDL", "on"), choices=["on", "off"],
                   help="launch the engine's GPU kernels with programmatic dependent launch where the GPU "
                        "supports it (small decode batches; results are the same either way)")
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=_env("PORT", 8000, int))
    a = p.parse_args(argv)
    quantization = None if a.quantization == "none" else a.quantization
    if quantization == "auto":
        quantization = "int8" if a.device == "cpu" and a.dtype == "float32" else None
    engine = EngineConfig(
        model=a.model, device=a.device, dtype=a.dtype, kv_policy=a.kv_policy, kv_sink=a.sink,
        kv_window=a.window, max_rows=a.rows, kv_cache_bytes=a.kv_cache_bytes,
        max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
        quantization=quantization, swap_bytes=a.swap_bytes,
        session_db=None if a.session_db.lower() in ("", "none") else a.session_db, pdl=a.pdl == "on",
    )
    keys = tuple(a.api_key or [k for k in _env("API_KEYS", "").split(",") if k.strip()])
    return Settings(engine=engine, host=a.host, port=a.port, max_queued=a.queue_size,
                    api_keys=tuple(k.strip() for k in keys), session_ttl_s=a.session_ttl,
                    max_body_bytes=a.max_body_bytes, drain_grace_s=a.drain_grace,
                    keep_alive_s=a.keep_alive)
