"""The Qwen3-MoE reference (dflash2.reference.target with dflash2.reference.moe's SparseMoE on the sparse layers)
against transformers' own Qwen3MoeForCausalLM on tiny random checkpoints written by save_pretrained and read back
through the family (dflash2.families.qwen3_moe): prefill logits, taps, greedy decoding over 64 tokens; expert
counts 4 / 8, top-k 1 / 2, norm_topk_prob on / off, decoder_sparse_step and mlp_only_layers; the config reader's
refusals; dflash2-make-tiny's checkpoint loads in transformers."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from dflash2 import families, tiny  # noqa: E402
from dflash2.errors import CheckpointError  # noqa: E402
from dflash2.reference.load import load_target  # noqa: E402
from dflash2.reference.moe import SparseMoE  # noqa: E402

TOL = 1e-4  # fp32 prefill logits / taps vs transformers

# name: (experts, top_k, norm_topk_prob, decoder_sparse_step, mlp_only_layers, tied)
SHAPES = {
    "e4-k2-norm": (4, 2, True, 1, [], False),
    "e8-k1-step2": (8, 1, False, 2, [], False),
    "e8-k2-only0-tied": (8, 2, False, 1, [0], True),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def hf_config(name: str) -> Qwen3MoeConfig:
    E, k, norm, step, only, tied = SHAPES[name]
    return Qwen3MoeConfig(vocab_size=211, hidden_size=48, intermediate_size=80, moe_intermediate_size=24,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_experts=E, num_experts_per_tok=k, norm_topk_prob=norm, decoder_sparse_step=step,
                          mlp_only_layers=only, tie_word_embeddings=tied, initializer_range=0.1)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Norm weights off 1, and the routers 5x sharper, so every row's choice of experts is decisive and the rows
    of a prompt spread over the experts (checked by test_routing_spreads_over_experts)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):
                p.mul_(5.0)


_CACHE: dict = {}


def pair(name: str, tmp_path_factory):
    """(transformers model, the reference loaded from its save_pretrained folder with every layer tapped)."""
    if name not in _CACHE:
        torch.manual_seed(1234)
        hf = Qwen3MoeForCausalLM(hf_config(name)).eval()
        randomize(hf, 7)
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder)
        fam, c = families.load(folder)
        assert fam.name == "qwen3_moe"
        _CACHE[name] = (hf, load_target(folder, tuple(range(c.num_layers)), config=c), folder)
    return _CACHE[name]


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 211, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(SHAPES))
def test_prefill_logits_and_taps_match_transformers(name, tmp_path_factory):
    hf, ref, _ = pair(name, tmp_path_factory)
    ids = prompt(24)
    with torch.no_grad():
        out = hf(ids[None], output_hidden_states=True)
        logits, taps, kv = ref(ids, torch.zeros(0, *ref.kv_row_shape()))
    d = (out.logits[0] - logits).abs().max().item()
    assert d < TOL, f"prefill logits differ by {d:.2e}"
    H = ref.config.hidden_size
    for i in range(ref.config.num_layers - 1):  # transformers' last hidden_states entry is post-norm
        d = (out.hidden_states[i + 1][0] - taps[:, i * H:(i + 1) * H]).abs().max().item()
        assert d < TOL * max(1.0, out.hidden_states[i + 1].abs().max().item()), f"tap {i} differs by {d:.2e}"
    assert kv.shape == (24, *ref.kv_row_shape())


@pytest.mark.parametrize("name", list(SHAPES))
def test_greedy_64_tokens_equal_generate(name, tmp_path_factory):
    hf, ref, _ = pair(name, tmp_path_factory)
    ids = prompt(12, seed=3)
    with torch.no_grad():
        want = hf.generate(ids[None], do_sample=False, max_new_tokens=64, min_new_tokens=64, pad_token_id=0)[0, 12:]
        logits, _, past = ref(ids, torch.zeros(0, *ref.kv_row_shape()))
        got = [int(logits[-1].argmax())]
        while len(got) < 64:
            lg, _, kv = ref(torch.tensor(got[-1:]), past)
            past = torch.cat([past, kv])
            got.append(int(lg[0].argmax()))
    assert got == want.tolist()


@pytest.mark.parametrize("name", list(SHAPES))
def test_layers_are_sparse_where_transformers_puts_experts(name, tmp_path_factory):
    hf, ref, _ = pair(name, tmp_path_factory)
    theirs = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    ours = [isinstance(layer.mlp, SparseMoE) for layer in ref.layers]
    assert ours == theirs and any(ours) and (name == "e4-k2-norm" or not all(ours))


def test_routing_spreads_over_experts(tmp_path_factory):
    """The parity above is not a one-expert accident: a 24-row prompt's rows pick every expert somewhere."""
    _, ref, _ = pair("e8-k2-only0-tied", tmp_path_factory)
    moe = ref.layers[1].mlp
    x = torch.randn(24, ref.config.hidden_size, generator=torch.Generator().manual_seed(5))
    _, idx = moe.route(x)
    assert len(torch.unique(idx)) == 8


