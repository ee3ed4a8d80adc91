"""Quantized deployment benchmark: dflash2 exports (fp32, int4, int8 ...; each autoregressive and
speculative) and onnxruntime-genai's own int4 model of the same target, in ONE process, interleaved
per prompt (this machine's speed drifts between runs, not within one: compare the ratios).

Every configuration gets the same prompt ids (the target's chat template, encoded once) and decodes
greedily up to the same number of new tokens; tokens/s counts the tokens after the first over the
time after the prompt (time to first token excluded), as dflash2-bench does. Also measured:
- lossless: each export's speculative ids == the same export's autoregressive ids (the quantized
  target as deployed is the reference of its own speculative decoding);
- top-1 agreement of every other export's target with the first export's (fp32) target, teacher-forced
  on the first export's greedy output: the share of positions where both targets pick the same token;
- the acceptance-length change between the first export and each other one.
onnxruntime-genai is an optional extra (`pip install dflash2[genai]`), imported only here.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from dflash2.bench.ratio import describe_ratio, pass_of, ratio_cell
from dflash2.bench.result import BestConfig, QuantBenchResult, QuantExport
from dflash2.errors import Dflash2Error
from dflash2.quant_manifest import describe, label
from dflash2.runtime.api import Runtime
from dflash2.speculative import FixedSchedule, generate


class GenaiRunner:
    """onnxruntime-genai's greedy generator over a folder written by its model builder."""

    def __init__(self, folder: Path, threads: int | None = None):
        try:
            import onnxruntime_genai as og
        except ImportError as e:
            raise Dflash2Error(f"--genai {folder}: onnxruntime-genai is not installed "
                               f"(pip install 'onnxruntime-genai==0.18.0', the dflash2[genai] extra)") from e
        if not (Path(folder) / "genai_config.json").is_file():
            raise Dflash2Error(f"--genai {folder}: expected genai_config.json (a folder written by "
                               f"`python -m onnxruntime_genai.models.builder ... -o {folder}`), found none")
        self.og, self.folder = og, Path(folder)
        config = og.Config(str(folder))
        if threads:  # the same intra-op thread count as dflash2's sessions
            config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)
        self.version = og.__version__

    def generate(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
        """(new ids, seconds after the first new token)."""
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, max_length=len(ids) + max_new_tokens)
        gen = self.og.Generator(self.model, params)
        gen.append_tokens(ids)
        out, t0 = [], None
        while not gen.is_done() and len(out) < max_new_tokens:
            gen.generate_next_token()
            out.append(int(gen.get_next_tokens()[0]))
            if t0 is None:
                t0 = time.perf_counter()
        return out, time.perf_counter() - t0 if t0 is not None else 0.0


def top1_agreement(rt: Runtime, prompt: list[int], reference: list[int]) -> tuple[int, int]:
    """(agreeing positions, positions): rt's target argmax over prompt + reference[:-1] vs reference."""
    if len(reference) < 1:
        return 0, 0
    s = rt.session
    s.reset()
    next_ids = s.verify(prompt + reference[:-1]).ids  # one pass; positions len(prompt)-1 .. predict reference
    got = [int(x) for x in next_ids[len(prompt) - 1:]]
    s.reset()
    return sum(a == b for a, b in zip(got, reference)), len(reference)


def _labels(runtimes: list[Runtime]) -> list[str]:
    out: list[str] = []
    for rt in runtimes:
        m = rt.manifest
        q = m.quantization  # "target-only": ONNX Runtime's choice; modelopt's Q/DQ covers the target only anyway
        base = label(m) + (" target-only" if q and q.backend == "onnxruntime" and not q.drafter else "")
        own = getattr(q, "drafter_method", None) if q and q.drafter else None
        base += f" drafter {own}" if own and own != q.method else ""
        base += " gqa" if m.kv is not None and m.kv.target_attention == "gqa" else ""
        name, k = base, 2
        while name in out:
            name, k = f"{base}-{k}", k + 1
        out.append(name)
    return out


