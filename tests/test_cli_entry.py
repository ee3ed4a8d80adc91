"""The CLIs' one wrapper (dflash2.cli.cli_main), dflash2-train's options as a Python API, and the import
direction between dflash2.folders and dflash2.interrupts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dflash2.cli import CliError, cli_main
from dflash2.cli import train as train_cli
from dflash2.errors import Dflash2Error
from dflash2.train.api import TrainOptions, run_training


def _main(raised: BaseException | None, **kw):
    @cli_main("dflash2-x", **kw)
    def main(argv: list[str] | None = None) -> int:
        if raised is not None:
            raise raised
        return 0
    return main


def test_a_refusal_is_one_line_and_status_2(capsys):
    assert _main(Dflash2Error("--flag: expected 1, found 2"))([]) == 2
    assert capsys.readouterr().err == "dflash2-x: error: --flag: expected 1, found 2\n"


def test_a_cli_error_keeps_its_own_status(capsys):
    assert _main(CliError("out: could not write it (No space left on device)", status=1))([]) == 1
    assert capsys.readouterr().err == "dflash2-x: error: out: could not write it (No space left on device)\n"


def test_only_the_errors_named_are_answered(capsys):
    with pytest.raises(ValueError):  # a bug keeps its traceback
        _main(ValueError("a bug"))([])
    assert _main(ValueError("bad prompt"), errors=(Dflash2Error, ValueError))([]) == 2
    assert capsys.readouterr().err == "dflash2-x: error: bad prompt\n"


def test_interrupts_are_answered_by_the_same_wrapper(capsys):
    assert _main(KeyboardInterrupt(), after="nothing was written")([]) == 130
    assert capsys.readouterr().err == "\ndflash2-x: interrupted; nothing was written\n"
    assert _main(None)([]) == 0


def test_train_flags_are_the_options_fields_with_their_defaults():
    assert train_cli.options(["--target", "t", "--out", "o"]) == TrainOptions(target=Path("t"), out=Path("o"))
    o = train_cli.options(["--target", "t", "--out", "o", "--max-new=64", "--steps", "3"])
    assert o.given == {"--max-new-tokens"} and o.max_new_tokens == 64 and o.steps == 3


def test_run_training_refuses_before_importing_torch():
    code = ("import sys\nfrom dflash2.errors import Dflash2Error\nfrom dflash2.train.api import TrainOptions, "
            "run_training\ntry:\n    run_training(TrainOptions(target='t', out='o', steps=0))\n"
            "except Dflash2Error as e:\n    print(e)\nprint('torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout == "--steps: expected >= 1, found 0\nFalse\n"


def test_run_training_is_the_cli_without_the_flags(tmp_path):
    with pytest.raises(Dflash2Error, match="--holdout: expected a share in"):
        run_training(TrainOptions(target=tmp_path / "t", out=tmp_path / "o", holdout=1.0))


def test_interrupts_imports_nothing_of_dflash2():
    """folders -> interrupts, never back: the outputs put in place are recorded in interrupts.PLACED."""
    r = subprocess.run([sys.executable, "-c", "import sys, dflash2.interrupts; "
                        "print(sorted(m for m in sys.modules if m.startswith('dflash2.')))"],
                       capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "['dflash2.interrupts']"
    from dflash2 import folders, interrupts

    assert folders.PLACED is interrupts.PLACED
