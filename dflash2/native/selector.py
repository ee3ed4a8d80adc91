"""ctypes bindings of the DFlash2Selector op: the CPU twin and the CUDA kernel on numpy arrays.

The inputs are checked with the contract's rules (`dflash2.ops.contract`, the same as the reference
op) before the C struct is filled. No torch: the edge runtime may import this module.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np

from dflash2.native.library import (ABI_VERSION, BUILD_HINT, CPU_LIB, PLUGIN_LIB, PluginLibraryError, abi_version,
                                    find_library, open_library)
from dflash2.ops import contract as C

_DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}  # DF2_FLOAT32 ... (contract.FLOAT_TYPES order)
_MODE_CODES = {m: i for i, m in enumerate(C.MODES)}  # DF2_MODE_GREEDY = 0, DF2_MODE_SAMPLE = 1


class _Args(ctypes.Structure):
    """Mirror of Df2SelectArgs in plugins/dflash2Selector/dflash2SelectorMath.h (C ABI 3): the input
    pointers in contract.INPUTS order, then the outputs in contract.OUTPUTS order."""

    _fields_ = [(n, ctypes.c_void_p) for n in C.input_names() + C.output_names()] + [
        (n, ctypes.c_int64) for n in "BSKRV"] + [
        ("logits_dtype", ctypes.c_int32), ("codebook_dtype", ctypes.c_int32),
        ("output_multiplier", ctypes.c_float), ("logit_softcap", ctypes.c_float), ("mode", ctypes.c_int32)]


def _load(path) -> ctypes.CDLL:
    lib = open_library(path)
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


def _prepare(inputs: tuple, attrs: dict):
    """Validate with the contract's rules (the same as the reference op), then fill the C struct;
    returns (args, outputs, keepalive)."""
    a = C.check_attributes(attrs)
    arrays = dict(zip(C.input_names(), inputs, strict=True))
    arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    ranges = {n: (int(arrays[n].min()), int(arrays[n].max())) for n in ("cand_ids", "anchor") if arrays[n].size}
    # ml_dtypes' bfloat16 arrays report "bfloat16"
    dims = C.check_io({n: v.shape for n, v in arrays.items()}, {n: v.dtype.name for n, v in arrays.items()},
                      a, ranges)
    B, S, K = dims["B"], dims["S"], dims["K"]
    shapes = {"B": B, "S": S, "K": K}
    outs = tuple(np.empty([shapes[d] for d in t.dims], t.dtypes[0]) for t in C.OUTPUTS)
    ptr = {k: v.ctypes.data for k, v in arrays.items()}
    args = _Args(*[ptr[n] for n in C.input_names()], *[o.ctypes.data for o in outs],
                 B, S, K, dims["R"], dims["V"], _DTYPE_CODES[arrays["cand_logits"].dtype.name],
                 _DTYPE_CODES[arrays["gate"].dtype.name], a["output_multiplier"], a["logit_softcap"],
                 _MODE_CODES[a["mode"]])
    return args, outs, arrays


def select_path_cpu(cand_logits, cand_ids, gate, anchor, pred_codebook, succ_codebook, uniforms, temperature,
                    **attrs) -> tuple[np.ndarray, ...]:
    """The op on numpy arrays through the CPU twin, inputs in the order of torch.ops.dflash2.select_path
    -> (draft_ids [B,S], path_index [B,S], path_scores [B,S,K], confidence [B,S], draft_probs [B,S,K]).

    Float inputs: float32, float16 or bfloat16 (ml_dtypes); ids int32; uniforms [B,S] and temperature
    [B] float32 (read in mode "sample" only, but always given, as in the ONNX node). Attributes
    (top_k, rank, output_multiplier, logit_softcap, mode) as in the contract.
    """
    args, outs, _keep = _prepare((cand_logits, cand_ids, gate, anchor, pred_codebook, succ_codebook, uniforms,
                                  temperature), attrs)
    err = ctypes.create_string_buffer(512)
    if load_cpu_twin().dflash2_select_path_cpu(ctypes.byref(args), err, len(err)) != 0:
        raise PluginLibraryError(err.value.decode())
    return outs


def select_path_cuda(cand_logits, cand_ids, gate, anchor, pred_codebook, succ_codebook, uniforms, temperature,
                     timing_iters: int = 0, **attrs) -> tuple:
    """Same through the CUDA kernel (host arrays copied to the GPU and back; for tests/benchmarks).

    Returns (draft_ids, path_index, path_scores, confidence, draft_probs, microseconds per launch or None).
    """
    args, outs, _keep = _prepare((cand_logits, cand_ids, gate, anchor, pred_codebook, succ_codebook, uniforms,
                                  temperature), attrs)
    err = ctypes.create_string_buffer(512)
    us = ctypes.c_float(0.0)
    if load_plugin_library().dflash2_select_path_cuda(ctypes.byref(args), timing_iters, ctypes.byref(us),
                                                     err, len(err)) != 0:
        raise PluginLibraryError(err.value.decode())
    return (*outs, us.value if timing_iters > 0 else None)
