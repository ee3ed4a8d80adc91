"""Issue 48's window buffer as users get it: dflash2-make-tiny --family muse_glimmer (3 sliding layers of window 8,
1 full layer), dflash2-export (fp32 and fp16 templates, and --quantize int8's fused graph) writes the windowed target by
default, and dflash2-run on it with a prompt past the window and enough new tokens to compact the buffer several
times: the speculative ids equal --no-spec's, --check-rows holds through compactions, and --json reports the KV
bytes: the full layer's max_seq_len rows and the window buffer's fixed rows (the bound). The manifest's window
binding is checked against the graphs' io (a wrong layer count is one clear error), the export's validation fails
on a window buffer one row short, the engines' profiles hold it (fake TensorRT), and --window-kv off is said in the
plan."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("torch")

from dflash2 import manifest as mf  # noqa: E402
from dflash2.cli import export as export_cli  # noqa: E402
from dflash2.cli import make_tiny as make_tiny_cli  # noqa: E402
from dflash2.cli import run as run_cli  # noqa: E402
from dflash2.errors import Dflash2Error  # noqa: E402
from dflash2.runtime import window  # noqa: E402
from tests.exports import edit_manifest  # noqa: E402

T = 256  # --max-seq-len
PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 5, 6, 7, 19, 23, 29, 31, 37, 41, 43, 47]  # 20 > window 8
NEW = 200  # new tokens: the 86-row buffer (7 + 63 + 2 x 8) compacted every 16..79 of them
KV_ROW = 2 * 2 * 16  # k|v x kv heads x head_dim, per layer and row: times the dtype's bytes


def cli(main, *args: str) -> str:
    """A dflash2 command in this process: its stdout (exit status 0 asserted)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(list(args))
    assert status == 0, out.getvalue()[-2000:]
    return out.getvalue()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("window_export")
    cli(make_tiny_cli.main, "--out", str(root / "pair"), "--family", "muse_glimmer")
    return root


KINDS = {"fp32": [], "fp16": ["--dtype", "float16"], "int8": ["--quantize", "int8"]}  # kind -> dflash2-export flags


def export_once(pair, kind: str):
    """dflash2-export of the module's pair (fp32, --dtype float16 or --quantize int8) into pair/out-KIND, once per
    module."""
    out = pair / f"out-{kind}"
    if not (out / mf.NAME).exists():
        cli(export_cli.main, "--model", str(pair / "pair" / "drafter"), "--target", str(pair / "pair" / "target"),
            "--out", str(out), "--max-seq-len", str(T), "--quiet", *KINDS[kind])
    return out


@pytest.fixture(scope="module", params=["fp32", "fp16", pytest.param("int8", marks=pytest.mark.slow)])
def exported(request, pair):
    return export_once(pair, request.param)


def test_the_export_writes_the_window_binding_and_checks_it(exported):
    m = mf.load(exported, mf.ExportManifest)
    sig = m.graphs["target"].signature
    assert sig.window is not None and sig.window.layers == [0, 1, 2] and sig.window.keep == 7
    shapes = [s.shape for s in m.graphs["target"].inputs if s.name == sig.window.past[0]]
    assert shapes == [["window_past", 3, 2, 2, 16]]
    assert all(v.ok and not v.skipped for v in m.validation.values()), m.validation
    assert m.validation["target.rows"].steps["window_compactions"] >= 2  # the row check crossed compactions
    if m.quantization is None:  # the TensorRT flavour binds the whole window buffer
        trt = m.graphs["target"].tensorrt_signature
        assert trt.window.length == "window_len" and trt.window.past == ["window_cache"]


def test_speculative_equals_no_spec_past_the_window_and_the_buffer_is_bounded(exported):
    ids = ",".join(map(str, PROMPT))
    spec, plain = (json.loads(cli(run_cli.main, str(exported), "--prompt-ids", ids, "--max-new-tokens", str(NEW),
                                  "--json", *flag)) for flag in ((), ("--no-spec",)))
    assert spec["ids"] == plain["ids"] and len(spec["ids"]) == NEW, (spec["stop_reason"], plain["stop_reason"])
    C = 7 + window.ALIGN - 1 + 2 * 8
    row = KV_ROW * (2 if "fp16" in exported.name else 4)
    for run in (spec, plain):
        kv = run["kv"]
        assert kv["window_rows"] == C < len(PROMPT) + NEW and kv["window_rows_used"] <= C
        assert kv["window_bytes"] == C * 3 * row  # the 3 sliding layers: window rows, whatever the length
        assert kv["target_bytes"] == T * 1 * row  # the full layer alone on max_seq_len rows
        assert kv["window_compactions"] >= 2 and kv["window_layers"] == [0, 1, 2]


def test_check_rows_holds_through_compactions(exported):
    out = json.loads(cli(run_cli.main, str(exported), "--check-rows"))
    assert out["row_invariant"] and out["differing"] == 0 and out["window_compactions"] >= 2


