"""The CUDA kernel against the CPU twin (bit-identical with softcap 0; confidence and draft_probs to a
few ulp, the device exp differs) on odd and production shapes, in both modes (sample at T = 0.7),
plus kernel microseconds per launch: `dflash2-plugins gpu`. Needs a GPU, not torch."""

from __future__ import annotations

import numpy as np

from dflash2.native.bench import random_inputs
from dflash2.native.selector import PluginLibraryError, cuda_device_count, select_path_cpu, select_path_cuda
from dflash2.ops import contract as C


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
            for mode in C.MODES:
                x = random_inputs(B, S, K, R, Vs, codebook_dtype=dt, logits_dtype=dt, seed=B + S + K + R,
                                  temperature=0.7)
                cpu = select_path_cpu(**x, top_k=K, rank=R, mode=mode)
                gpu = select_path_cuda(**x, top_k=K, rank=R, mode=mode)[:len(C.OUTPUTS)]
                checked += 1
                for name, a, b in zip(C.output_names(), gpu, cpu):
                    close = name in ("confidence", "draft_probs")
                    same = np.allclose(a, b, rtol=1e-6, atol=1e-12) if close else np.array_equal(a, b)
                    if not same:
                        mismatches.append(f"{dt} {mode} B={B} S={S} K={K} R={R}: {name} differs at "
                                          f"{np.argwhere(a != b)[:3].tolist()}")
    timings = []
    dt = "bfloat16" if _has_bf16() else "float16"
    for mode in C.MODES:
        for B in (1, 8):
            x = random_inputs(B, 7, 16, 256, V, codebook_dtype=dt)
            us = select_path_cuda(**x, top_k=16, rank=256, mode=mode, timing_iters=iters)[-1]
            timings.append({"mode": mode, "batch": B, "S": 7, "K": 16, "R": 256, "V": V, "codebook_dtype": dt,
                            "kernel_us": us})
    return {"cases_checked": checked, "mismatches": mismatches, "timings": timings}
