"""Each weight once in an export folder: graphs that carry the same bytes read one copy.

The drafter graphs carry the target's embedding and LM head (the drafter embeds its block with the
target's table and scores with the target's head), the selector graph the drafter's codebooks, and a
quantized drafter the same int4 head as the quantized target. After every graph is written and
validated, `share()` points each external initializer whose bytes (dtype and sha256 of the data)
are already stored by a graph written earlier at that copy (onnxruntime-genai shares one
`.onnx.data` between its graphs the same way; ONNX Runtime and TensorRT's parser resolve each tensor's
`location` relative to the graph file), then rewrites each data file with only the bytes some graph
still reads, and deletes a data file nothing reads. Memory: 64 MB of a tensor at a time (hashed
with pread). Outputs are bit-identical: the bytes read are the same bytes.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import onnx
from onnx import TensorProto

MIN_BYTES = 1 << 16  # smaller tensors are not worth a lookup
ALIGN = 4096


def _ext(t: TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


def _set_ext(t: TensorProto, location: str, offset: int, length: int) -> None:
    del t.external_data[:]
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = k, v


def _externals(model: onnx.ModelProto) -> list[TensorProto]:
    return [t for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL]


def share(folder: Path, graph_files: list[str]) -> dict:
    """graph_files: every graph file of the folder, in the order written (earlier graphs keep their copies).
    Returns a report: bytes before / after, tensors repointed, data files removed. Only tensors of a
    (dtype, length) that occurs more than once are hashed, read with pread in pieces (a memory map's pages
    would count as resident: the whole export)."""
    folder = Path(folder)
    unlisted = sorted({g.name for g in folder.glob("*.onnx")} - set(graph_files))
    if unlisted:  # compaction moves offsets: a graph not rewritten with them would read the wrong bytes
        raise ValueError(f"dedupe.share: graphs {unlisted} in {folder} are not in the list to rewrite")
    models = {g: onnx.load(str(folder / g), load_external_data=False) for g in graph_files}
    read_before = _data_files(models)
    before = sum((folder / f).stat().st_size for f in read_before)
    order = []  # (tensor, span) in the order written
    sizes: dict[tuple[int, int], int] = {}
    for g in graph_files:
        for t in _externals(models[g]):
            e = _ext(t)
            span = (e["location"], int(e.get("offset", 0)), int(e["length"]))
            if span[2] >= MIN_BYTES:
                order.append((t, span))
                sizes[(t.data_type, span[2])] = sizes.get((t.data_type, span[2]), 0) + 1
    digests: dict[tuple[str, int, int], str] = {}
    seen: dict[tuple, tuple[str, int, int]] = {}  # (dtype, sha256) -> (location, offset, length)
    repointed = 0
    for t, span in order:
        if sizes[(t.data_type, span[2])] < 2:
            continue  # no other tensor of this dtype and length: nothing to share
        if span not in digests:
            digests[span] = _sha256(folder / span[0], span[1], span[2])
        first = seen.setdefault((t.data_type, digests[span]), span)  # same bytes: the dims only say how read
        if first != span:
            _set_ext(t, *first)
            repointed += 1
    removed = _compact(folder, models, read_before)
    for g, m in models.items():
        onnx.save_model(m, str(folder / g))
    after = sum((folder / f).stat().st_size for f in _data_files(models))
    return {"bytes_before": before, "bytes_after": after, "tensors_shared": repointed, "data_files_removed": removed}


def _sha256(path: Path, offset: int, length: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for pos in range(offset, offset + length, 64 << 20):
            h.update(os.pread(fh.fileno(), min(64 << 20, offset + length - pos), pos))
    return h.hexdigest()


def data_files_of(graph: Path) -> set[str]:
    """The external data files one graph file reads."""
    return {_ext(t)["location"] for t in _externals(onnx.load(str(graph), load_external_data=False))}


def _data_files(models: dict[str, onnx.ModelProto]) -> set[str]:
    return {_ext(t)["location"] for m in models.values() for t in _externals(m)}


def _compact(folder: Path, models: dict[str, onnx.ModelProto], read_before: set[str]) -> list[str]:
    """Rewrite each data file with only the byte ranges some graph reads (offsets updated everywhere);
    remove the data files these graphs read before and no longer do. Returns the removed names."""
    refs: dict[str, list[TensorProto]] = {}
    for m in models.values():
        for t in _externals(m):
            refs.setdefault(_ext(t)["location"], []).append(t)
    for loc, tensors in refs.items():
        spans = sorted({(int(_ext(t).get("offset", 0)), int(_ext(t)["length"])) for t in tensors})
        size = (folder / loc).stat().st_size
        if sum(n for _, n in spans) >= size - ALIGN * len(spans):  # nothing to reclaim beyond alignment
            continue
        tmp = folder / f".{loc}.compact"
        moved: dict[tuple[int, int], int] = {}
        with open(folder / loc, "rb") as src, open(tmp, "wb") as dst:
            pos = 0
            for off, n in spans:
                if n >= 1024 and pos % ALIGN:
                    dst.write(b"\0" * (ALIGN - pos % ALIGN))
                    pos += ALIGN - pos % ALIGN
                moved[(off, n)] = pos
                src.seek(off)
                left = n
                while left:
                    chunk = src.read(min(left, 64 << 20))
                    dst.write(chunk)
                    left -= len(chunk)
                pos += n
        os.replace(tmp, folder / loc)
        for t in tensors:
            e = _ext(t)
            _set_ext(t, loc, moved[(int(e.get("offset", 0)), int(e["length"]))], int(e["length"]))
    removed = []
    for name in sorted(read_before - set(refs)):
        (folder / name).unlink()
        removed.append(name)
    return removed


def duplicates(folder: Path) -> list[tuple[str, str]]:
    """Pairs (first, again) of stored tensors of at least MIN_BYTES with identical bytes, over every
    graph file of the folder, counting each stored (file, offset, length) once."""
    folder = Path(folder)
    seen: dict[tuple, str] = {}
    stored: set[tuple[str, int, int]] = set()
    out = []
    for g in sorted(folder.glob("*.onnx")):
        m = onnx.load(str(g), load_external_data=False)
        for t in m.graph.initializer:
            if t.data_location == TensorProto.EXTERNAL:
                e = _ext(t)
                span = (e["location"], int(e.get("offset", 0)), int(e["length"]))
                if span in stored:
                    continue
                stored.add(span)
                with open(folder / span[0], "rb") as fh:
                    fh.seek(span[1])
                    raw = fh.read(span[2])
            elif t.HasField("raw_data"):
                raw = t.raw_data
            else:
                continue
            if len(raw) < MIN_BYTES:
                continue
            key = (t.data_type, hashlib.sha256(raw).hexdigest())
            where = f"{g.name}:{t.name}"
            if key in seen:
                out.append((seen[key], where))
            else:
                seen[key] = where
    return out
