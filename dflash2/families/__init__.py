"""Target families: one module each, registered here (torch-free; the runtime may import it).

`dense.py` (Llama, Qwen3), `qwen3_5.py` (Qwen3.5 / 3.6 / 3.8 dense hybrid Gated DeltaNet), `qwen3_moe.py` and
`qwen3_5_moe.py` (their mixture-of-experts variants), `muse_glimmer.py` (Muse-Glimmer's text path:
sliding-window / NoPE gated attention) and `gpt_oss.py` (gpt-oss: sliding windows, sinks, MoE, MXFP4);
reference only. A family's config reader, state kinds, tap points and
tiny-checkpoint config live in its module; its PyTorch reference and its ONNX layer templates are named there by
import path and live in the stages that own them (dflash2/reference/, dflash2/export/). Adding a family: write its module, add it to FAMILIES (docs/architecture.md, "Target families").
"""

from __future__ import annotations

from dflash2.families.base import OP_SETS, STATE_KINDS, StateKind, TargetFamily, TinyShape, resolve
from dflash2.families.dense import LLAMA, QWEN3
from dflash2.families.gpt_oss import GPT_OSS
from dflash2.families.muse_glimmer import MUSE_GLIMMER
from dflash2.families.qwen3_5 import QWEN3_5
from dflash2.families.qwen3_5_moe import QWEN3_5_MOE
from dflash2.families.qwen3_moe import QWEN3_MOE

FAMILIES: tuple[TargetFamily, ...] = (LLAMA, QWEN3, QWEN3_5, QWEN3_MOE, QWEN3_5_MOE, MUSE_GLIMMER, GPT_OSS)
# the families of dflash2.reference.target (Target / StreamedTarget) and the dense graph builders (gqa.py,
# plain.py): one KV state kind, attention layers; Qwen3-MoE is Qwen3 with a per-layer MLP (dflash2.reference.moe)
DENSE = (LLAMA.name, QWEN3.name, QWEN3_MOE.name)

__all__ = ["DENSE", "FAMILIES", "OP_SETS", "STATE_KINDS", "StateKind", "TargetFamily", "TinyShape", "by_arch", "by_name",
           "claim", "exportable_archs", "load", "resolve"]


def by_arch(arch: str) -> TargetFamily | None:
    """The family that claims a Hugging Face architecture name (None: no family does)."""
    return next((f for f in FAMILIES if arch in f.archs), None)


def by_name(name: str) -> TargetFamily:
    for f in FAMILIES:
        if f.name == name:
            return f
    raise KeyError(f"unknown target family {name!r}; known: {', '.join(f.name for f in FAMILIES)}")


def exportable_archs() -> tuple[str, ...]:
    return tuple(a for f in FAMILIES if f.exportable for a in f.archs)


def claim(path, raw: dict, supported: list[str]) -> tuple[TargetFamily, str]:
    """(the family claiming config.json's `architectures`, the architecture); refused in one line naming
    `supported` when no family claims it."""
    from dflash2.errors import CheckpointError

    archs = raw.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
        raise CheckpointError(path, "architectures", "a list with one architecture name", repr(archs))
    fam = by_arch(archs[0])
    if fam is None:
        raise CheckpointError(path, "architectures", f"one of {supported}", repr(archs[0]), "unsupported architecture")
    return fam, archs[0]


def load(folder) -> tuple[TargetFamily, object]:
    """(family, its config) of a target folder, any registered family (the reference and tiny checkpoints read
    every family; the export and the trainer read config.load_target_config, which refuses one not exportable)."""
    from dflash2.config import read_config

    path, raw = read_config(folder)
    fam, arch = claim(path, raw, sorted(a for f in FAMILIES for a in f.archs))
    return fam, fam.read_config(path, raw, arch)
