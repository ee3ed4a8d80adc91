"""The DFlash2Selector native libraries from Python: find, load (ctypes), call the CPU twin.

Libraries (built by `bash plugins/build.sh` into build/plugins/):
- libdflash2_selector_cpu.so: the CPU twin alone (g++ only; needs neither CUDA nor TensorRT);
- libdflash2_plugins.so: the TensorRT plugin + CUDA kernel + the same CPU twin; what
  `IPluginRegistry::loadLibrary` / `trtexec --dynamicPlugins` / `load_library` take.
Search order: $DFLASH2_PLUGIN_LIB (the plugin .so or a folder holding the libraries), then
build/plugins/ under the repository root, then dflash2/lib/ next to this module.

No torch here: the edge runtime imports this module. `python -m dflash2.plugins bench` times the
CPU twin against the PyTorch reference (torch is imported by that command only).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

from dflash2.errors import Dflash2Error
from dflash2.ops import contract as C

PLUGIN_LIB = "libdflash2_plugins.so"
CPU_LIB = "libdflash2_selector_cpu.so"
ENV_VAR = "DFLASH2_PLUGIN_LIB"
ABI_VERSION = 1
BUILD_HINT = ("build it from the repository root with `bash plugins/build.sh` (CPU twin only: "
              "`DFLASH2_CPU_ONLY=1 bash plugins/build.sh`), or set DFLASH2_PLUGIN_LIB to the built "
              "libdflash2_plugins.so or its folder")
_DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}


class PluginLibraryError(Dflash2Error):
    """A native library is missing, fails to load, or reports an error."""


class _Args(ctypes.Structure):
    """Mirror of Df2SelectArgs in plugins/dflash2Selector/dflash2SelectorMath.h."""

    _fields_ = [(n, ctypes.c_void_p) for n in (
        "cand_logits", "cand_ids", "gate", "anchor", "pred_codebook", "succ_codebook",
        "draft_ids", "path_index", "path_scores")] + [
        (n, ctypes.c_int64) for n in "BSKRV"] + [
        ("logits_dtype", ctypes.c_int32), ("codebook_dtype", ctypes.c_int32),
        ("output_multiplier", ctypes.c_float), ("logit_softcap", ctypes.c_float)]


BUILD_DIR = Path(__file__).resolve().parents[1] / "build" / "plugins"  # where plugins/build.sh writes


def abi_version(lib: ctypes.CDLL, path: Path) -> int:
    """The C ABI version a loaded library reports; a library without the symbol is not ours."""
    if not hasattr(lib, "dflash2_selector_abi_version"):
        raise PluginLibraryError(f"{path}: not a DFlash2 plugin library (no dflash2_selector_abi_version); "
                                 f"{BUILD_HINT}")
    lib.dflash2_selector_abi_version.restype = ctypes.c_int32
    return int(lib.dflash2_selector_abi_version())


def search_dirs() -> list[Path]:
    dirs = []
    env = os.environ.get(ENV_VAR)
    if env:
        p = Path(env)
        dirs.append(p.parent if p.is_file() or p.suffix == ".so" else p)
    dirs.append(BUILD_DIR)
    dirs.append(Path(__file__).resolve().parent / "lib")
    return dirs


def find_library(name: str = PLUGIN_LIB) -> Path:
    """Path of `name` (libdflash2_plugins.so or libdflash2_selector_cpu.so); error says how to build."""
    env = os.environ.get(ENV_VAR)
    if env and name == PLUGIN_LIB and Path(env).is_file():
        return Path(env)
    looked = [d / name for d in search_dirs()]
    for p in looked:
        if p.is_file():
            return p
    raise PluginLibraryError(f"{name} not found (looked in: {', '.join(map(str, looked))}); {BUILD_HINT}")


def _load(path: Path) -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise PluginLibraryError(f"{path} failed to load: {e}; rebuild it: {BUILD_HINT}") from e
    found = abi_version(lib, path)
    if found != ABI_VERSION:
        raise PluginLibraryError(f"{path}: C ABI version expected {ABI_VERSION}, found {found}; {BUILD_HINT}")
    for fn in ("dflash2_select_path_cpu", "dflash2_check_select_args"):
        getattr(lib, fn).argtypes = [ctypes.POINTER(_Args), ctypes.c_char_p, ctypes.c_size_t]
        getattr(lib, fn).restype = ctypes.c_int32
    if hasattr(lib, "dflash2_cuda_device_count"):
        lib.dflash2_cuda_device_count.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        lib.dflash2_cuda_device_count.restype = ctypes.c_int32
    if hasattr(lib, "dflash2_select_path_cuda"):
        lib.dflash2_select_path_cuda.argtypes = [ctypes.POINTER(_Args), ctypes.c_int32,
                                                 ctypes.POINTER(ctypes.c_float), ctypes.c_char_p, ctypes.c_size_t]
        lib.dflash2_select_path_cuda.restype = ctypes.c_int32
    return lib


@lru_cache(maxsize=None)
def load_cpu_twin() -> ctypes.CDLL:
    """The CPU twin: libdflash2_selector_cpu.so, else the same code inside libdflash2_plugins.so."""
    try:
        return _load(find_library(CPU_LIB))
    except PluginLibraryError as first:
        try:
            return _load(find_library(PLUGIN_LIB))
        except PluginLibraryError:
            raise first from None


@lru_cache(maxsize=None)
def load_plugin_library() -> ctypes.CDLL:
    """libdflash2_plugins.so (plugin + kernel); loads without a GPU, its CUDA entry needs one to run."""
    return _load(find_library(PLUGIN_LIB))


def cuda_device_count() -> tuple[int, str]:
    """(number of CUDA devices the plugin library sees, reason when 0): no torch needed."""
    err = ctypes.create_string_buffer(256)
    n = load_plugin_library().dflash2_cuda_device_count(err, len(err))
    return max(n, 0), (err.value.decode() if n < 0 else "no CUDA device visible" if n == 0 else "")


def _prepare(cand_logits, cand_ids, gate, anchor, pred_codebook, succ_codebook, attrs: dict):
    """Validate with the contract's rules (the same as the reference op), then fill the C struct;
    returns (args, outputs, keepalive)."""
    a = C.check_attributes(attrs)
    arrays = dict(zip(C.input_names(), (cand_logits, cand_ids, gate, anchor, pred_codebook, succ_codebook)))
    arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    ranges = {n: (int(arrays[n].min()), int(arrays[n].max())) for n in ("cand_ids", "anchor") if arrays[n].size}
    # ml_dtypes' bfloat16 arrays report "bfloat16"
    dims = C.check_io({n: v.shape for n, v in arrays.items()}, {n: v.dtype.name for n, v in arrays.items()},
                      a, ranges)
    B, S, K = dims["B"], dims["S"], dims["K"]
    outs = (np.empty((B, S), np.int32), np.empty((B, S), np.int32), np.empty((B, S, K), np.float32))
    ptr = {k: v.ctypes.data for k, v in arrays.items()}
    args = _Args(*[ptr[n] for n in C.input_names()], *[o.ctypes.data for o in outs],
                 B, S, K, dims["R"], dims["V"], _DTYPE_CODES[arrays["cand_logits"].dtype.name],
                 _DTYPE_CODES[arrays["gate"].dtype.name], a["output_multiplier"], a["logit_softcap"])
    return args, outs, arrays


def select_path_cpu(cand_logits, cand_ids, gate, anchor, pred_codebook, succ_codebook, **attrs):
    """The op on numpy arrays through the CPU twin -> (draft_ids [B,S], path_index [B,S], path_scores [B,S,K]).

    Float inputs: float32, float16 or bfloat16 (ml_dtypes); ids int32. Attributes as in the contract.
    """
    args, outs, _keep = _prepare(cand_logits, cand_ids, gate, anchor, pred_codebook, succ_codebook, attrs)
    err = ctypes.create_string_buffer(512)
    if load_cpu_twin().dflash2_select_path_cpu(ctypes.byref(args), err, len(err)) != 0:
        raise PluginLibraryError(err.value.decode())
    return outs


def select_path_cuda(cand_logits, cand_ids, gate, anchor, pred_codebook, succ_codebook,
                     timing_iters: int = 0, **attrs):
    """Same through the CUDA kernel (host arrays copied to the GPU and back; for tests/benchmarks).

    Returns (draft_ids, path_index, path_scores, microseconds per launch or None).
    """
    args, outs, _keep = _prepare(cand_logits, cand_ids, gate, anchor, pred_codebook, succ_codebook, attrs)
    err = ctypes.create_string_buffer(512)
    us = ctypes.c_float(0.0)
    if load_plugin_library().dflash2_select_path_cuda(ctypes.byref(args), timing_iters, ctypes.byref(us),
                                                     err, len(err)) != 0:
        raise PluginLibraryError(err.value.decode())
    return (*outs, us.value if timing_iters > 0 else None)


def random_inputs(B: int, S: int, K: int, R: int, V: int, codebook_dtype: str = "float32",
                  logits_dtype: str = "float32", seed: int = 0) -> dict[str, np.ndarray]:
    """Random op inputs (ids distinct per row, like top-K) as numpy arrays in the given dtypes."""
    rng = np.random.default_rng(seed)

    def floats(shape, dtype, scale=1.0):
        x = (rng.standard_normal(shape, dtype=np.float32) * scale)
        if dtype == "bfloat16":
            import ml_dtypes  # onnx's dependency; only needed for bf16
            return x.astype(ml_dtypes.bfloat16)
        return x.astype(dtype)

    ids = np.stack([rng.choice(V, size=K, replace=False) for _ in range(B * S)]).reshape(B, S, K).astype(np.int32)
    return {"cand_logits": floats((B, S, K), logits_dtype, 4.0), "cand_ids": ids,
            "gate": floats((B, S, R), codebook_dtype, 1.0 / np.sqrt(R)),
            "anchor": rng.integers(0, V, size=B, dtype=np.int32),
            "pred_codebook": floats((V, R), codebook_dtype), "succ_codebook": floats((V, R), codebook_dtype)}


def _time_us(fn, repeats: int = 7, min_seconds: float = 0.05) -> float:
    """Median over `repeats` of the mean microseconds per call (robust to a busy machine)."""
    fn()  # warm-up
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t0
        if dt >= min_seconds:
            break
        n *= 2
    samples = [dt / n]
    for _ in range(repeats - 1):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n)
    return float(np.median(samples)) * 1e6


def bench(batches=(1, 8), codebook_dtypes=("float32", "bfloat16"), S: int = 7, K: int = 16, R: int = 256,
          V: int = 151936, reference: bool = True) -> list[dict]:
    """Microseconds per call of the CPU twin (and the PyTorch reference) at production sizes."""
    rows = []
    for dt in codebook_dtypes:
        base = random_inputs(max(batches), S, K, R, V, codebook_dtype=dt)
        for B in batches:
            x = {k: (v if k.endswith("codebook") else v[:B]) for k, v in base.items()}
            row = {"batch": B, "S": S, "K": K, "R": R, "V": V, "codebook_dtype": dt,
                   "cpu_twin_us": _time_us(lambda: select_path_cpu(**x, top_k=K, rank=R))}
            if reference:
                row["torch_reference_us"] = _time_torch_reference(x, K, R)
            rows.append(row)
    return rows


def _time_torch_reference(x: dict, K: int, R: int) -> float:
    import torch  # the benchmark alone needs torch; importing this module must not

    import dflash2.reference.selector  # noqa: F401  registers torch.ops.dflash2.select_path

    def tensor(a: np.ndarray):
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)

    t = {k: tensor(v) for k, v in x.items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CPU twin is single-threaded; OpenMP spinning on a busy box distorts
    try:
        with torch.inference_mode():
            return _time_us(lambda: torch.ops.dflash2.select_path(**t, top_k=K, rank=R))
    finally:
        torch.set_num_threads(threads)


def _has_bf16() -> bool:
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False
    return True


def gpu_check(V: int = 151936, iters: int = 200) -> dict:
    """Kernel vs CPU twin (bit-identical with softcap 0) on odd and production shapes, plus kernel
    microseconds per launch at production sizes. Needs a GPU, not torch."""
    n, why = cuda_device_count()
    if n == 0:
        raise PluginLibraryError(f"no CUDA device: {why}")
    dtypes = ("float32", "float16") + (("bfloat16",) if _has_bf16() else ())
    shapes = [(1, 7, 16, 256, 2000), (8, 7, 16, 256, 2000), (3, 1, 1, 1, 50), (2, 5, 64, 1024, 500),
              (2, 40, 4, 33, 64)]
    mismatches, checked = [], 0
    for dt in dtypes:
        for B, S, K, R, Vs in shapes:
            x = random_inputs(B, S, K, R, Vs, codebook_dtype=dt, logits_dtype=dt, seed=B + S + K + R)
            cpu = select_path_cpu(**x, top_k=K, rank=R)
            gpu = select_path_cuda(**x, top_k=K, rank=R)[:3]
            checked += 1
            for name, a, b in zip(C.output_names(), gpu, cpu):
                if not np.array_equal(a, b):
                    mismatches.append(f"{dt} B={B} S={S} K={K} R={R}: {name} differs at "
                                      f"{np.argwhere(a != b)[:3].tolist()}")
    timings = []
    dt = "bfloat16" if _has_bf16() else "float16"
    for B in (1, 8):
        x = random_inputs(B, 7, 16, 256, V, codebook_dtype=dt)
        us = select_path_cuda(**x, top_k=16, rank=256, timing_iters=iters)[3]
        timings.append({"batch": B, "S": 7, "K": 16, "R": 256, "V": V, "codebook_dtype": dt, "kernel_us": us})
    return {"cases_checked": checked, "mismatches": mismatches, "timings": timings}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash2.plugins", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="CPU twin vs PyTorch reference, microseconds per call")
    b.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    b.add_argument("--vocab", type=int, default=151936)
    b.add_argument("--no-reference", action="store_true", help="skip the PyTorch reference (no torch needed)")
    sub.add_parser("find", help="print the library paths that would be loaded")
    sub.add_parser("gpu", help="kernel vs CPU twin + kernel microseconds (needs a GPU, not torch)")
    args = ap.parse_args(argv)
    if args.cmd == "gpu":
        try:
            res = gpu_check()
        except PluginLibraryError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"kernel vs CPU twin: {res['cases_checked']} cases, {len(res['mismatches'])} mismatching")
        for m in res["mismatches"]:
            print("  MISMATCH", m)
        for t in res["timings"]:
            print(f"kernel B={t['batch']} S=7 K=16 R=256 V={t['V']} {t['codebook_dtype']}: {t['kernel_us']:.1f} us")
        print(json.dumps(res))
        return 1 if res["mismatches"] else 0
    if args.cmd == "find":
        for name in (PLUGIN_LIB, CPU_LIB):
            try:
                print(f"{name}: {find_library(name)}")
            except PluginLibraryError as e:
                print(e)
        return 0
    try:
        rows = bench(tuple(args.batch), V=args.vocab, reference=not args.no_reference)
    except PluginLibraryError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'batch':>5} {'codebooks':>9} {'CPU twin us':>12} {'torch ref us':>13} {'speedup':>8}"
          "   (median us per call, one thread each)")
    for r in rows:
        ref = r.get("torch_reference_us")
        ref_s, speedup = (f"{ref:.1f}", f"{ref / r['cpu_twin_us']:.1f}x") if ref else ("-", "-")
        print(f"{r['batch']:>5} {r['codebook_dtype']:>9} {r['cpu_twin_us']:>12.1f} {ref_s:>13} {speedup:>8}")
    print(json.dumps({"S": rows[0]["S"], "K": rows[0]["K"], "R": rows[0]["R"], "V": rows[0]["V"], "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
