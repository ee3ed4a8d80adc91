"""The Qwen3.5-MoE reference (dflash2.reference.qwen3_5_moe: the Qwen3.5 hybrid with dflash2.reference.moe's
SparseMoE + shared expert) against transformers' Qwen3_5MoeForCausalLM on tiny random checkpoints read back
through the family (dflash2.families.qwen3_5_moe): prefill logits and taps, greedy decoding over 64 tokens through
the reference's state; expert counts 4 / 8, top-k 1 / 2; both expert layouts (per expert as save_pretrained
writes, fused as the published checkpoints hold) under both architectures; the reader's refusals."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402

from dflash2 import families, tiny  # noqa: E402
from dflash2.errors import CheckpointError  # noqa: E402
from dflash2.reference.qwen3_5 import commit  # noqa: E402
from dflash2.reference.qwen3_5_moe import load_target  # noqa: E402

TOL = 1e-4

# name: (experts, top_k, shared width, tied)
SHAPES = {"e4-k2": (4, 2, 40, False), "e8-k1-tied": (8, 1, 24, True), "e8-k2": (8, 2, 64, False)}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def hf_config(name: str) -> Qwen3_5MoeTextConfig:
    E, k, S, tied = SHAPES[name]
    return Qwen3_5MoeTextConfig(
        vocab_size=211, hidden_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=S,
        num_experts=E, num_experts_per_tok=k, num_hidden_layers=4, full_attention_interval=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=tied,
        initializer_range=0.1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
                                                "mrope_interleaved": True})


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Norms, dt_bias, A_log off their constants; routers 5x sharper (decisive, spread routing); the shared
    expert's gate 5x so sigmoid() is not ~0.5 everywhere."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name or "A_log" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight"):
                p.mul_(5.0)


def fuse(folder) -> None:
    """Rewrite a save_pretrained folder as the published checkpoints are: the wrapper architecture (text under
    text_config, tensors under model.language_model.) and each layer's experts fused."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    out, experts = {}, {}
    for name, t in tensors.items():
        name = name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
        if ".mlp.experts." in name:
            p, rest = name.split(".mlp.experts.")
            e, m = rest.split(".")[:2]
            experts.setdefault(p, {}).setdefault(int(e), {})[m] = t
        else:
            out[name] = t
    for p, per in experts.items():
        E = len(per)
        out[f"{p}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([per[e]["gate_proj"], per[e]["up_proj"]])
                                                            for e in range(E)]).contiguous()
        out[f"{p}.mlp.experts.down_proj"] = torch.stack([per[e]["down_proj"] for e in range(E)]).contiguous()
    (folder / "model.safetensors").unlink()
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    wrapped = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
               "tie_word_embeddings": raw["tie_word_embeddings"], "text_config": raw}
    (folder / "config.json").write_text(json.dumps(wrapped))


_CACHE: dict = {}


def pair(name: str, tmp_path_factory, fused: bool = False):
    key = (name, fused)
    if key not in _CACHE:
        torch.manual_seed(1234)
        hf = Qwen3_5MoeForCausalLM(hf_config(name)).eval()
        randomize(hf, 7)
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder)
        if fused:
            fuse(folder)
        fam, c = families.load(folder)
        assert fam.name == "qwen3_5_moe" and c.fused_experts == fused
        _CACHE[key] = (hf, load_target(folder, tuple(range(c.num_layers)), config=c))
    return _CACHE[key]


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 211, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name, fused", [(n, False) for n in SHAPES] + [("e8-k2", True)])
def test_prefill_logits_and_taps_match_transformers(name, fused, tmp_path_factory):
    hf, ref = pair(name, tmp_path_factory, fused)
    ids = prompt(24)
    with torch.no_grad():
        out = hf(ids[None], output_hidden_states=True)
        logits, taps, _ = ref(ids, ref.empty_state())
    d = (out.logits[0] - logits).abs().max().item()
    assert d < TOL, f"prefill logits differ by {d:.2e}"
    H = ref.config.hidden_size
    for i in range(ref.config.num_layers - 1):
        d = (out.hidden_states[i + 1][0] - taps[:, i * H:(i + 1) * H]).abs().max().item()
        assert d < TOL * max(1.0, out.hidden_states[i + 1].abs().max().item()), f"tap {i} differs by {d:.2e}"


@pytest.mark.parametrize("name", list(SHAPES))
def test_greedy_64_tokens_equal_generate(name, tmp_path_factory):
    hf, ref = pair(name, tmp_path_factory)
    ids = prompt(12, seed=3)
    with torch.no_grad():
        want = hf.generate(ids[None], do_sample=False, max_new_tokens=64, min_new_tokens=64, pad_token_id=0)[0, 12:]
        logits, _, step = ref(ids, ref.empty_state())
        state = commit(ref.empty_state(), step, 12)
        got = [int(logits[-1].argmax())]
        while len(got) < 64:
            lg, _, step = ref(torch.tensor(got[-1:]), state)
            state = commit(state, step, 1)
            got.append(int(lg[0].argmax()))
    assert got == want.tolist()


