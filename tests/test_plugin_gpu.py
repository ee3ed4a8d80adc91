"""The CUDA kernel and the TensorRT plugin on a real GPU.

- kernel vs CPU twin and vs contract.walk_row (through `dflash2_select_path_cuda`, host pointers; no
  torch-CUDA needed), both modes, the sample-mode known answers of test_plugin_cpu.py: skipped with
  the CUDA runtime's reason where no device is visible;
- kernel timing at production sizes;
- the plugin inside a TensorRT engine built from `selector_model(..., flavour="tensorrt")`, run
  with Polygraphy's TrtRunner against the PyTorch reference: skipped where `import tensorrt` fails.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from dflash2.native import bench, library, selector
from dflash2.ops import contract as C
from tests.test_plugin_cpu import (CASES, assert_matches, case_inputs, check_sample_cases, check_ulp_boundaries,
                                   contract_check, reference, require, run_rows, special_inputs)


@pytest.fixture(scope="module")
def cuda():
    require(selector.load_plugin_library)
    n, why = selector.cuda_device_count()
    if n == 0:
        pytest.skip(f"no CUDA device: {why}")


def kernel(*args, **kwargs):
    """select_path_cuda without the timing: the five outputs, as select_path_cpu returns them."""
    return selector.select_path_cuda(*args, **kwargs)[:len(C.OUTPUTS)]


@pytest.mark.parametrize("mode", C.MODES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_cpu_twin(cuda, case, mode):
    x, attrs = case_inputs(case)
    cpu = selector.select_path_cpu(**x, **attrs, mode=mode)
    gpu = kernel(**x, **attrs, mode=mode)
    # Same per-element code and summation order, no FMA contraction: scores bit-identical unless softcap's
    # tanhf differs; indices exact; confidence and q to a few ulp (device exp).
    assert_matches(gpu, cpu, exact_scores=attrs["logit_softcap"] == 0.0)
    contract_check(x, {**attrs, "mode": mode}, gpu)


@pytest.mark.parametrize("mode", C.MODES)
@pytest.mark.parametrize("case", CASES[:4], ids=[c[0] for c in CASES[:4]])
def test_kernel_matches_reference(cuda, case, mode):
    x, attrs = case_inputs(case)
    assert_matches(kernel(**x, **attrs, mode=mode), reference(x, **attrs, mode=mode))


@pytest.mark.parametrize("T", [0.0, -1.0, np.nan])
def test_kernel_sample_at_t_le_0_is_greedy_bit_for_bit(cuda, T):
    x, attrs = case_inputs(CASES[2], temperature=T)
    for name, g, s in zip(C.output_names(), kernel(**x, **attrs, mode="greedy"), kernel(**x, **attrs, mode="sample")):
        np.testing.assert_array_equal(s, g, err_msg=name)


def test_kernel_greedy_reads_no_uniforms_or_temperature(cuda):
    """Greedy mode through the C ABI with NULL uniforms / temperature: nothing reads them."""
    x, attrs = case_inputs(CASES[0])
    want = kernel(**x, **attrs)
    args, outs, _keep = selector._prepare(tuple(x[n] for n in C.input_names()), attrs)
    args.uniforms = args.temperature = None
    err = ctypes.create_string_buffer(512)
    rc = selector.load_plugin_library().dflash2_select_path_cuda(ctypes.byref(args), 0, None, err, len(err))
    assert rc == 0, err.value.decode()
    for name, a, b in zip(C.output_names(), outs, want):
        np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("mode", C.MODES)
def test_kernel_special_values(cuda, mode):
    x, attrs, want = special_inputs()
    gpu = kernel(**x, **attrs, mode=mode)
    np.testing.assert_array_equal(gpu[0], want["draft_ids"])
    np.testing.assert_array_equal(gpu[1], want["path_index"])
    np.testing.assert_array_equal(gpu[2], want["path_scores"])
    np.testing.assert_allclose(gpu[3], want["confidence"], rtol=1e-6)
    np.testing.assert_array_equal(gpu[4], want["draft_probs"])


def test_kernel_sample_known_answers(cuda):
    check_sample_cases(fn=kernel)


@pytest.mark.parametrize("T", [0.5, 1.0, 2.0])
def test_kernel_sample_one_ulp_around_cdf_boundaries(cuda, T):
    check_ulp_boundaries(T, fn=kernel)


def test_kernel_sample_many_uniforms_equal_cpu_twin(cuda):
    """20,000 uniforms on K = 64 rows: the kernel's indices and q equal the twin's."""
    rng = np.random.default_rng(11)
    N, K = 20000, 64
    rows = (rng.standard_normal((N, K)) * 3).astype(np.float32).tolist()
    T, u = rng.choice([0.25, 0.7, 1.0, 1.5], N), rng.random(N, dtype=np.float32)
    gi, gq, gc, _ = run_rows(rows, T, u, fn=kernel)
    ci, cq, cc, _ = run_rows(rows, T, u)
    np.testing.assert_array_equal(gi, ci)
    np.testing.assert_allclose(gq, cq, rtol=1e-6, atol=0)
    np.testing.assert_allclose(gc, cc, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", C.MODES)
@pytest.mark.parametrize("batch", [1, 8])
def test_kernel_timing_production(cuda, batch, mode):
    S, K, R, V = 7, 16, 256, 151936
    x = bench.random_inputs(batch, S, K, R, V, codebook_dtype="bfloat16")
    *out, us = selector.select_path_cuda(**x, top_k=K, rank=R, mode=mode, timing_iters=200)
    print(f"\nDFlash2Selector kernel: {mode} B={batch} S={S} K={K} R={R} V={V} bf16: {us:.1f} us per launch")
    assert_matches(out, selector.select_path_cpu(**x, top_k=K, rank=R, mode=mode), exact_scores=True)
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


@pytest.mark.parametrize("mode", C.MODES)
@pytest.mark.parametrize("dtypes", [("float32", "float32"), ("float16", "float16"), ("float32", "float16")])
def test_tensorrt_engine_matches_reference(trt, dtypes, mode):
    from polygraphy.backend.trt import CreateConfig, EngineFromNetwork, NetworkFromOnnxBytes, TrtRunner

    from dflash2.export.selector_onnx import selector_model

    tl, tc = dtypes
    B, S, K, R, V = 2, 7, 16, 256, 3000
    attrs = {"top_k": K, "rank": R, "output_multiplier": 1.25, "logit_softcap": 0.0, "mode": mode}
    model = selector_model(S, K, R, V, flavour="tensorrt", attrs=attrs, logits_dtype=tl, codebook_dtype=tc,
                           batch=B)
    engine = EngineFromNetwork(NetworkFromOnnxBytes(model.SerializeToString()), config=CreateConfig())
    x, _ = case_inputs(("trt", B, S, K, R, V, tl, tc, 1.25, 0.0))
    with TrtRunner(engine) as runner:
        out = runner.infer(feed_dict=x)
    got = [np.asarray(out[n]) for n in C.output_names()]
    contract_check(x, attrs, got)
    assert_matches(got, selector.select_path_cpu(**x, **attrs), exact_scores=True)
    assert_matches(got, reference(x, **attrs))
