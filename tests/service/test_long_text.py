"""Long texts are tokenized off the event loop through the Rust tokenizer directly
(`turns.long_text_ids`); the ids are the ones `tokenizer(text)` gives, with and without the
special tokens (a session's later turns go without BOS)."""

import pytest
from transformers import AutoTokenizer

from service.turns import OFF_LOOP_CHARS, long_text_ids

TEXTS = [
    "The quick brown fox jumps over the lazy dog while counting sheep. " * 400,
    "  leading spaces,\ttabs,\n\nblank lines and trailing spaces   " * 120,
    "Ünïcödé — 漢字かな交じり文, emoji 🦊🐑, and <start_of_turn> as plain text. " * 150,
    "x" * (OFF_LOOP_CHARS + 1),
]


@pytest.fixture(scope="module")
def tok(embedded_dir):
    return AutoTokenizer.from_pretrained(str(embedded_dir))


@pytest.mark.parametrize("special", [True, False])
@pytest.mark.parametrize("text", TEXTS, ids=["repeated", "whitespace", "unicode", "one-run"])
def test_long_text_ids_equal_the_tokenizers(tok, text, special):
    assert len(text) > OFF_LOOP_CHARS
    want = tok(text, add_special_tokens=special)["input_ids"]
    got = long_text_ids(tok, text, special)
    assert got == want
    assert (got[0] == tok.bos_token_id) == special
