"""The one dtype table (dflash2.dtypes) and what is derived from it: CLI choices, numpy dtypes
(bfloat16 included, never a uint16 stand-in), ONNX element types, TensorRT types, tolerances."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest

from dflash2 import dtypes
from dflash2 import manifest as mf
from dflash2.cli import build as build_cli
from dflash2.cli import export as export_cli
from dflash2.numerics import ID_MISMATCH_SHARE, TOLERANCES
from dflash2.runtime.memory import HostBuffer
from dflash2.runtime.session import SpecSession


def _choices(main, flag: str) -> list[str]:
    import argparse

    seen = {}

    def parse_args(self, argv=None):
        seen.update({a.dest: a.choices for a in self._actions if flag in a.option_strings})
        raise SystemExit(0)

    orig = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = parse_args
    try:
        with pytest.raises(SystemExit):
            main([])
    finally:
        argparse.ArgumentParser.parse_args = orig
    return list(next(iter(seen.values())))


def test_cli_choices_come_from_the_table():
    assert _choices(export_cli.main, "--dtype") == ["float32", "float16", "bfloat16"] == list(dtypes.GRAPH_DTYPES)
    assert _choices(build_cli.main, "--precision") == ["fp32", "fp16", "bf16"] == list(dtypes.PRECISIONS)
    assert set(TOLERANCES) == set(ID_MISMATCH_SHARE) == set(dtypes.GRAPH_DTYPES)


def test_numpy_onnx_and_tensorrt_types():
    for d in dtypes.TABLE:
        proto_name = {"float32": "FLOAT", "float16": "FLOAT16"}.get(d.name, d.name.upper())
        assert d.onnx == getattr(onnx.TensorProto, proto_name)
        assert dtypes.from_onnx(d.onnx) is d and dtypes.get(d.numpy) is d
        assert d.numpy.itemsize == d.itemsize
    bf16 = dtypes.numpy_dtype("bfloat16")
    assert bf16.name == "bfloat16" and bf16 != np.uint16 and bf16.itemsize == 2
    trt = type("trt", (), {"DataType": type("DataType", (), {"BF16": "bf16-member", "HALF": "half-member"})})
    assert dtypes.trt_type(trt, "bfloat16") == "bf16-member" and dtypes.trt_type(trt, np.float16) == "half-member"
    with pytest.raises(dtypes.Dflash2Error, match="dtype: expected one of .*found 'float8'"):
        dtypes.get("float8")


class _HostOnly:
    """A backend with host buffers and no engines: enough to see what the session allocates."""

    name = "host"

    def __init__(self, manifest):
        self.manifest = manifest

    def engine(self, graph):
        return type("NoEngine", (), {"bind": lambda self, i, o: None})()

    def signature(self, graph):
        return self.manifest.signature(graph)

    def max_rows(self, graph):
        return None

    device_buffer = host_buffer = staticmethod(HostBuffer)


def test_bfloat16_session_buffers_are_bfloat16(export_dir):
    m = dataclasses.replace(mf.load(export_dir), dtype="bfloat16")
    s = SpecSession(m, _HostOnly(m))
    for buf in (s.kv, s.ctx_kv, s.context):
        assert buf.dtype.name == "bfloat16" and buf.whole().dtype.name == "bfloat16"
    assert s.kv.row_bytes == 2 * int(np.prod(m.kv.rows.target))


def test_tensorrt_binding_checks_the_element_type(fake_engines, fake):
    """Same itemsize, other type (bf16 into an fp16 slot, fp32 KV bound as int32) is refused by name."""
    from dflash2.runtime.api import Runtime
    from dflash2.runtime.trt import EngineError

    s = Runtime(fake_engines).session
    wrong = HostBuffer(s.kv.shape, np.int32)
    with pytest.raises(EngineError, match="input kv_cache expected float32, bound int32"):
        s.backend.engine("target").run({"input_ids": s.ids.rows(0, 1), "kv_cache": wrong.whole(), "past_len": s.target_kv.length.whole()}, {})
