"""dflash2-run's start: files hashed once and trusted while unchanged (dflash2.manifest.hashcache), every change
still caught, a full rehash on demand, and what this machine cannot run refused before any hashing."""

from __future__ import annotations

import os
import shutil

import pytest

from dflash2 import manifest as mf
from dflash2.manifest import sealing
from dflash2.cli import run as run_cli
from dflash2.errors import Dflash2Error
from dflash2.runtime.api import Runtime
from tests.exports import edit_manifest


@pytest.fixture
def folder(exports, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH2_VERIFIED_DIR", str(tmp_path / "cache" / "verified"))
    copy = tmp_path / "copy"
    shutil.copytree(exports[("llama", 1)], copy)  # copy2 keeps the export's (older) mtimes
    old = (copy / "manifest.json").stat().st_mtime - 60
    for p in copy.iterdir():  # written a minute ago: past the racy-timestamp window
        os.utime(p, (old, old))
    return copy


@pytest.fixture
def hashed(monkeypatch):
    """The names of the files hashed by the next calls."""
    seen = []
    real = sealing.sha256

    def counting(path):
        seen.append(path.name)
        return real(path)

    monkeypatch.setattr(sealing, "sha256", counting)  # what the file checks and the writer hash with
    return seen


def test_hashed_once_then_trusted_until_a_file_changes(folder, hashed, capsys):
    files = set(mf.load(folder, check_files=False).files)
    mf.load(folder)
    assert set(hashed) == files  # the first check hashes every file
    hashed.clear()
    Runtime(folder)
    assert hashed == []  # unchanged since: nothing rehashed
    Runtime(folder, verify="full")
    assert set(hashed) == files  # --verify-files hashes everything
    hashed.clear()
    with open(folder / "target.onnx.data", "r+b") as fh:  # same size, new bytes: mtime moves
        fh.seek(100)
        fh.write(b"\x00\x01\x02\x03")
    assert run_cli.main([str(folder), "--prompt-ids", "1,2"]) == 2
    assert "target.onnx.data: sha256 does not match the manifest" in capsys.readouterr().err
    assert hashed == ["target.onnx.data"]  # only the changed file was hashed


def test_a_file_written_just_before_its_check_is_rehashed(folder, hashed):
    os.utime(folder / "drafter.onnx.data")  # mtime now: within the racy window of the next check
    mf.load(folder)
    hashed.clear()
    mf.load(folder)
    assert hashed == ["drafter.onnx.data"]


def test_a_replaced_file_with_the_old_mtime_is_caught(folder, hashed):
    mf.load(folder)
    p = folder / "target.onnx.data"
    st = p.stat()
    data = bytearray(p.read_bytes())
    data[200] ^= 0xFF
    p.unlink()
    p.write_bytes(bytes(data))  # a new inode
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(mf.ManifestError, match="target.onnx.data: sha256 does not match"):
        mf.load(folder)


def test_an_unreadable_record_only_costs_a_rehash(folder, hashed, tmp_path):
    mf.load(folder)
    for p in (tmp_path / "cache" / "verified").iterdir():
        p.write_text("{not json")
    hashed.clear()
    mf.load(folder)
    assert len(hashed) == len(mf.load(folder, check_files=False).files)


def test_what_cannot_run_here_is_refused_before_hashing(folder, monkeypatch):
    from tests.exports import relabel_dtype

    edit_manifest(folder, lambda d: relabel_dtype(d, "bfloat16"))

    def no_hashing(path):
        raise AssertionError(f"hashed {path} before refusing")

    monkeypatch.setattr(sealing, "sha256", no_hashing)
    with pytest.raises(Dflash2Error, match="a bfloat16 export cannot run on ONNX Runtime's CPU provider"):
        Runtime(folder)
    # emulating copies (the export's row check, the tests) run on ONNX Runtime's CPU provider only
    for kw in ({"backend": "tensorrt"}, {"provider": "CUDAExecutionProvider"}):
        with pytest.raises(Dflash2Error, match="emulated graphs run on ONNX Runtime's CPU provider from an export"):
            Runtime(folder, emulated={"target": "target.onnx"}, **kw)


def test_the_export_records_the_hashes_it_took(tmp_path, hashed, monkeypatch):
    """The first start after an export hashes nothing the export itself hashed (and that was written before it
    hashed); a copy elsewhere is a folder the record has never seen: hashed in full."""
    from dflash2 import tiny
    from dflash2.manifest import hashcache
    from dflash2.export.api import export

    monkeypatch.setenv("DFLASH2_VERIFIED_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(hashcache, "RACY_NS", 0)  # the tiny export's files are written moments before the hashing
    drafter, target = tiny.make_pair(tmp_path / "pair")
    out = tmp_path / "export"
    export(drafter, target, out, quiet=True)
    files = set(mf.load(out, check_files=False).files)
    assert set(hashed) == files  # the export's own hashing
    hashed.clear()
    mf.load(out)
    assert hashed == []
    shutil.copytree(out, tmp_path / "copy")
    mf.load(tmp_path / "copy")
    assert set(hashed) == files
