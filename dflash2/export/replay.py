"""The Polygraphy replay files of a validation (X.inputs.json, X.reference.json), written one feed at a time.

`polygraphy run X.onnx --onnxrt --load-inputs X.inputs.json --load-outputs X.reference.json` replays the check.
Polygraphy's own writer (save_json, RunResults.save) builds the whole file as one string: every array as
np.save bytes, their base64, and the JSON around them, all in memory at once, for every feed together. A
hybrid target's per-row recurrent states are ~300 MB per feed at Qwen3.5-0.8B's shape, and that writer held
several GB (the reference file alone is ~0.9 GB). `ReplayWriter` writes the same bytes as Polygraphy's writer
(json.dumps with Polygraphy's encoders and its indent; tests/test_validation_memory.py compares them), streaming each
array's base64 in pieces and each feed as it comes: a feed's arrays are the most it holds.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np

_MARK = "\x00dflash2-items\x00"  # where the feeds go in the serialized skeleton


class _B64:
    """A binary file-like object base64-encoding what it is given into a text file (3-byte groups carried over:
    the pieces' encodings join into the whole's)."""

    def __init__(self, out):
        self.out, self.rest = out, b""

    def write(self, b) -> int:
        data = self.rest + bytes(b)
        n = len(data) // 3 * 3
        self.out.write(base64.b64encode(data[:n]).decode())
        self.rest = data[n:]
        return len(b)

    def close(self) -> None:
        self.out.write(base64.b64encode(self.rest).decode())
        self.rest = b""


def _encoder():
    from polygraphy.json import to_json
    from polygraphy.json.serde import Encoder

    to_json([])  # registers Polygraphy's numpy encoders (done lazily by its own save / load functions)
    return Encoder()


class _Json:
    """json.dumps(obj, cls=Polygraphy's Encoder, indent=TAB), written to `out` as it goes; numpy arrays are
    streamed (np.save's bytes, base64-encoded in pieces) instead of encoded whole."""

    def __init__(self, out, indent: str):
        self.out, self.ind, self.enc = out, indent, _encoder()

    def dump(self, obj, level: int) -> None:
        w, ind = self.out.write, self.ind
        if isinstance(obj, np.ndarray):
            d = self.enc.default(np.zeros(0, np.uint8))  # the array's dict: its keys and their order
            d["array"] = obj
            w("{")
            for j, (k, v) in enumerate(d.items()):
                w(("," if j else "") + "\n" + ind * (level + 1) + json.dumps(k) + ": ")
                if k == "array":
                    w('"')
                    b64 = _B64(self.out)
                    np.lib.format.write_array(b64, v, allow_pickle=False)
                    b64.close()
                    w('"')
                else:
                    self.dump(v, level + 1)
            w("\n" + ind * level + "}")
        elif isinstance(obj, dict):
            if not obj:
                w("{}")
                return
            w("{")
            for j, (k, v) in enumerate(obj.items()):
                w(("," if j else "") + "\n" + ind * (level + 1) + json.dumps(k) + ": ")
                self.dump(v, level + 1)
            w("\n" + ind * level + "}")
        elif isinstance(obj, (list, tuple)):
            if not obj:
                w("[]")
                return
            w("[")
            for j, v in enumerate(obj):
                w(("," if j else "") + "\n" + ind * (level + 1))
                self.dump(v, level + 1)
            w("\n" + ind * level + "]")
        elif obj is None or isinstance(obj, (str, int, float, bool)):
            w(json.dumps(obj))
        else:  # a Polygraphy object (IterationResult, LazyArray, ...): its registered encoder's dict
            self.dump(self.enc.default(obj), level)


class _Items:
    """One JSON file whose skeleton has a list of items appended one at a time."""

    def __init__(self, path: Path, skeleton):
        from polygraphy import constants

        self.fh = open(path, "w")
        self.json = _Json(self.fh, constants.TAB)
        text = json.dumps(skeleton, cls=type(self.json.enc), indent=constants.TAB)  # the skeleton has no arrays
        head, self.tail = text.split(json.dumps(_MARK))
        self.level = len(head) - len(head.rstrip(" "))  # the items' indentation (in characters)
        self.level //= len(constants.TAB)
        self.head, self.n = head, 0

    def add(self, item) -> None:
        self.fh.write(self.head if self.n == 0 else ",\n" + self.json.ind * self.level)
        self.json.dump(item, self.level)
        self.n += 1

    def close(self) -> None:
        if self.n == 0:
            self.fh.close()
            raise ValueError(f"{self.fh.name}: a replay file needs at least one feed")
        self.fh.write(self.tail)
        self.fh.close()


class ReplayWriter:
    """X.inputs.json and X.reference.json of one graph's validation, a feed at a time (`add`), closed by `close`
    (or the with block). The bytes are those of validate.save_polygraphy over all feeds at once."""

    def __init__(self, folder: Path, name: str):
        from polygraphy.comparator import RunResults

        self.inputs = _Items(folder / f"{name}.inputs.json", [_MARK])
        results = RunResults()
        results.append(("pytorch", [_MARK]))
        self.refs = _Items(folder / f"{name}.reference.json", results)

    def add(self, feed: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> None:
        from polygraphy.comparator import IterationResult

        self.inputs.add(feed)
        self.refs.add(IterationResult(outputs=ref, runner_name="pytorch"))

    def close(self) -> None:
        self.inputs.close()
        self.refs.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for f in (self.inputs, self.refs):
            if exc[0] is None:
                f.close()
            else:
                f.fh.close()
