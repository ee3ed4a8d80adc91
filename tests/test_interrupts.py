"""Interruptions: a real export killed mid-way (SIGTERM, SIGINT) leaves nothing behind and answers with
one line + 130 / 143; stale temp folders of dead processes are removed by the next run; every CLI
turns Ctrl-C into that line instead of a traceback."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash2 import folders, tiny
from tests.errorcheck import snapshot

CLIS = ["export", "build", "run", "bench", "bench_quant", "compare", "demo", "draft_vocab", "make_tiny", "train",
        "plugins"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny.make_pair(tmp_path_factory.mktemp("pair"), family="llama", version=2)


def _start_export(drafter: Path, target: Path, out: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[1]))
    # the signals back to their defaults in the child: a shell runs background jobs (`pytest ... &`) with SIGINT
    # ignored and `nohup` ignores SIGHUP; the child would inherit that and finish instead of being interrupted
    return subprocess.Popen([sys.executable, "-m", "dflash2.cli.export", "--model", str(drafter), "--target",
                             str(target), "--out", str(out), "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, preexec_fn=_default_signals)


def _default_signals() -> None:
    for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL)


def _wait_for_graph_file(proc: subprocess.Popen, out: Path, timeout: float = 240) -> Path:
    """Block until the export's temp folder holds a written graph (the export is mid-way)."""
    tmp = out.parent / f".{out.name}.tmp-{proc.pid}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"export ended before it could be interrupted: {proc.communicate()}")
        if tmp.is_dir() and any(p.suffix == ".onnx" for p in tmp.iterdir()):
            return tmp
        time.sleep(0.05)
    proc.kill()
    pytest.fail("the export never wrote a graph")


@pytest.mark.parametrize("sig,status,word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted"),
                                             (signal.SIGHUP, 129, "hung up (SIGHUP)")])  # SIGHUP: the terminal closed
def test_export_killed_midway_leaves_nothing(tmp_path, pair, sig, status, word):
    drafter, target = pair
    before = snapshot(drafter, target)
    out = tmp_path / "o"
    proc = _start_export(drafter, target, out)
    tmp = _wait_for_graph_file(proc, out)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == status, err
    assert err.strip().splitlines() == [f"dflash2-export: {word}; nothing was written"]
    assert not tmp.exists() and list(tmp_path.iterdir()) == []
    assert snapshot(drafter, target) == before


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temp_folders_of_dead_processes_are_removed(tmp_path):
    out = tmp_path / "export"
    dead, live = _dead_pid(), subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for name in (f".export.tmp-{dead}", f".export.tmp-{live.pid}", f".other.tmp-{dead}", "keep"):
            (tmp_path / name).mkdir()
            (tmp_path / name / "target.onnx.data").write_bytes(b"x" * 1000)
        (tmp_path / f".export.tmp-{dead}.txt").write_text("not ours: another name")
        with folders.temp_folder(out) as tmp:
            assert tmp.name == f".export.tmp-{os.getpid()}"
            left = sorted(p.name for p in tmp_path.iterdir())
        # the dead process's folder is gone; a live one, other outputs' and unrelated entries stay
        assert left == sorted([f".export.tmp-{os.getpid()}", f".export.tmp-{live.pid}", f".other.tmp-{dead}",
                               f".export.tmp-{dead}.txt", "keep"])
        assert not tmp.exists()
    finally:
        live.kill()
        live.wait()


def test_stale_old_folder_is_put_back_when_the_output_is_missing(tmp_path):
    """Killed between moving the previous output aside and renaming the new one in: the previous
    export comes back, it is not deleted."""
    out, dead = tmp_path / "export", _dead_pid()
    old = tmp_path / f".export.old-{dead}"
    old.mkdir()
    (old / "manifest.json").write_text("{}")
    assert folders.remove_stale(out) == [] and (out / "manifest.json").is_file() and not old.exists()
    old.mkdir()  # with the output present, the moved-aside copy is the stale one
    assert folders.remove_stale(out) == [old] and not old.exists()


def test_replace_folder_interrupted_puts_the_previous_folder_back(tmp_path, monkeypatch):
    out, tmp = tmp_path / "export", tmp_path / ".export.tmp-1"
    out.mkdir()
    previous = '{"format": "dflash2-export", "note": "previous"}'  # ours: --force may replace it
    (out / "manifest.json").write_text(previous)
    tmp.mkdir()
    real_rename = Path.rename

    def rename(self, target):
        if self == tmp:
            raise KeyboardInterrupt  # Ctrl-C between the two renames
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        folders.replace_folder(tmp, out, force=True)
    assert (out / "manifest.json").read_text() == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == [".export.tmp-1", "export"]


