"""The device check (dflash2/bench/device/, scripts/device_check.sh) on a CPU machine: its refusal in one
line, and its pieces against fakes: the runner's budget and failure capture, the table / JSON, the case
generators and the comparison rule (the CPU twin standing in for the kernel), the trainer piece on a fake
trainer, the PyTorch references CPU against CPU, the tree-size check. The kernel-only build, the CUDA-graph
piece on a fake runtime and main: tests/test_device_check_graph.py. What needs a GPU: docs/gpu.md."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dflash2.bench.device import families, graph, kernel, runner, trainer
from dflash2.bench.device import main as check
from dflash2.native import library, selector
from dflash2.ops import contract as C

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def no_gpu_env(tmp_path) -> dict:
    """PATH without nvidia-smi (bash and git stay reachable)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for tool in ("bash", "git", "env", "dirname", "compgen"):
        found = shutil.which(tool)
        if found:
            (bin_ / tool).symlink_to(found)
    return {**ENV, "PATH": str(bin_)}


def twin_or_skip():
    try:
        return selector.load_cpu_twin()
    except library.PluginLibraryError as e:
        pytest.skip(str(e))


# ---------------------------------------------------------------- the refusal

def test_refuses_in_one_line_without_a_gpu(tmp_path):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "dflash2.bench.device", "--out", str(out)],
                       env=no_gpu_env(tmp_path), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2
    assert p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("device_check: refused: no GPU here"), p.stderr
    assert not out.exists()


