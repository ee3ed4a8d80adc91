"""The device check's CUDA-graph piece: one kernel launch captured on a cuda-bindings stream, replayed onto
zeroed outputs and compared with the twin, then replay vs plain-launch microseconds. On its own because
it is the one piece that drives the CUDA runtime directly; the runtime module and the kernel library are
arguments so that tests/test_device_check_graph.py runs it on host memory with the twin as kernel."""

from __future__ import annotations

import ctypes
import time

from dflash2.bench.device.kernel import REAL_K, REAL_R, REAL_V, _need_lib, compare, real_inputs
from dflash2.bench.device.runner import FAIL, PASS


def _checked(rt):
    """dflash2.native.cudart.call for this runtime module (cuda.bindings.runtime, or a test's fake)."""
    def call(result, what: str):
        err, rest = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
        if err != rt.cudaError_t.cudaSuccess:
            msg = rt.cudaGetErrorString(err)
            msg = msg[1] if isinstance(msg, tuple) else msg
            raise RuntimeError(f"{what} failed: {msg.decode() if isinstance(msg, bytes) else msg} ({err})")
        return rest[0] if len(rest) == 1 else (rest or None)
    return call


def piece_cuda_graph(ctx: dict, rt=None, lib=None, V: int = REAL_V) -> dict:
    """Capture one launch (dflash2_launch_select_path, device pointers) on a cuda-bindings stream into a
    graph, zero the outputs, replay: the outputs equal the twin's; then time replays vs plain launches.
    rt / lib: cuda.bindings.runtime and the kernel library (a test passes fakes)."""
    if lib is None:
        _need_lib(ctx)
    from dflash2.native import selector
    from dflash2.ops import contract as C
    if rt is None:
        from dflash2.native import cudart as cr
        rt = cr.cudart()
    call = _checked(rt)
    lib = lib or selector.load_plugin_library()
    if not hasattr(lib, "dflash2_launch_select_path"):
        raise RuntimeError("the kernel library has no dflash2_launch_select_path (an older build?)")
    lib.dflash2_launch_select_path.argtypes = [ctypes.POINTER(selector._Args), ctypes.c_void_p, ctypes.c_char_p,
                                               ctypes.c_size_t]
    lib.dflash2_launch_select_path.restype = ctypes.c_int32
    H2D, D2H = rt.cudaMemcpyKind.cudaMemcpyHostToDevice, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
    results, bad, ptrs = [], [], []
    stream = call(rt.cudaStreamCreateWithFlags(getattr(rt, "cudaStreamNonBlocking", 1)), "cudaStreamCreateWithFlags")
    err = ctypes.create_string_buffer(512)
    try:
        for block, mode in ((8, "greedy"), (16, "sample")):
            x = real_inputs(1, block - 1, V=V, cache=ctx.setdefault("real_cache", {}) if V == REAL_V else {})
            names = C.input_names()
            args, outs, keep = selector._prepare(tuple(x[n] for n in names), {"top_k": REAL_K, "rank": REAL_R,
                                                                              "mode": mode})
            dev = {}
            for n in names:
                a = keep[n]
                dev[n] = call(rt.cudaMalloc(max(a.nbytes, 1)), "cudaMalloc")
                ptrs.append(dev[n])
                call(rt.cudaMemcpy(dev[n], a.ctypes.data, a.nbytes, H2D), "cudaMemcpy H2D")
            for n, o in zip(C.output_names(), outs):
                dev[n] = call(rt.cudaMalloc(max(o.nbytes, 1)), "cudaMalloc")
                ptrs.append(dev[n])
            for n in names + C.output_names():
                setattr(args, n, dev[n])
            sp = ctypes.c_void_p(int(stream))  # the handle's value (getPtr() would be its address)

            def launch():
                if lib.dflash2_launch_select_path(ctypes.byref(args), sp, err, len(err)) != 0:
                    raise RuntimeError(err.value.decode())
            launch()  # warm (module load) outside the capture
            call(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
            call(rt.cudaStreamBeginCapture(stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
                 "cudaStreamBeginCapture")
            launch()
            graph = call(rt.cudaStreamEndCapture(stream), "cudaStreamEndCapture")
            gexec = call(rt.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
            for n, o in zip(C.output_names(), outs):
                call(rt.cudaMemsetAsync(dev[n], 0, o.nbytes, stream), "cudaMemsetAsync")
            call(rt.cudaGraphLaunch(gexec, stream), "cudaGraphLaunch")
            call(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
            for n, o in zip(C.output_names(), outs):
                call(rt.cudaMemcpy(o.ctypes.data, dev[n], o.nbytes, D2H), "cudaMemcpy D2H")
            twin = selector.select_path_cpu(**x, top_k=REAL_K, rank=REAL_R, mode=mode)
            bad += [f"block {block} {mode}: {d}" for d in compare(outs, twin, exact_scores=True)]
            iters = 200
            t = {}
            for how, fn in (("graph_replay_us", lambda: call(rt.cudaGraphLaunch(gexec, stream), "cudaGraphLaunch")),
                            ("plain_launch_us", launch)):
                fn()
                call(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                call(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")
                t[how] = round((time.perf_counter() - t0) / iters * 1e6, 2)
            results.append({"block": block, "batch": 1, "mode": mode, **t})
            call(rt.cudaGraphExecDestroy(gexec), "cudaGraphExecDestroy")
            call(rt.cudaGraphDestroy(graph), "cudaGraphDestroy")
    finally:
        for p in ptrs:
            rt.cudaFree(p)
        rt.cudaStreamDestroy(stream)
    summary = "; ".join(f"b{r['block']} {r['mode']}: replay {r['graph_replay_us']} us, launch "
                        f"{r['plain_launch_us']} us" for r in results)
    return {"result": FAIL if bad else PASS, "cases": len(results), "data": {"timings": results, "mismatches": bad},
            "detail": (f"{len(bad)} mismatching: {bad[0]}" if bad else "replayed graph == twin") + f"; {summary}"}


