"""The TensorRT build stage without TensorRT: profile planning, trtexec lines, every build error
that needs no TensorRT, the engine-folder manifest and backend selection. Fixtures (the shared
tiny export, the fake TensorRT, stand-in plugin and engines) live in conftest.py."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from dflash2 import manifest as mf
from dflash2.native import library
from dflash2.ops import contract as C
from dflash2.cli import build as build_cli
from dflash2.engines import build as eb
from dflash2.engines import manifest as em
from dflash2.engines import plan as ep
from dflash2.engines import profiles as pr
from dflash2.engines import trtexec
from dflash2.errors import Dflash2Error
from dflash2.folders import OutputError
from dflash2.native import tensorrt as ntrt
from dflash2.runtime import trt as rtrt
from dflash2.runtime.api import Runtime, pick_backend

from tests.exports import PROMPT, T, edit_manifest

HAS_TRT = ntrt._trt is not None


def _export_manifest(export_dir: Path) -> mf.ExportManifest:
    return mf.load(export_dir, mf.ExportManifest)


# ------------------------------------------------------------------------------------------- profiles

def test_profiles_golden(export_dir):
    plan = {g: [p.to_dict() for p in ps] for g, ps in pr.plan_profiles(_export_manifest(export_dir), 64, 32).items()}
    kv, ckv = [64, 4, 2, 2, 16], [64, 1, 2, 2, 16]  # fixed-shape flavours: the whole buffer, always
    assert plan["target"] == [
        {"name": "prefill", "dims": {"n": [1, 32, 32], "cap": [64, 64, 64]},
         "shapes": {"input_ids": {"min": [1], "opt": [32], "max": [32]},
                    "kv_cache": {"min": kv, "opt": kv, "max": kv}}},
        {"name": "decode", "dims": {"n": [1, 8, 8], "cap": [64, 64, 64]},
         "shapes": {"input_ids": {"min": [1], "opt": [8], "max": [8]},
                    "kv_cache": {"min": kv, "opt": kv, "max": kv}}}]
    assert plan["drafter"] == [
        {"name": "draft", "dims": {"n": [1, 8, 32], "cap": [64, 64, 64]},
         "shapes": {"context": {"min": [1, 64], "opt": [8, 64], "max": [32, 64]},
                    "ctx_kv_cache": {"min": ckv, "opt": ckv, "max": ckv}}}]
    assert plan["selector"] == [
        {"name": "batch", "dims": {"batch": [1, 1, 8]},
         "shapes": {"cand_logits": {"min": [1, 7, 8], "opt": [1, 7, 8], "max": [8, 7, 8]},
                    "cand_ids": {"min": [1, 7, 8], "opt": [1, 7, 8], "max": [8, 7, 8]},
                    "gate": {"min": [1, 7, 16], "opt": [1, 7, 16], "max": [8, 7, 16]},
                    "anchor": {"min": [1], "opt": [1], "max": [8]},
                    "uniforms": {"min": [1, 7], "opt": [1, 7], "max": [8, 7]},
                    "temperature": {"min": [1], "opt": [1], "max": [8]}}}]


def test_profiles_defaults_and_small_prefill(export_dir):
    m = _export_manifest(export_dir)
    default = pr.plan_profiles(m)
    assert default["target"][0].dims["n"] == pr.DimRange(1, T, T)  # max_prefill defaults to max_seq_len
    small = pr.plan_profiles(m, 40, 4)  # drafter rows still cover a whole verify block (S + 1 = 8)
    assert small["drafter"][0].dims["n"] == pr.DimRange(1, 8, 8)
    assert small["target"][1].dims["cap"] == pr.DimRange(40, 40, 40)


@pytest.mark.parametrize("kw, needle", [
    ({"max_seq_len": 128}, "expected <= the export's max_seq_len 64, found 128 (re-export"),
    ({"max_seq_len": 9}, "expected >= block_size + 2 = 10, found 9"),
    ({"max_prefill": 0}, "--max-prefill: expected 1 <= max_prefill <= max_seq_len 64, found 0"),
    ({"max_seq_len": 32, "max_prefill": 33}, "max_seq_len 32, found 33"),
])
def test_profile_limits_rejected(export_dir, kw, needle):
    with pytest.raises(pr.ProfileError) as e:
        pr.plan_profiles(_export_manifest(export_dir), **kw)
    assert needle in str(e.value)


def test_window_profiles_bind_the_whole_window_buffer(export_dir):
    """A windowed target's fixed flavour (manifest.WindowSignature: window_cache [window_cap, Lw, ...] + window_len +
    window_base): both target profiles fix window_cap at the runtime's window capacity (runtime.window.window_rows),
    whatever the step; the static [1] inputs need no entry. The export's target edited to that io here (the windowed
    Muse-Glimmer export goes through the fake TensorRT in tests/test_window_export.py)."""
    import dataclasses

    from dflash2.export import signature as sg
    from dflash2.runtime import window

    m = _export_manifest(export_dir)
    g = m.graphs["target"]
    io = g.tensorrt
    ins = [dataclasses.replace(s, shape=["cap", 1, 2, 2, 16]) if s.name == "kv_cache" else s for s in io.inputs]
    ins += [mf.IoSpec("window_cache", "float32", ["window_cap", 3, 2, 2, 16]), mf.IoSpec("window_len", "int32", [1]),
            mf.IoSpec("window_base", "int64", [1])]
    trt_sig = dataclasses.replace(g.tensorrt_signature, window=sg.window_signature("fixed", [0, 1, 2], 7))
    m.graphs["target"] = dataclasses.replace(g, tensorrt_io=mf.GraphIo(ins, io.outputs), tensorrt_signature=trt_sig)
    C = 7 + window.ALIGN - 1 + 2 * 8  # keep + ALIGN - 1 + 2 steps of a block
    kv, win = [64, 1, 2, 2, 16], [C, 3, 2, 2, 16]
    plan = [p.to_dict() for p in pr.plan_profiles(m, 64, 32)["target"]]
    assert [p["dims"] for p in plan] == [{"n": [1, 32, 32], "cap": [64, 64, 64], "window_cap": [C, C, C]},
                                         {"n": [1, 8, 8], "cap": [64, 64, 64], "window_cap": [C, C, C]}]
    for p in plan:
        assert p["shapes"]["kv_cache"] == {"min": kv, "opt": kv, "max": kv}
        assert p["shapes"]["window_cache"] == {"min": win, "opt": win, "max": win}
        assert "window_len" not in p["shapes"] and "window_base" not in p["shapes"]


def test_unknown_symbolic_dim_rejected():
    with pytest.raises(pr.ProfileError, match="symbolic dim\\(s\\) \\['seq'\\]"):
        pr.input_shapes("target", [mf.IoSpec("x", "float32", ["seq", 4])], {"n": pr.DimRange(1, 1, 1)})


# ------------------------------------------------------------------------------------------- trtexec

def test_trtexec_golden(export_dir, tmp_path):
    plan = ep.plan_build(export_dir, tmp_path / "eng", max_seq_len=64, max_prefill=32,
                         plugin="/opt/df2/libdflash2_plugins.so", timing_cache="/tmp/tc.cache", workspace_mb=512,
                         mode="print")
    E, O, L = export_dir, tmp_path / "eng", "/opt/df2/libdflash2_plugins.so"
    tail = f"--dynamicPlugins={L} --timingCacheFile=/tmp/tc.cache --memPoolSize=workspace:512M --skipInference"
    assert trtexec.commands(plan) == [
        "# precision fp32: from the float32 export (strongly typed, no precision flag); max_seq_len 64, max_prefill 32",
        f"# {L} is not built yet: run `bash plugins/build.sh` first",
        f"mkdir -p {O}",
        "# target.engine: profiles prefill, decode",
        f"trtexec --onnx={E}/target.trt.onnx --saveEngine={O}/target.engine --stronglyTyped "
        "--minShapes=input_ids:1,kv_cache:64x4x2x2x16 --optShapes=input_ids:32,kv_cache:64x4x2x2x16 "
        "--maxShapes=input_ids:32,kv_cache:64x4x2x2x16 "
        "--minShapes=input_ids:1,kv_cache:64x4x2x2x16 --optShapes=input_ids:8,kv_cache:64x4x2x2x16 "
        f"--maxShapes=input_ids:8,kv_cache:64x4x2x2x16 {tail}",
        "# drafter.engine: profiles draft",
        f"trtexec --onnx={E}/drafter.trt.onnx --saveEngine={O}/drafter.engine --stronglyTyped "
        "--minShapes=context:1x64,ctx_kv_cache:64x1x2x2x16 --optShapes=context:8x64,ctx_kv_cache:64x1x2x2x16 "
        f"--maxShapes=context:32x64,ctx_kv_cache:64x1x2x2x16 {tail}",
        "# selector.engine: profiles batch",
        f"trtexec --onnx={E}/selector.trt.onnx --saveEngine={O}/selector.engine --stronglyTyped "
        "--minShapes=cand_logits:1x7x8,cand_ids:1x7x8,gate:1x7x16,anchor:1,uniforms:1x7,temperature:1 "
        "--optShapes=cand_logits:1x7x8,cand_ids:1x7x8,gate:1x7x16,anchor:1,uniforms:1x7,temperature:1 "
        f"--maxShapes=cand_logits:8x7x8,cand_ids:8x7x8,gate:8x7x16,anchor:8,uniforms:8x7,temperature:8 {tail}",
        f"dflash2-build {E} --out {O} --manifest-only --max-seq-len=64 --max-prefill=32 --plugin={L}",
    ]


def test_print_trtexec_cli_needs_no_tensorrt(export_dir, tmp_path, capsys):
    assert build_cli.main([str(export_dir), "--out", str(tmp_path / "eng"), "--print-trtexec"]) == 0
    out = capsys.readouterr().out
    assert out.count("trtexec --onnx=") == 3 and "--stronglyTyped" in out and "--dynamicPlugins=" in out
    assert not (tmp_path / "eng").exists()  # builds nothing
    if not HAS_TRT:
        assert "tensorrt" not in sys.modules


# ------------------------------------------------------------------------------------------- errors

def test_tensorrt_missing_says_what_to_install(export_dir, tmp_path, fake_plugin, capsys):
    if HAS_TRT:
        pytest.skip("tensorrt is installed: the missing-TensorRT message cannot be provoked")
    with pytest.raises(ntrt.TensorRTMissingError, match="pip install tensorrt-cu12"):
        eb.build(ep.plan_build(export_dir, tmp_path / "eng", plugin=fake_plugin))
    assert build_cli.main([str(export_dir), "--out", str(tmp_path / "eng"), "--plugin", str(fake_plugin)]) == 2
    err = capsys.readouterr().err
    assert "TensorRT is not installed" in err and "JetPack" in err
    assert not (tmp_path / "eng").exists()


def test_plugin_missing_explicit_path(export_dir, tmp_path, capsys):
    rc = build_cli.main([str(export_dir), "--out", str(tmp_path / "eng"), "--plugin", str(tmp_path / "nope.so")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "nope.so: no such file" in err and "bash plugins/build.sh" in err


def test_plugin_missing_default_search(export_dir, tmp_path, monkeypatch):
    monkeypatch.delenv(library.ENV_VAR, raising=False)
    monkeypatch.setattr(library, "search_dirs", lambda: [tmp_path / "a", tmp_path / "b"])
    with pytest.raises(library.PluginLibraryError, match="bash plugins/build.sh") as e:
        ep.plan_build(export_dir, tmp_path / "eng")
    assert str(tmp_path / "a" / library.PLUGIN_LIB) in str(e.value)


def test_plugin_not_a_library(export_dir, tmp_path):
    bad = tmp_path / library.PLUGIN_LIB
    bad.write_bytes(b"garbage")
    with pytest.raises(library.PluginLibraryError, match="failed to load.*bash plugins/build.sh"):
        ep.plan_build(export_dir, tmp_path / "eng", plugin=bad)


def test_plugin_abi_version_mismatch(export_dir, tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a library with a wrong ABI version")
    import subprocess

    src = tmp_path / "abi.c"
    src.write_text("int dflash2_selector_abi_version(void) { return 99; }\n")
    lib = tmp_path / library.PLUGIN_LIB
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    with pytest.raises(ep.PluginVersionError, match=f"ABI version expected {library.ABI_VERSION}, found 99"):
        ep.plan_build(export_dir, tmp_path / "eng", plugin=lib)


def test_export_selector_version_mismatch(export_dir, tmp_path, fake_plugin):
    copy = tmp_path / "export"
    shutil.copytree(export_dir, copy)
    edit_manifest(copy, lambda m: m["selector"].update(plugin_version="1"))  # from before the confidence output
    with pytest.raises(ep.PluginVersionError, match=f"plugin_version: export has '1', this dflash2 builds '{C.PLUGIN_VERSION}'"):
        ep.plan_build(copy, tmp_path / "eng", plugin=fake_plugin)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_precision_must_match_export_dtype(export_dir, tmp_path, precision, capsys):
    assert build_cli.main([str(export_dir), "--out", str(tmp_path / "e"), "--precision", precision]) == 2
    err = capsys.readouterr().err
    want = ep.PRECISIONS[precision]
    assert f"--precision {precision} does not match the export dtype float32" in err
    assert f"dflash2-export ... --dtype {want}" in err and "strongly typed" in err


def test_precision_default_is_export_dtype(export_dir, tmp_path, fake_plugin):
    assert ep.plan_build(export_dir, tmp_path / "e", plugin=fake_plugin).precision == "fp32"


def test_existing_output_needs_force(export_dir, tmp_path, fake_plugin):
    (tmp_path / "eng").mkdir()
    with pytest.raises(OutputError, match="exists; pass --force"):
        ep.plan_build(export_dir, tmp_path / "eng", plugin=fake_plugin)
    assert ep.plan_build(export_dir, tmp_path / "eng", plugin=fake_plugin, force=True).force


def test_export_files_changed_after_export(export_dir, tmp_path, fake_plugin):
    copy = tmp_path / "export"
    shutil.copytree(export_dir, copy)
    (copy / "target.onnx.data").write_bytes(b"x" * (copy / "target.onnx.data").stat().st_size)
    with pytest.raises(mf.ManifestError, match="target.onnx.data: sha256 does not match"):
        ep.plan_build(copy, tmp_path / "eng", plugin=fake_plugin)


def test_device_without_bf16(fake):
    fake.CUDART.sm = (7, 2)  # Xavier
    with pytest.raises(ep.PrecisionError, match="Fake GPU is sm_72, bf16 needs sm_80"):
        eb.check_device_precision("bf16")
    eb.check_device_precision("fp16")
    eb.check_device_precision("fp32")


# ------------------------------------------------------------------------------------------- manifest

def test_engine_manifest_roundtrip(adopted, export_dir, fake_plugin):
    m = mf.load(adopted, mf.EngineManifest)  # files checked too
    assert m.format == mf.ENGINE_FORMAT and m.format_version == mf.FORMAT_VERSION
    assert m.export_dir == str(export_dir.absolute())
    assert (m.max_seq_len, m.export_max_seq_len, m.max_prefill) == (48, T, 16)
    assert m.plugin.path == str(fake_plugin) and m.plugin.sha256 == mf.sha256(fake_plugin)
    assert m.plugin.op == "DFlash2Selector" and m.plugin.plugin_version == C.PLUGIN_VERSION
    e = _export_manifest(export_dir)
    for k in em.COPIED:
        assert getattr(m, k) == getattr(e, k), k
    assert set(m.engines) == {"target", "drafter", "selector"}
    assert m.engines["drafter"].onnx == "drafter.trt.onnx"
    assert [p.name for p in m.engines["target"].profiles] == ["prefill", "decode"]
    assert m.engines["target"].profiles[0].dims["cap"] == [48, 48, 48]
    assert {"tokenizer.json", "target.engine"} <= set(m.files)
    assert (adopted / "tokenizer.json").is_file()


def test_engine_manifest_reader_lists_every_problem(adopted):
    def edit(m):
        del m["block_size"], m["engines"]["drafter"], m["engines"]["target"]["profiles"]

    edit_manifest(adopted, edit)
    with pytest.raises(mf.ManifestError) as e:
        mf.load(adopted, mf.EngineManifest)
    msg = str(e.value)
    assert "block_size: expected an integer, found nothing (missing)" in msg
    assert "engines.drafter: expected an engine" in msg
    assert "engines.target.profiles: expected a list of an object (ProfileRecord), found nothing (missing)" in msg


def test_manifest_only_needs_engine_files(export_dir, tmp_path, fake_plugin, capsys):
    (tmp_path / "eng").mkdir()
    rc = build_cli.main([str(export_dir), "--out", str(tmp_path / "eng"), "--manifest-only", "--plugin",
                         str(fake_plugin)])
    assert rc == 2
    assert "expected engine files ['target.engine', 'drafter.engine', 'selector.engine']" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- runtime selection

def test_pick_backend(adopted, export_dir):
    assert pick_backend(mf.load(adopted), None) == "tensorrt"
    assert pick_backend(_export_manifest(export_dir), None) == "onnxruntime"
    assert pick_backend(mf.load(adopted), "onnxruntime") == "onnxruntime"
    with pytest.raises(Dflash2Error, match="--backend: expected one of"):
        pick_backend(mf.load(adopted), "tvm")


def test_engine_folder_on_onnxruntime_matches_export(adopted, export_dir):
    """--backend onnxruntime on an engine folder runs its export with the engine manifest's fields."""
    want = Runtime(export_dir).generate(PROMPT, 20).ids
    rt = Runtime(adopted, backend="onnxruntime")
    assert rt.session.max_seq_len == 48
    assert rt.generate(PROMPT, 20).ids == want


def test_tensorrt_backend_missing_says_so(adopted, export_dir):
    if HAS_TRT:
        pytest.skip("tensorrt is installed: the missing-TensorRT message cannot be provoked")
    with pytest.raises(Dflash2Error, match="TensorRT is not installed.*pip install tensorrt-cu12"):
        Runtime(adopted)
    with pytest.raises(ntrt.TensorRTMissingError):
        rtrt.TrtBackend(adopted, mf.load(adopted, check_files=False))
    with pytest.raises(Dflash2Error, match="TensorRT is not installed"):  # said before the folder kind
        Runtime(export_dir, backend="tensorrt")
