"""The TensorRT path without TensorRT: profile planning, trtexec lines, the engine-folder manifest,
every error that needs no TensorRT, dflash2-compare on ONNX Runtime, backend selection, and the
build + runtime code driven through a fake TensorRT/CUDA (tests/fake_trt.py). Tests that need the
real TensorRT or a GPU skip with the reason."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from dflash2 import manifest as mf
from dflash2 import plugins, tiny
from dflash2.cli import build as build_cli
from dflash2.cli import compare as compare_cli
from dflash2.engines import build as eb
from dflash2.engines import manifest as em
from dflash2.engines import plan as ep
from dflash2.engines import profiles as pr
from dflash2.engines import trtexec
from dflash2.errors import Dflash2Error
from dflash2.folders import OutputError
from dflash2.numerics import ID_MISMATCH_SHARE
from dflash2.runtime import cuda as rcuda
from dflash2.runtime import trt as rtrt
from dflash2.runtime.api import Runtime, pick_backend

T = 64  # export capacity of the shared tiny export
PROMPT = [5, 17, 42, 99, 7, 250, 31, 64, 12, 300, 8]
HAS_TRT = rtrt._trt is not None


@pytest.fixture(scope="session")
def export_dir(tmp_path_factory) -> Path:
    """One tiny Qwen3 + DFlash2 export for the whole session (~10 s)."""
    from dflash2.export.api import export

    root = tmp_path_factory.mktemp("engines")
    drafter, target = tiny.make_pair(root / "pair", family="qwen3", version=2)
    export(drafter, target, root / "export", max_seq_len=T, quiet=True)
    return root / "export"


@pytest.fixture
def fake_plugin(tmp_path, monkeypatch) -> Path:
    """A stand-in plugin file whose ABI check passes (the real library may not be built here)."""
    lib = tmp_path / "lib" / plugins.PLUGIN_LIB
    lib.parent.mkdir()
    lib.write_bytes(b"not really a shared library")
    monkeypatch.setattr(ep, "library_abi", lambda path: plugins.ABI_VERSION)
    return lib


def _load_fake_trt():
    """tests/fake_trt.py as a module (the tests folder is not a package)."""
    import importlib.util

    if "fake_trt" not in sys.modules:
        spec = importlib.util.spec_from_file_location("fake_trt", Path(__file__).with_name("fake_trt.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["fake_trt"] = module
        spec.loader.exec_module(module)
    return sys.modules["fake_trt"]


@pytest.fixture
def fake(monkeypatch):
    fake_trt = _load_fake_trt()
    fake_trt.reset()
    monkeypatch.setattr(rtrt, "_trt", fake_trt)
    monkeypatch.setattr(rtrt, "_LOADED", {})
    monkeypatch.setattr(rcuda, "_CUDART", fake_trt.CUDART)
    return fake_trt


def _export_manifest(export_dir: Path) -> dict:
    return mf.load(export_dir, (mf.EXPORT_FORMAT,))


# ------------------------------------------------------------------------------------------- profiles

def test_profiles_golden(export_dir):
    plan = {g: [p.to_dict() for p in ps] for g, ps in pr.plan_profiles(_export_manifest(export_dir), 64, 32).items()}
    kv, ckv = [4, 2, 2, 16], [1, 2, 2, 16]
    assert plan["target"] == [
        {"name": "prefill", "dims": {"n": [1, 32, 32], "past": [0, 0, 63]},
         "shapes": {"input_ids": {"min": [1], "opt": [32], "max": [32]},
                    "past_kv": {"min": [0, *kv], "opt": [0, *kv], "max": [63, *kv]}}},
        {"name": "decode", "dims": {"n": [1, 8, 8], "past": [0, 32, 63]},
         "shapes": {"input_ids": {"min": [1], "opt": [8], "max": [8]},
                    "past_kv": {"min": [0, *kv], "opt": [32, *kv], "max": [63, *kv]}}}]
    assert plan["drafter"] == [
        {"name": "draft", "dims": {"n": [1, 8, 32], "past": [0, 32, 63]},
         "shapes": {"context": {"min": [1, 64], "opt": [8, 64], "max": [32, 64]},
                    "past_ctx_kv": {"min": [0, *ckv], "opt": [32, *ckv], "max": [63, *ckv]}}}]
    assert plan["selector"] == [
        {"name": "batch", "dims": {"batch": [1, 1, 8]},
         "shapes": {"cand_logits": {"min": [1, 7, 8], "opt": [1, 7, 8], "max": [8, 7, 8]},
                    "cand_ids": {"min": [1, 7, 8], "opt": [1, 7, 8], "max": [8, 7, 8]},
                    "gate": {"min": [1, 7, 16], "opt": [1, 7, 16], "max": [8, 7, 16]},
                    "anchor": {"min": [1], "opt": [1], "max": [8]}}}]


def test_profiles_defaults_and_small_prefill(export_dir):
    m = _export_manifest(export_dir)
    default = pr.plan_profiles(m)
    assert default["target"][0].dims["n"] == pr.DimRange(1, T, T)  # max_prefill defaults to max_seq_len
    small = pr.plan_profiles(m, 40, 4)  # drafter rows still cover a whole verify block (S + 1 = 8)
    assert small["drafter"][0].dims["n"] == pr.DimRange(1, 8, 8)
    assert small["target"][1].dims["past"] == pr.DimRange(0, 20, 39)


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


def test_unknown_symbolic_dim_rejected():
    with pytest.raises(pr.ProfileError, match="symbolic dim\\(s\\) \\['seq'\\]"):
        pr.input_shapes("target", [{"name": "x", "shape": ["seq", 4]}], {"n": pr.DimRange(1, 1, 1)})


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
        f"trtexec --onnx={E}/target.onnx --saveEngine={O}/target.engine --stronglyTyped "
        "--minShapes=input_ids:1,past_kv:0x4x2x2x16 --optShapes=input_ids:32,past_kv:0x4x2x2x16 "
        "--maxShapes=input_ids:32,past_kv:63x4x2x2x16 "
        "--minShapes=input_ids:1,past_kv:0x4x2x2x16 --optShapes=input_ids:8,past_kv:32x4x2x2x16 "
        f"--maxShapes=input_ids:8,past_kv:63x4x2x2x16 {tail}",
        "# drafter.engine: profiles draft",
        f"trtexec --onnx={E}/drafter.trt.onnx --saveEngine={O}/drafter.engine --stronglyTyped "
        "--minShapes=context:1x64,past_ctx_kv:0x1x2x2x16 --optShapes=context:8x64,past_ctx_kv:32x1x2x2x16 "
        f"--maxShapes=context:32x64,past_ctx_kv:63x1x2x2x16 {tail}",
        "# selector.engine: profiles batch",
        f"trtexec --onnx={E}/selector.trt.onnx --saveEngine={O}/selector.engine --stronglyTyped "
        "--minShapes=cand_logits:1x7x8,cand_ids:1x7x8,gate:1x7x16,anchor:1 "
        "--optShapes=cand_logits:1x7x8,cand_ids:1x7x8,gate:1x7x16,anchor:1 "
        f"--maxShapes=cand_logits:8x7x8,cand_ids:8x7x8,gate:8x7x16,anchor:8 {tail}",
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
    with pytest.raises(rtrt.TensorRTMissingError, match="pip install tensorrt-cu12"):
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
    monkeypatch.delenv(plugins.ENV_VAR, raising=False)
    monkeypatch.setattr(plugins, "search_dirs", lambda: [tmp_path / "a", tmp_path / "b"])
    with pytest.raises(plugins.PluginLibraryError, match="bash plugins/build.sh") as e:
        ep.plan_build(export_dir, tmp_path / "eng")
    assert str(tmp_path / "a" / plugins.PLUGIN_LIB) in str(e.value)


def test_plugin_not_a_library(export_dir, tmp_path):
    bad = tmp_path / plugins.PLUGIN_LIB
    bad.write_bytes(b"garbage")
    with pytest.raises(plugins.PluginLibraryError, match="failed to load.*bash plugins/build.sh"):
        ep.plan_build(export_dir, tmp_path / "eng", plugin=bad)


def test_plugin_abi_version_mismatch(export_dir, tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a library with a wrong ABI version")
    import subprocess

    src = tmp_path / "abi.c"
    src.write_text("int dflash2_selector_abi_version(void) { return 99; }\n")
    lib = tmp_path / plugins.PLUGIN_LIB
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    with pytest.raises(ep.PluginVersionError, match=f"ABI version expected {plugins.ABI_VERSION}, found 99"):
        ep.plan_build(export_dir, tmp_path / "eng", plugin=lib)


def test_export_selector_version_mismatch(export_dir, tmp_path, fake_plugin):
    copy = tmp_path / "export"
    shutil.copytree(export_dir, copy)
    m = json.loads((copy / mf.NAME).read_text())
    m["selector"]["plugin_version"] = "2"
    (copy / mf.NAME).write_text(json.dumps(m))
    with pytest.raises(ep.PluginVersionError, match="plugin_version: export has '2', this dflash2 builds '1'"):
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

@pytest.fixture
def adopted(export_dir, tmp_path, fake_plugin) -> Path:
    """An engine folder from --manifest-only over stand-in engine files (what trtexec would write)."""
    out = tmp_path / "engines"
    out.mkdir()
    for g in ("target", "drafter", "selector"):
        (out / f"{g}.engine").write_bytes(f"stand-in {g} engine".encode())
    rc = build_cli.main([str(export_dir), "--out", str(out), "--manifest-only", "--max-seq-len", "48",
                         "--max-prefill", "16", "--plugin", str(fake_plugin)])
    assert rc == 0
    return out


def test_engine_manifest_roundtrip(adopted, export_dir, fake_plugin):
    m = em.read(adopted)
    mf.verify_files(adopted, m)
    assert m["format"] == mf.ENGINE_FORMAT and m["format_version"] == 1
    assert m["export_dir"] == str(export_dir.absolute())
    assert (m["max_seq_len"], m["export_max_seq_len"], m["max_prefill"]) == (48, T, 16)
    assert m["plugin"]["path"] == str(fake_plugin) and m["plugin"]["sha256"] == mf.sha256(fake_plugin)
    assert m["plugin"]["op"] == "DFlash2Selector" and m["plugin"]["plugin_version"] == "1"
    e = _export_manifest(export_dir)
    for k in em.COPIED:
        assert m[k] == e[k], k
    assert set(m["engines"]) == {"target", "drafter", "selector"}
    assert m["engines"]["drafter"]["onnx"] == "drafter.trt.onnx"
    assert [p["name"] for p in m["engines"]["target"]["profiles"]] == ["prefill", "decode"]
    assert m["engines"]["target"]["profiles"][0]["dims"]["past"] == [0, 0, 47]
    assert {"tokenizer.json", "target.engine"} <= set(m["files"])
    assert (adopted / "tokenizer.json").is_file()


def test_engine_manifest_reader_lists_every_problem(adopted):
    m = json.loads((adopted / mf.NAME).read_text())
    del m["block_size"], m["engines"]["drafter"], m["engines"]["target"]["profiles"]
    (adopted / mf.NAME).write_text(json.dumps(m))
    with pytest.raises(mf.ManifestError) as e:
        em.read(adopted)
    msg = str(e.value)
    assert "block_size: missing" in msg and "engines.drafter: missing" in msg
    assert "engines.target.profiles: missing" in msg


def test_manifest_only_needs_engine_files(export_dir, tmp_path, fake_plugin, capsys):
    (tmp_path / "eng").mkdir()
    rc = build_cli.main([str(export_dir), "--out", str(tmp_path / "eng"), "--manifest-only", "--plugin",
                         str(fake_plugin)])
    assert rc == 2
    assert "expected engine files ['target.engine', 'drafter.engine', 'selector.engine']" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- runtime selection

def test_pick_backend(adopted, export_dir):
    assert pick_backend(em.read(adopted), None) == "tensorrt"
    assert pick_backend(_export_manifest(export_dir), None) == "onnxruntime"
    assert pick_backend(em.read(adopted), "onnxruntime") == "onnxruntime"
    with pytest.raises(Dflash2Error, match="--backend: expected one of"):
        pick_backend(em.read(adopted), "tvm")


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
    with pytest.raises(rtrt.TensorRTMissingError):
        rtrt.TrtBackend(adopted, em.read(adopted))
    with pytest.raises(Dflash2Error, match="TensorRT is not installed"):  # said before the folder kind
        Runtime(export_dir, backend="tensorrt")


# ------------------------------------------------------------------------------------------- compare

def test_compare_onnxruntime_passes(export_dir, capsys):
    assert compare_cli.main([str(export_dir)]) == 0
    out = capsys.readouterr().out
    for graph, output in [("target", "next_ids"), ("target", "new_kv"), ("drafter", "cand_ids"),
                          ("selector", "path_scores")]:
        line = next(ln for ln in out.splitlines() if ln.startswith(graph) and f" {output} " in ln)
        assert "pytorch vs onnxrt" in line and line.rstrip().endswith("PASS")
    assert "PASSED: 9/9 comparisons" in out


def test_compare_fails_on_tampered_reference(export_dir, tmp_path, capsys):
    from polygraphy.comparator import RunResults

    copy = tmp_path / "export"
    shutil.copytree(export_dir, copy)
    ref = RunResults.load(str(copy / "drafter.reference.json"))
    it = ref["pytorch"][1]
    it["new_ctx_kv"] = it["new_ctx_kv"] + 0.5
    ref.save(str(copy / "drafter.reference.json"))
    assert compare_cli.main([str(copy)]) == 1
    out = capsys.readouterr().out
    bad = next(ln for ln in out.splitlines() if ln.startswith("drafter") and "new_ctx_kv" in ln)
    assert "FAIL" in bad and "feed(s) [1] of 2 out of tolerance" in bad and "0.5" in bad
    good = next(ln for ln in out.splitlines() if ln.startswith("drafter") and "draft_ids" in ln)
    assert good.rstrip().endswith("PASS")
    assert "FAILED: 8/9 comparisons" in out


@pytest.mark.parametrize("dtype, verdict", [("float32", "FAIL"), ("float16", "PASS")])
def test_compare_counts_differing_ids_like_the_export_validation(export_dir, tmp_path, capsys, dtype, verdict):
    """One candidate id swapped: fp32 allows none, fp16 allows up to 5% (near-equal candidates may swap)."""
    from polygraphy.comparator import RunResults

    copy = tmp_path / "export"
    shutil.copytree(export_dir, copy)
    m = json.loads((copy / mf.NAME).read_text())
    m["dtype"] = dtype  # the rule follows the export dtype; the graphs themselves stay fp32
    (copy / mf.NAME).write_text(json.dumps(m))
    ref = RunResults.load(str(copy / "drafter.reference.json"))
    cand = ref["pytorch"][0]["cand_ids"]
    cand.flat[0] = cand.flat[1]  # [1, S, K]: another candidate's id
    ref.save(str(copy / "drafter.reference.json"))
    compare_cli.main([str(copy)])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("drafter") and "cand_ids" in ln)
    total = 2 * cand.size
    assert f"  {verdict}  1/{total} ids differ (allowed {ID_MISMATCH_SHARE[dtype]:.0%})" in line


def test_compare_missing_reference_file(export_dir, tmp_path, capsys):
    copy = tmp_path / "export"
    shutil.copytree(export_dir, copy)
    (copy / "target.reference.json").unlink()
    assert compare_cli.main([str(copy)]) == 2
    assert "target.reference.json: expected the Polygraphy file" in capsys.readouterr().err


def test_compare_engines_without_tensorrt_skips_clearly(export_dir, adopted, capsys):
    if HAS_TRT:
        pytest.skip("tensorrt is installed: the skip path cannot be provoked")
    assert compare_cli.main([str(export_dir), "--engines", str(adopted), "--graph", "selector"]) == 0
    out = capsys.readouterr().out
    assert "TensorRT comparisons skipped: TensorRT is not installed" in out
    assert "PASSED: 3/3 comparisons" in out


# ------------------------------------------------------------------------------------------- fake TensorRT

@pytest.fixture
def fake_engines(export_dir, tmp_path, fake_plugin, fake) -> Path:
    """dflash2-build's real code over the fake TensorRT: engines are JSON naming ONNX + profiles."""
    plan = ep.plan_build(export_dir, tmp_path / "fake-engines", max_seq_len=48, max_prefill=16, plugin=fake_plugin,
                         timing_cache=tmp_path / "cache" / "timing.cache", workspace_mb=256)
    eb.build(plan, quiet=True)
    return tmp_path / "fake-engines"


