"""The package tree reads as the pipeline: each stage a folder, imports only toward lower stages.

Every `import dflash2...` of every module (module level or inside a function) is checked against
the stage rules below, so a stage that starts reaching sideways or upward fails here, like the
runtime's no-torch test."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "dflash2"

# Stage folders and what each may import besides the shared modules (the package's top-level modules
# and ops/, native/, models/: contracts, dtypes, folders, manifests, native libraries, the loop).
STAGES = {
    "reference": set(),  # PyTorch models of target and drafter
    "train": {"reference"},  # drafter training over the reference models
    "export": {"reference"},  # reference models -> ONNX folders
    "engines": set(),  # export folder -> TensorRT engines (never the runtime)
    "runtime": set(),  # export / engine folder -> generation (never torch)
    # measurement: benches, replay, scale check, studies over what ships; nothing that ships imports it
    "bench": {"reference", "train", "export", "engines", "runtime"},
    "cli": {"reference", "train", "export", "engines", "runtime", "bench"},  # thin front ends over everything
}
# Modules that reach a stage their rules above do not allow, each with why; nothing else may.
EXCEPTIONS = {
    ("native.bench", "reference"): "times the CPU twin against the PyTorch op (lazily: dflash2-plugins bench only)",
    ("export.api", "runtime"): "runs the written export once through the runtime's own session, as generation "
                               "binds it (lazily, its last step: row invariance, what losslessness rests on)",
}


def _stage(module: str) -> str:
    """'dflash2.runtime.trt' -> 'runtime'; shared modules -> '' (their own name for EXCEPTIONS)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else ""


def _imports(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("dflash2")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.startswith("dflash2"):
                out.add(base)
                out |= {f"{base}.{a.name}" for a in node.names if (PKG.parent / f"{base}.{a.name}".replace(".", "/")).exists()
                        or (PKG.parent / (f"{base}.{a.name}".replace(".", "/") + ".py")).exists()}
    return out


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield path, ".".join(parts)


def test_every_stage_imports_only_downward():
    bad = []
    for path, module in _modules():
        own = _stage(module)
        allowed = STAGES.get(own, set()) | {own}
        for target in _imports(path, module):
            to = _stage(target)
            if not to or to in allowed:
                continue
            short = module.split(".", 1)[-1]
            if (short, to) in EXCEPTIONS or (".".join(short.split(".")[:2]), to) in EXCEPTIONS:
                continue
            bad.append(f"{module} imports {target} ({own or 'shared'} -> {to})")
    assert not bad, "imports against the pipeline direction:\n  " + "\n  ".join(bad)


def test_the_checker_sees_violations(tmp_path):
    """The rule is real: an engines module reaching into the runtime would be reported."""
    src = tmp_path / "x.py"
    src.write_text("def f():\n    from dflash2.runtime.trt import TrtBackend\n")
    assert "dflash2.runtime.trt" in _imports(src, "dflash2.engines.x")
    assert _stage("dflash2.runtime.trt") == "runtime" and "runtime" not in STAGES["engines"]


@pytest.mark.parametrize("module, banned", [
    ("dflash2.cli.train", "dflash2.runtime"),  # the trainer's CLI needs no runtime (prompts: dflash2.prompts)
    ("dflash2.engines.compare", "dflash2.runtime"),
    ("dflash2.engines.build", "dflash2.runtime"),
    ("dflash2.cli.run", "dflash2.bench"),  # what ships runs no measurement code (the benches import it, not back)
])
def test_stage_does_not_load_another(module, banned):
    code = f"import sys, {module}; bad = sorted(m for m in sys.modules if m.startswith('{banned}')); print(bad); sys.exit(bool(bad))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
