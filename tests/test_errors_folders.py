"""Output folders never reach an input: is / contains / lies inside, with or without --force, for
dflash2-export, dflash2-build and dflash2-train; --force replaces only a folder dflash2 wrote."""

from __future__ import annotations

import json
import os

import pytest

from dflash2 import tiny
from dflash2.cli import build as build_cli
from dflash2.cli import export as export_cli
from dflash2.cli import train as train_cli
from tests.errorcheck import one_line_error, snapshot


@pytest.fixture
def pair(tmp_path):
    """A private tiny pair inside tmp_path/ckpt (the cases below point outputs at it)."""
    d, t = tiny.make_pair(tmp_path / "ckpt", family="llama", version=2)
    return d, t


def _export(capsys, drafter, target, out, *extra) -> str:
    code = export_cli.main(["--model", str(drafter), "--target", str(target), "--out", str(out), "--quiet", *extra])
    assert code == 2
    return one_line_error(capsys.readouterr().err, "dflash2-export")


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("where,how", [("drafter", "is the --model"), ("target", "is the --target"),
                                       ("ckpt", "contains the --model"), ("root", "contains the --model"),
                                       ("inside-drafter", "lies inside the --model"),
                                       ("inside-target", "lies inside the --target")])
def test_export_output_apart_from_inputs(tmp_path, pair, capsys, where, how, force):
    drafter, target = pair
    out = {"drafter": drafter, "target": target, "ckpt": tmp_path / "ckpt", "root": tmp_path,
           "inside-drafter": drafter / "export", "inside-target": target / "sub" / "export"}[where]
    before = snapshot(tmp_path)
    msg = _export(capsys, drafter, target, out, *(["--force"] if force else []))
    assert how in msg and "choose another --out" in msg
    assert snapshot(tmp_path) == before  # inputs byte-identical, nothing created, nothing left behind


def test_export_symlinked_output_is_resolved(tmp_path, pair, capsys):
    drafter, target = pair
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    before = snapshot(tmp_path)
    assert "is the --target" in _export(capsys, drafter, target, link, "--force")
    # and an input reached through a symlink: the output is its real folder
    alias = tmp_path / "alias"
    alias.symlink_to(drafter.parent, target_is_directory=True)
    assert "lies inside the --model" in _export(capsys, alias / drafter.name, target, drafter / "x", "--force")
    alias.unlink()
    assert snapshot(tmp_path) == before


def test_force_replaces_only_a_dflash2_folder(tmp_path, pair, capsys):
    drafter, target = pair
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    (mine / "manifest.json").write_text(json.dumps({"format": "someone-else"}))
    before = snapshot(tmp_path)
    msg = _export(capsys, drafter, target, mine, "--force")
    assert "--force replaces only a folder written by dflash2" in msg
    assert snapshot(tmp_path) == before


def test_build_output_apart_from_export(tmp_path, capsys):
    # a folder that *is* ours (dflash2 manifest): --force would otherwise replace it
    export = tmp_path / "export"
    export.mkdir()
    (export / "manifest.json").write_text(json.dumps({"format": "dflash2-export", "format_version": 1}))
    (export / "target.onnx").write_bytes(os.urandom(64))
    cache = tmp_path / "cache" / "timing.cache"
    cache.parent.mkdir()
    cache.write_bytes(b"cache")
    before = snapshot(tmp_path)
    for out, extra, how in [(export, [], "is the EXPORT_DIR"), (tmp_path, [], "contains the EXPORT_DIR"),
                            (export / "engines", [], "lies inside the EXPORT_DIR"),
                            (cache.parent, ["--timing-cache", str(cache)], "contains the --timing-cache file")]:
        for force in ([], ["--force"]):
            assert build_cli.main([str(export), "--out", str(out), *extra, *force]) == 2
            assert how in one_line_error(capsys.readouterr().err, "dflash2-build")
    assert build_cli.main([str(export), "--out", str(export), "--manifest-only"]) == 2
    assert "is the EXPORT_DIR" in one_line_error(capsys.readouterr().err, "dflash2-build")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("case,how", [("out=target", "--out {t} is the --target"),
                                      ("out-in-target", "lies inside the --target"),
                                      ("corpus=target", "--corpus {t} is the --target"),
                                      ("corpus-in-out", "contains the --corpus folder"),
                                      ("out-in-corpus", "lies inside the --corpus"),
                                      ("second-corpus=out", "is the --corpus")])
