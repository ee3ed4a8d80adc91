"""Issue 49, round three of "no data lost, no tracebacks": one test per class that failed before (exit status, one
line naming the file / field, inputs byte-identical, nothing left behind)."""

from __future__ import annotations

import json

import pytest

from dflash2 import tiny
from tests.errorcheck import one_line_error, snapshot


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny.make_pair(tmp_path_factory.mktemp("round3"), family="llama", version=2)


# (1) inputs overwritten: one rule, "a folder filled in place holds its marker or nothing"; "an output is no input"

def test_train_refuses_a_tap_corpus_that_lost_its_corpus_json(pair, tmp_path, capsys):
    from dflash2.cli import train as train_cli

    drafter, target = pair
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "shard-00000.safetensors").write_bytes(b"the user's shard, not to be replaced")
    before = snapshot(tmp_path, target)
    assert train_cli.main(["--target", str(target), "--out", str(tmp_path / "d"), "--corpus", str(corpus),
                           "--prompts", "templated:4", "--threads", "1"]) == 2
    msg = one_line_error(capsys.readouterr().err, "dflash2-train")
    assert str(corpus) in msg and "corpus.json" in msg and "shard-00000.safetensors" in msg
    assert snapshot(tmp_path, target) == before


def _bench_json(path, **kw):
    path.write_text(json.dumps({"whatever": 1, **kw}))
    return path


def test_bench_combine_refuses_json_over_its_own_input(tmp_path, capsys):
    from dflash2.cli import bench as bench_cli

    a = _bench_json(tmp_path / "A.json")
    b = _bench_json(tmp_path / "B.json")
    before = snapshot(tmp_path)
    assert bench_cli.main(["--combine", str(a), str(b), "--json", str(a)]) == 2
    msg = one_line_error(capsys.readouterr().err, "dflash2-bench")
    assert "--json" in msg and "--combine" in msg and str(a) in msg
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("content", ['{"not": "a draft vocabulary"}',
                                     '{"format": "dflash2-draft-vocab", "version": 1, "ids": [1]}'])
def test_draft_vocab_never_replaces_an_existing_file_without_force(pair, tmp_path, capsys, content, monkeypatch):
    from dflash2.cli import draft_vocab as cli
    from dflash2.train import data

    drafter, target = pair
    d = tmp_path / "drafter"
    import shutil

    shutil.copytree(drafter, d)
    (d / "draft_vocab.json").write_text(content)
    monkeypatch.setattr(data, "corpus_answers", lambda c: [list(range(5, 80))])
    before = snapshot(tmp_path, target)
    assert cli.main(["--drafter", str(d), "--target", str(target), "--corpus", str(tmp_path / "c"),
                     "--size", "64"]) == 2
    msg = one_line_error(capsys.readouterr().err, "dflash2-draft-vocab")
    assert str(d / "draft_vocab.json") in msg and "--force" in msg
    assert snapshot(tmp_path, target) == before
    ours = "dflash2-draft-vocab" in content
    code = cli.main(["--drafter", str(d), "--target", str(target), "--corpus", str(tmp_path / "c"), "--size", "64",
                     "--force"])
    err = capsys.readouterr().err
    if ours:
        assert code == 0, err
        assert json.loads((d / "draft_vocab.json").read_text())["size"] >= 64
    else:
        assert code == 2
        assert "format: expected a draft vocabulary" in one_line_error(err, "dflash2-draft-vocab")
        assert snapshot(tmp_path, target) == before


# (2) the tamper hole: the file table covers the folder, stays inside it, and dflash2-compare checks it too

def _drop(name):
    return lambda m: m["files"].pop(name)


def _add(name, path):
    import hashlib
    from pathlib import Path

    data = Path(path).read_bytes()
    return lambda m: m["files"].update({name: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}})


TAMPER = {
    "dropped_weights": (_drop("target.onnx.data"), "target.onnx.data"),
    "dropped_tokenizer": (_drop("tokenizer.json"), "tokenizer.json"),
    "outside_dotdot": (_add("../../x", "/etc/hostname"), "../../x"),
    "outside_absolute": (_add("/etc/hostname", "/etc/hostname"), "/etc/hostname"),
}


