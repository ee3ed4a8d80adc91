"""The PyTorch reference backend of `dflash2.speculative`: static KV buffers + write pointers."""

from __future__ import annotations

from typing import Sequence

import torch

from dflash2.reference.drafter import Drafter
from dflash2.reference.target import Target
from dflash2.speculative import Drafted, Verified


class TorchBackend:
    """Target KV [max_seq, L, 2, kv, hd] and drafter context KV [max_seq, Ld, 2, kv, hd], allocated
    once. A step reads buffer[:pos] and writes its new rows at pos; rollback never copies."""

    def __init__(self, target: Target, drafter: Drafter | None, max_seq_len: int):
        self.target, self.drafter, self.max_seq_len = target, drafter, max_seq_len
        dtype = target.norm.weight.dtype
        self.kv = torch.zeros(max_seq_len, *target.kv_row_shape(), dtype=dtype)
        self.ctx_kv = torch.zeros(max_seq_len, *drafter.kv_row_shape(), dtype=dtype) if drafter else None
        self.block_size = drafter.config.block_size if drafter else 1
        self.pos = self.ctx_pos = 0
        self.pending: torch.Tensor | None = None  # context rows not yet in the drafter's cache  # [n, H]
        self.verified: torch.Tensor | None = None  # context rows of the last verify  # [S+1, H]

    def reset(self) -> None:
        self.pos = self.ctx_pos = 0
        self.pending = self.verified = None

    @torch.no_grad()
    def _run_target(self, ids: Sequence[int]) -> tuple[Verified, torch.Tensor | None]:
        n = len(ids)
        if self.pos + n > self.max_seq_len:
            raise ValueError(f"KV cache full: position {self.pos} + {n} tokens > max_seq_len {self.max_seq_len}")
        logits, taps, new_kv = self.target(torch.tensor(ids, dtype=torch.long), self.kv[: self.pos])
        self.kv[self.pos: self.pos + n] = new_kv
        ctx = self.drafter.context(taps) if self.drafter is not None else None
        logits = logits.float()
        rows = logits[-self.block_size:].numpy()  # as the exported target graph's logits output
        return Verified(logits.argmax(-1).tolist(), lambda: rows), ctx  # [n], [n, H]

    def prefill(self, ids: Sequence[int]) -> Verified:
        self.reset()  # a new prompt: both caches start empty (as SpecSession.prefill)
        out, self.pending = self._run_target(ids)
        self.pos += len(ids)
        return out

    @torch.no_grad()
    def draft(self, anchor: int, uniforms: Sequence[float] | None = None, temperature: float = 0.0) -> Drafted:
        n = self.pending.shape[0]
        hidden, new = self.drafter(self.pending, self.ctx_kv[: self.ctx_pos], torch.tensor([anchor]))
        self.ctx_kv[self.ctx_pos: self.ctx_pos + n] = new
        self.ctx_pos += n
        self.pending = None  # consumed; verify + commit without a draft append to it
        u = None if uniforms is None else torch.as_tensor(list(uniforms), dtype=torch.float32)
        out = self.drafter.propose(hidden, torch.tensor([anchor]), u, temperature)
        sampled = "draft_probs" in out and uniforms is not None and temperature > 0
        q = (out["cand_ids"].numpy(), out["draft_probs"].numpy()) if sampled else None
        return Drafted(out["draft_ids"].tolist(), out["confidence"].tolist(), q)

    def verify(self, tokens: Sequence[int]) -> Verified:
        out, self.verified = self._run_target(tokens)  # KV rows written at pos.., pointer not moved yet
        return out

    def commit(self, n: int) -> None:
        self.pos += n  # rows beyond stay in the buffer and are overwritten next step
        rows = self.verified[:n]
        self.pending = rows if self.pending is None else torch.cat([self.pending, rows])

    def decode(self, token: int) -> Verified:
        out, _ = self._run_target([token])
        self.pos += 1
        return out
