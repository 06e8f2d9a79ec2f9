"""Long texts are tokenized off the event loop: in the tokenizer process
(service/tokenize_worker.py) while it runs, else in a thread through the Rust tokenizer directly
(`turns.long_text_ids`). Both give the ids `tokenizer(text)` gives, with and without the special
tokens (a session's later turns go without BOS). The process runs at the lowest CPU priority; when it dies,
its callers get an error at once, not a wait, and the pool goes on in threads."""

import asyncio
import os
import signal
import sys

import pytest
from transformers import AutoTokenizer

from service.tokenize_worker import TokenizerGone, TokenizerProcess
from service.turns import OFF_LOOP_CHARS, TokenizerPool, long_text_ids
from tests.servers import alive

TEXTS = [
    "The quick brown fox jumps over the lazy dog while counting sheep. " * 400,
    "  leading spaces,\ttabs,\n\nblank lines and trailing spaces   " * 120,
    "Ünïcödé — 漢字かな交じり文, emoji 🦊🐑, and <start_of_turn> as plain text. " * 150,
    "x" * (OFF_LOOP_CHARS + 1),
]


async def gone(pid: int, within: float = 5.0) -> bool:
    for _ in range(int(within / 0.05)):
        if not alive(pid):
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def tok(embedded_dir):
    return AutoTokenizer.from_pretrained(str(embedded_dir))


@pytest.mark.parametrize("special", [True, False])
@pytest.mark.parametrize("text", TEXTS, ids=["repeated", "whitespace", "unicode", "one-run"])
def test_long_text_ids_equal_the_tokenizers(tok, text, special):
    assert len(text) > OFF_LOOP_CHARS
    want = tok(text, add_special_tokens=special)["input_ids"]
    got = long_text_ids(tok, text, special)
    assert got == want
    assert (got[0] == tok.bos_token_id) == special


async def test_the_tokenizer_process_gives_the_tokenizers_ids_at_the_lowest_priority(tok):
    proc = TokenizerProcess()
    await proc.start(tok.backend_tokenizer.to_str())
    try:
        for special in (True, False):
            got = await asyncio.gather(*(proc.encode(text, special) for text in TEXTS))
            assert got == [tok(text, add_special_tokens=special)["input_ids"] for text in TEXTS]
        if sys.platform == "linux":
            assert os.sched_getscheduler(proc._proc.pid) == os.SCHED_BATCH
            assert os.getpriority(os.PRIO_PROCESS, proc._proc.pid) == 19
    finally:
        proc.close()
    assert await gone(proc._proc.pid)  # closing kills it


async def test_a_dead_tokenizer_process_fails_its_callers_and_the_pool_goes_on_in_threads(tok):
    pool = TokenizerPool()
    await pool.start_process(tok)
    try:
        assert pool.process_running
        process = pool._process
        pid = process._proc.pid
        os.kill(pid, signal.SIGSTOP)  # a text is sent, then the process dies without answering it
        pending = asyncio.ensure_future(process.encode(TEXTS[0], True))
        await asyncio.sleep(0.2)
        assert not pending.done()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(TokenizerGone):
            await asyncio.wait_for(pending, 10)
        assert not pool.process_running
        with pytest.raises(TokenizerGone):
            await process.encode(TEXTS[0], True)
        assert await pool.encode(tok, TEXTS[2], False) == tok(TEXTS[2], add_special_tokens=False)["input_ids"]
    finally:
        pool.close()


async def test_a_tokenizer_the_process_cannot_load_leaves_long_texts_to_threads(tok):
    proc = TokenizerProcess()
    with pytest.raises(TokenizerGone):
        await proc.start("{not a tokenizer")
    assert not proc.alive and await gone(proc._proc.pid)
    pool = TokenizerPool()
    pool._process = proc
    try:
        assert await pool.encode(tok, TEXTS[0], True) == tok(TEXTS[0])["input_ids"]
    finally:
        pool.close()


def test_the_tokenizer_process_on_the_servers_event_loop(tok):
    """On uvloop (the loop uvicorn runs the front end on) the process starts, answers, and its
    exit reaches a waiting caller at once (a thread reaps it); closing leaves no process."""
    uvloop = pytest.importorskip("uvloop")

    async def run() -> None:
        proc = TokenizerProcess()
        await proc.start(tok.backend_tokenizer.to_str())
        try:
            assert await proc.encode(TEXTS[3], False) == tok(TEXTS[3], add_special_tokens=False)["input_ids"]
            os.kill(proc._proc.pid, signal.SIGSTOP)
            pending = asyncio.ensure_future(proc.encode(TEXTS[0], True))
            await asyncio.sleep(0.2)
            os.kill(proc._proc.pid, signal.SIGKILL)
            with pytest.raises(TokenizerGone):
                await asyncio.wait_for(pending, 5)
            assert not proc.alive and proc._proc.returncode == -signal.SIGKILL  # reaped
        finally:
            proc.close()
        again = TokenizerProcess()
        await again.start(tok.backend_tokenizer.to_str())
        pid = again._proc.pid
        again.close()
        assert await gone(pid)

    uvloop.run(run())
