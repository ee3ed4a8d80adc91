"""The speculative session: drafter + target engines over buffers allocated once, bound once.

Implements `dflash2.speculative.SpecBackend`, so the loop itself is the shared one. Everything it binds
comes from each graph's signature (the manifest): tensor names by role, the KV binding kind
(dflash2.runtime.binding: one object per graph, built once) and capabilities.
Buffer plan (T = max_seq_len):
    target KV, drafter context KV   owned by their binding objects (prefix / fixed / gqa-shared)
    context  [T, C]              target's context rows; the drafter reads rows [0, pending)
    ids/next [T] int32           token staging in / target argmax out
    anchor [1], draft [S], cand [S, K] int32 (cand stays on the device unless a policy reads it),
    confidence [S] fp32          the drafter's per-position confidence (the draft-length schedule reads it)
    logits [B, V] fp32           the target's last min(n, B) logits rows (read only when sampling)
    states                       a hybrid target's recurrent state, (2W + 1) rows per state tensor
                                 (dflash2.runtime.state.RowStates: committed by moving a pointer, no copy)
    window                       a windowed target's sliding layers' KV, keep + 2 step rows, not T (the target
                                 KV then holds only the other layers; dflash2.runtime.window.CompactingKv:
                                 compacted at commit points; a prefill longer than a step runs in steps)
                                 A drafter whose every layer slides (its signature's window binding) keeps its
                                 context KV the same way: drafter_kv is a CompactingKv. The drafter writes
                                 committed context rows only (a verify's rows reach it at the next draft, once
                                 committed), so each of its calls is at a commit point and a rejected verify
                                 never touches it; its calls are cut to the buffer's step rows.
    uniforms [S], temperature [1], draft_probs [S, K] fp32   DFlash2's sampled walk (T > 0) and its q
Views that never move (KV buffers of the gqa binding, the anchor, drafts, the walk's inputs) are bound once
at session start; a step binds only what changes. Rollback after a rejection moves `pos`; rows past it
are overwritten by the next step. A target call's context rows go to [pending, pending + n): rounds that
skip the drafter leave their rows pending. A call of at most B rows writes them into a fixed staging
buffer [B, C] and one device copy moves them there: its bindings then stay the same from call to call,
where an output moving by a row every step cost ONNX Runtime a re-bind, 0.6-1.5% of a 2-thread int4
decode step (what made a round that skips the drafter slower than a plain decode step).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from dflash2 import dtypes
from dflash2 import manifest as mf
from dflash2.errors import Dflash2Error
from dflash2.runtime.binding import CapacityError, make_kv
from dflash2.runtime.ort import Backend
from dflash2.runtime.state import RowStates, state_bytes
from dflash2.runtime.window import CompactingKv, window_bytes
from dflash2.speculative import Drafted, Verified


def buffer_bytes(manifest: mf.ModelFacts, max_seq_len: int, target: mf.Signature | None = None,
                 drafter: mf.Signature | None = None) -> int:
    """Bytes of the session's buffers (plan in the module docstring): known before allocating.
    target / drafter: the graphs' signatures (None: the manifest's own, where it is an export or engine manifest);
    a hybrid target's recurrent state counts too, a windowed target's sliding layers and a windowed drafter's
    context KV at their window rows."""
    m = manifest
    itemsize = dtypes.get(m.dtype).itemsize
    if isinstance(m, (mf.ExportManifest, mf.EngineManifest)):
        target = target if target is not None else m.signature("target")
        drafter = drafter if drafter is not None else m.signature("drafter")
    window = target.window if target is not None else None
    dwin = drafter.window if drafter is not None else None
    full, slide = target_rows(m.kv.rows.target, window)
    row = int(np.prod(full)) + (0 if dwin else int(np.prod(m.kv.rows.drafter))) + m.context.width
    state = state_bytes(target.state if target is not None else None)
    extra = state + window_bytes(window, slide, m.block_size, itemsize) + \
        window_bytes(dwin, m.kv.rows.drafter, m.block_size, itemsize)
    return max_seq_len * (row * itemsize + 2 * 4) + extra  # + ids / next_ids int32


def target_rows(row: list[int], window: mf.WindowSignature | None) -> tuple[list[int], list[int] | None]:
    """(the target KV binding's row, the window buffer's row) from the manifest's row [L, 2, kv, hd] of every layer:
    a window binding takes its layers off the first; (row, None) without one."""
    if window is None:
        return list(row), None
    L, Lw = row[0], len(window.layers)
    if Lw >= L or max(window.layers) >= L:
        raise Dflash2Error(f"target signature: window.layers expected {Lw} of the {L} layers (kv.rows.target {row}) "
                           f"with at least one left on the KV binding, found {window.layers}")
    return window.split_rows(list(row))


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


class SamplingUnsupported(Dflash2Error, ValueError):
    pass


class SpecSession:
    def __init__(self, manifest: mf.ModelFacts, backend: Backend, max_seq_len: int | None = None,
                 log: Callable[[str], None] | None = None):
        m = manifest
        self.manifest, self.backend = m, backend
        self.block_size, S = m.block_size, m.num_drafts
        self.vocab_size = m.vocab_size
        self.max_seq_len = T = min(max_seq_len or m.max_seq_len, m.max_seq_len)
        ts, ds = self.target_sig, self.drafter_sig = backend.signature("target"), backend.signature("drafter")
        self.buffer_bytes = need = buffer_bytes(m, T, ts, ds)
        what = "KV, context and recurrent-state" if ts.state is not None else "KV and context"
        if log is not None:
            log(f"allocating {need / 2**20:.1f} MiB of {what} buffers (max_seq_len {T})")
        free = available_host_bytes() if backend.name == "onnxruntime" else None  # host buffers only
        if free is not None and need > free:
            raise CapacityError(f"max_seq_len {T}: the {what} buffers need {need / 2**30:.1f} GiB, "
                                f"{free / 2**30:.1f} GiB of memory is available (export with a smaller --max-seq-len)")
        if ts.state is not None and ts.state.window < self.block_size:
            raise Dflash2Error(f"target signature: state.window expected >= block_size {self.block_size} (a verify "
                               f"may accept only its first row), found {ts.state.window}")
        dt = dtypes.numpy_dtype(m.dtype)  # bfloat16: ml_dtypes' type, the engines' own element type
        self.target, self.drafter = backend.engine("target"), backend.engine("drafter")
        # a hybrid target's recurrent state; None: a dense target
        self.states = RowStates(ts.state, backend) if ts.state is not None else None
        full, slide = target_rows(m.kv.rows.target, ts.window)
        self.window = CompactingKv(ts.window, backend, slide, self.block_size, dt) if ts.window is not None else None
        self.target_kv = make_kv(ts.kv, backend, "target", full, T, dt)
        if ds.window is not None:  # every drafter layer slides: its context KV on the window buffer (docstring)
            self.drafter_kv = CompactingKv(ds.window, backend, m.kv.rows.drafter, self.block_size, dt, "drafter")
        else:
            self.drafter_kv = make_kv(ds.kv, backend, "drafter", m.kv.rows.drafter, T, dt)
        self.kv, self.ctx_kv = self.target_kv.buffer, self.drafter_kv.buffer
        self.gqa = ts.kv.kind == "gqa-shared"
        self.context = backend.device_buffer((T, m.context.width), dt)
        self.context_stage = backend.device_buffer((self.block_size, m.context.width), dt)
        self.ids = backend.host_buffer((T,), np.int32)
        self.next_ids = backend.host_buffer((T,), np.int32)
        self.anchor = backend.host_buffer((1,), np.int32)
        self.draft_ids = backend.host_buffer((S,), np.int32)
        self.has_lattice = ds.has("lattice")
        K = m.selector.top_k if self.has_lattice else 1
        self.cand_ids = backend.host_buffer((S, K), np.int32)
        self.conf = backend.host_buffer((S,), np.float32)
        self.logits_buf = backend.host_buffer((self.block_size, m.vocab_size), np.float32)
        self.sampled_walk = ds.has("sampled-walk")
        if self.has_lattice and not self.sampled_walk:
            raise SamplingUnsupported("the drafter graph's signature lacks the sampled walk (uniforms, temperature "
                                      "in; draft_probs out): re-export with dflash2-export")
        if self.sampled_walk:  # zeros (the greedy walk) until a sampled draft writes them
            self.uniforms = backend.host_buffer((S,), np.float32)
            self.temperature = backend.host_buffer((1,), np.float32)
            self.draft_probs = backend.host_buffer((S, K), np.float32)
            self._set_walk(np.zeros(S, np.float32), 0.0)
        self.walk_sampled = False  # what the uniforms / temperature buffers hold now
        self.calls = 0  # target calls so far: a Verified's lazy logits are valid until the next one
        self._bind_fixed()
        # an engine's drafter profile takes max(max_prefill, B) context rows at once; ONNX Runtime any number
        limit = min(getattr(m, "max_prefill", None) or T, backend.max_rows("drafter") or T)
        self.max_draft_rows = max(limit, self.block_size)
        if ds.window is not None:  # a window buffer takes at most its step's rows per call
            self.max_draft_rows = min(self.max_draft_rows, self.drafter_kv.step_rows)
        self.reset()

    def _bind_fixed(self) -> None:
        """Bind what never moves once: per step only the views that change are passed to the engines."""
        ts, ds = self.target_sig, self.drafter_sig
        kin, kout = self.target_kv.fixed()
        if self.window is not None:
            win, wout = self.window.fixed()
            kin, kout = {**kin, **win}, {**kout, **wout}
        self.target.bind(kin, kout)
        din, dout = self.drafter_kv.fixed()
        din = {**din, ds.inputs["anchor"]: self.anchor.whole()}
        dout = {**dout, ds.outputs["draft_ids"]: self.draft_ids.whole(), ds.outputs["confidence"]: self.conf.whole()}
        if self.has_lattice:
            dout[ds.outputs["cand_ids"]] = self.cand_ids.whole()
        if self.sampled_walk:
            din |= {ds.inputs["uniforms"]: self.uniforms.whole(), ds.inputs["temperature"]: self.temperature.whole()}
            dout[ds.outputs["draft_probs"]] = self.draft_probs.whole()
        self.drafter.bind(din, dout)
        # the role names a step binds, looked up once
        self._t_ids, self._t_next, self._t_ctx = ts.inputs["ids"], ts.outputs["next_ids"], ts.outputs["context"]
        self._t_logits, self._d_ctx = ts.outputs["logits"], ds.inputs["context"]

    def reset(self) -> None:
        self.pos = self.ctx_pos = self.pending = 0
        self.last_rows = 0  # rows of the last target step (what a state commit counts from)
        if self.states is not None:
            self.states.reset()
        if self.window is not None:
            self.window.reset()
        if self.drafter_sig.window is not None:
            self.drafter_kv.reset()

    def buffers(self) -> dict[str, int]:
        """name -> base address: constant for the life of the session (tested)."""
        out = {n: b.ptr for n, b in vars(self).items() if hasattr(b, "rows")}
        for kv in ("target_kv", "drafter_kv", "window"):
            if getattr(self, kv) is not None:
                out |= {f"{kv}.{n}": b.ptr for n, b in vars(getattr(self, kv)).items() if hasattr(b, "rows")}
        if self.states is not None:
            out |= {f"states.{n}": b.ptr for n, b in self.states.named_buffers().items()}
        return out

    def kv_report(self) -> dict:
        """The KV buffers' bytes as allocated (dflash2-run --json): the target's KV binding (max_seq_len rows; its
        full-attention layers only where a window buffer holds the sliding ones), the window buffer (its rows fixed
        by the window, whatever the sequence: runtime.window), the drafter's context KV; with a window buffer also
        its rows, the most of them a step saw, its compactions and layers; a windowed drafter's (drafter_bytes then
        its window buffer's, fixed whatever the sequence) the same under drafter_window_*."""
        out = {"target_bytes": self.kv.nbytes, "window_bytes": 0, "drafter_bytes": self.ctx_kv.nbytes}
        for key, w, sig in (("window", self.window, self.target_sig), ("drafter_window", self.drafter_kv,
                                                                         self.drafter_sig)):
            if sig.window is not None:
                out |= {f"{key}_rows": w.capacity, f"{key}_rows_used": w.high, f"{key}_compactions": w.compactions,
                        f"{key}_layers": list(sig.window.layers)}
        if self.window is not None:
            out["window_bytes"] = self.window.buffer.nbytes
        return out

    def check_capacity(self, prompt_len: int, max_new_tokens: int) -> None:
        need = prompt_len + max_new_tokens + self.block_size
        if need > self.max_seq_len:
            raise CapacityError(f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} + block "
                                f"{self.block_size} = {need} exceeds max_seq_len {self.max_seq_len} "
                                f"(re-export with a larger --max-seq-len)")

    def _run_target(self, tokens: Sequence[int], in_place: bool = False) -> Verified:
        n, c, kv, spare = len(tokens), self.pending, self.target_kv, self.target_kv.spare
        if self.pos + n + spare > self.max_seq_len:
            raise CapacityError(f"KV cache full: {self.pos} + {n}{' + 1' if spare else ''} > max_seq_len "
                                f"{self.max_seq_len}")
        self.ids.host[:n] = tokens
        self.ids.push(n)
        rows = min(n, self.block_size)
        k_in, k_out = kv.step(self.pos, n)
        if self.window is not None:  # may compact first: self.pos is a commit point
            w_in, w_out = self.window.step(self.pos, n)
            k_in, k_out = {**k_in, **w_in}, {**k_out, **w_out}
        # a hybrid target: the state before the step in, the state after each of its last min(n, W) rows out
        s_in, s_out = self.states.step(n, in_place) if self.states is not None else ({}, {})
        self.last_rows = n
        staged = n <= self.block_size  # decode and verify steps: bound views that do not move (docstring)
        ctx = self.context_stage.rows(0, n) if staged else self.context.rows(c, c + n)
        self.target.run({self._t_ids: self.ids.rows(0, n), **k_in, **s_in},
                        {self._t_next: self.next_ids.rows(0, n), self._t_ctx: ctx,
                         self._t_logits: self.logits_buf.rows(0, rows), **k_out, **s_out})
        if staged:
            self.context.copy_rows(self.context_stage, n, c)
        kv.after(self.pos, n)
        if self.window is not None:
            self.window.after(self.pos, n)
        self.calls = call = self.calls + 1
        return Verified(self.next_ids.pull(n), lambda: self._logits(call, rows))

    def _logits(self, call: int, rows: int) -> np.ndarray:
        """The logits of target call `call`: the buffer holds only the last call's (one buffer, no copies)."""
        if call != self.calls:
            raise Dflash2Error(f"the logits of target call {call} were overwritten by call {self.calls}: read a "
                               "Verified's logits before the next target call")
        return self.logits_buf.pull(rows)

    # --- SpecBackend ---------------------------------------------------------------------------
    def prefill(self, ids: Sequence[int]) -> Verified:
        self.reset()
        if self.window is not None and len(ids) > self.window.step_rows:
            return self._prefill_steps(ids, self.window.step_rows)
        out = self._run_target(ids)
        self.pos, self.pending = len(ids), len(ids)
        if self.states is not None:
            self.states.commit(len(ids), len(ids))
        return out

    def _prefill_steps(self, ids: Sequence[int], step: int) -> Verified:
        """A prompt longer than the window buffer's step in steps of at most `step` rows, each committed (the next
        may compact). The first step takes the remainder, so the last has `step` >= B rows and its logits are the
        prompt's last B rows, as one call's would be."""
        cuts = [0, *range(len(ids) % step or step, len(ids) + 1, step)]
        next_ids = []
        for a, b in zip(cuts, cuts[1:]):
            out = self._run_target(ids[a:b])
            next_ids.append(np.array(out.ids))  # the next call overwrites the buffer the view reads
            self.pos, self.pending = b, b
            if self.states is not None:
                self.states.commit(b - a, b - a)
        return Verified(np.concatenate(next_ids), out.logits)

    def draft(self, anchor: int, uniforms: Sequence[float] | None = None, temperature: float = 0.0) -> Drafted:
        self.anchor.host[0] = anchor
        self.anchor.push(1)
        sampled = uniforms is not None and temperature > 0  # a DFlash2 drafter without the walk is refused at start
        if self.sampled_walk and (sampled or self.walk_sampled):  # greedy rounds after greedy rounds copy nothing
            self._set_walk(uniforms if sampled else 0.0, temperature if sampled else 0.0)
            self.walk_sampled = sampled
        done, kv = 0, self.drafter_kv
        while done < self.pending:  # rows pending after skipped drafts may exceed what one call takes
            n, p = min(self.pending - done, self.max_draft_rows), self.ctx_pos
            k_in, k_out = kv.step(p, n)
            self.drafter.run({self._d_ctx: self.context.rows(done, done + n), **k_in}, k_out)  # the last call counts
            kv.after(p, n)
            self.ctx_pos, done = p + n, done + n
        self.pending = 0
        S = self.block_size - 1
        conf = self.conf.pull(S, wait=False)  # queued: the draft ids' pull below waits for every copy
        q = None
        if sampled and self.has_lattice:
            q = (self.cand_ids.pull(S, wait=False), self.draft_probs.pull(S, wait=False))
        return Drafted(self.draft_ids.pull(S), conf, q)

    def _set_walk(self, uniforms, temperature: float) -> None:
        self.uniforms.host[:] = uniforms
        self.temperature.host[0] = temperature
        self.uniforms.push(self.block_size - 1)
        self.temperature.push(1)

    def verify(self, tokens: Sequence[int]) -> Verified:
        # writes KV rows at pos..pos+S; pos moves at commit. One row is the loop's K = 0 round, which always commits
        # it: a hybrid target's state is then written in place, as a decode's (RowStates; a plain decode step's
        # speed, where the other buffer cost ~2% a step on the reduced Qwen3.5-MoE, measured)
        return self._run_target(tokens, in_place=len(tokens) == 1)

    def commit(self, n: int) -> None:
        self.pos += n
        self.pending += n  # verify's first n context rows join the drafter's next input, in place
        if self.states is not None:  # the state after the last accepted row: a pointer moves, nothing is copied
            self.states.commit(n, self.last_rows)

    def decode(self, token: int) -> Verified:
        out = self._run_target([token], in_place=True)  # always committed: its state may overwrite the one it read
        self.pos += 1
        if self.states is not None:
            self.states.commit(1, 1)
        return out
