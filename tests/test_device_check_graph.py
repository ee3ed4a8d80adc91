"""The device check (dflash2/bench/device/) on a CPU machine, continued from tests/test_device_check.py:
the kernel-only build with nvcc (no GPU needed to compile), the CUDA-graph piece on a fake runtime (host
memory, the twin as kernel), main on a faked GPU and dflash2-plugins device."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from dflash2.bench.device import graph, runner
from dflash2.bench.device import main as check
from dflash2.native import library, selector

ROOT = Path(__file__).resolve().parents[1]


def twin_or_skip():
    try:
        return selector.load_cpu_twin()
    except library.PluginLibraryError as e:
        pytest.skip(str(e))


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
    row = graph.piece_cuda_graph({"work": str(tmp_path)}, rt=rt, lib=FakeKernelLib(rt, twin), V=3000)
    assert row["result"] == runner.PASS, row["detail"]
    assert row["cases"] == 2 and rt.replays >= 2 and rt.bufs == {}  # every buffer freed
    assert {t["block"] for t in row["data"]["timings"]} == {8, 16}
    rt = FakeRuntime()
    row = graph.piece_cuda_graph({"work": str(tmp_path)}, rt=rt, lib=FakeKernelLib(rt, twin, wrong=True), V=3000)
    assert row["result"] == runner.FAIL and "path_index differs" in row["detail"]


def test_main_on_a_faked_gpu_prints_one_table_and_writes_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(check, "gpu_present", lambda: (True, ""))
    rc = check.main(["--out", str(tmp_path / "o"), "--work", str(tmp_path / "w"), "--only", "tensorrt,kernel-twin"])
    out = capsys.readouterr().out
    assert rc == 1  # kernel-twin had no library: an ERROR row, not a pass
    doc = json.loads((tmp_path / "o" / "device_check.json").read_text())
    assert [(r["piece"], r["result"]) for r in doc["rows"]] == [("tensorrt", runner.SKIP),
                                                                ("kernel-twin", runner.ERROR)]
    assert doc["complete"] is True and doc["exit_code"] == 1
    assert out.count("piece  ") == 1 and "device_check: FAILED: kernel-twin" in out


def test_plugins_cli_device_is_the_device_check(tmp_path, monkeypatch, capsys):
    from dflash2.cli import plugins as plugins_cli
    monkeypatch.setattr(check, "gpu_present", lambda: (False, "no nvidia-smi on PATH"))
    assert plugins_cli.main(["device", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no GPU here" in err[0]
