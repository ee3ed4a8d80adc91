"""dflash2-compare on ONNX Runtime: every output against the PyTorch reference, tampered or missing
references, id outputs judged like the export validation, engines without TensorRT."""

from __future__ import annotations

import json
import shutil

import pytest

from dflash2 import manifest as mf
from dflash2.cli import compare as compare_cli
from dflash2.numerics import ID_MISMATCH_SHARE
from dflash2.native import tensorrt as ntrt
from tests.exports import edit_manifest, relabel_dtype

HAS_TRT = ntrt._trt is not None


def _resealed(folder):
    """The folder's file table rewritten after a test edited a file (dflash2-compare checks the hashes first)."""
    mf.write(folder, mf.load(folder, check_files=False))


# ------------------------------------------------------------------------------------------- compare

def test_compare_onnxruntime_passes(export_dir, capsys):
    assert compare_cli.main([str(export_dir)]) == 0
    out = capsys.readouterr().out
    for graph, output in [("target", "next_ids"), ("target", "new_kv"), ("drafter", "cand_ids"),
                          ("drafter", "confidence"), ("selector", "path_scores"), ("selector", "confidence")]:
        line = next(ln for ln in out.splitlines() if ln.startswith(graph) and f" {output} " in ln)
        assert "pytorch vs onnxrt" in line and line.rstrip().endswith("PASS")
    assert "PASSED: 14/14 comparisons" in out  # 4 target + 5 drafter + 5 selector outputs


def test_compare_fails_on_tampered_reference(export_dir, tmp_path, capsys):
    from polygraphy.comparator import RunResults

    copy = tmp_path / "export"
    shutil.copytree(export_dir, copy)
    ref = RunResults.load(str(copy / "drafter.reference.json"))
    it = ref["pytorch"][1]
    it["new_ctx_kv"] = it["new_ctx_kv"] + 0.5
    ref.save(str(copy / "drafter.reference.json"))
    _resealed(copy)
    assert compare_cli.main([str(copy)]) == 1
    out = capsys.readouterr().out
    bad = next(ln for ln in out.splitlines() if ln.startswith("drafter") and "new_ctx_kv" in ln)
    assert "FAIL" in bad and "feed(s) [1] of 2 out of tolerance" in bad and "0.5" in bad
    good = next(ln for ln in out.splitlines() if ln.startswith("drafter") and "draft_ids" in ln)
    assert good.rstrip().endswith("PASS")
    assert "FAILED: 13/14 comparisons" in out


@pytest.mark.parametrize("dtype, verdict", [("float32", "FAIL"), ("float16", "PASS")])
def test_compare_counts_differing_ids_like_the_export_validation(export_dir, tmp_path, capsys, dtype, verdict):
    """One candidate id swapped: fp32 allows none, fp16 allows up to 5% (near-equal candidates may swap)."""
    from polygraphy.comparator import RunResults

    copy = tmp_path / "export"
    shutil.copytree(export_dir, copy)
    edit_manifest(copy, lambda m: relabel_dtype(m, dtype))  # the rule follows the export dtype; graphs stay fp32
    ref = RunResults.load(str(copy / "drafter.reference.json"))
    cand = ref["pytorch"][0]["cand_ids"]
    cand.flat[0] = cand.flat[1]  # [1, S, K]: another candidate's id
    ref.save(str(copy / "drafter.reference.json"))
    _resealed(copy)
    compare_cli.main([str(copy)])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("drafter") and "cand_ids" in ln)
    total = 2 * cand.size
    assert f"  {verdict}  1/{total} ids differ (allowed {ID_MISMATCH_SHARE[dtype]:.0%})" in line


def test_compare_missing_reference_file(export_dir, tmp_path, capsys):
    copy = tmp_path / "export"
    shutil.copytree(export_dir, copy)
    (copy / "target.reference.json").unlink()
    _resealed(copy)
    assert compare_cli.main([str(copy)]) == 2
    assert "target.reference.json: expected the Polygraphy file" in capsys.readouterr().err


def test_compare_engines_without_tensorrt_skips_clearly(export_dir, adopted, capsys):
    if HAS_TRT:
        pytest.skip("tensorrt is installed: the skip path cannot be provoked")
    assert compare_cli.main([str(export_dir), "--engines", str(adopted), "--graph", "selector"]) == 0
    out = capsys.readouterr().out
    assert "TensorRT comparisons skipped: TensorRT is not installed" in out
    assert "PASSED: 5/5 comparisons" in out  # the selector's 5 outputs


@pytest.mark.parametrize("scale, verdict", [(0.9, "PASS"), (1.1, "FAIL")])
def test_compare_and_export_validation_share_one_rule(export_dir, tmp_path, capsys, scale, verdict):
    """|got - want| <= atol * max(1, rms(want)) + rtol*|want| in both (Polygraphy's own rule, both
    differences above their tolerance, would fail the 0.9 case wherever rtol*|want| < 0.9 * (atol + rtol*|want|) > atol)."""
    import numpy as np
    from polygraphy.comparator import RunResults

    from dflash2.export.validate import compare as validation_compare
    from dflash2.numerics import TOLERANCES, magnitude

    atol, rtol = TOLERANCES["float32"]
    copy = tmp_path / "export"
    shutil.copytree(export_dir, copy)
    ref = RunResults.load(str(copy / "drafter.reference.json"))
    it = ref["pytorch"][1]
    want = np.asarray(it["new_ctx_kv"], np.float64)
    it["new_ctx_kv"] = (want + scale * (atol * magnitude(want) + rtol * np.abs(want))).astype(np.float32)
    ref.save(str(copy / "drafter.reference.json"))
    _resealed(copy)
    compare_cli.main([str(copy), "--graph", "drafter"])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("drafter") and "new_ctx_kv" in ln)
    assert f"  {verdict}" in line
    got = np.linspace(-2, 2, 101)
    for big in (1.0, 40.0):  # logits of std ~32: the atol grows with the output's magnitude
        g = got * big
        s = g + scale * (atol * magnitude(g) + rtol * np.abs(g))
        failures, _ = validation_compare("g", {"x": g}, {"x": s}, "float32", 0)
        assert bool(failures) == (verdict == "FAIL"), big
    assert magnitude(got * 40) > 40 and magnitude(got) > 1