def test_fake_build_writes_engines_profiles_cache(fake_engines, fake, fake_plugin, tmp_path):
    m = em.read(fake_engines)
    mf.verify_files(fake_engines, m)
    assert m["tensorrt_version"] == fake.__version__ and m["build"]["workspace_mb"] == 256
    assert fake.REGISTRY.libraries == [str(fake_plugin.resolve())]  # loaded before parsing
    target = json.loads((fake_engines / "target.engine").read_bytes())
    assert target["onnx"].endswith("target.onnx")
    assert target["profiles"][1]["input_ids"] == [[1], [8], [8]]  # decode profile reached the builder
    assert json.loads((fake_engines / "drafter.engine").read_bytes())["onnx"].endswith("drafter.trt.onnx")
    assert (tmp_path / "cache" / "timing.cache").read_bytes() == b"fake timing cache"


def test_fake_build_parse_error_names_node(export_dir, tmp_path, fake_plugin, fake):
    fake.OnnxParser.fail_with = "Unsupported operator DFlash2Selector: no plugin creator"
    plan = ep.plan_build(export_dir, tmp_path / "eng", plugin=fake_plugin)
    with pytest.raises(eb.OnnxParseError) as e:
        eb.build(plan, quiet=True)
    msg = str(e.value)
    assert "target.onnx: TensorRT's ONNX parser reported 1 error(s)" in msg
    assert "node /layers.0/attn/MatMul (MatMul): Unsupported operator DFlash2Selector" in msg
    assert not (tmp_path / "eng").exists()  # nothing half-written


