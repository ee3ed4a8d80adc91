"""Sampling at T > 0: the processed distribution, the seeded stream, and lossless speculative sampling.

Independent references: transformers' logits warpers for p; plain enumeration of the target-only
distribution for the statistical tests (tests/sampling_models.py); the PyTorch reference backend for
"same seed, same ids" across backends.
"""

from __future__ import annotations

import collections
import json

import numpy as np
import pytest
import torch

from dflash2 import sampling as sm
from dflash2.reference.backend import TorchBackend
from dflash2.reference.load import load_pair
from dflash2.runtime.api import Runtime
from dflash2.sampling import Sampling
from dflash2.speculative import Drafted, generate
from tests import sampling_models as models

RUNS = 20_000  # seeded runs per statistical case (the floor)


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    return {v: models.sharp_export(root, v) for v in (1, 2)} | {"root": root}


# ----------------------------------------------------------------------------- p, u, one round


@pytest.mark.parametrize("T,top_k,top_p", [(0.5, 0, 1.0), (1.0, 0, 1.0), (0.7, 20, 1.0), (1.3, 0, 0.9),
                                          (0.8, 50, 0.75), (1.0, 1, 1.0), (2.0, 0, 0.05)])
def test_processed_distribution_equals_transformers_warpers(T, top_k, top_p):
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    g = torch.Generator().manual_seed(int(T * 100) + top_k)
    logits = torch.randn(4, 500, generator=g) * 4  # [rows, V]
    for row in logits:
        x = row[None].clone()
        x = TemperatureLogitsWarper(T)(None, x)
        if top_k:
            x = TopKLogitsWarper(top_k)(None, x)
        if top_p < 1:
            x = TopPLogitsWarper(top_p)(None, x)
        want = torch.softmax(x.double(), -1)[0].numpy()
        got = sm.process(row.numpy(), Sampling(T, top_k, top_p))
        assert np.array_equal(got > 0, want > 0)  # the same support
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)