@pytest.mark.parametrize("name", CLIS)
def test_every_cli_answers_ctrl_c_with_one_line_and_130(name, monkeypatch, capsys):
    """Ctrl-C at any point (here: while the arguments are parsed) -> one line, status 130."""
    mod = importlib.import_module(f"dflash2.cli.{name}")

    def parse_args(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    assert mod.main([]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dflash2-{name.replace('_', '-')}: interrupted; "), err


def test_sigterm_handler_is_restored(tmp_path):
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with folders.temp_folder(tmp_path / "x"):
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        mine = lambda *a: None  # noqa: E731 - someone else's handler is never replaced
        signal.signal(signal.SIGTERM, mine)
        with folders.temp_folder(tmp_path / "x"):
            assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("name", CLIS)
@pytest.mark.parametrize("code,words", [(28, "no space left on the device"), (30, "read-only file system"),
                                        (1, "operation not permitted")])
def test_every_cli_answers_a_full_or_read_only_disk_with_one_line(name, code, words, monkeypatch, capsys):
    """ENOSPC / EROFS / EPERM anywhere (here: raised while the arguments are parsed) -> one line naming the file
    and the cause, status 1, no traceback."""
    mod = importlib.import_module(f"dflash2.cli.{name}")

    def parse_args(self, *a, **k):
        raise OSError(code, os.strerror(code), "/some/where/file.bin")

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    assert mod.main([]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dflash2-{name.replace('_', '-')}: error: /some/where/file.bin: "
                                               f"{words}"), err


def test_safetensors_disk_errors_are_recognised_and_bugs_keep_their_traceback():
    from dflash2.interrupts import environment_error

    class SafetensorError(Exception):  # safetensors' type names the OS code only in its text
        pass

    assert environment_error(SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                                             "message: \"No space left on device\" })")) == "no space left on the device"
    assert environment_error(SafetensorError("Error while serializing: I/O error: No space left on device (os error "
                                             "28)")) == "no space left on the device"  # safetensors 0.8's wording
    assert environment_error(SafetensorError("Error while deserializing header: HeaderTooLarge")) is None
    assert environment_error(OSError(2, "No such file or directory", "x")) is None  # the caller's to name
    assert environment_error(ValueError("a bug")) is None


def test_export_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, pair, capsys, monkeypatch):
    import errno

    import onnx

    from dflash2.cli import export as export_cli

    drafter, target = pair

    def full(*a, **k):  # the first graph write hits a full disk (onnx's writer names no file)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(onnx, "save_model", full)
    before = snapshot(tmp_path, drafter.parent)
    assert export_cli.main(["--model", str(drafter), "--target", str(target), "--out", str(tmp_path / "out"),
                            "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dflash2-export: error: {tmp_path / 'out'}: no space left on the "
                                               f"device while writing the export") and \
        err[0].endswith("nothing was written"), err
    assert snapshot(tmp_path, drafter.parent) == before


@pytest.mark.parametrize("name", ["export", "train", "make_tiny"])
def test_ctrl_c_wrapped_by_a_library_is_still_an_interrupt(name, monkeypatch, capsys):
    """torch.export turns a KeyboardInterrupt during tracing into its own TorchExportError: still one line and 130."""
    mod = importlib.import_module(f"dflash2.cli.{name}")

    class TorchExportError(RuntimeError):
        pass

    def parse_args(self, *a, **k):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise TorchExportError("Failed to export the model with torch.export") from e

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    assert mod.main([]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"dflash2-{name.replace('_', '-')}: interrupted; "), err


@pytest.fixture
def python_sigint():
    """Python's own Ctrl-C handler, as a CLI process starts with: an earlier in-process test may leave another (in
    the full suite SIGINT was found ignored by then, and an ignored Ctrl-C is rightly not answered)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_during_the_final_swap_waits_for_it_and_says_the_output_is_complete(tmp_path, monkeypatch, capsys,
                                                                                   python_sigint):
    """A real SIGINT sent while the replaced folder is being removed: the removal runs to the end (no half old
    folder beside the new one), the interrupt arrives right after, and the CLI line says OUT is complete."""
    from dflash2.interrupts import interruptible

    out, tmp = tmp_path / "export", tmp_path / ".export.tmp-1"
    out.mkdir()
    (out / "manifest.json").write_text('{"format": "dflash2-export"}')
    for i in range(24):
        (out / f"old-{i}.bin").write_bytes(b"x")
    tmp.mkdir()
    (tmp / "manifest.json").write_text('{"format": "dflash2-export", "new": true}')
    real_rmtree = folders.shutil.rmtree

    def rmtree(path, *a, **k):  # Ctrl-C as the old folder starts to go
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # it would have been delivered by now, were it not held
        return real_rmtree(path, *a, **k)

    monkeypatch.setattr(folders.shutil, "rmtree", rmtree)

    @interruptible("dflash2-export")
    def main(argv):
        folders.replace_folder(tmp, out, force=True)
        time.sleep(1)  # (not reached: the held SIGINT arrives as the swap ends)
        return 0

    assert main([]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"dflash2-export: interrupted; {out}: complete and in place (the signal came after it was written)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no .old- half folder, no temp
    assert '"new": true' in (out / "manifest.json").read_text() and not list(out.glob("old-*"))


@pytest.mark.parametrize("sig,status,word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGHUP, 129, "hung up"),
                                             (signal.SIGINT, 130, "interrupted")])
def test_a_signal_while_exiting_says_the_run_had_finished(sig, status, word):
    """After main() returned, the interpreter's teardown can take seconds (sessions, threads): a signal there
    ended the process silently (-15). Now one line and the shell's status, saying the work was done."""
    code = ("import os, signal, sys, time\nfrom dflash2.interrupts import interruptible\n"
            "signal.signal(signal.SIGHUP, signal.SIG_DFL); signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "@interruptible('dflash2-x')\ndef main(argv=None):\n    print('done')\n    return 0\n"
            f"main()\nos.kill(os.getpid(), {int(sig)})\ntime.sleep(30)\nprint('not reached')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == status, (r.returncode, r.stderr)
    assert r.stdout == "done\n"
    assert r.stderr.strip() == f"dflash2-x: {word}{' (SIGHUP)' if sig == signal.SIGHUP else ''} while exiting; " \
        "it had finished with status 0 (nothing more to do)"
