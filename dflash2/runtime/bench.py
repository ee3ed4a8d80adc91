"""Autoregressive vs speculative decoding in ONE process, interleaved per prompt, plus the
acceptance of alternative draft policies. Prints a table, returns a JSON-able dict."""

from __future__ import annotations

import time
from pathlib import Path

from dflash2 import dtypes
from dflash2.manifest import ExportManifest
from dflash2.prompts import default_prompts, load_prompts  # noqa: F401 (re-exported for callers)
from dflash2.quantization import describe, label
from dflash2.runtime.api import Runtime
from dflash2.runtime.policies import POLICIES, PolicySession
from dflash2.speculative import Stats, check_draft_len, gap_closed, generate


class TimedEngine:
    """Counts the seconds spent inside engine calls: everything else in a step is host overhead."""

    def __init__(self, engine):
        self.engine, self.seconds = engine, 0.0

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
    from dflash2.runtime.engines import OrtEngine

    m = rt.manifest
    S, K, R, V = m.num_drafts, m.selector.top_k, m.selector.rank, m.vocab_size
    rng = np.random.default_rng(0)
    feeds = {"cand_logits": np.sort(rng.standard_normal((1, S, K), dtype=np.float32))[..., ::-1].copy(),
             "cand_ids": rng.integers(0, V, (1, S, K)).astype(np.int32),
             "gate": rng.standard_normal((1, S, R)).astype(dtypes.numpy_dtype(m.dtype)),
             "anchor": np.array([1], np.int32)}
    session = OrtEngine("selector", Path(rt.folder) / graph.flavours.portable, ["CPUExecutionProvider"]).session
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
        out.emitted += s.emitted
        out.new_tokens += s.new_tokens
        for k, v in s.times.items():
            out.times[k] += v
    return out


def bench(folder: str | Path, prompts: list[str], max_new_tokens: int = 128, chat: bool = True,
          policies: tuple[str, ...] | None = None, repeats: int = 1, draft_len: int | None = None,
          sweep: tuple[int, ...] = ()) -> dict:
    """sweep: more draft lengths timed with the selector's path in the same interleaved loop, so
    their speedups compare (this machine's speed drifts between runs, not within one)."""
    rt = Runtime(folder)
    m = rt.manifest
    draft_len = check_draft_len(draft_len, m.block_size)
    sweep = tuple(k for k in dict.fromkeys(check_draft_len(k, m.block_size) for k in sweep)
                  if k != draft_len)
    v2 = m.drafter_version == 2
    policies = policies or (POLICIES if v2 else ("selector",))
    if "selector" not in policies:
        policies = ("selector", *policies)  # the speculative timing is the selector's path
    sessions = {p: PolicySession(rt.manifest, rt.session.backend, policy=p) for p in policies}
    for s in sessions.values():
        s.target, s.drafter = TimedEngine(s.target), TimedEngine(s.drafter)
    main = sessions["selector"]
    ar, spec, per_policy, lossless = [], [], {p: [] for p in policies}, True
    swept: dict[int, list[Stats]] = {k: [] for k in sweep}
    engine_s = host_s = 0.0
    for prompt in prompts:
        ids = rt.prompt_ids(text=prompt, chat=chat) if isinstance(prompt, str) else list(prompt)
        main.check_capacity(len(ids), max_new_tokens)
        for _ in range(repeats):  # interleaved: AR then speculative, same prompt, same process
            base = generate(main, ids, max_new_tokens, rt.eos_ids, speculative=False)
            ar.append(base.stats)
            for p, s in sessions.items():
                s.set_truth(len(ids), base.ids)
                e0 = s.target.seconds + s.drafter.seconds
                g = generate(s, ids, max_new_tokens, rt.eos_ids, draft_len=draft_len)
                lossless &= g.ids == base.ids
                per_policy[p].append(g.stats)
                if p == "selector":
                    spec.append(g.stats)
                    e = s.target.seconds + s.drafter.seconds - e0
                    engine_s += e
                    host_s += g.stats.times["total"] - e
            for k in sweep:
                g = generate(main, ids, max_new_tokens, rt.eos_ids, draft_len=k)
                lossless &= g.ids == base.ids
                swept[k].append(g.stats)
    A, S = _merge(ar), _merge(spec)
    ar_tps, spec_tps = A.tokens_per_second, S.tokens_per_second
    acc = {p: _merge(v).acceptance_length for p, v in per_policy.items()}
    result = {
        "folder": str(folder), "backend": rt.backend_name, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
        "block_size": m.block_size, "dtype": m.dtype, "lossless": lossless,
        "weights": label(m), "quantization": describe(m),
        "draft_len": draft_len,
        "draft_vocab_size": m.draft_vocab.size if m.draft_vocab else m.vocab_size,
        "autoregressive_tokens_per_second": ar_tps, "speculative_tokens_per_second": spec_tps,
        "speedup": spec_tps / ar_tps if ar_tps else 0.0,
        "acceptance_length": acc, "position_acceptance": {p: _merge(v).position_acceptance()
                                                          for p, v in per_policy.items()},
        "speculative_seconds": S.to_dict()["seconds"], "autoregressive_seconds": A.to_dict()["seconds"],
        "host_overhead_share": host_s / (host_s + engine_s) if engine_s else 0.0,
        "spec_step_ms": _round_ms(S),
        "ar_step_ms": 1e3 * A.times["decode"] / max(A.new_tokens - len(ar), 1),
    }
    result["select_ms_standalone"] = selector_ms(rt)
    if {"top1", "oracle", "selector"} <= set(acc):
        result["selector_gap_closed"] = gap_closed(acc["selector"], acc["top1"], acc["oracle"])
    if sweep:
        rows = {draft_len: S, **{k: _merge(v) for k, v in swept.items()}}
        result["draft_len_sweep"] = [_sweep_row(k, rows[k], ar_tps) for k in sorted(rows)]
    return result