def test_shared_expert_and_routing_both_matter(tmp_path_factory):
    """The parity above would notice a missing shared expert or a one-expert routing: each moves the output."""
    _, ref = pair("e8-k2", tmp_path_factory)
    moe = ref.layers[1].mlp
    x = torch.randn(24, ref.config.hidden_size, generator=torch.Generator().manual_seed(5))
    _, idx = moe.route(x)
    assert len(torch.unique(idx)) == 8
    with torch.no_grad():
        shared = torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
    assert shared.abs().max() > 0.1 * moe(x).abs().max()


@pytest.mark.parametrize("change, field", [
    ({"num_experts": 0}, "num_experts"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"shared_expert_intermediate_size": None}, "shared_expert_intermediate_size"),
    ({"moe_intermediate_size": 1.5}, "moe_intermediate_size"),
])
def test_config_reader_names_file_field_expected_found(change, field, tmp_path):
    raw = {**json.loads(json.dumps(hf_config("e4-k2").to_dict())), "architectures": ["Qwen3_5MoeForCausalLM"]}
    raw.update(change)
    path = tmp_path / "config.json"
    with pytest.raises(CheckpointError) as e:
        families.by_name("qwen3_5_moe").read_config(path, raw, "Qwen3_5MoeForCausalLM")
    assert field in str(e.value) and str(path) in str(e.value)


def test_the_dense_reader_points_the_moe_architecture_to_its_family(tmp_path):
    from dflash2.families.qwen3_5 import read_qwen3_5_config

    with pytest.raises(CheckpointError, match="read by the qwen3_5_moe family"):
        read_qwen3_5_config({"architectures": ["Qwen3_5MoeForCausalLM"]}, tmp_path / "config.json")


def test_make_tiny_checkpoint_loads_in_transformers(tmp_path):
    folder = tiny.make_target(tmp_path / "t", family="qwen3_5_moe", vocab_size=300, hidden_size=32,
                              intermediate_size=64, num_layers=2)
    hf, info = Qwen3_5MoeForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ref = load_target(folder)
    ids = prompt(10)
    with torch.no_grad():
        assert (hf.eval()(ids[None]).logits[0] - ref(ids, ref.empty_state())[0]).abs().max().item() < TOL


def test_the_published_35b_a3b_layout_is_read():
    """Qwen3.5-35B-A3B's text config (as published, under the wrapper) with its fused experts: the tensor names and
    shapes its index lists (`mlp.experts.gate_up_proj` [256, 1024, 2048], `mlp.experts.down_proj` [256, 2048, 512],
    no `.weight` suffix), about 34.7B text parameters (35B with the vision tower and the MTP head)."""
    import dataclasses
    import math
    from pathlib import Path

    text = {"hidden_size": 2048, "num_hidden_layers": 40, "full_attention_interval": 4, "num_attention_heads": 16,
            "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
            "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts": 256,
            "num_experts_per_tok": 8, "vocab_size": 248320,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10]}}
    raw = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "tie_word_embeddings": False, "text_config": text}
    fam = families.by_name("qwen3_5_moe")
    c = dataclasses.replace(fam.read_config(Path("/absent/config.json"), raw, raw["architectures"][0]),
                            fused_experts=True)  # (no safetensors beside the config: the layout is given here)
    shapes = fam.tensor_shapes(c)
    p = "model.language_model.layers.7.mlp."
    assert shapes[p + "experts.gate_up_proj"] == (256, 1024, 2048)
    assert shapes[p + "experts.down_proj"] == (256, 2048, 512)
    assert shapes[p + "shared_expert_gate.weight"] == (1, 2048) and shapes[p + "gate.weight"] == (256, 2048)
    assert 34.5e9 < sum(math.prod(s) for s in shapes.values()) < 34.8e9


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_streamed_reference_equals_the_loaded_one(fused, tmp_path_factory):
    """The layer-streamed reference (the export's, for targets past its memory budget) reads either expert layout
    an expert at a time (UnfusedExperts) and computes exactly the loaded reference."""
    from dflash2.checkpoint import Weights
    from dflash2.reference.streamed import StreamedQwen35MoeTarget, streamed_target

    torch.manual_seed(1234)
    hf = Qwen3_5MoeForCausalLM(hf_config("e4-k2")).eval()
    randomize(hf, 7)
    folder = tmp_path_factory.mktemp("streamed")
    hf.save_pretrained(folder)
    if fused:
        fuse(folder)
    _, c = families.load(folder)
    whole = load_target(folder, (1, 3), config=c)
    streamed = streamed_target(c, (1, 3), Weights(folder))
    assert isinstance(streamed, StreamedQwen35MoeTarget)
    ids = prompt(20)
    with torch.no_grad():
        a, b = whole(ids, whole.empty_state()), streamed(ids, streamed.empty_state())
    for x, y in zip((a[0], a[1], *a[2]), (b[0], b[1], *b[2])):
        assert torch.equal(x, y)
