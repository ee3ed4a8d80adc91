"""The device check's trainer piece (dflash2-train on a small random target on the GPU, label tokens/s) and
its tensorrt row, always skipped here. The trainer runs as a subprocess (python -m dflash2.cli.train), so
this module imports no train code: a crash or a hang in training is a row, not the end of the check."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from dflash2.bench.device.runner import BUDGETS, FAIL, PASS, ROOT, SKIP


TOKS = re.compile(r"([\d,]+) label tok/s")


def parse_throughput(log: str) -> float | None:
    """The last 'N label tok/s' the trainer printed (dflash2/train/trainer.py), else None."""
    found = TOKS.findall(log)
    return float(found[-1].replace(",", "")) if found else None


def trainer_command(target: Path, out: Path, minutes: float, device: str = "cuda", prompts: int = 300) -> list[str]:
    return [sys.executable, "-m", "dflash2.cli.train", "--target", str(target), "--out", str(out),
            "--prompts", f"templated:{prompts}", "--max-new-tokens", "48", "--minutes", f"{minutes:g}",
            "--device", device, "--steps", "1000000", "--eval-every", "1000000", "--save-every", "1000000",
            "--block-size", "8", "--top-k", "16", "--rank", "64", "--seed", "0"]


def piece_trainer(ctx: dict, command=None) -> dict:
    minutes = ctx["train_minutes"]
    work = Path(ctx["work"]) / "trainer"
    cut = ""
    if command is None:
        fit = (ctx["budget"] - BUDGETS["trainer"]) / 60  # what is left after setup, corpus and evaluation
        if fit < minutes:
            if fit < 0.5:
                return {"result": FAIL, "detail": f"only {ctx['budget']:.0f} s left: too little for a trainer run"}
            minutes, cut = round(fit, 2), f" (cut from {minutes:g} min to fit the check's budget)"
        from dflash2 import tiny
        shutil.rmtree(work, ignore_errors=True)
        target = tiny.make_target(work / "target", family="qwen3", hidden_size=256, num_layers=4,
                                  intermediate_size=512)
        command = trainer_command(target, work / "drafter", minutes)
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    try:
        p = subprocess.run(command, env=env, capture_output=True, text=True, timeout=max(ctx["budget"] - 5, 1),
                           cwd=str(ROOT))
        log, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        log = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        log += (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        rc = "timeout"
    (work / "trainer.log").write_text(log)
    ctx["trainer_log"] = str(work / "trainer.log")
    rate = parse_throughput(log)
    took = time.monotonic() - t0
    data = {"minutes": minutes, "label_tokens_per_s": rate, "exit": rc, "seconds": round(took, 1),
            "command": " ".join(map(str, command)), "log_tail": log.strip().splitlines()[-8:]}
    if rc != 0 or rate is None:
        tail = " | ".join(log.strip().splitlines()[-2:])[:300]
        return {"result": FAIL, "data": data, "detail": f"trainer exit {rc}, throughput "
                                                        f"{'not printed' if rate is None else rate}: {tail}"}
    steps = re.findall(r"step (\d+)/", log)
    return {"result": PASS, "cases": int(steps[-1]) if steps else 0, "data": data,
            "detail": f"{minutes:g} min of training{cut}: {rate:,.0f} label tok/s ({took:.0f} s in all, corpus and "
                      f"evaluation included)"}


def piece_tensorrt(ctx: dict) -> dict:
    if importlib.util.find_spec("tensorrt") is None:
        return {"result": SKIP, "detail": "no TensorRT in this image (scripts/gpu_check.sh runs it where TensorRT "
                                          "is installed)"}
    return {"result": SKIP, "detail": "TensorRT is installed here: run scripts/gpu_check.sh for the TensorRT path"}


