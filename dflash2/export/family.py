"""A target family's layer templates, as the export reaches them: through the family registry (dflash2.families),
never by the family's name. The family names its builder per op set ("fused": ONNX Runtime contrib ops, gqa.py;
"plain": standard ops, portable + TensorRT flavour, plain.py); this stage imports it."""

from __future__ import annotations

from typing import Callable

from dflash2 import families
from dflash2.errors import Dflash2Error


def template(tc, op_set: str) -> Callable:
    """The graph builder of target config tc's family for op_set (families.OP_SETS)."""
    fam = families.by_name(tc.family)
    path = fam.templates.get(op_set)
    if path is None:
        have = ", ".join(sorted(fam.templates)) or "none yet"
        raise Dflash2Error(f"{tc.arch} ({fam.name}, {fam.description}): no {op_set!r} layer templates "
                           f"(op sets it has: {have})")
    return families.resolve(path)
