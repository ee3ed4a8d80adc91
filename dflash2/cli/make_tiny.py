"""dflash2-make-tiny: write a deterministic tiny target + drafter pair (tests, demos).

Both folders are filled in temporary siblings and renamed at the end; a failure (a full disk: one line naming the
file, dflash2.disk) or Ctrl-C leaves --out as it was: no half pair, and no --out folder this run created."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from dflash2.cli import CliError, cli_main
from dflash2.errors import Dflash2Error, require_extra
from dflash2.folders import OutputError, check_output, replace_folder, signals_held, temp_folder
from dflash2.interrupts import PLACED


MAX_SEED = 2**63 - 2
AFTER = "nothing was written (the pair is put in place only when complete)"


@cli_main("dflash2-make-tiny", AFTER)
def main(argv: list[str] | None = None) -> int:
    require_extra("dflash2-make-tiny", "export", 'torch', 'safetensors')
    from dflash2 import families, tiny
    from dflash2.disk import FULL, DiskFullError, full_code

    p = argparse.ArgumentParser(prog="dflash2-make-tiny", description=__doc__)
    p.add_argument("--out", required=True, type=Path, help="folder; writes OUT/target and OUT/drafter")
    p.add_argument("--family", choices=[f.name for f in families.FAMILIES], default="llama",
                   help="target family (dflash2.families); not exportable yet (reference and tiny checkpoints only): "
                        + (", ".join(f.name for f in families.FAMILIES if not f.exportable) or "none"))
    p.add_argument("--drafter", choices=["v1", "v2"], default="v2")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--layers", type=int, default=1, help="drafter layers")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        if not (2 <= a.block_size <= 256 and 1 <= a.layers <= 64):  # a tiny pair: small, whatever is asked
            raise Dflash2Error(f"--block-size / --layers: expected 2..256 / 1..64, found {a.block_size} / {a.layers}")
        if not 0 <= a.seed <= MAX_SEED:  # torch's generator takes a signed 64-bit seed; the drafter uses seed + 1
            raise Dflash2Error(f"--seed: expected 0..{MAX_SEED}, found {a.seed}")
        target, drafter = a.out / "target", a.out / "drafter"
        held = [n for n in ("config.json", "manifest.json") if (a.out / n).is_file()] + \
            sorted(p.name for p in a.out.glob("*.safetensors"))[:1] if a.out.is_dir() else []
        if held:  # new subfolders inside a checkpoint or an export would change that input
            raise OutputError(f"{a.out}: holds a checkpoint or an export ({held[0]}); dflash2-make-tiny writes its "
                              f"pair into a folder of its own (choose another --out)")
        for sub in (target, drafter):  # it writes into them: never over a real checkpoint
            if sub.exists() or sub.is_symlink():
                raise OutputError(f"{sub}: exists; dflash2-make-tiny writes only new folders (choose another --out)")
            check_output(sub, force=False)
        made = _first_missing(a.out)  # --out (or a parent) this run creates: removed again if the run fails
        try:  # both filled in temporary siblings and renamed at the end: a failure or Ctrl-C leaves no half pair
            with temp_folder(target) as tt, temp_folder(drafter) as td:
                try:
                    tiny.make_target(tt, family=a.family, seed=a.seed)
                    tiny.make_drafter(td, tt, version=int(a.drafter[1]), num_layers=a.layers,
                                      block_size=a.block_size, seed=a.seed + 1)
                except DiskFullError as e:  # named by the file it would have been, not the temporary one
                    for tmp, final in ((tt, target), (td, drafter)):
                        if e.path.parent == tmp:
                            e.path, e.what = final / e.path.name, f"{e.what} of the tiny {final.name}"
                    raise
                with signals_held():  # both or neither: a Ctrl-C between the renames counts after the second
                    replace_folder(tt, target, what="the tiny target")
                    try:
                        replace_folder(td, drafter, what="the tiny drafter")
                    except BaseException:
                        shutil.rmtree(target, ignore_errors=True)  # ours, renamed a moment ago: no half pair
                        PLACED.remove(target)
                        raise
        except BaseException:
            _remove_made(a.out, made)
            raise
    except DiskFullError as e:  # one line: the file, the disk, the bytes; the temporary folders are gone
        e.after = f"{AFTER}: free some space and run it again"
        raise
    except OSError as e:  # a full or read-only disk: one line; the temporary folders are gone
        raise CliError(f"{a.out}: could not write the pair ({e.strerror}); nothing was written", status=1) from None
    except Exception as e:  # a full disk met elsewhere: a library's report (the OS code in its text), or the rename
        cause = e.__context__ if isinstance(e, OutputError) else e  # into place (folders words it, keeps the OSError)
        if cause is None or full_code(cause) is None:
            raise
        raise CliError(f"{a.out}: {FULL[full_code(cause)]} while writing the pair (putting it in place); {AFTER}: "
                       "free some space and run it again", status=1) from None
    print(f"target:  {target}\ndrafter: {drafter}")
    return 0


def _first_missing(out: Path) -> Path | None:
    """The outermost of `out` and its parents that does not exist yet (None: `out` exists)."""
    made = None
    while not (out.exists() or out.is_symlink()) and out != out.parent:
        made, out = out, out.parent
    return made


def _remove_made(out: Path, made: Path | None) -> None:
    """The folders from `out` up to `made` that this run created, while they are empty (never anyone's files)."""
    if made is None:
        return
    for p in (out, *out.parents):
        try:
            p.rmdir()
        except OSError:
            return
        if p == made:
            return


if __name__ == "__main__":
    raise SystemExit(main())
