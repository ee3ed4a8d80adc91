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
         "export": 25, "train": 25, "prepare": 30}
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
    return [a for a in caught[0]._actions if a.option_strings and a.option_strings[-1] not in SLOW]


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
