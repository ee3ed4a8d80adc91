"""Issue 48 for drafters: a drafter whose every layer slides keeps its context KV in the window buffer
(manifest.WindowSignature on the drafter's signature, runtime.window.CompactingKv, export.fused_drafter.sliding).

(a) the record: the drafter's binding and the problems that name each broken field; (b) a tiny Muse-Glimmer target
with a z-lab-format DFlash2 drafter whose 2 layers slide (causal, window 8), exported by dflash2-export (the
windowed drafter: the default) and with --window-kv off (every context row kept), run speculatively far past the
window: the drafter's raw drafts and the accepted count are the same in every round, the window buffer compacts
and stays within its capacity, holds exactly the committed rows after every rejected verify, and its bytes do
not grow with max_seq_len. Meta's format (inclusive, bidirectional window) against transformers' own DFlash loop:
tests/test_meta_assistant_export.py."""

from __future__ import annotations

import numpy as np
import pytest

from dflash2 import manifest as mf
from dflash2.errors import Dflash2Error
from dflash2.export import signature as sg

BLOCK, WINDOW, LONG = 8, 8, 400
PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 5, 6, 7, 19, 23, 29, 31, 37, 41, 43, 47]  # 20 > window 8


# --- (a) the record -----------------------------------------------------------------------------------------------

def drafter_sig(**change) -> mf.Signature:
    ins = [sg.CONTEXT, sg.PAST_CTX_KV, sg.ANCHOR, sg.WINDOW_BASE]
    outs = [sg.DRAFT_IDS, sg.CONFIDENCE, sg.NEW_CTX_KV]
    s = sg.signature("drafter", "prefix", ins, outs, window=([0, 1], 7))
    for k, v in change.items():
        setattr(s.window, k, v)
    return s


def test_the_drafter_binding_takes_over_its_kv_tensors():
    s = drafter_sig()
    assert s.window == mf.WindowSignature("compacting", [sg.PAST_CTX_KV], [sg.NEW_CTX_KV], sg.WINDOW_BASE, [0, 1], 7)
    assert s.problems("drafter signature", None, "drafter") == []
    fixed = sg.window_signature("fixed", [0], 3, graph="drafter")
    assert (fixed.past, fixed.length) == ([sg.CTX_KV_CACHE], sg.PAST_LEN)


@pytest.mark.parametrize("change, want", [
    ({"past": [sg.PAST_WINDOW_KV]}, "d.window.past: expected the drafter's kv.past ['past_ctx_kv'] (the window "
                                    "buffer replaces the context KV), found ['past_window_kv']"),
    ({"present": [sg.NEW_WINDOW_KV]}, "d.window.present: expected the drafter's kv.present ['new_ctx_kv']"),
    ({"layers": [1, 0]}, "d.window.layers: expected every drafter layer in order 0 .. 1 (a drafter whose every "
                         "layer slides), found [1, 0]"),
    ({"keep": -2}, "d.window.keep: expected >= 0, found -2"),
])
def test_a_bad_drafter_binding_names_the_field(change, want):
    got = drafter_sig(**change).problems("d", None, "drafter")
    assert any(p.startswith(want) for p in got), got


