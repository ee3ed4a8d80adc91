"""A session over a dflash2-export folder's own graphs with a test's session class or target signature: the windowed
target is what dflash2-export writes for a target with sliding and full layers (export/window_spec.py), so the
tests and scripts/window_kv_32k.py open its files; `unbounded` exports the same pair with --window-kv off (every
layer on the max_seq_len-row KV) to compare against."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from dflash2 import manifest as mf
from dflash2.runtime.ort import OrtBackend
from dflash2.runtime.session import SpecSession


def windowed_session(out: Path, sig: mf.Signature | None = None, cls=SpecSession, max_seq_len: int | None = None,
                     fixed: bool = False, **kw) -> SpecSession:
    """cls over the export's target (its fixed flavour, target.trt.onnx, where `fixed`) and drafter on ONNX Runtime.
    sig: the target signature to bind (None: the manifest's; a test's edited one to show a check can fail);
    max_seq_len may exceed the export's (the window buffer does not grow with it)."""
    m = mf.load(out, mf.ExportManifest, check_files=False)
    if max_seq_len is not None:
        m = dataclasses.replace(m, max_seq_len=max_seq_len)
    g = m.graphs["target"]
    if sig is None:
        sig = g.tensorrt_signature if fixed else g.signature
    graphs = {"target": g.flavours.tensorrt if fixed else g.flavours.portable,
              "drafter": m.graphs["drafter"].flavours.portable}
    backend = OrtBackend(out, graphs, {"target": sig, "drafter": m.signature("drafter")}, threads=1)
    return cls(m, backend, **kw)


def export_pair(drafter: Path, target: Path, out: Path, window_kv: bool = True, **kw) -> mf.ExportManifest:
    """dflash2-export of the pair (the windowed target by default; window_kv=False: every layer unbounded)."""
    from dflash2.export.api import export

    return export(drafter, target, out, quiet=True, window_kv=window_kv, **kw)
