"""Seeded random arguments to every CLI that reads or writes (make-tiny, draft-vocab, compare, run, bench,
bench-quant, export, train, prepare-smollm2): each call ends with an exit status and, on failure, one `PROG: error: ...` line;
never a traceback, never a changed input, never a temporary file or folder left behind.

The flags come from each CLI's own parser (so a new flag is fuzzed without editing this test); values are
drawn from a pool of the classic bad ones (0, -1, nan, inf, 2**70, '', bytes that are not UTF-8, a file where
a folder is expected, an input given as an output, ...) and some valid ones, added to a cheap valid base
command so a mutation that happens to be valid still finishes in seconds.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import re
from pathlib import Path

import pytest

from dflash2 import tiny
from tests.errorcheck import snapshot

CASES = {"make_tiny": 40, "draft_vocab": 30, "compare": 25, "run": 40, "bench": 25, "bench_quant": 15,
         "export": 25, "train": 25, "prepare": 30, "corpus": 30}
MODULES = {"prepare": "dflash2.cli.prepare_smollm2"}  # the others: dflash2.cli.NAME
PROGS = {"prepare": "dflash2-prepare-smollm2"}
# flags that only make a valid run longer (they are range-checked in test_errors_*): kept at the base's value
SLOW = {"--max-new-tokens", "--steps", "--repeats", "--minutes", "--sweep-draft-len", "--temperature", "--engines",
        "--help", "--live-taps", "--prompts", "--eval-every", "--gen-batch", "--max-prompt-tokens"}


def _flags(name: str) -> list[argparse.Action]:
    """The CLI's parser actions, caught as it parses (its parser is built inside main)."""
    mod = importlib.import_module(MODULES.get(name, f"dflash2.cli.{name}"))
    caught = []

    class Caught(Exception):
        pass

    def parse_args(self, *a, **k):
        caught.append(self)
        raise Caught

    real = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = parse_args
    try:
        mod.main([])
    except Caught:
        pass
    finally:
        argparse.ArgumentParser.parse_args = real
    actions = caught[0]._actions
    if name == "corpus":  # its subcommands' flags (grow answers ShareGPT for minutes: not fuzzed here)
        subs = next(a for a in actions if isinstance(a, argparse._SubParsersAction)).choices
        actions = [a for sub in ("info", "verify", "taps") for a in subs[sub]._actions]
    return [a for a in actions if a.option_strings and a.option_strings[-1] not in SLOW]


def _pool(paths: dict[str, Path]) -> list[str]:
    return ["0", "-1", "1", "2", "3", "7", "nan", "inf", "-inf", "1e30", str(2**70), "0.5", "x", "", "\udcff\udcfe",
            "a,b", "1,2", "1,1", "-3,2", "auto", "none", "selector", "int4", "float16", "bfloat16", "cuda",
            *(str(p) for p in paths.values())]


@pytest.fixture(scope="module")
def world(tmp_path_factory, exports):
    root = tmp_path_factory.mktemp("fuzzcli")
    drafter, target = tiny.make_pair(root / "pair", family="llama", version=2)
    prompts = root / "prompts.json"
    prompts.write_text(json.dumps(["hello there"]))
    folder_file = root / "a_file.txt"
    folder_file.write_text("not a folder")
    export = exports[("llama", 2)]
    return {"drafter": drafter, "target": target, "export": export, "prompts": prompts, "file": folder_file,
            "root": root}


