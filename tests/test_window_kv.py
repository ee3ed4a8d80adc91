"""Issue 48's windowed KV: the sliding layers' K|V in a bounded buffer compacted at commit points
(manifest.WindowSignature, export.plain.KvLayout, runtime.window.CompactingKv, plan section 3.2).

(a) the binding alone on host buffers: what a step binds, the compaction's row move, rollback after a partial
    accept; (b) the signature record; (c) a tiny Muse-Glimmer pair (dflash2-make-tiny: 3 sliding layers of window 8,
    1 NoPE full layer) exported by dflash2-export (windowed: the default; and with --window-kv off, every layer
    unbounded, to compare), run by the runtime far past the window: the window buffer's shape and every view it
    binds stay within its capacity, greedy ids equal transformers' and the unbounded export's, speculative decoding
    (every accepted count, and the pair's own drafter) equals greedy; (d) the same for a tiny gpt-oss pair (sinks on the sliding layers too)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from dflash2 import manifest as mf
from dflash2.errors import Dflash2Error
from dflash2.export import signature as sg
from dflash2.manifest.jsonio import _convert, _plain
from dflash2.runtime.memory import HostBuffer
from dflash2.runtime import window
from dflash2.manifest import window as window_rule
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

@pytest.fixture
def unaligned(monkeypatch):
    """ALIGN 1: base = pos - keep exactly at a compaction (the mechanics below count rows that way)."""
    monkeypatch.setattr(window, "ALIGN", 1)
    monkeypatch.setattr(window_rule, "ALIGN", 1)  # the capacity rule reads it there


@pytest.mark.parametrize("fixed", [False, True])
@pytest.mark.parametrize("align", [1, window.ALIGN])
def test_steps_compact_at_commit_points_and_roll_back_exactly(fixed, align, monkeypatch):
    """Random verifies of 1..B rows, each accepted in part: before every step the valid rows are exactly the last
    min(pos, ...) committed positions in order, the past view never holds a rejected row, and no view passes C;
    the base always a multiple of ALIGN (row invariance: runtime/window.py)."""
    monkeypatch.setattr(window, "ALIGN", align)
    monkeypatch.setattr(window_rule, "ALIGN", align)  # the capacity rule reads it there
    B = 8
    kv = CompactingKv(window_sig(fixed=fixed), HostBackend(), ROW, B, np.float32)
    step, C = window_rows(window_sig(), B)
    assert (step, C) == (8, 7 + align - 1 + 16) and kv.buffer.shape == (C, *ROW)
    rng, pos = np.random.default_rng(0), 0
    write(kv, 0, 5)
    pos = 5
    for _ in range(300):
        n = int(rng.integers(1, B + 1))
        ins, outs = write(kv, pos, n)
        v = pos - kv.base
        assert 0 <= kv.base <= pos and v >= min(pos, kv.keep) and kv.base % align == 0  # every visible row there
        if fixed:
            assert kv.length.host[0] == v and kv.base_buf.host[0] == kv.base
        else:
            (past,) = ins.values()
            assert past.shape == (v, *ROW) and past.ptr == kv.buffer.ptr
        np.testing.assert_array_equal(kv.buffer.host[:v], rows_at(kv, range(kv.base, pos)))
        pos += int(rng.integers(0, n + 1))  # accept a of n (0: the whole verify rejected)
    assert kv.compactions > (20 if align == 1 else 5) and kv.high <= C


def test_compaction_moves_the_last_keep_rows(unaligned):
    kv = CompactingKv(window_sig(keep=7), HostBackend(), ROW, 8, np.float32)
    write(kv, 0, 8)
    write(kv, 8, 8)  # v = 16
    write(kv, 16, 7)  # 16 + 7 = 23 rows: fits, nothing moves
    assert (kv.base, kv.compactions, kv.high) == (0, 0, 23)
    write(kv, 23, 1)  # 23 + 1 > 23: rows [16, 23) -> [0, 7), base 16
    assert (kv.base, kv.compactions) == (16, 1)
    np.testing.assert_array_equal(kv.buffer.host[:8], rows_at(kv, range(16, 24)))


def test_an_overlapping_move_keeps_every_row(monkeypatch, unaligned):
    """keep > step (Muse-Glimmer's 2047 against steps of 512): the rows moved overlap their new place."""
    from dflash2.runtime import window

    monkeypatch.setattr(window, "MAX_STEP", 4)
    monkeypatch.setattr(window_rule, "MAX_STEP", 4)  # the capacity rule reads it there
    kv = CompactingKv(window_sig(keep=7), HostBackend(), ROW, 2, np.float32)
    assert (kv.step_rows, kv.capacity) == (4, 15)
    for p in range(0, 12):
        write(kv, p, 1)
    write(kv, 12, 4)  # 12 + 4 > 15: rows [5, 12) -> [0, 7), overlapping
    assert kv.base == 5
    np.testing.assert_array_equal(kv.buffer.host[:11], rows_at(kv, range(5, 16)))


def test_the_binding_refuses_what_it_cannot_do(unaligned):
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
    assert "s.window: expected none (only a target or drafter graph" in " ".join(
        mf.Signature({}, {}, None, window=window_sig()).problems("s", None, "selector"))


# --- (c) a tiny Muse-Glimmer pair through the runtime, far past the window ---------------------------------------

BLOCK, PROMPT = 8, [11, 22, 33, 44, 55, 66, 77, 88, 99, 5, 6, 7, 19, 23, 29, 31, 37, 41, 43, 47]  # 20 > window 8
LONG = 400  # new tokens: 50x the window, compacted every 8 or so


@pytest.fixture(scope="module")
def muse(tmp_path_factory):
    """(the export folder, the same pair exported with --window-kv off, the target folder) of dflash2-make-tiny's
    Muse-Glimmer pair: dflash2-export writes the windowed target by default (its sliding layers on the window
    buffer), the unbounded one keeps every layer on the max_seq_len-row KV."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("torch")
    from dflash2 import tiny
    from tests.window_kv_pair import export_pair

    root = tmp_path_factory.mktemp("muse_window")
    target = tiny.make_target(root / "target", family="muse_glimmer")
    drafter = tiny.make_drafter(root / "drafter", target, version=2, block_size=BLOCK)
    export_pair(drafter, target, root / "out", max_seq_len=LONG + 64)
    export_pair(drafter, target, root / "full", window_kv=False, max_seq_len=LONG + 64)
    return root / "out", root / "full", target


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
    """The export's target signatures (both flavours) bind the window buffer; --window-kv off binds none."""
    out, full, _ = muse
    m = mf.load(out, mf.ExportManifest, check_files=False)
    sig, trt = m.graphs["target"].signature, m.graphs["target"].tensorrt_signature
    L = m.kv.rows.target[0]
    assert sig.window.layers == [0, 1, 2] and sig.window.keep == 7 and L == 4  # 3 sliding (window 8), 1 full
    assert sig.kv == sg.KV[("target", "prefix")] and sig.window.base == sg.WINDOW_BASE
    assert trt.window == sg.window_signature("fixed", [0, 1, 2], 7) and trt.kv == sg.KV[("target", "fixed")]
    assert mf.load(full, mf.ExportManifest, check_files=False).graphs["target"].signature.window is None
    rows = m.validation["target.rows"]
    assert rows.ok and rows.steps["window_compactions"] >= 2  # the row check crossed compactions


def test_greedy_far_past_the_window_equals_the_unbounded_export_and_transformers(muse):
    """The windowed session's greedy ids = the export's (every layer on the full KV) over LONG tokens, and =
    transformers' generate over the first 64; the window buffer never holds more than its capacity."""
    import torch
    from transformers import MuseGlimmerForConditionalGeneration

    from dflash2.runtime.api import Runtime
    from dflash2.speculative import generate
    from tests.window_kv_pair import windowed_session

    out, full, target = muse
    rt = Runtime(full)
    rt.manifest.eos_token_ids = []
    truth = rt.generate(PROMPT, LONG, speculative=False).ids
    s = windowed_session(out)
    s.manifest.eos_token_ids = []
    C = s.window.capacity
    assert s.window.buffer.shape == (C, 3, 2, 2, 16) and C == 7 + window.ALIGN - 1 + 2 * BLOCK  # [C, Lw, 2, kv, hd]
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

    out, _, _ = muse
    base = windowed_session(out)
    base.manifest.eos_token_ids = []
    truth = generate(base, PROMPT, LONG, speculative=False).ids
    s = windowed_session(out, cls=Planned.make(SpecSession), truth=truth, plan=list(range(BLOCK)) + [3, 0, 7, 1])
    g = generate(s, PROMPT, LONG)
    assert g.ids == truth and set(g.stats.accepted) >= set(range(BLOCK))
    assert s.window.compactions >= LONG // (s.window.capacity - 7) - 1 and s.window.high <= s.window.capacity
    addresses = s.buffers()
    assert generate(s, PROMPT, 40, draft_len=BLOCK - 1).ids == truth[:40]  # the pair's own drafter
    assert s.buffers() == addresses  # nothing reallocated: compaction moves rows inside the buffer


def test_the_check_sees_a_window_one_row_short(muse, monkeypatch):
    """keep = W - 2 (one visible row dropped at each compaction): the greedy ids differ, so the tests above can
    fail on a wrong keep. ALIGN 1 here: an aligned base keeps up to ALIGN - 1 rows more than keep, hiding it."""
    from dflash2.speculative import generate
    from tests.window_kv_pair import windowed_session

    monkeypatch.setattr(window, "ALIGN", 1)

    monkeypatch.setattr(window_rule, "ALIGN", 1)  # the capacity rule reads it there
    out, _, _ = muse
    sig = mf.load(out, mf.ExportManifest, check_files=False).graphs["target"].signature
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
    from tests.window_kv_pair import windowed_session

    out, _, _ = muse
    base = windowed_session(out)
    base.manifest.eos_token_ids = []
    truth = generate(base, PROMPT, LONG, speculative=False).ids
    s = windowed_session(out, fixed=True, cls=Planned.make(SpecSession), truth=truth, plan=list(range(BLOCK)))
    assert s.target_sig.window.length == sg.WINDOW_LEN and s.target_sig.kv.kind == "fixed"
    s.window.buffer.host[...] = 1e4  # garbage where no row was written yet
    g = generate(s, PROMPT, LONG)
    assert g.ids == truth and set(g.stats.accepted) >= set(range(BLOCK)) and s.window.compactions > 3


# --- (d) a tiny gpt-oss pair: sliding and full layers alternating, a sink column on both -------------------------

@pytest.mark.slow
def test_gpt_oss_with_the_window_buffer_equals_its_unbounded_export(tmp_path_factory):
    """dflash2-make-tiny's gpt-oss pair (window 8 on every other layer): greedy far past the window = the export's
    own greedy, and speculative decoding with every accepted count = greedy, the window buffer bounded. Two exports:
    ~55 s on a loaded 2-core machine (test_gpt_oss_export checks the default export's window binding quickly)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("torch")
    from dflash2 import tiny
    from dflash2.runtime.api import Runtime
    from dflash2.runtime.session import SpecSession
    from dflash2.speculative import generate
    from tests.window_kv_pair import export_pair, windowed_session

    root = tmp_path_factory.mktemp("oss_window")
    target = tiny.make_target(root / "target", family="gpt_oss")
    drafter = tiny.make_drafter(root / "drafter", target, version=2, block_size=BLOCK)
    m = export_pair(drafter, target, root / "out", max_seq_len=LONG + 64)
    export_pair(drafter, target, root / "full", window_kv=False, max_seq_len=LONG + 64)
    sig, L = m.graphs["target"].signature, m.kv.rows.target[0]
    assert sig.window.layers == list(range(0, L, 2)) and sig.window.keep == 7
    assert m.validation["target.rows"].ok and m.validation["target.rows"].steps["window_compactions"] >= 2
    rt = Runtime(root / "full")
    rt.manifest.eos_token_ids = []
    truth = rt.generate(PROMPT, LONG, speculative=False).ids
    s = windowed_session(root / "out", cls=Planned.make(SpecSession), truth=truth, plan=list(range(BLOCK)) + [2])
    s.manifest.eos_token_ids = []
    g = generate(s, PROMPT, LONG)
    assert g.ids == truth and set(g.stats.accepted) >= set(range(BLOCK))
    assert s.window.compactions >= 4 and s.window.high <= s.window.capacity == 7 + window.ALIGN - 1 + 2 * BLOCK


def test_a_prefill_in_steps_returns_the_prompts_last_logits_rows(muse):
    """A 20-row prompt prefilled in window steps of 8 (4 + 8 + 8): the same next ids and the same last-B logits rows
    (what sampling reads) as the unbounded export's one-call prefill."""
    from dflash2.runtime.api import Runtime
    from tests.window_kv_pair import windowed_session

    out, full, _ = muse
    whole = Runtime(full).session.prefill(PROMPT)
    want_ids, want_logits = np.array(whole.ids), np.array(whole.logits())
    s = windowed_session(out)
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
