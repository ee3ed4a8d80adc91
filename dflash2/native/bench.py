"""The DFlash2Selector CPU twin against the PyTorch reference: microseconds per call at production
sizes, and the random op inputs the tests and the GPU check share.

`dflash2-plugins bench` runs it; torch is imported by the reference timing only (importing this
module needs no torch).
"""

from __future__ import annotations

import time

import numpy as np

from dflash2.native.selector import select_path_cpu


def random_inputs(B: int, S: int, K: int, R: int, V: int, codebook_dtype: str = "float32",
                  logits_dtype: str = "float32", seed: int = 0, temperature: float = 1.0) -> dict[str, np.ndarray]:
    """Random op inputs (ids distinct per row, like top-K) as numpy arrays in the given dtypes;
    uniforms in [0, 1), every batch row at `temperature` (both read by mode "sample" only)."""
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
            "pred_codebook": floats((V, R), codebook_dtype), "succ_codebook": floats((V, R), codebook_dtype),
            "uniforms": rng.random((B, S), dtype=np.float32), "temperature": np.full(B, temperature, np.float32)}


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
