"""The asyncio bridge: streams, cancellation at the next step, errors before the first output."""

import asyncio

import pytest

from engine import Engine, EngineConfig, EngineError, Request
from engine.worker import Worker
from tests.helpers import greedy, tiny_loaded


@pytest.fixture
async def worker():
    cfg = EngineConfig(model="tiny-random", kv_policy="s5", kv_sink=2, kv_window=4, max_rows=4,
                       kv_cache_bytes=1 << 22)
    w = Worker(Engine(cfg, tiny_loaded(0)))
    await w.start()
    yield w
    await w.stop()


async def test_concurrent_streams_and_cancel(worker):
    async def consume(rid, n, stop_after=None):
        stream = await worker.generate(Request(rid, [5, 6, 7, 8], greedy(n)))
        got = []
        async for out in stream:
            got += out.new_token_ids
            if stop_after is not None and len(got) >= stop_after:
                break
        return got

    full, cut, other = await asyncio.gather(consume("a", 30), consume("b", 500, stop_after=3), consume("c", 30))
    assert len(full) == 30 and full == other and len(cut) == 3
    for _ in range(50):  # the abort lands at the next step boundary
        if await worker.call(lambda: worker.engine.pool.num_free_rows) == 4:
            break
        await asyncio.sleep(0.02)
    await worker.call(worker.engine.check_invariants)
    assert await worker.call(lambda: worker.engine.pool.num_free_rows) == 4


async def test_refused_request_raises_before_streaming(worker):
    with pytest.raises(EngineError):
        await worker.generate(Request("bad", [], greedy(3)))
    assert worker.num_active == 0
