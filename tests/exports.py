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
