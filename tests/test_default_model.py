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
    from dflash2.bench.bench import bench

    r = bench(default_export, default_prompts(), max_new_tokens=64).to_dict()
    print("\n" + json.dumps({k: r[k] for k in ("acceptance_length", "speedup", "lossless")}))
    assert r["lossless"] and r["prompts"] == len(default_prompts())
    assert all(v["ok"] for v in json.loads((default_export / "manifest.json").read_text())["validation"].values())


@pytest.mark.slow
def test_replayed_rounds_are_the_runtime_loops(default_export):
    """A trace recorded from the default export (the drafter at every position), replayed with a schedule, gives
    the rounds, accepted drafts and reused tails the runtime loop gives with that schedule: the replay's premise
    (what is drafted at a position does not depend on the rounds before it) holds on the runtime itself."""
    from dflash2.prompts import default_prompts
    from dflash2.runtime.api import Runtime
    from dflash2.bench.replay import record, replay
    from dflash2.speculative import FixedSchedule, generate

    class ReusingFixed(FixedSchedule):
        def wants_reuse(self) -> bool:
            return True

    rt = Runtime(default_export)
    prompts = [rt.prompt_ids(text=p, chat=True) for p in default_prompts()[:3]]
    B = rt.session.block_size
    trace = {"block_size": B, "answers": record(rt, prompts, max_new_tokens=48),
             "costs_ms": {"decode": 1.0, "verify": [0.0] + [1.0] * B, "draft_base": 0.0, "draft_per_row": 0.0}}
    for make in (lambda: FixedSchedule(2), lambda: FixedSchedule(B - 1), lambda: ReusingFixed(2)):
        want = {"rounds": 0, "accepted": 0, "reused": 0}
        for ids in prompts:
            st = generate(rt.session, ids, 48, rt.eos_ids, schedule=make()).stats
            want = {"rounds": want["rounds"] + st.rounds, "accepted": want["accepted"] + sum(st.accepted),
                    "reused": want["reused"] + sum(st.reused)}
        got = replay(make(), trace)
        assert {k: got[k] for k in want} == want
        assert want["accepted"] > 0  # the shipped drafter's drafts are accepted: the comparison means something
    assert want["reused"] > 0
