"""Non-streamed replies (`service.turns.collect_all`): the choices of one request are gathered
together, a failed choice ends the request at once and aborts the others, and a client that
leaves gets every choice aborted. Turns whose failure or timing the HTTP tests cannot choose are
stood in for by scripted ones here; the served path is covered in tests/e2e."""

import asyncio

from engine import FinishReason
from service.errors import APIError
from service.turns import Chunk, collect_all


class ScriptedTurn:
    """A turn that yields one token every `gap` seconds, `tokens` times, the last finishing with
    `reason`; `close()` is counted, and ends the turn as an abort would."""

    def __init__(self, tokens: int, gap: float, reason=FinishReason.LENGTH) -> None:
        self.tokens, self.gap, self.reason = tokens, gap, reason
        self.closed = 0
        self.running = False
        self.yielded = 0

    async def chunks(self):
        self.running = True
        try:
            for i in range(self.tokens):
                await asyncio.sleep(self.gap)
                last = i == self.tokens - 1
                reason = self.reason if last else None
                self.yielded += 1
                yield Chunk(f"t{i} ", [i], last, reason, 3, 0, i + 1,
                            "boom" if reason == FinishReason.ERROR else None)
        finally:
            self.running = False

    def close(self) -> None:
        self.closed += 1


class Client:
    """An ASGI request whose client leaves after `leave_after` seconds (never if None)."""

    def __init__(self, leave_after: float | None = None) -> None:
        self.leave_after = leave_after

    async def receive(self):
        if self.leave_after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.leave_after)
        return {"type": "http.disconnect"}


def run(coro):
    """The result (or the exception) of `coro`, and the tasks still running 50 ms after it ended."""
    async def main():
        try:
            out = await coro
        except Exception as exc:  # noqa: BLE001 - handed to the test
            out = exc
        await asyncio.sleep(0.05)  # cancelled work finishes unwinding
        return out, [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    return asyncio.run(main())


def test_every_choice_is_gathered_in_order():
    turns = [ScriptedTurn(3, 0.01), ScriptedTurn(5, 0.002)]
    out, left = run(collect_all(turns, Client()))
    assert [o[0] for o in out] == ["t0 t1 t2 ", "t0 t1 t2 t3 t4 "]
    assert [o[1] for o in out] == [[0, 1, 2], [0, 1, 2, 3, 4]]
    assert all(o[2].finish_reason == FinishReason.LENGTH for o in out)
    assert [t.closed for t in turns] == [1, 1] and not left


def test_a_failed_choice_ends_the_request_at_once_and_stops_the_others():
    turns = [ScriptedTurn(2, 0.01, FinishReason.ERROR), ScriptedTurn(10_000, 0.01)]
    err, left = run(collect_all(turns, Client()))
    assert isinstance(err, APIError) and err.code == "generation_failed" and err.status == 500
    assert [t.closed for t in turns] == [1, 1]
    assert turns[1].yielded < 100  # stopped with the failed one, not run to its end
    assert not any(t.running for t in turns) and not left


def test_a_client_that_leaves_aborts_every_choice_and_keeps_what_arrived():
    turns = [ScriptedTurn(10_000, 0.01), ScriptedTurn(10_000, 0.01)]
    out, left = run(collect_all(turns, Client(leave_after=0.1)))
    assert all(o[2] is None for o in out)  # no last chunk: the reply was cut short
    assert all(0 < len(o[1]) < 10_000 for o in out)
    assert [t.closed for t in turns] == [1, 1] and not any(t.running for t in turns) and not left
