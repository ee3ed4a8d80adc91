"""The gpt-oss reference (dflash2.reference.gpt_oss) against transformers' own GptOssForCausalLM on tiny random
checkpoints written by save_pretrained and read back through the family (dflash2.families.gpt_oss): prefill logits
and taps with a prompt 5x the sliding window, greedy decoding over 64 tokens past the window, float and MXFP4
experts (the decode bit-exact against transformers' dequantization), YaRN's frequencies and attention factor
against transformers' (truncate true / false / absent), the SwiGLU clamp and the sinks shown to matter; the config
reader's refusals and the checkpoint check's dtype rule."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GptOssConfig as HfConfig, GptOssForCausalLM  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from dflash2 import families  # noqa: E402
from dflash2.checkpoint import check_target_tensors  # noqa: E402
from dflash2.errors import CheckpointError  # noqa: E402
from dflash2.reference.gpt_oss import GptOssTarget, decode_mxfp4, load_target, quantize_mxfp4  # noqa: E402
from dflash2.reference.layers import rope_inv_freq  # noqa: E402
from dflash2.tiny import write_safetensors  # noqa: E402

TOL = 1e-4
WINDOW, VOCAB = 8, 256
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def hf_config(**over) -> HfConfig:
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
              max_position_embeddings=2048, eos_token_id=1, pad_token_id=0, rope_parameters=dict(YARN))
    kw.update(over)
    return HfConfig(**kw)


_CACHE: dict = {}


def pair(name: str, tmp_path_factory):
    """(transformers model, the reference with every layer tapped, its folder). Experts and router at std 0.5 and
    sinks at std 1 (transformers' 0.02 makes routing, the clamp and the sinks irrelevant); "mxfp4": the same float
    checkpoint's experts x25 (so the clamp at 7 is hit) written as MXFP4 blocks / scales."""
    if name not in _CACHE:
        torch.manual_seed(1234)
        hf = GptOssForCausalLM(hf_config()).eval()
        with torch.no_grad():
            for n, p in hf.named_parameters():
                if ("experts" in n and not n.endswith("bias")) or "router.weight" in n:
                    p.normal_(0, 0.5)
                elif "sinks" in n:
                    p.normal_(0, 1.0)
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder)
        if name == "mxfp4":
            from safetensors.torch import load_file

            tensors = load_file(str(folder / "model.safetensors"))
            for k in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
                tensors[k + "_blocks"], tensors[k + "_scales"] = quantize_mxfp4(tensors.pop(k) * 25)
            (folder / "model.safetensors").unlink()
            write_safetensors(folder, tensors)
            raw = json.loads((folder / "config.json").read_text())
            raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
            (folder / "config.json").write_text(json.dumps(raw))
            hf = GptOssForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        fam, c = families.load(folder)
        assert fam.name == "gpt_oss" and c.expert_format == ("mxfp4" if name == "mxfp4" else "float")
        _CACHE[name] = (hf, load_target(folder, tuple(range(c.num_layers)), config=c), folder)
    return _CACHE[name]


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def run(ref, ids):
    return ref(ids, torch.zeros(0, *ref.kv_row_shape()))


@pytest.mark.parametrize("name", ["float", "mxfp4"])
def test_prefill_logits_and_taps_match_transformers(name, tmp_path_factory):
    hf, ref, _ = pair(name, tmp_path_factory)
    ids = prompt(5 * WINDOW)
    with torch.no_grad():
        out = hf(input_ids=ids[None], output_hidden_states=True)
        logits, taps, _ = run(ref, ids)
    scale = max(1.0, out.logits.abs().max().item())
    d = (out.logits[0] - logits).abs().max().item()
    assert d < TOL * scale, f"prefill logits differ by {d:.2e} (scale {scale:.1f})"
    H = ref.config.hidden_size
    for i in range(ref.config.num_layers - 1):  # transformers' last hidden_states entry is the final-normed state
        want = out.hidden_states[i + 1][0]
        d = (want - taps[:, i * H:(i + 1) * H]).abs().max().item()
        assert d < TOL * max(1.0, want.abs().max().item()), f"tap {i} differs by {d:.2e}"


