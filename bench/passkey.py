"""Passkey-retrieval prompts (a 5-digit key at a chosen depth in filler text), shared by the
recall tests and benchmarks."""

from __future__ import annotations

import random

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)


def passkey_prompt(tokenizer, target_tokens: int, depth: float, key: int) -> list[int]:
    """Token ids of a prompt of about `target_tokens` tokens hiding `key` at `depth` (0..1)."""
    head = "There is important info hidden inside a lot of irrelevant text. Find it and memorize it.\n"
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    tail = "\nWhat is the pass key? The pass key is"
    fixed = len(tokenizer(head + needle + tail)["input_ids"])
    per = len(tokenizer(FILLER, add_special_tokens=False)["input_ids"])
    n = max(1, (target_tokens - fixed) // per)
    before = round(n * depth)
    text = head + FILLER * before + needle + FILLER * (n - before) + tail
    return tokenizer(text)["input_ids"]


def passkey_cases(tokenizer, target_tokens: int, num: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed * 7919 + target_tokens)
    cases = []
    for i in range(num):
        key = rng.randrange(10000, 100000)
        depth = (i + 0.5) / num
        cases.append((passkey_prompt(tokenizer, target_tokens, depth, key), key))
    return cases
