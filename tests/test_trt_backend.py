"""The TensorRT build + runtime code driven through a fake TensorRT/CUDA (tests/fake_trt.py), and
the real TensorRT path, which skips with the reason when TensorRT or a GPU is absent."""

from __future__ import annotations

import ctypes
import json
import sys

import numpy as np
import pytest

from dflash2 import manifest as mf
from dflash2.native import library, selector
from dflash2.cli import build as build_cli
from dflash2.engines import build as eb
from dflash2.engines import plan as ep
from dflash2.native import cudart as ncudart
from dflash2.runtime import cuda as rcuda
from dflash2.runtime import trt as rtrt
from dflash2.runtime.api import Runtime
from dflash2.runtime.session import CapacityError

from tests.exports import PROMPT


# ------------------------------------------------------------------------------------------- fake TensorRT

def test_fake_build_writes_engines_profiles_cache(fake_engines, fake, fake_plugin, tmp_path):
    m = mf.load(fake_engines, mf.EngineManifest)  # files checked too
    assert m.tensorrt_version == fake.__version__ and m.build.workspace_mb == 256
    assert fake.REGISTRY.libraries == [str(fake_plugin.resolve())]  # loaded before parsing
    target = json.loads((fake_engines / "target.engine").read_bytes())
    assert target["onnx"].endswith("target.trt.onnx")  # the fixed-shape flavour
    assert target["profiles"][1]["input_ids"] == [[1], [8], [8]]  # decode profile reached the builder
    lo, opt, hi = target["profiles"][1]["kv_cache"]
    assert lo == opt == hi and lo[0] == 48  # the whole KV buffer: max_seq_len rows in every profile
    assert json.loads((fake_engines / "drafter.engine").read_bytes())["onnx"].endswith("drafter.trt.onnx")
    assert (tmp_path / "cache" / "timing.cache").read_bytes() == b"fake timing cache"


def test_fake_build_parse_error_names_node(export_dir, tmp_path, fake_plugin, fake):
    fake.OnnxParser.fail_with = "Unsupported operator DFlash2Selector: no plugin creator"
    plan = ep.plan_build(export_dir, tmp_path / "eng", plugin=fake_plugin)
    with pytest.raises(eb.OnnxParseError) as e:
        eb.build(plan, quiet=True)
    msg = str(e.value)
    assert "target.trt.onnx: TensorRT's ONNX parser reported 1 error(s)" in msg
    assert "node /layers.0/attn/MatMul (MatMul): Unsupported operator DFlash2Selector" in msg
    assert not (tmp_path / "eng").exists()  # nothing half-written


@pytest.mark.parametrize("speculative", [True, False])
def test_fake_tensorrt_runtime_matches_onnxruntime(fake_engines, export_dir, fake, speculative):
    want = Runtime(export_dir).generate(PROMPT, 24, speculative=speculative).ids
    rt = Runtime(fake_engines)
    assert rt.backend_name == "tensorrt"
    assert rt.session.kv.whole().device == "cuda"
    before = rt.session.buffers()
    assert rt.generate(PROMPT, 24, speculative=speculative).ids == want
    assert rt.session.buffers() == before  # allocated once
    target = rt.session.backend.engine("target")
    used = {i for i, ctx in target.contexts.items() if ctx.calls["set_input_shape"]}
    assert used == ({0, 1})  # prefill (11 rows) on profile 0, decode / verify on profile 1


@pytest.mark.parametrize("draft_len", [7, 3])
def test_fake_tensorrt_samples_what_onnxruntime_samples(fake_engines, export_dir, fake, draft_len):
    """Same seed, same ids on the TensorRT path (fixed-shape graphs, device buffers, the logits pulled
    only when sampling reads them) as on ONNX Runtime, speculative and target-only. A fixed draft
    length: `auto` picks K from measured timings, so its draws differ run to run (docs/sampling.md)."""
    from dflash2.sampling import Sampling

    ort_rt, trt_rt = Runtime(export_dir), Runtime(fake_engines)
    for seed in range(3):
        s = Sampling(0.8, top_k=20 if seed else 0, top_p=0.95 if seed == 2 else 1.0, seed=seed)
        for spec in (True, False):
            want = ort_rt.generate(PROMPT, 20, speculative=spec, sampling=s, draft_len=draft_len).ids
            assert trt_rt.generate(PROMPT, 20, speculative=spec, sampling=s, draft_len=draft_len).ids == want
    d = trt_rt.session.draft(PROMPT[-1], uniforms=[0.5] * 7, temperature=0.8)
    assert d.q is not None and d.q[1].shape == (7, 8)  # q of the walk


