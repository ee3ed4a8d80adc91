"""dflash2-plugins: the DFlash2Selector native libraries: where they are (find), the CPU twin vs the
PyTorch reference (bench), the CUDA kernel vs the CPU twin (gpu), the whole device check on a GPU without
TensorRT (device: dflash2/bench/device/)."""

from __future__ import annotations

import argparse
import json
import sys

from dflash2.cli import cli_main
from dflash2.native.library import CPU_LIB, PLUGIN_LIB, PluginLibraryError, find_library


def _gpu() -> int:
    from dflash2.native.gpu_check import gpu_check

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


def _bench(batches: tuple[int, ...], vocab: int, reference: bool) -> int:
    from dflash2.native.bench import bench

    try:
        rows = bench(batches, V=vocab, reference=reference)
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


@cli_main("dflash2-plugins")
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dflash2-plugins", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="CPU twin vs PyTorch reference, microseconds per call")
    b.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    b.add_argument("--vocab", type=int, default=151936)
    b.add_argument("--no-reference", action="store_true", help="skip the PyTorch reference (no torch needed)")
    sub.add_parser("find", help="print the library paths that would be loaded")
    sub.add_parser("gpu", help="kernel vs CPU twin + kernel microseconds (needs a GPU, not torch)")
    sub.add_parser("device", add_help=False,
                   help="the device check on a GPU without TensorRT (kernel-only build, kernel vs twin, CUDA "
                        "graphs, references, trainer); its options: dflash2-plugins device --help")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["device"]:
        from dflash2.bench.device.main import main as device_main
        return device_main(argv[1:])
    args = ap.parse_args(argv)
    if args.cmd == "gpu":
        return _gpu()
    if args.cmd == "find":
        for name in (PLUGIN_LIB, CPU_LIB):
            try:
                print(f"{name}: {find_library(name)}")
            except PluginLibraryError as e:
                print(e)
        return 0
    return _bench(tuple(args.batch), args.vocab, not args.no_reference)


if __name__ == "__main__":
    sys.exit(main())
