"""dflash2-demo: the reference greedy speculative decode on a built-in tiny model pair.

Interim main job until the export and runtime stages exist: makes a deterministic tiny
Llama target + DFlash2 drafter, decodes with and without speculation in PyTorch, checks they
are identical and prints acceptance and speed.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from dflash2 import tiny
from dflash2.reference.backend import TorchBackend
from dflash2.reference.load import load_pair
from dflash2.speculative import generate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dflash2-demo", description=__doc__)
    p.add_argument("--max-new-tokens", type=int, default=64)
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        drafter_dir, target_dir = tiny.make_pair(Path(tmp), family="llama", version=2)
        target, drafter = load_pair(drafter_dir, target_dir)
        prompt = [3, 14, 15, 92, 65, 35]
        spec = generate(TorchBackend(target, drafter, 512), prompt, a.max_new_tokens)
        base = generate(TorchBackend(target, drafter, 512), prompt, a.max_new_tokens, speculative=False)
    s = spec.stats
    print(f"tokens: {s.new_tokens}  rounds: {s.rounds}  acceptance length: {s.acceptance_length:.2f}")
    print(f"speculative: {s.tokens_per_second:.1f} tok/s   autoregressive: {base.stats.tokens_per_second:.1f} tok/s")
    print(f"identical to target-only greedy: {spec.ids == base.ids}")
    return 0 if spec.ids == base.ids else 1


if __name__ == "__main__":
    raise SystemExit(main())
