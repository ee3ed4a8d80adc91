"""A full disk (ENOSPC) or a spent quota (EDQUOT) under dflash2-make-tiny and dflash2-train (issue 49, round 3).

The disk fills the way the other CLIs' tests fill it (tests/test_interrupts.py, tests/test_train_live.py): the
library writers are monkeypatched. `FullDisk` makes the n-th write of a chosen file put half its bytes down and
then fail exactly as the real writer fails on a full disk: safetensors' SafetensorError whose text alone carries
'(os error 28)', Python's OSError(28) with no file name. Every case checks: one line `PROG: error: PATH: no space
left on the device while writing WHAT (N needed, M free); WHAT IS LEFT`, status 1, no traceback, no temporary or
half file under any name, the inputs byte-identical, and what is left whole and loadable (the rerun succeeds).
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from safetensors import SafetensorError

from dflash2 import tiny
from dflash2.cli import make_tiny as make_tiny_cli
from dflash2.cli import train as train_cli
from dflash2.train import corpus, state, trainer
from dflash2.disk import DiskFullError, full_code, size
from tests.errorcheck import one_line_error, snapshot

TEXT = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded"}


def final_name(path) -> str:
    """The name a file is written for: '.config.json.tmp-123' and 'resume.safetensors.tmp-123' -> their final names."""
    return Path(path).name.split(".tmp-")[0].lstrip(".")


class FullDisk:
    """The writers dflash2 uses, patched: the `nth` write of the file `name` (its final name; 'model-' / 'shard-':
    names starting so; '': any file) under `under` writes half its bytes, then fails as a full disk (or quota,
    `code`) does. `written` lists the final name of every file written, failed or not."""

    SAFETENSORS = (tiny, state, trainer, corpus)  # the modules that call safetensors' save_file

    def __init__(self, monkeypatch, name: str | None = None, nth: int = 1, code: int = errno.ENOSPC,
                 under: Path | None = None):
        self.name, self.nth, self.code, self.under = name, nth, code, under
        self.seen, self.written, self.failed = 0, [], None
        real_bytes = Path.write_bytes
        for mod in self.SAFETENSORS:
            real = mod.save_file
            monkeypatch.setattr(mod, "save_file", self._safetensors(real))
        monkeypatch.setattr(Path, "write_bytes", self._bytes(real_bytes))

    def _fails(self, path: str) -> bool:
        name = final_name(path)
        self.written.append(name)
        if self.name is None or self.failed or (self.under is not None and self.under not in Path(path).parents):
            return False
        if not (name.startswith(self.name) if self.name.endswith("-") or not self.name else name == self.name):
            return False
        self.seen += 1
        if self.seen == self.nth:
            self.failed = Path(path)
            return True
        return False

    def _half(self, path, size_: int) -> None:
        with open(path, "wb") as f:
            f.write(b"\0" * max(1, size_ // 2))

    def _safetensors(self, real):
        def save_file(tensors, filename, metadata=None):
            if self._fails(filename):
                self._half(filename, sum(t.numel() * t.element_size() for t in tensors.values()))
                raise SafetensorError(f"Error while serializing: I/O error: {TEXT[self.code]} (os error {self.code})")
            return real(tensors, filename, metadata=metadata)
        return save_file

    def _bytes(self, real):
        disk = self

        def write_bytes(self, data):
            if disk._fails(str(self)):
                disk._half(self, len(data))
                raise OSError(disk.code, TEXT[disk.code])  # the write failed, not the open: no file name
            return real(self, data)
        return write_bytes


def _no_leftovers(*roots: Path) -> None:
    left = [p for root in roots if root.exists() for p in root.rglob("*") if ".tmp-" in p.name or ".old-" in p.name]
    assert not left, left


# ---------------------------------------------------------------------------------------------------- the helper


def test_the_libraries_reports_of_a_full_disk_are_recognised():
    assert full_code(OSError(errno.ENOSPC, "No space left on device")) == errno.ENOSPC
    assert full_code(OSError(errno.EDQUOT, "Disk quota exceeded", "f")) == errno.EDQUOT
    assert full_code(SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")) \
        == errno.ENOSPC  # safetensors 0.5+
    assert full_code(SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                                     '"No space left on device" })')) == errno.ENOSPC  # older safetensors
    assert full_code(Exception("Disk quota exceeded (os error 122)")) == errno.EDQUOT  # tokenizers
    for other in (OSError(errno.EROFS, "Read-only file system"), OSError("no errno"), ValueError("a bug"),
                  SafetensorError("Error while deserializing header: HeaderTooLarge")):
        assert full_code(other) is None
    e = DiskFullError("/o/f.bin", "the weights", errno.ENOSPC, needed=3 * 2**20, free=5 * 2**10, after="left: X")
    assert str(e) == "/o/f.bin: no space left on the device while writing the weights (3 MiB needed, 5 KiB free); " \
                     "left: X" and e.status == 1
    assert "free" not in str(DiskFullError("/o/f", "it", errno.EDQUOT, needed=10, free=99))  # a quota is not a disk
    assert size(1234604) == "1.18 MiB" and size(12) == "12 bytes"
    same = DiskFullError("/o/f", "it", errno.ENOSPC, needed=1234604, free=1234000)
    assert "1,234,604 bytes needed, 1,234,000 bytes free" in str(same)  # alike when rounded: exact


# ---------------------------------------------------------------------------------------------- dflash2-make-tiny

# what make-tiny writes, in order (checked below against what it really writes)
TINY_FILES = [("target", "tokenizer.json"), ("target", "tokenizer_config.json"), ("target", "config.json"),
              ("target", "generation_config.json"), ("target", "model.safetensors"), ("drafter", "config.json"),
              ("drafter", "model.safetensors")]


@pytest.mark.parametrize("existing", [False, True], ids=["new-out", "existing-empty-out"])
def test_make_tiny_on_a_full_disk_at_every_file_leaves_out_as_it_was(tmp_path, monkeypatch, capsys, existing):
    """ENOSPC at each file of the pair in turn (the first, each one mid-way, the last): one line naming the file
    under its final name, the bytes it needed; --out absent (or, when it existed, as it was): no half pair, no
    temporary sibling, no --out folder made by the failed run."""
    out = tmp_path / "a" / "pair"
    if existing:
        out.mkdir(parents=True)
    before = snapshot(tmp_path)
    disk = FullDisk(monkeypatch)
    assert make_tiny_cli.main(["--out", str(tmp_path / "probe")]) == 0  # what it writes, in order
    assert disk.written == [n for _, n in TINY_FILES], disk.written
    capsys.readouterr()
    import shutil

    shutil.rmtree(tmp_path / "probe")
    for i, (sub, name) in enumerate(TINY_FILES):
        nth = sum(1 for _, n in TINY_FILES[: i + 1] if n == name)
        disk = FullDisk(monkeypatch, name, nth)
        assert make_tiny_cli.main(["--out", str(out)]) == 1
        line = one_line_error(capsys.readouterr().err, "dflash2-make-tiny")
        assert disk.failed is not None
        assert line.startswith(f"dflash2-make-tiny: error: {out / sub / name}: no space left on the device while "
                               f"writing "), line
        assert f"of the tiny {sub} (" in line and " needed, " in line and " free)" in line, line
        assert line.endswith("nothing was written (the pair is put in place only when complete): free some space "
                             "and run it again"), line
        assert snapshot(tmp_path) == before, name
        _no_leftovers(tmp_path)
    monkeypatch.undo()
    assert make_tiny_cli.main(["--out", str(out)]) == 0  # the disk has room again: the same command succeeds
    assert (out / "drafter" / "model.safetensors").is_file()


def test_make_tiny_quota_and_the_final_rename(tmp_path, monkeypatch, capsys):
    """EDQUOT: 'disk quota exceeded' (the disk's free space is not the quota's, so not shown). ENOSPC at the last
    step, the drafter's rename into place: the target renamed a moment before is taken back, --out is gone."""
    out = tmp_path / "pair"
    before = snapshot(tmp_path)
    FullDisk(monkeypatch, "model.safetensors", 1, errno.EDQUOT)
    assert make_tiny_cli.main(["--out", str(out)]) == 1
    line = one_line_error(capsys.readouterr().err, "dflash2-make-tiny")
    assert f"{out / 'target' / 'model.safetensors'}: disk quota exceeded while writing the weights of the tiny " \
           "target (" in line and "needed)" in line and " free)" not in line, line
    assert snapshot(tmp_path) == before
    monkeypatch.undo()

    real = Path.rename

    def rename(self, target):
        if Path(target).name == "drafter":
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    assert make_tiny_cli.main(["--out", str(out)]) == 1
    line = one_line_error(capsys.readouterr().err, "dflash2-make-tiny")
    assert line == f"dflash2-make-tiny: error: {out}: no space left on the device while writing the pair (putting " \
                   "it in place); nothing was written (the pair is put in place only when complete): free some space " \
                   "and run it again", line
    assert snapshot(tmp_path) == before
    _no_leftovers(tmp_path)


