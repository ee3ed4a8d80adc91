"""The device check (dflash2/native/device_check.py, scripts/device_check.sh) on a CPU machine: its
refusal in one line, and its pieces against fakes: the runner's budget and failure capture, the
table / JSON, the case generators and the comparison rule (the CPU twin standing in for the kernel),
the trainer piece on a fake trainer, the PyTorch references CPU against CPU, the tree-size check, and
the kernel-only build with nvcc (no GPU needed to compile). What needs a GPU: docs/gpu.md."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dflash2.native import device_check as dc
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
    p = subprocess.run([sys.executable, "-m", "dflash2.native.device_check", "--out", str(out)],
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
    monkeypatch.setattr(dc.shutil, "which", lambda name: None)
    assert dc.gpu_present() == (False, "no nvidia-smi on PATH")

    class Done:
        def __init__(self, rc, out, err=""):
            self.returncode, self.stdout, self.stderr = rc, out, err
    monkeypatch.setattr(dc.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(dc.subprocess, "run", lambda *a, **k: Done(0, "GPU 0: NVIDIA H100 80GB HBM3 (UUID: x)\n"))
    assert dc.gpu_present() == (True, "")
    monkeypatch.setattr(dc.subprocess, "run", lambda *a, **k: Done(9, "", "NVIDIA-SMI has failed\n"))
    ok, why = dc.gpu_present()
    assert not ok and "NVIDIA-SMI has failed" in why


# ---------------------------------------------------------------- runner, budget, table, JSON

def test_run_piece_turns_every_failure_into_a_row():
    def boom(ctx):
        raise RuntimeError("the kernel\nfell over")
    row = dc.run_piece("x", boom, {}, 5)
    assert row.result == dc.ERROR and row.detail == "RuntimeError: the kernel fell over"

    def slow(ctx):
        time.sleep(5)
    t0 = time.monotonic()
    row = dc.run_piece("y", slow, {}, 0.3)
    assert row.result == dc.TIMEOUT and "budget of 0 s" in row.detail and time.monotonic() - t0 < 3
    row = dc.run_piece("z", lambda ctx: {"result": dc.PASS, "cases": 3, "detail": "ok"}, {}, 5)
    assert (row.piece, row.result, row.cases) == ("z", dc.PASS, 3)


def test_run_all_gives_each_piece_what_is_left_and_never_passes_a_missing_one():
    seen = {}

    def rec(name, sleep=0.0):
        def fn(ctx):
            seen[name] = ctx["budget"]
            time.sleep(sleep)
            return {"result": dc.PASS, "cases": 1}
        return fn
    funcs = {"a": rec("a", 1.0), "b": rec("b"), "c": rec("c")}
    rows = dc.run_all({}, ("a", "b", "c"), funcs=funcs, total_s=3.0, echo=None)
    assert [r.result for r in rows] == [dc.PASS] * 3
    assert seen["a"] == pytest.approx(3.0, abs=0.05) and seen["b"] < 2.1
    funcs["a"] = rec("a", 2.0)
    rows = dc.run_all({}, ("a", "b"), funcs=funcs, total_s=1.5, echo=None)
    assert rows[0].result == dc.TIMEOUT
    assert rows[1].result == dc.TIMEOUT and rows[1].detail.startswith("not started")
    assert dc.verdict(rows)[0] == 1


def test_table_json_and_verdict(tmp_path):
    rows = [dc.Row("build", dc.PASS, 1, 12.0, "built"), dc.Row("kernel-twin", dc.FAIL, 200, 3.5, "2 mismatching"),
            dc.Row("tensorrt", dc.SKIP, 0, 0.0, "no TensorRT in this image")]
    table = dc.format_table(rows)
    assert table.splitlines()[0].split()[:4] == ["piece", "cases", "result", "seconds"]
    assert len(table.splitlines()) == 4 and "FAIL" in table.splitlines()[2]
    rc, line = dc.verdict(rows)
    assert rc == 1 and "FAILED: kernel-twin" in line and "skipped: tensorrt" in line
    path = dc.write_report(tmp_path / "o", rows, {"seconds": 1.0})
    doc = json.loads(path.read_text())
    assert doc["format"] == "dflash2-device-check" and doc["exit_code"] == 1
    assert [r["piece"] for r in doc["rows"]] == ["build", "kernel-twin", "tensorrt"]
    assert (tmp_path / "o" / "device_check.txt").read_text().startswith("piece")
    rc, line = dc.verdict([rows[0], rows[2]])
    assert rc == 0 and line == "device_check: 1/1 pieces passed; skipped: tensorrt"


def test_tensorrt_row_is_a_skip_with_its_reason(monkeypatch):
    monkeypatch.setattr(dc.importlib.util, "find_spec", lambda name: None)
    row = dc.piece_tensorrt({})
    assert row["result"] == dc.SKIP and "scripts/gpu_check.sh" in row["detail"]


def test_kernel_pieces_fail_without_a_library():
    for fn in (dc.piece_kernel_twin, dc.piece_kernel_time, dc.piece_cuda_graph):
        row = dc.run_piece("k", fn, {"budget": 5}, 5)
        assert row.result == dc.ERROR and "no kernel library" in row.detail


def test_the_budgets_fit_eight_minutes():
    assert dc.TOTAL_BUDGET_S <= 8 * 60
    assert set(dc.PIECES) == set(dc.FUNCS) and dc.PIECES[-1] == "tensorrt"


# ---------------------------------------------------------------- cases and the comparison rule

def test_flavours_cover_every_dtype_pair_mode_and_softcap():
    f = dc.flavours()
    assert len(f) == len(set(f)) == 3 * 3 * 2 * 2
    assert {(tl, tc) for tl, tc, *_ in f} == {(a, b) for a in C.FLOAT_TYPES for b in C.FLOAT_TYPES}
    assert {m for _, _, m, _, _ in f} == set(C.MODES) and {cap for *_, cap in f} == {0.0, 30.0}


def test_random_cases_are_seeded_and_valid():
    a = next(iter(dc.random_cases(seed=3)))
    b = next(iter(dc.random_cases(seed=3)))
    assert a[0] == b[0] and all(np.array_equal(a[1][k], b[1][k]) for k in a[1])
    assert sum(1 for _ in dc.random_cases()) == len(dc.flavours()) * len(dc.RANDOM_SHAPES)


def _outs(B=2, S=3, K=4):
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((B, S, K)).astype(np.float32)
    return [np.zeros((B, S), np.int32), np.ones((B, S), np.int32), scores,
            np.full((B, S), 0.5, np.float32), np.full((B, S, K), 0.25, np.float32)]


def test_compare_rule():
    a, b = _outs(), _outs()
    assert dc.compare(a, b, exact_scores=True) == []
    b[1] = b[1].copy()
    b[1][1, 2] = 3
    assert dc.compare(a, b, True) == ["path_index differs at [[1, 2]]"]
    b = _outs()
    b[2] = np.nextafter(b[2], np.float32(np.inf))  # one ulp
    assert dc.compare(a, b, exact_scores=True)[0].startswith("path_scores differs")
    assert dc.compare(a, b, exact_scores=False) == []
    b = _outs()
    b[3] = b[3] * np.float32(1 + 2e-6)  # a few ulp: the device exp
    assert dc.compare(a, b, True) == []
    b[4] = b[4] * np.float32(1.001)
    assert dc.compare(a, b, True)[0].startswith("draft_probs differs")
    assert dc.compare(a[:4], b, True) == [f"expected {len(C.OUTPUTS)} outputs, got 4 and 5"]


def test_check_cases_with_the_twin_as_kernel_passes_every_case():
    """Every hand-built and random case runs (the twin standing in for the kernel), the known answers hold."""
    twin_or_skip()
    res = dc.check_cases(dc.hand_cases(), selector.select_path_cpu, selector.select_path_cpu)
    assert res["mismatches"] == [] and res["cases"] == 5 and not res["stopped"]
    shapes = ((2, 3, 4, 8, 40),)
    res = dc.check_cases(dc.random_cases(shapes=shapes), selector.select_path_cpu, selector.select_path_cpu)
    assert res["mismatches"] == [] and res["cases"] == len(dc.flavours())


def test_check_cases_reports_a_differing_kernel_and_a_spent_budget():
    twin_or_skip()

    def off_by_one(**kw):
        out = list(selector.select_path_cpu(**kw))
        out[1] = (out[1] + 1) % kw["top_k"] if kw["top_k"] > 1 else out[1]
        return out
    res = dc.check_cases(dc.hand_cases(), off_by_one, selector.select_path_cpu)
    assert res["mismatches"] and any("known-path" in m and "known" in m for m in res["mismatches"])
    row = dc._cases_row(res, "x")
    assert row["result"] == dc.FAIL and "mismatching" in row["detail"]
    res = dc.check_cases(dc.hand_cases(), selector.select_path_cpu, selector.select_path_cpu,
                         deadline=time.monotonic() - 1)
    assert res["cases"] == 0 and res["stopped"]
    assert dc._cases_row(res, "x")["result"] == dc.FAIL


def test_real_inputs_share_the_codebooks():
    cache = {}
    a = dc.real_inputs(1, 7, dtype="float16", V=5000, cache=cache)
    b = dc.real_inputs(8, 15, dtype="float16", V=5000, cache=cache)
    assert a["pred_codebook"] is b["pred_codebook"] and a["pred_codebook"].shape == (5000, dc.REAL_R)
    assert b["cand_ids"].shape == (8, 15, dc.REAL_K) and b["cand_ids"].max() < 5000
    assert all(len(set(r)) == dc.REAL_K for r in b["cand_ids"].reshape(-1, dc.REAL_K).tolist())


# ---------------------------------------------------------------- torch references, trainer

def test_reference_rule_helpers():
    assert dc.rel_diff([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert dc.rel_diff([0.0, 4.0 + 4e-4], [0.0, 4.0]) == pytest.approx(1e-4)
    a = np.array([[1.0, 2.0, 2.0005], [5.0, 0.0, 0.0]])
    b = np.array([[1.0, 2.0005, 2.0], [5.0, 0.0, 0.0]])
    assert dc.argmax_flips(a, b) == 0  # a near-tie may flip
    assert dc.argmax_flips(np.array([[0.0, 1.0]]), np.array([[1.0, 0.0]])) == 1


def test_torch_reference_piece_runs_every_family_cpu_against_cpu(tmp_path):
    pytest.importorskip("torch")
    row = dc.piece_torch_ref({"work": str(tmp_path)}, device="cpu")
    assert row["result"] == dc.PASS, row["detail"]
    assert set(row["data"]["families"]) == {"llama", "qwen3", "qwen3_5"} and row["cases"] == 6


def test_trainer_piece_on_a_fake_trainer(tmp_path):
    ok = [sys.executable, "-c", "print('step 10/99 [#] draft CE 1.0  12,345 label tok/s'); "
                                "print('step 20/99 [#] draft CE 0.9  23,456 label tok/s')"]
    row = dc.piece_trainer({"work": str(tmp_path), "train_minutes": 3, "budget": 60}, command=ok)
    assert row["result"] == dc.PASS and row["data"]["label_tokens_per_s"] == 23456 and row["cases"] == 20
    bad = [sys.executable, "-c", "import sys; print('CUDA out of memory'); sys.exit(3)"]
    row = dc.piece_trainer({"work": str(tmp_path), "train_minutes": 3, "budget": 60}, command=bad)
    assert row["result"] == dc.FAIL and "exit 3" in row["detail"] and "CUDA out of memory" in row["detail"]
    row = dc.piece_trainer({"work": str(tmp_path), "train_minutes": 3, "budget": dc.BUDGETS["trainer"] + 20})
    assert row["result"] == dc.FAIL and "too little for a trainer run" in row["detail"]
    silent = [sys.executable, "-c", "pass"]
    row = dc.piece_trainer({"work": str(tmp_path), "train_minutes": 3, "budget": 60}, command=silent)
    assert row["result"] == dc.FAIL and "not printed" in row["detail"]


def test_trainer_command_asks_for_the_gpu_and_a_time_limit(tmp_path):
    cmd = dc.trainer_command(tmp_path / "t", tmp_path / "d", 3)
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
    t = dc.travel_bytes(r)
    assert t["bytes"] == 1000 + 10 + len("/.whl/\n") and t["fits"]
    assert dc.travel_bytes(r, (".whl",))["bytes"] == t["bytes"] + 500


def test_wheel_script_names_pinned_wheels_with_the_device_flags():
    s = (ROOT / "scripts" / "device_wheels.sh").read_text()
    for flag in ("--no-deps", "--only-binary=:all:", "--python-version 3.12", "--platform manylinux_2_28_x86_64",
                 "-d .whl"):
        assert flag in s
    assert '"polygraphy==' in s
    assert "/.whl/" in (ROOT / ".gitignore").read_text().splitlines()


@pytest.mark.slow
def test_kernel_only_build_compiles_without_tensorrt_headers(tmp_path):
    """nvcc builds libdflash2_kernel.so and the twin with DFLASH2_KERNEL_ONLY=1 (no TensorRT headers, no GPU);
    the library loads and exports the C entries the device check calls."""
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
    if nvcc is None or shutil.which("cmake") is None:
        pytest.skip("no nvcc / cmake on this machine: the kernel-only build is proven where they are")
    env = {**os.environ, "DFLASH2_KERNEL_ONLY": "1", "BUILD_DIR": str(tmp_path / "b"), "CUDA_ARCHS": "90-real",
           "JOBS": "2", "TENSORRT_ROOT": ""}
    p = subprocess.run(["bash", str(ROOT / "plugins" / "build.sh")], env=env, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
    assert "DFLASH2_KERNEL_ONLY=ON" in p.stdout and "fetching TensorRT headers" not in p.stdout
    lib = tmp_path / "b" / "libdflash2_kernel.so"
    assert lib.is_file() and (tmp_path / "b" / "libdflash2_selector_cpu.so").is_file()
    assert not (tmp_path / "b" / "libdflash2_plugins.so").exists()
    import ctypes
    so = ctypes.CDLL(str(lib))
    assert library.abi_version(so, lib) == library.ABI_VERSION
    for sym in ("dflash2_select_path_cuda", "dflash2_launch_select_path", "dflash2_cuda_device_count",
                "dflash2_select_path_cpu", "dflash2_check_select_args"):
        assert hasattr(so, sym), sym
    assert not hasattr(so, "getCreators")  # no TensorRT plugin in it


class FakeRuntime:
    """cuda.bindings.runtime's calls the graph piece makes, on host memory: 'device' buffers are numpy
    arrays addressed by their real pointers, a captured launch is kept and run again at each replay."""

    class cudaError_t:
        cudaSuccess = 0

    class cudaMemcpyKind:
        cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost = 1, 2

    class cudaStreamCaptureMode:
        cudaStreamCaptureModeThreadLocal = 1

    cudaStreamNonBlocking = 1

    def __init__(self):
        self.bufs, self.capturing, self.graphs, self.launches, self.replays = {}, None, {}, 0, 0

    def cudaGetErrorString(self, err):
        return 0, b"fake error"

    def cudaStreamCreateWithFlags(self, flags):
        return 0, 77  # the stream handle: an int, as int(cudaStream_t) gives

    def cudaMalloc(self, n):
        a = np.zeros(n, np.uint8)
        self.bufs[a.ctypes.data] = a
        return 0, a.ctypes.data

    def cudaMemcpy(self, dst, src, n, kind):
        ctypes.memmove(dst, src, n)
        return (0,)

    def cudaMemsetAsync(self, dst, value, n, stream):
        ctypes.memset(dst, value, n)
        return (0,)

    def cudaStreamSynchronize(self, stream):
        return (0,)

    def cudaStreamBeginCapture(self, stream, mode):
        self.capturing = []
        return (0,)

    def cudaStreamEndCapture(self, stream):
        g, self.capturing = self.capturing, None
        self.graphs[id(g)] = g
        return 0, id(g)

    def cudaGraphInstantiate(self, graph, flags):
        return 0, graph

    def cudaGraphLaunch(self, gexec, stream):
        self.replays += 1
        for fn in self.graphs[gexec]:
            fn()
        return (0,)

    def cudaGraphExecDestroy(self, g):
        return (0,)

    def cudaGraphDestroy(self, g):
        return (0,)

    def cudaFree(self, p):
        self.bufs.pop(p)
        return (0,)

    def cudaStreamDestroy(self, s):
        return (0,)


class FakeKernelLib:
    """dflash2_launch_select_path that runs the CPU twin on the (host) buffers; captured launches are
    recorded with their arguments by value, as a CUDA graph keeps a kernel's parameters."""

    def __init__(self, rt, twin, wrong=False):
        self.rt, self.twin, self.wrong = rt, twin, wrong

        def launch(args_ref, stream, err, n):
            assert stream.value == 77
            args = type(args_ref._obj).from_buffer_copy(args_ref._obj)

            def run():
                assert twin.dflash2_select_path_cpu(ctypes.byref(args), err, n) == 0
                if self.wrong:
                    ctypes.memset(args.path_index, 0xFF, 4)
            if rt.capturing is not None:
                rt.capturing.append(run)
            else:
                rt.launches += 1
                run()
            return 0
        self.dflash2_launch_select_path = launch



