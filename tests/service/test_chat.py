"""A conversation fed to a session turn by turn (service/chat.py) is, token for token, what the
chat template renders for the whole conversation: on the embedded model's Gemma template and on
another template (ChatML-like markup with a default system prompt and no BOS), with replies that
ended at the end-of-turn token or were cut by length, and with messages appended without a
generation prompt."""

import pytest
from transformers import AutoTokenizer

from service import chat

CHATML_LIKE = (
    "{%- if messages[0]['role'] != 'system' -%}{{ '<start_of_turn>system\nYou are helpful.<end_of_turn>\n' }}{%- endif -%}"
    "{%- for m in messages -%}{{ '<start_of_turn>' + m['role'] + '\n' + m['content'] + '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>assistant\n' }}{%- endif -%}"
)


@pytest.fixture(scope="module", params=["gemma", "chatml-like"])
def tok(request, embedded_dir):
    t = AutoTokenizer.from_pretrained(str(embedded_dir))
    if request.param == "chatml-like":
        t.chat_template = CHATML_LIKE
    return t


def U(text):
    return {"role": "user", "content": text}


def A(text):
    return {"role": "assistant", "content": text}


def full(tok, messages, generation_prompt=True):
    return list(tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                        return_dict=False))


def feed(tok, history, messages, generation_prompt=True):
    history += chat.message_ids(tok, messages, len(history), history[-chat.TAIL_TOKENS:], generation_prompt)


def test_turn_by_turn_equals_the_whole_conversation(tok):
    (eot,) = chat.end_of_turn_ids(tok)
    assert tok.convert_ids_to_tokens(eot) == "<end_of_turn>"
    reply = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    history: list[int] = []
    feed(tok, history, [U("What is the capital of Italy?")])
    assert history == full(tok, [U("What is the capital of Italy?")])  # BOS (if the template has one) included
    history += reply("Rome.") + [eot]  # the model ended its turn: the stop token is in the history
    feed(tok, history, [U("And of France?")])
    conversation = [U("What is the capital of Italy?"), A("Rome."), U("And of France?")]
    assert history == full(tok, conversation)
    history += reply("Paris is the")  # cut by max_tokens: no end-of-turn token
    feed(tok, history, [U("Finish your sentence.")])
    conversation += [A("Paris is the"), U("Finish your sentence.")]
    assert history == full(tok, conversation)


def test_appended_messages_then_a_turn(tok):
    history: list[int] = []
    few_shot = [U("What is the capital of Italy?"), A("The capital of Italy is Rome.")]
    feed(tok, history, few_shot, generation_prompt=False)
    assert history == full(tok, few_shot, generation_prompt=False)
    feed(tok, history, [U("What is the capital of France?")])
    assert history == full(tok, [*few_shot, U("What is the capital of France?")])


def test_a_template_error_is_the_callers(tok):
    from service.errors import APIError

    saved, tok.chat_template = tok.chat_template, "{{ raise_exception('roles must alternate') }}"
    try:
        with pytest.raises(APIError) as err:
            chat.message_ids(tok, [U("x")], 0, [], True)
        assert err.value.status == 400 and "roles must alternate" in err.value.message
    finally:
        tok.chat_template = saved


def test_a_system_message_the_template_leaves_out_is_refused_not_dropped(embedded_dir):
    """Gemma's template puts the system text into the first user turn: a system message sent alone
    (a session's first append, a chat of one message) renders none of it, and is refused. A template
    that renders it on its own takes it."""
    from service.errors import APIError

    tok = AutoTokenizer.from_pretrained(str(embedded_dir))
    system = {"role": "system", "content": "Always answer in French."}
    assert "Always answer in French." in tok.decode(chat.message_ids(tok, [system, U("Hello")], 0, [], True))
    for generation_prompt in (False, True):
        with pytest.raises(APIError) as err:
            chat.message_ids(tok, [system], 0, [], generation_prompt)
        assert err.value.status == 400 and "system message" in err.value.message
    tok.chat_template = CHATML_LIKE
    assert tok.decode(chat.message_ids(tok, [system], 0, [], False)).endswith("Always answer in French.<end_of_turn>\n")
    # a template that places the system text with the last user message only (Mistral's): with other
    # messages beside it, its placement stands, even where a turn ends on a reply
    tok.chat_template = (
        "{%- set sys = messages[0]['content'] if messages[0]['role'] == 'system' else '' -%}"
        "{%- for m in messages if m['role'] != 'system' -%}"
        "{%- if m['role'] == 'user' -%}{{ '[INST] ' + (sys + '\n\n' if loop.last and sys else '') + m['content'] + ' [/INST]' }}"
        "{%- else -%}{{ m['content'] + '</s>' }}{%- endif -%}{%- endfor -%}")
    text = chat.render(tok, [system, U("Hello"), A("Bonjour")], False)
    assert "Always answer in French." not in text and text.endswith("Bonjour</s>")


async def test_long_turns_rendered_off_the_event_loop_equal_the_whole_conversation(tok):
    """Long messages take the front end's off-loop path (`turns.render_chat`: the template on a
    worker thread, its text in the tokenizer process): the same tokens, turn by turn."""
    from types import SimpleNamespace

    from service.turns import OFF_LOOP_CHARS, TokenizerPool, render_chat

    pool = TokenizerPool()
    await pool.start_process(tok)
    state = SimpleNamespace(tokenizer=tok, tokenizer_pool=pool)
    (eot,) = chat.end_of_turn_ids(tok)
    reply = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    ask = "Tell me about the quick brown fox and the lazy dog. " * (OFF_LOOP_CHARS // 40)
    history: list[int] = []

    async def feed_long(messages):
        history.extend(await render_chat(state, messages, len(history), history[-chat.TAIL_TOKENS:], True))

    try:
        assert pool.process_running
        await feed_long([U(ask)])
        assert history == full(tok, [U(ask)])
        history += reply("A fox.") + [eot]
        await feed_long([U(ask + " Again?")])
        assert history == full(tok, [U(ask), A("A fox."), U(ask + " Again?")])
        history += reply("The fox is")  # cut by max_tokens
        await feed_long([U("Finish it. " + ask)])
        assert history == full(tok, [U(ask), A("A fox."), U(ask + " Again?"), A("The fox is"), U("Finish it. " + ask)])
    finally:
        pool.close()
