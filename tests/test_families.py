"""The target-family contract (dflash2/families/): every registered family declares what the stages read and
keeps it consistent: architectures claimed once, state kinds known, taps in range, the tiny maker's checkpoint
accepted by the family's own config reader, its tensor set exactly what its PyTorch reference loads and what
transformers' class loads; parts named in the stage that owns them; the registry torch-free; a family without
export templates refused by dflash2-export in one line before anything is written; make-tiny + export of
the hybrid family from the command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dflash2 import families, tiny
from dflash2.checkpoint import read_headers
from dflash2.config import load_target_config
from dflash2.errors import CheckpointError

NAMES = [f.name for f in families.FAMILIES]


@pytest.fixture(scope="module")
def tiny_targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: tiny.make_target(root / name, family=name) for name in NAMES}


def test_every_architecture_is_claimed_once_and_names_are_unique():
    archs = [a for f in families.FAMILIES for a in f.archs]
    assert len(archs) == len(set(archs))
    assert len(NAMES) == len(set(NAMES))
    assert families.exportable_archs() == ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3_5ForCausalLM",
                                           "Qwen3_5ForConditionalGeneration", "Qwen3MoeForCausalLM",
                                           "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration",
                                           "MuseGlimmerForConditionalGeneration", "GptOssForCausalLM")
    for f in families.FAMILIES:
        assert all(families.by_arch(a) is f for a in f.archs)
        assert families.by_name(f.name) is f
    with pytest.raises(KeyError, match="known: llama, qwen3, qwen3_5"):
        families.by_name("gpt2")


def test_parts_live_in_the_stage_that_owns_them():
    for f in families.FAMILIES:
        assert f.reference.startswith("dflash2.reference."), f.name
        assert set(f.templates) <= set(families.OP_SETS), f.name
        assert all(p.startswith("dflash2.export.") for p in f.templates.values()), f.name


def test_the_dtypes_a_family_declares_are_ones_its_templates_write():
    """TargetFamily.dtypes (what the plan lets through) within what the family's standard-op builder takes."""
    import importlib

    from dflash2.dtypes import GRAPH_DTYPES

    for f in families.FAMILIES:
        assert f.dtypes and set(f.dtypes) <= set(GRAPH_DTYPES), f.name
        if "plain" in f.templates:
            module = importlib.import_module(f.templates["plain"].split(":")[0])
            assert set(f.dtypes) <= set(module.DTYPES), f.name


@pytest.mark.parametrize("name", NAMES)
def test_tiny_checkpoint_is_read_by_its_family(tiny_targets, name):
    fam, c = families.load(tiny_targets[name])
    assert fam.name == name
    states = fam.layer_states(c)
    assert len(states) == c.num_layers
    assert all(kinds and set(kinds) <= set(families.STATE_KINDS) for kinds in states)
    assert "kv" in fam.state_kinds(c)  # every family so far has attention layers
    taps = fam.tap_points(c)
    assert taps and all(0 <= t < c.num_layers for t in taps)
    held = {k: tuple(s) for k, (_, s) in read_headers(tiny_targets[name]).items()}
    if fam.extra_tensors is not None:  # a vision tower: written for transformers, not the target, skipped by name
        extra = fam.extra_tensors(json.loads((tiny_targets[name] / "config.json").read_text()))
        assert extra and all(k.startswith(fam.ignored) for k in extra)
        held = {k: s for k, s in held.items() if k not in extra}
    assert held == fam.tensor_shapes(c)


def test_qwen3_5_layers_carry_kv_or_conv_and_recurrent_state(tiny_targets):
    fam, c = families.load(tiny_targets["qwen3_5"])
    assert fam.layer_states(c) == (("conv", "recurrent"), ("kv",), ("conv", "recurrent"), ("kv",))
    assert fam.state_kinds(c) == {"kv", "conv", "recurrent"}