def _sweep_row(k: int, s: Stats, ar_tps: float) -> dict:
    return {"draft_len": k, "acceptance_length": s.acceptance_length, "tokens_per_second": s.tokens_per_second,
            "speedup": s.tokens_per_second / ar_tps if ar_tps else 0.0,
            "round_ms": _round_ms(s)}


def _round_ms(s: Stats) -> float:
    """Draft + verify time per speculative round."""
    return 1e3 * (s.times["draft"] + s.times["verify"]) / max(s.rounds, 1)


def table(r: dict) -> str:
    rows = [("backend / dtype", f"{r['backend']} / {r['dtype']}"), ("weights", r.get("weights", r["dtype"])),
            ("prompts", r["prompts"]),
            ("draft vocabulary (ids)", r.get("draft_vocab_size", "-")),
            ("drafts verified per round", r.get("draft_len", "-")),
            ("lossless (spec == AR ids)", r["lossless"]),
            ("autoregressive tok/s", f"{r['autoregressive_tokens_per_second']:.1f}"),
            ("speculative tok/s", f"{r['speculative_tokens_per_second']:.1f}"),
            ("speedup", f"{r['speedup']:.2f}x"),
            ("AR step ms / spec round ms", f"{r['ar_step_ms']:.2f} / {r['spec_step_ms']:.2f}"),
            ("host overhead (spec)", f"{100 * r['host_overhead_share']:.1f}%")]
    if r.get("select_ms_standalone") is not None:
        rows.append(("select ms (standalone graph)", f"{r['select_ms_standalone']:.3f}"))
    rows += [(f"acceptance length: {p}", f"{v:.2f}") for p, v in r["acceptance_length"].items()]
    if r.get("selector_gap_closed") is not None:
        rows.append(("top1->oracle gap closed", f"{100 * r['selector_gap_closed']:.0f}%"))
    s = r["speculative_seconds"]
    rows.append(("spec seconds: draft/verify/host", f"{s['draft']:.2f} / {s['verify']:.2f} / {s['host']:.2f}"))
    out = "\n".join(f"{k:<34}{v!s:>18}" for k, v in rows)
    pos = "\n".join(f"  {p:<9}" + " ".join(f"{x:.2f}" for x in v) for p, v in r["position_acceptance"].items())
    out += "\nacceptance per draft position:\n" + pos
    if r.get("quantization"):
        out += "\n" + r["quantization"]
    if r.get("draft_len_sweep"):
        out += "\ndraft length sweep (selector path, same run):\n    K    tau  round ms    tok/s  speedup\n"
        out += "\n".join(f"  {w['draft_len']:>3} {w['acceptance_length']:>6.2f} {w['round_ms']:>9.2f} "
                         f"{w['tokens_per_second']:>8.1f} {w['speedup']:>7.2f}x" for w in r["draft_len_sweep"])
    return out


def plot(r: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for p, v in r["position_acceptance"].items():
        ax.plot(range(1, len(v) + 1), v, marker="o", label=f"{p} (tau {r['acceptance_length'][p]:.2f})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"{Path(r['folder']).name}: acceptance per position")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
