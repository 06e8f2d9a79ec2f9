"""The engine process: the one owner of the model, the KV pool and the device.

`run_engine` is the process's entry point (the front end starts it through `EngineClient`). It
loads the engine, warms it up, announces `Started`, then loops:

    drain commands (Submit, Abort, Call) without blocking while there is work, or wait for one
    when idle -> one `Engine.step()` -> one `StepOutputs` message for every row it touched

It never waits for the front end: outputs are pushed (ZeroMQ queues them) and the next step runs.
When idle it checks the engine's invariants once (counted in the published stats). It ends on
`Shutdown`, and dies with its parent: the kernel kills it if the parent process goes (Linux), and a
watchdog thread exits if the parent's pid changes. SIGINT and SIGTERM are the parent's to handle
(a terminal's Ctrl-C reaches the whole process group): the parent drains, then shuts it down.
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

import zmq

from engine import ipc
from engine.core.config import EngineConfig
from engine.core.engine import Engine
from engine.core.types import EngineError, Request, RequestOutput, SamplingParams

log = logging.getLogger("s5serve.engine")

IDLE_POLL_MS = 500  # an idle engine wakes this often to notice a vanished parent and stay responsive


def run_engine(config: EngineConfig, in_addr: str, out_addr: str, parent_pid: int, log_level: int) -> None:
    """Entry point of the engine process. Exits 0 after a Shutdown, 1 if the engine failed."""
    _die_with_parent(parent_pid)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    ctx = zmq.Context(1)
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(in_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, 2000)  # outputs queued at exit still reach the front end
    outbox.connect(out_addr)
    encode = ipc.encoder().encode
    try:
        engine = Engine(config)
        engine.grammars.start_building()  # alongside the warm-up (core/structured.py)
        _warm_up(engine)
        engine.grammars.wait_built()
    except Exception as exc:
        log.exception("the engine failed to start")
        outbox.send(encode(ipc.Failed(f"{type(exc).__name__}: {exc}")))
        _close(ctx, inbox, outbox)
        sys.exit(1)
    # Everything allocated so far (model, tokenizer, pool) lives as long as the process: out of the
    # collector's view, full collections stay short while serving.
    gc.collect()
    gc.freeze()
    info = ipc.EngineInfo(engine.model_name, engine.max_model_len, engine.geometry.vocab_size, os.getpid())
    outbox.send(encode(ipc.Started(info)))
    core = EngineCore(engine, outbox)
    code = 0
    try:
        core.serve(inbox)
    except Exception as exc:
        log.exception("the engine loop died")
        outbox.send(encode(ipc.Failed(f"engine failed: {type(exc).__name__}: {exc}")))
        code = 1
    finally:
        engine.close()
        _close(ctx, inbox, outbox)
    sys.exit(code)


def _warm_up(engine: Engine) -> None:
    """One short request through every part of a step (the first step pays one-time costs)."""
    engine.add_request(Request("warmup", [2, 3, 4], SamplingParams(max_tokens=2, ignore_eos=True)))
    while engine.has_work():
        engine.step()
    engine.stats.update(steps=0, prefill_tokens=0, decode_tokens=0)


def _close(ctx, *socks) -> None:
    for s in socks:
        s.close()
    ctx.term()


def _die_with_parent(parent_pid: int) -> None:
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
    """The loop around one Engine: commands in, one message per step out."""

    def __init__(self, engine: Engine, outbox) -> None:
        self.engine = engine
        self.outbox = outbox
        self.encode = ipc.encoder().encode
        self.decode = ipc.decoder(ipc.ToEngine).decode
        self.running = True
        self.invariant_checks = 0
        self.invariant_failures = 0
        self._stats_at = 0.0

    def serve(self, inbox) -> None:
        engine = self.engine
        poller = zmq.Poller()
        poller.register(inbox, zmq.POLLIN)
        checked = False  # invariants checked since the engine last had work
        while self.running:
            busy = engine.has_work()
            if busy or poller.poll(IDLE_POLL_MS):
                self._drain(inbox)
            if not self.running:
                return
            if engine.has_work():
                checked = False
                t0 = time.perf_counter()
                outs = engine.step()
                self._send(outs, time.perf_counter() - t0)
            elif not checked:  # idle: the books must balance
                checked = True
                self._check()
                self._send([], 0.0, force_stats=True)

    def _drain(self, inbox) -> None:
        while True:
            try:
                frame = inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(self.decode(frame.buffer))
            if self.engine.ended_between_steps:
                self._send(self.engine.ended_between_steps, 0.0)
                self.engine.ended_between_steps = []
            if not self.running:
                return

    def _handle(self, msg) -> None:
        engine = self.engine
        if isinstance(msg, ipc.Submit):
            try:
                engine.add_request(msg.request)
            except EngineError as err:
                self._reply(msg.call_id, error=err)
            else:
                self._reply(msg.call_id)
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
                self._reply(msg.call_id, error=EngineError(f"unknown engine call {msg.method!r}"))
                return
            try:
                result = fn(*msg.args)
            except EngineError as err:
                self._reply(msg.call_id, error=err)
            else:
                self._reply(msg.call_id, result)
        elif isinstance(msg, ipc.Shutdown):
            self.running = False

    def _reply(self, call_id: int, result=None, error: EngineError | None = None) -> None:
        wire = ipc.WireError(error.message, error.code, error.param) if error is not None else None
        self.outbox.send(self.encode(ipc.Reply(call_id, result, wire)))

    def _send(self, outs: list[RequestOutput], seconds: float, force_stats: bool = False) -> None:
        now = time.monotonic()
        stats = None
        if force_stats or now - self._stats_at >= ipc.STATS_PERIOD_S:
            stats, self._stats_at = self._stats(), now
        if not outs and stats is None:
            return
        # RequestOutput is a tuple of Output's fields: it encodes as the wire's array
        self.outbox.send(self.encode(ipc.StepOutputs(outs, seconds, stats)))

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


def main(argv: list[str]) -> None:
    """`python -m engine.process IN_ADDR OUT_ADDR PARENT_PID LOG_LEVEL`, the EngineConfig as JSON
    on stdin (EngineClient starts it so)."""
    import msgspec

    in_addr, out_addr, parent_pid, log_level = argv
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineConfig)
    run_engine(config, in_addr, out_addr, int(parent_pid), int(log_level))


if __name__ == "__main__":
    main(sys.argv[1:])
