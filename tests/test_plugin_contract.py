"""The plugin against the single op contract: its YAML, its C++ field list, its README, and the
C++ lifecycle driver (dlopens libdflash2_plugins.so; needs no TensorRT runtime and no GPU)."""

from __future__ import annotations

import ctypes
import json
import os
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


def test_plugin_library_exports_tensorrt_entry_points(plugin_lib: Path):
    lib = ctypes.CDLL(str(plugin_lib))
    for symbol in ("getCreators", "setLoggerFinder", "dflash2_select_path_cuda", "dflash2_select_path_cpu"):
        assert hasattr(lib, symbol), f"{plugin_lib.name} does not export {symbol}"