@pytest.mark.parametrize("speculative", [True, False])
def test_fake_tensorrt_runtime_matches_onnxruntime(fake_engines, export_dir, fake, speculative):
    want = Runtime(export_dir).generate(PROMPT, 24, speculative=speculative).ids
    rt = Runtime(fake_engines)
    assert rt.backend_name == "tensorrt"
    assert rt.session.kv.whole().device == "cuda"
    before = rt.session.buffers()
    assert rt.generate(PROMPT, 24, speculative=speculative).ids == want
    assert rt.session.buffers() == before  # allocated once
    target = rt.session.backend.engine("target")
    used = {i for i, ctx in target.contexts.items() if ctx.calls["set_input_shape"]}
    assert used == ({0, 1})  # prefill (11 rows) on profile 0, decode / verify on profile 1


def test_fake_tensorrt_binding_checks_and_spare_output(fake_engines, fake):
    s = Runtime(fake_engines).session
    s.ids.host[:3] = [5, 6, 7]
    s.ids.push(3)
    eng = s.backend.engine("target")
    feeds = {"input_ids": s.ids.rows(0, 3), "past_kv": s.kv.rows(0, 0)}
    eng.run(feeds, {"next_ids": s.next_ids.rows(0, 3), "context": s.context.rows(0, 3), "new_kv": s.kv.rows(0, 3)})
    want = s.next_ids.pull(3).tolist()
    s.next_ids.host[:] = 0
    s.next_ids.push(3)
    eng.run(feeds, {"next_ids": s.next_ids.rows(0, 3), "new_kv": s.kv.rows(0, 3)})  # context unbound
    assert s.next_ids.pull(3).tolist() == want
    assert set(eng.spare) == {"context"} and eng.spare["context"].nbytes == 16 * 64 * 4  # max n 16 x width x fp32
    with pytest.raises(rtrt.EngineError, match=r"output next_ids expected shape \[3\].*bound \[2\]"):
        eng.run(feeds, {"next_ids": s.next_ids.rows(0, 2), "new_kv": s.kv.rows(0, 3)})
    with pytest.raises(rtrt.EngineError, match=r"missing \['past_kv'\]"):
        eng.run({"input_ids": s.ids.rows(0, 3)}, {})