@pytest.mark.parametrize("case", sorted(TAMPER))
def test_resealed_file_table_is_refused_by_run_and_compare(case, export_dir, tmp_path, capsys):
    import shutil

    from dflash2.cli import compare as compare_cli
    from dflash2.cli import run as run_cli
    from tests.errorcheck import one_error
    from tests.exports import edit_manifest

    folder = tmp_path / "export"
    shutil.copytree(export_dir, folder)
    edit, named = TAMPER[case]
    if named in ("target.onnx.data", "tokenizer.json") and not (folder / named).is_file():
        pytest.skip(f"{named} not in this export")
    edit_manifest(folder, edit)
    if case == "dropped_weights":  # the edited weights then ran with exit 0, --verify-files included
        with open(folder / named, "r+b") as fh:
            fh.seek(100)
            fh.write(b"\x7f\x7f\x7f\x7f")
    before = snapshot(tmp_path)
    for prog, call in {"dflash2-run": lambda: run_cli.main([str(folder), "--prompt-ids", "1,2",
                                                              "--max-new-tokens", "2", "--verify-files"]),
                       "dflash2-compare": lambda: compare_cli.main([str(folder)])}.items():
        assert call() == 2, prog
        err = "\n".join(ln for ln in capsys.readouterr().err.splitlines() if " allocating " not in ln)
        msg = one_error(err, prog)
        assert named in msg and "manifest.json" in msg, msg
    assert snapshot(tmp_path) == before


def test_compare_checks_the_hashes(export_dir, tmp_path, capsys):
    import shutil

    from dflash2.cli import compare as compare_cli
    from tests.errorcheck import one_error

    folder = tmp_path / "export"
    shutil.copytree(export_dir, folder)
    with open(folder / "target.onnx.data", "r+b") as fh:
        fh.seek(100)
        fh.write(b"\x7f\x7f\x7f\x7f")
    before = snapshot(tmp_path)
    assert compare_cli.main([str(folder)]) == 2
    msg = one_error(capsys.readouterr().err, "dflash2-compare")
    assert "target.onnx.data: sha256 does not match" in msg
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("field, value, want", [("vocab_size", 500, "vocab_size: expected 384"),
                                                ("dtype", "float16", "dtype: expected float32")])
