"""Autoregressive, fixed draft lengths and `auto` in ONE process, interleaved per prompt, plus the
acceptance of alternative draft paths. Returns a BenchResult (result.py); prints its table."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from dflash2 import dtypes
from dflash2.bench.policies import POLICIES, PolicySession
from dflash2.bench.ratio import describe_ratio, pass_of, ratio_cell
from dflash2.bench.result import (BenchProgress, BenchResult, BenchResultError, CombinedMode, CombinedResult,
                                  ModeResult, PromptResult, SweepPoint)
from dflash2.manifest import ExportManifest
from dflash2.errors import Dflash2Error
from dflash2.native.bench import random_inputs
from dflash2.onnxrt import open_session
from dflash2.prompts import default_prompts, load_prompts  # noqa: F401 (re-exported for callers)
from dflash2.quant_manifest import describe, label
from dflash2.runtime.api import Runtime
from dflash2.speculative import FixedSchedule, Stats, gap_closed, generate, parse_draft_len


class TimedEngine:
    """Counts the seconds spent inside engine calls: everything else in a step is host overhead."""

    def __init__(self, engine):
        self.engine, self.seconds = engine, 0.0

    def bind(self, inputs, outputs):
        self.engine.bind(inputs, outputs)

    def run(self, inputs, outputs):
        t0 = time.perf_counter()
        self.engine.run(inputs, outputs)
        self.seconds += time.perf_counter() - t0


def selector_ms(rt: Runtime, repeats: int = 200) -> float | None:
    """Median ms of the standalone selector.onnx at one round's shape [1, S, K]: the select share
    of a draft step (in drafter.onnx the same node runs fused)."""
    import numpy as np

    if not isinstance(rt.manifest, ExportManifest) or rt.backend_name != "onnxruntime":
        return None  # an engine folder times its selector inside the drafter engine
    graph = rt.manifest.graphs.get("selector")
    if graph is None:
        return None
    m = rt.manifest
    S, K, R, V = m.num_drafts, m.selector.top_k, m.selector.rank, m.vocab_size
    op = random_inputs(1, S, K, R, V, codebook_dtype=str(dtypes.numpy_dtype(m.dtype)), temperature=0.0)
    op["cand_logits"] = -np.sort(-op["cand_logits"], axis=-1)  # descending, as TopK gives them
    feeds = {name: op[name] for name in graph.signature.inputs.values()}  # the graph's own inputs, by its signature
    session = open_session(Path(rt.folder) / graph.flavours.portable)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def _merge(all_stats: list[Stats]) -> Stats:
    out = Stats(all_stats[0].block_size)
    for s in all_stats:
        out.accepted += s.accepted
        out.verified += s.verified
        out.skipped += s.skipped
        out.reused += s.reused
        out.emitted += s.emitted
        out.new_tokens += s.new_tokens
        for k, v in s.times.items():
            out.times[k] += v
    return out


def _tps(stats: list[Stats]) -> float:
    return _merge(stats).tokens_per_second if stats else 0.0


def bench(folder: str | Path, prompts: list[str], max_new_tokens: int = 128, chat: bool = True,
          policies: tuple[str, ...] | None = None, repeats: int = 1, draft_len: int | str | None = "auto",
          sweep: tuple[int, ...] = (), log: Callable[[str], None] | None = None,
          partial: Callable[[BenchProgress], None] | None = None, sampling: dict | None = None) -> BenchResult:
    """Times, interleaved per prompt in ONE process: autoregressive, every fixed K of `sweep` (and
    draft_len when it is an int), and auto; the order of the modes rotates from prompt to prompt (this
    machine's speed drifts between runs, not within one). policies: draft paths whose acceptance is
    measured at K = S (selector = what the runtime drafts; top1, oracle: measurement only).
    sampling: temperature / top_k / top_p / seed (unset: the model's generation_config.json, else greedy).
    At T > 0 every mode samples with the same options and seed, the baseline is target-only
    sampling; ids then differ between modes by design (the same distribution, not the same draws: the
    statistical tests prove it), so "lossless" is None and only the selector's acceptance is measured."""
    rt = Runtime(folder, schedule_cache=False)  # a cold session: calibration is part of what it measures
    sampling = rt.sampling(**(sampling or {}))
    if not sampling.greedy:
        policies = ("none",)
    man = rt.manifest
    B, S = man.block_size, man.num_drafts
    main_mode = str(parse_draft_len(draft_len, B))
    fixed = tuple(dict.fromkeys(parse_draft_len(k, B) for k in (*sweep, *([int(main_mode)] if main_mode != "auto"
                                                                          else []))))
    v2 = man.drafter_version == 2
    if not v2 and policies and policies != ("none",):  # v1 drafts the head's top-1: no path to choose between
        raise Dflash2Error(f"--policies {','.join(policies)}: {folder}'s drafter is DFlash v1 (no candidate selector, "
                           f"no lattice): only its own drafts are measured; omit --policies (or give none)")
    policies = policies or (POLICIES if v2 else ("selector",))
    if policies == ("none",):  # no acceptance-by-path runs: the timed modes only
        policies = ()
    elif "selector" not in policies:
        policies = ("selector", *policies)
    sessions = {p: PolicySession(rt.manifest, rt.session.backend, policy=p) for p in policies}
    for s in sessions.values():
        s.target, s.drafter = TimedEngine(s.target), TimedEngine(s.drafter)
    main = PolicySession(man, rt.session.backend, policy="selector")
    main.target, main.drafter = TimedEngine(main.target), TimedEngine(main.drafter)
    auto = rt.auto_schedule  # its first auto rounds calibrate it (inside the timed auto runs)
    modes = ["ar", *map(str, fixed), "auto"]
    runs: dict[str, list[Stats]] = {m: [] for m in modes}
    engine_s = {m: 0.0 for m in modes}
    per_policy: dict[str, list[Stats]] = {p: [] for p in policies}
    per_prompt, lossless = [], True
    passes: list[int] = []  # per generation (prompt, repeat): the independent sample it belongs to (ratio.pass_of)
    for i, prompt in enumerate(prompts):
        ids = rt.prompt_ids(text=prompt, chat=chat) if isinstance(prompt, str) else list(prompt)
        main.check_capacity(len(ids), max_new_tokens)
        row = PromptResult(len(ids), {})
        for rep in range(repeats):
            passes.append(pass_of(i, rep, repeats))
            ids_of = {}
            for m in modes[i % len(modes):] + modes[:i % len(modes)]:  # rotated order
                e0 = main.target.seconds + main.drafter.seconds
                sched = None if m == "ar" else auto if m == "auto" else FixedSchedule(int(m))
                g = generate(main, ids, max_new_tokens, rt.eos_ids, speculative=m != "ar", schedule=sched,
                             sampling=sampling)
                engine_s[m] += main.target.seconds + main.drafter.seconds - e0
                runs[m].append(g.stats)
                ids_of[m] = g.ids
                row.tokens_per_second[m] = g.stats.tokens_per_second
                if m == "auto":
                    row.k_histogram, row.acceptance_length = g.stats.k_histogram(), g.stats.acceptance_length
            if sampling.greedy:
                lossless &= all(v == ids_of["ar"] for v in ids_of.values())
            for p, s in sessions.items():  # acceptance of the draft paths, all S drafts verified
                if p == "selector" and S in fixed:  # the fixed K = S run already measured it
                    per_policy[p].append(runs[str(S)][-1])
                    continue
                s.set_truth(len(ids), ids_of["ar"])
                g = generate(s, ids, max_new_tokens, rt.eos_ids, schedule=FixedSchedule(S))
                lossless &= g.ids == ids_of["ar"]
                per_policy[p].append(g.stats)
        per_prompt.append(row)
        if log is not None:
            now = "  ".join(f"{m} {row.tokens_per_second[m]:.1f}" for m in modes)
            run = "  ".join(f"{m} {_tps(runs[m]):.1f}" for m in modes)
            log(f"[prompt {i + 1}/{len(prompts)}] {len(ids)} tokens, tok/s: {now}  | running: {run}")
        if partial is not None:  # what a run cut short still leaves: the prompts done so far
            ar_now = _merge(runs["ar"]).tokens_per_second
            partial(BenchProgress(i + 1, repeats, lossless,
                                  {m: _mode_row(m, _merge(runs[m]), ar_now, engine_s[m],
                                                _samples(runs, m, passes)) for m in modes},
                                  auto.to_dict()["costs"], per_prompt))
    merged = {m: _merge(v) for m, v in runs.items()}
    calibration = auto.to_dict()["costs"]
    ar_tps = merged["ar"].tokens_per_second
    mode_rows = {m: _mode_row(m, merged[m], ar_tps, engine_s[m], _samples(runs, m, passes)) for m in modes}
    best = max(["ar", *map(str, fixed)], key=lambda m: mode_rows[m].tokens_per_second)
    A, M = merged["ar"], merged[main_mode]
    acc = {p: _merge(v).acceptance_length for p, v in per_policy.items()}
    if not sampling.greedy:  # the acceptance of what the runtime drafted, at the sampling options
        acc = {"sampled": M.acceptance_length}
    acc_total = merged["auto"].times["total"] / max(merged["auto"].new_tokens, 1) * 128
    return BenchResult(
        folder=str(folder), backend=rt.backend_name, prompts=len(prompts), repeats=repeats,
        max_new_tokens=max_new_tokens, block_size=B, dtype=man.dtype,
        lossless=lossless if sampling.greedy else None, sampling=sampling.describe(), draft_len=main_mode,
        weights=label(man), quantization=describe(man),
        draft_vocab_size=man.draft_vocab.size if man.draft_vocab else man.vocab_size,
        autoregressive_tokens_per_second=ar_tps, speculative_tokens_per_second=M.tokens_per_second,
        speedup=mode_rows[main_mode].speedup, modes=mode_rows, best_of_ar_and_fixed=best,
        auto_vs_best=mode_rows["auto"].tokens_per_second / max(mode_rows[best].tokens_per_second, 1e-9),
        calibration=calibration, schedule_after=auto.to_dict(), per_prompt=per_prompt,
        # calibration wall time over one auto generation scaled to 128 new tokens
        calibration_share_128=calibration["calibration_seconds"] / acc_total,
        acceptance_length=acc,
        position_acceptance=({p: _merge(v).position_acceptance() for p, v in per_policy.items()}
                             if sampling.greedy else {"sampled": M.position_acceptance()}),
        speculative_seconds=M.to_dict()["seconds"], autoregressive_seconds=A.to_dict()["seconds"],
        host_overhead_share=mode_rows[main_mode].host_overhead_share,
        spec_step_ms=_round_ms(M), ar_step_ms=1e3 * A.times["decode"] / max(A.new_tokens - len(runs["ar"]), 1),
        select_ms_standalone=selector_ms(rt),
        selector_gap_closed=(gap_closed(acc["selector"], acc["top1"], acc["oracle"])
                             if {"top1", "oracle", "selector"} <= set(acc) else None),
        draft_len_sweep=[_sweep_row(k, merged[str(k)], ar_tps) for k in sorted(fixed)])


def _samples(runs: dict[str, list[Stats]], mode: str, passes: list[int]) -> list[float]:
    """The mode's speedup over "ar" once per independent pass (ratio.pass_of): the spread its headline carries."""
    out = []
    for p in sorted(set(passes)):
        ar = _tps([s for s, q in zip(runs["ar"], passes) if q == p])
        out.append(_tps([s for s, q in zip(runs[mode], passes) if q == p]) / ar if ar else 0.0)
    return out


def _mode_row(mode: str, s: Stats, ar_tps: float, engine_seconds: float, samples: list[float]) -> ModeResult:
    total = s.times["total"]
    return ModeResult(s.tokens_per_second, s.tokens_per_second / ar_tps if ar_tps else 0.0, s.acceptance_length,
                      s.rounds, s.k_histogram(), _round_ms(s) if s.rounds else None, s.new_tokens, s.decode_seconds,
                      max(total - engine_seconds, 0.0) / total if total else 0.0, samples)


def _sweep_row(k: int, s: Stats, ar_tps: float) -> SweepPoint:
    return SweepPoint(k, s.acceptance_length, s.tokens_per_second, s.tokens_per_second / ar_tps if ar_tps else 0.0,
                      _round_ms(s))


def _round_ms(s: Stats) -> float:
    """Draft + verify time per speculative round."""
    return 1e3 * (s.times["draft"] + s.times["verify"]) / max(s.rounds, 1)


def combine(results: list[BenchResult]) -> CombinedResult:
    """Several bench results of one folder (e.g. prompt sets split across processes) as one: per mode,
    tok/s = sum(new tokens after the first of each generation) / sum(decode seconds); tau and the K
    histogram summed over rounds. Each part had its own session (own calibration and learning)."""
    names = list(results[0].modes)
    for r in results[1:]:
        if list(r.modes) != names:
            raise BenchResultError(f"--combine: expected runs of the same modes {names}, found {list(r.modes)} "
                                   f"in the run of {r.folder}")
    modes = {}
    for mode in names:
        rows = [r.modes[mode] for r in results]
        gens = [r.prompts * r.repeats for r in results]
        tokens = sum(w.new_tokens - g for w, g in zip(rows, gens))
        secs = sum(w.decode_seconds for w in rows)
        rounds = sum(w.rounds for w in rows)
        hist: dict[str, int] = {}
        for w in rows:
            for k, v in w.k_histogram.items():
                hist[k] = hist.get(k, 0) + v
        tau = sum(w.acceptance_length * w.rounds for w in rows) / rounds if rounds else 0.0
        # each part is one independent sample of the mode's speedup (its own process, prompts and calibration)
        modes[mode] = CombinedMode(tokens / secs if secs else 0.0, rounds, hist, tau,
                                   speedup_samples=[w.speedup for w in rows])
    ar = modes["ar"].tokens_per_second
    for w in modes.values():
        w.speedup = w.tokens_per_second / ar if ar else 0.0
    best = max((m for m in names if m != "auto"), key=lambda m: modes[m].tokens_per_second)
    return CombinedResult(len(results), sum(r.prompts for r in results), all(r.lossless for r in results), modes,
                          best, modes["auto"].tokens_per_second / max(modes[best].tokens_per_second, 1e-9),
                          [p for r in results for p in r.per_prompt])


def combined_table(c: CombinedResult) -> str:
    out = (f"{c.prompts} prompts in {c.parts} interleaved runs, lossless {c.lossless}, "
           f"auto / best of AR and fixed K {c.auto_vs_best:.3f} (best: {c.best_of_ar_and_fixed})\n"
           "  mode    tau    tok/s  speedup, range over parts  K per round\n")
    def cell(m, w) -> str:
        return "1.00x (base)" if m == "ar" else ratio_cell(w.speedup_samples, w.speedup, w.acceptance_length)

    return out + "\n".join(f"  {m:<5} {w.acceptance_length:>5.2f} {w.tokens_per_second:>8.1f} {cell(m, w):>25}  "
                            + " ".join(f"{k}:{v}" for k, v in w.k_histogram.items() if v) for m, w in c.modes.items())


def table(r: BenchResult) -> str:
    rows = [("backend / dtype", f"{r.backend} / {r.dtype}"), ("weights", r.weights), ("prompts", r.prompts),
            ("draft vocabulary (ids)", r.draft_vocab_size), ("drafts verified per round", r.draft_len),
            ("sampling", r.sampling),
            ("lossless (spec == AR ids)", "by distribution" if r.lossless is None else r.lossless),
            ("autoregressive tok/s", f"{r.autoregressive_tokens_per_second:.1f}"),
            ("speculative tok/s", f"{r.speculative_tokens_per_second:.1f}"),
            ("speedup", describe_ratio(r.main_mode.speedup_samples, r.speedup, over=_over(r),
                                       ceiling=r.main_mode.acceptance_length)),
            ("auto / best of AR and fixed K", f"{r.auto_vs_best:.3f} (best: {r.best_of_ar_and_fixed})"),
            ("AR step ms / spec round ms", f"{r.ar_step_ms:.2f} / {r.spec_step_ms:.2f}"),
            ("host overhead (spec)", f"{100 * r.host_overhead_share:.1f}%"),
            ("calibration added s (its rounds)", f"{r.calibration['calibration_seconds']:.3f} "
                                           f"({r.calibration['measured_seconds']:.3f})"),
            ("calibration / 128-token generation", f"{100 * r.calibration_share_128:.1f}%")]
    if r.select_ms_standalone is not None:
        rows.append(("select ms (standalone graph)", f"{r.select_ms_standalone:.3f}"))
    rows += [(f"acceptance length K=S: {p}" if p != "sampled" else f"acceptance length ({r.draft_len}, sampled)",
              f"{v:.2f}") for p, v in r.acceptance_length.items()]
    if r.selector_gap_closed is not None:
        rows.append(("top1->oracle gap closed", f"{100 * r.selector_gap_closed:.0f}%"))
    s = r.speculative_seconds
    rows.append(("spec seconds: draft/verify/host", f"{s['draft']:.2f} / {s['verify']:.2f} / {s['host']:.2f}"))
    out = "\n".join(f"{k:<34}{v!s:>18}" for k, v in rows)
    pos = "\n".join(f"  {p:<9}" + " ".join(f"{x:.2f}" for x in v) for p, v in r.position_acceptance.items())
    out += "\nacceptance per draft position (K=S):\n" + pos
    out += (f"\nmodes (same run, interleaved; speedup range over {_over(r)}):\n"
            "  mode    tau    tok/s      speedup, range   host  K per round\n")
    out += "\n".join(f"  {m:<5} {w.acceptance_length:>5.2f} {w.tokens_per_second:>8.1f} "
                      f"{'1.00x (base)' if m == 'ar' else ratio_cell(w.speedup_samples, w.speedup, w.acceptance_length):>20} "
                      f"{100 * w.host_overhead_share:>5.1f}%  "
                      + " ".join(f"{k}:{v}" for k, v in w.k_histogram.items() if v)
                      for m, w in r.modes.items())
    if r.quantization:
        out += "\n" + r.quantization
    return out


def _over(r: BenchResult) -> str:
    return "repeats" if r.repeats > 1 else "halves of the prompts"


def plot(r: BenchResult, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for p, v in r.position_acceptance.items():
        ax.plot(range(1, len(v) + 1), v, marker="o", label=f"{p} (tau {r.acceptance_length[p]:.2f})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"{Path(r.folder).name}: acceptance per position")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