def test_fake_tensorrt_binding_checks_and_spare_output(fake_engines, fake):
    s = Runtime(fake_engines).session
    s.ids.host[:3] = [5, 6, 7]
    s.ids.push(3)
    s.target_kv.length.host[0] = 0
    s.target_kv.length.push(1)
    eng = s.backend.engine("target")
    feeds = {"input_ids": s.ids.rows(0, 3), "kv_cache": s.kv.whole(), "past_len": s.target_kv.length.whole()}
    eng.run(feeds, {"next_ids": s.next_ids.rows(0, 3), "context": s.context.rows(0, 3), "new_kv": s.target_kv.staging.rows(0, 3)})
    want = s.next_ids.pull(3).tolist()
    s.next_ids.host[:] = 0
    s.next_ids.push(3)
    eng.run(feeds, {"next_ids": s.next_ids.rows(0, 3), "new_kv": s.target_kv.staging.rows(0, 3)})  # context unbound
    assert s.next_ids.pull(3).tolist() == want
    assert set(eng.spare) == {"context", "logits"} and eng.spare["context"].nbytes == 16 * 64 * 4  # max n 16 x width
    assert eng.spare["logits"].nbytes == s.block_size * s.vocab_size * 4  # [min(n, B), V] at most B rows
    with pytest.raises(rtrt.EngineError, match=r"output next_ids expected shape \[3\].*bound \[2\]"):
        eng.run(feeds, {"next_ids": s.next_ids.rows(0, 2), "new_kv": s.target_kv.staging.rows(0, 3)})
    with pytest.raises(rtrt.EngineError, match=r"missing \['kv_cache', 'past_len'\]"):
        eng.run({"input_ids": s.ids.rows(0, 3)}, {})


def test_fake_tensorrt_prompt_beyond_max_prefill(fake_engines, fake):
    rt = Runtime(fake_engines)
    with pytest.raises(CapacityError, match="a step of 20 rows exceeds the 16 rows .*--max-prefill"):
        rt.generate(list(range(3, 23)), 4)  # 20 tokens > max_prefill 16
    s = rt.session  # the engine's own check, where a caller binds past the staging buffer's rows
    with pytest.raises(rtrt.EngineError, match="fit no optimization profile.*--max-prefill"):
        s.target.run({"input_ids": s.ids.rows(0, 20), "kv_cache": s.kv.whole(), "past_len": s.target_kv.length.whole()}, {})


def test_fake_tensorrt_cuda_graphs(fake_engines, export_dir, fake):
    want = Runtime(export_dir).generate(PROMPT, 12).ids
    rt = Runtime(fake_engines)
    rt.session.backend = backend = rtrt.TrtBackend(fake_engines, rt.manifest, cuda_graphs=True)
    from dflash2.runtime.session import SpecSession

    rt.session = SpecSession(rt.manifest, backend)
    runs = [rt.generate(PROMPT, 12, draft_len=7).ids for _ in range(3)]  # fixed K: the same shapes every run
    assert runs == [want] * 3
    # run 1 warms every key up, run 2 captures them, run 3 only launches graphs
    assert backend.graphs.captures > 0 and backend.graphs.launches >= 2 * backend.graphs.captures


def test_fake_tensorrt_corrupt_engine(fake_engines, fake):
    (fake_engines / "drafter.engine").write_bytes(b"\x00garbage")
    with pytest.raises(rtrt.EngineError, match="could not deserialize.*rebuild with dflash2-build"):
        rtrt.TrtBackend(fake_engines, mf.load(fake_engines, check_files=False))


def test_graph_cache_policy(fake):
    ran = []
    cache = rcuda.GraphCache(rcuda.Stream(), limit=1)
    enqueue = lambda: fake.CUDART.capture.append(lambda: ran.append("graph")) if fake.CUDART.capture is not None \
        else ran.append("direct")  # noqa: E731
    cache.launch("a", enqueue)  # warm-up: direct
    cache.launch("a", enqueue)  # captured, then launched
    cache.launch("a", enqueue)  # launched
    cache.launch("b", enqueue)
    cache.launch("b", enqueue)  # captures b, evicts a (limit 1)
    assert ran == ["direct", "graph", "graph", "direct", "graph"]
    assert list(cache.graphs) == ["b"] and cache.captures == 2


def test_device_buffer_push_pull_rows(fake):
    stream = rcuda.Stream()
    buf = rcuda.DeviceBuffer((6, 3), np.int32, stream, pinned=True)
    buf.host[:2] = [[1, 2, 3], [4, 5, 6]]
    buf.push(2)
    buf.host[:] = 0
    assert buf.pull(2).tolist() == [[1, 2, 3], [4, 5, 6]]
    v = buf.rows(2, 5)
    assert (v.ptr - buf.ptr, v.shape, v.device) == (2 * 12, (3, 3), "cuda")
    with pytest.raises(IndexError):
        buf.rows(4, 7)
    dev = rcuda.DeviceBuffer((4,), np.float32, stream)
    assert dev._host is None and dev.pull(4).tolist() == [0.0] * 4  # zeroed; mirror made on demand


