"""Prompts for the drift tests: the trained model's own kind of text, and three other kinds."""

from __future__ import annotations

import random

# Another language (German prose): a different alphabet of habits from Python source.
GERMAN = (
    "Die Würde des Menschen ist unantastbar. Sie zu achten und zu schützen ist Verpflichtung aller "
    "staatlichen Gewalt. Das Deutsche Volk bekennt sich darum zu unverletzlichen und unveräußerlichen "
    "Menschenrechten als Grundlage jeder menschlichen Gemeinschaft, des Friedens und der Gerechtigkeit."
)


def in_distribution(test_text: str, n: int = 16, chars: int = 320) -> list[str]:
    """Consecutive slices of the held-out split (what the reference was measured on)."""
    step = max(chars, (len(test_text) - chars) // n)
    return [test_text[i : i + chars] for i in range(0, len(test_text) - chars, step)][:n]


def out_of_distribution(test_text: str, tokenizer, n: int = 8, seed: int = 0) -> dict[str, list]:
    """Other language, random characters, and held-out text with its tokens shuffled (token ids)."""
    rng = random.Random(seed)
    shuffled = []
    for text in in_distribution(test_text, n):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        rng.shuffle(ids)
        shuffled.append(ids)
    words = GERMAN.split()
    return {
        "german": [" ".join(words[i:] + words[:i]) for i in range(0, len(words), max(1, len(words) // n))][
            :n
        ],
        "random": ["".join(chr(rng.randrange(32, 0x250)) for _ in range(100)) for _ in range(n)],
        "shuffled": shuffled,
    }
