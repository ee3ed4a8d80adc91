"""Layer-cut scale checks and the disk check of dflash2.bench.scalecheck.

A real shape whose pair the disk cannot hold (a 27B target is ~54 GB of bf16, its int4 export ~19 GB more) is
measured cut: the target keeps its first N layers (`--layers 8,16`), the embedding, head and drafter whole. Two cuts
of the same shape give the per-layer cost (the difference over the layers between) and the fixed part (embedding,
head, drafter, graph building), and from them the whole model's, extrapolated (per_layer). A hybrid's cuts at
multiples of its full-attention interval (4) hold the same mix of layer kinds, so the difference is one period's.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import replace
from pathlib import Path

from dflash2.bench.scalecheck import Shape


def cut_taps(taps: tuple[int, ...], layers: int, kept: int) -> tuple[int, ...]:
    """The drafter's taps of a `layers`-layer target moved into its first `kept` layers: scaled, then made distinct
    (increasing) where `kept` allows, else clipped into [0, kept-1] with repeats (config.py accepts them). The count
    stays: the drafter's fc [H, len(taps) * H] is the real drafter's, so its cost is the real one."""
    moved = [min(kept - 1, round(t * kept / layers)) for t in taps]
    if kept >= len(moved):
        for i in range(1, len(moved)):
            moved[i] = max(moved[i], moved[i - 1] + 1)
        for i in range(len(moved)):  # pushed past the end: pull back, keeping one layer per later tap
            moved[i] = min(moved[i], kept - len(moved) + i)
    return tuple(moved)


def truncate(shape: Shape, layers: int) -> Shape:
    """`shape`'s target kept to its first `layers` layers (a hybrid keeps its pattern: the interval is a config
    field, so every 4th kept layer is still full attention), the drafter unchanged but for its taps (cut_taps).
    Its own name (its own cache folder) and full_layers record the cut in the JSON and the table."""
    if not 1 <= layers <= shape.layers:
        raise ValueError(f"--layers: expected 1..{shape.layers} for {shape.name} ({shape.layers} layers), "
                         f"found {layers}")
    if layers == shape.layers:
        return shape
    return replace(shape, name=f"{shape.name}-L{layers}", layers=layers, taps=cut_taps(shape.taps, shape.layers, layers),
                   full_layers=shape.layers)


class DiskTooSmall(RuntimeError):
    pass


# bytes per target parameter of an export's output (measured: int4 blocks of 32 with fp32 scales, ~0.6, plus the
# fp32 norms, GDN and router tensors); a bound for the disk check, not a prediction
OUT_BYTES_PER_PARAM = {"fp32": 4.1, "fp16": 2.1, "bf16": 2.1, "int4": 0.75, "target-int4": 0.75, "target-fp32": 4.1}


def _free_for(path: Path) -> tuple[int, int]:
    """(free bytes, device) of the file system `path` is or would be on."""
    p = Path(path)
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free, p.stat().st_dev


def check_disk(pair_bytes: int, pair_root: Path, out_bytes: int, out_root: Path, what: str,
               margin: int = 2 << 30) -> None:
    """Refuse (DiskTooSmall, with the numbers) before writing when the pair and the export cannot both fit."""
    (pf, pd), (of, od) = _free_for(pair_root), _free_for(out_root)
    need = {pd: 0, od: 0}
    need[pd] += pair_bytes + margin
    need[od] += out_bytes + margin
    free = {pd: pf, od: of}
    for dev, n in need.items():
        if n > free[dev]:
            raise DiskTooSmall(
                f"{what}: the pair ({pair_bytes / 1e9:.1f} GB at {pair_root}) and its export (up to "
                f"{out_bytes / 1e9:.1f} GB at {out_root}) need {n / 1e9:.1f} GB with a {margin / 2**30:.0f} GiB margin "
                f"on one file system; {free[dev] / 1e9:.1f} GB is free (truncate it: --layers N)")


def pair_sizes(shape: Shape, target: Path, drafter: Path) -> tuple[int, int, int]:
    """(bytes on disk of the pair as written, target parameters, the export's scratch bytes) from the written
    config.json files. The scratch is the templates' end-to-end check (dflash2.export.stages.gqa_target): an fp32
    build of the truncated layers with the real embedding and head (10 GB of vocabulary at the 27B shape's untied
    248,320 x 5120), written beside the export and deleted once validated; a quantized export skips it past
    stages.TRUNCATED_CHECK_BYTES, so for those it is a bound, not a prediction."""
    from dflash2.checkpoint import drafter_tensor_shapes, family_tensor_shapes
    from dflash2.config import load_drafter_config, load_target_config
    from dflash2.export.stages import truncated_depth
    from dflash2.reference.streamed import truncated

    item = {"bfloat16": 2, "float32": 4}[shape.dtype]
    tc, dc = load_target_config(target), load_drafter_config(drafter)
    t = family_tensor_shapes(tc)
    d = drafter_tensor_shapes(dc, shape.hidden)
    params = sum(math.prod(v) for v in t.values())
    per_layer = sum(math.prod(v) for k, v in t.items() if ".layers." in k) / tc.num_layers
    vocab = shape.vocab * shape.hidden * (1 if shape.tied else 2)
    scratch = int(4 * (vocab + truncated(tc, dc, truncated_depth(tc))[0].num_layers * per_layer))
    return item * (params + sum(math.prod(v) for v in d.values())), params, scratch


def per_layer(shapes: list[Shape], rows: list) -> list[dict]:
    """For each (real shape, mode) run cut at 2+ layer counts: the least-squares line of each measure over the kept
    layers (exact for two): per layer, fixed, and at the real layer count. Peak RSS is a maximum over steps, not a sum:
    its line says how the largest step grows, which is what the floor is about. Wall time compares only at like
    loads: on a shared machine the slope between two runs mixes depth with load (the JSON's load_average)."""
    by = {s.name: s for s in shapes}
    groups: dict[tuple[str, str, int], list] = {}
    for r in rows:
        s = by.get(r.shape)
        if s is None or r.rc != 0:
            continue
        base = s.name.rsplit("-L", 1)[0] if s.full_layers else s.name  # a whole run is a point of its line too
        groups.setdefault((base, r.mode, s.full_layers or s.layers), []).append((s.layers, r))
    fits = []
    for (base, mode, full), pts in groups.items():
        if len({n for n, _ in pts}) < 2:
            continue
        fit = {"shape": base, "mode": mode, "layers": [n for n, _ in pts], "full_layers": full,
               "per_layer": {}, "fixed": {}, "extrapolated": {}}
        for key in ("peak_rss_gib", "wall_s", "output_gb"):
            xs = [n for n, r in pts if getattr(r, key) is not None]
            ys = [getattr(r, key) for n, r in pts if getattr(r, key) is not None]
            if len(set(xs)) < 2:
                continue
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            fit["per_layer"][key] = round(slope, 4)
            fit["fixed"][key] = round(my - slope * mx, 3)
            if key == "peak_rss_gib":  # a maximum over steps, most of them depth-free (the checks' truncated
                # builds): never extrapolated below the largest measured; only a growing peak grows on
                fit["extrapolated"][key] = round(max(ys) + max(0.0, slope) * (full - max(xs)), 2)
            else:
                fit["extrapolated"][key] = round(my + slope * (full - mx), 2)
        fits.append(fit)
    return fits
