"""Train a DFlash2 drafter (and its candidate selector) for a target, on the CPU at small scale.

Recipe (docs/algorithm.md section 4): the target's embedding and LM head are frozen; each training
sequence is a target-generated answer with the target's taps; random anchors a (in the answer)
give blocks [tok_a, MASK x S] that see the context rows < a and predict tok_{a+1..a+S};
loss = depth-decayed cross-entropy (weight exp(-k/gamma)) + a K-way cross-entropy for the
selector with the TRUE previous token as predecessor, counted where the true token is in the top-K.
The losses and the offline acceptance are dflash2/train/objective.py; this module runs the loop, saves and
resumes. Checkpoints are safetensors (weights and optimizer moments), never pickle, each written to a temporary
name and renamed: a full disk (a DiskFullError naming the file, dflash2.disk) leaves the last whole save, and
the error says which step that is.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash2.errors import Dflash2Error
from dflash2.train import distributed, state
from dflash2.disk import DiskFullError, safetensors_bytes, write_text, writing
from dflash2.train.state import STATE  # noqa: F401 (the checkpoint folder's state subfolder)
from dflash2.train.objective import Teacher, after_misses, block_forward, losses, offline_acceptance
from dflash2.train.pool import RecordPool
from dflash2.train.init import drafter_config_dict, init_drafter
from dflash2.train.warm_start import warm_start
from dflash2.reference.drafter import Drafter
from dflash2.reference.load import load_target


@dataclass
class TrainConfig:
    layers: int = 1
    block_size: int = 8
    top_k: int = 8
    rank: int = 64
    steps: int = 1000
    lr: float = 5e-4
    warmup: int = 50
    seqs_per_step: int = 6
    anchors_per_seq: int = 16
    gamma: float = 4.0  # ~4 for B=8, ~7 for B=16
    selector_weight: float = 1.0
    mask_token_id: int = 0
    tap_ids: tuple[int, ...] = ()
    seed: int = 0
    eval_every: int = 100
    save_every: int = 100
    eval_seqs: int = 48
    init_from: str = "last"  # target layers copied into the drafter: "last" | "first" (measured worse)
    learn_multiplier: bool = True  # learn output_multiplier (unary vs pair balance) from the selector loss
    # the draft loss's softmax: "shortlist" = the corpus's tokens + random negatives (every label inside); "draft" =
    # the draft vocabulary the exported head will cover (labels outside it are dropped: it can never draft them)
    loss_vocab: str = "shortlist"
    # where a sequence's training blocks sit: "uniform" over its answer, or "after-miss" = one step of the speculative
    # loop from uniform anchors with the current drafter (a + accepted + 1), where the loop's own blocks are
    anchors_at: str = "uniform"
    negatives: int = 2048
    kd_weight: float = 0.0  # + kd_weight * KL(target || drafter) on draft rows (soft labels, see Teacher)


def _set_multiplier(d: Drafter, folder: Path | None, value: float) -> None:
    """Write the learned unary scale into the drafter's config (object and, unless `folder` is None, config.json)."""
    import dataclasses

    d.config = dataclasses.replace(d.config, output_multiplier=value)
    if folder is None:
        return
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg["dflash_config"]["output_multiplier"] = value
    write_text(path, json.dumps(cfg, indent=2), "the drafter's config (its learned output multiplier)")


@contextlib.contextmanager
def _saved_at(out: Path, saved: list):
    """A DiskFullError in the block says what is left: the last whole save (`saved[0]`, the step a rerun resumes
    from) or nothing trained yet."""
    try:
        yield
    except DiskFullError as e:
        e.after = e.after or ("no training state was saved yet: free some space and run the same command again"
                              if saved[0] is None else f"the training state saved at step {saved[0]} is whole ({out}): "
                              f"free some space and rerun the same command to resume from step {saved[0]}")
        raise


