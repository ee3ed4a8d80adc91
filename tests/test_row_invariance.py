"""Row invariance (dflash2.runtime.invariance): a k-row verify must give the bitwise logits of k 1-row decode
steps, or greedy speculative output can differ from target-only output. The export checks it on the written
export and refuses a graph that fails; `dflash2-run --check-rows` checks a deployment machine."""

import json
import subprocess
import sys

import numpy as np
import pytest

from dflash2 import manifest as mf
from dflash2.errors import ValidationError
from dflash2.export import quantize as qz
from dflash2.export.api import ROWS, export
from dflash2.runtime.api import Runtime
from dflash2.runtime.invariance import check_rows, validation
from dflash2.speculative import generate


class Perturbed:
    """A session whose multi-row calls return logits off by `eps` in one column: what a kernel with another
    summation order for k > 1 rows looks like to the loop."""

    def __init__(self, session, eps: float, column: int = 3):
        self.s, self.eps, self.column = session, eps, column

    def __getattr__(self, name):
        return getattr(self.s, name)

    def verify(self, tokens):
        v = self.s.verify(tokens)
        if len(tokens) == 1:
            return v
        logits = v.logits().copy()
        logits[:, self.column] += self.eps
        return type(v)(v.ids, lambda: logits)


def test_check_passes_on_the_real_session_and_catches_any_multirow_difference(exports):
    s = Runtime(exports[("llama", 2)]).session
    r = check_rows(s)
    B = s.block_size
    assert r.ok and r.differing == 0 and r.max_abs == 0.0
    assert sorted(r.per_k) == list(range(2, B + 1)) and r.rows == sum(v["rows"] for v in r.per_k.values()) > 0
    # the smallest difference float32 can hold at the column's magnitude is caught: the rule is bitwise
    bad = check_rows(Perturbed(s, eps=1e-3))
    assert not bad.ok and bad.differing == bad.rows and bad.max_abs == pytest.approx(1e-3, rel=1e-2)
    v = validation(Perturbed(s, eps=1e-3))
    assert not v.ok and "not bitwise equal" in v.failures[0] and f"{bad.rows} rows differ" in v.failures[0]
    assert v.steps["differing"] == bad.rows
    # a difference large enough to move the argmax is counted as such
    flips = check_rows(Perturbed(s, eps=1e6))
    assert flips.argmax_flips == flips.rows


def test_export_records_the_check(exports):
    m = mf.load(exports[("qwen3", 2)], check_files=False)
    v = m.validation[ROWS]
    assert v.ok and not v.failures and v.steps["rule"] == "bitwise equal logits"
    assert v.steps["rows"] > 0 and v.steps["differing"] == 0 and v.steps["max_abs"] == 0.0
    assert sorted(map(int, v.steps["per_k"])) == list(range(2, m.block_size + 1))


def test_int4_block_32_passes_and_a_larger_block_is_refused_where_its_kernel_is_not_invariant(tmp_path, pairs):
    """ONNX Runtime 1.32's CPU int4 kernel (AVX-512 VNNI) computes blocks of 64 / 128 differently for one row
    and for several (docs/quantization.md); block 32 is invariant. Kernels are chosen per CPU, so a machine
    whose block-64 kernel is invariant exports it: then it must be lossless."""
    drafter, target = pairs[("llama", 2)]
    ok = tmp_path / "b32"
    export(drafter, target, ok, max_seq_len=256, quiet=True, quantize=qz.OrtQuant("int4", 32))
    assert mf.load(ok, check_files=False).validation[ROWS].ok
    out = tmp_path / "b64"
    try:
        export(drafter, target, out, max_seq_len=256, quiet=True, quantize=qz.OrtQuant("int4", 64))
    except ValidationError as e:
        assert "not bitwise equal" in str(e) and "not lossless" in str(e) and "block 32" in str(e)
        assert not out.exists()  # nothing written where the export was asked for
        failed = tmp_path / "b64.failed"
        assert "not bitwise equal" in (failed / "VALIDATION_FAILED.txt").read_text()
        # the kept folder holds the manifest with the failing record: dflash2-run --check-rows says the same
        r = subprocess.run([sys.executable, "-m", "dflash2.cli.run", str(failed), "--check-rows"],
                           capture_output=True, text=True)
        assert r.returncode == 1, r.stderr
        got = json.loads(r.stdout)
        assert got["row_invariant"] is False and got["differing"] > 0 and "not bitwise equal" in r.stderr
    else:
        rt = Runtime(out)
        assert mf.load(out, check_files=False).validation[ROWS].ok
        for prompt in ([5, 17, 42, 99, 7], list(range(40, 90))):
            assert generate(rt.session, prompt, 48, draft_len=3).ids == generate(rt.session, prompt, 48,
                                                                                  speculative=False).ids


def test_run_check_rows_cli(exports):
    r = subprocess.run([sys.executable, "-m", "dflash2.cli.run", str(exports[("llama", 1)]), "--check-rows"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["row_invariant"] is True and got["rows"] > 0 and got["differing"] == 0
    assert np.isclose(got["max_abs"], 0.0)
