"""A session turn that a stop string ends keeps the text the client got. The history holds the
tokens before the stop string (and, where it began inside a token, the tokens of that token's
visible part), never the stop string, and the next turns read from there: the same tokens as a
request that sends the visible conversation, and as the session's row rebuilt by replay."""

import pytest

from engine import Engine, EngineConfig, Request, SamplingParams
from engine.core.detokenizer import IncrementalDetokenizer
from engine.model.loader import LoadedModel

pytestmark = pytest.mark.slow

PROMPT = "My favourite fruit is the"
TURNS = (" I also like its", " Tell me more:")


def _engine(embedded) -> Engine:
    return Engine(EngineConfig(model="embedded"), LoadedModel(embedded.model, embedded.tokenizer, "e"))


def _run(engine: Engine, request: Request) -> list[int]:
    engine.add_request(request)
    out = []
    while engine.has_work():
        for o in engine.step():
            assert o.error is None, o.error
            out += o.new_token_ids
    return out


def _greedy(max_tokens: int, stop: tuple[str, ...] = ()) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, stop=stop, ignore_eos=True)


def _choose_stop(tokenizer, out: list[int], inside: bool) -> tuple[str, int, int]:
    """A stop string whose first match in `out`'s text is at token j: the whole token (`inside`
    False), or from its second character to the end of token j + 2. (stop, j, its offset)."""
    text = tokenizer.decode(out, skip_special_tokens=True)
    starts = [len(tokenizer.decode(out[:i], skip_special_tokens=True)) for i in range(len(out) + 1)]
    for j in range(2, len(out) - 3):
        piece = text[starts[j]:starts[j + 1]]
        if len(piece.strip()) < 2 or not piece.isascii():
            continue
        at = starts[j] + 1 if inside else starts[j]
        stop = text[at:starts[j + 3]] if inside else piece
        if text.find(stop) == at:
            return stop, j, at
    raise AssertionError(f"no stop string to choose in {text!r}")


@pytest.mark.parametrize("inside", [False, True], ids=["whole-token", "inside-a-token"])
def test_a_session_keeps_the_text_before_its_stop_string(embedded, inside):
    tok = embedded.tokenizer
    prompt = tok(PROMPT)["input_ids"]
    engine = _engine(embedded)
    free = _run(engine, Request("free", prompt, _greedy(16)))
    stop, j, at = _choose_stop(tok, free, inside)
    visible = tok.decode(free, skip_special_tokens=True)[:at]

    sid = engine.create_session()
    out = _run(engine, Request("t1", prompt, _greedy(16, (stop,)), session_id=sid))
    # the turn ends at the token that completes the stop string, and the client's text before it
    assert out == free[: j + (3 if inside else 1)]
    detok = IncrementalDetokenizer(tok, (stop,))
    assert detok.add_many(out) == (visible, True)

    history = engine.session_tokens(sid)
    assert history[: len(prompt) + j] == prompt + free[:j]
    assert tok.decode(history[len(prompt):], skip_special_tokens=True) == visible
    session = engine.sessions[sid]
    if inside:  # the row fed tokens of the stop string: rolled back, the next turn prefills this one
        assert len(history) > len(prompt) + j and session.row is None and session.forwards == [(0, 0)]
    else:  # every token the row fed is kept: the row stays, holding the whole history
        assert len(history) == len(prompt) + j
        assert session.row is not None and engine.pool.kv_len(session.row) == len(history)

    # the next turns: the same tokens as the visible conversation sent whole (inside: the turn
    # before is not in the row, so the next turn is one prefill of it all, as a request's is) and
    # as the row rebuilt by replaying the recorded forwards
    twin = _engine(embedded)
    twin_sid = twin.create_session()
    assert _run(twin, Request("t1", prompt, _greedy(16, (stop,)), session_id=twin_sid)) == out
    for n, text in enumerate(TURNS, start=2):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        before = engine.session_tokens(sid)
        got = _run(engine, Request(f"t{n}", ids, _greedy(8), session_id=sid))
        if inside and n == 2:
            assert got == _run(engine, Request(f"whole{n}", before + ids, _greedy(8)))
        twin.release_row(twin_sid)
        assert _run(twin, Request(f"t{n}", ids, _greedy(8), session_id=twin_sid)) == got
        assert engine.session_tokens(sid) == before + ids + got
        assert twin.session_tokens(twin_sid) == engine.session_tokens(sid)
    engine.check_invariants()
    twin.check_invariants()
