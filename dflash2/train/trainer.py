"""Train a DFlash2 drafter (and its candidate selector) for a target, on the CPU at small scale.

Recipe (algorithm.md section 4): the target's embedding and LM head are frozen; each training
sequence is a target-generated answer with the target's taps; random anchors a (in the answer)
give blocks [tok_a, MASK x S] that see the context rows < a and predict tok_{a+1..a+S};
loss = depth-decayed cross-entropy (weight exp(-k/gamma)) + a K-way cross-entropy for the
selector with the TRUE previous token as predecessor, counted where the true token is in the top-K.
Checkpoints are safetensors (weights and optimizer moments), never pickle.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dflash2.config import load_drafter_config, load_target_config
from dflash2.reference.drafter import Drafter
from dflash2.reference.layers import rope_cos_sin
from dflash2.reference.load import load_target
from dflash2.speculative import Stats


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
    shortlist: bool = True  # softmax over corpus tokens + random negatives instead of the whole vocab
    negatives: int = 2048
    kd_weight: float = 0.0  # + kd_weight * KL(target || drafter) on draft rows (soft labels, see Teacher)


def drafter_config_dict(target_dir: str | Path, c: TrainConfig) -> dict:
    t = load_target_config(target_dir)
    return {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size, "num_hidden_layers": c.layers,
        "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads, "head_dim": t.head_dim,
        "vocab_size": t.vocab_size, "rms_norm_eps": t.rms_norm_eps, "rope_theta": t.rope.theta,
        "attention_bias": False, "hidden_act": "silu", "num_target_layers": t.num_layers,
        "block_size": c.block_size, "is_causal": False, "tie_word_embeddings": False,
        "dflash_config": {"block_size": c.block_size, "target_layer_ids": list(c.tap_ids),
                          "mask_token_id": c.mask_token_id, "conv_kernel_size": 2, "conv_group_size": 16,
                          "selector_rank": c.rank, "selector_top_k": c.top_k},
    }


def init_drafter(target, cfg_dict: dict, folder: Path, init_from: str = "last") -> Drafter:
    """Fresh drafter: attention/MLP copied from the target's first (or last) layers, identity convs,
    small codebooks. The block's input is a token embedding, which the first layers expect."""
    (folder / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    dc = load_drafter_config(folder)
    d = Drafter(dc, target.embed_tokens.weight.detach(), target.head_weight.detach(), target.config.hidden_size)
    src = target.layers[:dc.num_layers] if init_from == "first" else target.layers[-dc.num_layers:]
    for mine, theirs in zip(d.layers, src):
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(mine.self_attn, name).weight.data.copy_(getattr(theirs.self_attn, name).weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(mine.mlp, name).weight.data.copy_(getattr(theirs.mlp, name).weight)
        mine.input_layernorm.weight.data.copy_(theirs.input_layernorm.weight)
        mine.post_attention_layernorm.weight.data.copy_(theirs.post_attention_layernorm.weight)
    d.norm.weight.data.copy_(target.norm.weight)
    g = torch.Generator().manual_seed(0)
    torch.nn.init.normal_(d.fc.weight, std=d.fc.in_features ** -0.5, generator=g)
    sel = d.candidate_selector
    torch.nn.init.normal_(sel.hidden_projection.weight, std=0.02, generator=g)
    torch.nn.init.normal_(sel.predecessor_codebook, std=0.02, generator=g)
    torch.nn.init.normal_(sel.successor_codebook, std=0.02, generator=g)
    return d


class Teacher:
    """The target's layers after the last tap, run over a record's last-tap rows: its final hidden
    states, hence its next-token distribution (soft labels), for 2 of SmolLM2's 30 layers. Corpus
    taps are fp16, so these logits are close to, not bit-equal with, the target's."""

    def __init__(self, target, tap_ids: tuple[int, ...]):
        last = max(tap_ids)
        self.column = list(tap_ids).index(last)  # which H-wide slice of the taps is the last tap
        self.layers = target.layers[last + 1:]
        self.norm, self.head, self.inv_freq = target.norm, target.head_weight, target.inv_freq
        self.kv_shape = (0, target.config.num_kv_heads, target.config.head_dim)

    @torch.no_grad()
    def logits(self, rec: dict, positions: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
        """positions [nb, S] (rows whose next token is a label) -> logits [nb, S, U or V] (fp32)."""
        H = self.norm.weight.shape[0]
        h = rec["taps"][:, self.column * H:(self.column + 1) * H].float()  # [T, H]
        pos = torch.arange(h.shape[0])
        cos, sin = rope_cos_sin(pos, self.inv_freq)
        visible = pos[None, :] <= pos[:, None]  # [T, T] causal
        empty = h.new_zeros(self.kv_shape)
        for layer in self.layers:
            h, _ = layer(h, empty, empty, cos, sin, visible)
        head = self.head if vocab is None else self.head[vocab]
        return self.norm(h)[positions.clamp(max=h.shape[0] - 1)] @ head.T


def sample_anchors(rec: dict, n: int, rng: random.Random) -> list[int]:
    """Anchor positions inside the answer (as at inference, slot 0 holds a target-generated token);
    the block sees context rows < a and its labels are the following generated tokens."""
    lo, hi = rec["prompt_len"], len(rec["ids"]) - 2  # at least one label after the anchor
    if hi < lo:
        return []
    return sorted(rng.sample(range(lo, hi + 1), min(n, hi - lo + 1)))


def block_forward(d: Drafter, rec: dict, anchors: list[int]):
    """-> hidden [nb, S, H] (final-normed rows 1..S), labels [nb, S] (-100 beyond the sequence)."""
    S = d.config.block_size - 1
    ids, taps = rec["ids"], rec["taps"]
    T = taps.shape[0]  # taps exist for positions 0..T-1
    c = d.context(taps.float())  # [T, H]
    ctx_kv = d.append_context(c, 0)  # [T, Ld, 2, kv, hd]
    a = torch.tensor(anchors)
    h = d.block_embeddings(ids[a], nb=len(anchors))  # [nb, B, H]
    hidden = d.run_blocks(h, ctx_kv, torch.arange(T), a, a)[:, 1:]  # [nb, S, H]
    idx = a[:, None] + torch.arange(1, S + 1)[None, :]  # [nb, S]
    labels = torch.where(idx < len(ids), ids[idx.clamp(max=len(ids) - 1)], torch.full_like(idx, -100))
    return hidden, labels, ids[a]


def losses(d: Drafter, hidden, labels, anchor_ids, gamma: float, K: int, vocab: torch.Tensor | None = None,
           multiplier: torch.Tensor | float | None = None, teacher: torch.Tensor | None = None, kd_weight: float = 0.0):
    """vocab: ids the softmax runs over ([U], sorted, must hold every label), or None for all.
    multiplier: the selector's unary scale (a learnable scalar while training), default the config's.
    teacher: the target's logits for the same rows and vocabulary [nb, S, U] (with kd_weight > 0)."""
    S = hidden.shape[1]
    if vocab is None:
        logits = d.logits(hidden)  # [nb, S, V]
        to_vocab = None
    else:
        logits = hidden @ d.head_weight[vocab].T  # [nb, S, U]
        to_vocab = vocab
        labels = torch.where(labels >= 0, torch.searchsorted(vocab, labels.clamp(min=0)), labels)
    w = torch.exp(-torch.arange(S, dtype=torch.float32) / gamma)  # position k+1 -> exp(-k/gamma)
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none").view_as(labels)
    valid = labels >= 0
    if teacher is not None and kd_weight > 0:  # soft labels: the target's whole next-token distribution
        kl = F.kl_div(F.log_softmax(logits.float(), -1), F.log_softmax(teacher, -1), log_target=True,
                      reduction="none").sum(-1)  # [nb, S]
        ce = ce + kd_weight * kl
    draft_loss = (ce * w * valid).sum() / (w * valid).sum().clamp(min=1)
    # selector: K-way CE over the drafter's own top-K, predecessor = the TRUE previous token
    sel = d.candidate_selector
    with torch.no_grad():
        unary, cand = logits.detach().float().topk(K, dim=-1)  # [nb, S, K] (shortlist positions)
    prev_labels = labels[:, :-1].clamp(min=0)  # [nb, S-1]: shortlist positions when `vocab` is given
    prev = torch.cat([anchor_ids[:, None], prev_labels if to_vocab is None else to_vocab[prev_labels]], 1)  # [nb, S]
    gate = hidden.detach() @ sel.hidden_projection.weight.T  # [nb, S, R]
    cand_vocab = cand if to_vocab is None else to_vocab[cand]
    pair = torch.einsum("nsr,nskr->nsk", sel.predecessor_codebook[prev] * gate, sel.successor_codebook[cand_vocab])
    hit = cand == labels[..., None]  # [nb, S, K]
    present = hit.any(-1) & valid
    target = hit.float().argmax(-1)
    m = d.config.output_multiplier if multiplier is None else multiplier
    sel_ce = F.cross_entropy((unary * m + pair).flatten(0, 1), target.flatten(),
                             reduction="none").view_as(labels)
    sel_loss = (sel_ce * present).sum() / present.sum().clamp(min=1)
    return draft_loss, sel_loss


@torch.no_grad()
def accepted_lengths(d: Drafter, rec: dict, anchors: list[int]) -> dict[str, list[int]]:
    """Drafts accepted per block (leading matches with the target's greedy tokens) for the selector
    path, the top-1 path and the top-K oracle: what the speculative loop would accept at these anchors."""
    hidden, labels, anchor_ids = block_forward(d, rec, anchors)
    out = d.propose_batch(hidden, anchor_ids)
    return {"selector": _accepted(out["draft_ids"].long() == labels).tolist(),
            "top1": _accepted(out["cand_ids"][..., 0].long() == labels).tolist(),
            "oracle": _accepted((out["cand_ids"].long() == labels[..., None]).any(-1)).tolist()}


@torch.no_grad()
def offline_acceptance(d: Drafter, records: list[dict], anchors_per_seq: int = 16, seed: int = 1) -> dict:
    """tau for the selector path, the top-1 path and the top-K oracle on held-out blocks at random
    anchors (every position weighs the same; the loop's own anchors sit more often where drafts fail)."""
    rng = random.Random(seed)
    taus = {"selector": [], "top1": [], "oracle": []}
    S = d.config.num_drafts
    for rec in records:
        anchors = sample_anchors(rec, anchors_per_seq, rng)
        if anchors:
            for name, acc in accepted_lengths(d, rec, anchors).items():
                taus[name] += acc
    if not taus["top1"]:
        return {"blocks": 0}
    stats = {k: Stats(S + 1, accepted=v) for k, v in taus.items()}
    out = {k: s.acceptance_length for k, s in stats.items()}
    out["position_acceptance"] = {k: s.position_acceptance() for k, s in stats.items()}
    return out | {"blocks": len(taus["top1"])}


def _accepted(ok: torch.Tensor) -> torch.Tensor:  # [nb, S] bool -> leading True count [nb]
    return ok.int().cumprod(-1).sum(-1)


def _set_multiplier(d: Drafter, folder: Path, value: float) -> None:
    """Write the learned unary scale into the drafter's config (object and config.json)."""
    import dataclasses

    d.config = dataclasses.replace(d.config, output_multiplier=value)
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg["dflash_config"]["output_multiplier"] = value
    path.write_text(json.dumps(cfg, indent=2))


def save_drafter(d: Drafter, folder: Path, dtype=torch.float16) -> None:
    state = {k: v.detach().to(dtype).contiguous() for k, v in d.state_dict().items()
             if not k.startswith("train_")}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


STATE = "train_state"  # resumable state lives in a subfolder: the checkpoint folder holds only the model


def _save_resume(folder: Path, d: Drafter, opt: torch.optim.Optimizer, step: int, c: TrainConfig, log: list) -> None:
    folder = folder / STATE
    folder.mkdir(exist_ok=True)
    tensors = {f"param/{k}": v.detach().contiguous() for k, v in d.state_dict().items()}
    names = {id(p): n for n, p in d.named_parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st:
                    tensors[f"{key}/{names[id(p)]}"] = st[key].contiguous()
    save_file(tensors, str(folder / "resume.safetensors.tmp"))
    (folder / "resume.safetensors.tmp").rename(folder / "resume.safetensors")
    (folder / "resume.json").write_text(json.dumps({"step": step, "config": asdict(c), "log": log}, indent=1))


def _load_resume(folder: Path, d: Drafter, opt: torch.optim.Optimizer) -> tuple[int, list]:
    folder = folder / STATE
    meta = json.loads((folder / "resume.json").read_text())
    t = load_file(str(folder / "resume.safetensors"))
    state = {k[6:]: v for k, v in t.items() if k.startswith("param/")}
    missing, unexpected = d.load_state_dict(state, strict=False)
    if unexpected or any(not k.startswith("train_") for k in missing):
        raise ValueError(f"{folder}: resume state does not match the model: missing {missing}, unexpected {unexpected}")
    for n, p in d.named_parameters():
        if f"exp_avg/{n}" in t:
            opt.state[p] = {"step": torch.tensor(float(meta["step"])), "exp_avg": t[f"exp_avg/{n}"],
                            "exp_avg_sq": t[f"exp_avg_sq/{n}"]}
    return meta["step"], meta["log"]


def train(target_dir: str | Path, out_dir: str | Path, records: list[dict], c: TrainConfig,
          eval_records: list[dict] | None = None, log_fn=print) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(c.seed)
    rng = random.Random(c.seed)
    target = load_target(target_dir, ())
    d = init_drafter(target, drafter_config_dict(target_dir, c), out, c.init_from)
    teacher = Teacher(target, c.tap_ids) if c.kd_weight > 0 else None  # keeps the layers after the last tap
    del target.layers  # otherwise only the embedding / LM head (buffers of the drafter) are needed
    log_mult = torch.nn.Parameter(torch.zeros(()), requires_grad=c.learn_multiplier)
    d.register_parameter("train_log_multiplier", log_mult)  # saved in train_state, not in the checkpoint
    params = [p for p in d.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=c.lr, weight_decay=0.0, betas=(0.9, 0.95))
    step, history = 0, []
    if (out / STATE / "resume.json").is_file():
        step, history = _load_resume(out, d, opt)
        log_fn(f"resumed at step {step}")
    K, t0, step0 = c.top_k, time.perf_counter(), step
    corpus_vocab = torch.unique(torch.cat([r["ids"] for r in records]))  # every token the target produced
    V = d.config.vocab_size
    while step < c.steps:
        lr = c.lr * min(1.0, (step + 1) / c.warmup) * 0.5 * (1 + math.cos(math.pi * step / c.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        d.train()
        opt.zero_grad(set_to_none=True)
        dl_sum = sl_sum = 0.0
        vocab = None
        if c.shortlist:
            negatives = torch.randint(0, V, (c.negatives,))
            vocab = torch.unique(torch.cat([corpus_vocab, negatives, torch.tensor([c.mask_token_id])]))
        for rec in rng.sample(records, min(c.seqs_per_step, len(records))):
            anchors = sample_anchors(rec, c.anchors_per_seq, rng)
            if not anchors:
                continue
            hidden, labels, anchor_ids = block_forward(d, rec, anchors)
            soft = None
            if teacher is not None:  # row k of the block at anchor a predicts token a+k: target position a+k-1
                rows = torch.tensor(anchors)[:, None] + torch.arange(labels.shape[1])[None, :]  # [nb, S]
                soft = teacher.logits(rec, rows, vocab)
            dl, sl = losses(d, hidden, labels, anchor_ids, c.gamma, K, vocab, log_mult.exp(), soft, c.kd_weight)
            ((dl + c.selector_weight * sl) / c.seqs_per_step).backward()
            dl_sum, sl_sum = dl_sum + dl.item(), sl_sum + sl.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if step % 10 == 0 or step == c.steps:
            rate = (time.perf_counter() - t0) / max(step - step0, 1)
            log_fn(f"step {step}/{c.steps}  draft CE {dl_sum / c.seqs_per_step:.3f}  selector CE "
                   f"{sl_sum / c.seqs_per_step:.3f}  lr {lr:.2e}  {rate:.2f} s/step  ETA {(c.steps - step) * rate / 60:.1f} min")
        if eval_records and (step % c.eval_every == 0 or step == c.steps):
            d.eval()
            _set_multiplier(d, out, float(log_mult.detach().exp()))
            acc = offline_acceptance(d, eval_records[: c.eval_seqs])
            history.append({"step": step, **acc})
            log_fn(f"eval @ {step}: tau selector {acc['selector']:.3f}  top1 {acc['top1']:.3f}  "
                   f"oracle {acc['oracle']:.3f}  ({acc['blocks']} held-out blocks)")
        if step % c.save_every == 0 or step == c.steps:
            _save_resume(out, d, opt, step, c, history)
    d.eval()
    _set_multiplier(d, out, float(log_mult.detach().exp()))
    save_drafter(d, out)
    (out / "training.json").write_text(json.dumps({"config": asdict(c), "history": history}, indent=1))
    return {"history": history}