def test_fake_tensorrt_prompt_beyond_max_prefill(fake_engines, fake):
    rt = Runtime(fake_engines)
    with pytest.raises(rtrt.EngineError, match="fit no optimization profile.*--max-prefill"):
        rt.generate(list(range(3, 23)), 4)  # 20 tokens > max_prefill 16


def test_fake_tensorrt_cuda_graphs(fake_engines, export_dir, fake):
    want = Runtime(export_dir).generate(PROMPT, 12).ids
    rt = Runtime(fake_engines)
    rt.session.backend = backend = rtrt.TrtBackend(fake_engines, rt.manifest, cuda_graphs=True)
    from dflash2.runtime.session import SpecSession

    rt.session = SpecSession(rt.manifest, backend)
    runs = [rt.generate(PROMPT, 12).ids for _ in range(3)]
    assert runs == [want] * 3
    # run 1 warms every key up, run 2 captures them, run 3 only launches graphs
    assert backend.graphs.captures > 0 and backend.graphs.launches >= 2 * backend.graphs.captures


def test_fake_tensorrt_corrupt_engine(fake_engines, fake):
    (fake_engines / "drafter.engine").write_bytes(b"\x00garbage")
    with pytest.raises(rtrt.EngineError, match="could not deserialize.*rebuild with dflash2-build"):
        rtrt.TrtBackend(fake_engines, em.read(fake_engines))


