"""The CUDA kernel and the TensorRT plugin on a real GPU.

- kernel vs CPU twin (through `dflash2_select_path_cuda`, host pointers; no torch-CUDA needed):
  skipped with the CUDA runtime's reason where no device is visible;
- kernel timing at production sizes;
- the plugin inside a TensorRT engine built from `selector_model(..., flavour="tensorrt")`, run
  with Polygraphy's TrtRunner against the PyTorch reference: skipped where `import tensorrt` fails.
"""

from __future__ import annotations

import numpy as np
import pytest

from dflash2.native import bench, library, selector
from tests.test_plugin_cpu import CASES, assert_matches, case_inputs, reference, require, special_inputs


@pytest.fixture(scope="module")
def cuda():
    require(selector.load_plugin_library)
    n, why = selector.cuda_device_count()
    if n == 0:
        pytest.skip(f"no CUDA device: {why}")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_cpu_twin(cuda, case):
    x, attrs = case_inputs(case)
    cpu = selector.select_path_cpu(**x, **attrs)
    gpu = selector.select_path_cuda(**x, **attrs)[:4]
    # Same per-element code and summation order, no FMA contraction: scores bit-identical unless softcap's
    # tanhf differs; confidence to a few ulp (device expf).
    assert_matches(gpu, cpu, exact_scores=attrs["logit_softcap"] == 0.0)
    assert_matches(gpu, reference(x, **attrs))


def test_kernel_special_values(cuda):
    x, attrs, want = special_inputs()
    gpu = selector.select_path_cuda(**x, **attrs)
    np.testing.assert_array_equal(gpu[0], want["draft_ids"])
    np.testing.assert_array_equal(gpu[1], want["path_index"])
    np.testing.assert_array_equal(gpu[2], want["path_scores"])
    np.testing.assert_allclose(gpu[3], want["confidence"], rtol=1e-6)


@pytest.mark.parametrize("batch", [1, 8])
def test_kernel_timing_production(cuda, batch):
    S, K, R, V = 7, 16, 256, 151936
    x = bench.random_inputs(batch, S, K, R, V, codebook_dtype="bfloat16")
    *out, us = selector.select_path_cuda(**x, top_k=K, rank=R, timing_iters=200)
    print(f"\nDFlash2Selector kernel: B={batch} S={S} K={K} R={R} V={V} bf16: {us:.1f} us per launch")
    assert_matches(out, selector.select_path_cpu(**x, top_k=K, rank=R), exact_scores=True)
    assert 0 < us < 1000, f"kernel took {us:.1f} us per launch at production sizes (expected tens of us)"


@pytest.fixture(scope="module")
def trt():
    try:
        import tensorrt
    except ImportError as e:
        pytest.skip(f"TensorRT is not installed (import tensorrt failed: {e})")
    require(selector.load_plugin_library)
    if selector.cuda_device_count()[0] == 0:
        pytest.skip(f"no CUDA device: {selector.cuda_device_count()[1]}")
    tensorrt.get_plugin_registry().load_library(str(library.find_library(library.PLUGIN_LIB)))
    return tensorrt


@pytest.mark.parametrize("dtypes", [("float32", "float32"), ("float16", "float16"), ("float32", "float16")])
def test_tensorrt_engine_matches_reference(trt, dtypes):
    from polygraphy.backend.trt import CreateConfig, EngineFromNetwork, NetworkFromOnnxBytes, TrtRunner

    from dflash2.export.selector_onnx import selector_model

    tl, tc = dtypes
    B, S, K, R, V = 2, 7, 16, 256, 3000
    attrs = {"top_k": K, "rank": R, "output_multiplier": 1.25, "logit_softcap": 0.0}
    model = selector_model(S, K, R, V, flavour="tensorrt", attrs=attrs, logits_dtype=tl, codebook_dtype=tc,
                           batch=B)
    engine = EngineFromNetwork(NetworkFromOnnxBytes(model.SerializeToString()), config=CreateConfig())
    x, _ = case_inputs(("trt", B, S, K, R, V, tl, tc, 1.25, 0.0))
    with TrtRunner(engine) as runner:
        out = runner.infer(feed_dict=x)
    got = [np.asarray(out[n]) for n in ("draft_ids", "path_index", "path_scores", "confidence")]
    assert_matches(got, reference(x, **attrs))
    assert_matches(got, selector.select_path_cpu(**x, **attrs), exact_scores=True)
