"""Safetensors checkpoints (single file or sharded index): headers, expected tensors, loading.

The expected tensor set of each architecture is derived from its config; every difference
(missing, unexpected, mis-shaped) is reported at once before a single weight loads.
Pickle (`*.bin`, `*.pt`) is refused: loading it can run code.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np

from dflash2.config import DrafterConfig, TargetConfig
from dflash2.errors import CheckpointError, TensorSetError
from dflash2.inputs import check_regular_file

INDEX = "model.safetensors.index.json"


# bytes per element of every safetensors dtype; weights must be one of FLOAT_DTYPES
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
               "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
MAX_HEADER = 100_000_000


def _weight_map(index: Path) -> dict[str, str]:
    try:
        doc = json.loads(check_regular_file(index).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise CheckpointError(index, "file", "a JSON index", "unreadable JSON") from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise CheckpointError(index, "weight_map", "a JSON object mapping tensor -> shard file",
                              repr(wm)[:80] if isinstance(doc, dict) else f"a JSON {type(doc).__name__}")
    bad = [f"{k!r}: {v!r}" for k, v in wm.items()
           if not isinstance(v, str) or not v.endswith(".safetensors") or Path(v).name != v]
    if bad:
        raise CheckpointError(index, "weight_map", "shard file names (*.safetensors, no folders)",
                              f"{len(bad)} bad entries, e.g. {bad[0]}"[:160])
    return wm


def shard_files(folder: str | Path) -> list[Path]:
    folder = Path(folder)
    index = folder / INDEX
    if index.is_file():
        shards = sorted(set(_weight_map(index).values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(index, "weight_map", "shard files that exist", f"missing {missing}")
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = ("pickle weights are not loaded (they can run code); convert them to safetensors"
                if pickles else "")
        raise CheckpointError(folder, "weights", "*.safetensors or " + INDEX, pickles or "no weight files", hint)
    return files


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) from a safetensors header, without reading the data. The header is
    checked as safetensors itself would (entries, dtypes, contiguous offsets, file length), so a
    truncated or malformed file is named here instead of failing inside the loader."""
    size = check_regular_file(path).stat().st_size  # a FIFO blocked forever, a folder was IsADirectoryError
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise CheckpointError(path, "header", "a safetensors file", f"a truncated file of {len(raw)} bytes")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(path, "header", "a safetensors header",
                                  f"a header length of {n} bytes in a file of {size} bytes (truncated or not safetensors)")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(path, "header", "a JSON safetensors header", "unreadable bytes") from None
    if not isinstance(header, dict):
        raise CheckpointError(path, "header", "a JSON object {tensor: {dtype, shape, data_offsets}}",
                              f"a JSON {type(header).__name__}")
    out, spans, problems = {}, [], []
    for name, v in header.items():
        if name == "__metadata__":
            continue
        why = _entry_problem(v)
        if why:
            problems.append(f"{name}: {why}")
            continue
        out[name] = (v["dtype"], tuple(v["shape"]))
        spans.append(tuple(v["data_offsets"]))
    end = 0
    for begin, stop in sorted(spans):
        if begin != end:
            problems.append(f"data_offsets: expected contiguous tensor data, found a {'gap' if begin > end else 'overlap'}"
                            f" at byte {end}")
            break
        end = stop
    if not problems and 8 + n + end != size:
        problems.append(f"tensor data ends at byte {8 + n + end}, the file has {size} bytes "
                        f"({'truncated' if 8 + n + end > size else 'trailing bytes'})")
    if problems:
        raise CheckpointError(path, "header", "a valid safetensors header",
                              f"{len(problems)} problem(s): " + "; ".join(problems[:4]))
    return out


def _entry_problem(v) -> str:
    """Why one header entry is malformed ('' when it is fine)."""
    if not isinstance(v, dict):
        return f"expected an object {{dtype, shape, data_offsets}}, found {type(v).__name__} {v!r}"[:120]
    dtype, shape, offsets = v.get("dtype"), v.get("shape"), v.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        return f"dtype: expected one of {sorted(DTYPE_BYTES)}, found {dtype!r}"
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        return f"shape: expected a list of non-negative integers, found {shape!r}"
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets) \
            or not 0 <= offsets[0] <= offsets[1]:
        return f"data_offsets: expected [begin, end] with 0 <= begin <= end, found {offsets!r}"
    need = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != need:
        return f"data_offsets: expected {need} bytes for {dtype} {shape}, found {offsets[1] - offsets[0]}"
    return ""


