"""Comparison tolerances per graph dtype, shared by export validation and dflash2-compare."""

TOLERANCES = {"float32": (1e-4, 1e-3), "float16": (5e-2, 2e-2), "bfloat16": (2e-1, 5e-2)}  # (atol, rtol)
# Share of id entries allowed to differ. fp32: none. In fp16/bf16 the LM-head output is rounded to
# 16 bits before the fp32 top-K, so near-equal candidates can swap order between backends.
ID_MISMATCH_SHARE = {"float32": 0.0, "float16": 0.05, "bfloat16": 0.1}
