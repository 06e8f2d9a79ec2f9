"""Logprobs as the OpenAI API shapes them, from the engine's per-token (logprob, top ids, top
logprobs): chat's `choice.logprobs.content[]`, the completions API's parallel lists, and the
session route's per-token objects.

A token's text is its id decoded alone (`token_id:<id>` where the model has no tokenizer); its
`bytes` are that text's UTF-8 bytes, or the byte itself for a byte-fallback token (`<0xE6>`), so
the bytes of a character split over several tokens add up to it. A logprob of -inf (a token
`min_tokens` bans) is reported as -9999.0, as the OpenAI API does: JSON has no infinity.
"""

from __future__ import annotations

import re
from functools import lru_cache

from engine.core.types import TokenLogprobs

FLOOR = -9999.0
_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _lp(x: float) -> float:
    return x if x > FLOOR else FLOOR


class TokenText:
    """Token id -> (text, bytes), cached per tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)
        self.bytes = lru_cache(maxsize=65536)(self._bytes)

    def _text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def _bytes(self, token_id: int) -> list[int]:
        if self.tokenizer is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            m = _BYTE.match(piece) if isinstance(piece, str) else None
            if m:
                return [int(m.group(1), 16)]
        return list(self.text(token_id).encode("utf-8", errors="replace"))


def chat(texts: TokenText, token_ids: list[int], logprobs: list[TokenLogprobs]) -> dict:
    """`choice.logprobs` of a chat completion (or of one streamed chunk of it)."""
    content = []
    for tid, (lp, top_ids, top_lps) in zip(token_ids, logprobs):
        content.append({
            "token": texts.text(tid), "logprob": _lp(lp), "bytes": texts.bytes(tid),
            "top_logprobs": [{"token": texts.text(t), "logprob": _lp(x), "bytes": texts.bytes(t)}
                             for t, x in zip(top_ids, top_lps)],
        })
    return {"content": content}


def completion(texts: TokenText, token_ids: list[int], logprobs: list[TokenLogprobs], offset: int) -> tuple[dict, int]:
    """`choice.logprobs` of a completion (or of one streamed chunk of it) whose first token's text
    starts at character `offset` of the choice's text; and the offset after its last token. Each
    token's `top_logprobs` holds the most likely tokens and the token itself."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, (lp, top_ids, top_lps) in zip(token_ids, logprobs):
        text = texts.text(tid)
        tokens.append(text)
        token_lps.append(_lp(lp))
        top = {texts.text(t): _lp(x) for t, x in zip(top_ids, top_lps)}
        top.setdefault(text, _lp(lp))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


def session(token_ids: list[int], logprobs: list[TokenLogprobs]) -> list[dict]:
    """Per token, on the session route: its id and logprob, and the most likely ids' logprobs."""
    return [{"token_id": tid, "logprob": _lp(lp),
             "top_logprobs": [{"token_id": t, "logprob": _lp(x)} for t, x in zip(top_ids, top_lps)]}
            for tid, (lp, top_ids, top_lps) in zip(token_ids, logprobs)]
