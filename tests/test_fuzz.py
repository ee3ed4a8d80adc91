"""Seeded random mutations of config and manifest fields: every one ends in a Dflash2Error or a clean
run, never another exception (a traceback at the CLI), and nothing is left behind.

Configs go through everything dflash2-export checks before it writes (export.api.preflight: output
folder, configs, pair, capacity, weights) and, when they pass, one reference generation. Manifests
are mutated and, mostly, resealed (a fresh manifest_sha256, as a buggy writer would leave them, so
the checks behind the seal are what is exercised), then opened by the runtime and generated from.
"""

from __future__ import annotations

import copy
import json
import random
import shutil

import pytest

from dflash2 import manifest as mf
from dflash2 import tiny
from dflash2.errors import Dflash2Error
from dflash2.export.api import preflight
from dflash2.reference.backend import TorchBackend
from dflash2.runtime.api import Runtime
from dflash2.speculative import generate
from tests.errorcheck import snapshot

CONFIG_CASES, MANIFEST_CASES = 300, 200
PROMPT = [5, 17, 42, 99, 7]


def _values(old, rng: random.Random) -> list:
    pool = [None, 0, 1, -1, 2, 3, 7, 10 ** 12, 0.5, -2.5, float("nan"), "", "x", "8", [], [0], [1, 2], [True], {},
            {"a": 1}, True, False]
    if isinstance(old, (int, float)) and not isinstance(old, bool):
        pool += [old + 1, old - 1, old * 2, -old, type(old)(old) / 3]
    if isinstance(old, list) and old:
        pool += [old[:-1], old + old[-1:], list(reversed(old))]
    return pool


def _paths(tree, prefix=()) -> list[tuple]:
    """Every key path in a JSON tree (objects and lists), containers included."""
    out = []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for k, v in items:
        out.append(prefix + (k,))
        out += _paths(v, prefix + (k,))
    return out


def mutate(doc: dict, rng: random.Random, n: int) -> list[str]:
    """Change n random fields of doc in place (a new value, a deletion, or a new key); returns what changed."""
    done = []
    for _ in range(n):
        paths = _paths(doc)
        path = rng.choice(paths) if paths and rng.random() < 0.9 else ("new_field",)
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        old = parent[path[-1]] if (isinstance(parent, dict) and path[-1] in parent) or isinstance(parent, list) \
            else None
        if isinstance(parent, dict) and rng.random() < 0.2:
            parent.pop(path[-1], None)
            done.append(f"del {'.'.join(map(str, path))}")
            continue
        new = rng.choice(_values(old, rng))
        parent[path[-1]] = new
        done.append(f"{'.'.join(map(str, path))} = {new!r}")
    return done


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    d, t = tiny.make_pair(root / "pair", family="qwen3", version=2)
    return d, t


def test_config_fuzz(pristine, tmp_path):
    drafter, target = tmp_path / "drafter", tmp_path / "target"
    shutil.copytree(pristine[0], drafter)
    shutil.copytree(pristine[1], target)
    texts = {f: (f / "config.json").read_text() for f in (drafter, target)}
    configs = {f: json.loads(t) for f, t in texts.items()}
    rng, failures, outcomes = random.Random(1234), [], {"refused": 0, "ran": 0}
    before = {f: snapshot(f) for f in (drafter, target)}
    for case in range(CONFIG_CASES):
        folder = rng.choice([drafter, target])
        doc = copy.deepcopy(configs[folder])
        what = mutate(doc, rng, rng.choice([1, 1, 2, 3]))
        (folder / "config.json").write_text(json.dumps(doc))
        try:
            t, d = preflight(drafter, target, tmp_path / "out", max_seq_len=64)
            generate(TorchBackend(t, d, 64), PROMPT, 8)
            outcomes["ran"] += 1
        except Dflash2Error:
            outcomes["refused"] += 1
        except Exception as e:  # noqa: BLE001 - the property under test: nothing else escapes
            failures.append(f"case {case} {folder.name}: {what}: {type(e).__name__}: {e}"[:300])
        (folder / "config.json").write_text(texts[folder])
        assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "target"], what  # nothing left
    assert failures == [], "\n".join(failures)
    assert {f: snapshot(f) for f in (drafter, target)} == before
    assert outcomes["refused"] > CONFIG_CASES // 3 and outcomes["ran"] > 10, outcomes  # both paths exercised


def test_manifest_fuzz(export_dir, tmp_path):
    folder = tmp_path / "export"
    shutil.copytree(export_dir, folder)
    pristine_text = (folder / mf.NAME).read_text()
    pristine = json.loads(pristine_text)
    rng, failures, outcomes = random.Random(99), [], {"refused": 0, "ran": 0}
    before = snapshot(folder)
    for case in range(MANIFEST_CASES):
        doc = copy.deepcopy(pristine)
        what = mutate(doc, rng, rng.choice([1, 1, 2]))
        if rng.random() < 0.8:
            doc["manifest_sha256"] = mf.content_sha256(doc)  # resealed: the checks behind the seal decide
        (folder / mf.NAME).write_text(json.dumps(doc))
        try:
            rt = Runtime(folder, verify=False)
            rt.generate(rt.prompt_ids(ids=PROMPT), 6)
            outcomes["ran"] += 1
        except Dflash2Error:
            outcomes["refused"] += 1
        except Exception as e:  # noqa: BLE001 - the property under test: nothing else escapes
            failures.append(f"case {case}: {what}: {type(e).__name__}: {e}"[:300])
    (folder / mf.NAME).write_text(pristine_text)
    assert failures == [], "\n".join(failures)
    assert snapshot(folder) == before and sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert outcomes["refused"] > MANIFEST_CASES // 3 and outcomes["ran"] > 10, outcomes