# ------------------------------------------------------------------------------------------------- dflash2-train


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A tiny target and a corpus of its answers (generated once; every test only reads it)."""
    root = tmp_path_factory.mktemp("disk-full")
    target = tiny.make_pair(root, family="llama", version=2)[1]
    assert train_cli.main(_args(target, root / "unused", root / "corpus") + ["--corpus-only"]) == 0
    return target, root / "corpus"


def _args(target: Path, out: Path, corpus_dir: Path, *extra: str) -> list[str]:
    return ["--target", str(target), "--out", str(out), "--corpus", str(corpus_dir), "--prompts", "templated:24",
            "--max-new-tokens", "8", "--shard-size", "8", "--threads", "1", "--seqs-per-step", "2", "--anchors", "4",
            "--save-every", "2", "--eval-every", "2", *extra]


def _train(inputs, out: Path, steps: int, capsys, *extra: str) -> tuple[int, str, str]:
    target, corpus_dir = inputs
    code = train_cli.main(_args(target, out, corpus_dir, "--steps", str(steps), *extra))
    got = capsys.readouterr()
    return code, got.out, "\n".join(ln for ln in got.err.splitlines() if "Loading weights" not in ln)


def _whole_save(out: Path, step: int) -> None:
    """The files a rerun resumes from are whole and name `step`: the full state (loaded back) and the compact one
    (progress.json checked against the weights' sha256)."""
    assert state.read_meta(out)["step"] == step
    from safetensors.torch import load_file

    assert load_file(str(state.path(out)))  # the whole file reads
    assert state.load_progress(out)["step"] == step


def test_train_on_a_full_disk_at_its_first_file(inputs, tmp_path, monkeypatch, capsys):
    """The first file the run writes (a scratch copy of the drafter's config, in the temporary folder), then the
    first file it writes into OUT (config.json): nothing saved yet, said so; the inputs unchanged."""
    import tempfile

    out = tmp_path / "d"
    before = snapshot(*inputs)
    disk = FullDisk(monkeypatch, "", 1)
    code, _, err = _train(inputs, out, 4, capsys)
    assert code == 1 and disk.failed is not None and disk.failed.parent.parent == Path(tempfile.gettempdir())
    line = one_line_error(err, "dflash2-train")
    assert line.startswith(f"dflash2-train: error: {tempfile.gettempdir()}: no space left on the device while writing "
                           "a scratch copy of the drafter's config (checked before --out is written) ("), line
    assert line.endswith("nothing was written into --out: free some space there and run the same command again"), line
    assert not out.exists() and snapshot(*inputs) == before
    monkeypatch.undo()

    disk = FullDisk(monkeypatch, "", 1, under=out)
    code, _, err = _train(inputs, out, 4, capsys)
    assert code == 1 and disk.failed is not None
    line = one_line_error(err, "dflash2-train")
    assert line.startswith(f"dflash2-train: error: {out / 'config.json'}: no space left on the device while writing "
                           "the drafter's config ("), line
    assert " needed, " in line and line.endswith("no training state was saved yet: free some space and run the "
                                                 "same command again"), line
    assert snapshot(*inputs) == before
    assert not (out / "config.json").exists() and not state.has_state(out)  # the half file never took the name
    _no_leftovers(tmp_path)
    monkeypatch.undo()
    assert _train(inputs, out, 4, capsys)[0] == 0
    _whole_save(out, 4)


@pytest.mark.parametrize("code,words", [(errno.ENOSPC, "no space left on the device"),
                                        (errno.EDQUOT, "disk quota exceeded")])
def test_train_on_a_full_disk_mid_run_keeps_the_last_save_whole(inputs, tmp_path, monkeypatch, capsys, code, words):
    """The state of step 4 cannot be written (step 2's was): one line naming train_state/resume.safetensors, its
    size, and step 2 as the step a rerun resumes from; the step-2 files byte-identical and loadable, no half
    file; the same command then resumes at step 2."""
    out = tmp_path / "d"
    assert _train(inputs, out, 2, capsys)[0] == 0
    saved = snapshot(out)
    before = snapshot(*inputs)
    disk = FullDisk(monkeypatch, "resume.safetensors", 1, code)
    rc, _, err = _train(inputs, out, 4, capsys)
    assert rc == 1 and disk.failed is not None
    line = one_line_error(err, "dflash2-train")
    assert line.startswith(f"dflash2-train: error: {state.path(out)}: {words} while writing the training state of "
                           "step 4 ("), line
    assert " needed" in line and (" free)" in line) == (code == errno.ENOSPC), line
    assert line.endswith(f"the training state saved at step 2 is whole ({out}): free some space and rerun the same "
                         "command to resume from step 2"), line
    assert snapshot(out) == saved and snapshot(*inputs) == before  # nothing of the failed save stands anywhere
    _whole_save(out, 2)
    monkeypatch.undo()
    rc, said, _ = _train(inputs, out, 4, capsys)
    assert rc == 0 and "resumed at step 2" in said
    _whole_save(out, 4)


def test_train_on_a_full_disk_after_the_state_was_saved(inputs, tmp_path, monkeypatch, capsys):
    """The full state of step 4 written, then progress.json (the save's last file) meets the full disk: the error
    names progress.json and step 4 as the step to resume from; progress.json is still step 2's, whole; a rerun
    resumes exactly at step 4 (from train_state/)."""
    out = tmp_path / "d"
    assert _train(inputs, out, 2, capsys)[0] == 0
    old_progress = (out / state.PROGRESS).read_bytes()
    disk = FullDisk(monkeypatch, state.PROGRESS, 1)
    rc, _, err = _train(inputs, out, 4, capsys)
    assert rc == 1 and disk.failed is not None
    line = one_line_error(err, "dflash2-train")
    assert line.startswith(f"dflash2-train: error: {out / state.PROGRESS}: no space left on the device while writing "
                           "the training progress of step 4 ("), line
    assert line.endswith(f"the training state saved at step 4 is whole ({out}): free some space and rerun the same "
                         "command to resume from step 4"), line
    assert (out / state.PROGRESS).read_bytes() == old_progress and state.read_meta(out)["step"] == 4
    json.loads(old_progress)
    _no_leftovers(tmp_path)
    monkeypatch.undo()
    rc, said, _ = _train(inputs, out, 6, capsys)
    assert rc == 0 and "resumed at step 4" in said
    _whole_save(out, 6)


def test_train_sharded_weights_are_replaced_only_when_every_shard_is_whole(inputs, tmp_path, monkeypatch, capsys):
    """--max-shard-mb: the second shard of the final save meets the full disk: the previous save's shards and
    index stay byte-identical (the first new shard waited under a temporary name, now removed)."""
    out = tmp_path / "d"
    assert _train(inputs, out, 2, capsys, "--max-shard-mb", "0.08")[0] == 0
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 2, shards
    saved = {n: (out / n).read_bytes() for n in [*shards, "model.safetensors.index.json"]}
    disk = FullDisk(monkeypatch, "model-", 2)
    rc, _, err = _train(inputs, out, 4, capsys, "--max-shard-mb", "0.08")
    assert rc == 1 and disk.failed is not None
    line = one_line_error(err, "dflash2-train")
    assert line.startswith(f"dflash2-train: error: {out / shards[1]}: no space left on the device while writing the "
                           f"drafter's fp16 weights (file 2 of {len(shards)}) ("), line
    assert line.endswith("resume from step 4"), line  # the full state of step 4 was saved before the weights
    assert {n: (out / n).read_bytes() for n in saved} == saved
    _no_leftovers(tmp_path)
    monkeypatch.undo()
    assert _train(inputs, out, 4, capsys, "--max-shard-mb", "0.08")[0] == 0


def test_corpus_generation_on_a_full_disk_keeps_the_shards_before(inputs, tmp_path, monkeypatch, capsys):
    """The second corpus shard cannot be written: one line naming it; the first shard and corpus.json whole; the
    same command continues the corpus from the second shard and trains. The target is unchanged, OUT never made."""
    target, _ = inputs
    before = snapshot(target)
    corpus_dir, out = tmp_path / "c", tmp_path / "d"
    disk = FullDisk(monkeypatch, "shard-", 2)
    code = train_cli.main(_args(target, out, corpus_dir, "--steps", "2"))
    err = capsys.readouterr().err
    assert code == 1 and disk.failed is not None
    line = [ln for ln in err.splitlines() if ln.strip()][-1]
    assert "Traceback" not in err and line.startswith(
        f"dflash2-train: error: {corpus_dir / 'shard-00001.safetensors'}: no space left on the device while writing a "
        "corpus shard ("), err
    assert line.endswith("the corpus's files written so far are whole: free some space and rerun the same command to "
                         "continue"), line
    assert sorted(p.name for p in corpus_dir.iterdir()) == ["corpus.json", "shard-00000.safetensors"]
    assert corpus.read_meta(corpus_dir)["complete"] is False and not out.exists()
    assert snapshot(target) == before
    monkeypatch.undo()
    assert train_cli.main(_args(target, out, corpus_dir, "--steps", "2")) == 0
    said = capsys.readouterr().out
    assert "corpus: shard 2/3" in said and "corpus: shard 1/3" not in said, said
    assert corpus.read_meta(corpus_dir)["complete"] is True


def test_the_draft_vocabulary_on_a_full_disk_after_training(inputs, tmp_path, monkeypatch, capsys):
    """draft_vocab.json, the run's last file, cannot be written: the drafter is saved whole and the error says so;
    the rerun (nothing left to train) writes the file."""
    out = tmp_path / "d"
    disk = FullDisk(monkeypatch, "draft_vocab.json", 1)
    rc, _, err = _train(inputs, out, 2, capsys, "--draft-vocab", "40")
    assert rc == 1 and disk.failed is not None
    line = one_line_error(err, "dflash2-train")
    assert line.startswith(f"dflash2-train: error: {out / 'draft_vocab.json'}: no space left on the device while "
                           "writing the draft vocabulary ("), line
    assert line.endswith(f"the drafter of step 2 is saved whole ({out}): free some space and rerun the same command "
                         "to write it"), line
    assert not (out / "draft_vocab.json").exists()
    _whole_save(out, 2)
    _no_leftovers(tmp_path)
    monkeypatch.undo()
    rc, said, _ = _train(inputs, out, 2, capsys, "--draft-vocab", "40")
    assert rc == 0 and (out / "draft_vocab.json").is_file() and os.path.getsize(out / "draft_vocab.json") > 0
