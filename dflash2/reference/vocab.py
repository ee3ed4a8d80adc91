"""The vocabulary-sized matrices (embedding, LM head) of a streamed reference, never held whole.

At Qwen3-8B's shape one [151,936, 4096] fp32 matrix is 2.5 GB, two for an untied head: more than the
rest of a streamed export's reference together. `StreamedRows` reads from the checkpoint only what a
step needs: `rows(ids)` the rows of the ids looked up (an embedding of a few prompt tokens reads a few
rows), `project(x)` = x @ W.T one vocabulary slice of ~64 MB at a time (each logit is the same dot
product over H as in the whole-matrix product: bit-identical where the slice takes the whole product's GEMM
kernel, as 64 MB slices of a real vocabulary do here; a narrow slice may take another, then equal to fp32
rounding: tests/test_streamed.py checks both against `Target`).

`take(W, ids)` / `project(x, W)` accept a loaded tensor or a `StreamedRows`, so the reference modules
run either way with one code path.
"""

from __future__ import annotations

import numpy as np
import torch

from dflash2.checkpoint import CHUNK_BYTES


class StreamedRows:
    """A [V, H] matrix read from a checkpoint (`dflash2.checkpoint.Weights`) on demand, as `dtype` (the
    checkpoint's values widened to fp32, then rounded once to dtype: what `.to(dtype)` of the loaded tensor gives)."""

    def __init__(self, weights, name: str, dtype: torch.dtype = torch.float32):
        self.src, self.name, self.dtype = weights, name, dtype
        self.shape = torch.Size(weights.shape(name))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] for ids of any shape -> [*ids.shape, H], reading each run of consecutive ids once."""
        flat = ids.reshape(-1).long()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.shape[0]):
            raise IndexError(f"{self.name}: ids must lie in 0..{self.shape[0] - 1}, found "
                             f"{int(flat.min())}..{int(flat.max())}")
        uniq, where = torch.unique(flat, return_inverse=True)  # sorted
        u = uniq.numpy()
        starts = np.flatnonzero(np.diff(u, prepend=-2) != 1)  # a run begins where an id is not the last + 1
        ends = np.append(starts[1:], len(u))
        got = [self.src.get(self.name, slice(int(u[a]), int(u[b - 1]) + 1)) for a, b in zip(starts, ends)]
        table = torch.from_numpy(np.concatenate(got) if got else np.zeros((0, self.shape[1]), np.float32))
        return table[where].reshape(*ids.shape, self.shape[1]).to(self.dtype)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> x @ W.T [..., V] in dtype, W read in slices of the vocabulary."""
        out = torch.empty(*x.shape[:-1], self.shape[0], dtype=self.dtype)
        start = 0
        for chunk in self.src.row_chunks(self.name, CHUNK_BYTES):  # [r, H] fp32
            out[..., start:start + len(chunk)] = x.to(self.dtype) @ torch.from_numpy(chunk).to(self.dtype).T
            start += len(chunk)
        return out


def take(weight, ids: torch.Tensor) -> torch.Tensor:
    """weight[ids] (an embedding lookup) of a tensor or a StreamedRows."""
    return weight.rows(ids) if isinstance(weight, StreamedRows) else torch.nn.functional.embedding(ids, weight)


def project(x: torch.Tensor, weight) -> torch.Tensor:
    """x @ weight.T (an LM head) of a tensor or a StreamedRows."""
    return weight.project(x) if isinstance(weight, StreamedRows) else x @ weight.T
