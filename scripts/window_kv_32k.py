"""Issue 48's long run: a 32k-token generation on a tiny windowed target whose sliding layers' KV stays at the window.

dflash2-make-tiny's Muse-Glimmer pair (3 sliding layers of window 8, 1 NoPE full layer, hidden 64) with a DFlash2
drafter of block 8, exported by dflash2-export (which writes the windowed target for it: --window-kv on, the
default), generated greedily and speculatively by the runtime (tests/window_kv_pair.py's session) for
--tokens tokens. Prints, at 1k / 8k / 32k tokens, the KV bytes in use: the window buffer (allocated once, its
capacity), the full layer's rows, the drafter's context rows, and what the sliding layers would hold without the
window buffer, and the process's resident memory; then compares speculative decoding (the pair's drafter) with
target-only greedy over the first --spec-check tokens. Two steps, so that the run's peak RSS (/usr/bin/time -v) is the
runtime's (no torch: the export imports it):

    PYTHONPATH=. python scripts/window_kv_32k.py --dir /tmp/wkv --prepare
    OMP_NUM_THREADS=1 PYTHONPATH=. /usr/bin/time -v python scripts/window_kv_32k.py --dir /tmp/wkv --tokens 32768
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.window_kv_pair

PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99, 5, 6, 7, 19, 23, 29, 31, 37, 41, 43, 47]
MARKS = (1024, 8192, 32768)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True, help="where the pair, its export and the windowed graph live")
    ap.add_argument("--prepare", action="store_true", help="make the pair and export it (the windowed target)")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--speculative", action="store_true", help="the long run speculative (default target-only)")
    ap.add_argument("--spec-check", type=int, default=2048,
                    help="tokens over which speculative and target-only ids are compared")
    args = ap.parse_args()

    root = args.dir
    if args.prepare:
        return prepare(root)
    from dflash2.speculative import generate
    from tests.window_kv_pair import windowed_session

    assert "torch" not in sys.modules  # the run measures the runtime alone
    T = len(PROMPT) + args.tokens + 64
    s = windowed_session(root / "out", max_seq_len=T)
    sig = s.target_sig
    s.manifest.eos_token_ids = []
    w, kv, ctx = s.window, s.target_kv.buffer, s.drafter_kv.buffer
    print(f"window layers {sig.window.layers} (keep {sig.window.keep}), buffer {w.buffer.shape} = "
          f"{w.buffer.nbytes} bytes; full-layer KV buffer {kv.shape}; session buffers "
          f"{s.buffer_bytes / 2**20:.1f} MiB (max_seq_len {T})")

    marks = [m for m in MARKS if m <= args.tokens] or [args.tokens]
    seen, rows = [0], []

    def on_tokens(new: list[int]) -> bool:
        before, seen[0] = seen[0], seen[0] + len(new)
        for m in marks:
            if before < m <= seen[0]:
                pos = s.pos
                rows.append((m, pos, pos - w.base, w.high))
                print(f"{m:>6} tokens: window rows in use {pos - w.base:>3} of {w.capacity} "
                      f"({w.buffer.nbytes} bytes, high {w.high}, {w.compactions} compactions); "
                      f"full-layer KV {pos * kv.row_bytes} bytes; drafter context KV {s.ctx_pos * ctx.row_bytes} "
                      f"bytes; the sliding layers without the window buffer: {pos * w.buffer.row_bytes} bytes; "
                      f"RSS {rss_kib()} KiB", flush=True)
        return False

    # the long run target-only (a 1-row decode a token; the random tiny drafter accepts nothing, so its rounds would
    # only add a drafter call over the whole context per token); speculative decoding is checked on its first ids
    t0 = time.perf_counter()
    g = generate(s, PROMPT, args.tokens, on_tokens=on_tokens, speculative=args.speculative)
    dt = time.perf_counter() - t0
    print(f"{'speculative' if args.speculative else 'target-only'}: {len(g.ids)} tokens in {dt:.1f} s, window high "
          f"{w.high} <= capacity {w.capacity}, {w.compactions} compactions")
    assert w.high <= w.capacity and w.buffer.shape[0] == w.capacity
    n = min(args.spec_check, args.tokens)
    other = windowed_session(root / "out", max_seq_len=T)
    other.manifest.eos_token_ids = []
    same = generate(other, PROMPT, n, speculative=not args.speculative).ids == g.ids[:n]
    print(f"speculative ids == target-only greedy over the first {n}: {same} ({other.window.compactions} "
          f"compactions in that run)")
    if not same:
        raise SystemExit(1)


def prepare(root: Path) -> None:
    from dflash2 import tiny
    from dflash2.export.api import export

    target = tiny.make_target(root / "target", family="muse_glimmer")
    drafter = tiny.make_drafter(root / "drafter", target, version=2, block_size=8)
    m = export(drafter, target, root / "out", max_seq_len=160, quiet=True)
    assert m.graphs["target"].signature.window is not None  # the windowed target: dflash2-export's default here
    print(f"prepared {root}")


def rss_kib() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))


if __name__ == "__main__":
    main()
