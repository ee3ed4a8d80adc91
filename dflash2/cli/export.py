"""dflash2-export: DFlash / DFlash2 checkpoint + target -> validated ONNX graphs and a manifest."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dflash2.cli import print_files
from dflash2.cli.args import utf8_arg
from dflash2.dtypes import GRAPH_DTYPES
from dflash2.errors import require_extra
from dflash2.cli.entry import CliError, cli_main
from dflash2.interrupts import environment_error


@cli_main("dflash2-export")
def main(argv: list[str] | None = None) -> int:
    require_extra("dflash2-export", "export", 'torch', 'onnx', 'transformers')
    p = argparse.ArgumentParser(prog="dflash2-export", description=__doc__)
    p.add_argument("--model", required=True, type=Path, help="drafter folder (DFlashDraftModel / DFlash2DraftModel)")
    p.add_argument("--target", required=True, type=Path, help="target folder (Llama / Qwen3, safetensors)")
    p.add_argument("--out", required=True, type=Path, help="output folder (written atomically)")
    p.add_argument("--dtype", default="float32", choices=GRAPH_DTYPES)
    p.add_argument("--max-seq-len", type=int,
                   help="KV capacity the runtime allocates (default min(2048, the target's max_position_embeddings); "
                        "at most max_position_embeddings)")
    p.add_argument("--beyond-max-positions", action="store_true",
                   help="allow --max-seq-len past the target's max_position_embeddings")
    p.add_argument("--no-fuse-context", action="store_true",
                   help="target emits raw taps; the drafter applies fc + hidden_norm itself")
    p.add_argument("--full-vocab", action="store_true",
                   help="ignore the drafter's draft_vocab.json: its LM head covers the whole vocabulary")
    p.add_argument("--draft-block", type=int, metavar="N",
                   help="draft N rows a round (2..the drafter's training block size; default: that size): fewer "
                        "rows make each draft cheaper; docs/export.md says when that pays")
    p.add_argument("--target-attention", choices=["auto", "plain", "gqa"], default="auto",
                   help="gqa: the target graph uses ONNX Runtime's fused ops (GroupQueryAttention over per-layer KV "
                        "buffers shared in place, SkipSimplifiedLayerNormalization): the CPU path, no TensorRT "
                        "flavour of the target; plain: ONNX ops, with a TensorRT flavour; auto (default): gqa with "
                        "--quantize int4|int8, plain otherwise")
    p.add_argument("--window-kv", choices=["on", "off"], default="on",
                   help="on (default): a target with sliding-window and full-attention layers (Muse-Glimmer, "
                        "gpt-oss) keeps its sliding layers' K|V in a buffer bounded by the window, compacted at "
                        "commit points; off: every layer keeps max_seq_len rows (docs/families/muse_glimmer.md)")
    q = p.add_argument_group("quantization (docs/quantization.md)")
    q.add_argument("--quantize", choices=["int4", "int8", "int4_awq", "fp8", "int8_qdq"],
                   help="int4 / int8: weight-only MatMulNBits graphs for ONNX Runtime (the TensorRT flavour is "
                        "dropped); int4_awq / fp8 / int8_qdq: a Q/DQ TensorRT flavour of the target (nvidia-modelopt)")
    q.add_argument("--quant-block-size", type=int, metavar="N",
                   help="weights per scale (default 32 for int4/int8, 128 for int4_awq); the export refuses a "
                        "size whose ONNX Runtime kernel is not row-invariant on this CPU (int4 64 / 128 on AVX-512 "
                        "VNNI: not lossless, docs/export.md)")
    q.add_argument("--quant-accuracy-level", type=int, default=4, metavar="L",
                   help="MatMulNBits compute: 4 int8 activations (default, fastest on VNNI CPUs), 1 fp32, 0 unset")
    q.add_argument("--quant-keep-head", action="store_true", help="keep the LM heads fp32")
    q.add_argument("--quant-target-only", action="store_true", help="keep the drafter fp32")
    q.add_argument("--quant-drafter", choices=["int4", "int8", "int8-dynamic"], metavar="int4|int8|int8-dynamic",
                   help="the drafter's own weights (default: --quantize's): int4 / int8 MatMulNBits, or int8-dynamic "
                        "(ONNX Runtime's DynamicQuantizeMatMul, per-column int8, 2.5-2.9x faster at the drafter's 8 rows). "
                        "The drafter need not be row-invariant (only the target decides the output)")
    q.add_argument("--quant-drafter-block-size", type=int, metavar="N",
                   help="the drafter's own block size (default: --quant-block-size's)")
    q.add_argument("--quant-no-fuse", action="store_true",
                   help="skip the MatMul merge and RMSNorm fusion done before quantizing (measured faster)")
    q.add_argument("--quant-from-gguf", type=Path, metavar="GGUF",
                   help="with --quantize int4|int8: the target's own quantized blocks from this GGUF (Q4_0, Q4_1, "
                        "Q8_0) go into MatMulNBits as they are instead of quantizing its dequantized weights again; "
                        "each is checked to dequantize exactly to --target's weights")
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    p.add_argument("--print", action="store_true", dest="print_plan",
                   help="check the options against both configs and print the plan (per graph: how it is written, "
                        "its quantization and when); reads no weights, writes nothing")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    from dflash2.export.api import export_plan  # heavy imports after argument parsing
    from dflash2.export.plan import QuantFlags, plan_export
    from dflash2.runtime.session import buffer_bytes

    t0 = time.perf_counter()
    try:  # the same checks as export() from Python (one rule set: dflash2.export.plan); a refusal is a
        # Dflash2Error, answered by cli_main
        for flag, path in (("--model", a.model), ("--target", a.target), ("--out", a.out)):
            utf8_arg(str(path), flag)  # argv bytes that are not UTF-8: ONNX's writer and checker take paths as text
        flags = QuantFlags(a.quantize, a.quant_block_size, a.quant_accuracy_level, a.quant_keep_head,
                           a.quant_target_only, a.quant_drafter, a.quant_drafter_block_size, a.quant_no_fuse,
                           a.quant_from_gguf)
        plan = plan_export(a.model, a.target, a.out, a.dtype, a.max_seq_len, a.force, not a.no_fuse_context, a.quiet,
                           a.full_vocab, a.beyond_max_positions, quantize=flags, target_attention=a.target_attention,
                           draft_block=a.draft_block, window_kv=a.window_kv == "on")
        if a.print_plan:
            print(plan.describe())
            return 0
        m = export_plan(plan)
    except OSError as e:  # onnx's writer does not name its file: the output's disk it was
        if environment_error(e) is None or e.filename:
            raise
        raise CliError(f"{a.out}: {environment_error(e)} while writing the export (into a temporary sibling "
                       f"{a.out.parent / ('.' + a.out.name + '.tmp-*')}, now removed); nothing was written",
                       status=1) from None
    vocab = f", draft vocabulary {m.draft_vocab.size} ids" if m.draft_vocab else ""
    print(f"exported {a.out} in {time.perf_counter() - t0:.1f} s (dtype {m.dtype}, block size {m.block_size}{vocab}; "
          f"dflash2-run allocates {buffer_bytes(m, m.max_seq_len) / 2**20:.1f} MiB of buffers for max_seq_len "
          f"{m.max_seq_len})")
    if m.quantization:
        from dflash2.quant_manifest import describe

        print(describe(m))
    print_files(m.files)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
