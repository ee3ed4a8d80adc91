"""The multi-row slowdown with one global thread pool shared by two sessions (2026-12-07 results entry):
    python docs/results/step_loops/global_pool_check.py EXPORT"""
import sys, importlib.util, onnxruntime as ort
from pathlib import Path
from onnxruntime.capi import _pybind_state as C
C.set_global_thread_pool_sizes(2, 1)
spec = importlib.util.spec_from_file_location("sl", str(Path(__file__).resolve().parents[3] / "scripts" / "experiments" / "step_loops.py")); sl = importlib.util.module_from_spec(spec); spec.loader.exec_module(sl)
def bare(path, threads):
    o = ort.SessionOptions(); o.use_per_session_threads = False; o.log_severity_level = 3
    return ort.InferenceSession(str(path), o, providers=["CPUExecutionProvider"])
sl._bare_session = bare
from pathlib import Path
exp = Path(sys.argv[1])
loops = {"bare": sl.dflash2_graph(exp, 2, None), "pre same": sl.dflash2_graph(exp, 2, "same"), "pre other": sl.dflash2_graph(exp, 2, "other")}
ms = {k: [] for k in loops}
for f in loops.values(): f(10)
R = 24
for i in range(R):
    for k in (list(loops) if i % 2 == 0 else list(loops)[::-1]): ms[k].append(1e3 * loops[k](40))
for k, v in ms.items():
    r = sorted(x / y for x, y in zip(v, ms["bare"]))
    print(f"{k:<10} {sorted(v)[R//2]:.3f} ms  ratio {r[R//2]:.3f} ({r[R//4]:.3f}-{r[3*R//4]:.3f})")
