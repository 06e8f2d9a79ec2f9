"""Logprobs as the OpenAI API shapes them, from the engine's per-token (logprob, top ids, top
logprobs): chat's `choice.logprobs.content[]`, the completions API's parallel lists, and the
session route's per-token objects.

A token's text is its id decoded alone (`token_id:<id>` where the model has no tokenizer); its
`bytes` are that text's UTF-8 bytes, or the byte itself for a byte-fallback token (`<0xE6>`), so
the bytes of a character split over several tokens add up to it. The completions API names a
byte-fallback token `bytes:\\xNN` (its text alone is U+FFFD), as the OpenAI API does, so its
`top_logprobs` keys stay distinct. A logprob of -inf (a token
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
    """Token id -> (text, bytes, the byte of a byte-fallback token), cached per tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)
        self.byte = lru_cache(maxsize=65536)(self._byte)

    def _text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def _byte(self, token_id: int) -> int | None:
        """The byte a byte-fallback token (`<0xE6>`) stands for; None for any other token."""
        if self.tokenizer is None:
            return None
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        m = _BYTE.match(piece) if isinstance(piece, str) else None
        return int(m.group(1), 16) if m else None

    def bytes(self, token_id: int) -> list[int]:
        b = self.byte(token_id)
        return [b] if b is not None else list(self.text(token_id).encode("utf-8", errors="replace"))


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


def _completion_token(texts: TokenText, token_id: int) -> str:
    """A token as the completions API names it: its text, or, for a byte-fallback token (a piece
    of a character; its text alone is U+FFFD), `bytes:\\xNN` as the OpenAI API writes such a
    token, so two byte tokens never share a name."""
    b = texts.byte(token_id)
    return texts.text(token_id) if b is None else f"bytes:\\x{b:02x}"


class TextOffsets:
    """Where each token's text starts in a completion's text: byte-fallback tokens start where the
    character they make up starts, and the text moves on when its last byte arrives (a character
    left incomplete counts as the one U+FFFD the text shows for it)."""

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.pending = b""

    def advance(self, texts: TokenText, token_id: int) -> int:
        """The offset of this token's text; moves past it."""
        b = texts.byte(token_id)
        if b is not None:
            at = self.offset
            self.pending += bytes((b,))
            try:
                self.offset += len(self.pending.decode("utf-8"))
                self.pending = b""
            except UnicodeDecodeError:
                if len(self.pending) >= 4:  # no character is longer: the text shows U+FFFD
                    self.offset, self.pending = self.offset + 1, b""
            return at
        if self.pending:
            self.offset, self.pending = self.offset + 1, b""
        at = self.offset
        self.offset += len(texts.text(token_id))
        return at


def completion(texts: TokenText, token_ids: list[int], logprobs: list[TokenLogprobs],
               offsets: TextOffsets) -> dict:
    """`choice.logprobs` of a completion (or of one streamed chunk of it); `offsets` carries the
    text offset from chunk to chunk. Each token's `top_logprobs` holds the most likely tokens and
    the token itself, by name; where two tokens share a name, the more likely one's logprob."""
    tokens, token_lps, tops, starts = [], [], [], []
    for tid, (lp, top_ids, top_lps) in zip(token_ids, logprobs):
        name = _completion_token(texts, tid)
        tokens.append(name)
        token_lps.append(_lp(lp))
        top: dict[str, float] = {}
        for t, x in zip(top_ids, top_lps):  # most likely first
            top.setdefault(_completion_token(texts, t), _lp(x))
        top.setdefault(name, _lp(lp))
        tops.append(top)
        starts.append(offsets.advance(texts, tid))
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": starts}


def session(token_ids: list[int], logprobs: list[TokenLogprobs]) -> list[dict]:
    """Per token, on the session route: its id and logprob, and the most likely ids' logprobs."""
    return [{"token_id": tid, "logprob": _lp(lp),
             "top_logprobs": [{"token_id": t, "logprob": _lp(x)} for t, x in zip(top_ids, top_lps)]}
            for tid, (lp, top_ids, top_lps) in zip(token_ids, logprobs)]
