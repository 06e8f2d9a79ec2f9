"""What a turn's input adds to a session, as token ids: text with BOS on a session's first turn,
and chat messages rendered with the tokenizer's own chat template as the increment since the
session's last turn (so any model family with a template works, and every special token comes
from the tokenizer).

A session's history lives in the engine as tokens; a turn is prepared against its length and its
last few tokens (`Engine.session_tail`):

- first turn (empty history): text is tokenized with the tokenizer's special tokens (BOS), as
  `/v1/completions` does; messages are the whole template, as `/v1/chat/completions` renders them.
- later turns: text is appended as it is; messages are rendered after a stand-in conversation, and
  the increment is the text after the stand-in's last message content: the markup that closes
  that message (Gemma: `<end_of_turn>\\n`), then the new messages (and the generation prompt). A
  history that ends with a reply holds a prefix of that closing markup where the model stopped at
  its end-of-turn token (the engine keeps the stop token in the history) and all of it after an
  append of messages; that part is not fed again. So a conversation held by a session is fed the
  tokens `/v1/chat/completions` renders for the whole conversation, reply by reply, as long as the
  replies' tokens are what their text tokenizes to.

Non-goals: templates that change earlier turns when later ones arrive (e.g. ones that drop past
reasoning); such a session holds what was rendered when each turn was fed.
"""

from __future__ import annotations

from typing import Any

from service.errors import APIError, valid_text
from service.schemas import Message

# stand-in contents for the conversation that precedes a later turn's messages: plain words, so
# templates that trim or escape content leave them as they are
_STAND_IN = ("S5STANDINUSER", "S5STANDINREPLY")
TAIL_TOKENS = 8  # history tokens a turn is prepared against (closing markup is shorter)


def chat_messages(messages: list[Message]) -> list[dict[str, str]]:
    """Validated messages as the template takes them (`developer` is the system role)."""
    try:
        return [{"role": "system" if m.role == "developer" else m.role, "content": valid_text(m.text(), "messages")}
                for m in messages]
    except ValueError as exc:
        raise APIError(400, f"messages: {exc}", "invalid_request", "messages") from exc


def render(tok, messages: list[dict[str, Any]], generation_prompt: bool, tools: list[dict] | None = None) -> str:
    """The template's text for `messages`. System messages alone (a session's first append, a
    chat of one message) that the template leaves out are refused rather than dropped: Gemma's
    template, for one, puts the system text into the first user turn and renders nothing of a
    system message sent without one. Where other messages come with them, the template's own
    placement stands (Mistral's puts the system text into the last user message only)."""
    kw = {"tools": tools} if tools else {}
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False, **kw)
    except Exception as exc:  # template errors are the caller's (e.g. roles out of order)
        raise APIError(400, f"messages: {exc}", "invalid_request", "messages") from exc
    if all(m.get("role") == "system" for m in messages):
        for m in messages:
            content = m.get("content")
            if isinstance(content, str) and content.strip() and content.strip() not in text:
                raise APIError(400, "messages: this model's chat template renders nothing of a system message "
                               "sent without a user message; send it together with the first user message",
                               "invalid_request", "messages")
    return text


def _ids(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _closing(tok, stand_in: list[dict[str, Any]]) -> str:
    """The markup the template puts after the stand-in's last message content."""
    marker = stand_in[-1]["content"]
    text = render(tok, stand_in, False)
    return text[text.find(marker) + len(marker):]


def end_of_turn_ids(tok) -> tuple[int, ...]:
    """The token that ends a reply under this tokenizer's chat template: the special token that
    opens the markup closing an assistant message (Gemma `<end_of_turn>`, ChatML `<|im_end|>`,
    Llama 3 `<|eot_id|>`). Chat replies stop there. () without a template or such a token. The
    app works it out once, when it loads the tokenizer."""
    if tok is None:
        return ()
    eot: tuple[int, ...] = ()
    try:
        ids = _ids(tok, _closing(tok, [{"role": "user", "content": _STAND_IN[0]},
                                       {"role": "assistant", "content": _STAND_IN[1]}]))
    except APIError:  # no chat template
        ids = []
    added = getattr(tok, "added_tokens_decoder", {})
    if ids and ids[0] in added and added[ids[0]].special:
        eot = (ids[0],)
    return eot


def message_ids(tok, messages: list[dict[str, str]], history_len: int, tail: list[int],
                generation_prompt: bool, tools: list[dict] | None = None) -> list[int]:
    """Chat messages: the increment the session's history needs to hold the conversation so far
    plus `messages` (and the generation prompt, unless the turn only appends). `tools` (a whole
    conversation only): for a template that takes them."""
    text, closing = message_text(tok, messages, history_len, generation_prompt, tools)
    return increment_ids(_ids(tok, text), None if closing is None else _ids(tok, closing), tail)


def message_text(tok, messages: list[dict[str, str]], history_len: int, generation_prompt: bool,
                 tools: list[dict] | None = None) -> tuple[str, str | None]:
    """`message_ids` in two parts: the template's text for the increment, and (None for a whole
    conversation) the closing markup of the turn before it that the text begins with ("": none).
    The text is tokenized without special tokens (`increment_ids`)."""
    if history_len == 0:
        return render(tok, messages, generation_prompt, tools), None
    # the stand-in ends with the role before the new messages' first one (alternating templates)
    stand_in: list[dict[str, Any]] = [{"role": "user", "content": _STAND_IN[0]}]
    if messages[0]["role"] != "assistant":
        stand_in.append({"role": "assistant", "content": _STAND_IN[1]})
    marker = stand_in[-1]["content"]
    full = render(tok, stand_in + messages, generation_prompt)
    cut = full.find(marker)
    if cut < 0:
        raise APIError(400, "messages: this model's chat template cannot render a conversation's "
                       "later turns on their own; send the turn as text or token ids", "invalid_request", "messages")
    increment = full[cut + len(marker):]
    closing = _closing(tok, stand_in)
    return increment, closing if increment.startswith(closing) else ""


def increment_ids(ids: list[int], closing_ids: list[int] | None, tail: list[int]) -> list[int]:
    """The ids of `message_text`'s text less the start of the closing markup (its ids:
    `closing_ids`) that the history (its last tokens: `tail`) already ends with."""
    if not closing_ids or ids[: len(closing_ids)] != closing_ids:
        return ids
    held = next((n for n in range(min(len(closing_ids), len(tail)), 0, -1) if tail[-n:] == closing_ids[:n]), 0)
    return ids[held:]
