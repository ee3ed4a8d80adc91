"""The reference target against transformers' own LlamaForCausalLM / Qwen3ForCausalLM."""

import inspect

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM, Qwen3ForCausalLM

from dflash2 import tiny
from dflash2.reference.load import load_target

HF = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}
TOL = 1e-4


def _hf_with_taps(model):
    """Capture every decoder layer's OUTPUT with hooks (HF replaces the last hidden_states entry)."""
    outs = {}
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o[0] if isinstance(o, tuple) else o))
    return outs


def _cache_kwarg(model) -> str:
    # transformers 5.x renames past_key_values -> cache
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@pytest.mark.parametrize("family, tied, bias", [("llama", False, False), ("llama", True, False),
                                                ("qwen3", False, False), ("qwen3", True, False),
                                                ("llama", False, True), ("qwen3", False, True)])
def test_prefill_decode_verify_match_transformers(tmp_path, family, tied, bias):
    """bias: attention_bias true, a bias on q/k/v/o as transformers' Llama / Qwen3 have it."""
    folder = tiny.make_target(tmp_path / "t", family=family, tie_word_embeddings=tied, num_layers=3, seed=7,
                              attention_bias=bias)
    if bias:  # the tiny factory's biases are random, not zero: the test sees them
        from safetensors import safe_open

        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            assert f.get_tensor("model.layers.0.self_attn.o_proj.bias").abs().max() > 0
    taps = (0, 1, 2)
    ours = load_target(folder, taps)
    hf = HF[family].from_pretrained(folder, dtype=torch.float32).eval()
    hf_taps = _hf_with_taps(hf)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, ours.config.vocab_size, (13,), generator=g)
    steps = [prompt, prompt[:1] * 0 + 5, torch.randint(0, ours.config.vocab_size, (8,), generator=g)]
    cache, kv, pos = DynamicCache(), torch.zeros(64, *ours.kv_row_shape()), 0
    with torch.no_grad():
        for ids in steps:  # prefill, 1-token decode, 8-token verify on the cache
            ref = hf(ids[None], use_cache=True, **{_cache_kwarg(hf): cache})
            logits, tap_out, new_kv = ours(ids, kv[:pos])
            kv[pos: pos + len(ids)] = new_kv
            pos += len(ids)
            assert (logits - ref.logits[0]).abs().max() <= TOL
            want = torch.cat([hf_taps[i][0] for i in taps], dim=-1)
            assert (tap_out - want).abs().max() <= TOL
            assert torch.equal(logits.argmax(-1), ref.logits[0].argmax(-1))
    # the cache holds what transformers' cache holds (keys after RoPE), so rollback = pointer
    for layer in range(ours.config.num_layers):
        hf_k = cache.layers[layer].keys[0].transpose(0, 1)  # [T, kv, hd]
        assert (kv[:pos, layer, 0] - hf_k).abs().max() <= TOL


def test_taps_are_layer_outputs_not_final_norm(tmp_path):
    """Pitfall in docs/algorithm.md section 2: tap k = output of layer k = HF hidden_states[k + 1], never post-norm."""
    folder = tiny.make_target(tmp_path / "t", family="qwen3", num_layers=3)
    last = 2
    ours = load_target(folder, (last,))
    hf = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.arange(6)
    with torch.no_grad():
        hs = hf(ids[None], output_hidden_states=True).hidden_states
        _, taps, _ = ours(ids, torch.zeros(0, *ours.kv_row_shape()))
    # transformers' last entry is post-norm: our tap of the last layer must NOT equal it
    assert (taps - hs[last + 1][0]).abs().max() > 1e-3
    ours_mid = load_target(folder, (1,))
    with torch.no_grad():
        _, mid, _ = ours_mid(ids, torch.zeros(0, *ours.kv_row_shape()))
    assert (mid - hs[2][0]).abs().max() <= TOL
