"""dflash2-make-tiny: write a deterministic tiny target + drafter pair (tests, demos)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dflash2.errors import Dflash2Error, require_extra
from dflash2.folders import OutputError, check_output
from dflash2.interrupts import interruptible


@interruptible("dflash2-make-tiny", "OUT may hold a partial pair; rerun the command to rewrite it")
def main(argv: list[str] | None = None) -> int:
    require_extra("dflash2-make-tiny", "export", 'torch', 'safetensors')
    from dflash2 import tiny

    p = argparse.ArgumentParser(prog="dflash2-make-tiny", description=__doc__)
    p.add_argument("--out", required=True, type=Path, help="folder; writes OUT/target and OUT/drafter")
    p.add_argument("--family", choices=["llama", "qwen3"], default="llama")
    p.add_argument("--drafter", choices=["v1", "v2"], default="v2")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--layers", type=int, default=1, help="drafter layers")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        if a.block_size < 2 or a.layers < 1:
            raise Dflash2Error(f"--block-size / --layers: expected >= 2 / >= 1, found {a.block_size} / {a.layers}")
        for sub in (a.out / "target", a.out / "drafter"):  # it writes into them: never over a real checkpoint
            if sub.exists():
                raise OutputError(f"{sub}: exists; dflash2-make-tiny writes only new folders (choose another --out)")
            check_output(sub, force=False)
        target = tiny.make_target(a.out / "target", family=a.family, seed=a.seed)
        drafter = tiny.make_drafter(a.out / "drafter", target, version=int(a.drafter[1]), num_layers=a.layers,
                                    block_size=a.block_size, seed=a.seed + 1)
    except Dflash2Error as e:
        print(f"dflash2-make-tiny: error: {e}", file=sys.stderr)
        return 2
    print(f"target:  {target}\ndrafter: {drafter}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
