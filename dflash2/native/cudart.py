"""cuda-python's runtime API for the engine builder and the runtime: the module (or what to
install), checked calls, and the current device's compute capability. No torch.

cuda-python ships the runtime API as `cuda.bindings.runtime` (cuda-python >= 12.6 / cuda-bindings)
or `cuda.cudart` (older releases); both return `(error, *results)` tuples.
"""

from __future__ import annotations

from dflash2.errors import Dflash2Error

_CUDART = None
INSTALL_HINT = ("install cuda-python for your CUDA major version, e.g. `pip install \"cuda-python>=12,<13\"` "
                "(CUDA 12) or `pip install \"cuda-python>=13,<14\"` (CUDA 13); on Jetson use the JetPack CUDA version")


class CudaMissingError(Dflash2Error):
    pass


class CudaError(Dflash2Error):
    pass


def cudart():
    """The cuda-python runtime module (cached); CudaMissingError names the package when missing."""
    global _CUDART
    if _CUDART is None:
        try:
            from cuda.bindings import runtime as rt
        except ImportError:
            try:
                from cuda import cudart as rt
            except ImportError as e:
                raise CudaMissingError(f"cuda-python is not installed (the TensorRT backend allocates device memory "
                                       f"and streams with it): {INSTALL_HINT}") from e
        _CUDART = rt
    return _CUDART


def call(result, what: str):
    """Unpack a cuda-python `(err, *values)` result; raise CudaError naming the call on failure."""
    rt = cudart()
    err, rest = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    if err != rt.cudaError_t.cudaSuccess:
        msg = rt.cudaGetErrorString(err)
        msg = msg[1] if isinstance(msg, tuple) else msg
        raise CudaError(f"{what} failed: {msg.decode() if isinstance(msg, bytes) else msg} ({err})")
    return rest[0] if len(rest) == 1 else (rest or None)


def compute_capability() -> tuple[tuple[int, int], str]:
    """((major, minor), device name) of the current device."""
    rt = cudart()
    dev = call(rt.cudaGetDevice(), "cudaGetDevice")
    prop = call(rt.cudaGetDeviceProperties(dev), "cudaGetDeviceProperties")
    name = prop.name.decode(errors="replace").rstrip("\0") if isinstance(prop.name, bytes) else str(prop.name)
    return (int(prop.major), int(prop.minor)), name