def read_headers(folder: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    folder = Path(folder)
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    where: dict[str, str] = {}
    for f in shard_files(folder):
        for name, meta in read_header(f).items():
            out[name], where[name] = meta, f.name
    if (folder / INDEX).is_file():  # the index must describe the shards it points to
        wm = _weight_map(folder / INDEX)
        wrong = [f"{k} (index: {v}, found in: {where.get(k, 'no shard')})" for k, v in wm.items() if where.get(k) != v]
        if wrong:
            raise CheckpointError(folder / INDEX, "weight_map", "each tensor in the shard the index names",
                                  f"{len(wrong)} mismatch(es), e.g. {', '.join(wrong[:3])}")
    return out


def target_tensor_shapes(c: TargetConfig) -> dict[str, tuple[int, ...]]:
    H, I, hd = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_heads * hd, c.num_kv_heads * hd
    shapes = {"model.embed_tokens.weight": (c.vocab_size, H), "model.norm.weight": (H,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, H)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes.update(_block_shapes(p, H, I, q, kv, hd, c.qk_norm, c.attention_bias, c.mlp_bias))
    return shapes


def family_tensor_shapes(c) -> dict[str, tuple[int, ...]]:
    """The target's tensors as its checkpoint names them, for any registered family (dflash2.families)."""
    from dflash2 import families

    return families.by_name(c.family).tensor_shapes(c)


def check_target_tensors(folder: str | Path, c) -> dict[str, tuple[str, tuple]]:
    """check_tensors of a target folder against its family's tensors, the family's ignored prefixes skipped."""
    from dflash2 import families

    fam = families.by_name(c.family)
    return check_tensors(folder, family_tensor_shapes(c), fam.ignored,
                         fam.tensor_dtypes(c) if fam.tensor_dtypes else None)


def _block_shapes(p, H, I, q, kv, hd, qk_norm, attn_bias, mlp_bias) -> dict:
    s = {p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
         p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
         p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
         p + "mlp.down_proj.weight": (H, I),
         p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,)}
    if qk_norm:
        s.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    if attn_bias:
        s.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                  p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (H,)})
    if mlp_bias:
        s.update({p + "mlp.gate_proj.bias": (I,), p + "mlp.up_proj.bias": (I,), p + "mlp.down_proj.bias": (H,)})
    return s


def drafter_tensor_shapes(c: DrafterConfig, target_hidden: int) -> dict[str, tuple[int, ...]]:
    H, hd = c.hidden_size, c.head_dim
    shapes = {"fc.weight": (H, len(c.target_layer_ids) * target_hidden),
              "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(c.num_layers):
        p = f"layers.{i}."
        shapes.update(_block_shapes(p, H, c.intermediate_size, c.num_heads * hd, c.num_kv_heads * hd, hd,
                                    True, c.attention_bias, False))
        if c.version == 2:
            G = H // c.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                shapes[f"{p}{conv}.base_kernel"] = (2, c.conv_kernel_size, H)
                shapes[f"{p}{conv}.kernel_projection.weight"] = (2 * c.conv_kernel_size * G, H)
    if c.version == 2:
        r, V = c.selector_rank, c.vocab_size
        shapes.update({"candidate_selector.hidden_projection.weight": (r, H),
                       "candidate_selector.predecessor_codebook": (V, r),
                       "candidate_selector.successor_codebook": (V, r)})
    from dflash2.drafter_formats import ALIASES  # a format's own names for some tensors (Meta's encoder.fc)

    alias = ALIASES.get(c.format, {})
    return {alias.get(k, k): s for k, s in shapes.items()}


# HF checkpoints of tied models sometimes still carry lm_head.weight; it is ignored, not an error.
_TOLERATED = {"lm_head.weight"}


def check_tensors(folder: str | Path, expected: dict[str, tuple[int, ...]],
                  ignored: tuple[str, ...] = (), dtypes: dict[str, str] | None = None) -> dict[str, tuple[str, tuple]]:
    """ignored: name prefixes that are not the model (a family's, e.g. an in-checkpoint MTP head); dtypes: the
    tensors that are not float, with their safetensors dtype (a family's tensor_dtypes: MXFP4's U8 bytes)."""
    found = read_headers(folder)
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(n for n in set(found) - set(expected) if n not in _TOLERATED and not n.startswith(ignored))
    misshaped = [(n, expected[n], found[n][1]) for n in sorted(set(expected) & set(found))
                 if tuple(found[n][1]) != tuple(expected[n])]
    if missing or unexpected or misshaped:
        raise TensorSetError(str(folder), missing, unexpected, misshaped)
    dtypes = dtypes or {}
    ints = [f"{n} ({found[n][0]})" for n in sorted(expected)
            if (found[n][0] != dtypes[n] if n in dtypes else found[n][0] not in FLOAT_DTYPES)]
    if ints:  # casting integer weights to float would silently export a different model
        declared = f"; {', '.join(sorted(set(dtypes.values())))} where the family declares it" if dtypes else ""
        raise CheckpointError(folder, "weights", f"float tensors ({', '.join(FLOAT_DTYPES)}){declared}",
                              f"{len(ints)} of another dtype: {', '.join(ints[:4])}")
    return found


def load_tensors(folder: str | Path, names: set[str] | None = None) -> dict:
    """torch tensors by name (safetensors only), every one checked finite: a NaN / inf weight would
    export and then generate garbage (id 0 forever). Imports torch lazily: callers are export/train."""
    import torch
    from safetensors import SafetensorError, safe_open

    out, bad = {}, []
    for f in shard_files(folder):
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    if names is None or k in names:
                        out[k] = t = fh.get_tensor(k)
                        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
                            bad.append(f"{k} in {f.name} ({nan} NaN, {inf} inf)")
        except SafetensorError as e:
            raise CheckpointError(f, "weights", "a readable safetensors file", str(e)) from None
    if bad:
        raise CheckpointError(folder, "weights", "finite values (no NaN / inf)",
                              f"{len(bad)} tensor(s): {', '.join(bad[:4])}")
    return out


# ------------------------------------------------------------------ streamed reading (dflash2.export.weights)

_NUMPY = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64, "I32": np.int32,
          "U8": np.uint8, "I8": np.int8}
