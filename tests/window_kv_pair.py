"""A windowed target beside a dflash2-export folder: the same family templates built with `window_kv=True` (the
sliding layers' K|V in their own bounded buffer) in a folder beside the export, its signature with the window
binding, and a SpecSession over it and the export's own drafter graph. dflash2-export does not write the windowed flavour yet (its validation and row
check feed one `past_kv`), so the tests and scripts/window_kv_32k.py build it here from the same checkpoints."""

from __future__ import annotations

from pathlib import Path

import onnx

from dflash2 import manifest as mf
from dflash2.runtime.ort import OrtBackend
from dflash2.runtime.session import SpecSession

WINDOW_FILE = {"prefix": "target_window.onnx", "fixed": "target_window_fixed.onnx"}  # per KV kind


def window_file(out: Path, kind: str = "prefix") -> Path:
    """Beside the export folder, not in it: the runtime refuses a file its manifest does not list."""
    return out.parent / f"{out.name}.window" / WINDOW_FILE[kind]


def _io_names(model: onnx.ModelProto) -> tuple[list[str], list[str]]:
    return [v.name for v in model.graph.input], [v.name for v in model.graph.output]


def build_windowed(out: Path, target_dir: Path, drafter_dir: Path, family: str, fixed: bool = False) -> mf.Signature:
    """Writes window_file(out) (the portable flavour, or the fixed one) and returns its signature."""
    import importlib

    from dflash2.export import signature as sg  # the export side imports torch; windowed_session does not
    from dflash2.export.plain import kv_layout
    from dflash2.export.weights import ModuleWeights
    from dflash2.reference.load import load_drafter

    m = mf.load(out, mf.ExportManifest, check_files=False)
    ref_mod = importlib.import_module(f"dflash2.reference.{family}")
    ref = ref_mod.load_target(target_dir, tuple(m.tap_ids))
    drafter = load_drafter(drafter_dir, ref)
    builder = importlib.import_module(f"dflash2.export.{family}")
    graphs = builder.build(ref.config, drafter.config, ModuleWeights(ref), ModuleWeights(drafter),
                           fuse_context=m.context.fused, window_kv=True)
    model = graphs[1 if fixed else 0]
    kind = "fixed" if fixed else "prefix"
    window_file(out).parent.mkdir(exist_ok=True)
    onnx.save(model, window_file(out, kind))
    layout = kv_layout(ref.config.layer_windows, True, family)
    return sg.signature("target", kind, *_io_names(model),
                        window=(list(layout.windowed), layout.keep))


def windowed_session(out: Path, sig: mf.Signature, cls=SpecSession, max_seq_len: int | None = None,
                     **kw) -> SpecSession:
    """A session over window_file(out) and the export's drafter (max_seq_len may exceed the export's)."""
    import dataclasses

    m = mf.load(out, mf.ExportManifest, check_files=False)
    if max_seq_len is not None:
        m = dataclasses.replace(m, max_seq_len=max_seq_len)
    graphs = {"target": f"../{out.name}.window/{WINDOW_FILE[sig.kv.kind]}",
              "drafter": m.graphs["drafter"].flavours.portable}
    backend = OrtBackend(out, graphs,
                         {"target": sig, "drafter": m.signature("drafter")}, threads=1)
    return cls(m, backend, **kw)
