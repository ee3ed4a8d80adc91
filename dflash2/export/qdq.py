"""Q/DQ target graphs for TensorRT with NVIDIA's own quantizer, `modelopt.onnx.quantization.quantize`.

`dflash2-export --quantize int4_awq | fp8 | int8_qdq` keeps the portable fp32 graphs (what ONNX Runtime
runs) and adds `target.qdq.onnx`, the TensorRT flavour of the target: ModelOpt's ONNX post-training
quantization inserts QuantizeLinear / DequantizeLinear pairs (INT4-AWQ: blockwise int4 weights with
AWQ-clip scales; FP8 / INT8: per-tensor activation scales from calibration, per-channel weights)
that a strongly typed TensorRT network builds as int4 / fp8 / int8 kernels. Calibration runs on ONNX
Runtime's CPU provider over prefill steps of a small prompt set (the shipped prompts, chat template).
The drafter is not quantized here: its selector node needs the TensorRT plugin, which ModelOpt's
calibration cannot run without TensorRT, and the drafter is a small share of a round on a GPU.

`nvidia-modelopt` is an optional dependency (it pins onnx / onnxruntime-gpu versions this project
does not use; install it with --no-deps and its [onnx] modules, docs/quantization.md). The ONNX
Runtime CPU provider runs the resulting Q/DQ graphs, so the export measures their deviation from
the fp32 PyTorch reference like the MatMulNBits graphs'.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import onnx

from dflash2.export import signature as N
from dflash2 import manifest as mf
from dflash2.export.quantize import QuantizeError, check_block_size

# method -> (modelopt quantize_mode, calibration_method, bits)
TRT_METHODS = {"int4_awq": ("int4", "awq_clip", 4), "fp8": ("fp8", "max", 8), "int8_qdq": ("int8", "max", 8)}
LIBRARY = "modelopt.onnx.quantization.quantize"


def require_modelopt():
    try:
        from modelopt.onnx.quantization import quantize
    except ImportError as e:
        raise QuantizeError(f"--quantize int4_awq / fp8 / int8_qdq need NVIDIA's nvidia-modelopt (its ONNX "
                            f"quantizer), which is not importable here ({e}); see docs/quantization.md") from e
    return quantize


@dataclass(frozen=True)
class TrtQuant:
    method: str  # "int4_awq" | "fp8" | "int8_qdq"
    block_size: int = 128  # int4: weights per scale along K (ModelOpt's default for AWQ)
    prompts: tuple[tuple[int, ...], ...] = ()  # calibration prompt ids (the plan sets the shipped prompts')
    backend: ClassVar[str] = "tensorrt"

    def __post_init__(self):
        if self.method not in TRT_METHODS:
            raise QuantizeError(f"--quantize: expected one of {list(TRT_METHODS)}, found {self.method!r}")
        check_block_size("--quant-block-size", self.block_size, power_of_two=False)  # ModelOpt checks its own

    def graphs(self) -> list[str]:
        return ["target"]

    def for_graph(self, name: str) -> "TrtQuant":
        return self

    def memory_note(self, gib: float) -> str:
        return (f" (ModelOpt's ONNX quantizer holds the whole fp32 graph, {gib:.2f} GiB, and calibrates it whole: "
                f"this stage is not memory-bounded)")

    def manifest_entry(self, per_graph: dict[str, mf.QuantizedGraph]) -> mf.Quantization:
        calibration = (f"{len(self.prompts)} shipped prompts (prefill)" if self.prompts else
                       "the validation feed (no tokenizer in the target folder)")
        mode, calib, bits = TRT_METHODS[self.method]
        return mf.Quantization(method=self.method, backend=self.backend, library=LIBRARY, bits=bits,
                               format=f"Q/DQ ({mode}, {calib})", graphs=per_graph,
                               block_size=self.block_size if mode == "int4" else None, drafter=False,
                               calibration=calibration)


class _Reader:
    """onnxruntime.quantization.CalibrationDataReader over a list of feeds."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]):
        self.feeds, self.i = feeds, 0

    def get_next(self):
        if self.i >= len(self.feeds):
            return None
        self.i += 1
        return self.feeds[self.i - 1]

    def get_first(self):  # ModelOpt probes the graph with the first feed
        return self.feeds[0]

    def rewind(self):
        self.i = 0

    def __iter__(self):
        return iter(self.feeds)

    def __len__(self):
        return len(self.feeds)


def shipped_prompt_ids(target_dir: Path, max_tokens: int = 256) -> tuple[tuple[int, ...], ...]:
    """The shipped prompts (dflash2.prompts) through the target's tokenizer, as plain text; () without one."""
    from dflash2.prompts import default_prompts

    path = Path(target_dir) / "tokenizer.json"
    if not path.is_file():
        return ()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    return tuple(tuple(tok.encode(p).ids[:max_tokens]) for p in default_prompts() if tok.encode(p).ids)


def calibration_feeds(prompts: list[list[int]], kv_row: list[int]) -> list[dict[str, np.ndarray]]:
    """Target prefill steps, one per prompt: input_ids [n] int32, past_kv [0, L, 2, kv, hd] fp32."""
    return [{N.INPUT_IDS: np.asarray(p, np.int32), N.PAST_KV: np.zeros((0, *kv_row), np.float32)} for p in prompts]


def quantize_target(portable: Path, q: TrtQuant, feeds: list[dict[str, np.ndarray]]) -> tuple[str, mf.QuantizedGraph]:
    """Write `target.qdq.onnx` (+ `target.qdq.onnx.data`) next to the portable fp32 target."""
    quantize = require_modelopt()
    mode, calib, _ = TRT_METHODS[q.method]
    out = portable.with_name(portable.stem + ".qdq.onnx")
    kw = {"block_size": q.block_size} if mode == "int4" else {}
    quantize(onnx_path=str(portable), quantize_mode=mode, calibration_method=calib,
             calibration_data_reader=_Reader(feeds), calibration_eps=["cpu"], use_external_data_format=True,
             output_path=str(out), high_precision_dtype="fp32", log_level="WARNING", **kw)
    logging.getLogger().setLevel(logging.WARNING)
    m = onnx.load(str(out), load_external_data=False)
    ops = Counter(n.op_type for n in m.graph.node)
    weights = sum(1 for n in m.graph.node if n.op_type in ("MatMul", "Gemm"))
    before = onnx.load(str(portable), load_external_data=False)
    return out.name, mf.QuantizedGraph(
        weight_matmuls=sum(1 for n in before.graph.node if n.op_type in ("MatMul", "Gemm")),
        quantized=ops["DequantizeLinear"] and weights, lm_heads=[], kept_fp32=[],
        weight_mb_before=round(_data_mb(portable), 2), weight_mb_after=round(_data_mb(out), 2),
        fused={"QuantizeLinear": ops["QuantizeLinear"], "DequantizeLinear": ops["DequantizeLinear"]})


def _data_mb(path: Path) -> float:
    data = [p for p in path.parent.iterdir() if p.name.startswith(path.name) and p.name != path.name]
    return sum(p.stat().st_size for p in data + [path]) / 2**20
