"""The contract of a target family (`TargetFamily`), torch-free.

A family is data plus readers: which Hugging Face `architectures` it claims, how its config.json is read and
checked, which state each layer carries, which layer outputs may be tapped, where its PyTorch reference and its
layer templates live, and how a tiny random checkpoint of it is written. The PyTorch and ONNX parts are named
by import path ("module:attribute") and imported only by the stage that owns them (the reference by
dflash2.reference, the templates by dflash2.export), as vLLM's model registry names its model classes: the
registry itself imports neither torch nor onnx, so the runtime may read it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

# What a layer keeps between steps. kv: attention K/V rows (rollback = keep fewer rows); conv: the last K-1 inputs
# of a causal conv; recurrent: a fixed-size state advanced per token (Gated DeltaNet's delta rule). conv and
# recurrent roll back by keeping the state after the accepted row (docs/families/qwen3_5.md).
StateKind = Literal["kv", "conv", "recurrent"]
STATE_KINDS: tuple[str, ...] = ("kv", "conv", "recurrent")

# The op sets a family's layer templates are written for. fused: ONNX Runtime's contrib ops (GroupQueryAttention,
# SkipSimplifiedLayerNormalization, MatMulNBits; export/gqa.py); plain: standard ONNX ops, one build giving the
# portable graph and the TensorRT flavour (export/plain.py).
OP_SETS: tuple[str, ...] = ("fused", "plain")


@dataclass(frozen=True)
class TinyShape:
    """The shape of a tiny random checkpoint (tests, demos); a family maps it to its own config.json."""
    vocab: int
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    tie_word_embeddings: bool = False
    eos: int = 0
    dtype: str = "float32"
    attention_bias: bool = False
    head_dim: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TargetFamily:
    name: str  # "llama", "qwen3", "qwen3_5": TargetConfig.family, the model_type a trained drafter records
    archs: tuple[str, ...]  # the Hugging Face `architectures` it claims
    description: str  # a few words for messages ("dense", "hybrid Gated DeltaNet")
    # (path, raw config.json dict, arch) -> the family's config (TargetConfig for the dense families); every
    # refusal a CheckpointError naming file, field, expected, found. A wrapper (ConditionalGeneration) reads
    # its text_config here.
    read_config: Callable[[Path, dict, str], Any]
    # config -> per layer, the state kinds it keeps (("kv",) for attention; ("conv", "recurrent") for GDN)
    layer_states: Callable[[Any], tuple[tuple[str, ...], ...]]
    # config -> its tensors as the checkpoint names them, with shapes (what a tiny checkpoint holds)
    tensor_shapes: Callable[[Any], dict[str, tuple[int, ...]]]
    # TinyShape -> a config.json dict as transformers writes it for this family
    tiny_config: Callable[[TinyShape], dict]
    hf_class: str  # the transformers class that loads its causal-LM checkpoints (parity tests, corpus generation)
    # "module:attribute" of load_target(folder, tap_ids=(), dtype=...) -> the PyTorch reference (dflash2.reference)
    reference: str
    # op set -> "module:attribute" of its graph builder (dflash2.export); empty: not exportable yet
    templates: Mapping[str, str] = field(default_factory=dict)
    # checkpoint tensor-name prefixes that are not the target (an MTP head, a vision tower): skipped, not refused
    ignored: tuple[str, ...] = ()
    # raw config.json dict -> tensors a checkpoint holds that are not the target (under `ignored`: a vision tower),
    # written by the tiny maker so that `hf_class` loads its checkpoint whole; None: none
    extra_tensors: Callable[[dict], dict[str, tuple[int, ...]]] | None = None
    # config -> {tensor name: safetensors dtype} of the tensors that are not float (MXFP4 blocks / scales: "U8");
    # the checkpoint check refuses an integer tensor anywhere else. None: every tensor float
    tensor_dtypes: Callable[[Any], dict[str, str]] | None = None
    # dflash2-train takes its targets (False: exportable, but the training path is not checked for it yet)
    trainable: bool = True
    # the KV binding of its fused-op target graph: "gqa-shared" (GroupQueryAttention's per-layer buffers bound in
    # place: every layer of a dense target, the full-attention layers of a hybrid) or "prefix" (one past_kv view)
    fused_kv: str = "prefix"
    # the graph dtypes its standard-op templates are checked in (the plan refuses the others before any weight is
    # read)
    dtypes: tuple[str, ...] = ("float32",)

    @property
    def exportable(self) -> bool:
        return bool(self.templates)

    @property
    def not_exportable(self) -> str:
        """Why dflash2-export / dflash2-train refuse a family without templates (the hint of their one line)."""
        return (f"{self.name}, {self.description}: reference and tiny checkpoints only; export and training not "
                f"yet supported")

    @property
    def not_trainable(self) -> str:
        """Why dflash2-train refuses an exportable family whose training is not checked yet."""
        return f"{self.name}, {self.description}: reference and export only; training not yet supported"

    def tap_points(self, config) -> tuple[int, ...]:
        """The layers whose OUTPUT a drafter may tap (HF hidden_states[i + 1]): every layer, for every family
        so far (a tap is the residual stream after the layer, whatever mixes the tokens inside it)."""
        return tuple(range(config.num_layers))

    def state_kinds(self, config) -> frozenset[str]:
        return frozenset(k for kinds in self.layer_states(config) for k in kinds)


def resolve(path: str) -> Any:
    """"module:attribute" -> the object (imported now: call it only from the stage the module belongs to)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