def save_drafter(d: Drafter, folder: Path, dtype=torch.float16, max_shard_mb: float | None = None) -> None:
    """fp16 safetensors; with `max_shard_mb`, sharded (model-0000N-of-0000M.safetensors + the standard
    index) so no file exceeds that size (files travelling back from a GPU machine are capped).
    Every file is written under a temporary name first and renamed once all are whole: a kill or a full disk
    (DiskFullError) mid-save keeps the last save's files, and no half file stands under a final name."""
    state_ = {k: v.detach().to(dtype).cpu().contiguous() for k, v in d.state_dict().items()
              if not k.startswith("train_")}
    limit = None if max_shard_mb is None else int(max_shard_mb * 2**20)
    total = sum(v.numel() * v.element_size() for v in state_.values())
    if limit is None or total <= limit:
        _save_weights(folder, {"model.safetensors": state_}, "the drafter's fp16 weights")
        return
    shards, cur, size = [], {}, 0
    for k, v in state_.items():
        n = v.numel() * v.element_size()
        if n > limit:
            raise Dflash2Error(f"tensor {k} is {n / 2**20:.1f} MB, over the {max_shard_mb} MB shard limit")
        if cur and size + n > limit:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = v, size + n
    shards.append(cur)
    files = {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": sh for i, sh in enumerate(shards)}
    _save_weights(folder, files, "the drafter's fp16 weights")
    index = {"metadata": {"total_size": total}, "weight_map": {k: name for name, sh in files.items() for k in sh}}
    write_text(folder / "model.safetensors.index.json", json.dumps(index, indent=1), "the drafter's weight index")


def _save_weights(folder: Path, files: dict[str, dict[str, torch.Tensor]], what: str) -> None:
    """Each file written to a temporary name, then all renamed: the previous files stay until every new one is
    whole."""
    tmps = {name: folder / f"{name}.tmp-{os.getpid()}" for name in files}
    try:
        for n, (name, tensors) in enumerate(files.items()):
            meta = {"format": "pt"}
            part = f" (file {n + 1} of {len(files)})" if len(files) > 1 else ""
            with writing(folder / name, what + part, safetensors_bytes(tensors, meta)):
                try:
                    save_file(tensors, str(tmps[name]), metadata=meta)
                except BaseException:
                    tmps[name].unlink(missing_ok=True)  # the free space is measured with the half file gone
                    raise
            os.chmod(tmps[name], 0o644)  # safetensors writes 0600: a drafter is meant to be shared
        for name, tmp in tmps.items():
            os.replace(tmp, folder / name)
    finally:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)


class _StepLoss(torch.nn.Module):
    """One micro-batch's loss as a module call, so torch's DDP can hook its gradient all-reduce."""

    def __init__(self, d: Drafter, c: TrainConfig, teacher: Teacher | None):
        super().__init__()
        self.d, self.c, self.teacher = d, c, teacher

    def forward(self, items: list[tuple[dict, list[int]]], vocab, log_mult, device: str):
        c, total, dl_sum, sl_sum, tokens = self.c, 0.0, 0.0, 0.0, 0
        for rec, anchors in items:
            rec = {"ids": rec["ids"].to(device), "taps": rec["taps"].to(device), "prompt_len": rec["prompt_len"]}
            hidden, labels, anchor_ids = block_forward(self.d, rec, anchors)
            soft = None
            if self.teacher is not None:  # row k of the block at anchor a predicts token a+k: target position a+k-1
                rows = torch.tensor(anchors)[:, None] + torch.arange(labels.shape[1])[None, :]  # [nb, S]
                soft = self.teacher.logits(rec, rows, vocab)
            dl, sl = losses(self.d, hidden, labels, anchor_ids, c.gamma, c.top_k, vocab, log_mult.exp(), soft,
                            c.kd_weight)
            total = total + (dl + c.selector_weight * sl) / c.seqs_per_step
            dl_sum, sl_sum, tokens = dl_sum + dl.item(), sl_sum + sl.item(), tokens + int((labels >= 0).sum())
        return total, dl_sum, sl_sum, tokens