def test_train_folders_apart(tmp_path, capsys, case, how):
    target = tiny.make_target(tmp_path / "target", family="llama")
    d, c = tmp_path / "d", tmp_path / "c"
    out, corpora = {"out=target": (target, [c]), "out-in-target": (target / "d", [c]),
                    "corpus=target": (d, [target]), "corpus-in-out": (d, [d / "corpus"]),
                    "out-in-corpus": (c / "d", [c]), "second-corpus=out": (d, [c, d])}[case]
    before = snapshot(tmp_path)
    code = train_cli.main(["--target", str(target), "--out", str(out), "--corpus", *map(str, corpora),
                           "--steps", "1", "--prompts", "2"])
    assert code == 2
    assert how.format(t=target) in one_line_error(capsys.readouterr().err, "dflash2-train")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("force", [False, True])
def test_prepare_never_replaces_a_users_file_or_folder(tmp_path, capsys, force):
    """dflash2-prepare-smollm2 once moved a user's file aside and emptied a user's folder (exit 0); it now
    follows the output rule: only a folder it wrote itself is replaced."""
    from dflash2.cli import prepare_smollm2 as smollm2

    user_file, user_dir = tmp_path / "notes.txt", tmp_path / "mine"
    user_file.write_text("mine")
    user_dir.mkdir()
    (user_dir / "config.json").write_text("{}")
    (user_dir / "model.safetensors").write_text("not weights")
    before = snapshot(tmp_path)
    for out, want in ((user_file, "expected a folder, found a file"), (user_dir, "was not written by")):
        assert smollm2.main(["--out", str(out), *(["--force"] if force else [])]) == 2
        assert want in one_line_error(capsys.readouterr().err, "dflash2-prepare-smollm2")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("appeared", ["user-folder", "user-file", "second-export"])
def test_what_appears_at_out_meanwhile_is_never_replaced(tmp_path, pair, capsys, monkeypatch, appeared):
    """The output rule again at the final rename: a folder or file that appeared at --out while the export ran
    (checked absent at the start) is refused and left byte-identical; nothing is left behind."""
    from dflash2.export import api
    from dflash2.folders import replace_folder

    drafter, target = pair
    out = tmp_path / "out"
    other = tmp_path / "other-export"
    if appeared == "second-export":  # two exports to one --out: the one finishing second must not replace
        assert export_cli.main(["--model", str(drafter), "--target", str(target), "--out", str(other), "--quiet"]) == 0
        capsys.readouterr()

    def racing(tmp, dest, *a, **kw):
        if appeared == "user-folder":
            dest.mkdir()
            (dest / "notes.txt").write_text("mine")
        elif appeared == "user-file":
            dest.write_text("mine")
        else:
            os.rename(other, dest)
        return replace_folder(tmp, dest, *a, **kw)

    monkeypatch.setattr(api, "replace_folder", racing)
    code = export_cli.main(["--model", str(drafter), "--target", str(target), "--out", str(out), "--quiet"])
    msg = one_line_error(capsys.readouterr().err, "dflash2-export")
    assert code == 2 and "appeared while this ran" in msg and "left as it is" in msg
    if appeared == "user-folder":
        assert [p.name for p in out.iterdir()] == ["notes.txt"]
    elif appeared == "user-file":
        assert out.read_text() == "mine"
    else:
        assert (out / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", "out"])  # no .out.tmp-* / .old-*


def test_force_still_refuses_a_users_folder_that_appeared(tmp_path):
    """With --force the final rename replaces an empty folder or one of ours, never a user's."""
    from dflash2.folders import OutputError, replace_folder

    out, tmp = tmp_path / "out", tmp_path / ".out.tmp-1"
    tmp.mkdir()
    (tmp / "manifest.json").write_text(json.dumps({"format": "dflash2-export"}))
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="does not replace"):
        replace_folder(tmp, out, force=True)
    assert (out / "notes.txt").read_text() == "mine" and tmp.is_dir()
    (out / "notes.txt").unlink()  # empty now: --force may replace it
    replace_folder(tmp, out, force=True)
    assert (out / "manifest.json").is_file() and not tmp.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
