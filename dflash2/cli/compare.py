"""dflash2-compare: every exported graph vs its PyTorch reference with Polygraphy (ONNX Runtime, and
TensorRT engines with --engines); a per-graph, per-output table; exit code 1 on any failure."""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash2.cli import cli_main
from dflash2.errors import Dflash2Error, require_extra


@cli_main("dflash2-compare")
def main(argv: list[str] | None = None) -> int:
    require_extra("dflash2-compare", "trt", 'polygraphy')
    p = argparse.ArgumentParser(prog="dflash2-compare", description=__doc__)
    p.add_argument("folder", type=Path, help="export folder written by dflash2-export")
    p.add_argument("--engines", type=Path, help="engine folder written by dflash2-build from this export")
    p.add_argument("--atol", type=float, help="absolute tolerance (default: by export dtype)")
    p.add_argument("--rtol", type=float, help="relative tolerance (default: by export dtype)")
    p.add_argument("--graph", action="append", help="compare only this graph (repeatable)")
    a = p.parse_args(argv)
    from dflash2.engines.compare import compare

    for flag, tol in (("--atol", a.atol), ("--rtol", a.rtol)):
        if tol is not None and not 0 <= tol < float("inf"):  # inf would pass every output: no check at all
            raise Dflash2Error(f"{flag}: expected a finite tolerance >= 0, found {tol}")
    report = compare(a.folder, a.engines, a.atol, a.rtol, a.graph)
    print(report.table())
    failed = sum(not r.passed for r in report.rows)
    if not report.rows:
        print("FAILED: no comparison ran (see the notes above)")
        return 1
    print(f"{'PASSED' if report.passed else 'FAILED'}: {len(report.rows) - failed}/{len(report.rows)} comparisons")
    return 0 if report.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
