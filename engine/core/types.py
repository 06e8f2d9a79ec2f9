"""Plain data shared by the engine's parts. No behaviour beyond validation."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from functools import cached_property
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
MAX_LOGPROBS = 20  # top logprobs a token may carry (OpenAI's limit)
MAX_REPETITION_PENALTY = 100.0  # and 1 / it the least: logits divided by less overflow float32
MAX_N = 16  # completions per request


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def fork_id(request_id: str, index: int) -> str:
    """The request id of completion `index` of a request with n > 1 (index 0 keeps the id)."""
    return request_id if index == 0 else f"{request_id}/{index}"


def prompt_id(request_id: str, index: int) -> str:
    """The request id of prompt `index` of a client's request with several prompts, each a
    request of its own (index 0 keeps the id); cancelling `request_id` ends them all."""
    return request_id if index == 0 else f"{request_id}+{index}"


def cancel_ids(request_id: str) -> tuple[str, str, str]:
    """The ids a cancel of a request id matches: the request itself, the request its completion
    forked from (`fork_id`), and the client's request it is a prompt of (`prompt_id`)."""
    base = request_id.partition("/")[0]
    return request_id, base, base.partition("+")[0]


@dataclass(frozen=True)
class SamplingParams:
    # tokens to generate; 0 (a session turn only): append the input to the session, generating
    # nothing (the row is prefilled and committed)
    max_tokens: int = 16
    # max_tokens is a default, not the client's: where the context or the KV cache leaves less
    # room, the request generates up to what fits (ending with LENGTH) instead of being refused
    max_tokens_fit: bool = False
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # vLLM's: tokens less likely than min_p x the top token's probability are cut; 0 = off
    seed: int | None = None  # same seed -> same tokens, alone or batched
    stop: tuple[str, ...] = ()  # stop strings; never emitted
    stop_token_ids: tuple[int, ...] = ()  # extra EOS-like ids
    ignore_eos: bool = False
    # None: no logprobs; k in 0..MAX_LOGPROBS: each token's logprob and the k most likely
    # tokens' (from the processed logits, after a grammar's mask: see logits_process.py)
    logprobs: int | None = None
    presence_penalty: float = 0.0  # OpenAI: subtracted once from each token generated so far
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # HF/vLLM: > 1 discourages tokens of the prompt and output, < 1 favours them
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100])
    min_tokens: int = 0  # EOS and stop tokens are banned until this many tokens are generated
    n: int = 1  # completions of one prompt: prefilled once, its row forked (stateless only)
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
        if not _is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise EngineError("min_p must be in [0, 1]", param="min_p")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise EngineError("stop strings must be non-empty strings", param="stop")
        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
            raise EngineError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}]", param="logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2.0 <= v <= 2.0:
                raise EngineError(f"{name} must be in [-2, 2]", param=name)
        r = self.repetition_penalty
        if not _is_num(r) or not 1 / MAX_REPETITION_PENALTY <= r <= MAX_REPETITION_PENALTY:
            raise EngineError(f"repetition_penalty must be in [{1 / MAX_REPETITION_PENALTY:g}, "
                              f"{MAX_REPETITION_PENALTY:g}]", param="repetition_penalty")
        for item in self.logit_bias:
            if len(item) != 2 or not _is_int(item[0]) or item[0] < 0 or not _is_num(item[1]) \
                    or not -100.0 <= item[1] <= 100.0:
                raise EngineError("logit_bias maps token ids to biases in [-100, 100]", param="logit_bias")
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise EngineError("logit_bias names a token twice", param="logit_bias")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise EngineError("min_tokens must be an integer >= 0", param="min_tokens")
        if self.min_tokens > self.max_tokens:
            raise EngineError("min_tokens must not exceed max_tokens", param="min_tokens")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise EngineError(f"n must be an integer in [1, {MAX_N}]", param="n")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise EngineError("grammar must be a non-empty string", param="response_format")

    @cached_property
    def processed(self) -> bool:
        """The row's logits are changed before sampling (penalties, biases, min_tokens): it
        leaves the step's precomputed greedy tokens."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    @cached_property
    def plain(self) -> bool:
        """Greedy with nothing else asked (no logprobs, processing or grammar): the row takes the
        step's precomputed greedy token (asked once per row per step: cached)."""
        return self.greedy and self.logprobs is None and not self.processed and self.grammar is None

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


# a token's logprob, and the ids and logprobs of the most likely tokens (most likely first)
TokenLogprobs = tuple[float, list[int], list[float]]


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
    # with SamplingParams.logprobs: per new token, (its logprob, top ids, their logprobs)
    logprobs: list[TokenLogprobs] | None = None


class StepLogits(NamedTuple):
    """What a model step hands back to the engine."""

    logits: torch.Tensor  # [n, vocab] float32 on the device, valid until the next step
    owners: list[int]  # for each of the n rows, the index into the step's inputs it belongs to
    greedy: torch.Tensor | None  # [2, n] `sampler.greedy_tokens` of the logits, where the step made them
