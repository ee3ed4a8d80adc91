"""The edge runtime: lossless through the exported graphs, no per-step allocation, bad input."""

import json
import resource
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM, Qwen3ForCausalLM

from dflash2.cli import run as run_cli
from dflash2.runtime.api import Runtime
from dflash2.runtime.schedule import AutoSchedule, CostModel
from dflash2.runtime.session import SpecSession
from dflash2.speculative import Drafted, generate
from tests.test_loop import PlannedSchedule

HF = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}
PROMPT = [11, 22, 33, 44, 55, 66]


def run_json(capsys, *args):
    code = run_cli.main([str(a) for a in args] + ["--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out)


def test_runtime_imports_neither_torch_nor_transformers():
    code = ("import sys, dflash2.runtime.api, dflash2.runtime.session, dflash2.bench.bench, "
            "dflash2.bench.policies, dflash2.runtime.schedule,"
            " dflash2.cli.run, dflash2.cli.bench, dflash2.native.selector, dflash2.native.tensorrt; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("family,version", [("llama", 1), ("llama", 2), ("qwen3", 1), ("qwen3", 2)])
def test_run_json_equals_transformers_generate(capsys, exports, pairs, family, version):
    folder = exports[(family, version)]
    spec = run_json(capsys, folder, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", 48)
    base = run_json(capsys, folder, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", 48, "--no-spec")
    hf = HF[family].from_pretrained(pairs[(family, version)][1], dtype=torch.float32).eval()
    ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=48, do_sample=False, min_new_tokens=48,
                      eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert spec["ids"] == base["ids"] == ref
    assert spec["speculative"] and not base["speculative"] and spec["rounds"] > 0


class PlannedDrafts(SpecSession):
    """Real graphs, drafts = the known greedy continuation with planned mistakes: zero, partial and
    full acceptance and the KV / context rollback all go through ONNX Runtime."""

    def __init__(self, manifest, backend, truth, prompt_len, plan):
        super().__init__(manifest, backend)
        self.truth, self.prompt_len, self.plan, self.r = truth, prompt_len, plan, 0

    def draft(self, anchor):
        d = super().draft(anchor)
        S, start = self.block_size - 1, self.pos - self.prompt_len + 1
        good = self.plan[self.r % len(self.plan)]
        self.r += 1
        nxt = (self.truth[start: start + S] + [0] * S)[:S]
        return Drafted([t if k < good else (t + 1) % self.vocab_size for k, t in enumerate(nxt)], d.confidence)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rollback_through_onnxruntime(exports, family):
    rt = Runtime(exports[(family, 2)])
    truth = generate(rt.session, PROMPT, 90, speculative=False).ids
    s = PlannedDrafts(rt.manifest, rt.session.backend, truth, len(PROMPT), plan=[0, 4, 7, 2, 7, 1])
    g = generate(s, PROMPT, 90)
    assert g.ids == truth and {0, 4, 7} <= set(g.stats.accepted)


@pytest.mark.parametrize("family,version", [("llama", 1), ("qwen3", 2)])
def test_every_schedule_is_lossless_through_onnxruntime(exports, family, version):
    """Skipped drafts (context rows pending across rounds), K = 0, K = S, switches between them, every
    fixed K and auto: always the target-only greedy ids, through the exported graphs."""
    rt = Runtime(exports[(family, version)], cost_prior=False)  # calibrated on drafted rounds, as pinned below
    S = rt.session.block_size - 1
    truth = rt.generate(PROMPT, 90, speculative=False).ids
    planned = PlannedSchedule(["skip", S, 0, "skip", "skip", 3, S, 1, 0, S])
    g = generate(rt.session, PROMPT, 90, schedule=planned)
    assert g.ids == truth and {0, S} <= set(g.stats.verified) and any(g.stats.skipped)
    for k in range(1, S + 1):
        assert rt.generate(PROMPT, 90, draft_len=k).ids == truth, f"draft_len {k}"
    auto = rt.generate(PROMPT, 90)  # the default: auto
    cal = rt.auto_schedule.to_dict()["costs"]  # its first four rounds measured the cost model
    assert auto.ids == truth and cal["calibrated"] and cal["calibration_rounds"] == 4 and cal["measured_seconds"] > 0
    assert auto.stats.skipped[:4] == [False, True, False, True] and auto.stats.verified[:4] == [(S + 1) // 2, 0, (S + 1) // 2, 0]
    conf = rt.session.draft(auto.ids[-1]).confidence
    assert conf is not None and conf.shape == (S,) and ((0 < conf) & (conf <= 1)).all()


def test_pending_rows_beyond_one_drafter_call_are_chunked(exports):
    """An engine's drafter profile bounds the context rows per call: many skipped drafts in a row are
    drafted in several calls, same ids as drafting every round."""
    rt = Runtime(exports[("llama", 2)])
    truth = rt.generate(PROMPT, 60, speculative=False).ids
    rt.session.max_draft_rows = 3  # the prompt (6 rows) and 9 skipped rounds: 2-4 calls per draft
    calls = []
    run = rt.session.drafter.run
    rt.session.drafter.run = lambda i, o: calls.append(i["context"].shape[0]) or run(i, o)
    g = generate(rt.session, PROMPT, 60, schedule=PlannedSchedule(["skip"] * 9 + [7, 2]))
    assert g.ids == truth and max(calls) == 3 and len(calls) > sum(not s for s in g.stats.skipped)


@pytest.mark.parametrize("verify_ms,expect", [([10.0] * 8, "full"), ([10.0 * n for n in range(1, 9)], "none")])
def test_scripted_cost_model_drives_auto_through_onnxruntime(exports, verify_ms, expect):
    """A flat verify cost (a GPU) makes auto verify every draft; a steep one makes it verify none and
    then stop drafting. The ids never change."""
    rt = Runtime(exports[("qwen3", 2)])
    truth = rt.generate(PROMPT, 60, speculative=False).ids
    draft_s = 0.0 if expect == "full" else 0.001  # a free draft: the tiny random drafter never pays for one
    sched = AutoSchedule(8, CostModel([0.0] + [v / 1e3 for v in verify_ms], 0.010, draft_s))
    sched.costs.observe = lambda r: None  # keep the script: no refinement from this machine's timings
    sched.acceptance.observe = lambda *a: None  # and the prior: acceptance = the drafter's confidence
    g = generate(rt.session, PROMPT, 60, schedule=sched)
    assert g.ids == truth
    h = g.stats.k_histogram()
    if expect == "full":
        assert h.get("7", 0) == g.stats.rounds and h["skip"] == 0
    else:
        assert h.get("0", 0) >= 1 and h["skip"] > g.stats.rounds / 2 and set(h) <= {"skip", "reused", "0"}


def test_no_allocation_per_step(exports):
    """1,000 speculative steps: tracemalloc net growth and every buffer address, reported."""
    s = Runtime(exports[("llama", 2)]).session
    addresses = s.buffers()
    t = int(s.prefill(PROMPT).ids[-1])
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    steps, start_pos = 0, s.pos
    while steps < 1000:
        if s.pos + s.block_size + 1 >= s.max_seq_len:
            s.pos, s.ctx_pos, s.pending = start_pos, start_pos, 1  # rewind pointers: no reallocation
        drafts = s.draft(t).ids
        preds = s.verify([t, *map(int, drafts)]).ids
        s.commit(1)
        t = int(preds[0])
        steps += 1
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    growth = sum(st.size_diff for st in after.compare_to(before, "filename"))
    print(f"\n1000 steps: tracemalloc net growth {growth} bytes; buffer addresses unchanged: "
          f"{s.buffers() == addresses} ({len(addresses)} buffers)")
    assert s.buffers() == addresses
    assert growth < 64 * 1024  # allocator noise only; a per-step allocation would be >= 1000x its size


def _rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.slow
def test_5000_tokens_without_memory_growth(exports):
    rt = Runtime(exports[("qwen3", 2)])
    g1 = rt.generate(PROMPT, max_new_tokens=5000)
    peak1 = _rss_mb()
    tracemalloc.start()
    g2 = rt.generate(PROMPT, max_new_tokens=5000)
    _, py_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    peak2 = _rss_mb()
    print(f"\n5000 tokens: peak RSS {peak1:.1f} MB after run 1, {peak2:.1f} MB after run 2; "
          f"python heap peak during run 2 {py_peak / 1e6:.2f} MB")
    assert len(g1.ids) == len(g2.ids) == 5000 and g1.ids == g2.ids
    assert peak2 - peak1 < 16
    assert py_peak < 8e6  # ids + stats lists, not tensors


@pytest.mark.parametrize("args,message", [
    (["--prompt-ids", "1,99999"], "prompt ids [99999] are outside the vocabulary [0, "),
    (["--prompt", "   "], "the prompt is empty"),
    (["--prompt-ids", "1,2", "--max-new-tokens", "7000"], "exceeds max_seq_len 6000"),
    (["--prompt-ids", "1,2", "--max-new-tokens", "0"], "--max-new-tokens: expected >= 1"),
    (["--prompt-ids", "1,2", "--backend", "tensorrt"], "TensorRT"),
    (["--prompt-ids", "1,2", "--draft-len", "8"], "draft length expected 1..7"),
    (["--prompt-ids", "1,2", "--draft-len", "0"], "draft length expected 1..7"),
])
def test_bad_input_messages(capsys, exports, args, message):
    assert run_cli.main([str(exports[("llama", 1)]), *args]) == 2
    assert message in capsys.readouterr().err


def test_non_integer_id_is_a_usage_error(capsys, exports):
    with pytest.raises(SystemExit) as e:
        run_cli.main([str(exports[("llama", 1)]), "--prompt-ids", "1,2,x"])
    assert e.value.code == 2 and "'x' is not an integer" in capsys.readouterr().err


def test_folder_that_is_not_an_export(capsys, tmp_path):
    assert run_cli.main([str(tmp_path), "--prompt-ids", "1"]) == 2
    assert "expected manifest.json" in capsys.readouterr().err


def test_checksum_mismatch(capsys, exports, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(exports[("llama", 1)], copy)
    with open(copy / "target.onnx.data", "r+b") as fh:
        fh.seek(100)
        fh.write(b"\x00\x01\x02\x03")
    assert run_cli.main([str(copy), "--prompt-ids", "1,2"]) == 2
    assert "target.onnx.data: sha256 does not match the manifest" in capsys.readouterr().err


def test_text_chat_stream_and_stop_strings(capsys, exports):
    rt = Runtime(exports[("qwen3", 2)])
    ids = rt.prompt_ids(text="the model", chat=True)
    assert ids[:1] == [rt.text.token_id("<|im_start|>")]
    streamed = []
    g = rt.generate(ids, max_new_tokens=40, on_text=streamed.append)
    assert "".join(streamed) == rt.text.decode(g.ids)
    stop = rt.text.decode(g.ids[5:7])
    if stop.strip():
        g2 = rt.generate(ids, max_new_tokens=40, stop=[stop])
        assert g2.stop_reason == "stop" and stop in rt.text.decode(g2.ids) and len(g2.ids) <= 7


@pytest.mark.parametrize("k", [1, 3])
def test_shorter_draft_len_is_lossless_through_onnxruntime(capsys, exports, k):
    folder = exports[("qwen3", 2)]
    ids = ",".join(map(str, PROMPT))
    base = run_json(capsys, folder, "--prompt-ids", ids, "--max-new-tokens", 40, "--no-spec")
    spec = run_json(capsys, folder, "--prompt-ids", ids, "--max-new-tokens", 40, "--draft-len", k)
    assert spec["ids"] == base["ids"] and max(spec["accepted_per_round"]) <= k
    assert all(e <= k + 1 for e in spec["emitted_per_round"])


def test_bench_reports(tmp_path, exports):
    from dflash2.cli import bench as bench_cli

    out, png = tmp_path / "b.json", tmp_path / "b.png"
    code = bench_cli.main([str(exports[("llama", 2)]), "--max-new-tokens", "16", "--json", str(out), "--plot", str(png),
                           "--sweep-draft-len", "2,7"])
    r = json.loads(out.read_text())
    assert code == 0 and r["lossless"] and png.stat().st_size > 1000
    assert {"autoregressive_tokens_per_second", "speculative_tokens_per_second", "speedup", "host_overhead_share",
            "position_acceptance", "selector_gap_closed"} <= set(r)
    assert set(r["acceptance_length"]) == {"selector", "top1", "oracle"}
    vocab = json.loads((exports[("llama", 2)] / "manifest.json").read_text())["vocab_size"]
    assert r["draft_len"] == "auto" and r["draft_vocab_size"] == vocab  # defaults: auto, no draft vocabulary
    sweep = {w["draft_len"]: w for w in r["draft_len_sweep"]}
    assert set(sweep) == {2, 7} and sweep[2]["acceptance_length"] <= 3
    assert set(r["modes"]) == {"ar", "2", "7", "auto"} and r["modes"]["auto"]["speedup"] == r["speedup"]
    assert sweep[7]["speedup"] == r["modes"]["7"]["speedup"] and r["modes"]["ar"]["speedup"] == 1.0
    assert r["best_of_ar_and_fixed"] in {"ar", "2", "7"} and r["auto_vs_best"] > 0
    assert r["calibration"]["calibrated"] and len(r["calibration"]["verify_ms"]) == 8
    assert len(r["per_prompt"]) == r["prompts"] and sum(r["per_prompt"][0]["k_histogram"].values()) > 0
    assert r["modes"]["7"]["k_histogram"] == {"skip": 0, "reused": 0, "7": r["modes"]["7"]["rounds"]}
    from dflash2.bench.result import BenchResult

    typed = BenchResult.from_dict(r, out)  # the JSON is the typed result's fields, read back whole
    assert typed.to_dict() == r and typed.main_mode.speedup == r["speedup"]
    assert isinstance(typed.draft_len_sweep[0].round_ms, float) and typed.per_prompt[0].prompt_tokens > 0


def test_bench_results_committed_before_the_types_still_combine(capsys):
    """Result files of earlier sessions (without the later sampling field) read back and combine."""
    from dflash2.cli import bench as bench_cli
    from dflash2.bench.result import BenchResult

    docs = Path(__file__).resolve().parents[1] / "docs" / "results"
    old = [docs / n for n in ("bench_sharegpt24_new_drafter.json", "bench_sharegpt24_old_drafter.json")]
    assert BenchResult.from_dict(json.loads(old[0].read_text()), old[0]).sampling == "greedy"
    assert bench_cli.main(["--combine", *map(str, old)]) in (0, 1)  # 1 only if a part was not lossless
    assert "prompts in 2 interleaved runs" in capsys.readouterr().out


def test_bench_json_read_back_names_the_file_and_field(tmp_path, exports, capsys):
    """--combine reads bench JSONs as typed results: a cut-short run, a missing or mistyped field, or a file that is
    not JSON is refused in one line naming the file and the field (rc 2), and nothing is written."""
    from dflash2.cli import bench as bench_cli

    good, prompts = tmp_path / "good.json", tmp_path / "prompts.json"
    prompts.write_text(json.dumps([" ".join(map(str, PROMPT))]))
    assert bench_cli.main([str(exports[("llama", 2)]), "--prompts", str(prompts), "--raw", "--max-new-tokens", "4",
                           "--policies", "none", "--json", str(good)]) == 0
    capsys.readouterr()
    base = json.loads(good.read_text())
    cases = {"partial": ({**{k: base[k] for k in ("prompts", "repeats", "lossless", "modes", "per_prompt")},
                          "complete": False}, "field complete expected true, found false"),
             "missing": ({k: v for k, v in base.items() if k != "calibration"}, "field calibration expected, found none"),
             "mistyped": ({**base, "prompts": "three"}, "field prompts expected int, found 'three'"),
             "mode": ({**base, "modes": {**base["modes"], "ar": {**base["modes"]["ar"], "rounds": True}}},
                      "field modes.ar.rounds expected int, found True"),
             "list": ([1, 2], "expected a JSON object, found list")}
    for name, (data, want) in cases.items():
        f = tmp_path / f"{name}.json"
        f.write_text(json.dumps(data))
        out = tmp_path / f"{name}-combined.json"
        assert bench_cli.main(["--combine", str(good), str(f), "--json", str(out)]) == 2
        err = capsys.readouterr().err
        assert str(f) in err and want in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()
    (tmp_path / "bad.json").write_bytes(b"{not json")
    assert bench_cli.main(["--combine", str(good), str(tmp_path / "bad.json")]) == 2
    assert "bad.json: expected JSON, found a syntax error" in capsys.readouterr().err


def test_bench_split_runs_combine(tmp_path, exports, capsys):
    """A prompt set split across runs (--policies none: timed modes only) combines into one table."""
    from dflash2.cli import bench as bench_cli

    folder, parts = exports[("qwen3", 2)], []
    for i, prompts in enumerate([[PROMPT], [PROMPT[:3], PROMPT[2:]]]):
        (tmp_path / f"p{i}.json").write_text(json.dumps([" ".join(map(str, p)) for p in prompts]))
        parts.append(tmp_path / f"r{i}.json")
        assert bench_cli.main([str(folder), "--prompts", str(tmp_path / f"p{i}.json"), "--raw", "--max-new-tokens",
                               "8", "--sweep-draft-len", "2", "--policies", "none", "--json", str(parts[-1])]) == 0
    rs = [json.loads(p.read_text()) for p in parts]
    assert all(r["acceptance_length"] == {} for r in rs)
    assert bench_cli.main(["--combine", *map(str, parts), "--json", str(tmp_path / "c.json")]) == 0
    c = json.loads((tmp_path / "c.json").read_text())
    assert c["prompts"] == 3 and c["lossless"] and set(c["modes"]) == {"ar", "2", "auto"}
    tokens = sum(r["modes"]["2"]["new_tokens"] - r["prompts"] for r in rs)
    secs = sum(r["modes"]["2"]["decode_seconds"] for r in rs)
    assert c["modes"]["2"]["tokens_per_second"] == pytest.approx(tokens / secs)
    assert c["modes"]["2"]["k_histogram"]["2"] == sum(r["modes"]["2"]["k_histogram"]["2"] for r in rs)
    assert "3 prompts in 2 interleaved runs" in capsys.readouterr().out


def test_a_verified_logits_handle_refuses_after_the_next_target_call(exports):
    """One logits buffer, no copies: a handle read after a later call would silently give that call's rows."""
    from dflash2.errors import Dflash2Error

    s = Runtime(exports[("llama", 2)]).session
    v = s.prefill(PROMPT)
    assert v.logits().shape == (min(len(PROMPT), s.block_size), s.vocab_size)
    s.decode(int(v.ids[-1]))
    with pytest.raises(Dflash2Error, match="overwritten by call"):
        v.logits()