def test_cuda_python_missing_names_package(monkeypatch):
    monkeypatch.setattr(ncudart, "_CUDART", None)
    monkeypatch.setitem(sys.modules, "cuda", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(ncudart.CudaMissingError, match="pip install"):
        ncudart.cudart()


# ------------------------------------------------------------------------------------------- real TensorRT

def test_real_tensorrt_build_compare_run(export_dir, tmp_path):
    """On a machine with TensorRT + a GPU + the built plugin: build, compare, lossless run."""
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (pip install tensorrt-cu12); "
                                           "scripts/gpu_check.sh runs this path on a GPU machine")
    try:
        n, why = selector.cuda_device_count()
    except library.PluginLibraryError as e:
        pytest.skip(f"plugin library not built: {e}")
    if n == 0:
        pytest.skip(f"no CUDA device: {why}")
    from dflash2.engines.compare import compare

    out = tmp_path / "engines"
    assert build_cli.main([str(export_dir), "--out", str(out), "--max-prefill", "32", "--quiet"]) == 0
    report = compare(export_dir, out)
    assert report.passed, report.table()
    assert any("tensorrt" in r.pair for r in report.rows)
    want = Runtime(export_dir).generate(PROMPT, 24).ids
    assert Runtime(out).generate(PROMPT, 24).ids == want


def test_one_buffer_protocol_on_both_backends(fake_engines, export_dir, fake):
    """Host and CUDA buffers are the same protocol: the session's buffers answer rows/whole/push/pull alike."""
    from dflash2.runtime.memory import Buffer, HostBuffer

    for folder, kind in ((export_dir, HostBuffer), (fake_engines, rcuda.DeviceBuffer)):
        s = Runtime(folder).session
        for buf in (s.kv, s.context, s.ids, s.draft_ids):
            assert isinstance(buf, Buffer) and isinstance(buf, kind)
        s.ids.host[:2] = [3, 4]
        s.ids.push(2)  # the engine-side memory at ptr now holds the rows (the fake's device memory is host)
        assert ctypes.string_at(s.ids.ptr, 8) == np.array([3, 4], np.int32).tobytes()
        assert s.ids.pull(2).tolist() == [3, 4] and s.ids.rows(1, 2).ptr == s.ids.ptr + 4


@pytest.fixture(scope="module")
def long_export(tmp_path_factory):
    """A tiny export with room for a 300-token generation."""
    from dflash2 import tiny
    from dflash2.export.api import export

    root = tmp_path_factory.mktemp("long")
    drafter, target = tiny.make_pair(root / "pair", family="qwen3", version=2)
    export(drafter, target, root / "export", max_seq_len=336, quiet=True)
    return root / "export"


class _Rows:
    """Records the row count of every step an engine runs."""

    def __init__(self, engine, seen: list):
        self.engine, self.seen, self.inputs = engine, seen, engine.inputs

    def run(self, inputs, outputs):
        self.seen.append((self.engine.name, next(iter(inputs.values())).shape[0]))
        self.engine.run(inputs, outputs)


def test_fake_tensorrt_cuda_graphs_replay_in_a_300_token_generation(long_export, tmp_path, fake_plugin, fake):
    """Fixed step shapes: at most one graph per (engine, row count) is captured, every later step of that
    row count replays it; the tokens equal ONNX Runtime's."""
    from dflash2.runtime.session import SpecSession

    out = tmp_path / "engines"
    eb.build(ep.plan_build(long_export, out, max_prefill=16, plugin=fake_plugin), quiet=True)
    want = Runtime(long_export).generate(PROMPT, 300)
    rt = Runtime(out)
    backend = rtrt.TrtBackend(out, rt.manifest, cuda_graphs=True)
    rt.session = s = SpecSession(rt.manifest, backend)
    steps: list = []
    s.target, s.drafter = _Rows(s.target, steps), _Rows(s.drafter, steps)
    got = rt.generate(PROMPT, 300, draft_len=7)  # fixed K: skipped drafts would move the context rows
    assert got.ids == want.ids and len(got.ids) == len(want.ids) > 200
    g, keys = backend.graphs, set(steps)
    assert g.direct + g.captures + g.replays == len(steps)
    assert g.captures <= len(keys) + 2  # distinct row counts (per engine) + 2
    assert g.direct == len(keys) and g.replays >= len(steps) - 2 * len(keys)  # all but 2 steps per key replay
    assert g.replays > 0.9 * len(steps)


def test_no_stream_sync_after_host_to_device_copies(fake_engines, fake):
    """One stream: a round waits for the GPU only where the host reads results: once for the drafts
    (ids and confidence together) when the drafter runs, once for the target's ids."""
    rt = Runtime(fake_engines)
    assert rt.session.conf is not None  # the export has the confidence output: its pull must not add a wait
    rt.generate(PROMPT, 4)
    for draft_len in (7, "auto"):  # auto skips the drafter in some rounds: those wait once
        before = fake.CUDART.syncs
        stats = rt.generate(PROMPT, 24, draft_len=draft_len).stats
        drafted = stats.rounds - sum(stats.skipped)
        assert drafted > 0 and fake.CUDART.syncs - before == drafted + stats.rounds + 1  # + the prefill's pull