@pytest.mark.parametrize("name", ["float", "mxfp4"])
def test_greedy_64_tokens_past_the_window_equal_generate(name, tmp_path_factory):
    hf, ref, _ = pair(name, tmp_path_factory)
    ids = prompt(3 * WINDOW, seed=3)
    with torch.no_grad():
        want = hf.generate(ids[None], do_sample=False, max_new_tokens=64, min_new_tokens=64, pad_token_id=0)
        want = want[0, ids.shape[0]:].tolist()
        logits, _, past = run(ref, ids)
        got = [int(logits[-1].argmax())]
        while len(got) < 64:
            lg, _, kv = ref(torch.tensor(got[-1:]), past)
            past = torch.cat([past, kv])
            got.append(int(lg[0].argmax()))
    assert got == want
    assert len(set(got)) > 8  # not one id repeated


def test_mxfp4_decode_equals_transformers_dequantization_bitwise(tmp_path_factory):
    hf, ref, _ = pair("mxfp4", tmp_path_factory)
    for i in range(ref.config.num_layers):
        theirs, ours = hf.model.layers[i].mlp.experts, ref.layers[i].mlp.experts
        assert torch.equal(theirs.gate_up_proj, ours.gate_up_proj) and torch.equal(theirs.down_proj, ours.down_proj)


def test_mxfp4_round_trip_is_exact_on_representable_values():
    """decode(quantize(w)) == w when w is already MXFP4 (codes times a power of two per 32 values)."""
    g = torch.Generator().manual_seed(0)
    w = decode_mxfp4(torch.randint(0, 256, (2, 8, 2, 16), dtype=torch.uint8, generator=g),
                     torch.randint(120, 135, (2, 8, 2), dtype=torch.uint8, generator=g))
    assert torch.equal(decode_mxfp4(*quantize_mxfp4(w)), w)


def test_the_clamp_is_hit_and_matters(tmp_path_factory):
    """The MXFP4 pair's experts (x25) drive gate / up past the limit 7; the reference without the clamp disagrees."""
    hf, ref, _ = pair("mxfp4", tmp_path_factory)
    ids = prompt(2 * WINDOW, seed=4)
    layer = ref.layers[0]
    with torch.no_grad():
        u = layer.post_attention_layernorm(layer(ref.embed(ids), *(torch.zeros(0, 2, 16),) * 2,
                                                 *_cos_sin(ref, ids.shape[0]), ref.layer_masks(
                                                     torch.arange(ids.shape[0]), torch.arange(ids.shape[0]))[0])[0])
        gu = u @ layer.mlp.experts.gate_up_proj[0] + layer.mlp.experts.gate_up_proj_bias[0]
        assert gu.abs().max().item() > 7
        want = hf(input_ids=ids[None]).logits[0]
        unclamped = GptOssTarget(dataclasses.replace(ref.config, swiglu_limit=1e9)).eval()
        unclamped.load_state_dict(ref.state_dict())
        assert (want - run(unclamped, ids)[0]).abs().max().item() > 100 * TOL * want.abs().max().item()


def _cos_sin(ref, n):
    from dflash2.reference.layers import rope_cos_sin

    return rope_cos_sin(torch.arange(n), ref.inv_freq)