def train(target_dir: str | Path, out_dir: str | Path, records, c: TrainConfig,
          eval_records: list | None = None, log_fn=print, device: str = "cpu", dtype: str = "fp32",
          grad_accum: int = 1, init_weights: str | Path | None = None, max_shard_mb: float | None = None,
          minutes: float | None = None, draft_ids: list[int] | None = None,
          out_files: dict[str, str] | None = None) -> dict:
    """Train (or resume) a drafter into `out_dir`. Under torchrun every rank calls this with the same
    arguments; rank 0 alone writes. `records`: a sequence of corpus records (lazy taps are fine) or an
    `IdStream` (train/live.py). `minutes`: stop (saved, resumable) after the step that passes this budget.

    `draft_ids`: the draft vocabulary (ascending ids) when c.loss_vocab == "draft"; the held-out evaluation then
    drafts over it too, as the exported drafter will. `out_files`: name -> text written into `out_dir` beside
    config.json once the warm start and the resume checks passed (a refused run writes nothing).

    Resumes from OUT/train_state/ (exactly) or, on a machine without it, from the compact state in OUT
    (progress.json + the fp16 drafter: AdamW's moments rebuilt during a fresh warm-up), whichever is further."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if c.loss_vocab not in ("shortlist", "draft"):
        raise Dflash2Error(f"loss_vocab: expected 'shortlist' or 'draft', found {c.loss_vocab!r}")
    if c.anchors_at not in ("uniform", "after-miss"):
        raise Dflash2Error(f"anchors_at: expected 'uniform' or 'after-miss', found {c.anchors_at!r}")
    if c.loss_vocab == "draft" and not draft_ids:
        raise Dflash2Error("loss_vocab 'draft': expected the draft vocabulary's ids (--draft-vocab N), found none")
    world = distributed.join(device)
    dev = world.device
    log = log_fn if world.main else (lambda m: None)
    out = Path(out_dir)
    pool = records if hasattr(records, "draw") else RecordPool(records)
    compact, stale = _read_compact(out)  # checked before any write
    torch.manual_seed(c.seed)
    rng = random.Random(c.seed)
    target = load_target(target_dir, ())
    cfg_dict = drafter_config_dict(target_dir, c)
    d = init_drafter(target, cfg_dict, c.init_from)  # the same fresh drafter on every rank (init is seeded)
    teacher = Teacher(target, c.tap_ids) if c.kd_weight > 0 else None  # keeps the layers after the last tap
    del target.layers  # otherwise only the embedding / LM head (buffers of the drafter) are needed
    log_mult = torch.nn.Parameter(torch.zeros(()), requires_grad=c.learn_multiplier)
    d.register_parameter("train_log_multiplier", log_mult)  # saved in train_state, not in the checkpoint
    if init_weights:
        warm_start(d, Path(init_weights), log_mult)
        log(f"initialised from {init_weights}")
    if c.loss_vocab == "draft":
        d.set_draft_vocab(draft_ids)  # what evaluation drafts over (the loss indexes the head itself)
    d.to(dev)
    params = [p for p in d.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=c.lr, weight_decay=0.0, betas=(0.9, 0.95))
    step, history, warm_from, seen = 0, [], 0, {"answer_tokens": 0, "blocks": 0, "records": 0}
    full = state.step_of(out) if state.has_state(out) else None  # the state checked like a manifest
    if full is not None:
        state.check_same_drafter(state.path(out), state.read_meta(out)["config"], asdict(c))
    if compact is not None:
        state.check_same_drafter(out / state.PROGRESS, compact["config"], asdict(c))
    if full is not None and (compact is None or full >= compact["step"]):
        step, history, py_state, extra = state.load(out, d, opt)
        rng.setstate(py_state)
        pool.restore(extra.get("stream"), str(state.path(out)))
        seen |= extra.get("seen", {})
        log(f"resumed at step {step}" + (f" (the compact state was left stale by a kill between its writes: {stale}; "
                                         "this run rewrites it)" if stale else ""))
    elif compact is not None:
        step, history, warm_from = compact["step"], compact["history"], compact["step"]
        _load_compact(d, out, compact, c, log_mult)
        pool.restore(compact["extra"].get("stream"), str(out / state.PROGRESS))
        seen |= compact["extra"].get("seen", {})
        rng.seed(f"{c.seed}/{step}")
        torch.manual_seed(c.seed + step)
        log(f"resumed at step {step} from the compact state ({out / state.PROGRESS} + {compact['weights']['file']}, "
            f"fp16; AdamW's moments rebuilt during a {c.warmup}-step warm-up)")
    saved = [step if full is not None or compact is not None else None]  # the last whole save a rerun resumes from
    if world.main:  # every check passed: the run's folder is written from here on
        with _saved_at(out, saved):
            with writing(out, "the drafter folder"):
                out.mkdir(parents=True, exist_ok=True)
            for name, text in (out_files or {}).items():
                write_text(out / name, text, f"{name} (fixed when the run starts)")
            write_text(out / "config.json", json.dumps(cfg_dict, indent=2), "the drafter's config")
            if step or init_weights:  # with the learned unary scale: otherwise the folder pairs the last saved
                # weights with no scale until the next save (a commit made mid-run, or a run killed before its next)
                _set_multiplier(d, out, float(log_mult.detach().exp()))
    distributed.barrier(world)
    if teacher is not None:
        teacher.to(dev, head=d.head_weight)  # its layers, final norm and RoPE frequencies; the drafter's LM head
    if eval_records is None and hasattr(pool, "held_out"):
        eval_records = pool.held_out(c.eval_seqs)
    module = _StepLoss(d, c, teacher)
    ddp = DDP(module, broadcast_buffers=False) if world.size > 1 else module
    t0, step0, tok_total, blocks_run = time.perf_counter(), step, 0, 0
    corpus_vocab = pool.vocab()
    fixed_vocab = torch.tensor(draft_ids, dtype=torch.long, device=dev) if c.loss_vocab == "draft" else None
    V = d.config.vocab_size
    autocast = torch.autocast(dev.split(":")[0], dtype=torch.bfloat16, enabled=dtype == "bf16")
    budget_hit = False

    def evaluate() -> None:
        d.eval()  # config.json changes with the saves only: it pairs with the weights beside it
        _set_multiplier(d, None, float(log_mult.detach().exp()))
        with torch.device(dev):
            acc = offline_acceptance(d, [_on(r, dev) for r in eval_records[: c.eval_seqs]])
        history.append({"step": step, **acc, "seen": dict(seen)})
        log(f"eval @ {step}: tau selector {acc['selector']:.3f}  top1 {acc['top1']:.3f}  "
            f"oracle {acc['oracle']:.3f}  ({acc['blocks']} held-out blocks; {seen['answer_tokens']:,} answer "
            "tokens seen)")

    if world.main and eval_records and step == 0 and not history:
        evaluate()  # the curve starts where the warm start (or the init) stands
    while step < c.steps and not budget_hit:
        lr = c.lr * min(1.0, (step - warm_from + 1) / c.warmup) * 0.5 * (1 + math.cos(math.pi * step / c.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        d.train()
        opt.zero_grad(set_to_none=True)
        vocab = fixed_vocab
        if c.loss_vocab == "shortlist":
            negatives = torch.randint(0, V, (c.negatives,))  # torch's generator: identical on every rank
            vocab = torch.unique(torch.cat([corpus_vocab, negatives, torch.tensor([c.mask_token_id])])).to(dev)
        batch = pool.draw(c, rng)
        if c.anchors_at == "after-miss":  # the same on every rank: same weights, same draw
            d.eval()
            with torch.device(dev), autocast:  # taps read once (a live record computes them on every read)
                batch = [(r, moved) for r, anchors in ((_on(rec, dev), anchors) for rec, anchors in batch)
                         if (moved := after_misses(d, r, anchors))]
            d.train()
        seen["records"] += len(batch)
        blocks_run += sum(len(anchors) for _, anchors in batch)
        seen["blocks"] += sum(len(anchors) for _, anchors in batch)
        seen["answer_tokens"] += sum(len(r["ids"]) - r["prompt_len"] for r, _ in batch)
        mine = distributed.share(batch, world)
        micro = [mine[i::grad_accum] for i in range(grad_accum)]
        dl_sum = sl_sum = tokens = 0.0
        for i, items in enumerate(micro):
            last = i == len(micro) - 1
            with ddp.no_sync() if world.size > 1 and not last else contextlib.nullcontext():
                with torch.device(dev), autocast:
                    loss, dl, sl, n = ddp(items, vocab, log_mult, dev)
                if torch.is_tensor(loss):
                    (loss * world.size).backward()  # DDP averages over ranks; the global batch is a sum
                elif world.size > 1:  # no sequence here: still take part in the all-reduce, with zero grads
                    (sum(p.sum() for p in params) * 0.0).backward()
            dl_sum, sl_sum, tokens = dl_sum + dl, sl_sum + sl, tokens + n
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        dl_sum, sl_sum, tokens = distributed.sum_across([dl_sum, sl_sum, tokens], world)
        tok_total += tokens
        el = time.perf_counter() - t0
        budget_hit = minutes is not None and el > minutes * 60
        if step % 10 == 0 or step == c.steps or budget_hit:
            rate = el / max(step - step0, 1)
            bar = "#" * int(20 * step / c.steps)
            log(f"step {step}/{c.steps} [{bar:<20}] draft CE {dl_sum / c.seqs_per_step:.3f}  selector CE "
                f"{sl_sum / c.seqs_per_step:.3f}  {tok_total / el:,.0f} label tok/s  "
                f"{blocks_run / el:.1f} blocks/s  "
                f"lr {lr:.2e}  {rate:.2f} s/step{pool.timing()}  ETA {(c.steps - step) * rate / 60:.1f} min")
        if world.main and eval_records and (step % c.eval_every == 0 or step == c.steps or budget_hit):
            evaluate()
        if world.main and (step % c.save_every == 0 or step == c.steps or budget_hit):
            extra = {"stream": pool.state(), "seen": dict(seen)}
            with _saved_at(out, saved):
                state.save(out, d, opt, step, asdict(c), history, rng.getstate(), extra)
                saved[0] = step
                if max_shard_mb is None:  # a sharded drafter travels back whole (gpu_train.sh); no compact state
                    _save_compact(d, out, step, c, history, extra, float(log_mult.detach().exp()))
        distributed.barrier(world)
    if world.main:
        d.eval()
        with _saved_at(out, saved):
            if max_shard_mb is None:  # progress.json always names the weights beside it (also when no step ran)
                _save_compact(d, out, step, c, history, {"stream": pool.state(), "seen": dict(seen)},
                              float(log_mult.detach().exp()))
            else:
                _set_multiplier(d, out, float(log_mult.detach().exp()))
                save_drafter(d, out, max_shard_mb=max_shard_mb)
                write_text(out / "training.json", json.dumps({"config": asdict(c), "history": history}, indent=1),
                       "the training history")
        if budget_hit and step < c.steps:
            log(f"stopped at step {step}/{c.steps}: the {minutes:g}-minute budget is spent; the same command "
                "continues from here (on another machine: from the committed progress.json + model.safetensors)")
    distributed.barrier(world)
    distributed.leave(world)
    return {"history": history, "step": step, "seen": seen}


def _read_compact(out: Path) -> tuple[dict | None, str | None]:
    """progress.json when it is sound; (None, why) when a kill between its writes left it naming other weights
    and train_state/ is there to resume from exactly; with no full state the mismatch is the error."""
    if not (out / state.PROGRESS).is_file():
        return None, None
    try:
        return state.load_progress(out), None
    except Dflash2Error as e:
        if state.has_state(out) and state.step_of(out) is not None:
            return None, str(e)
        raise


def _save_compact(d: Drafter, out: Path, step: int, c: TrainConfig, history: list, extra: dict, mult: float) -> None:
    """What a fresh machine continues from: the fp16 drafter, its config (learned multiplier), training.json
    and, last, progress.json naming the weights' sha256 (a kill between the writes is detected on resume)."""
    _set_multiplier(d, out, mult)
    save_drafter(d, out, max_shard_mb=None)  # one file: progress.json names it
    write_text(out / "training.json", json.dumps({"config": asdict(c), "history": history}, indent=1),
           "the training history")
    state.save_progress(out, step, asdict(c), history, extra | {"output_multiplier": mult},
                        out / "model.safetensors")