CHUNK_BYTES = 64 << 20  # a tensor is widened / checked this many source bytes at a time


def _format_names() -> dict[str, str]:
    from dflash2.drafter_formats import ALIASES

    return {ours: theirs for aliases in ALIASES.values() for ours, theirs in aliases.items()}


_FORMAT_NAMES = _format_names()  # dflash2's drafter tensor name -> another format's (looked up when ours is absent)


class Weights:
    """name -> fp32 numpy array, read from a safetensors folder on demand (module docstring). Names are the reference
    modules': a target's `model.` / `model.language_model.` prefix and a drafter format's own names are looked up
    behind them."""

    def __init__(self, folder: str | Path, prefixes: tuple[str, ...] = ("", "model.", "model.language_model.")):
        self.folder, self.prefixes = Path(folder), prefixes
        self.where: dict[str, tuple[Path, str, tuple[int, ...], int]] = {}  # name -> (file, dtype, shape, offset)
        for f in shard_files(self.folder):
            header = read_header(f)  # validated: entries, dtypes, contiguous offsets, file length
            start, offsets = _offsets(f)
            for name, (dtype, shape) in header.items():
                self.where[name] = (f, dtype, shape, start + offsets[name])

    def _key(self, name: str) -> str:
        for p in self.prefixes:
            if p + name in self.where:
                return p + name
        alias = _FORMAT_NAMES.get(name)  # a drafter format's own name for it (Meta's encoder.fc.weight)
        if alias in self.where:
            return alias
        raise KeyError(f"{self.folder}: no tensor {name!r} (looked for {[p + name for p in self.prefixes]})")

    def __contains__(self, name: str) -> bool:
        return any(p + name in self.where for p in self.prefixes) or _FORMAT_NAMES.get(name) in self.where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.where[self._key(name)][2])

    def get(self, name: str, rows: slice | None = None) -> np.ndarray:
        """fp32 copy of a tensor (or of consecutive rows of its first axis), checked finite. Read with
        pread in CHUNK_BYTES pieces, not through a memory map: mapped file pages count as the process's
        resident memory until unmapped, which would make a streamed export look like it holds the model."""
        out, f, key, (start, stop) = self._read(name, rows)
        # one cheap pass: a sum is finite unless some entry is not (or it overflows: then the exact check)
        if not _finite(out):
            where = "" if rows is None else f" in rows {start}..{stop - 1}"
            raise CheckpointError(f, key, "finite values (no NaN / inf)",
                                  f"{int(np.isnan(out).sum())} NaN, {int(np.isinf(out).sum())} inf{where}")
        return out

    def non_finite(self, names) -> list[str]:
        """'name in file (n NaN, m inf)' for every tensor of `names` holding a NaN / inf, read CHUNK_BYTES of
        rows at a time (the streamed exports' first check: every bad tensor named at once, before any graph)."""
        bad = []
        for name in names:
            key = self._key(name)
            if self.where[key][1] not in FLOAT_DTYPES:  # an integer tensor a family declares (MXFP4's bytes)
                continue
            nan = inf = 0
            for rows in self._row_slices(name, CHUNK_BYTES):
                out = self._read(name, rows)[0]
                if not _finite(out):
                    nan, inf = nan + int(np.isnan(out).sum()), inf + int(np.isinf(out).sum())
            if nan or inf:
                bad.append(f"{key} in {self.where[key][0].name} ({nan} NaN, {inf} inf)")
        return bad

    def raw(self, name: str, rows: slice | None = None) -> np.ndarray:
        """A tensor (or consecutive rows of its first axis) as the bytes' own integer dtype (U8 / I8: the MXFP4
        blocks and scales a family declares), not widened."""
        key = self._key(name)
        f, dtype, shape, offset = self.where[key]
        np_dtype = np.dtype(_NUMPY[dtype])
        start, stop, _ = (rows or slice(None)).indices(shape[0])
        row = int(np.prod(shape[1:], dtype=np.int64)) * np_dtype.itemsize
        with open(f, "rb") as fh:
            buf = os.pread(fh.fileno(), (stop - start) * row, offset + start * row)
        return np.frombuffer(buf, np_dtype).reshape(stop - start, *shape[1:]).copy()

    def _read(self, name: str, rows: slice | None):
        key = self._key(name)
        f, dtype, shape, offset = self.where[key]
        np_dtype = np.dtype(np.uint16 if dtype == "BF16" else _NUMPY.get(dtype, np.void))
        if np_dtype == np.void or dtype not in FLOAT_DTYPES:
            raise CheckpointError(f, key, "a float tensor", f"dtype {dtype}")
        start, stop, _ = (rows or slice(None)).indices(shape[0] if shape else 1)
        row = int(np.prod(shape[1:], dtype=np.int64)) if shape else 1
        out = np.empty((stop - start, *shape[1:]) if shape else (), np.float32)
        flat = out.reshape(-1)
        step = max(1, CHUNK_BYTES // np_dtype.itemsize)
        with open(f, "rb") as fh:
            fd = fh.fileno()
            base = offset + start * row * np_dtype.itemsize
            for i in range(0, flat.size, step):
                n = min(step, flat.size - i)
                buf = np.frombuffer(os.pread(fd, n * np_dtype.itemsize, base + i * np_dtype.itemsize), np_dtype)
                if np_dtype == np.uint16:  # bf16: its bits are the upper half of the fp32's
                    bits = flat[i:i + n].view(np.uint32)
                    bits[:] = buf
                    bits <<= 16
                else:
                    flat[i:i + n] = buf
        return out, f, key, (start, stop)

    def row_chunks(self, name: str, max_bytes: int = CHUNK_BYTES):
        """fp32 copies of consecutive row ranges of a 2-D tensor, each at most ~max_bytes."""
        for rows in self._row_slices(name, max_bytes):
            yield self.get(name, rows)

    def _row_slices(self, name: str, max_bytes: int):
        """Consecutive row ranges of a tensor whose fp32 copies are at most ~max_bytes (a scalar: one, None)."""
        shape = self.shape(name)
        if not shape:
            yield None
            return
        step = max(1, max_bytes // (4 * max(1, int(np.prod(shape[1:], dtype=np.int64)))))
        for i in range(0, shape[0], step):
            yield slice(i, min(shape[0], i + step))


def _finite(a: np.ndarray) -> bool:
    """A sum is finite unless some entry is not (or it overflows: then the exact check)."""
    return bool(np.isfinite(np.add.reduce(a.reshape(-1), dtype=np.float32)) or np.isfinite(a).all())


def check_finite(folder: str | Path, names) -> None:
    """CheckpointError listing every tensor of `names` with a NaN / inf (load_tensors' message), streamed."""
    bad = Weights(folder).non_finite(names)
    if bad:
        raise CheckpointError(folder, "weights", "finite values (no NaN / inf)",
                              f"{len(bad)} tensor(s): {', '.join(bad[:4])}")


def _offsets(f: Path) -> tuple[int, dict[str, int]]:
    """(byte where tensor data starts, name -> offset of its data after that)."""
    import json

    with open(f, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(n))
    return 8 + n, {k: int(v["data_offsets"][0]) for k, v in header.items() if k != "__metadata__"}