def test_script_refuses_in_one_line_without_a_gpu(tmp_path):
    p = subprocess.run(["bash", str(ROOT / "scripts" / "device_check.sh")],
                       env={**no_gpu_env(tmp_path), "PYTHON": sys.executable, "OUT": str(tmp_path / "o")},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "no GPU here" in p.stderr


def test_gpu_check_sh_points_elsewhere_in_one_line_without_a_gpu(tmp_path):
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")],
                       env={**no_gpu_env(tmp_path), "PYTHON": sys.executable, "WORK": str(tmp_path / "w")},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and "no GPU here" in p.stderr
    assert "Traceback" not in p.stderr


def test_gpu_present_reads_nvidia_smi(monkeypatch):
    monkeypatch.setattr(check.shutil, "which", lambda name: None)
    assert check.gpu_present() == (False, "no nvidia-smi on PATH")

    class Done:
        def __init__(self, rc, out, err=""):
            self.returncode, self.stdout, self.stderr = rc, out, err
    monkeypatch.setattr(check.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(check.subprocess, "run", lambda *a, **k: Done(0, "GPU 0: NVIDIA H100 80GB HBM3 (UUID: x)\n"))
    assert check.gpu_present() == (True, "")
    monkeypatch.setattr(check.subprocess, "run", lambda *a, **k: Done(9, "", "NVIDIA-SMI has failed\n"))
    ok, why = check.gpu_present()
    assert not ok and "NVIDIA-SMI has failed" in why


# ---------------------------------------------------------------- runner, budget, table, JSON

def test_run_piece_turns_every_failure_into_a_row():
    def boom(ctx):
        raise RuntimeError("the kernel\nfell over")
    row = runner.run_piece("x", boom, {}, 5)
    assert row.result == runner.ERROR and row.detail == "RuntimeError: the kernel fell over"

    def slow(ctx):
        time.sleep(5)
    t0 = time.monotonic()
    row = runner.run_piece("y", slow, {}, 0.3)
    assert row.result == runner.TIMEOUT and "budget of 0 s" in row.detail and time.monotonic() - t0 < 3
    row = runner.run_piece("z", lambda ctx: {"result": runner.PASS, "cases": 3, "detail": "ok"}, {}, 5)
    assert (row.piece, row.result, row.cases) == ("z", runner.PASS, 3)


def test_run_all_gives_each_piece_what_is_left_and_never_passes_a_missing_one():
    seen = {}

    def rec(name, sleep=0.0):
        def fn(ctx):
            seen[name] = ctx["budget"]
            time.sleep(sleep)
            return {"result": runner.PASS, "cases": 1}
        return fn
    funcs = {"a": rec("a", 1.0), "b": rec("b"), "c": rec("c")}
    rows = runner.run_all({}, ("a", "b", "c"), funcs=funcs, total_s=3.0, echo=None)
    assert [r.result for r in rows] == [runner.PASS] * 3
    assert seen["a"] == pytest.approx(3.0, abs=0.05) and seen["b"] < 2.1
    funcs["a"] = rec("a", 2.0)
    rows = runner.run_all({}, ("a", "b"), funcs=funcs, total_s=1.5, echo=None)
    assert rows[0].result == runner.TIMEOUT
    assert rows[1].result == runner.TIMEOUT and rows[1].detail.startswith("not started")
    assert runner.verdict(rows)[0] == 1


def test_table_json_and_verdict(tmp_path):
    rows = [runner.Row("build", runner.PASS, 1, 12.0, "built"),
            runner.Row("kernel-twin", runner.FAIL, 200, 3.5, "2 mismatching"),
            runner.Row("tensorrt", runner.SKIP, 0, 0.0, "no TensorRT in this image")]
    table = runner.format_table(rows)
    assert table.splitlines()[0].split()[:4] == ["piece", "cases", "result", "seconds"]
    assert len(table.splitlines()) == 4 and "FAIL" in table.splitlines()[2]
    rc, line = runner.verdict(rows)
    assert rc == 1 and "FAILED: kernel-twin" in line and "skipped: tensorrt" in line
    path = runner.write_report(tmp_path / "o", rows, {"seconds": 1.0})
    doc = json.loads(path.read_text())
    assert doc["format"] == "dflash2-device-check" and doc["exit_code"] == 1
    assert [r["piece"] for r in doc["rows"]] == ["build", "kernel-twin", "tensorrt"]
    assert (tmp_path / "o" / "device_check.txt").read_text().startswith("piece")
    rc, line = runner.verdict([rows[0], rows[2]])
    assert rc == 0 and line == "device_check: 1/1 pieces passed; skipped: tensorrt"


def test_tensorrt_row_is_a_skip_with_its_reason(monkeypatch):
    monkeypatch.setattr(trainer.importlib.util, "find_spec", lambda name: None)
    row = trainer.piece_tensorrt({})
    assert row["result"] == runner.SKIP and "scripts/gpu_check.sh" in row["detail"]


def test_kernel_pieces_fail_without_a_library():
    for fn in (kernel.piece_kernel_twin, kernel.piece_kernel_time, graph.piece_cuda_graph):
        row = runner.run_piece("k", fn, {"budget": 5}, 5)
        assert row.result == runner.ERROR and "no kernel library" in row.detail


def test_the_budgets_fit_eight_minutes():
    assert runner.TOTAL_BUDGET_S <= 8 * 60
    assert set(runner.PIECES) == set(check.FUNCS) and runner.PIECES[-1] == "tensorrt"


# ---------------------------------------------------------------- cases and the comparison rule

def test_flavours_cover_every_dtype_pair_mode_and_softcap():
    f = kernel.flavours()
    assert len(f) == len(set(f)) == 3 * 3 * 2 * 2
    assert {(tl, tc) for tl, tc, *_ in f} == {(a, b) for a in C.FLOAT_TYPES for b in C.FLOAT_TYPES}
    assert {m for _, _, m, _, _ in f} == set(C.MODES) and {cap for *_, cap in f} == {0.0, 30.0}


def test_random_cases_are_seeded_and_valid():
    a = next(iter(kernel.random_cases(seed=3)))
    b = next(iter(kernel.random_cases(seed=3)))
    assert a[0] == b[0] and all(np.array_equal(a[1][k], b[1][k]) for k in a[1])
    assert sum(1 for _ in kernel.random_cases()) == len(kernel.flavours()) * len(kernel.RANDOM_SHAPES)


def _outs(B=2, S=3, K=4):
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((B, S, K)).astype(np.float32)
    return [np.zeros((B, S), np.int32), np.ones((B, S), np.int32), scores,
            np.full((B, S), 0.5, np.float32), np.full((B, S, K), 0.25, np.float32)]


def test_compare_rule():
    a, b = _outs(), _outs()
    assert kernel.compare(a, b, exact_scores=True) == []
    b[1] = b[1].copy()
    b[1][1, 2] = 3
    assert kernel.compare(a, b, True) == ["path_index differs at [[1, 2]]"]
    b = _outs()
    b[2] = np.nextafter(b[2], np.float32(np.inf))  # one ulp
    assert kernel.compare(a, b, exact_scores=True)[0].startswith("path_scores differs")
    assert kernel.compare(a, b, exact_scores=False) == []
    b = _outs()
    b[3] = b[3] * np.float32(1 + 2e-6)  # a few ulp: the device exp
    assert kernel.compare(a, b, True) == []
    b[4] = b[4] * np.float32(1.001)
    assert kernel.compare(a, b, True)[0].startswith("draft_probs differs")
    assert kernel.compare(a[:4], b, True) == [f"expected {len(C.OUTPUTS)} outputs, got 4 and 5"]


def test_check_cases_with_the_twin_as_kernel_passes_every_case():
    """Every hand-built and random case runs (the twin standing in for the kernel), the known answers hold."""
    twin_or_skip()
    res = kernel.check_cases(kernel.hand_cases(), selector.select_path_cpu, selector.select_path_cpu)
    assert res["mismatches"] == [] and res["cases"] == 5 and not res["stopped"]
    shapes = ((2, 3, 4, 8, 40),)
    res = kernel.check_cases(kernel.random_cases(shapes=shapes), selector.select_path_cpu, selector.select_path_cpu)
    assert res["mismatches"] == [] and res["cases"] == len(kernel.flavours())


def test_check_cases_reports_a_differing_kernel_and_a_spent_budget():
    twin_or_skip()

    def off_by_one(**kw):
        out = list(selector.select_path_cpu(**kw))
        out[1] = (out[1] + 1) % kw["top_k"] if kw["top_k"] > 1 else out[1]
        return out
    res = kernel.check_cases(kernel.hand_cases(), off_by_one, selector.select_path_cpu)
    assert res["mismatches"] and any("known-path" in m and "known" in m for m in res["mismatches"])
    row = kernel._cases_row(res, "x")
    assert row["result"] == runner.FAIL and "mismatching" in row["detail"]
    res = kernel.check_cases(kernel.hand_cases(), selector.select_path_cpu, selector.select_path_cpu,
                         deadline=time.monotonic() - 1)
    assert res["cases"] == 0 and res["stopped"]
    assert kernel._cases_row(res, "x")["result"] == runner.FAIL


def test_real_inputs_share_the_codebooks():
    cache = {}
    a = kernel.real_inputs(1, 7, dtype="float16", V=5000, cache=cache)
    b = kernel.real_inputs(8, 15, dtype="float16", V=5000, cache=cache)
    assert a["pred_codebook"] is b["pred_codebook"] and a["pred_codebook"].shape == (5000, kernel.REAL_R)
    assert b["cand_ids"].shape == (8, 15, kernel.REAL_K) and b["cand_ids"].max() < 5000
    assert all(len(set(r)) == kernel.REAL_K for r in b["cand_ids"].reshape(-1, kernel.REAL_K).tolist())


# ---------------------------------------------------------------- torch references, trainer

def test_reference_rule_helpers():
    assert families.rel_diff([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert families.rel_diff([0.0, 4.0 + 4e-4], [0.0, 4.0]) == pytest.approx(1e-4)
    a = np.array([[1.0, 2.0, 2.0005], [5.0, 0.0, 0.0]])
    b = np.array([[1.0, 2.0005, 2.0], [5.0, 0.0, 0.0]])
    assert families.argmax_flips(a, b) == 0  # a near-tie may flip
    assert families.argmax_flips(np.array([[0.0, 1.0]]), np.array([[1.0, 0.0]])) == 1


def test_torch_reference_piece_runs_every_family_cpu_against_cpu(tmp_path):
    pytest.importorskip("torch")
    row = families.piece_torch_ref({"work": str(tmp_path)}, device="cpu")
    assert row["result"] == runner.PASS, row["detail"]
    assert set(row["data"]["families"]) == {"llama", "qwen3", "qwen3_5"} and row["cases"] == 6


def test_trainer_piece_on_a_fake_trainer(tmp_path):
    ok = [sys.executable, "-c", "print('step 10/99 [#] draft CE 1.0  12,345 label tok/s'); "
                                "print('step 20/99 [#] draft CE 0.9  23,456 label tok/s')"]
    row = trainer.piece_trainer({"work": str(tmp_path), "train_minutes": 3, "budget": 60}, command=ok)
    assert row["result"] == runner.PASS and row["data"]["label_tokens_per_s"] == 23456 and row["cases"] == 20
    bad = [sys.executable, "-c", "import sys; print('CUDA out of memory'); sys.exit(3)"]
    row = trainer.piece_trainer({"work": str(tmp_path), "train_minutes": 3, "budget": 60}, command=bad)
    assert row["result"] == runner.FAIL and "exit 3" in row["detail"] and "CUDA out of memory" in row["detail"]
    row = trainer.piece_trainer({"work": str(tmp_path), "train_minutes": 3, "budget": runner.BUDGETS["trainer"] + 20})
    assert row["result"] == runner.FAIL and "too little for a trainer run" in row["detail"]
    silent = [sys.executable, "-c", "pass"]
    row = trainer.piece_trainer({"work": str(tmp_path), "train_minutes": 3, "budget": 60}, command=silent)
    assert row["result"] == runner.FAIL and "not printed" in row["detail"]


def test_trainer_command_asks_for_the_gpu_and_a_time_limit(tmp_path):
    cmd = trainer.trainer_command(tmp_path / "t", tmp_path / "d", 3)
    assert cmd[cmd.index("--device") + 1] == "cuda" and cmd[cmd.index("--minutes") + 1] == "3"
    from dflash2.cli import train as train_cli
    with pytest.raises(SystemExit) as e:  # every flag it passes is one dflash2-train takes
        train_cli.main([*cmd[3:], "--help"])
    assert e.value.code == 0


# ---------------------------------------------------------------- what travels, the kernel-only build

def test_travel_counts_tracked_untracked_and_carried_files_not_ignored_ones(tmp_path):
    git = shutil.which("git") or pytest.skip("no git")
    r = tmp_path / "r"
    r.mkdir()
    subprocess.run([git, "init", "-q", str(r)], check=True)
    (r / ".gitignore").write_text("/.whl/\n")
    (r / "a.py").write_bytes(b"x" * 1000)
    (r / "new.txt").write_bytes(b"y" * 10)
    (r / ".whl").mkdir()
    (r / ".whl" / "w.whl").write_bytes(b"z" * 500)
    subprocess.run([git, "-C", str(r), "add", "a.py", ".gitignore"], check=True)
    t = runner.travel_bytes(r)
    assert t["bytes"] == 1000 + 10 + len("/.whl/\n") and t["fits"]
    assert runner.travel_bytes(r, (".whl",))["bytes"] == t["bytes"] + 500


def test_wheel_script_names_pinned_wheels_with_the_device_flags():
    s = (ROOT / "scripts" / "device_wheels.sh").read_text()
    for flag in ("--no-deps", "--only-binary=:all:", "--python-version 3.12", "--platform manylinux_2_28_x86_64",
                 "-d .whl"):
        assert flag in s
    assert '"polygraphy==' in s
    assert "/.whl/" in (ROOT / ".gitignore").read_text().splitlines()