@pytest.mark.parametrize("change", ["no sinks", "no window"])
def test_sinks_and_window_matter(change, tmp_path_factory):
    hf, ref, _ = pair("float", tmp_path_factory)
    other = GptOssTarget(dataclasses.replace(ref.config, layer_types=("full_attention",) * 4)
                         if change == "no window" else ref.config).eval()
    state = ref.state_dict()
    if change == "no sinks":  # a sink of -inf carries no weight
        state = {k: torch.full_like(v, -1e30) if k.endswith("sinks") else v for k, v in state.items()}
    other.load_state_dict(state)
    ids = prompt(3 * WINDOW, seed=7)
    with torch.no_grad():
        want = hf(input_ids=ids[None]).logits[0]
        d = (want - run(other, ids)[0]).abs().max().item()
    assert d > 100 * TOL * want.abs().max().item(), f"{change}: still within {d:.2e}"


@pytest.mark.parametrize("truncate", [True, False, None])
@pytest.mark.parametrize("factor, orig", [(32.0, 64), (4.0, 512), (1.0, 2048)])
def test_yarn_matches_transformers(truncate, factor, orig, tmp_path):
    rope = dict(YARN, factor=factor, original_max_position_embeddings=orig)
    if truncate is None:
        del rope["truncate"]
    else:
        rope["truncate"] = truncate
    hc = hf_config(rope_parameters=rope)
    inv, attention = ROPE_INIT_FUNCTIONS["yarn"](hc)
    raw = {**json.loads(json.dumps(hc.to_dict())), "architectures": ["GptOssForCausalLM"]}
    c = families.by_name("gpt_oss").read_config(tmp_path / "config.json", raw, "GptOssForCausalLM")
    assert c.rope.truncate is (truncate is not False)
    assert torch.equal(rope_inv_freq(c.rope, c.head_dim), inv) and c.rope.attention_factor == attention


def _raw(**changes) -> dict:
    raw = {**json.loads(json.dumps(hf_config().to_dict())), "architectures": ["GptOssForCausalLM"]}
    raw.update(changes)
    return raw


@pytest.mark.parametrize("change, field", [
    ({"attention_bias": False}, "attention_bias"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ({"sliding_window": None}, "sliding_window"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, "rope_parameters.rope_type"),
    ({"rope_parameters": {**YARN, "factor": None}}, "rope_parameters.factor"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantization_config.quant_method"),
    ({"quantization_config": {"quant_method": "mxfp4"}, "intermediate_size": 48}, "intermediate_size"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
])
def test_config_reader_names_file_field_expected_found(change, field, tmp_path):
    path = tmp_path / "config.json"
    with pytest.raises(CheckpointError) as e:
        families.by_name("gpt_oss").read_config(path, _raw(**change), "GptOssForCausalLM")
    assert f"{path}: {field}: expected" in str(e.value), str(e.value)


def test_integer_tensors_only_where_mxfp4_puts_them(tmp_path_factory, tmp_path):
    """The MXFP4 checkpoint passes the checkpoint check (its U8 blocks / scales declared); a U8 tensor anywhere else,
    or float bytes where the blocks belong, is refused naming the tensor."""
    _, ref, folder = pair("mxfp4", tmp_path_factory)
    check_target_tensors(folder, ref.config)
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    for name, bad in (("model.layers.0.self_attn.sinks", torch.uint8),
                      ("model.layers.0.mlp.experts.down_proj_scales", torch.float32)):
        broken = tmp_path / name.replace(".", "_")
        broken.mkdir()
        (broken / "config.json").write_text((folder / "config.json").read_text())
        write_safetensors(broken, {**tensors, name: tensors[name].to(bad)})
        with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
            check_target_tensors(broken, ref.config)


def test_the_20b_config_is_read():
    """gpt-oss-20b's config.json as published (rope_scaling, MXFP4): 24 layers, 32 experts top-4, about 21B
    parameters (its model card's figure)."""
    import math
    from pathlib import Path

    raw = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
           "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
           "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
           "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
           "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
           "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
           "output_router_logits": False, "pad_token_id": 199999,
           "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                              "model.embed_tokens", "lm_head"],
                                   "quant_method": "mxfp4"},
           "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                   "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                   "truncate": False},
           "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
           "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088}
    fam = families.by_name("gpt_oss")
    c = fam.read_config(Path("/absent/config.json"), raw, "GptOssForCausalLM")
    assert (c.expert_format, c.num_experts, c.rope.theta, c.rope.truncate, c.sliding_window) == \
        ("mxfp4", 32, 150000.0, False, 128)
    shapes = fam.tensor_shapes(c)
    params = sum(math.prod(s) * (2 if k.endswith("_blocks") else 1) for k, s in shapes.items()
                 if not k.endswith("_scales"))
    assert round(params / 1e9, 1) == 20.9


def test_training_refuses_it_in_one_line(tmp_path):
    """Exportable (tests/test_gpt_oss_export.py), not trainable yet: dflash2-train refuses the family with its
    one-line reason, before anything is written."""
    from dflash2 import tiny
    from dflash2.train.api import run_training
    from dflash2.train.options import TrainOptions

    target = tiny.make_target(tmp_path / "target", family="gpt_oss")
    why = families.by_name("gpt_oss").not_trainable
    with pytest.raises(CheckpointError) as e:
        run_training(TrainOptions(target=target, out=tmp_path / "trained", corpus=[tmp_path / "corpus"], steps=1))
    assert why in str(e.value) and "found 'GptOssForCausalLM'" in str(e.value) and "\n" not in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]