def bench_quant(folders: list[str | Path], prompts: list[str], genai: str | Path | None = None,
                max_new_tokens: int = 128, chat: bool = True, draft_len: int | str | None = 2, repeats: int = 1,
                threads: int | None = None, log=None) -> QuantBenchResult:
    """folders: export folders of the same target; the first is the reference (normally fp32).
    draft_len: K drafts verified per round, or "auto" (each export's own runtime schedule, learning
    across the prompts as in dflash2-run).
    threads: intra-op threads of every session, dflash2's and onnxruntime-genai's (default: ONNX Runtime's).
    log: gets a progress line after every prompt (running tokens/s of each configuration)."""
    if not folders:
        raise Dflash2Error("give at least one export folder")
    runtimes = [Runtime(f, threads=threads, schedule_cache=False) for f in folders]  # cold sessions
    labels = _labels(runtimes)
    ref = runtimes[0]
    for rt, f in zip(runtimes[1:], folders[1:]):
        if rt.manifest.vocab_size != ref.manifest.vocab_size:
            raise Dflash2Error(f"{f}: vocab_size {rt.manifest.vocab_size} != {ref.manifest.vocab_size} of "
                               f"{folders[0]}: the exports must share one target")
    S = ref.manifest.block_size - 1
    schedules = [rt.schedule(S if draft_len is None else draft_len) for rt in runtimes]  # checks the value
    K = schedules[0].k if isinstance(schedules[0], FixedSchedule) else "auto"
    warm_k = S if K == "auto" else K  # the warm-up allocates every shape the runs use
    runner = GenaiRunner(Path(genai), threads) if genai is not None else None
    names = [f"{lab} {mode}" for lab in labels for mode in ("autoregressive", "speculative")]
    names += ["onnxruntime-genai int4"] if runner else []
    tokens = {n: 0 for n in names}
    seconds = {n: 0.0 for n in names}
    by_pass: dict[str, dict[int, list[float]]] = {n: {} for n in names}  # name -> pass -> [tokens, seconds]
    acc = {lab: [0, 0] for lab in labels}  # accepted + 1 summed, rounds
    agree = {lab: [0, 0] for lab in labels[1:]}
    lossless = {lab: True for lab in labels}
    genai_vs_ref = [0, 0]
    for i, prompt in enumerate(prompts):
        ids = ref.prompt_ids(text=prompt, chat=chat) if isinstance(prompt, str) else list(prompt)
        for rt in runtimes:
            rt.session.check_capacity(len(ids), max_new_tokens)
        if i == 0:  # untimed warm-up: first runs of each graph shape allocate
            for rt in runtimes:
                generate(rt.session, ids, 8, rt.eos_ids, speculative=False)
                generate(rt.session, ids, 8, rt.eos_ids, draft_len=warm_k)
            if runner:
                runner.generate(ids, 8)
        for rep in range(repeats):
            p = pass_of(i, rep, repeats)
            first_ar = None
            for lab, rt, sched in zip(labels, runtimes, schedules):
                ar = generate(rt.session, ids, max_new_tokens, rt.eos_ids, speculative=False)
                sp = generate(rt.session, ids, max_new_tokens, rt.eos_ids, schedule=sched)
                lossless[lab] &= sp.ids == ar.ids
                for mode, g in (("autoregressive", ar), ("speculative", sp)):
                    _add(tokens, seconds, by_pass, f"{lab} {mode}", p, max(g.stats.new_tokens - 1, 0),
                         g.stats.decode_seconds)
                acc[lab][0] += sum(a + 1 for a in sp.stats.accepted)
                acc[lab][1] += sp.stats.rounds
                first_ar = ar.ids if first_ar is None else first_ar
            if runner:
                out, s = runner.generate(ids, max_new_tokens)
                _add(tokens, seconds, by_pass, "onnxruntime-genai int4", p, max(len(out) - 1, 0), s)
                genai_vs_ref[0] += sum(a == b for a, b in zip(out, first_ar))
                genai_vs_ref[1] += len(first_ar)
        for lab, rt in zip(labels[1:], runtimes[1:]):
            a, n = top1_agreement(rt, ids, first_ar)
            agree[lab][0] += a
            agree[lab][1] += n
        if log is not None:
            run = "  ".join(f"{n} {tokens[n] / seconds[n]:.1f}" for n in names if seconds[n])
            log(f"[prompt {i + 1}/{len(prompts)}] {len(ids)} tokens, running tok/s: {run}")
    tps = {n: tokens[n] / seconds[n] if seconds[n] else 0.0 for n in names}
    tau = {lab: a / r if r else 0.0 for lab, (a, r) in acc.items()}
    best = max((n for n in names if not n.startswith("onnxruntime-genai")), key=lambda n: tps[n])
    genai_tps = tps.get("onnxruntime-genai int4")
    return QuantBenchResult(
        prompts=len(prompts), max_new_tokens=max_new_tokens, draft_len=K, repeats=repeats, threads=threads,
        exports={lab: QuantExport(str(f), describe(rt.manifest), _quantization(rt.manifest))
                 for lab, f, rt in zip(labels, folders, runtimes)},
        genai={"folder": str(genai), "version": runner.version} if runner else None,
        tokens_per_second=tps, tokens_per_second_by_pass={n: [t / s if s else 0.0 for _, (t, s) in sorted(v.items())]
                                                          for n, v in by_pass.items()},
        lossless=lossless, acceptance_length=tau,
        acceptance_change={lab: tau[lab] - tau[labels[0]] for lab in labels[1:]},
        top1_agreement_vs_first={lab: a / n if n else 0.0 for lab, (a, n) in agree.items()},
        genai_prefix_agreement_vs_first=genai_vs_ref[0] / genai_vs_ref[1] if genai_vs_ref[1] else None,
        best=BestConfig(best, tps[best], tps[best] / genai_tps if genai_tps else None))


