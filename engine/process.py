"""The engine process: the one owner of the model, the KV pool and the device.

`run_engine` is the process's entry point (whoever starts it passes the `ipc.Endpoints`: one
shared inbox, one outbox per front end). It loads the engine, warms it up, announces `Started` to
every front end, then loops:

    drain commands (Submit, Abort, Call) without blocking while there is work, or wait for one
    when idle -> one `Engine.step()` -> one `StepOutputs` message per front end with rows in it

It never waits for a front end: outputs are pushed (ZeroMQ queues them) and the next step runs.
Each request's outputs go to the front end that submitted it. When idle it checks the engine's
invariants once (counted in the published stats). It ends on `Shutdown`, and dies with its parent:
the kernel kills it if the parent process goes (Linux), and a watchdog thread exits if the
parent's pid changes. SIGINT and SIGTERM are the parent's to handle (a terminal's Ctrl-C reaches
the whole process group): the parent drains, then shuts it down.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

import zmq

from engine import ipc
from engine.core.config import EngineConfig
from engine.core.types import EngineError, Request, RequestOutput, SamplingParams

if TYPE_CHECKING:  # the engine (its model runner) is imported where it is built: front-end
    # processes import this module for die_with_parent only
    from engine.core.engine import Engine

log = logging.getLogger("s5serve.engine")

IDLE_POLL_MS = 500  # an idle engine wakes this often to notice a vanished parent and stay responsive


def run_engine(config: EngineConfig, ends: ipc.Endpoints, parent_pid: int, log_level: int) -> None:
    """Entry point of the engine process. Exits 0 after a Shutdown, 1 if the engine failed."""
    die_with_parent(parent_pid)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    ctx = zmq.Context(1)
    inbox = ctx.socket(zmq.PULL)
    inbox.bind(ends.inbox)
    outboxes = []
    for addr in ends.outs:
        out = ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 2000)  # outputs queued at exit still reach the front end
        out.connect(addr)
        outboxes.append(out)
    encode = ipc.encoder().encode
    from engine.core.session_db import SessionFileBusy, SessionFileLock, SessionStoreError, is_postgres_url

    try:
        from engine.core.engine import Engine

        # one server per session file: taken before the model loads, so a second server on the
        # file stops at once (the store takes the lock over)
        lock = (SessionFileLock(config.session_db)
                if config.session_db and not is_postgres_url(config.session_db) else None)
        engine = Engine(config, session_lock=lock)
        engine.grammars.start_building()  # alongside the warm-up (core/structured.py)
        _warm_up(engine)
        engine.grammars.wait_built()
    except Exception as exc:
        if isinstance(exc, (ValueError, SessionStoreError, SessionFileBusy)):  # the settings', the model's, the store's
            log.error("the engine failed to start: %s: %s", type(exc).__name__, exc)
            log.debug("the engine failed to start", exc_info=True)  # the traceback, at debug level
        else:  # anything else is the engine's own: with its traceback
            log.exception("the engine failed to start")
        _broadcast(outboxes, encode(ipc.Failed(f"{type(exc).__name__}: {exc}")))
        _close(ctx, inbox, *outboxes)
        sys.exit(1)
    # Everything allocated so far (model, tokenizer, pool) lives as long as the process: out of the
    # collector's view, full collections stay short while serving.
    gc.collect()
    gc.freeze()
    info = ipc.EngineInfo(engine.model_name, engine.max_model_len, engine.geometry.vocab_size, os.getpid())
    _broadcast(outboxes, encode(ipc.Started(info)))
    core = EngineCore(engine, outboxes)
    code = 0
    try:
        core.serve(inbox)
    except Exception as exc:
        log.exception("the engine loop died")
        _broadcast(outboxes, encode(ipc.Failed(f"engine failed: {type(exc).__name__}: {exc}")))
        code = 1
    finally:
        engine.close()
        _close(ctx, inbox, *outboxes)
    # Everything is closed: end without the interpreter's teardown, in which compiled extensions
    # (Triton's) report every object they still hold as leaked, hundreds of lines per shutdown.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# Prompt lengths of the warm-up requests, run one after another. The first forward of each kind in a
# process pays one-time costs: lazy initialisation, and on CUDA Triton compiling (or loading from its
# on-disk cache) each kernel form that forward launches. 3 tokens run a step through the forms a
# decode step launches; 48 and 49 tokens are prefill forwards wide enough for the plain (non-PDL)
# forms (kernels/launch.worthwhile), at a row count Triton specializes as a multiple of 16 and at
# one it does not. Without the last two a 4B model's first prompt of a user waited ~0.6 s for them.
WARM_UP_PROMPTS = (3, 48, 49)
# On CUDA one more, longer than the fused kernels' row limits (kernels/moe.MAX_TOKENS for the
# experts, kernels/nf4.MAX_KERNEL_ROWS for NF4 products): its prefill takes the library products
# (a mixture-of-experts layer's grouped product on its experts, dequantized where they are NF4),
# which a user's first long prompt would otherwise set up.
CUDA_WARM_UP_PROMPT = 300


def warm_up_lengths(engine: Engine) -> tuple[int, ...]:
    """The warm-up's prompt lengths for this engine's device."""
    cuda = str(engine.config.device).startswith("cuda")
    return WARM_UP_PROMPTS + ((CUDA_WARM_UP_PROMPT,) if cuda else ())


def _warm_up(engine: Engine, lengths: tuple[int, ...] | None = None) -> None:
    """Requests of `lengths` prompt tokens (default: `warm_up_lengths`) through the engine, one at
    a time, before it serves; its counters start from zero after them. Each prompt is clamped to
    the engine's context and to what its KV cache holds."""
    pool = engine.pool
    for i, n in enumerate(warm_up_lengths(engine) if lengths is None else lengths):
        n = max(1, min(n, engine.max_model_len - 2))
        while n > 1 and pool.blocks_for(n + 2) > pool.num_blocks - 1:
            n //= 2
        engine.add_request(Request(f"warmup{i}", list(range(2, 2 + n)), SamplingParams(max_tokens=2, ignore_eos=True)))
        while engine.has_work():
            engine.step()
    engine.stats.update(steps=0, prefill_tokens=0, decode_tokens=0)


