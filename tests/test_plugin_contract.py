"""The plugin against the single op contract: its YAML, its C++ field list, its README, and the
C++ lifecycle driver (dlopens libdflash2_plugins.so; needs no TensorRT runtime and no GPU)."""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from dflash2.native import library
from dflash2.ops import contract as C

REPO = Path(__file__).resolve().parents[1]
PLUGIN_DIR = REPO / "plugins" / "dflash2Selector"
DRIVER = "dflash2_plugin_lifecycle_test"
FIELD_TYPES = {"int": "INT32", "float": "FLOAT32", "string": "CHAR"}  # what TensorRT's ONNX parser passes


def skip_or_fail(msg: str) -> None:
    """Skip with the build hint; in CI (DFLASH2_REQUIRE_PLUGINS=1) a missing build is a failure."""
    if os.environ.get("DFLASH2_REQUIRE_PLUGINS") == "1":
        pytest.fail(f"DFLASH2_REQUIRE_PLUGINS=1 but {msg}")
    pytest.skip(msg)


@pytest.fixture(scope="module")
def plugin_lib() -> Path:
    try:
        return library.find_library(library.PLUGIN_LIB)
    except library.PluginLibraryError as e:
        skip_or_fail(str(e))


@pytest.fixture(scope="module")
def driver(plugin_lib: Path) -> Path:
    path = REPO / "build" / "plugins" / DRIVER
    if not path.is_file():
        skip_or_fail(f"{path} is missing; build it with `bash plugins/build.sh`")
    return path


def test_yaml_equals_contract():
    data = yaml.safe_load((PLUGIN_DIR / "DFlash2Selector_PluginConfig.yaml").read_text())
    assert data == C.as_dict()


def test_readme_names_every_tensor_and_attribute():
    text = (PLUGIN_DIR / "README.md").read_text()
    names = C.input_names() + C.output_names() + [a.name for a in C.ATTRIBUTES]
    missing = [n for n in names if f"`{n}`" not in text]
    assert not missing, f"README.md does not document {missing}"
    for needle in (f"K <= {C.MAX_TOP_K}", f"R <= {C.MAX_RANK}", "bash plugins/build.sh", "--dynamicPlugins",
                   "loadLibrary", "TENSORRT_ROOT"):
        assert needle in text, f"README.md lacks {needle!r}"


def test_lifecycle_driver_passes(driver: Path, plugin_lib: Path):
    out = subprocess.run([str(driver), str(plugin_lib)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().startswith("PASS:"), out.stdout


def test_cpp_fields_match_contract(driver: Path, plugin_lib: Path):
    out = subprocess.run([str(driver), "--dump-fields", str(plugin_lib)], capture_output=True, text=True,
                         timeout=60, check=True)
    got = json.loads(out.stdout)
    assert (got["name"], got["version"], got["namespace"]) == (C.OP_NAME, C.PLUGIN_VERSION, C.PLUGIN_NAMESPACE)
    assert got["fields"] == [{"name": a.name, "type": FIELD_TYPES[a.kind]} for a in C.ATTRIBUTES]
    defaults = {a.name: a.default for a in C.ATTRIBUTES if a.default is not None}
    assert {k: got["serialized_defaults"][k] for k in defaults} == defaults
    assert got["nb_outputs"] == len(C.OUTPUTS)
    mode = next(a for a in C.ATTRIBUTES if a.name == "mode")
    assert got["modes_accepted"] == list(mode.allowed) == list(C.MODES)


def test_cpp_tensor_lists_match_contract():
    """The C++ input table (names, symbolic dims), IO counts and the C ABI struct's pointer fields follow
    contract.INPUTS / OUTPUTS in order (the lifecycle driver then checks the behaviour)."""
    rules = (PLUGIN_DIR / "dflash2SelectorRules.cpp").read_text()
    header = (PLUGIN_DIR / "dflash2SelectorPlugin.h").read_text()
    math_h = (PLUGIN_DIR / "dflash2SelectorMath.h").read_text()
    names = re.search(r"kInputNames\[kNB_INPUTS\]\s*=\s*\{([^}]*)\}", rules).group(1)
    assert re.findall(r'"(\w+)"', names) == C.input_names()
    dims = re.search(r"kInputDims\[kNB_INPUTS\]\s*=\s*\{([^}]*)\}", rules).group(1)
    assert re.findall(r'"(\w+)"', dims) == ["".join(t.dims) for t in C.INPUTS]
    assert int(re.search(r"kNB_INPUTS = (\d+);", header).group(1)) == len(C.INPUTS)
    assert int(re.search(r"kNB_OUTPUTS = (\d+);", header).group(1)) == len(C.OUTPUTS)
    assert re.search(r'kPLUGIN_VERSION = "(\w+)"', header).group(1) == C.PLUGIN_VERSION
    struct = re.search(r"typedef struct Df2SelectArgs \{(.*?)\} Df2SelectArgs;", math_h, re.DOTALL).group(1)
    pointers = re.findall(r"\*\s*(\w+);", struct)
    assert pointers == C.input_names() + C.output_names()
    modes = re.search(r"enum \{ DF2_MODE_GREEDY = 0, DF2_MODE_SAMPLE = 1 \};", math_h)
    assert modes is not None and C.MODES == ("greedy", "sample")


def test_plugin_library_exports_tensorrt_entry_points(plugin_lib: Path):
    lib = ctypes.CDLL(str(plugin_lib))
    for symbol in ("getCreators", "setLoggerFinder", "dflash2_select_path_cuda", "dflash2_select_path_cpu"):
        assert hasattr(lib, symbol), f"{plugin_lib.name} does not export {symbol}"
