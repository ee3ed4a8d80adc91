"""Row invariance (dflash2.runtime.invariance): a k-row verify must give the bitwise logits (and argmax ids) of
k 1-row decode steps, or greedy speculative output can differ from target-only output. The export checks it on
the written export and refuses a graph that fails; `dflash2-run --check-rows` checks a deployment machine."""

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from dflash2 import manifest as mf
from dflash2.cli import run as run_cli
from dflash2.errors import Dflash2Error, ValidationError
from dflash2.export import quantize as qz
from dflash2.export.api import ROWS, export
from dflash2.runtime.api import Runtime
from dflash2.runtime.invariance import COSTS, _prompt, check_rows, sizes, validation
from dflash2.runtime.ort import OrtBackend
from dflash2.runtime.state import RowStates
from dflash2.speculative import generate


class Edited:
    """A session whose target logits are edited on the way out: `multi` for calls of several rows, `every` for
    all calls (both the 1-row reference and the verifies). What a kernel with another summation order for k > 1
    rows looks like to the check."""

    def __init__(self, session, multi=None, every=None):
        self.s, self.multi, self.every = session, multi, every

    def __getattr__(self, name):
        return getattr(self.s, name)

    def _edit(self, v, n):
        logits = v.logits().copy()
        if self.every:
            self.every(logits)
        if self.multi and n > 1:
            self.multi(logits)
        return type(v)(v.ids, lambda: logits)

    def decode(self, token):
        return self._edit(self.s.decode(token), 1)

    def verify(self, tokens):
        return self._edit(self.s.verify(tokens), len(tokens))


def one_ulp(logits):  # the smallest change float32 can make, in one column
    logits[:, 3] = np.nextafter(logits[:, 3], np.float32(np.inf))


def test_check_passes_on_the_real_session_and_catches_a_one_ulp_multirow_difference(exports):
    s = Runtime(exports[("llama", 2)]).session
    r = check_rows(s)
    B = s.block_size
    assert r.ok and r.differing == 0 and r.max_abs == 0.0
    assert sorted(r.per_k) == list(range(2, B + 1)) and r.rows == sum(v["rows"] for v in r.per_k.values()) > 0
    bad = check_rows(Edited(s, multi=one_ulp))
    assert not bad.ok and bad.differing == bad.rows and 0 < bad.max_abs < 1e-3 and bad.argmax_flips == 0
    v = validation(Edited(s, multi=one_ulp), "target.onnx", "a hint")
    assert not v.ok and v.failures[0].startswith("target.onnx: expected a k-row verify bitwise equal")
    assert f"found {bad.rows} of {bad.rows} rows differing" in v.failures[0] and v.failures[0].endswith("a hint")
    flips = check_rows(Edited(s, multi=lambda x: x.__setitem__((slice(None), 7), 1e9)))
    assert flips.argmax_flips == 0  # the logits moved, not the graph's own argmax ids: still every row differs
    assert flips.differing == flips.rows


def test_lean_runtime_checks_the_same_rows_without_a_drafter_session(exports):
    """The export's row check opens its runtime lean (no drafter session unless a draft runs, no CPU arena): the
    same check result, and a lean session that does draft opens the drafter then and generates the same ids."""
    folder = exports[("llama", 2)]
    plain, lean = Runtime(folder).session, Runtime(folder, lean=True).session
    assert set(plain.backend._sessions) == {"target", "drafter"} and set(lean.backend._sessions) == {"target"}
    a, b = check_rows(plain), check_rows(lean)
    assert b.ok and (a.rows, a.per_k) == (b.rows, b.per_k) and "drafter" not in lean.backend._sessions
    prompt = _prompt(lean.vocab_size, 12)
    want = generate(plain, prompt, 40)
    got = generate(lean, prompt, 40)
    assert got.ids == want.ids and got.stats.accepted == want.stats.accepted
    assert "drafter" in lean.backend._sessions and any(got.stats.accepted)


def test_infinities_in_both_do_not_hide_a_difference(exports):
    s = Runtime(exports[("llama", 2)]).session

    def inf_col(logits):
        logits[:, 0] = np.inf

    same = check_rows(Edited(s, every=inf_col))
    assert same.ok and same.max_abs == 0.0  # the same inf in both: equal bits
    hidden = check_rows(Edited(s, every=inf_col, multi=one_ulp))
    assert hidden.differing == hidden.rows and np.isfinite(hidden.max_abs)


def test_sizes_fit_any_max_seq_len(exports):
    for T, B in [(4096, 8), (80, 8), (12, 8), (10, 8), (6, 2), (4, 2), (3, 2)]:
        p, c = sizes(T, B)
        assert p >= 1 and p + c <= T - 1  # the last call's spare row fits
        if T - 1 - 1 >= B:
            assert c >= B  # every k checked once the prompt is down to one token
    assert sizes(4096, 8) == (48, 40)  # the verifies straddle 64 keys (PROMPT_TOKENS)
    assert max(_prompt(203, 500)) < 203 and min(_prompt(203, 500)) >= 1  # within any vocabulary
    s = Runtime(exports[("llama", 2)], max_seq_len=12).session
    r = check_rows(s)
    assert r.ok and max(r.per_k) == min(s.block_size, sizes(12, s.block_size)[1])
    v = validation(Runtime(exports[("llama", 2)], max_seq_len=3).session)
    assert v.skipped and "no room" in v.skipped and not v.failures