def _broadcast(outboxes, frame: bytes) -> None:
    for out in outboxes:
        out.send(frame)


def _close(ctx, *socks) -> None:
    for s in socks:
        s.close()
    ctx.term()


def die_with_parent(parent_pid: int) -> None:
    """End this process when `parent_pid` (its parent) ends, however that ends."""
    try:  # Linux: the kernel sends SIGKILL when the parent goes, however it goes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent went before the line above took effect
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="s5serve-parent-watch", daemon=True).start()


class EngineCore:
    """The loop around one Engine: commands in, one message per step per front end out."""

    def __init__(self, engine: Engine, outboxes: list) -> None:
        self.engine = engine
        self.outboxes = outboxes  # one per front end, by index
        self.encode = ipc.encoder().encode
        self.decode = ipc.decoder(ipc.ToEngine).decode
        self.running = True
        self.invariant_checks = 0
        self.invariant_failures = 0
        self._stats_at = 0.0
        # with several front ends: request id (for n completions, the prefix of the forks' ids) ->
        # [the front end that submitted it, completions not yet finished]; a request that ends
        # before its row is forked ends its forks too (Engine._finish)
        self._route: dict[str, list[int]] = {}

    def serve(self, inbox) -> None:
        engine = self.engine
        poller = zmq.Poller()
        poller.register(inbox, zmq.POLLIN)
        checked = False  # invariants checked since the engine last had work
        published = False  # stats sent since the engine last had work
        while self.running:
            busy = engine.has_work()
            if not busy and not published:  # gone idle: the stats say so before the wait for a message
                published = True
                self._send([], 0.0, force_stats=True)
            handled = self._drain(inbox) if busy or poller.poll(IDLE_POLL_MS) else 0
            if not self.running:
                return
            if engine.has_work():
                checked = published = False
                t0 = time.perf_counter()
                outs = engine.step()
                self._send(outs, time.perf_counter() - t0)
            elif not checked:  # idle: the books must balance, and no request is left to route
                checked = True
                self._check()
                self._route.clear()
                self._send([], 0.0, force_stats=True)
            elif handled:  # idle, and a call may have changed the stats (a session closed, a row released)
                self._send([], 0.0, force_stats=True)

    def _drain(self, inbox) -> int:
        """Handles every message waiting; returns how many there were."""
        handled = 0
        while True:
            try:
                frame = inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return handled
            handled += 1
            self._handle(self.decode(frame.buffer))
            if self.engine.ended_between_steps:
                self._send(self.engine.ended_between_steps, 0.0)
                self.engine.ended_between_steps = []
            if not self.running:
                return handled

    def _handle(self, msg) -> None:
        engine = self.engine
        if isinstance(msg, ipc.Submit):
            limits = msg.limits or ipc.Limits()
            try:
                engine.add_request(msg.request, limits.max_in_flight, limits.max_per_owner)
            except EngineError as err:
                self._reply(msg.client, msg.call_id, error=err)
            else:
                if len(self.outboxes) > 1:
                    self._route[msg.request.request_id] = [msg.client, max(1, msg.request.params.n)]
                self._reply(msg.client, msg.call_id)
        elif isinstance(msg, ipc.Abort):
            outs = [out for rid in msg.request_ids if (out := engine.abort(rid)) is not None]
            if outs:
                self._send(outs, 0.0)
        elif isinstance(msg, ipc.Call):
            # looked up per call: a table of bound methods kept on self would be a reference cycle
            target = engine.responses if msg.method in ipc.RESPONSE_CALLS else engine
            fn = (getattr(self, "_" + msg.method, None) or getattr(target, msg.method)) if msg.method in ipc.CALLS \
                else None
            if fn is None:
                self._reply(msg.client, msg.call_id, error=EngineError(f"unknown engine call {msg.method!r}"))
                return
            try:
                result = fn(*msg.args)
            except EngineError as err:
                self._reply(msg.client, msg.call_id, error=err)
            else:
                self._reply(msg.client, msg.call_id, result)
        elif isinstance(msg, ipc.Shutdown):
            self.running = False

    def _reply(self, client: int, call_id: int, result=None, error: EngineError | None = None) -> None:
        wire = ipc.WireError(error.message, error.code, error.param) if error is not None else None
        self.outboxes[client].send(self.encode(ipc.Reply(call_id, result, wire)))

    def _send(self, outs: list[RequestOutput], seconds: float, force_stats: bool = False) -> None:
        now = time.monotonic()
        stats = None
        if force_stats or now - self._stats_at >= ipc.STATS_PERIOD_S:
            stats, self._stats_at = self._stats(), now
        if not outs and stats is None:
            return
        # RequestOutput is a tuple of Output's fields: it encodes as the wire's array
        if len(self.outboxes) == 1:
            self.outboxes[0].send(self.encode(ipc.StepOutputs(outs, seconds, stats)))
            return
        parts: list[list[RequestOutput]] = [[] for _ in self.outboxes]
        route = self._route
        for out in outs:
            base = out.request_id.partition("/")[0]
            entry = route.get(base)
            if entry is None:  # not submitted through a front end (the warm-up)
                continue
            parts[entry[0]].append(out)
            if out.finished:
                entry[1] -= 1  # completions left
                if entry[1] == 0:
                    del route[base]
        # the step's time goes with the first message only: summed over front ends, each step counts once
        for client, part in enumerate(parts):
            if part or stats is not None:
                self.outboxes[client].send(self.encode(ipc.StepOutputs(part, seconds, stats)))
                seconds = 0.0

    def _check(self) -> None:
        self.invariant_checks += 1
        try:
            self.engine.check_invariants()
        except AssertionError as exc:
            self.invariant_failures += 1
            log.error("engine invariant violated while idle: %s", exc)

    # ---- calls that are the core's own --------------------------------------------------------
    def _stats(self) -> ipc.EngineStats:
        e = self.engine
        pool = e.pool
        util = 1 - pool.num_free_blocks / (pool.num_blocks - 1) if pool.paged_layers else 0.0
        session_rows = sum(s.row is not None for s in e.sessions.values())
        return ipc.EngineStats(e.num_waiting, e.num_running, pool.num_rows, pool.num_rows - pool.num_free_rows,
                               session_rows, util, len(e.sessions), e.sessions.swapped_bytes, dict(e.stats), self.invariant_checks,
                               self.invariant_failures)

    def _check_invariants(self) -> None:
        try:
            self.engine.check_invariants()
        except AssertionError as exc:
            raise EngineError(f"invariant violated: {exc}", code="invariant_violated") from exc


