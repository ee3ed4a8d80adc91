"""Find and load the DFlash2Selector native libraries, and check their C ABI version.

Libraries (built by `bash plugins/build.sh` into build/plugins/):
- libdflash2_selector_cpu.so: the CPU twin alone (g++ only; needs neither CUDA nor TensorRT);
- libdflash2_plugins.so: the TensorRT plugin + CUDA kernel + the same CPU twin; what
  `IPluginRegistry::loadLibrary` / `trtexec --dynamicPlugins` / `load_library` take.
Search order: $DFLASH2_PLUGIN_LIB (the plugin .so or a folder holding the libraries), then
build/plugins/ under the repository root.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import warnings
from pathlib import Path

from dflash2.errors import Dflash2Error

PLUGIN_LIB = "libdflash2_plugins.so"
CPU_LIB = "libdflash2_selector_cpu.so"
ENV_VAR = "DFLASH2_PLUGIN_LIB"
ABI_VERSION = 3  # 2: Df2SelectArgs.confidence; 3: + uniforms, temperature, draft_probs, mode
BUILD_HINT = ("build it from the repository root with `bash plugins/build.sh` (CPU twin only: "
              "`DFLASH2_CPU_ONLY=1 bash plugins/build.sh`), or set DFLASH2_PLUGIN_LIB to the built "
              "libdflash2_plugins.so or its folder")
BUILD_DIR = Path(__file__).resolve().parents[2] / "build" / "plugins"  # where plugins/build.sh writes


class PluginLibraryError(Dflash2Error):
    """A native library is missing, fails to load, or reports an error."""


class PluginVersionError(Dflash2Error):
    """A library or export names another plugin / ABI version than this checkout builds."""


def abi_version(lib: ctypes.CDLL, path: Path) -> int:
    """The C ABI version a loaded library reports; a library without the symbol is not ours."""
    if not hasattr(lib, "dflash2_selector_abi_version"):
        raise PluginLibraryError(f"{path}: not a DFlash2 plugin library (no dflash2_selector_abi_version); "
                                 f"{BUILD_HINT}")
    lib.dflash2_selector_abi_version.restype = ctypes.c_int32
    return int(lib.dflash2_selector_abi_version())


def open_library(path: Path) -> ctypes.CDLL:
    """dlopen a library (no TensorRT or GPU needed); a failure says how to rebuild it."""
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise PluginLibraryError(f"{path} failed to load: {e}; rebuild it: {BUILD_HINT}") from e


def library_abi(path: Path) -> int:
    """The C ABI version the library at `path` reports."""
    return abi_version(open_library(path), path)


def check_abi(path: Path, found: int) -> None:
    if found != ABI_VERSION:
        raise PluginVersionError(f"{path}: plugin library ABI version expected {ABI_VERSION}, found {found} "
                                 f"(built from another checkout?); rebuild it with `bash plugins/build.sh`")


def search_dirs() -> list[Path]:
    dirs = []
    env = os.environ.get(ENV_VAR)
    if env:
        p = Path(env)
        dirs.append(p.parent if p.is_file() or p.suffix == ".so" else p)
    dirs.append(BUILD_DIR)
    return dirs


def find_library(name: str = PLUGIN_LIB) -> Path:
    """Path of `name` (libdflash2_plugins.so or libdflash2_selector_cpu.so); error says how to build."""
    env = os.environ.get(ENV_VAR)
    if env and name == PLUGIN_LIB and Path(env).is_file():
        return Path(env)
    looked = [d / name for d in search_dirs()]
    for p in looked:
        if p.is_file():
            return p
    raise PluginLibraryError(f"{name} not found (looked in: {', '.join(map(str, looked))}); {BUILD_HINT}")


def recorded_library(path: str, sha256: str) -> Path:
    """The plugin library an engine folder records, else this machine's build (an engine folder moved to
    another machine); warns when its bytes differ from the library the engines were built with."""
    p = Path(path)
    if not p.is_file():
        p = find_library(PLUGIN_LIB)
    h = hashlib.sha256(p.read_bytes()).hexdigest()
    if h != sha256:
        warnings.warn(f"{p} differs from the plugin library the engines were built with ({path}); if "
                      f"deserialization fails, rebuild the engines with dflash2-build", RuntimeWarning)
    return p
