"""Session-wide tiny exports shared by the export and runtime tests (each takes ~10 s)."""

from __future__ import annotations

from pathlib import Path

from dflash2.export.api import export

T = 64  # export capacity of the shared tiny engines-test export
PROMPT = [5, 17, 42, 99, 7, 250, 31, 64, 12, 300, 8]


def export_pair(root: Path, pairs: dict, family: str, version: int, **kw) -> Path:
    out = root / f"export-{family}-v{version}" / "out"
    if not (out / "manifest.json").is_file():
        drafter, target = pairs[(family, version)]
        export(drafter, target, out, quiet=True, **kw)
    return out


def edit_manifest(folder: Path, edit) -> None:
    """Change a folder's manifest.json the way a newer or buggy writer would: edit(dict) in place, then
    reseal it (a fresh manifest_sha256), so the reader's other checks are what the test sees."""
    import json

    from dflash2 import manifest as mf

    data = json.loads((folder / mf.NAME).read_text())
    edit(data)
    data["manifest_sha256"] = mf.content_sha256(data)
    (folder / mf.NAME).write_text(json.dumps(data))


def relabel_dtype(m: dict, dtype: str) -> None:
    """An edit_manifest edit: the export's dtype, and the target's KV element type with it (the manifest checks
    that they agree), so a test can reach what follows from the dtype alone (tolerances, provider refusals)."""
    m["dtype"] = dtype
    past = m["graphs"]["target"]["signature"]["kv"]["past"]
    for spec in m["graphs"]["target"]["inputs"]:
        if spec["name"] in past:
            spec["dtype"] = dtype


def low_precision_checks(pair, out: Path, dtype: str, prompt: list[int], new: int, plan: list[int],
                         max_seq_len: int = 160):
    """A float16 / bfloat16 export of a tiny pair (drafter, target) into out (kept if it is there), as users get it:
    every graph validated; both target flavours bind the KV rows in that dtype and give fp32 logits; the row check
    bitwise; speculative decoding through the graphs equal to the target's own greedy ids at every accepted count
    0..S (planned drafts: plan) and with the pair's drafter. bf16 (no bf16 kernels on the CPU provider): all of it
    on the graphs' emulation (dflash2.export.bf16_emulation), recorded as such, the loop's bf16 buffers, binding
    and rollback as a GPU would run them. Returns the manifest."""
    from contextlib import nullcontext

    import onnx

    from dflash2 import dtypes
    from dflash2.export.bf16_emulation import emulated_export
    from dflash2.runtime.api import Runtime
    from dflash2.speculative import generate
    from tests.test_qwen3_5_export import PlannedDrafts

    m = export(*pair, out, max_seq_len=max_seq_len, quiet=True, dtype=dtype) if not out.exists() else \
        Runtime(out).manifest
    graphs = {k: v for k, v in m.validation.items() if k != "target.rows"}
    assert m.dtype == dtype and all(v.ok and not v.skipped for v in graphs.values()), m.validation
    # the tiny pairs meet a fixed tolerance (their own dtype's or fp32's): the last rule is for long windows
    assert not any("judged_by_dtype_error" in r for v in graphs.values() for r in v.steps.values()
                   if isinstance(r, dict)), m.validation
    low = dtypes.onnx_type(dtype)
    for f, past in (("target.onnx", "past_kv"), ("target.trt.onnx", "kv_cache")):
        g = onnx.load(str(out / f), load_external_data=False).graph
        types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.output]}
        assert types[past] == types["new_kv"] == types["context"] == low and types["logits"] == onnx.TensorProto.FLOAT
    rows = m.validation["target.rows"]
    bf16 = dtype == "bfloat16"
    assert all(("emulated" in v.steps) == bf16 for v in m.validation.values()), m.validation
    assert not any(v.skipped for v in m.validation.values()), m.validation
    assert rows.steps["rows"] > 0 and rows.steps["differing"] == 0
    files = {g: e.flavours.portable for g, e in m.graphs.items()}
    with emulated_export(out, files) if bf16 else nullcontext(None) as emulated:
        rt = Runtime(out, emulated=emulated)
        rt.manifest.eos_token_ids = []
        truth = rt.generate(prompt, new, speculative=False).ids
        g = generate(PlannedDrafts(rt.manifest, rt.session.backend, truth, plan=plan), prompt, new)
        assert g.ids == truth and set(g.stats.accepted) >= set(range(max(plan) + 1))
        assert rt.generate(prompt, new).ids == truth  # the pair's own drafter
    assert not any(".bf16emu." in p.name for p in out.iterdir())  # the copies gone
    return m