def test_export_records_the_check(exports):
    m = mf.load(exports[("qwen3", 2)], check_files=False)
    v = m.validation[ROWS]
    assert v.ok and not v.failures and v.steps["rule"].startswith("bitwise equal logits")
    assert v.steps["rows"] > 0 and v.steps["differing"] == 0 and v.steps["max_abs"] == 0.0
    assert sorted(map(int, v.steps["per_k"])) == list(range(2, m.block_size + 1)) == list(range(2, v.steps["k_max"] + 1))
    c = v.steps[COSTS]  # and its calls' timings: the auto schedule's prior
    assert len(c["verify"]) == m.block_size + 1 and c["verify"][0] == 0 and c["verify"][1] == c["decode"]
    assert all(x > 0 for x in (*c["verify"][1:], c["decode"], c["draft"]))


def test_a_cold_session_starts_from_the_exports_cost_prior(exports, tmp_path):
    """Where the export's timings say a draft costs several decode steps (as a 248,320-word head does), a cold
    session calibrates on plain decode steps and drafts only once its probe budget allows: the first rounds are
    plain, and greedy output is still the target's own. A manifest without usable timings calibrates as before."""
    import shutil

    from tests.exports import PROMPT, edit_manifest

    folder = tmp_path / "export"
    shutil.copytree(exports[("llama", 2)], folder)
    cheap = Runtime(folder, schedule_cache=False)
    c = cheap.manifest.validation[ROWS].steps[COSTS]
    prior = cheap._cost_prior()
    assert prior is not None and prior.draft == pytest.approx(c["draft"] / 1e3) and prior.decode == c["decode"] / 1e3

    def expensive(m):
        m["validation"][ROWS]["steps"][COSTS]["draft"] = 3 * c["decode"]
    edit_manifest(folder, expensive)
    rt = Runtime(folder, schedule_cache=False)
    auto = rt.auto_schedule
    assert auto.calibration.prior is not None and auto.calibration.plan == ("decode", "decode")
    want = rt.generate(PROMPT, 60, speculative=False)
    got = rt.generate(PROMPT, 60)
    assert got.ids == want.ids
    assert auto.made >= 59 and all(got.stats.skipped)  # 3 decode steps a draft: the budget allows one at 150 tokens

    edit_manifest(folder, lambda m: m["validation"][ROWS]["steps"][COSTS].update(verify=[0.0, 1.0]))
    assert Runtime(folder, schedule_cache=False)._cost_prior() is None  # not this block size: ignored


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
        msg = str(e)
        assert "target.onnx (validation[\"target.rows\"])" in msg and "not lossless" in msg
        assert "int4 kernel at block 64, accuracy level 4" in msg and "block 32" in msg
        assert not out.exists()  # nothing written where the export was asked for
        failed = tmp_path / "b64.failed"
        assert "found" in (failed / "VALIDATION_FAILED.txt").read_text()
        # kept for inspection, not runnable: the manifest is there under another name, with the failing record
        kept = json.loads((failed / "manifest.rows-failed.json").read_text())
        assert kept["validation"][ROWS]["failures"] and not (failed / mf.NAME).exists()
        with pytest.raises(Dflash2Error):
            Runtime(failed)
    else:
        rt = Runtime(out)
        assert mf.load(out, check_files=False).validation[ROWS].ok
        for prompt in ([5, 17, 42, 99, 7], list(range(40, 90))):
            assert generate(rt.session, prompt, 48, draft_len=3).ids == generate(rt.session, prompt, 48,
                                                                                  speculative=False).ids


def test_run_check_rows_cli(exports, capsys):
    folder = exports[("llama", 1)]
    r = subprocess.run([sys.executable, "-m", "dflash2.cli.run", str(folder), "--check-rows"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["row_invariant"] is True and got["rows"] > 0 and got["differing"] == 0 and got["max_abs"] == 0.0
    r = subprocess.run([sys.executable, "-m", "dflash2.cli.run", str(folder), "--check-rows", "--chat", "--json"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--check-rows: generates nothing, so --chat, --json would have no effect" in r.stderr
    # the failing path: exit 1, the JSON line says so, the failure on stderr
    rt = Runtime(folder)
    fake = SimpleNamespace(session=Edited(rt.session, multi=one_ulp), folder=folder, backend_name="onnxruntime")
    capsys.readouterr()
    assert run_cli._check_rows(fake) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["row_invariant"] is False and "expected a k-row verify bitwise equal" in err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_DONTNEED zero-fills on Linux only")
def test_the_check_hands_back_the_state_rows_no_step_reads():
    """RowStates.release_stale, run by the check before its prefills and verifies: the row the next step reads keeps
    its bytes, every other row of both buffers reads as zeros (its pages wholly inside: 16 KiB rows here, the middle
    8 KiB of each always) and is handed back; after a reset no row is live."""
    sig = mf.StateSignature("rows", ["s"], ["s_out"], [[4096]], ["float32"], 4)
    s = RowStates(sig, OrtBackend(None, {}, {}))
    s.step(4)
    s.commit(3, 4)  # the state after row 2 of a 4-row step: current = (A, 2)
    k, r = s.current
    for bufs in s.buffers[:2]:
        bufs[0].host[...] = 7
    released = s.release_stale()
    assert (s.buffers[k][0].host[r] == 7).all()
    stale = [(j, i) for j in range(2) for i in range(4) if (j, i) != (k, r)]
    assert all(not s.buffers[j][0].host[i, 1024:3072].any() for j, i in stale)
    assert released >= len(stale) * 8192
    s.reset()
    assert s.release_stale() >= 8192 and not s.buffers[k][0].host[r, 1024:3072].any()
    s.step(2)  # its rows are what the commit makes current: not stale until then
    with pytest.raises(Dflash2Error, match="no step awaiting its commit, found a 2-row step not committed"):
        s.release_stale()
