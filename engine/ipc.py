"""The wire between the front ends and the engine process: typed messages, MessagePack-encoded
(msgspec), over ZeroMQ PUSH/PULL sockets on local IPC endpoints.

    front end i  --ToEngine-->   engine process    Submit, Abort, Call, Shutdown    (one inbox, shared)
    front end i  <--FromEngine-- engine process    Started, StepOutputs, Reply, Failed  (outbox i)

A server has one or more front ends (`Endpoints.outs`, one each); the engine binds the shared
inbox and connects one outbox to each front end. A `Submit` or `Call` names its front end
(`client`): the request's outputs and the call's reply go back to that front end only. One
`StepOutputs` carries every row of one engine step that belongs to that front end (never one
message per token). A `Call` names one of `CALLS`, the engine verbs a front end may use; its
`Reply` carries the verb's result or the `EngineError` it raised. Replies and outputs travel on
the same socket in the order the engine produced them, so a request's `Reply` always precedes its
first output.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import msgspec

from engine.core.types import FinishReason, Request, TokenLogprobs

# Engine verbs a `Call` may name (methods of engine.Engine, plus "stats" and "check_invariants",
# and RESPONSE_CALLS, methods of the engine's ResponseStore).
RESPONSE_CALLS = ("put_response", "get_response", "response_chain", "delete_response")
CALLS = ("create_session", "close_session", "reset_session", "release_row", "session_info", "session_tokens",
         "session_tail", "expire_idle", "cancel", "stats", "check_invariants", *RESPONSE_CALLS)


class Limits(msgspec.Struct, array_like=True, frozen=True):
    """Admission limits over every front end's requests, applied by the engine (which alone sees
    them all). A request counts once, with its n completions and all its prompts."""

    max_in_flight: int | None = None  # requests waiting or running, over all tenants
    max_per_owner: int | None = None  # requests waiting or running of one tenant (API key)


# ---- front end -> engine --------------------------------------------------------------------------
class Submit(msgspec.Struct, tag="submit", array_like=True):
    call_id: int  # the Reply says whether the engine accepted the request
    client: int  # the front end that sent it: its outputs go there
    request: Request
    limits: Limits | None = None  # the server's admission limits (the engine applies them)


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]  # end these at the next step boundary (unknown ids are ignored)


class Call(msgspec.Struct, tag="call", array_like=True):
    call_id: int
    client: int  # the front end that called: the Reply goes there
    method: str  # one of CALLS
    args: list[Any]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


ToEngine = Submit | Abort | Call | Shutdown


# ---- engine -> front end --------------------------------------------------------------------------
class Output(msgspec.Struct, array_like=True, gc=False):
    """engine.core.types.RequestOutput on the wire (same fields, same order)."""

    request_id: str
    new_token_ids: list[int]  # tokens sampled this step
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int  # tokens prefilled for this turn (excludes reused history)
    num_cached_tokens: int  # history tokens reused from the row
    num_output_tokens: int  # tokens generated so far
    error: str | None  # set with FinishReason.ERROR
    logprobs: list[TokenLogprobs] | None = None  # per new token, where the request wants them


class EngineStats(msgspec.Struct, array_like=True):
    """What the engine looks like now; published with step outputs at most every STATS_PERIOD_S
    and whenever it goes idle. Counters are totals since the engine started."""

    num_waiting: int  # requests queued for admission
    num_running: int  # requests holding a row
    num_rows: int  # KV rows in the pool
    rows_used: int  # rows held by sessions and requests
    session_rows: int  # of those, rows held by sessions (the rest: stateless requests in flight)
    kv_block_utilization: float  # share of paged KV blocks in use (0 without paged layers)
    num_sessions: int  # open sessions
    swapped_bytes: int  # host bytes of swapped session rows
    counters: dict[str, int]  # Engine.stats: steps, prefill/decode tokens, swaps, rebuilds, ...
    invariant_checks: int  # pool/engine invariant checks run while idle
    invariant_failures: int  # of those, how many failed (logged by the engine process)


class EngineInfo(msgspec.Struct, array_like=True):
    """Facts about the loaded model, sent once when the engine is ready."""

    model_name: str
    max_model_len: int
    vocab_size: int
    pid: int


class Started(msgspec.Struct, tag="started", array_like=True):
    info: EngineInfo


class StepOutputs(msgspec.Struct, tag="step", array_like=True):
    outputs: list[Output]  # every row that produced something this step (aborts included)
    step_seconds: float  # the step's duration in the engine (0 for outputs of aborts)
    stats: EngineStats | None  # a fresh snapshot, or None when the last one is recent


class WireError(msgspec.Struct, array_like=True):
    message: str
    code: str
    param: str | None


class Reply(msgspec.Struct, tag="reply", array_like=True):
    call_id: int
    result: Any = None
    error: WireError | None = None  # the EngineError the verb raised


class Failed(msgspec.Struct, tag="failed", array_like=True):
    error: str  # the engine could not start, or its loop died: it exits after sending this


FromEngine = Started | StepOutputs | Reply | Failed

STATS_PERIOD_S = 0.05


class Endpoints(msgspec.Struct, frozen=True):
    """Where one engine and its front ends meet: the engine's inbox, one outbox per front end."""

    dir: str  # a private directory holding the IPC files
    inbox: str
    outs: list[str]


def endpoints(num_clients: int = 1) -> Endpoints:
    """Fresh IPC endpoints for an engine and `num_clients` front ends, in a private temp dir."""
    base = tempfile.mkdtemp(prefix="s5serve-")
    os.chmod(base, 0o700)
    return Endpoints(base, f"ipc://{base}/in", [f"ipc://{base}/out-{i}" for i in range(num_clients)])


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder(kind) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(kind)