def _add(tokens, seconds, by_pass, name: str, p: int, n: int, s: float) -> None:
    tokens[name] += n
    seconds[name] += s
    cell = by_pass[name].setdefault(p, [0, 0.0])
    cell[0] += n
    cell[1] += s


def _vs(r: QuantBenchResult, name: str, other: str) -> list[float]:
    """name's tok/s over other's, once per independent pass (ratio.pass_of): the spread of their ratio."""
    a, b = r.tokens_per_second_by_pass.get(name, []), r.tokens_per_second_by_pass.get(other, [])
    return [x / y if y else 0.0 for x, y in zip(a, b)]


def _quantization(m) -> dict | None:
    q = m.quantization
    return None if q is None else {"method": q.method, "bits": q.bits, "block_size": q.block_size,
                                   "accuracy_level": q.accuracy_level, "graphs": sorted(q.graphs),
                                   "drafter_method": getattr(q, "drafter_method", None)}


def table(r: QuantBenchResult) -> str:
    g = r.tokens_per_second.get("onnxruntime-genai int4")
    head = f"{'configuration':<34}{'tok/s':>9}{'vs genai, range':>20}{'tau':>7}  lossless"
    lines = [f"{r.prompts} prompts, {r.max_new_tokens} new tokens, greedy, speculative with K={r.draft_len} "
             f"drafts verified per round, intra-op threads {r.threads or 'ONNX Runtime default'}",
             head, "-" * len(head)]
    for name, v in r.tokens_per_second.items():
        lab, _, mode = name.rpartition(" ")
        tau = f"{r.acceptance_length[lab]:.2f}" if mode == "speculative" else "-"
        ok = str(r.lossless[lab]) if mode == "speculative" else "-"
        vs = "-" if not g else "1.00x (base)" if name == "onnxruntime-genai int4" else ratio_cell(
            _vs(r, name, "onnxruntime-genai int4"), v / g)
        lines.append(f"{name:<34}{v:>9.1f}{vs:>20}{tau:>7}  {ok}")
    for lab, a in r.top1_agreement_vs_first.items():
        lines.append(f"top-1 agreement {lab} vs {r.reference}: {100 * a:.1f}%  "
                     f"(acceptance length change {r.acceptance_change[lab]:+.2f})")
    if r.genai_prefix_agreement_vs_first is not None:
        lines.append(f"onnxruntime-genai int4 ids equal to {r.reference} greedy ids at "
                     f"{100 * r.genai_prefix_agreement_vs_first:.1f}% of positions")
    b = r.best
    over = "repeats" if r.repeats > 1 else "halves of the prompts"
    lines.append(f"best dflash2: {b.config} {b.tokens_per_second:.1f} tok/s"
                 + (" vs onnxruntime-genai int4: " + describe_ratio(_vs(r, b.config, "onnxruntime-genai int4"),
                                                                    b.vs_genai_int4, over=over)
                    if b.vs_genai_int4 is not None else ""))
    for lab in r.exports:  # what speculative decoding bought each export, by the same rule
        sp, ar = f"{lab} speculative", f"{lab} autoregressive"
        if r.tokens_per_second.get(ar):
            lines.append(f"{lab} speculative / autoregressive: " + describe_ratio(
                _vs(r, sp, ar), r.tokens_per_second[sp] / r.tokens_per_second[ar], over=over))
    lines += [f"{lab}: {e.describe}" for lab, e in r.exports.items()]
    return "\n".join(lines)
