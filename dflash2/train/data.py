"""Training data for a drafter: the target's OWN greedy answers to a prompt set, with the taps.

The drafter must predict what the target will verify, so labels are target-generated tokens.
Generation is batched (left padding) and keeps the tap layers' outputs of every position from
the same forward passes, so no second pass over the corpus is needed. Shards are safetensors.
"""

from __future__ import annotations

import ast
import json
import random
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash2.config import load_target_config
from dflash2.errors import Dflash2Error

META = "corpus.json"

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


@torch.no_grad()
def generate_corpus(target_dir: str | Path, prompts: list[str], out_dir: str | Path, tap_ids: list[int],
                    max_new_tokens: int = 128, batch_size: int = 32, shard_size: int = 128, log=print) -> Path:
    """Greedy answers of the target (chat template) + tap outputs, sharded as safetensors."""
    from transformers import AutoTokenizer, LlamaForCausalLM, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"target": str(target_dir), "tap_ids": list(tap_ids), "prompts": list(prompts),
            "max_new_tokens": max_new_tokens}
    _start_or_resume(out, meta)  # shards are resumed by index: only valid for the same prompts and taps
    tc = load_target_config(target_dir)  # checked: architecture, EOS ids, shapes
    cls = Qwen3ForCausalLM if tc.family == "qwen3" else LlamaForCausalLM
    model = cls.from_pretrained(target_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    pad = json.loads((Path(target_dir) / "config.json").read_text()).get("pad_token_id") or 0
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]
    ids = [list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x) for x in ids]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # similar lengths share a batch: less padding
    done = {int(p.stem.split("-")[1]) for p in out.glob("shard-*.safetensors")}
    for s0 in range(0, len(order), shard_size):
        if s0 // shard_size in done:
            continue
        records = []
        for b0 in range(s0, min(s0 + shard_size, len(order)), batch_size):
            batch = [ids[i] for i in order[b0: b0 + batch_size]]
            records += _generate_batch(model, batch, tap_ids, max_new_tokens, list(tc.eos_token_ids), pad)
            log(f"corpus: {b0 + len(batch)}/{len(ids)} prompts")
        _save_shard(out / f"shard-{s0 // shard_size:04d}.safetensors", records)
    (out / META).write_text(json.dumps(meta | {"complete": True}, indent=1))
    return out


def _start_or_resume(out: Path, meta: dict) -> None:
    path = out / META
    if path.is_file():
        old = json.loads(path.read_text())
        diff = [k for k in ("tap_ids", "prompts", "max_new_tokens") if old.get(k) != meta[k]]
        if diff:
            raise Dflash2Error(f"{path}: this corpus was generated with other {', '.join(diff)} "
                               f"(tap_ids {old.get('tap_ids')} vs {meta['tap_ids']}, {len(old.get('prompts', []))} vs "
                               f"{len(meta['prompts'])} prompts); use another folder or delete it")
        return
    path.write_text(json.dumps(meta | {"complete": False}, indent=1))


def corpus_complete(folder: str | Path) -> bool:
    path = Path(folder) / META
    return path.is_file() and json.loads(path.read_text()).get("complete", True)


def _generate_batch(model, batch: list[list[int]], tap_ids, max_new, eos, pad) -> list[dict]:
    B, L = len(batch), max(len(x) for x in batch)
    input_ids = torch.full((B, L), pad, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for i, x in enumerate(batch):
        input_ids[i, L - len(x):] = torch.tensor(x)
        mask[i, L - len(x):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids, attention_mask=mask, position_ids=pos, use_cache=True, output_hidden_states=True)
    taps = [torch.cat([out.hidden_states[k + 1][:, -1:] for k in tap_ids], -1)]  # per step [B, 1, n*H]
    prompt_taps = torch.cat([out.hidden_states[k + 1] for k in tap_ids], -1).half()  # [B, L, n*H]
    nxt = out.logits[:, -1].argmax(-1)
    gen, alive = [nxt], torch.ones(B, dtype=torch.bool)
    cache = out.past_key_values
    for _ in range(max_new - 1):
        alive &= ~torch.isin(nxt, torch.tensor(eos))
        if not alive.any():
            break
        mask = torch.cat([mask, torch.ones(B, 1, dtype=torch.long)], 1)
        pos = pos[:, -1:] + 1
        out = model(nxt[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                    output_hidden_states=True)
        cache = out.past_key_values
        taps.append(torch.cat([out.hidden_states[k + 1] for k in tap_ids], -1))
        nxt = out.logits[:, -1].argmax(-1)
        gen.append(nxt)
    gen_ids = torch.stack(gen, 1)  # [B, G]
    gen_taps = torch.cat(taps[1:], 1).half() if len(taps) > 1 else prompt_taps[:, :0]  # taps of gen tokens 0..G-2
    records = []
    for i, x in enumerate(batch):
        g = gen_ids[i].tolist()
        n = next((k + 1 for k, t in enumerate(g) if t in eos), len(g))
        seq = x + g[:n]
        # taps exist for every position whose token went through the target: the prompt + g[:n-1]
        t = torch.cat([prompt_taps[i, L - len(x):], gen_taps[i, : n - 1]], 0)
        records.append({"ids": torch.tensor(seq, dtype=torch.int32), "taps": t.contiguous(),
                        "prompt_len": len(x)})
    return records


def _save_shard(path: Path, records: list[dict]) -> None:
    tensors = {}
    for j, r in enumerate(records):
        tensors[f"{j}.ids"], tensors[f"{j}.taps"] = r["ids"], r["taps"]
        tensors[f"{j}.prompt_len"] = torch.tensor([r["prompt_len"]], dtype=torch.int32)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    tmp.rename(path)


def corpus_answers(folder: str | Path) -> list[list[int]]:
    """The answers (target-generated ids after each prompt) of a complete corpus, without its taps."""
    from safetensors import safe_open

    _check_complete(folder)
    answers = []
    for shard in sorted(Path(folder).glob("shard-*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for j in range(len({k.split(".")[0] for k in f.keys()})):
                answers.append(f.get_tensor(f"{j}.ids")[int(f.get_tensor(f"{j}.prompt_len")[0]):].tolist())
    return answers


def _check_complete(folder: str | Path) -> None:
    path = Path(folder) / META
    if not corpus_complete(folder):
        raise Dflash2Error(f"{path}: expected a complete corpus, found "
                           f"{'a partial one (rerun its generation to finish it)' if path.is_file() else 'none'}")


def load_corpus(folder: str | Path, tap_ids: list[int] | None = None) -> list[dict]:
    """The records of a complete corpus; with `tap_ids`, checks they are the taps it was made with."""
    path = Path(folder) / META
    _check_complete(folder)
    made_with = json.loads(path.read_text())["tap_ids"]
    if tap_ids is not None and list(made_with) != list(tap_ids):
        raise Dflash2Error(f"{path}: tap_ids expected {list(tap_ids)} (--taps), found {made_with}")
    records = []
    for shard in sorted(Path(folder).glob("shard-*.safetensors")):
        t = load_file(str(shard))
        for j in range(len({k.split(".")[0] for k in t})):
            records.append({"ids": t[f"{j}.ids"].long(), "taps": t[f"{j}.taps"],
                            "prompt_len": int(t[f"{j}.prompt_len"][0])})
    return records