def _base(name: str, w: dict, out: Path) -> list[str]:
    """A valid, cheap command line of each CLI; the fuzzed flags are appended (argparse: the last one wins)."""
    return {
        "make_tiny": ["--out", str(out)],
        "draft_vocab": ["--drafter", str(out), "--target", str(w["target"]), "--corpus", str(w["root"] / "none"),
                        "--size", "64"],
        "compare": [str(w["export"]), "--graph", "selector"],
        "run": [str(w["export"]), "--prompt", "hi", "--max-new-tokens", "3"],
        "bench": [str(w["export"]), "--prompts", str(w["prompts"]), "--max-new-tokens", "2"],
        "bench_quant": [str(w["export"]), str(w["export"]), "--prompts", str(w["prompts"]), "--max-new-tokens", "2"],
        "export": ["--model", str(w["drafter"]), "--target", str(w["target"]), "--out", str(out), "--quiet",
                   "--max-seq-len", "64"],
        "train": ["--target", str(w["target"]), "--out", str(out), "--corpus", str(w["root"] / "no-corpus"),
                  "--steps", "1", "--threads", "1", "--max-new-tokens", "2", "--prompts", "templated:2"],
        "prepare": ["--out", str(out)],
        "corpus": ["taps", str(w["root"] / "no-corpus"), "--target", str(w["target"]), "--taps", "1",
                   "--cache", str(out)],
    }[name]


