"""The speculative session: drafter + target engines over buffers allocated once.

Implements `dflash2.speculative.SpecBackend`, so the loop itself is the shared one.
Buffer plan (T = max_seq_len, rows of the sequence-major KV layout from the manifest):
    kv       [T, L, 2, kv, hd]   target KV; a step reads kv[:pos], writes kv[pos:pos+n]
    ctx_kv   [T, Ld, 2, kv, hd]  drafter context KV; same rule with ctx_pos
    context  [T, C]              target's context rows; the drafter reads rows [0, pending)
    ids/next [T] int32           token staging in / target argmax out
    anchor [1], draft [S], cand [S, K] int32 (cand stays on the device unless a policy reads it),
    confidence [S] fp32          the drafter's per-position confidence (the draft-length schedule reads it)
    logits [B, V] fp32           the target's last min(n, B) logits rows (read only when sampling)
    uniforms [S], temperature [1], draft_probs [S, K] fp32   DFlash2's sampled walk (T > 0) and its q
Rollback after a rejection moves `pos`; rows past it are overwritten by the next step.
A gqa-shared target graph (dflash2.kv_binding) gets kv as [2L, kv, T, hd] instead: row j is layer j//2's
K or V buffer [1, kv, T, hd], bound as both past and present; the graph writes its rows in place.
A target call writes its context rows at [pending, pending + n): committing acc+1 of them needs no
copy, and rounds that skip the drafter leave their rows pending for the next draft.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from dflash2 import dtypes
from dflash2.errors import Dflash2Error
from dflash2.kv_binding import is_gqa, kv_names
from dflash2.manifest import ModelFacts
from dflash2.runtime.engines import Backend


class CapacityError(Dflash2Error, ValueError):
    pass


def buffer_bytes(manifest: ModelFacts, max_seq_len: int) -> int:
    """Bytes of the session's buffers (plan in the module docstring): known before allocating."""
    m = manifest
    itemsize = dtypes.get(m.dtype).itemsize
    row = int(np.prod(m.kv.rows.target)) + int(np.prod(m.kv.rows.drafter)) + m.context.width
    return max_seq_len * (row * itemsize + 2 * 4)  # + ids / next_ids int32


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where unknown."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def graph_outputs(manifest: ModelFacts, graph: str) -> set[str]:
    """Output names of a graph (an export lists graphs, an engine folder engines)."""
    return set(manifest.output_names(graph) if hasattr(manifest, "output_names") else [])


class SamplingUnsupported(Dflash2Error, ValueError):
    pass


