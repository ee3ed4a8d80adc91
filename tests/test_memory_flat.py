"""A 1,500-token generation holds its memory flat after warm-up and stays lossless.

The runtime allocates every buffer once per session, so after two full-length warm-up runs (which
also touches the lazily mapped KV pages) further 1,500-token runs must not grow the process: RSS
sampled every round stays within 256 KiB in at least one of three runs (a leak of 200 bytes a token
would exceed it in every run), and tracemalloc sees no Python memory left behind between runs.
Measured in a fresh subprocess so earlier tests' peaks do not hide a growth.

Why "one of three": the allocators under ONNX Runtime and Python raise their high-water mark once in a
while long after warm-up (measured: a single ~600 KiB step in one run out of six, at a different round
each time, with glibc's trim and mmap thresholds pinned too, and no step in the runs after it). A leak
repeats in every run; a high-water step does not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import json, sys, tracemalloc
from dflash2.runtime.api import Runtime
from dflash2.speculative import generate

def rss():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096

rt = Runtime(sys.argv[1])
prompt, n = [5, 17, 42, 99, 7, 250, 31], 1500
target_only = generate(rt.session, prompt, n, (), speculative=False).ids
# warm-up: two full runs touch every buffer page and let ONNX Runtime's arena settle (the second
# still grows ~1 MiB on the tiny model, the ones after it by a few KiB: measured, see the test)
warm = [generate(rt.session, prompt, n, ()).ids for _ in range(2)]
runs = []
for traced in (False, False, False, True):  # RSS without tracemalloc (its own bookkeeping grows RSS), then traced
    if traced and not tracemalloc.is_tracing():
        tracemalloc.start()
    samples = [0] * (n + 1)  # preallocated: the sampling itself must not allocate
    count = [0]

    def on_tokens(new):
        samples[count[0]] = rss()
        count[0] += 1
        return False

    start, traced0 = rss(), tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    # the traced run samples nothing: the sampled RSS ints would be memory the test itself keeps
    ids = generate(rt.session, prompt, n, (), on_tokens=None if traced else on_tokens).ids
    run = {"traced": traced, "rss_start": start, "rss_max": max(samples[:count[0]] or [0]), "rounds": count[0],
           "lossless": ids == target_only, "tokens": len(ids),
           "traced_peak_growth": tracemalloc.get_traced_memory()[1] - traced0}
    del ids
    run["traced_left"] = tracemalloc.get_traced_memory()[0] - traced0
    runs.append(run)
print(json.dumps({"runs": runs, "warm_lossless": all(w == target_only for w in warm)}))
"""


@pytest.mark.slow
def test_1500_tokens_memory_flat_and_lossless(exports):
    folder = exports[("llama", 2)]  # max_seq_len 6000
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[1]))
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(folder)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["warm_lossless"]
    for run in out["runs"]:
        assert run["tokens"] == 1500 and run["lossless"], run  # speculative == target-only, token for token
        if not run["traced"]:
            assert run["rounds"] > 100, run  # sampled every round
        else:
            assert run["traced_left"] < 16 << 10, run  # nothing kept between runs
            assert run["traced_peak_growth"] < 512 << 10, run  # the ids list and per-round stats only
    growth = [r["rss_max"] - r["rss_start"] for r in out["runs"] if not r["traced"]]
    assert min(growth) < 256 << 10, out["runs"]  # flat: < 256 KiB over 1,500 tokens (see the docstring)
    print(json.dumps(out["runs"]))
