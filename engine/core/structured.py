"""Structured outputs in the engine: a request's grammar as a token matcher (llguidance).

A request that asks for structured output carries a grammar (`SamplingParams.grammar`: an
llguidance grammar, the JSON the front end made from a JSON schema, a regex, a choice or a Lark
grammar). The engine owns one `Grammars`: the grammar engine's view of the model's tokenizer and
an LRU of compiled grammars keyed by their text. That tokenizer takes seconds to build for a 262k
vocabulary and holds the GIL while it builds: the engine process builds it on a thread while it
warms up (torch's kernels let go of the GIL) and is ready once both are done (`start_building`,
`wait_built`); an engine made in-process builds it on its first grammar request. Each request
gets its own `RowGrammar`, a copy of the compiled matcher (microseconds); each completion of a
request with n > 1 a copy of its parent's (`RowGrammar.fork`).

Per step, `step_masks` fills one bitmask row (1 bit per token) for each row with a grammar,
after that row's previous token was accepted (`RowGrammar.accept`, where the engine applies
tokens); the sampler applies the masks to those rows only, after their penalties and before
their pick and logprobs (runner/sampler.py `asking_picks`, runner/token_mask.py). A grammar that
can go no further ends its request (finish reason stop). Steps launched ahead (core/ahead.py)
keep running with grammar rows: a row's next mask needs the token the step before produced, so
that step is applied and the masks filled (on a thread of their own, `fill_masks_async`, while
the engine thread applies the step's other rows) while the device runs the next forward; a row
whose mask is late sits a step out rather than hold the others.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

from engine.core.types import EngineError

GRAMMAR_PARAM = "response_format"  # the request parameter a grammar error is reported against


class TokenMasks(NamedTuple):
    """A step's grammar masks: which logits rows they constrain, and their bits."""

    rows: list[int]  # logits rows with a grammar, ascending
    bitmask: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32 on the host; bit t of a row: token t allowed


class RowGrammar:
    """One request's matcher: the grammar's state after the tokens it has accepted. The
    request's own stop tokens (`SamplingParams.stop_token_ids`, e.g. a chat template's end of
    turn) are allowed wherever the grammar allows its end-of-sequence token, and stand for it."""

    __slots__ = ("matcher", "eos", "stops")

    def __init__(self, matcher, eos: int, stops: tuple[int, ...]) -> None:
        self.matcher = matcher
        self.eos = eos  # the grammar's end-of-sequence token
        self.stops = stops  # the request's stop tokens

    def fill_mask(self, row: torch.Tensor) -> None:
        """The tokens allowed next, as bits into `row` (int32, contiguous, on the host)."""
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if self.stops:
            bits = row.numpy().view(np.uint32)
            if bits[self.eos >> 5] >> (self.eos & 31) & 1:
                for t in self.stops:
                    bits[t >> 5] |= np.uint32(1 << (t & 31))

    def fork(self) -> RowGrammar:
        """A copy in the same state, for a forked completion (n > 1): it advances on its own."""
        return RowGrammar(self.matcher.deep_copy(), self.eos, self.stops)

    def accept(self, token: int) -> bool:
        """Advance over a sampled token; False when the grammar does not allow it."""
        return self.matcher.consume_token(self.eos if token in self.stops else token)

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (or only an end-of-sequence token)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""


