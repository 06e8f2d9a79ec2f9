"""EngineClient against a real engine process (tiny random model): streams, coalescing, aborts,
refusals, tenancy, and the engine's death."""

import asyncio
import os
import signal
import sys

import pytest

from engine import EngineConfig, EngineError, FinishReason, Request
from engine.client import EngineClient, EngineDead
from engine.process import OPENMP_PLACEMENT_VARS, bind_cpu_threads
from tests.helpers import greedy

CONFIG = EngineConfig(model="tiny-random:2", max_rows=4, kv_cache_bytes=1 << 22)


async def _tokens(stream, pause: float = 0.0) -> tuple[list[int], list[int], FinishReason]:
    """All tokens, the size of every delta, and the finish reason."""
    ids, sizes, reason = [], [], None
    async for d in stream:
        ids += d.token_ids
        sizes.append(len(d.token_ids))
        reason = d.finish_reason
        if pause:
            await asyncio.sleep(pause)
    return ids, sizes, reason


async def _idle(client: EngineClient):
    for _ in range(200):
        st = await client.fresh_stats()
        if st.num_running == 0 and st.num_waiting == 0:
            return st
        await asyncio.sleep(0.02)
    raise AssertionError("the engine did not go idle")


async def test_streams_coalesce_for_slow_readers_and_abort_frees_rows():
    client = EngineClient(CONFIG)
    await client.start()
    try:
        prompt = [2, 17, 33, 5, 91]
        fast = await client.generate(Request("fast", prompt, greedy(40)))
        eager, eager_sizes, reason = await _tokens(fast)
        assert reason == FinishReason.LENGTH and len(eager) == 40
        slow = await client.generate(Request("slow", prompt, greedy(40)))
        late, late_sizes, _ = await _tokens(slow, pause=0.05)  # reads slower than the engine steps
        assert late == eager  # the same tokens, in fewer deltas
        assert len(late_sizes) < len(eager_sizes) and max(late_sizes) > 1

        long = await client.generate(Request("long", prompt, greedy(4000)))
        got = 0
        async for d in long:
            got += len(d.token_ids)
            if got >= 3:
                break
        long.abort()
        assert client.num_active == 0
        st = await _idle(client)
        assert st.rows_used == 0
        await client.check_invariants()
    finally:
        await client.shutdown()


async def test_a_refused_request_changes_nothing_and_sessions_answer_only_their_owner():
    client = EngineClient(CONFIG)
    await client.start()
    try:
        with pytest.raises(EngineError) as e:
            await client.generate(Request("bad", [], greedy(3)))
        assert e.value.param == "prompt" and client.num_active == 0
        sid = await client.create_session("alice")
        stream = await client.generate(Request("t1", [2, 5, 6], greedy(4), sid, "alice"))
        ids, _, _ = await _tokens(stream)
        assert (await client.session_info(sid, "alice"))["history_tokens"] == 3 + 4
        for call in (client.session_info(sid, "bob"), client.session_tokens(sid, None),
                     client.generate(Request("t2", [7], greedy(2), sid, "bob"))):
            with pytest.raises(EngineError) as e:
                await call
            assert e.value.code == "session_not_found"
        assert not await client.close_session(sid, "bob")
        assert await client.session_tokens(sid, "alice") == [2, 5, 6, *ids]
        assert await client.close_session(sid, "alice")
        assert (await _idle(client)).rows_used == 0
    finally:
        await client.shutdown()


async def test_the_published_stats_follow_the_engine_without_waiting_for_a_step():
    """The snapshot the engine publishes (what /metrics shows) says a finished request is gone as
    soon as the engine is idle, not after its wait for the next message (half a second), and a
    closed session as soon as it is closed, though no step follows."""
    client = EngineClient(CONFIG)
    await client.start()
    loop = asyncio.get_running_loop()

    async def until(ok, within: float) -> float:
        t0 = loop.time()
        while not (client.stats is not None and ok(client.stats)):
            assert loop.time() - t0 < within, client.stats
            await asyncio.sleep(0.005)
        return loop.time() - t0

    try:
        for i in range(4):
            await _tokens(await client.generate(Request(f"r{i}", [2, 17, 33, 5], greedy(3))))
            await until(lambda st: st.num_running == 0 and st.num_waiting == 0, 0.3)
        sid = await client.create_session()
        await _tokens(await client.generate(Request("turn", [2, 17, 33], greedy(3), session_id=sid)))
        held = await _idle(client)
        assert held.num_sessions == 1 and held.rows_used == 1
        await until(lambda st: st.num_sessions == 1 and st.rows_used == 1, 3.0)
        assert await client.close_session(sid)
        await until(lambda st: st.num_sessions == 0 and st.rows_used == 0, 3.0)
    finally:
        await client.shutdown()