@pytest.mark.parametrize("name", NAMES)
def test_tiny_checkpoint_loads_into_the_reference_and_transformers(tiny_targets, name):
    fam, c = families.load(tiny_targets[name])
    ref = families.resolve(fam.reference)(tiny_targets[name], tap_ids=(1,))
    assert isinstance(ref, torch.nn.Module)
    transformers = pytest.importorskip("transformers")
    _, info = getattr(transformers, fam.hf_class).from_pretrained(tiny_targets[name], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


@pytest.mark.parametrize("name", NAMES)
def test_tiny_checkpoint_reference_matches_transformers(tiny_targets, name):
    """The tiny maker's weights mean the same to the family's reference and to transformers (prefill logits)."""
    transformers = pytest.importorskip("transformers")
    fam, c = families.load(tiny_targets[name])
    ref = families.resolve(fam.reference)(tiny_targets[name])
    hf = getattr(transformers, fam.hf_class).from_pretrained(tiny_targets[name], dtype=torch.float32).eval()
    ids = torch.arange(3, 3 + 12) % c.vocab_size
    with torch.no_grad():
        if fam.state_kinds(c) == {"kv"}:
            past = torch.zeros(0, c.num_layers, 2, c.num_kv_heads, c.head_dim)
            logits = ref(ids, past)[0]
        else:
            logits = ref(ids, ref.empty_state())[0]
        want = hf(ids[None]).logits[0]
    scale = max(1.0, want.abs().max().item())  # fp32 rounding grows with the logits' size (22 for qwen3_5_moe's)
    assert torch.allclose(logits, want, atol=1e-4 * scale, rtol=1e-4), (logits - want).abs().max()


@pytest.mark.parametrize("name", [n for n in NAMES if families.by_name(n).exportable])
def test_exportable_families_read_through_load_target_config(tiny_targets, name):
    tc = load_target_config(tiny_targets[name])
    assert tc.family == name and getattr(tc, "qk_norm", None) == {"llama": False, "qwen3": True,
                                                                  "qwen3_moe": True}.get(name)


def test_unknown_architecture_names_what_is_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match=r"architectures: expected one of \['GptOssForCausalLM', "
                                              r"'LlamaForCausalLM', 'MuseGlimmerForConditionalGeneration', "
                                              r"'Qwen3ForCausalLM', 'Qwen3MoeForCausalLM', 'Qwen3_5ForCausalLM', "
                                              r"'Qwen3_5ForConditionalGeneration', 'Qwen3_5MoeForCausalLM', "
                                              r"'Qwen3_5MoeForConditionalGeneration'\], found 'GPT2LMHeadModel' "
                                              r"\(unsupported"):
        load_target_config(tmp_path)


def test_make_tiny_qwen3_5_then_export_from_the_command_line(tmp_path):
    pair = tmp_path / "pair"  # dflash2-make-tiny --family qwen3_5: the target and a drafter for it
    r = subprocess.run([sys.executable, "-m", "dflash2.cli.make_tiny", "--out", str(pair), "--family", "qwen3_5"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads((pair / "target" / "config.json").read_text())["architectures"] == ["Qwen3_5ForCausalLM"]
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "dflash2.cli.export", "--target", str(pair / "target"),
                        "--model", str(pair / "drafter"), "--out", str(out), "--max-seq-len", "128"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "manifest.json").read_text())["graphs"]["target"]["signature"]["state"]["kind"] == "rows"


def test_export_refuses_a_family_without_templates_before_writing(tmp_path, monkeypatch):
    """A registered family without layer templates (a reference-only family) is refused in one line naming the
    architectures that export, before anything is written."""
    import dataclasses

    from dflash2 import tiny

    target = tiny.make_target(tmp_path / "target", family="qwen3_5")
    drafter = tiny.make_drafter(tmp_path / "drafter", target)
    bare = dataclasses.replace(families.by_name("qwen3_5"), templates={})
    monkeypatch.setattr(families, "FAMILIES", tuple(bare if f.name == "qwen3_5" else f for f in families.FAMILIES))
    from dflash2.export.api import export

    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as e:
        export(drafter, target, out, quiet=True)
    supported = "['GptOssForCausalLM', 'LlamaForCausalLM', 'MuseGlimmerForConditionalGeneration', " \
                "'Qwen3ForCausalLM', 'Qwen3MoeForCausalLM', 'Qwen3_5MoeForCausalLM', " \
                "'Qwen3_5MoeForConditionalGeneration']"
    assert "'Qwen3_5ForCausalLM' (qwen3_5, hybrid Gated DeltaNet: reference and tiny checkpoints only; export" \
           in str(e.value) and supported in str(e.value), str(e.value)
    assert not out.exists() and not list(tmp_path.glob("out*"))


def test_the_registry_imports_neither_torch_nor_onnx():
    code = ("import sys, dflash2.families as F; [F.load, F.by_arch]; "
            "bad = [m for m in ('torch', 'onnx', 'transformers') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