# Where any of these is set, the user has chosen the OpenMP threads' number or placement.
OPENMP_PLACEMENT_VARS = ("OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")


def bind_cpu_threads(config: EngineConfig, environ: dict[str, str]) -> bool:
    """On the CPU, bind the engine's OpenMP threads one to a core (the OpenMP runtime reads
    `environ` when torch loads it, so this runs before). Each of a step's parallel regions ends at
    a barrier that waits for the slowest thread. Unbound, the kernel's load balancer at times moves
    one engine thread onto the core of another while a third process (the tokenizer process, at the
    lowest priority) gets the freed core to itself, and keeps it so for 100-250 ms: every step
    of that time runs at half speed (seen on a 2-core machine, a 15 ms decode step taking 90-270
    ms). Bound, an engine thread waits at most for another process's time slice on its own core.
    Only where the user chose no OpenMP thread count or placement of their own (then torch takes
    one thread per core the process may use; OMP_PROC_BIND=false leaves placement to the kernel).
    Whether it bound them."""
    if not config.device.startswith("cpu") or any(v in environ for v in OPENMP_PLACEMENT_VARS):
        return False
    environ["OMP_PROC_BIND"] = "close"
    environ["OMP_PLACES"] = "cores"
    return True


def main(argv: list[str]) -> None:
    """`python -m engine.process PARENT_PID LOG_LEVEL`, the EngineConfig and the ipc.Endpoints as
    JSON lines on stdin (EngineProcess starts it so)."""
    import msgspec

    parent_pid, log_level = argv
    config_line, ends_line = sys.stdin.buffer.read().split(b"\n", 1)
    config = msgspec.json.decode(config_line, type=EngineConfig)
    bind_cpu_threads(config, os.environ)
    run_engine(config, msgspec.json.decode(ends_line, type=ipc.Endpoints), int(parent_pid), int(log_level))


if __name__ == "__main__":
    main(sys.argv[1:])
