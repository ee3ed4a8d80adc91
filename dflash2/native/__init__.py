"""Native code from Python, below every stage that needs it (no torch):

    library    find and load our native libraries (libdflash2_selector_cpu.so, libdflash2_plugins.so
               built by `bash plugins/build.sh` from the repository's C++ `plugins/` folder), ABI checks
    selector   ctypes bindings of the DFlash2Selector op: the CPU twin and the CUDA kernel
    bench      the CPU twin vs the PyTorch reference, microseconds per call
    gpu_check  the CUDA kernel vs the CPU twin, plus kernel timings (needs a GPU)
    tensorrt   the tensorrt module or what to install, a logger, loading the plugin into TensorRT
    cudart     cuda-python's runtime module or what to install, checked calls, the device's capability

`dflash2.engines` (builds) and `dflash2.runtime` (runs) both import from here, never from each other.
The command line is `dflash2-plugins` (dflash2/cli/plugins.py).
"""
