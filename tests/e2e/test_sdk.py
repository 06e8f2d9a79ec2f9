"""The SDK's two faces are one API: the same calls, the same answers, sessions as context managers
on both (`async with client.create_session() as s` included)."""

import asyncio

import pytest

from service.client import AsyncClient, BadRequest, Client, ConnectionFailed, NotFound
from tests.servers import free_port

pytestmark = pytest.mark.slow
GREEDY = dict(max_tokens=7, temperature=0)
FEW_SHOT = [{"role": "user", "content": "What is the capital of Italy?"},
            {"role": "assistant", "content": "The capital of Italy is Rome."}]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_sync_and_async_faces_answer_alike(server):
    with Client(server.url) as client:
        with client.create_session() as s:
            held = s.append(messages=FEW_SHOT)
            reply = "".join(s.generate(messages=QUESTION, **GREEDY))
            sync_last, sync_id = s.last, s.id
        with pytest.raises(NotFound):  # leaving the block deleted the session
            s.info()
        sync_chat = "".join(client.chat(FEW_SHOT + QUESTION, **GREEDY))
        sync_complete = "".join(client.complete("The capital of France is", **GREEDY))

    async def run():
        async with AsyncClient(server.url) as client:
            async with client.create_session() as s:
                a_held = await s.append(messages=FEW_SHOT)
                a_reply = "".join([t async for t in s.generate(messages=QUESTION, **GREEDY)])
                assert (await s.info())["history_tokens"] == s.last["prompt_tokens"] + s.last["cached_tokens"] + 7
            with pytest.raises(NotFound):
                await s.info()
            plain = await client.create_session()  # awaiting it gives the session, as before
            assert (await plain.info())["history_tokens"] == 0
            await plain.close()
            a_chat = "".join([t async for t in client.chat(FEW_SHOT + QUESTION, **GREEDY)])
            a_complete = "".join([t async for t in client.complete("The capital of France is", **GREEDY)])
            return a_held, a_reply, s.last, a_chat, a_complete, s.id

    a_held, a_reply, a_last, a_chat, a_complete, a_id = asyncio.run(run())
    assert a_id != sync_id
    assert held["appended_tokens"] == held["history_tokens"] > 0 and held["resident_kv_bytes"] > 0
    assert {k: v for k, v in a_held.items() if "seconds" not in k} == {k: v for k, v in held.items() if "seconds" not in k}
    assert reply == a_reply == sync_chat == a_chat == "The capital of France is Paris."
    assert sync_complete == a_complete and sync_complete.startswith(" the capital of")
    assert sync_last["completion_tokens"] == a_last["completion_tokens"] == 7


def test_misuse_and_an_unreachable_server_raise_at_once(server):
    """The streaming calls yield one completion's text: `stream` or n > 1 is refused before a
    request is sent (a non-streamed turn would commit a reply the caller never sees; the choices
    of n would interleave). Input and messages both go to the server, which refuses them. A
    server that cannot be reached raises the SDK's ConnectionFailed on both faces."""
    with Client(server.url) as client:
        with pytest.raises(ValueError):
            list(client.complete("x", n=2, max_tokens=2))
        with pytest.raises(TypeError):
            list(client.chat(QUESTION, stream=False))
        with client.create_session() as s:
            with pytest.raises(TypeError):
                list(s.generate("Hello", stream=False, max_tokens=2))
            with pytest.raises(BadRequest, match="exactly one of input or messages"):
                list(s.generate("hi", messages=QUESTION, max_tokens=2))
            assert s.info()["history_tokens"] == 0  # nothing was committed
    with Client(f"http://127.0.0.1:{free_port()}", timeout=5) as nobody:
        with pytest.raises(ConnectionFailed):
            nobody.create_session()
        with pytest.raises(ConnectionFailed):
            list(nobody.complete("x"))

    async def run():
        async with AsyncClient(f"http://127.0.0.1:{free_port()}", timeout=5) as nobody:
            with pytest.raises(ConnectionFailed):
                await nobody.create_session()
            with pytest.raises(ConnectionFailed):
                [t async for t in nobody.chat(QUESTION)]
        async with AsyncClient(server.url) as client:
            with pytest.raises(ValueError):
                [t async for t in client.complete("x", n=3)]

    asyncio.run(run())


def test_the_terminal_chat_answers_ends_and_reports_a_missing_server(server, monkeypatch, capsys):
    """`s5serve chat`: a turn's reply printed as it streams; Ctrl-C at the prompt ends the chat
    (exit 130) and deletes its session; a server that cannot be reached is one line on stderr
    (exit 1), not a traceback."""
    import builtins

    import httpx

    from service.cli import main

    lines = iter(["What is the capital of France?"])

    def fake_input(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise KeyboardInterrupt from None

    monkeypatch.setattr(builtins, "input", fake_input)
    assert main(["chat", "--url", server.url, "--max-tokens", "7", "--temperature", "0"]) == 130
    out = capsys.readouterr().out
    sid = out.split()[1]
    with Client(server.url) as client:
        want = "".join(client.chat([{"role": "user", "content": "What is the capital of France?"}], **GREEDY))
    assert want and want in out
    assert httpx.get(f"{server.url}/v1/sessions/{sid}").status_code == 404  # deleted on the way out
    assert main(["chat", "--url", f"http://127.0.0.1:{free_port()}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("s5serve chat: http://127.0.0.1:") and "Traceback" not in err and len(err.splitlines()) == 1
    with pytest.raises(SystemExit):
        main(["chat", "--max-tokens", "0"])