def _tokenizer_json(tokenizer) -> str:
    """A fast tokenizer's Rust form serialized (with the added tokens of its config), what the
    grammar engine builds its tokenizer from. It must carry no padding or truncation; where it does,
    a copy without them is serialized (for Gemma's 262k vocabulary the copy takes 2.4 s)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("only fast (Rust) tokenizers are supported")
    if backend.padding is not None or backend.truncation is not None:
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
    return backend.to_str()


class Grammars:
    """Owns the grammar engine's tokenizer and the compiled grammars (LRU keyed by their text)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], capacity: int = 64) -> None:
        self.vocab_size = vocab_size
        self.capacity = capacity
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._tokenizer = tokenizer
        self._eos = list(eos_token_ids)
        self._lltok = None
        self._build_error: str | None = None
        self._built = threading.Event()
        self._building: threading.Thread | None = None
        self._filler: ThreadPoolExecutor | None = None  # fills masks for steps launched ahead
        if tokenizer is None:
            self._build_error = "structured outputs need the model's tokenizer; this model has none"
            self._built.set()

    def start_building(self) -> None:
        """Build the grammar tokenizer on a thread of its own, if it is not built or building."""
        if self._building is None and not self._built.is_set():
            self._building = threading.Thread(target=self._build, args=(self._tokenizer, self._eos), daemon=True,
                                              name="s5serve-grammar-tokenizer")
            self._building.start()

    def wait_built(self) -> None:
        self.start_building()
        self._built.wait()

    def _build(self, tokenizer, eos: list[int]) -> None:
        try:
            from llguidance import LLTokenizer

            self._lltok = LLTokenizer(_tokenizer_json(tokenizer), n_vocab=self.vocab_size,
                                      eos_token=eos or tokenizer.eos_token_id)
        except Exception as exc:  # e.g. a slow (non-Rust) tokenizer: grammar requests are refused
            self._build_error = f"structured outputs are not available for this tokenizer: {exc}"
        finally:
            self._built.set()

    @property
    def mask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    def matcher(self, grammar: str, stop_token_ids: tuple[int, ...] = ()) -> RowGrammar:
        """A fresh matcher of `grammar` for a request with `stop_token_ids`, compiled once and then
        copied. Raises EngineError when the grammar is invalid or the model's tokenizer cannot
        take one."""
        from llguidance import LLMatcher

        proto = self._compiled.get(grammar)
        if proto is None:
            self.wait_built()
            if self._lltok is None:
                raise EngineError(self._build_error or "no grammar tokenizer", param=GRAMMAR_PARAM)
            proto = LLMatcher(self._lltok, grammar, log_level=0)
            if proto.is_error():
                raise EngineError(f"invalid grammar: {proto.get_error()}", param=GRAMMAR_PARAM)
            self._compiled[grammar] = proto
            while len(self._compiled) > self.capacity:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        eos = self._lltok.eos_token
        return RowGrammar(proto.deep_copy(), eos, tuple(t for t in stop_token_ids if t != eos and 0 <= t < self.vocab_size))

    def fill_masks_async(self, grammars: list[RowGrammar | None]) -> Future:
        """`step_masks(grammars, ())` on the grammar thread: filling a mask lets go of the GIL, so
        the caller goes on meanwhile. The matchers in `grammars` belong to that thread until the
        future is done."""
        if self._filler is None:
            self._filler = ThreadPoolExecutor(1, thread_name_prefix="s5serve-grammar-masks")
        return self._filler.submit(self.step_masks, grammars, ())

    def close(self) -> None:
        """Stop the grammar thread (once its work is done)."""
        if self._filler is not None:
            self._filler.shutdown(wait=False)
            self._filler = None

    def step_masks(self, grammars: list[RowGrammar | None], skip) -> tuple[TokenMasks | None, dict[int, str]]:
        """The masks of a step's rows that have a grammar (`grammars[j]`, rows in `skip` left
        out), and the rows whose grammar failed (an error: that row ends, the rest go on)."""
        rows = [j for j, g in enumerate(grammars) if g is not None and j not in skip]
        if not rows:
            return None, {}
        bitmask = torch.empty((len(rows), self.mask_width), dtype=torch.int32)  # [r, ceil(vocab/32)]
        failed = {}
        for i, j in enumerate(rows):
            g = grammars[j]
            g.fill_mask(bitmask[i])
            if g.error:
                failed[j] = f"grammar failed: {g.error}"
        if failed:
            keep = [i for i, j in enumerate(rows) if j not in failed]
            rows, bitmask = [rows[i] for i in keep], bitmask[keep]
        return (TokenMasks(rows, bitmask) if rows else None), failed