def test_a_window_binding_that_disagrees_with_the_graph_is_one_clear_error(pair, tmp_path):
    """The manifest's window.layers one short: refused on load, naming the field, the graph's shape and the rows."""
    import shutil

    src = export_once(pair, "fp32")
    out = tmp_path / "edited"
    shutil.copytree(src, out)

    def edit(d):
        d["graphs"]["target"]["signature"]["window"]["layers"] = [0, 1]
    edit_manifest(out, edit)
    with pytest.raises(Dflash2Error) as e:
        mf.load(out, mf.ExportManifest)
    msg = str(e.value)
    assert ("window: past_window_kv expected shape [rows, 2 (window.layers), 2, kv, hd], found "
            "['window_past', 3, 2, 2, 16]") in msg, msg


def test_window_signature_problems_compare_shapes_with_the_graph_io():
    from dflash2.export import signature as sg

    sig = sg.window_signature("fixed", [0, 2], 7)
    good = mf.GraphIo([mf.IoSpec("window_cache", "float32", ["window_cap", 2, 2, 2, 16]),
                       mf.IoSpec("window_len", "int32", [1]), mf.IoSpec("window_base", "int64", [1])],
                      [mf.IoSpec("new_window_kv", "float32", ["n", 2, 2, 2, 16])])
    assert sig.problems("target signature", good) == []
    bad = mf.GraphIo([mf.IoSpec("window_cache", "float32", ["window_cap", 2, 2, 2, 16]),
                      mf.IoSpec("window_len", "int64", [1])],
                     [mf.IoSpec("new_window_kv", "float16", ["n", 2, 2, 2, 16])])
    assert sig.problems("target signature", bad) == [
        "target signature.window: new_window_kv expected the rows of window_cache (float32 [2, 2, 2, 16]), found "
        "float16 [2, 2, 2, 16]",
        "target signature.window: window_base is not an input of the graph (['window_cache', 'window_len'])",
        "target signature.window: window_len expected int32 [1], found int64 [1]"]


def test_window_kv_off_is_said_in_the_plan(pair):
    args = ["--model", str(pair / "pair" / "drafter"), "--target", str(pair / "pair" / "target"),
            "--out", str(pair / "never"), "--print"]
    assert "window KV:   on: sliding layers [0, 1, 2] in a bounded buffer (keep 7 rows" in cli(export_cli.main, *args)
    assert "window KV:   off (--window-kv off" in cli(export_cli.main, *args, "--window-kv", "off")
    assert not (pair / "never").exists()


def test_windowed_engines_on_the_fake_tensorrt_match_onnxruntime(exported, tmp_path, fake_plugin, fake):
    """dflash2-build's real code over the fake TensorRT (tests/fake_trt.py: set_input_shape enforces the active
    profile): the target engine's profiles take the whole window buffer, and generation on the fixed bindings
    (device buffers, the window buffer moved by cudaMemcpyAsync) gives ONNX Runtime's ids through compactions."""
    from dflash2.engines import build as eb
    from dflash2.engines import plan as ep
    from dflash2.runtime.api import Runtime

    if mf.load(exported, mf.ExportManifest, check_files=False).quantization is not None:
        pytest.skip("--quantize int8's fused graph has no TensorRT flavour")
    plan = ep.plan_build(exported, tmp_path / "engines", max_seq_len=T, max_prefill=32, plugin=fake_plugin,
                         timing_cache=tmp_path / "timing.cache", workspace_mb=256)
    eb.build(plan, quiet=True)
    for speculative in (True, False):
        want = Runtime(exported).generate(PROMPT, NEW, speculative=speculative).ids
        rt = Runtime(tmp_path / "engines")
        assert rt.backend_name == "tensorrt" and rt.session.window.buffer.whole().device == "cuda"
        assert rt.generate(PROMPT, NEW, speculative=speculative).ids == want
        assert rt.session.window.compactions >= 2


def test_the_validation_sees_a_window_buffer_one_row_short(pair, tmp_path):
    """The export's check of the windowed target (export/window_spec.py) can fail: its feeds with keep - 1 rows after
    the compaction (one visible row missing from the graph's keys, a zero row in the reference's) fail on the
    exported graph; the right keep passes."""
    from dflash2.export.graphs import graph_specs
    from dflash2.export.validate import validate_graph
    from dflash2.export.window_spec import windowed_spec
    from dflash2.reference.load import load_drafter
    from dflash2.reference.muse_glimmer import load_target

    out = export_once(pair, "fp32")
    m = mf.load(out, mf.ExportManifest, check_files=False)
    ref = load_target(pair / "pair" / "target", tuple(m.tap_ids))
    spec = graph_specs(ref, load_drafter(pair / "pair" / "drafter", ref), m.context.fused)[0]
    layers, keep = m.graphs["target"].signature.window.layers, m.graphs["target"].signature.window.keep
    good, _ = validate_graph(windowed_spec(spec, layers, keep), out / "target.onnx", "float32")
    bad, _ = validate_graph(windowed_spec(spec, layers, keep - 1), out / "target.onnx", "float32")
    assert good == [] and bad and all("(step 2)" in f for f in bad), bad
