"""dflash2-corpus-bench: corpus generation tokens/s against transformers' own `generate`, same run.

The same prompts (chat template), batch and answer length for each contender, interleaved round by
round so a noisy shared machine slows them alike: transformers' `generate` (greedy) in fp32, under
bf16 autocast and on the model cast to bf16, and dflash2's corpus generator (which also captures the
taps) in fp32 and bf16 (its bf16 casts the model once). Tokens counted are answer tokens up to and
including EOS. Prints a table and writes JSON.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from dflash2.bench.ratio import describe_ratio


def _hf_generate(model, batch, max_new, eos, pad, autocast: bool = False):
    B, L = len(batch), max(len(x) for x in batch)
    ids = torch.full((B, L), pad, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for i, x in enumerate(batch):
        ids[i, L - len(x):], mask[i, L - len(x):] = torch.tensor(x), 1
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                             pad_token_id=pad, eos_token_id=eos, min_new_tokens=1)
    return [row.tolist()[: _answer_len(row.tolist(), eos)] for row in out[:, L:]]


def _answer_len(g: list[int], eos) -> int:
    return next((k + 1 for k, t in enumerate(g) if t in eos), len(g))


def _ours(model, batch, max_new, eos, pad, taps):
    from dflash2.train.generate import generate_batch

    recs = generate_batch(model, batch, taps, max_new, eos, pad, "cpu")
    return [r["ids"][r["prompt_len"]:].tolist() for r in recs]


def bench(target: Path, prompts: list[str], batch: int, max_new: int, repeats: int, taps: list[int], log=print) -> dict:
    import copy

    from dflash2.train.generate import as_generation_dtype, chat_ids, load_hf_target

    model, tok, tc = load_hf_target(target)
    bf16 = as_generation_dtype(copy.deepcopy(model), "bf16")
    pad = json.loads((target / "config.json").read_text()).get("pad_token_id") or 0
    ids = sorted(chat_ids(tok, prompts), key=len)[:batch]
    eos = list(tc.eos_token_ids)
    runs = {"transformers generate fp32": lambda: _hf_generate(model, ids, max_new, eos, pad),
            "transformers generate bf16 autocast": lambda: _hf_generate(model, ids, max_new, eos, pad, autocast=True),
            "transformers generate bf16 weights": lambda: _hf_generate(bf16, ids, max_new, eos, pad),
            "dflash2 corpus fp32 (+taps)": lambda: _ours(model, ids, max_new, eos, pad, taps),
            "dflash2 corpus bf16 (+taps)": lambda: _ours(bf16, ids, max_new, eos, pad, taps)}
    rates, answers = {k: [] for k in runs}, {}
    for r in range(repeats):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            answers[name] = fn()
            n = sum(map(len, answers[name]))
            rates[name].append(n / (time.perf_counter() - t0))
            log(f"round {r + 1}/{repeats}  {name}: {rates[name][-1]:.0f} tok/s ({n} tokens)")
    med = {k: statistics.median(v) for k, v in rates.items()}
    hf = max((k for k in med if k.startswith("transformers")), key=med.get)
    ours = max((k for k in med if k.startswith("dflash2")), key=med.get)
    best_hf, best_ours = med[hf], med[ours]
    return {"target": str(target), "batch": len(ids), "max_new_tokens": max_new, "repeats": repeats,
            "threads": torch.get_num_threads(), "tok_per_s": med, "runs": rates,
            "ours_vs_best_transformers": best_ours / best_hf,
            # the same two contenders' ratio once per round (each round runs both, in turns): its spread
            "ours_vs_best_transformers_samples": [a / b for a, b in zip(rates[ours], rates[hf])],
            # an independent check of the generator: fp32 greedy answers identical to transformers' generate
            "same_answers_fp32": answers["transformers generate fp32"] == answers["dflash2 corpus fp32 (+taps)"],
            "same_answers_bf16": answers["transformers generate bf16 weights"] == answers["dflash2 corpus bf16 (+taps)"]}


def table(r: dict) -> str:
    rows = [f"| {k} | {v:.0f} |" for k, v in r["tok_per_s"].items()]
    return "\n".join([f"batch {r['batch']}, {r['max_new_tokens']} new tokens, {r['threads']} thread(s), "
                      f"median of {r['repeats']} interleaved rounds", "| generator | answer tok/s |", "| --- | --- |",
                      *rows, "dflash2 (best) / transformers (best): " + describe_ratio(
                          r.get("ours_vs_best_transformers_samples", []), r["ours_vs_best_transformers"], "rounds"),
                      f"fp32 answers identical to transformers' generate: {r['same_answers_fp32']}",
                      f"bf16 answers identical to transformers' generate on the bf16 model: {r['same_answers_bf16']}"])
