"""Malformed configs and checkpoints: each rejected with its own message naming file and field."""

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from dflash2 import tiny
from dflash2.errors import CheckpointError, TensorSetError
from dflash2.reference.load import load_pair


@pytest.fixture()
def pair(tmp_path, targets):
    target = tmp_path / "target"
    shutil.copytree(targets["llama"], target)
    drafter = tiny.make_drafter(tmp_path / "drafter", target, version=2)
    return drafter, target


def edit(folder, **changes):
    p = folder / "config.json"
    cfg = json.loads(p.read_text())
    for k, v in changes.items():
        if k.startswith("dc_"):
            cfg["dflash_config"][k[3:]] = v
        elif v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    p.write_text(json.dumps(cfg))


def edit_tensors(folder, fn):
    f = folder / "model.safetensors"
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f))


CASES = {
    "not_a_folder": (lambda d, t: shutil.rmtree(d), r"no such directory"),
    "no_config": (lambda d, t: (d / "config.json").unlink(), r"config\.json: expected a config\.json file"),
    "bad_json": (lambda d, t: (d / "config.json").write_text("{oops"), r"expected valid JSON, found a parse error"),
    "target_arch": (lambda d, t: edit(t, architectures=["GPT2LMHeadModel"]),
                    r"target.*architectures: expected one of .*LlamaForCausalLM.*found 'GPT2LMHeadModel'"),
    "drafter_arch": (lambda d, t: edit(d, architectures=["EagleModel"]),
                     r"drafter.*architectures: expected one of \['DFlash2DraftModel', 'DFlashDraftModel', "
                     r"'MuseGlimmerAssistantModel'\]"),
    "missing_field": (lambda d, t: edit(t, hidden_size=None), r"hidden_size: expected an integer, found the field missing"),
    "hidden_mismatch": (lambda d, t: edit(d, hidden_size=48, head_dim=12),
                        r"drafter hidden_size 48 != target hidden_size 64 \(drafter .*drafter/config.json, target .*target/config"),
    "vocab_mismatch": (lambda d, t: edit(d, vocab_size=999), r"drafter vocab_size 999 != target vocab_size \d+ "),
    "tap_out_of_range": (lambda d, t: edit(d, dc_target_layer_ids=[1, 4]),
                         r"target_layer_ids: expected layer ids in \[0, 3\].*found \[4\]"),
    "block_size": (lambda d, t: edit(d, block_size=1, dc_block_size=1), r"block_size: expected >= 2, found 1"),
    "top_k_vs_vocab": (lambda d, t: edit(d, dc_selector_top_k=100000), r"selector_top_k: expected <= vocab_size"),
    "rank": (lambda d, t: edit(d, dc_selector_rank=0), r"selector_rank: expected >= 1, found 0"),
    "mask_id": (lambda d, t: edit(d, dc_mask_token_id=10 ** 6), r"mask_token_id: expected < vocab_size"),
    "kv_heads": (lambda d, t: edit(t, num_key_value_heads=3), r"num_key_value_heads: expected a divisor of num_attention_heads=4, found 3"),
    "group_size": (lambda d, t: edit(d, dc_conv_group_size=7), r"conv_group_size: expected a divisor of hidden_size=64"),
    "num_target_layers": (lambda d, t: edit(d, num_target_layers=9, dc_target_layer_ids=[1, 2]),
                          r"drafter num_target_layers 9 != target num_hidden_layers 4 "),
    "rope": (lambda d, t: edit(t, rope_scaling={"rope_type": "yarn", "factor": 4.0}), r"rope_type: expected one of"),
    "layer_types": (lambda d, t: edit(d, layer_types=["full_attention", "other"]), r"layer_types: expected 1 entries"),
    "pickle_only": (lambda d, t: ((d / "model.safetensors").rename(d / "pytorch_model.bin")),
                    r"found \['pytorch_model.bin'\] \(pickle weights are not loaded"),
    "missing_shard": (lambda d, t: (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"fc.weight": "model-00002.safetensors"}})), r"missing \['model-00002.safetensors'\]"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_is_rejected_with_its_message(pair, case):
    drafter, target = pair
    breaker, match = CASES[case]
    breaker(drafter, target)
    with pytest.raises(CheckpointError, match=match):
        load_pair(drafter, target)


def test_tensor_problems_listed_all_at_once(pair):
    drafter, target = pair

    def mutate(t):
        t.pop("fc.weight")
        t.pop("layers.0.mlp.up_proj.weight")
        t["layers.0.extra.weight"] = t["norm.weight"].clone()
        t["candidate_selector.successor_codebook"] = t["candidate_selector.successor_codebook"][:, :3].contiguous()

    edit_tensors(drafter, mutate)
    with pytest.raises(TensorSetError) as e:
        load_pair(drafter, target)
    msg = str(e.value)
    assert "missing (2): fc.weight, layers.0.mlp.up_proj.weight" in msg
    assert "unexpected (1): layers.0.extra.weight" in msg
    assert "mis-shaped: candidate_selector.successor_codebook: expected [" in msg and ", 3]" in msg


def test_target_missing_tensor_named(pair):
    drafter, target = pair
    edit_tensors(target, lambda t: t.pop("model.layers.2.self_attn.k_proj.weight"))
    with pytest.raises(TensorSetError, match=r"missing \(1\): model.layers.2.self_attn.k_proj.weight"):
        load_pair(drafter, target)