def test_options_are_checked_with_clear_errors():
    for kw, field in [({"temperature": -1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
                      ({"top_k": -2}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                      ({"seed": -1}, "seed")]:
        with pytest.raises(sm.SamplingError, match=field):
            Sampling(**kw)
    with pytest.raises(sm.SamplingError, match="finite maximum"):
        sm.process(np.full(8, np.nan, np.float32), Sampling(1.0))


def test_generation_config_defaults(tmp_path):
    assert sm.defaults_from(tmp_path) == {}  # no file: greedy
    f = tmp_path / "generation_config.json"
    f.write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    assert sm.defaults_from(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    f.write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert sm.defaults_from(tmp_path) == {}  # sampling not asked for
    f.write_text(json.dumps({"do_sample": True, "temperature": "hot"}))
    with pytest.raises(sm.SamplingError, match="temperature"):
        sm.defaults_from(tmp_path)
    f.write_text(json.dumps({"do_sample": True, "temperature": 0.7, "top_p": 7}))  # in range too, naming the file
    with pytest.raises(sm.SamplingError, match=r"generation_config.json: field top_p expected a number in \(0, 1\], "
                                               r"found 7"):
        sm.defaults_from(tmp_path)
    f.write_text("[1, 2]")
    with pytest.raises(sm.SamplingError, match="JSON object"):
        sm.defaults_from(tmp_path)


def test_uniforms_are_keyed_by_position_not_by_draw_order():
    a = [sm.uniform(7, p, sm.ACCEPT) for p in range(100, 120)]
    b = [sm.uniform(7, p, sm.ACCEPT) for p in reversed(range(100, 120))][::-1]
    assert a == b and len(set(a)) == 20  # order-free, no repeats
    assert sm.uniform(7, 100, sm.ACCEPT) != sm.uniform(7, 100, sm.RESIDUAL) != sm.uniform(8, 100, sm.ACCEPT)
    u = np.array([sm.uniform(3, p, sm.TOKEN) for p in range(20_000)])
    assert u.min() >= 0 and u.max() < 1
    counts = np.histogram(u, bins=10, range=(0, 1))[0]
    assert abs(counts - 2000).max() < 5 * np.sqrt(2000)  # uniform within 5 sigma per decile
    np.testing.assert_array_equal(sm.uniforms(3, 5, 4, sm.DRAFT), [sm.uniform(3, 5 + i, sm.DRAFT) for i in range(4)])


def test_one_round_of_rejection_sampling_has_the_target_distribution():
    """Plain Python check of verify_round on hand-built p and q (no model): the first token of a
    round, drafted from q, must follow p; q is deliberately far from p (mass where p has none)."""
    V, S = 6, 2
    rows = np.log(np.array([[0.5, 0.2, 0.1, 0.1, 0.1, 1e-30], [0.1, 0.1, 0.1, 0.2, 0.5, 1e-30],
                            [0.3, 0.3, 0.1, 0.1, 0.1, 0.1]], np.float32))  # [S+1, V] "logits"
    q_ids = np.array([[5, 1, 0], [4, 3, 2]])  # [S, K]
    q = np.array([[0.6, 0.3, 0.1], [0.5, 0.3, 0.2]], np.float32)
    s = Sampling(1.0)
    p0 = sm.process(rows[0], s)
    first = collections.Counter()
    N = 40_000
    for seed in range(N):
        rng = np.random.default_rng(seed)
        d0 = int(rng.choice(q_ids[0], p=q[0]))
        d1 = int(rng.choice(q_ids[1], p=q[1]))
        acc, tok = sm.verify_round(rows, [d0, d1], q_ids, q, 10, Sampling(1.0, seed=seed))
        first[d0 if acc > 0 else tok] += 1
    emp = np.array([first[i] / N for i in range(V)])
    assert 0.5 * np.abs(emp - p0).sum() < models.tv_bound(V, N)


# ----------------------------------------------------------------------------- real tiny models


CASES = [Sampling(0.5), Sampling(1.0), Sampling(0.5, top_k=5, top_p=0.9), Sampling(1.0, top_k=5, top_p=0.9)]


class WrongQ:
    """A session whose draft q ignores the temperature (softmax(row) instead of softmax(row / T)):
    the bug the statistical test must catch."""

    def __init__(self, session, T: float):
        self.session, self.T = session, T

    def __getattr__(self, name):
        return getattr(self.session, name)

    def draft(self, *args, **kw) -> Drafted:
        d = self.session.draft(*args, **kw)
        if d.q is None:
            return d
        w = d.q[1].astype(np.float64) ** self.T  # q^T is proportional to softmax(row)
        return Drafted(d.ids, d.confidence, (d.q[0], w / w.sum(-1, keepdims=True)))


def _first_tokens(backend, s: Sampling, runs: int) -> collections.Counter:
    counts = collections.Counter()
    for seed in range(runs):
        g = generate(backend, models.PROMPT, 3, (), sampling=Sampling(s.temperature, s.top_k, s.top_p, seed),
                     draft_len=3)
        counts[tuple(g.ids)] += 1
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("family, case", [("qwen3_5", CASES[1]), ("qwen3_5", CASES[2]), ("qwen3_5_moe", CASES[1])],
                         ids=lambda x: x if isinstance(x, str) else x.describe().replace(" ", "_"))
def test_speculative_sampling_on_the_hybrid_target(sharp, family, case):
    """The same statistical test on a Qwen3.5 hybrid target, and on its MoE variant (the experts' block routing each
    verify row; one case: ~5 min on a loaded 2-core machine): the recurrent state rolled back by the runtime's state
    rows after each rejection keeps the target-only distribution; drafts were accepted (the rollback ran)."""
    rt = Runtime(models.sharp_export(sharp["root"], 2, family=family))
    exact = models.exact_distribution(rt.session, case)
    counts = _first_tokens(rt.session, case, RUNS)
    bound = models.tv_bound(len(exact), RUNS)
    got = models.tv(counts, exact, RUNS)
    print(json.dumps({"family": family, "sampling": case.describe(), "bins": len(exact), "tv": got, "bound": bound}))
    assert got < bound, (got, bound, exact)
    g = generate(rt.session, models.PROMPT, 30, (), sampling=Sampling(case.temperature, case.top_k, case.top_p, 1),
                 draft_len=3)
    assert 0 < sum(g.stats.accepted) < 3 * len(g.stats.accepted)  # some drafts accepted, some rejected


# gpt-oss-shaped: window 4 (the prompt, 3 tokens and a 4-row verify cross it: the sliding layers' mask cuts), 8
# experts top-4 (gpt-oss routes 4: QMoE's k >= 3 sum order matters), the sinks, YaRN, biases; fp32 standard ops and
# int8 weights (MatMulNBits, the experts on slot-form QMoE int8: export/gpt_oss_qmoe.py)
GPT_OSS = {"sliding_window": 4, "num_local_experts": 8, "num_experts_per_tok": 4}


@pytest.mark.slow
@pytest.mark.parametrize("method", [None, "int8"], ids=["fp32", "int8"])
def test_speculative_sampling_on_a_gpt_oss_shaped_target(sharp, method):
    """The statistical test on a gpt-oss-shaped tiny target (GPT_OSS; one case, T = 1: 5-12 min on a loaded 2-core
    machine): 20,000 seeded speculative runs' first 3 tokens within the TV bound (delta 1e-6) of the exact
    target-only distribution of the same export (quantized: the quantized target's own); drafts were accepted."""
    from dflash2.export.plan import QuantFlags

    case = CASES[1]
    rt = Runtime(models.sharp_export(sharp["root"], 2, family="gpt_oss", extra=GPT_OSS,
                                     quantize=None if method is None else QuantFlags(method=method)))
    exact = models.exact_distribution(rt.session, case)
    counts = _first_tokens(rt.session, case, RUNS)
    bound = models.tv_bound(len(exact), RUNS)
    got = models.tv(counts, exact, RUNS)
    print(json.dumps({"family": "gpt_oss", "weights": method or "fp32", "sampling": case.describe(),
                      "bins": len(exact), "tv": got, "bound": bound}))
    assert got < bound, (got, bound, exact)
    g = generate(rt.session, models.PROMPT, 30, (), sampling=Sampling(case.temperature, case.top_k, case.top_p, 1),
                 draft_len=3)
    assert 0 < sum(g.stats.accepted) < 3 * len(g.stats.accepted)  # some drafts accepted, some rejected


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("case", CASES, ids=lambda s: s.describe().replace(" ", "_"))
def test_speculative_sampling_matches_the_exact_target_distribution(sharp, version, case):
    """20,000 seeded speculative runs: the first 3 tokens' empirical distribution is within the TV
    bound (delta 1e-6) of the exact target-only distribution; drafts were really accepted."""
    rt = Runtime(sharp[version])
    exact = models.exact_distribution(rt.session, case)
    counts = _first_tokens(rt.session, case, RUNS)
    bound = models.tv_bound(len(exact), RUNS)
    got = models.tv(counts, exact, RUNS)
    print(json.dumps({"version": version, "sampling": case.describe(), "bins": len(exact), "tv": got,
                      "bound": bound}))
    assert got < bound, (got, bound, exact)
    assert sum(counts.values()) == RUNS


@pytest.mark.slow
def test_a_q_that_ignores_the_temperature_fails_the_same_test(sharp):
    case = Sampling(0.5)
    rt = Runtime(sharp[2])
    exact = models.exact_distribution(rt.session, case)
    counts = _first_tokens(WrongQ(rt.session, case.temperature), case, RUNS)
    assert models.tv(counts, exact, RUNS) > models.tv_bound(len(exact), RUNS)


def test_acceptance_is_real_in_the_statistical_models(sharp):
    """Without accepted drafts the statistical tests would only test the residual path."""
    rt = Runtime(sharp[2])
    acc = [generate(rt.session, models.PROMPT, 12, (), sampling=Sampling(0.5, seed=i), draft_len=3).stats
           for i in range(20)]
    assert sum(sum(a.accepted) for a in acc) > 20


# ----------------------------------------------------------------------------- T = 0, seeds, backends


def test_temperature_zero_is_the_greedy_output(sharp):
    rt = Runtime(sharp[2])
    prompt = [5, 17, 42, 99, 7]
    greedy = rt.generate(prompt, 24, speculative=False, sampling=Sampling()).ids
    assert rt.generate(prompt, 24, sampling=Sampling(0.0, top_k=3, top_p=0.5, seed=9), draft_len=3).ids == greedy
    assert rt.generate(prompt, 24).ids == greedy  # the tiny target's generation_config asks for no sampling


@pytest.mark.parametrize("version", [1, 2])
def test_same_seed_same_ids_on_pytorch_and_onnx_runtime(sharp, version):
    rt = Runtime(sharp[version])
    root = sharp["root"]
    ref = TorchBackend(*load_pair(root / f"drafter-qwen3-v{version}", root / "target-qwen3"), 64)
    prompt = [5, 17, 42, 99, 7]
    for seed in range(6):
        s = Sampling(0.8, top_k=8 if seed % 2 else 0, seed=seed)
        a = rt.generate(prompt, 24, sampling=s, draft_len=3, stop=()).ids
        assert rt.generate(prompt, 24, sampling=s, draft_len=3).ids == a  # repeated run
        b = generate(ref, prompt, 24, rt.eos_ids, sampling=s, draft_len=3).ids
        assert a == b, (seed, a, b)
        assert generate(rt.session, prompt, 24, rt.eos_ids, sampling=s, schedule=rt.auto_schedule).ids  # runs


def test_an_export_from_before_sampling_is_refused_with_re_export(sharp, tmp_path):
    """The compatibility branches for older exports are retired: a manifest of contract 2 (no logits output,
    no sampled walk) or without graph signatures is refused at load, naming the fix."""
    import json
    import shutil

    from dflash2 import manifest as mf

    for edit, want in ((lambda d: d.update(contract_version=2), "contract_version: expected >= 3"),
                       (lambda d: d["graphs"]["drafter"].pop("signature"), "graphs.drafter.signature: expected")):
        old = tmp_path / f"old-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(sharp[2], old)
        data = json.loads((old / mf.NAME).read_text())
        edit(data)
        data["manifest_sha256"] = mf.content_sha256(data)  # resealed: only the contract check can refuse it
        (old / mf.NAME).write_text(json.dumps(data))
        with pytest.raises(mf.ManifestError, match=want) as e:
            Runtime(old)
        assert "re-export with dflash2-export" in str(e.value)


# ----------------------------------------------------------------------------- the CLIs


def test_run_cli_samples_with_a_seed_and_reports_it(sharp, capsys):
    from dflash2.cli import run as run_cli

    args = [str(sharp[2]), "--prompt-ids", "5,17,42", "--max-new-tokens", "16", "--json", "--draft-len", "3"]
    outs = []
    for extra in (["--temperature", "0.8", "--seed", "4"], ["--temperature", "0.8", "--seed", "4"],
                  ["--temperature", "0.8", "--seed", "5", "--top-k", "3", "--top-p", "0.9"], []):
        assert run_cli.main(args + extra) == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert outs[0]["ids"] == outs[1]["ids"] and outs[0]["sampling"] == "T=0.8 top_k=off top_p=1 seed=4"
    assert outs[2]["sampling"] == "T=0.8 top_k=3 top_p=0.9 seed=5"
    assert outs[3]["sampling"] == "greedy"
    greedy = generate(Runtime(sharp[2]).session, [5, 17, 42], 16, Runtime(sharp[2]).eos_ids, speculative=False).ids
    assert outs[3]["ids"] == greedy
    for bad, field in ((["--temperature", "-1"], "temperature"), (["--temperature", "1", "--top-p", "2"], "top_p")):
        assert run_cli.main(args + bad) == 2
        assert field in capsys.readouterr().err


def test_bench_cli_temperature_sweep(sharp, tmp_path, capsys):
    from dflash2.cli import bench as bench_cli

    out, prompts = tmp_path / "sweep.json", tmp_path / "prompts.txt"
    prompts.write_text("the cat sat\nhello there\n")
    code = bench_cli.main([str(sharp[2]), "--prompts", str(prompts), "--raw", "--max-new-tokens", "12",
                           "--temperature", "0,0.7", "--draft-len", "3", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    rows = json.loads(out.read_text())["temperature_sweep"]
    assert [r["temperature"] for r in rows] == [0.0, 0.7]
    assert rows[0]["lossless"] is True and rows[1]["lossless"] is None  # T > 0: by distribution
    assert rows[1]["sampling"].startswith("T=0.7") and rows[1]["acceptance_length"] >= 1.0
    assert "temperature   tau" in capsys.readouterr().out
