"""Issue 48's windowed KV: the sliding layers' K|V in a bounded buffer compacted at commit points
(manifest.WindowSignature, export.plain.KvLayout, runtime.window.CompactingKv, plan section 3.2).

(a) the binding alone on host buffers: what a step binds, the compaction's row move, rollback after a partial
    accept; (b) the signature record; (c) a tiny Muse-Glimmer pair (dflash2-make-tiny: 3 sliding layers of window 8,
    1 NoPE full layer) through dflash2-export, its target rebuilt with the window buffer, run by the runtime far past
    the window: the window buffer's shape and every view it binds stay within its capacity, greedy ids equal
    transformers' and the unbounded export's, speculative decoding (every accepted count, and the pair's own
    drafter) equals greedy; (d) the same for a tiny gpt-oss pair (sinks on the sliding layers too)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from dflash2 import manifest as mf
from dflash2.errors import Dflash2Error
from dflash2.export import signature as sg
from dflash2.manifest.jsonio import _convert, _plain
from dflash2.runtime.memory import HostBuffer
from dflash2.runtime.window import CompactingKv, window_rows

ROW = [3, 2, 1, 2]  # [Lw, 2, kv, hd]


class HostBackend:
    def device_buffer(self, shape, dtype):
        return HostBuffer(shape, dtype)

    host_buffer = device_buffer


def window_sig(keep: int = 7, fixed: bool = False) -> mf.WindowSignature:
    return sg.window_signature("fixed" if fixed else "prefix", [0, 1, 2], keep)


def rows_at(kv: CompactingKv, positions) -> np.ndarray:
    """What the buffer must hold for real positions (each row filled with its position)."""
    return np.stack([np.full(ROW, p, np.float32) for p in positions])


def write(kv: CompactingKv, pos: int, n: int) -> tuple[dict, dict]:
    """One step as the graph would run it: its rows filled with their real positions."""
    ins, outs = kv.step(pos, n)
    (view,) = outs.values()
    assert view.shape == (n, *ROW)
    at = (view.ptr - kv.buffer.ptr) // kv.buffer.row_bytes if kv.staging is None else None
    target = kv.buffer.host[at:at + n] if at is not None else kv.staging.host[:n]
    target[...] = rows_at(kv, range(pos, pos + n))
    kv.after(pos, n)
    return ins, outs


# --- (a) the binding --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fixed", [False, True])
def test_steps_compact_at_commit_points_and_roll_back_exactly(fixed):
    """Random verifies of 1..B rows, each accepted in part: before every step the valid rows are exactly the last
    min(pos, ...) committed positions in order, the past view never holds a rejected row, and no view passes C."""
    B = 8
    kv = CompactingKv(window_sig(fixed=fixed), HostBackend(), ROW, B, np.float32)
    step, C = window_rows(window_sig(), B)
    assert (step, C) == (8, 7 + 16) and kv.buffer.shape == (C, *ROW)
    rng, pos = np.random.default_rng(0), 0
    write(kv, 0, 5)
    pos = 5
    for _ in range(300):
        n = int(rng.integers(1, B + 1))
        ins, outs = write(kv, pos, n)
        v = pos - kv.base
        assert 0 <= kv.base <= pos and v >= min(pos, kv.keep)  # every row a query can see is there
        if fixed:
            assert kv.length.host[0] == v and kv.base_buf.host[0] == kv.base
        else:
            (past,) = ins.values()
            assert past.shape == (v, *ROW) and past.ptr == kv.buffer.ptr
        np.testing.assert_array_equal(kv.buffer.host[:v], rows_at(kv, range(kv.base, pos)))
        pos += int(rng.integers(0, n + 1))  # accept a of n (0: the whole verify rejected)
    assert kv.compactions > 20 and kv.high <= C


def test_compaction_moves_the_last_keep_rows():
    kv = CompactingKv(window_sig(keep=7), HostBackend(), ROW, 8, np.float32)
    write(kv, 0, 8)
    write(kv, 8, 8)  # v = 16
    write(kv, 16, 7)  # 16 + 7 = 23 rows: fits, nothing moves
    assert (kv.base, kv.compactions, kv.high) == (0, 0, 23)
    write(kv, 23, 1)  # 23 + 1 > 23: rows [16, 23) -> [0, 7), base 16
    assert (kv.base, kv.compactions) == (16, 1)
    np.testing.assert_array_equal(kv.buffer.host[:8], rows_at(kv, range(16, 24)))


def test_an_overlapping_move_keeps_every_row(monkeypatch):
    """keep > step (Muse-Glimmer's 2047 against steps of 512): the rows moved overlap their new place."""
    from dflash2.runtime import window

    monkeypatch.setattr(window, "MAX_STEP", 4)
    kv = CompactingKv(window_sig(keep=7), HostBackend(), ROW, 2, np.float32)
    assert (kv.step_rows, kv.capacity) == (4, 15)
    for p in range(0, 12):
        write(kv, p, 1)
    write(kv, 12, 4)  # 12 + 4 > 15: rows [5, 12) -> [0, 7), overlapping
    assert kv.base == 5
    np.testing.assert_array_equal(kv.buffer.host[:11], rows_at(kv, range(5, 16)))


def test_the_binding_refuses_what_it_cannot_do():
    kv = CompactingKv(window_sig(), HostBackend(), ROW, 8, np.float32)
    with pytest.raises(Dflash2Error, match="window KV: a step of 9 rows, expected at most 8"):
        kv.step(0, 9)
    write(kv, 0, 8)
    write(kv, 8, 8)
    write(kv, 16, 8)  # compacted: base 9
    with pytest.raises(Dflash2Error, match="window KV: a step at position 3 before the buffer's first row "
                                           r"\(position 9\)"):
        kv.step(3, 1)
    with pytest.raises(Dflash2Error, match="window.kind expected 'compacting', found 'ring'"):
        CompactingKv(dataclasses.replace(window_sig(), kind="ring"), HostBackend(), ROW, 8, np.float32)


# --- (b) the signature record -----------------------------------------------------------------------------------

def test_the_signature_records_the_window_and_round_trips():
    ins = [sg.INPUT_IDS, sg.PAST_KV, sg.PAST_WINDOW_KV, sg.WINDOW_BASE]
    outs = [sg.NEXT_IDS, sg.CONTEXT, sg.NEW_KV, sg.LOGITS, sg.NEW_WINDOW_KV]
    sig = sg.signature("target", "prefix", ins, outs, window=([0, 1, 2], 7))
    assert sig.window == mf.WindowSignature("compacting", [sg.PAST_WINDOW_KV], [sg.NEW_WINDOW_KV], sg.WINDOW_BASE,
                                            [0, 1, 2], 7)
    assert sig.names() == (set(ins), set(outs)) and sig.problems("t", None, "target") == []
    problems: list[str] = []
    back = _convert(mf.Signature, json.loads(json.dumps(_plain(sig))), "t", problems)
    assert problems == [] and back == sig and isinstance(back.window, mf.WindowSignature)
    with pytest.raises(ValueError, match=r"tensors \['new_window_kv', 'past_window_kv'|unnamed by the contract"):
        sg.signature("target", "prefix", ins, outs)  # the window tensors without the binding: a builder bug
    fixed = sg.signature("target", "fixed", [sg.INPUT_IDS, sg.KV_CACHE, sg.PAST_LEN, sg.WINDOW_CACHE, sg.WINDOW_LEN,
                                              sg.WINDOW_BASE], outs, window=([1], 3))
    assert fixed.window.length == sg.WINDOW_LEN and fixed.window.past == [sg.WINDOW_CACHE]


@pytest.mark.parametrize("change, want", [
    ({"kind": "ring"}, "t.window.kind: expected one of ['compacting'], found 'ring'"),
    ({"layers": [1, 1]}, "t.window.layers: expected distinct layer indices >= 0 (at least one), found [1, 1]"),
    ({"layers": []}, "t.window.layers: expected distinct layer indices >= 0 (at least one), found []"),
    ({"keep": -1}, "t.window.keep: expected >= 0, found -1"),
    ({"past": ["a", "b"]}, "t.window.past: expected one tensor, found ['a', 'b']"),
    ({"base": sg.PAST_WINDOW_KV}, "t.window: expected distinct tensor names"),
])
def test_problems_name_each_broken_field(change, want):
    w = dataclasses.replace(window_sig(), **change)
    sig = mf.Signature({"ids": sg.INPUT_IDS}, {}, sg.KV[("target", "prefix")], window=w)
    assert any(p.startswith(want) for p in sig.problems("t", None)), sig.problems("t", None)
    assert "d.window: expected none (only a target graph" in " ".join(
        mf.Signature({}, {}, sg.KV[("drafter", "prefix")], window=window_sig()).problems("d", None, "drafter"))


# --- (c) a tiny Muse-Glimmer pair through the runtime, far past the window ---------------------------------------

BLOCK, PROMPT = 8, [11, 22, 33, 44, 55, 66, 77, 88, 99, 5, 6, 7, 19, 23, 29, 31, 37, 41, 43, 47]  # 20 > window 8
LONG = 400  # new tokens: 50x the window, compacted every 8 or so


@pytest.fixture(scope="module")
def muse(tmp_path_factory):
    """(export folder, target folder, the windowed target's signature) of dflash2-make-tiny's Muse-Glimmer pair."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("torch")
    from dflash2 import tiny
    from dflash2.export.api import export
    from tests.window_kv_pair import build_windowed

    root = tmp_path_factory.mktemp("muse_window")
    target = tiny.make_target(root / "target", family="muse_glimmer")
    drafter = tiny.make_drafter(root / "drafter", target, version=2, block_size=BLOCK)
    export(drafter, target, root / "out", max_seq_len=LONG + 64, quiet=True)
    return root / "out", target, build_windowed(root / "out", target, drafter, "muse_glimmer")


class Planned:
    """Drafts = greedy's continuation with a planned number right: every accepted count 0..S occurs."""

    @staticmethod
    def make(base):
        class PlannedDrafts(base):
            def __init__(self, *a, truth, plan, **kw):
                super().__init__(*a, **kw)
                self.truth, self.plan, self.r = truth, plan, 0

            def draft(self, anchor, uniforms=None, temperature=0.0):
                from dflash2.speculative import Drafted

                d = super().draft(anchor)  # the real drafter runs: its context rows are consumed
                S, start = self.block_size - 1, self.pos - len(PROMPT) + 1
                good = self.plan[self.r % len(self.plan)]
                self.r += 1
                nxt = (self.truth[start: start + S] + [0] * S)[:S]
                return Drafted([t if k < good else (t + 1) % self.vocab_size for k, t in enumerate(nxt)],
                               d.confidence)
        return PlannedDrafts


def test_the_windowed_graph_declares_its_window(muse):
    out, _, sig = muse
    m = mf.load(out, mf.ExportManifest, check_files=False)
    L = m.kv.rows.target[0]
    assert sig.window.layers == [0, 1, 2] and sig.window.keep == 7 and L == 4  # 3 sliding (window 8), 1 full
    assert sig.kv == sg.KV[("target", "prefix")] and sig.window.base == sg.WINDOW_BASE


def test_greedy_far_past_the_window_equals_the_unbounded_export_and_transformers(muse):
    """The windowed session's greedy ids = the export's (every layer on the full KV) over LONG tokens, and =
    transformers' generate over the first 64; the window buffer never holds more than its capacity."""
    import torch
    from transformers import MuseGlimmerForConditionalGeneration

    from dflash2.runtime.api import Runtime
    from dflash2.speculative import generate
    from tests.window_kv_pair import windowed_session

    out, target, sig = muse
    rt = Runtime(out)
    rt.manifest.eos_token_ids = []
    truth = rt.generate(PROMPT, LONG, speculative=False).ids
    s = windowed_session(out, sig)
    s.manifest.eos_token_ids = []
    C = s.window.capacity
    assert s.window.buffer.shape == (C, 3, 2, 2, 16) and C == 7 + 2 * BLOCK  # [C, Lw, 2, kv, hd]
    assert s.target_kv.buffer.shape[1] == 1  # the full layer alone on the max_seq_len buffer
    assert generate(s, PROMPT, LONG, speculative=False).ids == truth
    assert s.window.high <= C and s.window.compactions >= LONG // (C - 7) - 1  # a decode compacts every C - keep
    hf = MuseGlimmerForConditionalGeneration.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=64, min_new_tokens=64, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    assert truth[:64] == want[0, len(PROMPT):].tolist()


def test_speculative_decoding_with_rollbacks_across_compactions_equals_greedy(muse):
    """Every accepted count 0..S (planned drafts: verifies rejected in part right after and before compactions),
    and the pair's own drafter: the ids of the windowed session's own greedy run."""
    from dflash2.runtime.session import SpecSession
    from dflash2.speculative import generate
    from tests.window_kv_pair import windowed_session

    out, _, sig = muse
    base = windowed_session(out, sig)
    base.manifest.eos_token_ids = []
    truth = generate(base, PROMPT, LONG, speculative=False).ids
    s = windowed_session(out, sig, Planned.make(SpecSession), truth=truth, plan=list(range(BLOCK)) + [3, 0, 7, 1])
    g = generate(s, PROMPT, LONG)
    assert g.ids == truth and set(g.stats.accepted) >= set(range(BLOCK))
    assert s.window.compactions > 20 and s.window.high <= s.window.capacity
    addresses = s.buffers()
    assert generate(s, PROMPT, 40, draft_len=BLOCK - 1).ids == truth[:40]  # the pair's own drafter
    assert s.buffers() == addresses  # nothing reallocated: compaction moves rows inside the buffer


def test_the_check_sees_a_window_one_row_short(muse):
    """keep = W - 2 (one visible row dropped at each compaction): the greedy ids differ, so the tests above can
    fail on a wrong keep."""
    from dflash2.speculative import generate
    from tests.window_kv_pair import windowed_session

    out, _, sig = muse
    short = dataclasses.replace(sig, window=dataclasses.replace(sig.window, keep=sig.window.keep - 1))
    good, bad = windowed_session(out, sig), windowed_session(out, short)
    for s in (good, bad):
        s.manifest.eos_token_ids = []
    assert generate(good, PROMPT, 120, speculative=False).ids != generate(bad, PROMPT, 120, speculative=False).ids


def test_the_fixed_flavour_with_stale_rows_gives_the_same_ids(muse):
    """The TensorRT flavour (the whole window buffer + window_len, stale rows after every query) through the fixed
    binding: its rows beyond the valid ones hold a rejected verify's rows and compacted leftovers."""
    from dflash2.runtime.session import SpecSession
    from dflash2.speculative import generate
    from tests.window_kv_pair import build_windowed, windowed_session

    out, target, sig = muse
    m = mf.load(out, mf.ExportManifest, check_files=False)
    fixed = build_windowed(out, target, Path(m.sources.drafter), "muse_glimmer", fixed=True)
    assert fixed.window.length == sg.WINDOW_LEN and fixed.kv.kind == "fixed"
    base = windowed_session(out, sig)
    base.manifest.eos_token_ids = []
    truth = generate(base, PROMPT, 120, speculative=False).ids
    s = windowed_session(out, fixed, Planned.make(SpecSession), truth=truth, plan=list(range(BLOCK)))
    s.window.buffer.host[...] = 1e4  # garbage where no row was written yet
    g = generate(s, PROMPT, 120)
    assert g.ids == truth and set(g.stats.accepted) >= set(range(BLOCK)) and s.window.compactions > 3


# --- (d) a tiny gpt-oss pair: sliding and full layers alternating, a sink column on both -------------------------

def test_gpt_oss_with_the_window_buffer_equals_its_unbounded_export(tmp_path_factory):
    """dflash2-make-tiny's gpt-oss pair (window 8 on every other layer): greedy far past the window = the export's
    own greedy, and speculative decoding with every accepted count = greedy, the window buffer bounded."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("torch")
    from dflash2 import tiny
    from dflash2.export.api import export
    from dflash2.runtime.api import Runtime
    from dflash2.runtime.session import SpecSession
    from dflash2.speculative import generate
    from tests.window_kv_pair import build_windowed, windowed_session

    root = tmp_path_factory.mktemp("oss_window")
    target = tiny.make_target(root / "target", family="gpt_oss")
    drafter = tiny.make_drafter(root / "drafter", target, version=2, block_size=BLOCK)
    export(drafter, target, root / "out", max_seq_len=160, quiet=True)
    sig = build_windowed(root / "out", target, drafter, "gpt_oss")
    L = mf.load(root / "out", mf.ExportManifest, check_files=False).kv.rows.target[0]
    assert sig.window.layers == list(range(0, L, 2)) and sig.window.keep == 7
    rt = Runtime(root / "out")
    rt.manifest.eos_token_ids = []
    truth = rt.generate(PROMPT, 120, speculative=False).ids
    s = windowed_session(root / "out", sig, Planned.make(SpecSession), truth=truth, plan=list(range(BLOCK)) + [2])
    s.manifest.eos_token_ids = []
    g = generate(s, PROMPT, 120)
    assert g.ids == truth and set(g.stats.accepted) >= set(range(BLOCK))
    assert s.window.compactions > 5 and s.window.high <= s.window.capacity == 7 + 2 * BLOCK


def test_a_prefill_in_steps_returns_the_prompts_last_logits_rows(muse):
    """A 20-row prompt prefilled in window steps of 8 (4 + 8 + 8): the same next ids and the same last-B logits rows
    (what sampling reads) as the unbounded export's one-call prefill."""
    from dflash2.runtime.api import Runtime
    from tests.window_kv_pair import windowed_session

    out, _, sig = muse
    whole = Runtime(out).session.prefill(PROMPT)
    want_ids, want_logits = np.array(whole.ids), np.array(whole.logits())
    s = windowed_session(out, sig)
    got = s.prefill(PROMPT)
    assert len(PROMPT) > s.window.step_rows and s.pos == s.pending == len(PROMPT)
    assert np.array_equal(got.ids, want_ids) and got.logits().shape == want_logits.shape == (BLOCK, 384)
    assert np.abs(got.logits() - want_logits).max() < 1e-4


def test_the_cuda_move_never_copies_overlapping_ranges(monkeypatch):
    """DeviceBuffer.move_rows with cudaMemcpyAsync simulated on host memory (no GPU here): each copy's source and
    target are disjoint (overlap is undefined for cudaMemcpy) and the rows arrive as numpy's overlapping copy."""
    import ctypes
    import types

    cuda = pytest.importorskip("dflash2.runtime.cuda")
    copies = []

    def memcpy(dst, src, nbytes, kind, stream):
        assert dst + nbytes <= src or src + nbytes <= dst, "overlapping cudaMemcpyAsync"
        ctypes.memmove(dst, src, nbytes)
        copies.append(nbytes)
        return (0,)

    rt = types.SimpleNamespace(cudaMemcpyAsync=memcpy,
                               cudaMemcpyKind=types.SimpleNamespace(cudaMemcpyDeviceToDevice=3))
    monkeypatch.setattr(cuda, "cudart", lambda: rt)
    monkeypatch.setattr(cuda, "call", lambda result, what: result)
    for src, n in ((5, 7), (9, 7), (1, 30), (3, 0)):
        memory = np.arange(40 * 4, dtype=np.float32).reshape(40, 4)
        buf = object.__new__(cuda.DeviceBuffer)
        buf._layout((40, 4), np.float32)
        buf.ptr, buf.stream = memory.ctypes.data, types.SimpleNamespace(handle=None)
        want = memory.copy()
        want[:n] = want[src:src + n].copy()
        copies.clear()
        buf.move_rows(src, n, 0)
        np.testing.assert_array_equal(memory, want)
        assert len(copies) == (-(-n // src) if n else 0)