# --- (b) through dflash2-export and the runtime ------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(windowed export, --window-kv off export) of the tiny Muse-Glimmer target + a 2-layer DFlash2 drafter whose
    layers both slide (z-lab's config: layer_types + sliding_window; causal)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("torch")
    from dflash2 import tiny
    from tests.window_kv_pair import export_pair

    root = tmp_path_factory.mktemp("drafter_window")
    target = tiny.make_target(root / "target", family="muse_glimmer")
    drafter = tiny.make_drafter(root / "drafter", target, version=2, num_layers=2, block_size=BLOCK,
                                extra={"layer_types": ["sliding_attention"] * 2, "sliding_window": WINDOW})
    export_pair(drafter, target, root / "out", max_seq_len=LONG + 64)
    export_pair(drafter, target, root / "full", window_kv=False, max_seq_len=LONG + 64)
    return root / "out", root / "full"


def test_the_plan_says_the_drafter_window(pair):
    from dflash2.cli import export as export_cli
    from tests.test_window_export import cli

    root = pair[0].parent
    args = ["--model", str(root / "drafter"), "--target", str(root / "target"), "--out", str(root / "never"), "--print"]
    assert f"drafter: every layer slides, its context KV in a bounded buffer (keep {WINDOW - 1} rows)" in cli(
        export_cli.main, *args)
    assert "drafter: every layer" not in cli(export_cli.main, *args, "--window-kv", "off")
    assert not (root / "never").exists()


def test_the_export_binds_the_drafter_window_and_validates_it(pair):
    out, full = pair
    m, f = (mf.load(p, mf.ExportManifest) for p in pair)
    d = m.graphs["drafter"]
    assert d.signature.window == mf.WindowSignature("compacting", [sg.PAST_CTX_KV], [sg.NEW_CTX_KV], sg.WINDOW_BASE,
                                                    [0, 1], WINDOW - 1)
    assert sg.WINDOW_BASE in [i.name for i in d.inputs] and d.tensorrt_signature.window is None
    assert list(m.drafter_config["layer_window"]) == [WINDOW] * 2
    assert all(v.ok for v in m.validation.values()), m.validation
    assert f.graphs["drafter"].signature.window is None and sg.WINDOW_BASE not in [i.name for i in
                                                                                   f.graphs["drafter"].inputs]


def run(folder, keep: int | None = None):
    """(session, every round's raw drafts: the drafter graph's ids before any verify, generation) of LONG tokens
    speculatively; keep: the drafter window's keep forced (a negative control)."""
    from dflash2.speculative import generate
    from tests.window_kv_pair import windowed_session

    s = windowed_session(folder)
    s.manifest.eos_token_ids = []
    if keep is not None:
        s.drafter_kv.keep = keep
    drafts, draft = [], s.draft

    def spy(anchor, *a, **kw):
        d = draft(anchor, *a, **kw)
        drafts.append(list(d.ids))
        return d
    s.draft = spy
    return s, drafts, generate(s, PROMPT, LONG)


_FULL: dict = {}


def unwindowed(folder):
    if folder not in _FULL:
        _FULL[folder] = run(folder)
    return _FULL[folder]


@pytest.fixture
def align(request, monkeypatch):
    """The window buffer's base alignment: 64 (runtime/window.py) or 1 (base = pos - keep exactly: the buffer
    holds no slack rows beyond keep after a compaction, so a wrong keep or base shows)."""
    from dflash2.manifest import window as window_rule
    from dflash2.runtime import window

    monkeypatch.setattr(window, "ALIGN", request.param)
    monkeypatch.setattr(window_rule, "ALIGN", request.param)  # the capacity rule reads it there
    return request.param


@pytest.mark.parametrize("align", [1, 64], indirect=True)
def test_drafts_and_accepted_counts_equal_the_unwindowed_drafter_far_past_the_window(pair, align):
    """LONG tokens speculatively (the random drafter is rejected nearly every round: a verify rolled back each
    time): the same raw drafts, accepted counts and ids every round; the drafter's buffer compacted, never past
    its capacity, which is far below the sequence; after the run it holds exactly the committed context rows the
    unwindowed drafter holds at those positions (a rejected verify left nothing in it)."""
    w, w_drafts, w_gen = run(pair[0])
    f, f_drafts, f_gen = unwindowed(pair[1])
    kv = w.drafter_kv
    assert w.drafter_sig.window is not None and f.drafter_sig.window is None
    assert len(w_drafts) > 50 and w_drafts == f_drafts
    assert w_gen.ids == f_gen.ids and w_gen.stats.accepted == f_gen.stats.accepted
    assert kv.compactions >= (3 if align > 1 else 20) and kv.high <= kv.capacity < len(PROMPT) + LONG
    assert min(w_gen.stats.accepted) == 0  # rejected verifies happened
    held = np.array(kv.buffer.pull(w.ctx_pos - kv.base))
    assert w.ctx_pos - kv.base >= WINDOW - 1
    # rounding only (the two exports' targets sum their context rows in other orders): a rejected row there would
    # be another token's, O(1) off
    np.testing.assert_allclose(held, f.ctx_kv.pull(w.ctx_pos)[kv.base:], rtol=0, atol=1e-4)


@pytest.mark.parametrize("align", [1], indirect=True)
def test_a_window_that_keeps_too_few_rows_changes_the_drafts(pair, align):
    """The negative control of the test above: keep 3 instead of W - 1 = 7 and the drafts differ."""
    _, w_drafts, _ = run(pair[0], keep=3)
    assert w_drafts != unwindowed(pair[1])[1]


def test_the_drafter_bytes_do_not_grow_with_max_seq_len(pair):
    from tests.window_kv_pair import windowed_session

    reports = {T: windowed_session(pair[0], max_seq_len=T).kv_report() for T in (1024, 8192, 32768)}
    full = {T: windowed_session(pair[1], max_seq_len=T).kv_report() for T in (1024, 8192)}
    sizes = {r["drafter_bytes"] for r in reports.values()}
    assert len(sizes) == 1 and sizes.pop() < full[1024]["drafter_bytes"] < full[8192]["drafter_bytes"]
    r, row = reports[32768], mf.load(pair[0], mf.ExportManifest, check_files=False).kv.rows.drafter
    assert r["drafter_window_layers"] == [0, 1] and r["drafter_window_rows"] * int(np.prod(row)) * 4 == \
        r["drafter_bytes"]


def test_a_bad_drafter_window_in_the_manifest_is_one_clear_error(pair, tmp_path):
    import shutil
    from tests.exports import edit_manifest

    out = tmp_path / "edited"
    shutil.copytree(pair[0], out)

    def edit(d):
        d["graphs"]["drafter"]["signature"]["window"]["past"] = [sg.PAST_WINDOW_KV]
    edit_manifest(out, edit)
    with pytest.raises(Dflash2Error) as e:
        mf.load(out, mf.ExportManifest)
    assert "window.past: expected the drafter's kv.past ['past_ctx_kv']" in str(e.value), str(e.value)