@pytest.mark.parametrize("name", sorted(CASES))
def test_cli_argument_fuzz(name, world, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative value ('1', 'a,b') given as a folder lands here, not in the checkout
    mod = importlib.import_module(MODULES.get(name, f"dflash2.cli.{name}"))
    prog = PROGS.get(name, f"dflash2-{name.replace('_', '-')}")
    if name == "prepare":  # its output rules are fuzzed, not the 30 s conversion (and never the user's own cache)
        from dflash2.errors import Dflash2Error

        def no_gguf():
            raise Dflash2Error("the SmolLM2 weights are missing (the fuzz test's stand-in)")

        from dflash2.models import smollm2  # what the command's main calls

        monkeypatch.setattr(smollm2, "gguf_path", no_gguf)
        monkeypatch.setattr(smollm2, "default_target_dir", lambda: tmp_path / "default-cache")
    flags = _flags(name)
    rng = random.Random(f"fuzz/{name}")
    inputs = [world["drafter"], world["target"], world["export"], world["prompts"], world["file"]]
    before = snapshot(*inputs)
    failures, codes = [], {}
    for case in range(CASES[name]):
        out = tmp_path / f"out{case}"
        if name == "draft_vocab":  # it writes into a drafter: a copy of one
            import shutil

            shutil.copytree(world["drafter"], out)
        paths = {"out": out, "file": world["file"], "export": world["export"], "target": world["target"],
                 "drafter": world["drafter"], "manifest": world["export"] / "manifest.json", "new": tmp_path / "new"}
        argv = _base(name, world, out)
        for action in rng.sample(flags, k=min(len(flags), rng.choice([1, 1, 2, 3]))):
            flag = action.option_strings[-1]
            if action.nargs == 0:
                argv.append(flag)
            else:
                argv += [flag, rng.choice(_pool(paths))]
        try:
            code = mod.main(argv)
        except SystemExit as e:  # argparse's own refusals: status 2 and its usage line
            code = e.code
        except BaseException as e:  # noqa: BLE001 - the property under test: nothing else escapes
            failures.append(f"case {case}: {argv[len(_base(name, world, out)):]}: {type(e).__name__}: {e}"[:300])
            continue
        err = capsys.readouterr().err
        codes[code] = codes.get(code, 0) + 1
        fuzzed = argv[len(_base(name, world, out)):]
        if "Traceback" in err:
            failures.append(f"case {case}: {fuzzed}: traceback: {err[-300:]}")
        elif code not in (0, 1, 2):
            failures.append(f"case {case}: {fuzzed}: exit {code!r}")
        elif code != 0 and not re.search(rf"^({re.escape(prog)}: error: |usage: )", err, re.M):
            failures.append(f"case {case}: {fuzzed}: exit {code} without an error line: {err[-300:]!r}")
        left = [str(p) for p in tmp_path.rglob("*") if ".tmp-" in p.name or ".old-" in p.name]
        if left:
            failures.append(f"case {case}: {fuzzed}: left behind {left}")
    assert snapshot(*inputs) == before  # no input changed, whatever was asked
    assert failures == [], "\n".join(failures)
    assert codes.get(2, 0) > 0, codes  # the bad values were refused (not all ignored)


# ------------------------------------------------------------------ a hostile filesystem (issue 49)
# FIFOs, link loops, dangling links, folders where files are read and files where folders are: in every path
# argument and in place of every file an input folder holds. Each call ends with a status and one line, within
# the alarm (a FIFO read blocks forever), no input changed, nothing left behind.

HOSTILE_CASES = 36


def _make_hostile(p: Path, kind: str) -> None:
    import os
    import shutil

    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "loop":
        p.symlink_to(p.name)
    elif kind == "dangling":
        p.symlink_to(p.name + ".nowhere")
    elif kind == "dir":
        p.mkdir()
        (p / "inner.json").write_text("{}")
    else:  # a file in place of a folder (or of a file: an empty one)
        p.write_bytes(b"")


def test_hostile_filesystem_fuzz(world, tmp_path, capsys, monkeypatch):
    import shutil
    import signal

    monkeypatch.chdir(tmp_path)
    rng = random.Random("fuzz/hostile")
    inputs = [world["drafter"], world["target"], world["export"], world["prompts"], world["file"]]
    before = snapshot(*inputs)
    failures = []

    def hung(signum, frame):
        raise TimeoutError("hung")

    old = signal.signal(signal.SIGALRM, hung)
    try:
        for case in range(HOSTILE_CASES):
            root = tmp_path / f"c{case}"
            root.mkdir()
            copies = {k: shutil.copytree(world[k], root / k, symlinks=True) for k in ("drafter", "target", "export")}
            name = rng.choice(["run", "compare", "export", "train", "draft_vocab", "corpus", "bench"])
            out = root / "out"
            if name == "draft_vocab":
                shutil.copytree(world["drafter"], out)
            w = {**world, **copies, "root": root}
            argv = _base(name, w, out)
            kind = rng.choice(["fifo", "loop", "dangling", "dir", "file"])
            paths = [i for i, a in enumerate(argv) if a.startswith(str(root))]
            if rng.random() < 0.5:  # an entry inside an input folder
                folder = rng.choice([copies[k] for k in copies if str(copies[k]) in " ".join(argv)] or
                                    list(copies.values()))
                victim = rng.choice(sorted(p for p in folder.iterdir()))
            else:  # a path argument itself
                victim = Path(argv[rng.choice(paths)])
            _make_hostile(victim, kind)
            snap = snapshot(root)
            mod = importlib.import_module(MODULES.get(name, f"dflash2.cli.{name}"))
            prog = PROGS.get(name, f"dflash2-{name.replace('_', '-')}")
            what = f"case {case}: {name} {kind} at {victim.relative_to(root)}"
            signal.alarm(120)
            try:
                code = mod.main(argv)
            except SystemExit as e:
                code = e.code
            except BaseException as e:  # noqa: BLE001 - nothing else may escape (a TimeoutError is a hang)
                failures.append(f"{what}: {type(e).__name__}: {e}"[:300])
                continue
            finally:
                signal.alarm(0)
            err = capsys.readouterr().err
            if "Traceback" in err:
                failures.append(f"{what}: traceback: {err[-300:]}")
            elif code not in (0, 1, 2):
                failures.append(f"{what}: exit {code!r}")
            elif code != 0 and not re.search(rf"^({re.escape(prog)}: error: |usage: )", err, re.M):
                failures.append(f"{what}: exit {code} without an error line: {err[-300:]!r}")
            inputs_now = {k: v for k, v in snapshot(root).items()
                          if not k.startswith((str(out), str(root / "corpus"), str(root / "no-corpus")))}
            if inputs_now != {k: v for k, v in snap.items()
                              if not k.startswith((str(out), str(root / "corpus"), str(root / "no-corpus")))}:
                failures.append(f"{what}: an input changed")
            left = [str(p) for p in root.rglob("*") if ".tmp-" in p.name or ".old-" in p.name or
                    p.name.endswith(".lock")]
            if left:
                failures.append(f"{what}: left behind {left}")
    finally:
        signal.signal(signal.SIGALRM, old)
    assert snapshot(*inputs) == before
    assert failures == [], "\n".join(failures)