class SpecSession:
    def __init__(self, manifest: ModelFacts, backend: Backend, max_seq_len: int | None = None,
                 log: Callable[[str], None] | None = None):
        m = manifest
        self.manifest, self.backend = m, backend
        self.block_size, S = m.block_size, m.num_drafts
        self.vocab_size = m.vocab_size
        self.max_seq_len = T = min(max_seq_len or m.max_seq_len, m.max_seq_len)
        self.buffer_bytes = need = buffer_bytes(m, T)
        if log is not None:
            log(f"allocating {need / 2**20:.1f} MiB of KV and context buffers (max_seq_len {T})")
        free = available_host_bytes() if backend.name == "onnxruntime" else None  # host buffers only
        if free is not None and need > free:
            raise CapacityError(f"max_seq_len {T}: the KV and context buffers need {need / 2**30:.1f} GiB, "
                                f"{free / 2**30:.1f} GiB of memory is available (export with a smaller --max-seq-len)")
        dt = dtypes.numpy_dtype(m.dtype)  # bfloat16: ml_dtypes' type, the engines' own element type
        self.target, self.drafter = backend.engine("target"), backend.engine("drafter")
        self.gqa = is_gqa(self.target.inputs)
        if self.gqa:  # same bytes as the plain layout: buffer_bytes holds
            L, _, kvh, hd = m.kv.rows.target
            self.kv = backend.device_buffer((2 * L, kvh, T, hd), dt)
            self.kv_len = backend.host_buffer((1,), np.int32)
            past, present = kv_names(L)
            views = [self.kv.rows(j, j + 1) for j in range(2 * L)]  # [1, kv, T, hd] each, fixed for the session
            self.kv_past, self.kv_present = dict(zip(past, views)), dict(zip(present, views))
        else:
            self.kv = backend.device_buffer((T, *m.kv.rows.target), dt)
        self.kv_spare = 1 if self.gqa else 0  # the gqa kernel also writes the row after the step's
        self.ctx_kv = backend.device_buffer((T, *m.kv.rows.drafter), dt)
        self.context = backend.device_buffer((T, m.context.width), dt)
        self.ids = backend.host_buffer((T,), np.int32)
        self.next_ids = backend.host_buffer((T,), np.int32)
        self.anchor = backend.host_buffer((1,), np.int32)
        self.draft_ids = backend.host_buffer((S,), np.int32)
        self.has_lattice = m.drafter_version == 2
        K = m.selector.top_k if self.has_lattice else 1
        self.cand_ids = backend.host_buffer((S, K), np.int32)
        # Fixed step shapes (the TensorRT flavour): the engines read the whole KV buffer plus its valid
        # length and write their new rows to a staging buffer, copied into place after the step; so every
        # step of n rows binds the same addresses and its CUDA graph replays.
        # Per engine: a Q/DQ-quantized target engine, for one, is built from a prefix-view graph.
        self.kv_new = self.ctx_kv_new = None
        if "past_len" in self.target.inputs and not self.gqa:
            self.kv_new = backend.device_buffer((min(T, backend.max_rows("target") or T), *m.kv.rows.target), dt)
            self.kv_len = backend.host_buffer((1,), np.int32)
        if "past_len" in self.drafter.inputs:
            self.ctx_kv_new = backend.device_buffer((min(T, backend.max_rows("drafter") or T), *m.kv.rows.drafter), dt)
            self.ctx_kv_len = backend.host_buffer((1,), np.int32)
        # exports older than the confidence output lack it: the schedule then learns per position
        self.conf = backend.host_buffer((S,), np.float32) if "confidence" in graph_outputs(m, "drafter") else None
        self.confidence: np.ndarray | None = None
        # sampling (T > 0): exports older than contract 3 lack these; sampling on them is refused
        self.logits_buf = (backend.host_buffer((self.block_size, m.vocab_size), np.float32)
                           if "logits" in graph_outputs(m, "target") else None)
        self.logit_rows = 0
        self.sampled_walk = "uniforms" in self.drafter.inputs
        if self.sampled_walk:  # zeros (the greedy walk) until a sampled draft writes them
            self.uniforms = backend.host_buffer((S,), np.float32)
            self.temperature = backend.host_buffer((1,), np.float32)
            self.draft_probs = backend.host_buffer((S, K), np.float32)
            self._set_walk(np.zeros(S, np.float32), 0.0)
        self.walk_sampled = False  # what the uniforms / temperature buffers hold now
        self.draft_q: tuple[np.ndarray, np.ndarray] | None = None
        # an engine's drafter profile takes max(max_prefill, B) context rows at once; ONNX Runtime any number
        limit = min(getattr(m, "max_prefill", None) or T, backend.max_rows("drafter") or T)
        self.max_draft_rows = max(limit, self.block_size)
        self.reset()

    def reset(self) -> None:
        self.pos = self.ctx_pos = self.pending = 0

    def check_sampling(self) -> None:
        """Sampling needs the contract-3 graphs: the target's logits output (and, for DFlash2, the
        selector's sampled walk); an older export gets a clear error, not a greedy answer."""
        missing = ([] if self.logits_buf is not None else ["the target graph's `logits` output"])
        if self.has_lattice and not self.sampled_walk:
            missing.append("the drafter graph's `uniforms` / `temperature` inputs")
        if missing:
            raise SamplingUnsupported(f"sampling (temperature > 0) needs {' and '.join(missing)}, found an export "
                                      f"without them (made before sampling existed): re-export it with dflash2-export")

    @property
    def logits(self) -> np.ndarray:
        """[min(n, B), V] fp32 of the last target call (pulled on demand: the greedy path never reads it)."""
        if self.logits_buf is None:
            self.check_sampling()
        return self.logits_buf.pull(self.logit_rows)

    def buffers(self) -> dict[str, int]:
        """name -> base address: constant for the life of the session (tested)."""
        return {n: b.ptr for n, b in vars(self).items() if hasattr(b, "rows")}

    def check_capacity(self, prompt_len: int, max_new_tokens: int) -> None:
        need = prompt_len + max_new_tokens + self.block_size
        if need > self.max_seq_len:
            raise CapacityError(f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} + block "
                                f"{self.block_size} = {need} exceeds max_seq_len {self.max_seq_len} "
                                f"(re-export with a larger --max-seq-len)")

    def _run_target(self, tokens: Sequence[int]) -> np.ndarray:
        n, c = len(tokens), self.pending
        if self.pos + n + self.kv_spare > self.max_seq_len:
            raise CapacityError(f"KV cache full: {self.pos} + {n}{' + 1' if self.kv_spare else ''} > max_seq_len "
                                f"{self.max_seq_len}")
        self.ids.host[:n] = tokens
        self.ids.push(n)
        outputs = {"next_ids": self.next_ids.rows(0, n), "context": self.context.rows(c, c + n)}
        if self.gqa:
            self.kv_len.host[0] = self.pos
            self.kv_len.push(1)
            past = {"past_len": self.kv_len.whole(), **self.kv_past}
            outputs.update(self.kv_present)
        else:
            past, outputs["new_kv"] = self._kv("kv_cache", "past_kv", self.kv, self.kv_new, self.pos, n)
        if self.logits_buf is not None:
            outputs["logits"] = self.logits_buf.rows(0, min(n, self.block_size))
        self.target.run({"input_ids": self.ids.rows(0, n), **past}, outputs)
        if self.kv_new is not None:
            self.kv.copy_rows(self.kv_new, n, self.pos)
        self.logit_rows = min(n, self.block_size)
        return self.next_ids.pull(n)

    def _kv(self, cache: str, prefix: str, kv, staging, pos: int, n: int) -> tuple[dict, object]:
        """(KV inputs, new-rows output view) of a step of n rows at pos, for either binding."""
        if staging is None:  # prefix view: past rows [0, pos) in, new rows written in place at [pos, pos+n)
            return {prefix: kv.rows(0, pos)}, kv.rows(pos, pos + n)
        if n > staging.capacity:
            raise CapacityError(f"a step of {n} rows exceeds the {staging.capacity} rows the engines take per step "
                                f"(rebuild them with a larger dflash2-build --max-prefill)")
        length = self.kv_len if cache == "kv_cache" else self.ctx_kv_len
        length.host[0] = pos
        length.push(1)
        return {cache: kv.whole(), "past_len": length.whole()}, staging.rows(0, n)

    # --- SpecBackend ---------------------------------------------------------------------------
    def prefill(self, ids: Sequence[int]) -> int:
        self.reset()
        out = self._run_target(ids)
        self.pos, self.pending = len(ids), len(ids)
        return int(out[-1])

    def draft(self, anchor: int, uniforms: Sequence[float] | None = None, temperature: float = 0.0) -> np.ndarray:
        self.anchor.host[0] = anchor
        self.anchor.push(1)
        sampled = uniforms is not None and temperature > 0
        if sampled:
            self.check_sampling()
        walk = {}
        if self.sampled_walk:  # temperature 0: the greedy walk, bit-identical to the greedy mode
            if sampled or self.walk_sampled:  # greedy rounds after greedy rounds copy nothing
                self._set_walk(uniforms if sampled else 0.0, temperature if sampled else 0.0)
                self.walk_sampled = sampled
            walk = {"uniforms": self.uniforms.whole(), "temperature": self.temperature.whole()}
        done = 0
        while done < self.pending:  # rows pending after skipped drafts may exceed what one call takes
            n, p = min(self.pending - done, self.max_draft_rows), self.ctx_pos
            past, new = self._kv("ctx_kv_cache", "past_ctx_kv", self.ctx_kv, self.ctx_kv_new, p, n)
            outputs = {"draft_ids": self.draft_ids.whole(), "new_ctx_kv": new}
            if self.has_lattice:
                outputs["cand_ids"] = self.cand_ids.whole()
            if self.conf is not None:
                outputs["confidence"] = self.conf.whole()
            if self.sampled_walk:
                outputs["draft_probs"] = self.draft_probs.whole()
            self.drafter.run({"context": self.context.rows(done, done + n), **past, "anchor": self.anchor.whole(),
                              **walk}, outputs)  # only the last call's drafts count
            if self.ctx_kv_new is not None:
                self.ctx_kv.copy_rows(self.ctx_kv_new, n, p)
            self.ctx_pos, done = p + n, done + n
        self.pending = 0
        S = self.block_size - 1
        if self.conf is not None:  # queued: the draft ids' pull below waits for every copy
            self.confidence = self.conf.pull(S, wait=False)
        self.draft_q = None
        if sampled and self.has_lattice:
            self.draft_q = (self.cand_ids.pull(S, wait=False), self.draft_probs.pull(S, wait=False))
        return self.draft_ids.pull(S)

    def _set_walk(self, uniforms, temperature: float) -> None:
        self.uniforms.host[:] = uniforms
        self.temperature.host[0] = temperature
        self.uniforms.push(self.block_size - 1)
        self.temperature.push(1)

    def verify(self, tokens: Sequence[int]) -> np.ndarray:
        return self._run_target(tokens)  # writes KV rows at pos..pos+S; pos moves at commit

    def commit(self, n: int) -> None:
        self.pos += n
        self.pending += n  # verify's first n context rows join the drafter's next input, in place

    def decode(self, token: int) -> int:
        out = self._run_target([token])
        self.pos += 1
        return int(out[0])
