"""The edge install: `pip install dflash2[runtime]` in a fresh venv has no torch and runs dflash2-run on an export,
with the same ids as the full install; a CLI whose extra is missing names it."""

import json
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "5,17,42,99,3"


@pytest.fixture(scope="module")
def runtime_venv(tmp_path_factory):
    env = tmp_path_factory.mktemp("runtime-venv") / "venv"
    venv.EnvBuilder(with_pip=True).create(env)
    r = subprocess.run([str(env / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                        f"{ROOT}[runtime]"], capture_output=True, text=True, timeout=900)
    if r.returncode != 0 and ("Could not find a version" in r.stderr or "connection" in r.stderr.lower()):
        pytest.skip(f"no package index reachable to build the runtime venv: {r.stderr.strip()[-300:]}")
    assert r.returncode == 0, r.stderr[-2000:]
    return env


@pytest.mark.slow
def test_runtime_extra_has_no_torch_and_runs_an_export(runtime_venv, exports, capsys):
    py = runtime_venv / "bin" / "python"
    r = subprocess.run([str(py), "-c", "import importlib.util as u; print([m for m in ('torch', 'transformers', "
                        "'onnx', 'polygraphy', 'matplotlib') if u.find_spec(m)])"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
    folder = exports[("qwen3", 2)]
    edge = subprocess.run([str(runtime_venv / "bin" / "dflash2-run"), str(folder), "--prompt-ids", PROMPT,
                           "--max-new-tokens", "24", "--json"], capture_output=True, text=True, timeout=300)
    assert edge.returncode == 0, edge.stderr
    full = subprocess.run([sys.executable, "-m", "dflash2.cli.run", str(folder), "--prompt-ids", PROMPT,
                           "--max-new-tokens", "24", "--json", "--no-spec"], capture_output=True, text=True,
                          timeout=300)
    assert full.returncode == 0, full.stderr
    assert json.loads(edge.stdout)["ids"] == json.loads(full.stdout)["ids"]  # lossless, on the torch-free install
    exp = subprocess.run([str(runtime_venv / "bin" / "dflash2-export"), "--help"], capture_output=True, text=True)
    assert exp.returncode == 2 and exp.stderr.count("\n") == 1, exp.stderr
    assert "needs torch" in exp.stderr and "pip install 'dflash2[export]'" in exp.stderr