def _load_compact(d: Drafter, out: Path, compact: dict, c: TrainConfig, log_mult: torch.nn.Parameter) -> None:
    from safetensors.torch import load_file

    where = out / state.PROGRESS
    for key in ("layers", "block_size", "top_k", "rank", "tap_ids", "mask_token_id"):
        saved, now = compact["config"].get(key), getattr(c, key)
        if (list(saved) if isinstance(saved, (list, tuple)) else saved) != (list(now) if isinstance(now, tuple) else now):
            raise Dflash2Error(f"{where}: config.{key} expected {now!r} (this run), found {saved!r}; train into "
                               "another --out or match its settings")
    weights = load_file(str(out / compact["weights"]["file"]))  # its sha256 was checked with progress.json
    own = d.state_dict()
    bad = sorted(k for k in own if not k.startswith("train_") and (k not in weights or weights[k].shape != own[k].shape))
    if bad:
        raise Dflash2Error(f"{out / compact['weights']['file']}: expected this run's drafter shapes, differing "
                           f"tensors {bad[:6]}")
    d.load_state_dict({k: weights[k].float() for k in own if not k.startswith("train_")}, strict=False)
    with torch.no_grad():
        log_mult.fill_(math.log(float(compact["extra"].get("output_multiplier", 1.0))))


def _on(rec, dev: str) -> dict:
    return {"ids": rec["ids"].to(dev), "taps": rec["taps"].to(dev), "prompt_len": rec["prompt_len"]}

