"""The window buffer's sizing rule (runtime.window.CompactingKv): here, below the stages, so that the runtime
that allocates it and dflash2-build that profiles it read one rule (engines must not import the runtime)."""

from __future__ import annotations

from dflash2.manifest.records import WindowSignature

# the most rows one step writes, beyond the block: a long prefill is cut into steps of this many rows, so a big
# window (Muse-Glimmer's 2048) costs window + 2 x 512 rows rather than a prompt's length
MAX_STEP = 512
# the buffer's base (the real position of row 0) is always a multiple of ALIGN. Why: a key's column in the window
# rows is its position - base, and ONNX Runtime's softmax sums a row's columns in SIMD lanes (8 floats with AVX2,
# 16 with AVX-512, unrolled): a k-row verify and the 1-row decodes at the same positions compact at different
# commit points, and with bases that differ by other than a multiple of the lane pattern the same keys land in
# other lanes and the sums round differently. Measured on an AVX-512 CPU (runtime.invariance's row check, 3224 rows
# of a tiny gpt-oss pair with window 100): 1487 rows differ (up to 7.6e-6) with base = pos - keep, 450 with ALIGN
# 8, none with 16 or 64. 64 (16 lanes x 4) leaves a margin for wider unrolling; it costs ALIGN - 1 buffer rows
ALIGN = 64


def window_rows(sig: WindowSignature, block_size: int) -> tuple[int, int]:
    """(step, capacity C) of a window buffer: step = the most rows one step may write (>= the block, so a verify
    always fits; >= keep + 1 up to MAX_STEP), C = keep + ALIGN - 1 + 2 x step: a compaction keeps keep .. keep +
    ALIGN - 1 rows (its base aligned down), then room for a step and slack of another (a compaction every >= step
    tokens)."""
    step = max(block_size, min(sig.keep + 1, MAX_STEP))
    return step, sig.keep + ALIGN - 1 + 2 * step
