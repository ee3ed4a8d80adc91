"""dflash2-build: an export folder -> TensorRT engines + manifest (engine folder for dflash2-run).

Precision comes from the export: engines are strongly typed, so --precision fp16 needs a
`dflash2-export --dtype float16` folder (the default is the export's own dtype).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dflash2.cli import cli_main, print_files
from dflash2.dtypes import PRECISIONS
from dflash2.errors import Dflash2Error


def check_flags(a: argparse.Namespace) -> None:
    """Flags without effect in this combination are errors, not silently ignored."""
    if a.print_trtexec and a.manifest_only:
        raise Dflash2Error("--print-trtexec and --manifest-only: give one (print the commands, or adopt their engines)")
    mode = "--print-trtexec" if a.print_trtexec else "--manifest-only"
    unused = {"--force": a.force and (a.print_trtexec or a.manifest_only),
              "--timing-cache": a.timing_cache is not None and a.manifest_only,
              "--workspace": a.workspace is not None and a.manifest_only}
    bad = [flag for flag, hit in unused.items() if hit]
    if bad:
        raise Dflash2Error(f"{', '.join(bad)}: no effect with {mode} (nothing is built or replaced)")


@cli_main("dflash2-build")
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dflash2-build", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("export_dir", type=Path, help="export folder written by dflash2-export")
    p.add_argument("--out", required=True, type=Path, help="engine folder (written atomically)")
    p.add_argument("--precision", choices=list(PRECISIONS), help="must match the export dtype (default: it)")
    p.add_argument("--max-seq-len", type=int, help="KV capacity (default and maximum: the export's max_seq_len)")
    p.add_argument("--max-prefill", type=int, help="longest prompt in one prefill step (default: max_seq_len)")
    p.add_argument("--plugin", type=Path, help="libdflash2_plugins.so (default: $DFLASH2_PLUGIN_LIB, then "
                                               "build/plugins/)")
    p.add_argument("--timing-cache", type=Path, help="TensorRT timing cache file, loaded if present, then saved")
    p.add_argument("--workspace", type=int, metavar="MB", help="builder workspace limit in MiB")
    p.add_argument("--print-trtexec", action="store_true", help="print equivalent trtexec commands, build nothing")
    p.add_argument("--manifest-only", action="store_true",
                   help="write manifest.json for engines already in --out (built by the trtexec commands)")
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    from dflash2.engines.plan import plan_build

    mode = "print" if a.print_trtexec else "adopt" if a.manifest_only else "build"
    t0 = time.perf_counter()
    check_flags(a)
    plan = plan_build(a.export_dir, a.out, a.precision, a.max_seq_len, a.max_prefill, a.plugin, a.timing_cache,
                      a.workspace, a.force, mode=mode)
    if mode == "print":
        from dflash2.engines.trtexec import commands

        print("\n".join(commands(plan)))
        return 0
    from dflash2.engines.build import adopt, build

    m = adopt(plan) if mode == "adopt" else build(plan, a.quiet)
    took = f" in {time.perf_counter() - t0:.1f} s" if mode == "build" else ""
    print(f"engines in {a.out}{took} (TensorRT {m.tensorrt_version}, precision {m.precision}, "
          f"max_seq_len {m.max_seq_len}, max_prefill {m.max_prefill})")
    if m.quantization:  # strongly typed: the Q/DQ graph's int4 / fp8 / int8 types come from the export
        from dflash2.quant_manifest import describe

        print(describe(m))
    print_files(m.files)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