@pytest.mark.parametrize("change, field", [
    ({"num_local_experts": 0}, "num_local_experts"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"moe_intermediate_size": "24"}, "moe_intermediate_size"),
    ({"mlp_only_layers": [4]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"num_experts": 4}, "num_local_experts"),  # both spellings, disagreeing
    ({"norm_topk_prob": 1}, "norm_topk_prob"),
])
def test_config_reader_names_file_field_expected_found(change, field, tmp_path):
    raw = {**json.loads(json.dumps(hf_config("e8-k2-only0-tied").to_dict())), "architectures": ["Qwen3MoeForCausalLM"]}
    raw.update(change)
    path = tmp_path / "config.json"
    with pytest.raises(CheckpointError) as e:
        families.by_name("qwen3_moe").read_config(path, raw, "Qwen3MoeForCausalLM")
    assert field in str(e.value) and str(path) in str(e.value)


def test_make_tiny_checkpoint_loads_in_transformers(tmp_path):
    """dflash2-make-tiny --family qwen3_moe: transformers reads the folder without a missing or unexpected
    tensor and computes the reference's logits."""
    folder = tiny.make_target(tmp_path / "t", family="qwen3_moe", vocab_size=300, hidden_size=32,
                              intermediate_size=64, num_layers=2)
    _, c = families.load(folder)
    hf, info = Qwen3MoeForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = prompt(10)
    with torch.no_grad():
        want = hf.eval()(ids[None]).logits[0]
        got, _, _ = load_target(folder, config=c)(ids, torch.zeros(0, c.num_layers, 2, c.num_kv_heads, c.head_dim))
    assert (want - got).abs().max().item() < TOL and c.sparse_layers == (0, 1)


def test_the_published_30b_a3b_config_is_read():
    """Qwen3-30B-A3B's config.json as published (`num_experts`, per-expert tensors): 30.5B parameters, 3.3B of them
    active per token (its model card's figures)."""
    import math
    from pathlib import Path

    raw = {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
           "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
           "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960, "mlp_only_layers": [],
           "model_type": "qwen3_moe", "moe_intermediate_size": 768, "norm_topk_prob": True,
           "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
           "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
           "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936}
    fam = families.by_name("qwen3_moe")
    c = fam.read_config(Path("/absent/config.json"), raw, raw["architectures"][0])
    assert c.sparse_layers == tuple(range(48)) and c.norm_topk_prob and c.num_experts == 128
    shapes = fam.tensor_shapes(c)
    total = sum(math.prod(s) for s in shapes.values())
    active = total - sum(math.prod(s) for k, s in shapes.items() if ".experts." in k) + 48 * 8 * 3 * 768 * 2048
    assert round(total / 1e9, 1) == 30.5 and 3.3e9 < active < 3.4e9
