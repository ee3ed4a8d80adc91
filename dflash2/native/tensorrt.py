"""TensorRT for the engine builder and the runtime: the module (or what to install), a logger that
keeps the last messages for error reports, and loading our plugin library into TensorRT's registry.

Importing this module never fails; `require_tensorrt()` raises `TensorRTMissingError` saying what
to install. No torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

from dflash2.errors import Dflash2Error
from dflash2.native.library import BUILD_HINT, PluginLibraryError
from dflash2.ops import contract as C

try:
    import tensorrt as _trt
    _IMPORT_ERROR: ImportError | None = None
except ImportError as e:  # the normal case on machines without TensorRT
    _trt, _IMPORT_ERROR = None, e

INSTALL_HINT = ("install TensorRT 10.x for your CUDA version: `pip install tensorrt-cu12` (CUDA 12) or "
                "`pip install tensorrt-cu13` (CUDA 13); on Jetson it comes with JetPack "
                "(`sudo apt install nvidia-jetpack`, Python module python3-libnvinfer)")


class TensorRTMissingError(Dflash2Error):
    pass


class EngineError(Dflash2Error):
    pass


def require_tensorrt():
    """The tensorrt module, or TensorRTMissingError with what to install."""
    if _trt is None:
        raise TensorRTMissingError(f"TensorRT is not installed (import tensorrt: {_IMPORT_ERROR}); {INSTALL_HINT}")
    return _trt


def make_logger(trt, echo: str = "ERROR"):
    """A trt.ILogger that keeps the last messages (for error reports) and prints those at `echo` or worse."""

    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.messages: list[str] = []
            self.echo = int(getattr(trt.ILogger.Severity, echo))

        def log(self, severity, msg):
            if int(severity) <= int(trt.ILogger.Severity.WARNING):
                self.messages = self.messages[-49:] + [f"[{severity.name}] {msg}"]
            if int(severity) <= self.echo:
                print(f"TensorRT [{severity.name}] {msg}", file=sys.stderr, flush=True)

        def tail(self, n: int = 8) -> str:
            return "\n  ".join(self.messages[-n:]) or "(TensorRT logged nothing)"

    return Logger()


_LOADED: dict[str, object] = {}


def load_plugin(trt, path: Path, logger=None) -> None:
    """Load libdflash2_plugins.so into TensorRT's plugin registry (once) and check it provides the
    DFlash2Selector creator this checkout's ONNX graphs name (op, version, namespace)."""
    path = Path(path).resolve()
    registry = trt.get_plugin_registry()
    if str(path) not in _LOADED:
        if not path.is_file():
            raise PluginLibraryError(f"{path}: plugin library not found; {BUILD_HINT}")
        handle = registry.load_library(str(path))
        if handle is None:
            tail = logger.tail() if logger is not None else ""
            raise PluginLibraryError(f"{path}: TensorRT could not load the plugin library {tail}; {BUILD_HINT}")
        _LOADED[str(path)] = handle
    if not hasattr(registry, "get_creator"):
        raise EngineError(f"TensorRT {trt.__version__}: IPluginRegistry.get_creator missing; TensorRT >= 10.0 "
                          f"is needed for IPluginV3 plugins")
    if registry.get_creator(C.OP_NAME, C.PLUGIN_VERSION, C.PLUGIN_NAMESPACE) is None:
        found = sorted({str(getattr(c, "plugin_version", "?")) for c in getattr(registry, "all_creators", [])
                        if getattr(c, "name", None) == C.OP_NAME})
        raise PluginLibraryError(
            f"{path}: plugin version mismatch: TensorRT's registry has no {C.OP_NAME} version "
            f"{C.PLUGIN_VERSION!r} namespace {C.PLUGIN_NAMESPACE!r} (found versions: {found or 'none'}); "
            f"rebuild the library from this checkout with `bash plugins/build.sh`")
