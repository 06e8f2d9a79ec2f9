"""Plain data shared by the engine's parts. No behaviour beyond validation."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch


class EngineError(ValueError):
    """A request the engine refuses; nothing was changed. `code` is a stable string."""

    def __init__(self, message: str, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS token or stop string
    LENGTH = "length"  # max_tokens or the model's context reached (an append ends so, with 0 tokens)
    ABORT = "abort"  # cancelled by the client or the server
    ERROR = "error"  # this request failed; others carry on


GREEDY_BELOW = 1e-5  # temperature under which sampling is greedy


@dataclass(frozen=True)
class SamplingParams:
    # tokens to generate; 0 (a session turn only): append the input to the session, generating
    # nothing (the row is prefilled and committed)
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # same seed -> same tokens, alone or batched
    stop: tuple[str, ...] = ()  # stop strings; never emitted
    stop_token_ids: tuple[int, ...] = ()  # extra EOS-like ids
    ignore_eos: bool = False
    # structured output: an llguidance grammar (JSON, as the front end makes it from a JSON schema,
    # a regex, a choice or a Lark grammar) that every generated token must follow; the turn ends
    # (stop) when the grammar is complete. None: free text.
    grammar: str | None = None

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 0:
            raise EngineError("max_tokens must be an integer >= 0", param="max_tokens")
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t) or t < 0:
            raise EngineError("temperature must be a finite number >= 0", param="temperature")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise EngineError("top_k must be an integer >= 0", param="top_k")
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0.0 < p <= 1.0:
            raise EngineError("top_p must be in (0, 1]", param="top_p")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise EngineError("stop strings must be non-empty strings", param="stop")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise EngineError("grammar must be a non-empty string", param="response_format")

    @property
    def greedy(self) -> bool:
        """Temperatures this close to 0 sample the top token (dividing logits by them would
        overflow); as vLLM does."""
        return self.temperature < GREEDY_BELOW


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]  # new input of this turn (appended to the session's history)
    params: SamplingParams = field(default_factory=SamplingParams)
    session_id: str | None = None  # None: a stateless request on a row of its own
    owner: str | None = None  # the tenant asking; a session answers only its own owner
    # prompt_token_ids is the whole conversation: the session's stored history must be a prefix
    # of it (only the rest is fed); otherwise the session starts over with the whole prompt
    match_prefix: bool = False
    # the session's history length the input was prepared against (e.g. rendered as the increment
    # of a chat); if the history has another length when the request is added, it is refused
    # (`session_busy`): another turn committed in between. None: no check.
    expect_history_len: int | None = None

    @property
    def append_only(self) -> bool:
        """A session turn that appends its input and generates nothing."""
        return self.params.max_tokens == 0


class RequestOutput(NamedTuple):
    """What one step produced for one request (a tuple: one is made per row per step, and the
    engine process sends them as they are)."""

    request_id: str
    new_token_ids: list[int]  # tokens sampled this step (0 or 1 today)
    finished: bool
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0  # tokens prefilled for this turn (excludes reused history)
    num_cached_tokens: int = 0  # history tokens reused from the row
    num_output_tokens: int = 0  # tokens generated so far
    error: str | None = None  # set with FinishReason.ERROR


class StepLogits(NamedTuple):
    """What a model step hands back to the engine."""

    logits: torch.Tensor  # [n, vocab] float32 on the device, valid until the next step
    owners: list[int]  # for each of the n rows, the index into the step's inputs it belongs to
    greedy: torch.Tensor | None  # [2, n] `sampler.greedy_tokens` of the logits, where the step made them
