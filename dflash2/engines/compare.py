"""Polygraphy comparisons of every exported graph against its PyTorch reference.

For each graph of an export folder: the feeds saved at export (`<name>.inputs.json`) go through
Polygraphy's OnnxrtRunner on the portable flavour and, given an engine folder, through TrtRunner
on the built engine; each runner's outputs are compared with the saved PyTorch outputs
(`<name>.reference.json`, a RunResults) by the export validation's rule (`dflash2.numerics`:
|got - want| <= atol + rtol*|want| per element, ids by the share that differ). `polygraphy run X.onnx
--onnxrt --load-inputs X.inputs.json --load-outputs X.reference.json` replays the runs from the
shell with Polygraphy's own rule (an element fails only where both differences exceed: slightly stricter).

The TensorRT runner uses the engine's first optimization profile (for the target: prefill, which
covers every saved feed); the decode profile is exercised end to end by dflash2-run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dflash2 import manifest as mf
from dflash2.errors import Dflash2Error
from dflash2.onnxrt import open_session

from dflash2.numerics import ID_MISMATCH_SHARE, TOLERANCES, compare_floats, ids_within

REFERENCE = "pytorch"


@dataclass
class Row:
    graph: str
    pair: str
    output: str
    max_abs: float | None
    max_rel: float | None
    passed: bool
    note: str = ""


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.passed for r in self.rows)

    def table(self) -> str:
        head = f"{'graph':<10}{'runners':<22}{'output':<14}{'max abs':>11}{'max rel':>11}  result"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            num = lambda x: "-" if x is None else f"{x:.3g}"  # noqa: E731
            lines.append(f"{r.graph:<10}{r.pair:<22}{r.output:<14}{num(r.max_abs):>11}{num(r.max_rel):>11}  "
                         f"{'PASS' if r.passed else 'FAIL'}{'  ' + r.note if r.note else ''}")
        return "\n".join(lines + self.notes)


def _quiet_polygraphy() -> None:
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.CRITICAL  # our table replaces its per-iteration [E] lines


def onnxrt_runner(path: Path):
    """OnnxrtRunner with our own session factory: Polygraphy's SessionFromOnnx would go through its
    ONNX loader, which is not needed here; ORT resolves external data and inlines local functions."""
    from polygraphy.backend.onnxrt import OnnxrtRunner

    return OnnxrtRunner(lambda: open_session(path), name="onnxrt")


def trt_runner(engine_path: Path, plugin: Path | None):
    """TrtRunner over a built engine; the plugin library is loaded before deserializing."""
    from polygraphy.backend.common import BytesFromPath
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

    from dflash2.native.tensorrt import load_plugin, require_tensorrt

    trt = require_tensorrt()
    if plugin is not None:
        load_plugin(trt, plugin)
    return TrtRunner(EngineFromBytes(BytesFromPath(str(engine_path))), name="tensorrt")


def _id_outputs(reference) -> set[str]:
    if not reference:
        return set()
    return {n for n, v in reference[0].items() if np.issubdtype(np.asarray(v).dtype, np.integer)}


def _summarize(graph: str, ran, reference, atol: float, rtol: float, report: Report, judged: bool = True) -> None:
    """Float outputs, dflash2.numerics' rule: max abs/rel per runner over the feeds, pass only if every feed did.
    judged=False (a quantized graph): the deviation is reported, only a missing output fails."""
    ids = _id_outputs(reference)
    expected = [n for n in (reference[0].keys() if reference else []) if n not in ids]
    for runner, iters in ran.items():
        for name in expected:
            got = [it[name] for it in iters if name in it.keys()]
            if len(got) < len(reference) or any(np.shape(g) != np.shape(ref[name]) for g, ref in zip(got, reference)):
                report.rows.append(Row(graph, f"{REFERENCE} vs {runner}", name, None, None, False,
                                       "output missing or of another shape"))
                continue
            diffs = [compare_floats(g, ref[name], atol, rtol) for g, ref in zip(got, reference)]
            bad = [i for i, d in enumerate(diffs) if not d.ok]
            note = f"feed(s) {bad} of {len(diffs)} out of tolerance" if bad else ""
            report.rows.append(Row(graph, f"{REFERENCE} vs {runner}", name, max(d.max_abs for d in diffs),
                                   max(d.max_rel for d in diffs), not bad or not judged,
                                   note if judged else "quantized: deviation, not judged"))


def _summarize_ids(graph: str, ran, reference, share: float, report: Report, judged: bool = True) -> None:
    """Id outputs: the share of entries that differ, allowed up to `share` (the export validation's rule:
    in fp16/bf16 near-equal candidates may swap)."""
    for name in sorted(_id_outputs(reference)):
        for runner, iters in ran.items():
            got = [np.asarray(it[name]) for it in iters if name in it.keys()]
            want = [np.asarray(ref[name]) for ref in reference]
            if len(got) < len(want) or any(g.shape != w.shape for g, w in zip(got, want)):
                report.rows.append(Row(graph, f"{REFERENCE} vs {runner}", name, None, None, False,
                                       "output missing or of another shape"))
                continue
            bad, total = sum(int((g != w).sum()) for g, w in zip(got, want)), sum(w.size for w in want)
            ok = ids_within(bad, total, share)  # an id's numeric distance means nothing: no max abs/rel
            if not judged:
                report.rows.append(Row(graph, f"{REFERENCE} vs {runner}", name, None, None, True,
                                       f"quantized: {100 * (1 - bad / total):.1f}% of {total} ids agree, not judged"))
                continue
            report.rows.append(Row(graph, f"{REFERENCE} vs {runner}", name, None, None, ok,
                                   "" if ok and not bad else f"{bad}/{total} ids differ (allowed {share:.0%})"))


def compare_graph(export_dir: Path, graph: str, runners: list, atol: float, rtol: float,
                  report: Report, id_share: float = 0.0, judged: bool = True, files: str | None = None,
                  rows: dict[str, int] | None = None) -> None:
    """files: the saved feeds / references to replay (default the graph's; `<graph>.trt` for the
    fixed-shape TensorRT flavour, whose inputs differ); rows: inputs whose axis 0 is padded to this
    many rows (a fixed-shape engine's whole KV buffer; the padding is past `past_len`, masked)."""
    from polygraphy.comparator import Comparator, RunResults
    from polygraphy.exception import PolygraphyException
    from polygraphy.json import load_json

    files = files or graph
    inputs_path, ref_path = export_dir / f"{files}.inputs.json", export_dir / f"{files}.reference.json"
    for p in (inputs_path, ref_path):
        if not p.is_file():
            raise mf.ManifestError(p, ["expected the Polygraphy file dflash2-export saves, found none"])
    feeds = load_json(str(inputs_path))
    for name, n in (rows or {}).items():
        for feed in feeds:
            a = feed[name]
            feed[name] = np.concatenate([a, np.zeros((n - a.shape[0], *a.shape[1:]), a.dtype)])
    reference = RunResults.load(str(ref_path))
    if REFERENCE not in reference.keys():
        raise mf.ManifestError(ref_path, [f"expected runner {REFERENCE!r}, found {list(reference.keys())}"])
    ref_iters = reference[REFERENCE]
    if len(ref_iters) != len(feeds):
        raise mf.ManifestError(ref_path, [f"expected {len(feeds)} reference iterations (one per saved feed), "
                                          f"found {len(ref_iters)}"])
    try:
        ran = Comparator.run(runners, data_loader=feeds, warm_up=0)
    except PolygraphyException as e:
        report.rows.append(Row(graph, "run", "-", None, None, False, f"inference failed: {e}"))
        return
    _summarize(graph, ran, ref_iters, atol, rtol, report, judged)
    _summarize_ids(graph, ran, ref_iters, id_share, report, judged)


def compare(export_dir: str | Path, engines_dir: str | Path | None = None, atol: float | None = None,
            rtol: float | None = None, graphs: list[str] | None = None) -> Report:
    """Compare every graph (or `graphs`) of an export folder; returns the per-output report."""
    _quiet_polygraphy()
    export_dir = Path(export_dir)
    export = mf.load(export_dir, mf.ExportManifest)  # sizes and sha256 too, as dflash2-run checks them
    dtype = export.dtype
    d_atol, d_rtol = TOLERANCES.get(dtype, TOLERANCES["float32"])
    atol, rtol = (d_atol if atol is None else atol), (d_rtol if rtol is None else rtol)
    report = Report(notes=[f"tolerances: atol {atol}, rtol {rtol}, ids differing <= "
                           f"{ID_MISMATCH_SHARE.get(dtype, 0.0):.0%} (export dtype {dtype})"])
    quantized = set(export.quantization.graphs) if export.quantization else set()
    if quantized:
        from dflash2.quant_manifest import describe

        report.notes.append(f"{describe(export)}: those graphs' deviation from the fp32 PyTorch reference is "
                            f"reported, not judged (lossless is defined against the quantized target)")
    unknown = sorted(set(graphs or []) - set(export.graphs))
    if unknown:
        raise Dflash2Error(f"--graph: expected names from {sorted(export.graphs)}, found {unknown}")
    engines, plugin, trt_skip = None, None, None
    if engines_dir is not None:
        from dflash2.native.library import recorded_library
        from dflash2.native.tensorrt import require_tensorrt

        engines = mf.load(engines_dir, mf.EngineManifest)
        if Path(engines.export_dir).resolve() != export_dir.resolve():
            report.notes.append(f"note: {engines_dir} was built from {engines.export_dir}, not {export_dir}")
        if engines.plugin is not None:  # the recorded library, else this machine's build
            plugin = recorded_library(engines.plugin.path, engines.plugin.sha256)
        try:
            require_tensorrt()
        except Dflash2Error as e:
            trt_skip = f"TensorRT comparisons skipped: {e}"
        if trt_skip is None and dtype == "bfloat16":
            trt_skip = ("TensorRT comparisons skipped for a bfloat16 export: the saved feeds are float32 (numpy has "
                        "no bfloat16); dflash2-run's spec vs --no-spec ids check the engines instead")
        if trt_skip:
            report.notes.append(trt_skip)
    for graph, g in export.graphs.items():
        if graphs and graph not in graphs:
            continue
        share, judged = ID_MISMATCH_SHARE.get(dtype, 0.0), graph not in quantized
        if dtype == "bfloat16":
            report.notes.append(f"{graph}: onnxrt skipped (ONNX Runtime's CPU provider has no bfloat16 kernels)")
        else:
            compare_graph(export_dir, graph, [onnxrt_runner(export_dir / g.flavours.portable)], atol, rtol, report,
                          share, judged)
        if engines is not None and trt_skip is None:
            if graph in engines.engines:  # the engine was built from the TensorRT flavour: its own feeds
                fixed = g.tensorrt_io is not None
                kv = export.signature(graph, tensorrt=True).kv  # a fixed binding's cache is the engine's whole buffer
                cache = {n: engines.max_seq_len for n in kv.past} if kv is not None and kv.kind == "fixed" else {}
                compare_graph(export_dir, graph, [trt_runner(Path(engines_dir) / engines.engines[graph].file, plugin)],
                              atol, rtol, report, share, judged, files=f"{graph}.trt" if fixed else None, rows=cache)
            else:
                report.notes.append(f"{graph}: no engine in {engines_dir}")
    return report
