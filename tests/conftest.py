"""Shared fixtures: tiny checkpoint pairs made once per session with the package's own factory."""

from __future__ import annotations

import pytest

from dflash2 import tiny

PAIRS = [("llama", 1), ("llama", 2), ("qwen3", 1), ("qwen3", 2)]


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def targets(tiny_root):
    return {fam: tiny.make_target(tiny_root / f"target-{fam}", family=fam) for fam in ("llama", "qwen3")}


@pytest.fixture(scope="session")
def pairs(tiny_root, targets):
    """(family, version) -> (drafter_dir, target_dir)."""
    out = {}
    for fam, ver in PAIRS:
        d = tiny.make_drafter(tiny_root / f"drafter-{fam}-v{ver}", targets[fam], version=ver,
                              num_layers=2 if ver == 2 else 1)
        out[(fam, ver)] = (d, targets[fam])
    return out


@pytest.fixture(scope="session")
def exports(tiny_root, pairs):
    """(family, version) -> export folder, made lazily once per session."""
    from tests.exports import export_pair

    class Lazy(dict):
        def __missing__(self, key):
            self[key] = export_pair(tiny_root, pairs, *key, max_seq_len=6000)
            return self[key]

    return Lazy()
