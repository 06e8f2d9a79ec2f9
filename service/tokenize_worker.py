"""A process that tokenizes a front end's long texts at the lowest CPU priority.

Where cores are few, the engine process keeps each of them busy while streams decode, and one
of its steps waits for the slowest of its threads. Tokenizing a huge prompt is a fraction of a
second of CPU (40k tokens: about 0.2 s on one core); run in a thread of the front end, even
niced, it holds the front end's interpreter lock, and when the scheduler takes the core from
that thread the event loop (every live stream) waits for it. So it runs in a process of its own,
in Linux's batch scheduling class at the lowest nice (SCHED_BATCH, nice 19): it does not preempt
another thread when it wakes, a waking thread of normal priority preempts it, and while every core is busy it gets
about 1.5% of one in slices of a millisecond or so. A 40k-token prompt is then tokenized in
seconds on a fully busy server, and no step of the engine waits more than a slice for a core
(the engine's threads are bound one to a core: engine/process.py, bind_cpu_threads).
(The idle class, SCHED_IDLE, gets a fifth of that share: the same prompt took 37-50 s to
tokenize on a 2-core server decoding 8 streams.)

`TokenizerProcess` (the front end's side) starts it with the tokenizer in its serialized form
(the `tokenizers` JSON of the front end's own tokenizer, so both give the same ids) and sends it
requests over a ZeroMQ pair socket, msgpack-encoded: [call id, text, add_special_tokens]. It
answers [call id, ids, None], or [call id, None, error] for a text it could not tokenize; the
first message back, [0, None, None], says it has loaded the tokenizer.

    python -m service.tokenize_worker PARENT_PID ADDRESS
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import msgspec
import zmq
import zmq.asyncio

from engine.client import watch_exit

log = logging.getLogger("s5serve")

START_TIMEOUT_S = 120.0  # loading a 262k-entry vocabulary takes a few seconds on a busy machine


class TokenizerGone(Exception):
    """The tokenizer process is not running (never started, or it exited)."""


class TokenizerProcess:
    """The front end's handle on one tokenizer process: `start`, then `encode` from the event
    loop, `close` at shutdown. Calls are answered in the order sent."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._exit: asyncio.Future | None = None  # the process's exit code, once it has exited
        self._ctx: zmq.asyncio.Context | None = None
        self._sock = None
        self._dir: str | None = None
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._tasks: list[asyncio.Task] = []
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder().decode
        self.alive = False

    async def start(self, tokenizer_json: str, timeout: float = START_TIMEOUT_S) -> None:
        """Start the process on the tokenizer `tokenizer_json` describes; returns once it has
        loaded it. Raises TokenizerGone if it could not start."""
        self._dir = tempfile.mkdtemp(prefix="s5serve-tok-")
        os.chmod(self._dir, 0o700)
        address = f"ipc://{self._dir}/tok"
        self._ctx = zmq.asyncio.Context(1)
        self._sock = self._ctx.socket(zmq.PAIR)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}  # one thread, at the lowest priority
        # Started by `subprocess`, whose child runs no Python between fork and exec, not by the
        # event loop's subprocess support: uvloop's (uvicorn's loop) forks and runs Python in the
        # child before its exec, which never ends if another thread of the front end held a
        # lock that code takes (OpenSSL's, freeing an SSL context) when it forked.
        self._proc = subprocess.Popen([sys.executable, "-m", "service.tokenize_worker", str(os.getpid()), address],
                                      env=env)
        loop = asyncio.get_running_loop()
        self._exit = exit_code = loop.create_future()
        watch_exit(self._proc, loop, lambda code: exit_code.done() or exit_code.set_result(code),
                   "s5serve-tokenizer-watch")
        await self._sock.send(tokenizer_json.encode())
        try:
            first = await asyncio.wait_for(self._sock.recv(), timeout)
        except asyncio.TimeoutError:
            self.close()
            raise TokenizerGone(f"the tokenizer process did not load the tokenizer in {timeout:.0f} s") from None
        if self._decode(first) != [0, None, None]:
            self.close()
            raise TokenizerGone("the tokenizer process could not load the tokenizer")
        self.alive = True
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._watch())]

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """The ids of `text`, as `tokenizer.backend_tokenizer.encode(text, add_special_tokens)`
        gives them. Raises TokenizerGone if the process is not running or exits first, ValueError
        if the tokenizer refused the text."""
        if not self.alive:
            raise TokenizerGone("the tokenizer process is not running")
        call_id = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        try:
            await self._sock.send(self._encode((call_id, text, add_special_tokens)))
            return await fut
        finally:
            self._calls.pop(call_id, None)

    async def _receive(self) -> None:
        while True:
            try:
                call_id, ids, error = self._decode(await self._sock.recv())
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            fut = self._calls.get(call_id)
            if fut is None or fut.done():  # its caller went away
                continue
            if error is not None:
                fut.set_exception(ValueError(error))
            else:
                fut.set_result(ids)

    async def _watch(self) -> None:
        code = await self._exit
        self.alive = False
        if self._calls:
            log.warning("the tokenizer process exited (code %s) with %d texts unanswered", code, len(self._calls))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(TokenizerGone(f"the tokenizer process exited (code {code})"))

    def close(self) -> None:
        self.alive = False
        for task in self._tasks:
            task.cancel()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        if self._sock is not None:
            self._sock.close()
        if self._ctx is not None:
            self._ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._sock = self._ctx = self._dir = None


def _lowest_priority() -> None:
    """This process to the batch scheduling class (Linux) and the lowest nice."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (OSError, AttributeError):  # not Linux: the nice alone
        pass
    try:
        os.nice(19 - os.nice(0))
    except OSError:
        pass


def main(argv: list[str]) -> None:
    from tokenizers import Tokenizer

    from engine.process import die_with_parent

    parent_pid, address = int(argv[0]), argv[1]
    die_with_parent(parent_pid)
    ctx = zmq.Context(1)
    sock = ctx.socket(zmq.PAIR)
    sock.connect(address)
    encode, decode = msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder().decode
    try:
        tok = Tokenizer.from_str(sock.recv().decode())
    except Exception as exc:
        print(f"s5serve tokenizer process: cannot load the tokenizer: {exc}", file=sys.stderr)
        sock.send(encode((0, None, str(exc))))
        sys.exit(1)
    # Loaded at the front end's priority (it waits for this at startup); from here on it
    # tokenizes at the lowest.
    _lowest_priority()
    sock.send(encode((0, None, None)))
    while True:
        call_id, text, add_special = decode(sock.recv())
        try:
            ids = tok.encode(text, add_special_tokens=add_special).ids
        except Exception as exc:  # a text the tokenizer refuses: that caller's error alone
            sock.send(encode((call_id, None, f"{type(exc).__name__}: {exc}")))
        else:
            sock.send(encode((call_id, ids, None)))


if __name__ == "__main__":
    # SIGINT and SIGTERM are the front end's to handle (a terminal's Ctrl-C reaches the whole
    # process group): it drains, then kills this process at close. Ignored before the imports,
    # so a Ctrl-C while the server starts leaves no traceback here either.
    for _sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_sig, signal.SIG_IGN)
    main(sys.argv[1:])