async def test_a_killed_engine_ends_every_stream_and_call():
    deaths = []
    client = EngineClient(CONFIG, on_death=deaths.append)
    await client.start()
    stream = await client.generate(Request("r", [2, 3, 4], greedy(4000)))
    first = await stream.__anext__()
    assert first.token_ids
    os.kill(client.pid, signal.SIGKILL)
    last = None
    async for d in stream:
        last = d
    assert last.finished and last.finish_reason == FinishReason.ERROR and "exited" in last.error
    assert deaths and not client.alive
    with pytest.raises(EngineDead):
        await client.create_session()
    await client.shutdown()


async def test_a_step_for_many_streams_resumes_them_a_group_per_event_loop_pass():
    """One step's outputs for 150 rows wake their consumers at most WAKE_GROUP per pass of the
    event loop, so no pass runs every stream's work; every stream still gets all its tokens."""
    from engine.client import WAKE_GROUP

    n = 150
    client = EngineClient(EngineConfig(model="tiny-random:2", max_rows=n, max_num_batched_tokens=1024,
                                       kv_cache_bytes=1 << 24))
    await client.start()
    loop = asyncio.get_running_loop()
    passes = [0]

    def tick():  # counts the loop's passes: each runs the callbacks scheduled in the one before
        passes[0] += 1
        loop.call_soon(tick)

    try:
        loop.call_soon(tick)
        resumed: dict[int, int] = {}
        counts = []

        async def consume(stream):
            got, first = 0, True
            async for d in stream:
                got += len(d.token_ids)
                if not first:  # the first delta may be there when the consumer starts: no wake-up
                    resumed[passes[0]] = resumed.get(passes[0], 0) + 1
                first = False
            counts.append(got)

        # submitted together, so the engine's steps carry every row
        streams = await asyncio.gather(*(client.generate(Request(f"r{i}", [2, 3 + i % 50, 7], greedy(40)))
                                         for i in range(n)))
        await asyncio.gather(*(consume(s) for s in streams))
        assert counts == [40] * n
        assert max(resumed.values()) <= WAKE_GROUP < n
        assert WAKE_GROUP in resumed.values()  # full groups did form: steps carried more rows than one group
    finally:
        await client.shutdown()


async def test_consumers_slower_than_the_engine_get_its_steps_coalesced():
    """150 consumers that each take 2 ms per delta fall behind the engine's steps: the receiver
    reads every step queued since it last looked before waking them, so their tokens arrive
    several to a delta instead of one step at a time."""
    import time as clock

    n, tokens = 150, 40
    client = EngineClient(EngineConfig(model="tiny-random:2", max_rows=n, max_num_batched_tokens=1024,
                                       kv_cache_bytes=1 << 24))
    await client.start()
    try:
        streams = await asyncio.gather(*(client.generate(Request(f"r{i}", [2, 3 + i % 50, 7], greedy(tokens)))
                                         for i in range(n)))
        deltas, counts = [0], []

        async def consume(stream):
            got = 0
            async for d in stream:
                got += len(d.token_ids)
                deltas[0] += 1
                clock.sleep(0.002)  # a consumer's own work, holding the event loop
            counts.append(got)

        await asyncio.gather(*(consume(s) for s in streams))
        assert counts == [tokens] * n
        assert deltas[0] < n * tokens / 4
    finally:
        await client.shutdown()


def _allowed_cpus(pid: int, tid: int) -> str:
    with open(f"/proc/{pid}/task/{tid}/status") as f:
        return next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list:"))


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="thread placement is read from Linux's /proc, and needs two cores to mean anything")
@pytest.mark.parametrize("user_choice", [None, "false"])
async def test_a_cpu_engine_binds_its_threads_unless_the_user_places_them(monkeypatch, user_choice):
    """The engine process binds its OpenMP threads one to a core (its main thread, which runs
    OpenMP's thread 0, to one core alone); OMP_PROC_BIND in the environment is the user's choice
    and leaves placement to the kernel."""
    if user_choice is None:
        monkeypatch.delenv("OMP_PROC_BIND", raising=False)
    else:
        monkeypatch.setenv("OMP_PROC_BIND", user_choice)
    for var in OPENMP_PLACEMENT_VARS:
        if var != "OMP_PROC_BIND":
            monkeypatch.delenv(var, raising=False)
    every = _allowed_cpus(os.getpid(), os.getpid())
    client = EngineClient(CONFIG)
    await client.start()
    try:
        main_thread = _allowed_cpus(client.pid, client.pid)
    finally:
        await client.shutdown()
    if user_choice is None:
        assert main_thread != every and "," not in main_thread and "-" not in main_thread, main_thread
    else:
        assert main_thread == every


def test_threads_are_bound_on_the_cpu_only_and_never_over_a_users_setting():
    env: dict[str, str] = {}
    assert bind_cpu_threads(EngineConfig(model="tiny-random:2"), env)
    assert env == {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}
    env = {}
    assert not bind_cpu_threads(EngineConfig(model="tiny-random:2", device="cuda"), env) and env == {}
    for var in OPENMP_PLACEMENT_VARS:
        env = {var: "4"}
        assert not bind_cpu_threads(EngineConfig(model="tiny-random:2"), env) and env == {var: "4"}
