"""The built-in default: SmolLM2-135M-Instruct + the shipped DFlash2 drafter, through the exported
graphs on ONNX Runtime. Lossless on every shipped prompt (speculative ids == target-only ids)."""

import json

import pytest

from dflash2.cli.demo import default_drafter
from dflash2.config import load_drafter_config

DRAFTER = default_drafter()


def test_shipped_drafter_is_a_small_dflash2_checkpoint():
    cfg = load_drafter_config(DRAFTER)
    assert cfg.version == 2 and cfg.num_target_layers == 30 and cfg.hidden_size == 576
    assert (DRAFTER / "model.safetensors").stat().st_size <= 25 * 1024 * 1024
    assert (DRAFTER / "RECIPE.md").is_file() and (DRAFTER / "training.json").is_file()


@pytest.fixture(scope="module")
def default_export(tmp_path_factory):
    from dflash2.export.api import export
    from dflash2.models import smollm2

    target = smollm2.prepare()  # scripts/setup.sh installs the weights; missing ones are an error here

    out = tmp_path_factory.mktemp("default") / "export"
    export(DRAFTER, target, out, quiet=True)
    return out


@pytest.mark.slow
def test_lossless_on_every_shipped_prompt(default_export):
    from dflash2.prompts import default_prompts
    from dflash2.runtime.bench import bench

    r = bench(default_export, default_prompts(), max_new_tokens=64).to_dict()
    print("\n" + json.dumps({k: r[k] for k in ("acceptance_length", "speedup", "lossless")}))
    assert r["lossless"] and r["prompts"] == len(default_prompts())
    assert all(v["ok"] for v in json.loads((default_export / "manifest.json").read_text())["validation"].values())
