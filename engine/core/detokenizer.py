"""Incremental detokenization: UTF-8 safe deltas and stop strings that are never emitted."""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids one at a time; get the newly printable text.

    A fast (Rust) tokenizer decodes through its own streaming decoder (`tokenizers`'
    `DecodeStream`, about 1 us a token). Any other is decoded over a short window of recent tokens
    (so tokenizers that merge or strip across token boundaries still yield the right delta). A
    delta ending in an incomplete UTF-8 sequence is held until the next token completes it. With
    stop strings, any tail that could still become a stop string is held back, and text from the
    first stop string on is dropped. The front end and the engine (which checks stop strings to
    end a turn at the right token) run this same class on the same tokens, so they agree.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "_tokenizer", None)
        self._stream = None
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._backend, self._stream = backend, DecodeStream(skip_special_tokens=True)
        self.stop = stop
        self._max_stop = max((len(s) for s in stop), default=0)
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens already turned into text
        self.text = ""  # text emitted so far
        self._held = ""  # decoded but not yet emitted (possible stop-string prefix)
        self.stopped = False  # a stop string was hit

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> tuple[str, bool]:
        """Returns (delta, stopped). After stopped is True, nothing more should be added."""
        if self._stream is not None:
            return self._emit(self._held + (self._stream.step(self._backend, token_id) or ""))
        self.ids.append(token_id)
        full = self._decode(self.ids[self._prefix :])
        if full.endswith(REPLACEMENT):
            return "", False
        prev = self._decode(self.ids[self._prefix : self._read])
        delta = full[len(prev) :] if full.startswith(prev) else full
        self._prefix, self._read = self._read, len(self.ids)
        return self._emit(self._held + delta)

    def add_many(self, token_ids: list[int]) -> tuple[str, bool]:
        """`add` for several tokens: their deltas joined, and whether a stop string was hit (the
        tokens after it are not decoded)."""
        out = []
        for t in token_ids:
            delta, stopped = self.add(t)
            out.append(delta)
            if stopped:
                return "".join(out), True
        return "".join(out), False

    def _emit(self, cand: str) -> tuple[str, bool]:
        if not self.stop:
            self.text += cand
            return cand, False
        tail = self.text[-(self._max_stop - 1) :] if self._max_stop > 1 else ""
        buf = tail + cand
        hits = [i for i in (buf.find(s) for s in self.stop) if i >= 0]
        if hits:
            cut = max(min(hits) - len(tail), 0)
            out = cand[:cut]
            self.text += out
            self._held = ""
            self.stopped = True
            return out, True
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    hold = max(hold, min(k, len(cand)))
                    break
        out = cand[: len(cand) - hold]
        self._held = cand[len(cand) - hold :]
        self.text += out
        return out, False

    def flush(self) -> str:
        """Text held back for a stop string that never came (call when the request ends)."""
        out, self._held = self._held, ""
        self.text += out
        return out


def kept_output(tokenizer, ids: list[int], text: str) -> tuple[list[int], list[int]]:
    """What a session keeps of a reply `ids` that a stop string ended, whose emitted text is
    `text`: the tokens wholly within the text, and the tokens of the text after them (the start
    of the token the stop string cut, encoded anew; empty where the cut fell between tokens)."""
    k, rest = visible_prefix(tokenizer, ids, text)
    return ids[:k], tokenizer.encode(rest, add_special_tokens=False) if rest else []


def visible_prefix(tokenizer, ids: list[int], text: str) -> tuple[int, str]:
    """For a completion `ids` that a stop string ended, and `text`, what was emitted for it (the
    stop string and what came after it dropped): how many of the tokens lie wholly within the text,
    and the text after them (the start of the token the stop string cut, if it began inside one).
    The stop string ends the completion, so the scan from its end decodes few prefixes."""
    for k in range(len(ids), 0, -1):
        s = tokenizer.decode(ids[:k], skip_special_tokens=True)
        if text.startswith(s) and not s.endswith(REPLACEMENT):
            return k, text[len(s):]
    return 0, text
