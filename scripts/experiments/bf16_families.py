"""Every target family's tiny pair exported in bf16 and checked on its graphs' emulation (export.bf16_emulation):

    python scripts/experiments/bf16_families.py --json docs/results/low_precision/bf16_families_tiny.json

Per family (a 4-layer tiny target from dflash2.tiny, a DFlash2 drafter of block 8): the export's validation and its
row check (both on the emulation: ONNX Runtime's CPU provider has no bf16 kernels), then 40 tokens greedy, speculative
against target-only, through `Runtime(emulated=...)`. One table and the JSON; the tests check the same per family
with planned drafts at every accepted count (tests/exports.low_precision_checks).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from dflash2 import families, tiny
from dflash2.export.api import export
from dflash2.export.bf16_emulation import emulated_export
from dflash2.runtime.api import Runtime

PROMPT = [5, 9, 33, 17, 2, 81, 40]


def check(root: Path, family: str) -> dict:
    target = tiny.make_target(root / "target", family=family, num_layers=4)
    drafter = tiny.make_drafter(root / "drafter", target, version=2, block_size=8)
    t0 = time.perf_counter()
    m = export(drafter, target, root / "bf16", max_seq_len=160, quiet=True, dtype="bfloat16")
    rows = m.validation["target.rows"]
    with emulated_export(root / "bf16", {g: e.flavours.portable for g, e in m.graphs.items()}) as emulated:
        rt = Runtime(root / "bf16", emulated=emulated)
        rt.manifest.eos_token_ids = []
        truth = rt.generate(PROMPT, 40, speculative=False).ids
        spec = rt.generate(PROMPT, 40)
    return {"validated": all(v.ok for k, v in m.validation.items() if k != "target.rows"),
            "emulated": all("emulated" in v.steps for v in m.validation.values()),
            "rows": rows.steps.get("rows"), "differing": rows.steps.get("differing"),
            "speculative_equals_target_only": spec.ids == truth, "accepted_mean": sum(spec.stats.accepted) /
            max(1, len(spec.stats.accepted)), "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    out = {}
    print(f"{'family':14} {'validated':>9} {'rows':>5} {'differing':>9} {'spec = AR':>9} {'s':>6}")
    for f in families.FAMILIES:
        with tempfile.TemporaryDirectory() as d:
            r = out[f.name] = check(Path(d), f.name)
        print(f"{f.name:14} {str(r['validated']):>9} {r['rows']:>5} {r['differing']:>9} "
              f"{str(r['speculative_equals_target_only']):>9} {r['seconds']:>6}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