def test_mxfp4_converts_block_exactly_to_int8():
    """The int8 form a CPU export writes (codes in [-12, 12], one fp32 scale per 32): code * scale is the decode,
    bitwise, whatever the bytes."""
    from dflash2.reference.gpt_oss import mxfp4_to_int8

    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 8, 4), dtype=torch.uint8, generator=g)
    codes, scale = mxfp4_to_int8(blocks, scales)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) == 12 and scale.shape == (3, 8, 4)
    back = (codes.float().view(3, 8, 4, 32) * scale[..., None]).reshape(3, 8, 128).transpose(1, 2)
    assert torch.equal(back, decode_mxfp4(blocks, scales))


def test_make_tiny_writes_an_mxfp4_checkpoint_transformers_reads(tmp_path):
    """tiny.make_target(extra={"quantization_config": {"quant_method": "mxfp4"}}): U8 blocks / scales where the family
    declares them; transformers dequantizes them to the reference's weights and computes its logits."""
    from dflash2 import tiny

    folder = tiny.make_target(tmp_path / "t", family="gpt_oss", intermediate_size=64,
                              extra={"quantization_config": {"quant_method": "mxfp4"}})
    fam, c = families.load(folder)
    assert c.expert_format == "mxfp4"
    check_target_tensors(folder, c)
    ref = load_target(folder, config=c)
    hf = GptOssForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert torch.equal(hf.model.layers[1].mlp.experts.down_proj, ref.layers[1].mlp.experts.down_proj)
    ids = prompt(3 * WINDOW)
    with torch.no_grad():
        want = hf(input_ids=ids[None]).logits[0]
        got = run(ref, ids)[0]
    assert (want - got).abs().max().item() < TOL * max(1.0, want.abs().max().item())


def test_the_norm_is_transformers_in_bf16():
    """GptOssRMSNorm takes (w * x) in fp32, then casts, where the Llama norm casts first: bitwise transformers' in
    bf16 (the export's 16-bit graphs follow it), and not the Llama norm's (so the test can fail)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm as HfNorm

    from dflash2.reference.gpt_oss import GptOssRMSNorm
    from dflash2.reference.layers import RMSNorm

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(64, generator=g) * 0.3 + 1, (torch.randn(16, 64, generator=g) * 3).to(torch.bfloat16)
    ours, hf, llama = GptOssRMSNorm(64, 1e-5), HfNorm(64, eps=1e-5), RMSNorm(64, 1e-5)
    for m in (ours, hf, llama):
        m.weight.data = w.clone()
        m.to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(ours(x), hf(x)) and not torch.equal(llama(x), hf(x))