def test_graph_cache_policy(fake):
    ran = []
    cache = rcuda.GraphCache(rcuda.Stream(), limit=1)
    enqueue = lambda: fake.CUDART.capture.append(lambda: ran.append("graph")) if fake.CUDART.capture is not None \
        else ran.append("direct")  # noqa: E731
    cache.launch("a", enqueue)  # warm-up: direct
    cache.launch("a", enqueue)  # captured, then launched
    cache.launch("a", enqueue)  # launched
    cache.launch("b", enqueue)
    cache.launch("b", enqueue)  # captures b, evicts a (limit 1)
    assert ran == ["direct", "graph", "graph", "direct", "graph"]
    assert list(cache.graphs) == ["b"] and cache.captures == 2


def test_device_buffer_push_pull_rows(fake):
    stream = rcuda.Stream()
    buf = rcuda.DeviceBuffer((6, 3), np.int32, stream, pinned=True)
    buf.host[:2] = [[1, 2, 3], [4, 5, 6]]
    buf.push(2)
    buf.host[:] = 0
    assert buf.pull(2).tolist() == [[1, 2, 3], [4, 5, 6]]
    v = buf.rows(2, 5)
    assert (v.ptr - buf.ptr, v.shape, v.device) == (2 * 12, (3, 3), "cuda")
    with pytest.raises(IndexError):
        buf.rows(4, 7)
    dev = rcuda.DeviceBuffer((4,), np.float32, stream)
    assert dev._host is None and dev.pull(4).tolist() == [0.0] * 4  # zeroed; mirror made on demand


def test_cuda_python_missing_names_package(monkeypatch):
    monkeypatch.setattr(rcuda, "_CUDART", None)
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(rcuda.CudaMissingError, match="pip install"):
        rcuda.cudart()


# ------------------------------------------------------------------------------------------- real TensorRT

def test_real_tensorrt_build_compare_run(export_dir, tmp_path):
    """On a machine with TensorRT + a GPU + the built plugin: build, compare, lossless run."""
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (pip install tensorrt-cu12); "
                                           "scripts/gpu_check.sh runs this path on a GPU machine")
    try:
        n, why = plugins.cuda_device_count()
    except plugins.PluginLibraryError as e:
        pytest.skip(f"plugin library not built: {e}")
    if n == 0:
        pytest.skip(f"no CUDA device: {why}")
    from dflash2.engines.compare import compare

    out = tmp_path / "engines"
    assert build_cli.main([str(export_dir), "--out", str(out), "--max-prefill", "32", "--quiet"]) == 0
    report = compare(export_dir, out)
    assert report.passed, report.table()
    assert any("tensorrt" in r.pair for r in report.rows)
    want = Runtime(export_dir).generate(PROMPT, 24).ids
    assert Runtime(out).generate(PROMPT, 24).ids == want
