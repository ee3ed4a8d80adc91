"""How a target graph binds its KV cache, read from its input names (no torch: the runtime imports it).

- prefix view (the plain graph): `past_kv` [P, L, 2, kv, hd] in, `new_kv` [n, ...] out (dflash2.export.api).
- fixed shapes (the TensorRT flavour): `kv_cache` [cap, ...] + `past_len` in, `new_kv` out to staging.
- gqa-shared (ONNX Runtime's fused-op graph, dflash2.export.gqa): per layer `past_key_values.{i}.key|value`
  [1, kv, cap, hd] + `past_len` in; `present.{i}.key|value` bound to the same memory, written in place.
"""

from __future__ import annotations

GQA_BINDING = ("gqa-shared: per layer past_key_values.{i}.key|value [1, kv, max_seq_len, hd] + past_len [1]; "
               "present.{i}.key|value are bound to the same memory and ONNX Runtime's GroupQueryAttention writes "
               "the step's rows at [past_len, past_len + n) in place; rollback lowers past_len.")


def kv_names(num_layers: int) -> tuple[list[str], list[str]]:
    """(past inputs, present outputs) of a gqa-shared graph, layer-major, key before value."""
    past = [f"past_key_values.{i}.{kv}" for i in range(num_layers) for kv in ("key", "value")]
    return past, [p.replace("past_key_values", "present") for p in past]


def is_gqa(input_names: list[str]) -> bool:
    return "past_key_values.0.key" in input_names
