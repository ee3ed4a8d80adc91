"""Broken manifests through every CLI that reads one (dflash2-run, -build, -compare, -bench): exit 2,
one error naming manifest.json and every problem (one line each), no traceback, the folder unchanged, nothing written."""

from __future__ import annotations

import json
import shutil

import pytest

from dflash2 import manifest as mf
from dflash2.cli import bench as bench_cli
from dflash2.cli import build as build_cli
from dflash2.cli import compare as compare_cli
from dflash2.cli import run as run_cli
from dflash2.ops import contract as C
from tests.errorcheck import one_error, snapshot
from tests.exports import edit_manifest


def _write(text):
    return lambda folder: (folder / mf.NAME).write_text(text)


def _edit_unsealed(fn):
    """A hand edit: the content changes, manifest_sha256 stays as it was."""
    def apply(folder):
        data = json.loads((folder / mf.NAME).read_text())
        fn(data)
        (folder / mf.NAME).write_text(json.dumps(data))
    return apply


def _sealed(fn):
    return lambda folder: edit_manifest(folder, fn)


CASES = {
    "a_list": (_write("[1, 2]"), "expected a JSON object, found a list [1, 2]"),
    "a_number": (_write("42"), "expected a JSON object, found an integer 42"),
    "not_json": (_write("{oops"), "expected valid JSON, found a parse error at line 1"),
    "not_utf8": (lambda f: (f / mf.NAME).write_bytes(b"\xff\xfe{"), "expected valid JSON"),
    "lacks_a_section": (_sealed(lambda m: m.pop("kv")), "kv: expected an object (Kv), found nothing (missing)"),
    "section_wrong_type": (_sealed(lambda m: m.update(context=[1])), "context: expected an object (Context)"),
    "newer_contract": (_sealed(lambda m: m.update(contract_version=C.CONTRACT_VERSION + 1)),
                       f"contract_version: made by a newer dflash2 (version {C.CONTRACT_VERSION + 1} > "),
    "newer_format": (_sealed(lambda m: m.update(format_version=mf.FORMAT_VERSION + 1)),
                     "format_version: made by a newer dflash2"),
    "unknown_field": (_sealed(lambda m: m.update(speculate_harder=True)), "unknown field(s) ['speculate_harder']"),
    "edited_vocab_size": (_edit_unsealed(lambda m: m.update(vocab_size=m["vocab_size"] + 1)),
                          "manifest_sha256: expected"),
    "edited_and_mistyped": (_edit_unsealed(lambda m: m.update(block_size="8")), "manifest_sha256: expected"),
    "other_format": (_sealed(lambda m: m.update(format="someone-else")), "format: expected one of"),
    "negative_max_seq_len": (_sealed(lambda m: m.update(max_seq_len=-1)),
                             "max_seq_len: expected >= block_size = 8, found -1"),  # was numpy's "negative dimensions"
    "mask_id_outside": (_sealed(lambda m: m.update(mask_token_id=99999)),
                        "mask_token_id: expected an id in [0, 384) (vocab_size), found 99999"),
    "eos_id_outside": (_sealed(lambda m: m.update(eos_token_ids=[99999])),
                       "eos_token_ids: expected ids in [0, 384) (vocab_size), found [99999]"),
    "quantization_field_mistyped": (_sealed(lambda m: m.update(quantization={"bits": "four"})),
                                    'quantization.bits: expected an integer, found a string "four"'),  # not "an object"
}


@pytest.fixture
def broken(request, export_dir, tmp_path):
    folder = tmp_path / "export"
    shutil.copytree(export_dir, folder)
    return folder


def _one_problem(err: str, prog: str) -> str:
    lines = [ln for ln in err.splitlines() if " allocating " not in ln]
    return one_error("\n".join(lines), prog)


@pytest.mark.parametrize("case", sorted(CASES))
def test_broken_manifest_through_every_reader(case, broken, tmp_path, capsys, fake_plugin):
    corrupt, what = CASES[case]
    corrupt(broken)
    before = snapshot(tmp_path)
    runs = {"dflash2-run": lambda: run_cli.main([str(broken), "--prompt-ids", "1,2", "--max-new-tokens", "2"]),
            "dflash2-build": lambda: build_cli.main([str(broken), "--out", str(tmp_path / "eng"),
                                                     "--plugin", str(fake_plugin)]),
            "dflash2-compare": lambda: compare_cli.main([str(broken)]),
            "dflash2-bench": lambda: bench_cli.main([str(broken), "--max-new-tokens", "2"])}
    for prog, call in runs.items():
        assert call() == 2, prog
        msg = _one_problem(capsys.readouterr().err, prog)
        assert str(broken / mf.NAME) in msg and what in msg, msg
    assert snapshot(tmp_path) == before
