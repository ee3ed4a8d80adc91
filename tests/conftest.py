"""Shared fixtures: tiny checkpoint pairs made once per session with the package's own factory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dflash2.native import library
from dflash2 import tiny
from dflash2.cli import build as build_cli
from dflash2.engines import build as eb
from dflash2.engines import plan as ep
from dflash2.native import cudart as ncudart
from dflash2.native import tensorrt as ntrt
from tests.exports import T

PAIRS = [("llama", 1), ("llama", 2), ("qwen3", 1), ("qwen3", 2)]


@pytest.fixture(scope="session", autouse=True)
def verified_record(tmp_path_factory):
    """dflash2-run's record of hashed files (dflash2.manifest.hashcache) goes to a temporary folder, not ~/.cache."""
    import os

    old = os.environ.get("DFLASH2_VERIFIED_DIR")
    os.environ["DFLASH2_VERIFIED_DIR"] = str(tmp_path_factory.mktemp("verified"))
    yield
    if old is None:
        os.environ.pop("DFLASH2_VERIFIED_DIR", None)
    else:
        os.environ["DFLASH2_VERIFIED_DIR"] = old


@pytest.fixture(scope="session", autouse=True)
def cold_schedules():
    """Every runtime session in the tests starts cold (calibrates), whatever earlier runs saved: the schedule
    cache (dflash2.runtime.schedule_cache) is off unless a test turns it on with its own DFLASH2_CACHE."""
    import os

    old = os.environ.get("DFLASH2_SCHEDULE_CACHE")
    os.environ["DFLASH2_SCHEDULE_CACHE"] = "0"
    yield
    if old is None:
        os.environ.pop("DFLASH2_SCHEDULE_CACHE", None)
    else:
        os.environ["DFLASH2_SCHEDULE_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def targets(tiny_root):
    return {fam: tiny.make_target(tiny_root / f"target-{fam}", family=fam) for fam in ("llama", "qwen3")}


@pytest.fixture(scope="session")
def pairs(tiny_root, targets):
    """(family, version) -> (drafter_dir, target_dir)."""
    out = {}
    for fam, ver in PAIRS:
        d = tiny.make_drafter(tiny_root / f"drafter-{fam}-v{ver}", targets[fam], version=ver,
                              num_layers=2 if ver == 2 else 1)
        out[(fam, ver)] = (d, targets[fam])
    return out


@pytest.fixture(scope="session")
def exports(tiny_root, pairs):
    """(family, version) -> export folder, made lazily once per session."""
    from tests.exports import export_pair

    class Lazy(dict):
        def __missing__(self, key):
            self[key] = export_pair(tiny_root, pairs, *key, max_seq_len=6000)
            return self[key]

    return Lazy()


# ------------------------------------------------------------------ the TensorRT path without TensorRT
# shared by test_engines.py, test_compare.py and test_trt_backend.py

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
    lib = tmp_path / "lib" / library.PLUGIN_LIB
    lib.parent.mkdir()
    lib.write_bytes(b"not really a shared library")
    monkeypatch.setattr(library, "library_abi", lambda path: library.ABI_VERSION)
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
    monkeypatch.setattr(ntrt, "_trt", fake_trt)
    monkeypatch.setattr(ntrt, "_LOADED", {})
    monkeypatch.setattr(ncudart, "_CUDART", fake_trt.CUDART)
    return fake_trt


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


@pytest.fixture
def fake_engines(export_dir, tmp_path, fake_plugin, fake) -> Path:
    """dflash2-build's real code over the fake TensorRT: engines are JSON naming ONNX + profiles."""
    plan = ep.plan_build(export_dir, tmp_path / "fake-engines", max_seq_len=48, max_prefill=16, plugin=fake_plugin,
                         timing_cache=tmp_path / "cache" / "timing.cache", workspace_mb=256)
    eb.build(plan, quiet=True)
    return tmp_path / "fake-engines"
