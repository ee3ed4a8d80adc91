"""Corpus generation: the target's OWN greedy answers (chat template) and its taps, in one pass.

The drafter must predict what the target will verify, so labels are target-generated tokens, and
the taps are the target's hidden states at every position of the same forward passes (no second
pass). Prompts are batched by length (left padding, little waste); logits are computed for the last
row only (the LM head is a fifth of a 135M model's step); rows that finished leave the batch; bf16
casts the weights once (AVX-512 BF16 units on this CPU, the native speed on a GPU; `dflash2-corpus-bench`).
A hybrid target (Qwen3.5: Gated DeltaNet + gated attention) batches the same way: transformers zeroes the padded
rows' inputs to its GDN layers, so their conv history and recurrent state stay zero as for an unpadded prompt (left
padding is exact up to float summation order), and finished rows leave with their conv / recurrent states
(`select_rows`: transformers' own Cache.batch_select_indices fails on a linear-attention layer).
Shards are written atomically every `shard_size` prompts, so a killed run resumes where it stopped.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from dflash2 import families
from dflash2.config import load_target_config
from dflash2.errors import Dflash2Error
from dflash2.train.corpus import save_shard, shard_path, start_or_resume, write_meta

DTYPES = ("fp32", "bf16")


def load_hf_target(target_dir: str | Path, device: str = "cpu"):
    """(model, tokenizer, target config) with transformers' own model code (the independent reference)."""
    import transformers

    tc = load_target_config(target_dir)  # checked: architecture, EOS ids, shapes
    cls = getattr(transformers, families.by_name(tc.family).hf_class)  # LlamaForCausalLM, Qwen3ForCausalLM, ...
    model = cls.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    return model, transformers.AutoTokenizer.from_pretrained(target_dir), tc


def chat_ids(tok, prompts: list[str]) -> list[list[int]]:
    out = []
    for p in prompts:
        x = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
        out.append(list(x["input_ids"]) if hasattr(x, "keys") else list(x))
    return out


def select_rows(cache, keep: torch.Tensor) -> None:
    """Keep the batch rows `keep` of a transformers cache, every layer kind: a KV layer's rows (its own
    batch_select_indices) and a linear-attention layer's conv and recurrent states (Qwen3.5's Gated DeltaNet layers:
    transformers 5's LinearAttentionLayer has no batch_select_indices, and Cache.batch_select_indices fails on it;
    the mixin's reorder_cache is the same row selection, index_select on the batch axis)."""
    try:
        from transformers.cache_utils import LinearAttentionCacheLayerMixin as Linear
    except ImportError:  # a transformers without linear-attention caches: KV layers only
        Linear = ()
    for i, layer in enumerate(cache.layers):
        linear = isinstance(layer, Linear)
        if linear:
            Linear.reorder_cache(layer, keep)  # conv + recurrent states (a hybrid layer: its KV part below)
        if hasattr(layer, "batch_select_indices"):
            layer.batch_select_indices(keep)  # KV rows (DynamicLayer's, also a hybrid layer's KV part)
        elif not linear:
            raise Dflash2Error(f"cache layer {i} ({type(layer).__name__}): expected a KV layer or a linear-attention "
                               "layer (conv / recurrent states) whose batch rows can be selected, found neither")


