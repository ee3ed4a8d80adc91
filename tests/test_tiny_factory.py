"""The tiny-checkpoint factory: deterministic, sharded loading, CLI, defaults of the config reader."""

import hashlib
import json
import subprocess
import sys

import torch

from dflash2 import tiny
from dflash2.config import default_target_layer_ids, load_drafter_config
from dflash2.reference.load import load_target


def digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_deterministic(tmp_path):
    a = tiny.make_target(tmp_path / "a", family="qwen3")
    b = tiny.make_target(tmp_path / "b", family="qwen3")
    assert digest(a) == digest(b)
    c = tiny.make_target(tmp_path / "c", family="qwen3", seed=1)
    assert digest(a)["model.safetensors"] != digest(c)["model.safetensors"]


def test_sharded_equals_single(tmp_path):
    one = load_target(tiny.make_target(tmp_path / "one", shards=1))
    three_dir = tiny.make_target(tmp_path / "three", shards=3)
    assert (three_dir / "model.safetensors.index.json").is_file()
    three = load_target(three_dir)
    for (k, v), (k2, v2) in zip(one.state_dict().items(), three.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)


def test_default_taps_and_attention_rules(tmp_path, targets):
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(30, 1) == (15,)
    d = tiny.make_drafter(tmp_path / "d", targets["qwen3"], version=2, num_layers=2,
                          extra={"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4})
    cfg = json.loads((d / "config.json").read_text())
    del cfg["dflash_config"]["target_layer_ids"], cfg["is_causal"]
    (d / "config.json").write_text(json.dumps(cfg))
    c = load_drafter_config(d)
    assert c.target_layer_ids == (1, 1)  # 4-layer target, 2 draft layers: z-lab's rule
    assert c.layer_causal == (True, False) and c.layer_window == (4, None)  # vLLM rule
    cfg["dflash_config"]["causal"] = False
    (d / "config.json").write_text(json.dumps(cfg))
    assert load_drafter_config(d).layer_causal == (False, False)


def test_cli(tmp_path):
    out = tmp_path / "pair"
    r = subprocess.run([sys.executable, "-m", "dflash2.cli.make_tiny", "--out", str(out), "--family", "qwen3",
                        "--drafter", "v1"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (out / "target" / "tokenizer.json").is_file() and (out / "drafter" / "config.json").is_file()
    assert json.loads((out / "drafter" / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