def test_cuda_graph_piece_on_a_fake_runtime(tmp_path):
    """The capture / zero / replay / compare plumbing, with host memory for device memory and the twin for
    the kernel: the replayed outputs equal the twin's, and a wrong replay is caught."""
    twin = twin_or_skip()
    rt = FakeRuntime()
    row = dc.piece_cuda_graph({"work": str(tmp_path)}, rt=rt, lib=FakeKernelLib(rt, twin), V=3000)
    assert row["result"] == dc.PASS, row["detail"]
    assert row["cases"] == 2 and rt.replays >= 2 and rt.bufs == {}  # every buffer freed
    assert {t["block"] for t in row["data"]["timings"]} == {8, 16}
    rt = FakeRuntime()
    row = dc.piece_cuda_graph({"work": str(tmp_path)}, rt=rt, lib=FakeKernelLib(rt, twin, wrong=True), V=3000)
    assert row["result"] == dc.FAIL and "path_index differs" in row["detail"]


def test_main_on_a_faked_gpu_prints_one_table_and_writes_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(dc, "gpu_present", lambda: (True, ""))
    rc = dc.main(["--out", str(tmp_path / "o"), "--work", str(tmp_path / "w"), "--only", "tensorrt,kernel-twin"])
    out = capsys.readouterr().out
    assert rc == 1  # kernel-twin had no library: an ERROR row, not a pass
    doc = json.loads((tmp_path / "o" / "device_check.json").read_text())
    assert [(r["piece"], r["result"]) for r in doc["rows"]] == [("tensorrt", dc.SKIP), ("kernel-twin", dc.ERROR)]
    assert doc["complete"] is True and doc["exit_code"] == 1
    assert out.count("piece  ") == 1 and "device_check: FAILED: kernel-twin" in out


def test_plugins_cli_device_is_the_device_check(tmp_path, monkeypatch, capsys):
    from dflash2.cli import plugins as plugins_cli
    monkeypatch.setattr(dc, "gpu_present", lambda: (False, "no nvidia-smi on PATH"))
    assert plugins_cli.main(["device", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no GPU here" in err[0]