@torch.inference_mode()  # no autograd bookkeeping at all, as transformers' generate
def generate_batch(model, batch: list[list[int]], tap_ids, max_new: int, eos: list[int], pad: int,
                   device: str = "cpu") -> list[dict]:
    """Greedy answers of a batch of prompts + the taps of every position that went through the target,
    in the model's own dtype (bf16 corpora: the model cast once, `as_generation_dtype`); tap_ids None: the
    ids alone (records without 'taps'; the hidden states are then never kept).
    Rows that emitted EOS leave the batch, KV rows included, once an eighth of it has finished
    (transformers' generate computes finished rows to the end): a quarter of ShareGPT answers end
    before 160 tokens."""
    B, L = len(batch), max(len(x) for x in batch)
    input_ids = torch.full((B, L), pad, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for i, x in enumerate(batch):
        input_ids[i, L - len(x):] = torch.tensor(x)
        mask[i, L - len(x):] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    eos_t = torch.tensor(eos, device=device)
    want_taps = tap_ids is not None
    out = model(input_ids, attention_mask=mask, position_ids=pos, use_cache=True, output_hidden_states=want_taps,
                logits_to_keep=1)
    prompt_taps = (torch.cat([out.hidden_states[k + 1] for k in tap_ids], -1).half() if want_taps  # [B, L, n*H]
                   else torch.zeros(B, L, 0, dtype=torch.half, device=device))
    nxt = out.logits[:, -1].argmax(-1)  # [b] the last token of each row still in the batch
    cache = out.past_key_values
    gen = torch.full((B, max_new), -1, dtype=torch.long, device=device)  # [B, G] -1: never generated
    taps = prompt_taps.new_zeros(B, max(max_new - 1, 0), prompt_taps.shape[-1])  # taps of gen tokens 0..G-2
    rows = torch.arange(B, device=device)  # original row of each row in the batch
    gen[:, 0] = nxt
    for step in range(1, max_new):
        live = ~torch.isin(nxt, eos_t)
        n_live = int(live.sum())
        if n_live == 0:
            break
        if 8 * (len(live) - n_live) >= len(live):  # compact: finished rows leave the batch
            keep = live.nonzero()[:, 0]
            select_rows(cache, keep)
            mask, pos, nxt, rows, live = mask[keep], pos[keep], nxt[keep], rows[keep], live[keep]
        mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.long, device=device)], 1)
        pos = pos[:, -1:] + 1
        out = model(nxt[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True,
                    output_hidden_states=want_taps)
        cache = out.past_key_values
        nxt = torch.where(live, out.logits[:, -1].argmax(-1), nxt)  # a finished row keeps its EOS
        fed = rows[live]  # finished rows not yet compacted computed nothing of use
        gen[fed, step] = nxt[live]
        if want_taps:
            t = torch.cat([out.hidden_states[k + 1][:, 0] for k in tap_ids], -1).half()  # [b, n*H]
            taps[fed, step - 1] = t[live]
    gen_ids, gen_taps, prompt_taps = gen.cpu(), taps.cpu(), prompt_taps.cpu()
    records = []
    for i, x in enumerate(batch):
        g = [t for t in gen_ids[i].tolist() if t >= 0]
        n = next((k + 1 for k, t in enumerate(g) if t in eos), len(g))
        # taps exist for every position whose token went through the target: the prompt + g[:n-1]
        t = torch.cat([prompt_taps[i, L - len(x):], gen_taps[i, : n - 1]], 0)
        rec = {"ids": torch.tensor(x + g[:n], dtype=torch.int32), "prompt_len": len(x)}
        records.append(rec | {"taps": t.contiguous()} if want_taps else rec)
    return records


def as_generation_dtype(model, dtype: str):
    """The model generation runs: bf16 casts the weights once (measured 1.2x faster than bf16 autocast
    on this CPU, which re-casts them, and the native speed on GPUs); fp32 is the model as loaded."""
    if dtype not in DTYPES:
        raise ValueError(f"generation dtype: expected one of {DTYPES}, found {dtype!r}")
    return model.to(torch.bfloat16) if dtype == "bf16" else model


def generate_corpus(target_dir: str | Path, prompts: list[str], out_dir: str | Path, tap_ids: list[int],
                    max_new_tokens: int = 128, batch_size: int = 32, shard_size: int = 128, log=print,
                    device: str = "cpu", dtype: str = "fp32", max_prompt_tokens: int = 512) -> Path:
    """Greedy answers of the target (chat template) + tap outputs, in resumable memory-mapped shards.
    Prompts longer than `max_prompt_tokens` (chat template included) are skipped, and said so."""
    out = Path(out_dir)
    model, tok, tc = load_hf_target(target_dir, device)
    model = as_generation_dtype(model, dtype)
    ids = chat_ids(tok, prompts)
    kept = [i for i, x in enumerate(ids) if len(x) <= max_prompt_tokens]
    if len(kept) < len(ids):
        log(f"corpus: skipping {len(ids) - len(kept)} of {len(ids)} prompts longer than {max_prompt_tokens} tokens")
    meta = {"target": str(target_dir), "tap_ids": list(tap_ids), "prompts": [prompts[i] for i in kept],
            "max_new_tokens": max_new_tokens, "dtype": dtype, "generation": f"{dtype} weights",
            "shard_size": shard_size}  # what a repair needs to regenerate exactly the missing shards
    done = start_or_resume(out, meta)
    pad = json.loads((Path(target_dir) / "config.json").read_text()).get("pad_token_id") or 0
    order = sorted(kept, key=lambda i: len(ids[i]))  # similar lengths share a batch: less padding
    n_shards = (len(order) + shard_size - 1) // shard_size
    t0, made, left = time.perf_counter(), 0, n_shards - len(done)
    for s in range(n_shards):
        if s in done:
            continue
        records = []
        end = min((s + 1) * shard_size, len(order))
        for b0 in range(s * shard_size, end, batch_size):
            batch = [ids[i] for i in order[b0: min(b0 + batch_size, end)]]  # a batch never crosses a shard
            records += generate_batch(model, batch, tap_ids, max_new_tokens, list(tc.eos_token_ids), pad, device)
        save_shard(shard_path(out, s), records)
        made += sum(len(r["ids"]) - r["prompt_len"] for r in records)
        left -= 1
        rate = made / (time.perf_counter() - t0)
        eta = (time.perf_counter() - t0) / (n_shards - len(done) - left) * left
        log(f"corpus: shard {s + 1}/{n_shards}  {min((s + 1) * shard_size, len(order))}/{len(order)} prompts  "
            f"{rate:.0f} answer tok/s  ETA {eta / 60:.1f} min")
    write_meta(out, meta | {"complete": True})
    return out
