"""Templated training prompts (`--prompts templated:N`), the option kept beside ShareGPT (the default).

Generation lives in train/generate.py, the on-disk corpus in train/corpus.py (re-exported here).
"""

from __future__ import annotations

import ast
import json
import random
import sys
from pathlib import Path

from dflash2.errors import Dflash2Error
from dflash2.train.corpus import Corpus, corpus_answers, corpus_complete, load_corpus  # noqa: F401
from dflash2.train.generate import generate_corpus  # noqa: F401

TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "machine learning", "volcanoes",
    "the immune system", "climate change", "the printing press", "electric cars", "the Roman Empire", "gravity",
    "honey bees", "the internet", "vaccines", "renewable energy", "the moon landing", "DNA", "earthquakes",
    "the stock market", "coffee", "the Olympic Games", "rainbows", "compound interest", "the human heart",
    "recycling", "the piano", "chess", "the Great Wall of China", "tea", "sleep", "exercise", "bread baking",
    "the solar system", "magnets", "the ocean tides", "dinosaurs", "the Renaissance", "bicycles", "clouds",
    "prime numbers", "fractions", "the Pythagorean theorem", "probability", "sorting algorithms", "recursion",
    "binary numbers", "databases", "encryption", "operating systems", "time management", "public speaking",
    "learning a new language", "healthy breakfast ideas", "saving money", "gardening", "camping", "friendship",
)
TEMPLATES = (
    "Explain {t} in simple terms.", "What is {t}? Answer briefly.", "Give me three facts about {t}.",
    "Write a short paragraph about {t}.", "Why is {t} important?", "List some pros and cons of {t}.",
    "How would you explain {t} to a child?", "Write a haiku about {t}.", "Summarize the history of {t}.",
    "What are common misconceptions about {t}?", "Give me a quiz question about {t} with the answer.",
    "Write a tweet about {t}.", "Compare {t} and {u}.", "Write a short story that involves {t}.",
)
CODE_TASKS = (
    "reverses a string", "checks whether a word is a palindrome", "returns the n-th Fibonacci number",
    "counts the vowels in a sentence", "finds the largest number in a list", "merges two sorted lists",
    "converts Celsius to Fahrenheit", "removes duplicates from a list", "computes the factorial of n",
    "checks whether a year is a leap year", "sums the digits of an integer", "sorts a list of tuples by the second item",
    "reads a text file and counts its lines", "returns the greatest common divisor of two numbers",
    "flattens a nested list", "capitalizes every word in a sentence",
)
LANGS = ("Python", "JavaScript", "C")


def _math_prompt(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 12)
    return rng.choice([f"What is {a} plus {b}? Explain the steps.",
                       f"A shop sells pens for {c} dollars each. How much do {a} pens cost?",
                       f"A car drives {a * c} km in {c} hours. What is its average speed?",
                       f"If I have {a} apples and give away {min(a, b)}, how many are left?",
                       f"What is {c} times {b}? Show your work."])


def _stdlib_prompts(limit: int) -> list[str]:
    """'What does <module>.<function> do?' from the docstrings of this Python's standard library."""
    root = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    out = []
    for path in sorted(root.glob("*.py"))[:400]:
        try:
            tree = ast.parse(path.read_text(errors="ignore"))
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and ast.get_docstring(node):
                out.append(f"What does the Python function {path.stem}.{node.name} do? Give an example.")
    random.Random(0).shuffle(out)
    return out[:limit]


WORD_TEMPLATES = (
    "Tell me about {w}.", "What does the word \"{w}\" mean? Give an example sentence.",
    "Write a short story about {w}.", "Give three interesting facts about {w}.", "Explain {w} to a beginner.",
    "Write a short poem about {w}.", "How is {w} used in everyday life?", "List five things related to {w}.",
    "Write a friendly email that mentions {w}.", "What is the history of {w}?", "Describe {w} in one paragraph.",
    "Give me advice about {w}.", "What are the advantages and disadvantages of {w}?",
    "Write a dialogue between two friends about {w}.", "Create a quiz question about {w} and answer it.",
)


def vocab_words(tokenizer_json: str | Path, limit: int = 5000, seed: int = 0) -> list[str]:
    """Whole English words from a byte-level BPE vocabulary ('Ġgarden' -> 'garden'): cheap topic diversity."""
    vocab = json.loads(Path(tokenizer_json).read_text())["model"]["vocab"]
    words = sorted({t[1:] for t in vocab if t.startswith("\u0120") and t[1:].isalpha() and t[1:].islower()
                    and 5 <= len(t) - 1 <= 12})
    random.Random(seed).shuffle(words)
    return words[:limit]


def make_prompts(n: int, seed: int = 0, exclude: set[str] = frozenset(),
                 words: list[str] | None = None) -> list[str]:
    """Templated instructions over fixed topics, code tasks, arithmetic, stdlib docstrings, and (when
    `words` is given) one random template per vocabulary word, the bulk of the topic diversity."""
    rng = random.Random(seed)
    pool = [t.format(t=a, u=rng.choice(TOPICS)) for a in TOPICS for t in TEMPLATES]
    pool += [rng.choice(WORD_TEMPLATES).format(w=w) for w in (words or [])]
    pool += [f"Write a {lang} function that {task}." for lang in LANGS for task in CODE_TASKS]
    pool += [_math_prompt(rng) for _ in range(200)]
    pool += _stdlib_prompts(300)
    pool = sorted(set(pool) - set(exclude))
    rng.shuffle(pool)
    return pool[:n]


def corpus_prompts(spec: str, seed: int = 0, words: list[str] | None = None) -> list[str]:
    """The training prompts a --prompts spec names; the benchmark's own prompts are never trained on."""
    from dflash2.prompts import default_prompts, parse_spec

    bench = set(default_prompts())
    if spec.split(":")[0] == "templated":
        n = spec.split(":", 1)[1] if ":" in spec else "1200"
        if not n.isdigit() or int(n) < 1:
            raise Dflash2Error(f"--prompts {spec!r}: expected 'templated[:N]' with an integer N >= 1, found {n!r}")
        return make_prompts(int(n), seed, exclude=bench, words=words)
    if spec.isdigit():  # the old meaning of --prompts (a count of templated prompts): say what it is now
        raise Dflash2Error(f"--prompts {spec!r}: expected 'sharegpt[:N]', 'templated[:N]' or a prompt file, "
                           f"found a bare number (did you mean 'templated:{spec}'?)")
    if spec.startswith("sharegpt") and ":eval" in spec:
        raise Dflash2Error(f"--prompts {spec!r}: ShareGPT conversations >= 15,000 are reserved for evaluation")
    return [p for p in parse_spec(spec, default_split="train", log=print) if p not in bench]