def test_resealed_vocab_size_or_dtype_is_named_not_a_runtime_traceback(field, value, want, export_dir, tmp_path,
                                                                        capsys):
    import shutil

    from dflash2.cli import run as run_cli
    from tests.errorcheck import one_error
    from tests.exports import edit_manifest

    folder = tmp_path / "export"
    shutil.copytree(export_dir, folder)
    edit_manifest(folder, lambda m: m.update({field: value}))
    before = snapshot(tmp_path)
    assert run_cli.main([str(folder), "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 2
    err = "\n".join(ln for ln in capsys.readouterr().err.splitlines() if " allocating " not in ln)
    assert want in one_error(err, "dflash2-run")
    assert snapshot(tmp_path) == before


# (3) GGUF headers parsed with bounds; thread counts bounded

def _gguf(path):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llamb")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _patch(at, value):
    def edit(b: bytearray):
        b[at:at + 8] = value.to_bytes(8, "little")
    return edit


GGUF = {"huge_tensor_count": (_patch(8, 1 << 60), "tensor_count"),
        "huge_kv_count": (_patch(16, 1 << 60), "kv_count"),
        "garbage_after_header": (lambda b: b.__setitem__(slice(24, None), bytes([0xEE]) * (len(b) - 24)), "header"),
        "non_utf8_architecture": (lambda b: b.__setitem__(slice(b.index(b"llamb"), b.index(b"llamb") + 5),
                                                          b"\xff\xfeamb"), "header")}


@pytest.mark.parametrize("case", sorted(GGUF))
def test_hostile_gguf_header_is_a_named_checkpoint_error(case, tmp_path):
    from dflash2.errors import CheckpointError
    from dflash2.gguf_blocks import GgufBlocks

    path = _gguf(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    edit, field = GGUF[case]
    edit(data)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as e:
        GgufBlocks(path, 4, 2)
    assert str(e.value).startswith(f"{path}: {field}: expected ")


def test_thread_counts_are_bounded_by_the_cores(pair, tmp_path, capsys, monkeypatch, export_dir):
    from dflash2.cli import corpus as corpus_cli
    from dflash2.cli import run as run_cli
    from dflash2.cli import train as train_cli

    drafter, target = pair
    before = snapshot(tmp_path, target)
    assert train_cli.main(["--target", str(target), "--out", str(tmp_path / "d"), "--corpus", str(tmp_path / "c"),
                           "--threads", "10000"]) == 2
    assert "--threads: expected at most" in one_line_error(capsys.readouterr().err, "dflash2-train")
    with pytest.raises(SystemExit) as e:
        corpus_cli.main(["taps", str(tmp_path / "c"), "--target", str(target), "--threads", "10000"])
    assert e.value.code == 2 and "expected at most" in capsys.readouterr().err
    monkeypatch.setenv("DFLASH2_THREADS", "10000")
    assert run_cli.main([str(export_dir), "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 2
    err = "\n".join(ln for ln in capsys.readouterr().err.splitlines() if " allocating " not in ln)
    assert "DFLASH2_THREADS: expected at most" in one_line_error(err, "dflash2-run")
    assert snapshot(tmp_path, target) == before


# (4) files that are not files: one check before a file is opened, one rule for every entry of an input folder

def _fifo(p):
    import os

    p.unlink(missing_ok=True)
    os.mkfifo(p)


def _dir(p):
    p.unlink(missing_ok=True)
    p.mkdir()


def _loop(p):
    p.unlink(missing_ok=True)
    p.symlink_to(p.name)


def _deep(p):
    p.write_text("[" * 100_000 + "]" * 100_000)


NOT_FILES = {  # case -> (folder, file, how, what the line names)
    "fifo_weights": ("target", "model.safetensors", _fifo, "found a FIFO"),
    "fifo_tokenizer": ("target", "tokenizer.json", _fifo, "found a FIFO"),
    "dir_weights": ("target", "model.safetensors", _dir, "found a folder"),
    "loop_weights": ("target", "model.safetensors", _loop, "found a symbolic link loop"),
    "loop_drafter_weights": ("drafter", "model.safetensors", _loop, "found a symbolic link loop"),
    "deep_config": ("target", "config.json", _deep, "deeper nesting"),
}


@pytest.fixture
def alarm():
    """A hang fails the test instead of blocking the suite (a FIFO read blocked forever)."""
    import signal

    def hung(signum, frame):
        raise TimeoutError("hung: a read blocked")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("case", sorted(NOT_FILES))
def test_export_refuses_entries_that_are_not_files(case, pair, tmp_path, capsys, alarm):
    import shutil

    from dflash2.cli import export as export_cli

    drafter, target = (shutil.copytree(p, tmp_path / n) for p, n in zip(pair, ("drafter", "target")))
    which, name, how, want = NOT_FILES[case]
    how((tmp_path / which) / name)
    before = snapshot(tmp_path)
    assert export_cli.main(["--model", str(drafter), "--target", str(target), "--out", str(tmp_path / "out"),
                            "--quiet"]) == 2
    msg = one_line_error(capsys.readouterr().err, "dflash2-export")
    assert name in msg and want in msg, msg
    assert snapshot(tmp_path) == before


def test_model_link_loop_and_long_out_name_are_one_line(pair, tmp_path, capsys, alarm):
    from dflash2.cli import export as export_cli

    drafter, target = pair
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    before = snapshot(tmp_path)
    assert export_cli.main(["--model", str(loop), "--target", str(target), "--out", str(tmp_path / "out")]) == 2
    assert "symbolic link loop" in one_line_error(capsys.readouterr().err, "dflash2-export")
    assert export_cli.main(["--model", str(drafter), "--target", str(target), "--out", str(tmp_path / ("o" * 300))]) \
        == 2
    assert "at most 255 bytes" in one_line_error(capsys.readouterr().err, "dflash2-export")
    assert snapshot(tmp_path) == before


def test_a_fifo_in_an_export_folder_is_refused_by_run(export_dir, tmp_path, capsys, alarm):
    import shutil

    from dflash2.cli import run as run_cli
    from tests.errorcheck import one_error

    folder = tmp_path / "export"
    shutil.copytree(export_dir, folder)
    _fifo(folder / "tokenizer.json")
    before = snapshot(tmp_path)
    assert run_cli.main([str(folder), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = "\n".join(ln for ln in capsys.readouterr().err.splitlines() if " allocating " not in ln)
    assert "tokenizer.json" in one_error(err, "dflash2-run")
    assert snapshot(tmp_path) == before


# (5) the environment: closed streams, cache folders that are files

def _sh(script: str, env: dict | None = None):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    full = {**os.environ, "PYTHONPATH": str(root), **(env or {})}
    return subprocess.run(["bash", "-c", script.replace("PY", sys.executable)], capture_output=True, text=True,
                          env=full, timeout=300, cwd=root)


def test_closed_stdout_and_stdin_are_no_traceback(export_dir, tmp_path):
    before = snapshot(export_dir)
    r = _sh(f"PY -m dflash2.cli.run {export_dir} --prompt-ids 1,2 --max-new-tokens 2 >&-")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    r = _sh(f"PY -m dflash2.cli.run {export_dir} --prompt - --max-new-tokens 2 <&-")
    assert r.returncode == 2, r.stderr
    assert "stdin: expected the prompt" in one_line_error(
        "\n".join(ln for ln in r.stderr.splitlines() if " allocating " not in ln), "dflash2-run")
    assert snapshot(export_dir) == before


@pytest.mark.parametrize("var", ["HOME", "DFLASH2_VERIFIED_DIR"])
def test_a_cache_folder_that_is_a_file_is_no_traceback(var, export_dir, tmp_path):
    import shutil

    folder = tmp_path / "export"
    shutil.copytree(export_dir, folder)
    afile = tmp_path / "afile"
    afile.write_text("mine")
    env = {var: str(afile)}
    if var == "HOME":
        env["DFLASH2_CACHE"] = ""
    before = snapshot(tmp_path)
    r = _sh(f"{'unset DFLASH2_CACHE; ' if var == 'HOME' else ''}PY -m dflash2.cli.run {folder} --prompt-ids 1,2 "
            f"--max-new-tokens 2", {k: v for k, v in env.items() if v})
    assert "Traceback" not in r.stderr and r.returncode in (0, 1), r.stderr
    assert afile.read_text() == "mine" and snapshot(tmp_path) == before


# (6) training state checked like a manifest; one dflash2-train per --out

def _state(folder, data: bytes | None = None, metadata=None):
    from dflash2.train import state

    p = state.path(folder)
    p.parent.mkdir(parents=True, exist_ok=True)
    if data is None:
        import torch
        from safetensors.torch import save_file

        save_file({"rng/torch": torch.zeros(3)}, str(p), metadata=metadata)
    else:
        p.write_bytes(data)
    return p


STATES = {
    "truncated": lambda f: _state(f, b"\x40\x00\x00\x00\x00\x00\x00\x00{\"a\""),
    "eight_bytes": lambda f: _state(f, b"\x00" * 8),
    "random": lambda f: _state(f, bytes(range(256)) * 4),
    "no_metadata": lambda f: _state(f),
    "metadata_not_ours": lambda f: _state(f, metadata={"resume": "[1, 2]"}),
    "state_is_a_file": lambda f: (f / "train_state").write_text("mine"),
    "state_is_a_fifo": lambda f: _fifo(_state(f)),
}


@pytest.mark.parametrize("case", sorted(STATES))
def test_a_damaged_training_state_is_named(case, tmp_path, alarm):
    from dflash2.errors import Dflash2Error
    from dflash2.train import state

    out = tmp_path / "d"
    out.mkdir()
    STATES[case](out)
    before = snapshot(tmp_path)
    with pytest.raises(Dflash2Error) as e:
        state.step_of(out)
    msg = str(e.value)
    assert "train_state" in msg and "\n" not in msg, msg
    assert snapshot(tmp_path) == before


def test_a_resume_under_another_block_size_is_refused(tmp_path):
    from dflash2.errors import Dflash2Error
    from dflash2.train import state

    with pytest.raises(Dflash2Error, match=r"config.block_size: expected 4 \(this run's\), found 8"):
        state.check_same_drafter(tmp_path / "resume.safetensors", {"block_size": 8, "layers": 1},
                                 {"block_size": 4, "layers": 1})


def test_two_trainers_on_one_out_the_second_is_refused(pair, tmp_path, capsys):
    from dflash2.cli import train as train_cli
    from dflash2.folders import output_lock

    drafter, target = pair
    with output_lock(tmp_path / "d"):  # a first dflash2-train holds --out
        before = snapshot(tmp_path, target)
        assert train_cli.main(["--target", str(target), "--out", str(tmp_path / "d"), "--corpus",
                               str(tmp_path / "c"), "--prompts", "templated:4", "--threads", "1"]) == 2
        msg = one_line_error(capsys.readouterr().err, "dflash2-train")
        assert "locked by process" in msg and str(tmp_path / "d") in msg
        assert snapshot(tmp_path, target) == before
    assert not list(tmp_path.glob(".d.lock"))


# the chat template and --repair-corpus (the last class)

@pytest.mark.parametrize("template", ["{{ 1 / 0 }}", "{{ messages[5].content }}", "{{ undefined_fn() }}"])
def test_a_template_that_fails_while_rendering_is_named(template, export_dir, tmp_path):
    import shutil

    from dflash2.runtime.text import Text, TokenizerError

    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(export_dir / "tokenizer.json", folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    with pytest.raises(TokenizerError, match=r"tok: chat template: expected a template that renders these messages"):
        Text(folder).encode("hi", chat=True)


def test_repair_corpus_knows_the_same_target_under_another_path(pair, tmp_path):
    import shutil

    from dflash2.train.api import same_target

    drafter, target = pair
    link = tmp_path / "link"
    link.symlink_to(target)
    copy = shutil.copytree(target, tmp_path / "copy")
    assert same_target(str(target), link) and same_target(str(target), copy)
    assert same_target(str(target), str(target) + "/")
    assert not same_target(str(target), drafter)
