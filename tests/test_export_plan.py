"""The export plan (dflash2.export.plan): one rule set for dflash2-export and export(), `--print`, the progress
steps counted from the plan's jobs, and the quantization choices told apart in the plan only."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from dflash2.cli import export as export_cli
from dflash2.errors import Dflash2Error
from dflash2.export import qdq, stages
from dflash2.export import quantize as qz
from dflash2.export.api import export
from dflash2.export.plan import QuantFlags, plan_export
from tests.errorcheck import one_line_error, snapshot

ROOT = Path(__file__).resolve().parents[1]


def _cli(capsys, pair, out, *extra) -> tuple[int, str, str]:
    drafter, target = pair
    code = export_cli.main(["--model", str(drafter), "--target", str(target), "--out", str(out), *extra])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_print_shows_the_plan_and_writes_nothing(tmp_path, pairs, capsys):
    before = snapshot(tmp_path, pairs[("qwen3", 2)][0], pairs[("qwen3", 2)][1])
    code, out, err = _cli(capsys, pairs[("qwen3", 2)], tmp_path / "out", "--print", "--max-seq-len", "64")
    assert code == 0, err
    for words in ("pair:", "dtype:       float32", "attention:   plain", "max_seq_len: 64", "quantize:    none",
                  "target    templates", "drafter   templates", "selector  traced", "steps:       12",
                  f"out:         {tmp_path / 'out'}"):
        assert words in out, out
    assert snapshot(tmp_path, pairs[("qwen3", 2)][0], pairs[("qwen3", 2)][1]) == before
    code, out, err = _cli(capsys, pairs[("qwen3", 2)], tmp_path / "out", "--print", "--quantize", "int4")
    assert code == 0, err
    assert "attention:   gqa" in out and "int4 as written" in out and not (tmp_path / "out").exists()
    assert "+ its Q4MatMul flavour where this CPU runs it" in out
    code, out, err = _cli(capsys, pairs[("qwen3", 2)], tmp_path / "out", "--print", "--quantize", "int8_qdq")
    assert code == 0, err
    assert "int8_qdq after validation" in out and "steps:       13" in out


def test_print_refuses_what_the_export_refuses(tmp_path, pairs, capsys):
    code, out, err = _cli(capsys, pairs[("qwen3", 2)], tmp_path / "out", "--print", "--max-seq-len", "3")
    assert code == 2 and out == "" and "--max-seq-len: expected >= block_size + 2" in one_line_error(err,
                                                                                                    "dflash2-export")


MISSING = "missing.gguf"
REFUSALS = [  # dflash2-export's flags, and export()'s keywords for the same values (made inside the check: making
    # the quantization choice may be what refuses)
    (["--quantize", "int4", "--quant-block-size", "512"], lambda d: {"quantize": qz.OrtQuant("int4", 512)}),
    (["--quantize", "int4_awq", "--quant-block-size", "512"], lambda d: {"quantize": qdq.TrtQuant("int4_awq", 512)}),
    (["--quantize", "int4", "--quant-block-size", "24"], lambda d: {"quantize": qz.OrtQuant("int4", 24)}),
    (["--quant-drafter", "int8"], lambda d: {"quantize": QuantFlags(drafter="int8")}),
    (["--quantize", "int4", "--quant-from-gguf", MISSING],
     lambda d: {"quantize": qz.OrtQuant("int4", native=str(d / MISSING))}),
    (["--quantize", "int4", "--dtype", "float16"], lambda d: {"quantize": qz.OrtQuant("int4"), "dtype": "float16"}),
    (["--quantize", "int8_qdq", "--target-attention", "gqa"],
     lambda d: {"quantize": qdq.TrtQuant("int8_qdq"), "target_attention": "gqa"}),
    (["--quantize", "int4", "--quant-drafter", "int8-dynamic", "--target-attention", "plain"],
     lambda d: {"quantize": qz.OrtQuant("int4", drafter_method="int8-dynamic"), "target_attention": "plain"}),
]


@pytest.mark.parametrize("flags,keywords", REFUSALS, ids=[" ".join(f) for f, _ in REFUSALS])
def test_the_api_refuses_what_the_cli_refuses_with_the_same_message(tmp_path, pairs, capsys, flags, keywords):
    pair = pairs[("llama", 2)]
    flags = [str(tmp_path / f) if f == MISSING else f for f in flags]
    code, _, err = _cli(capsys, pair, tmp_path / "cli", *flags)
    assert code == 2
    cli_msg = one_line_error(err, "dflash2-export").removeprefix("dflash2-export: error: ")
    with pytest.raises(Dflash2Error) as e:
        export(*pair, tmp_path / "api", quiet=True, **keywords(tmp_path))
    assert str(e.value) == cli_msg
    assert list(tmp_path.iterdir()) == []


def _old_steps(version: int, quantize, attention: str) -> int:
    """The total export() summed by hand before the plan (its dynamic `+= 3` per graph past the budget aside)."""
    specs_count = 3 if version == 2 else 2
    steps = 1 + 2 * specs_count + 2 + 1 + 1 + 1
    return steps + (len(quantize.graphs()) if quantize and attention != "gqa" else 0)


QUANTS = {"none": None, "int4": lambda: qz.OrtQuant("int4"), "int4-target": lambda: qz.OrtQuant("int4", drafter=False),
          "int8-dyn-drafter": lambda: qz.OrtQuant("int8", drafter_method="int8-dynamic"),
          "fp8": lambda: qdq.TrtQuant("fp8", prompts=((1, 2),))}


@pytest.mark.parametrize("past_budget", [False, True])
def test_steps_match_the_old_count_in_every_combination(tmp_path, pairs, monkeypatch, past_budget):
    if past_budget:  # the plain graphs checked on a truncated build: 3 steps each, counted up front now
        monkeypatch.setattr(stages, "WHOLE_GRAPH_BYTES", 0)
    seen = 0
    for (fam, ver), dtype, attention, qname in itertools.product(
            [("llama", 1), ("qwen3", 2)], ["float32", "float16", "bfloat16"], ["auto", "plain", "gqa"], QUANTS):
        q = QUANTS[qname] and QUANTS[qname]()
        try:
            plan = plan_export(*pairs[(fam, ver)], tmp_path / "out", dtype, 64, quantize=q, target_attention=attention)
        except Dflash2Error:
            continue  # a refused combination has no plan
        seen += 1
        truncated = sum(3 for j in plan.jobs if j.route == "templates") if past_budget else 0
        # + one step per int4 graph: its Q4MatMul flavour, written or said not written (dflash2.export.q4_flavour)
        q4 = sum(j.cpu_q4 for j in plan.jobs)
        assert q4 == (len(q.graphs()) if qname in ("int4", "int4-target") else 0), (fam, ver, dtype, attention, qname)
        assert plan.steps == _old_steps(ver, q, plan.attention) + truncated + q4, (fam, ver, dtype, attention, qname)
        assert all(j.truncated_check == (j.route == "gqa" and j.name == "target" or
                                         past_budget and j.route == "templates") for j in plan.jobs)
    assert seen >= 20 and not (tmp_path / "out").exists()


def test_quantization_choices_are_told_apart_in_the_plan_only():
    """isinstance on OrtQuant / TrtQuant: dflash2/export/plan.py only; everything else asks the protocol."""
    hits = []
    for path in sorted((ROOT / "dflash2").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                names = {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node.args[1])
                         if isinstance(n, (ast.Name, ast.Attribute))}
                if names & {"OrtQuant", "TrtQuant"}:
                    hits.append(path.relative_to(ROOT).as_posix())
    assert hits and set(hits) == {"dflash2/export/plan.py"}, hits


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_progress_counts_to_the_plans_total_past_the_budget(tmp_path, pairs, monkeypatch, capsys, quantize):
    """Past WHOLE_GRAPH_BYTES the truncated builds' steps are in the plan's count from the first line, and the
    last step is [total/total]."""
    import re

    monkeypatch.setattr(stages, "WHOLE_GRAPH_BYTES", 0)
    q = qz.OrtQuant(quantize) if quantize else None
    plan = plan_export(*pairs[("qwen3", 2)], tmp_path / "out", max_seq_len=64, quantize=q)
    export(*pairs[("qwen3", 2)], tmp_path / "out", max_seq_len=64, quantize=q)
    seen = [tuple(map(int, m)) for m in re.findall(r"^\[(\d+)/(\d+)\]", capsys.readouterr().err, re.M)]
    assert {total for _, total in seen} == {plan.steps} and max(i for i, _ in seen) == plan.steps
