"""The Qwen3.5 hybrid reference (dflash2/reference/qwen3_5.py, gated_deltanet.py) against transformers' own
Qwen3_5ForCausalLM / Qwen3_5ForConditionalGeneration on tiny random models: prefill logits, taps, greedy decoding
through the reference's state, rollback by commit after a k-row verify, the chunked prefill, M-RoPE, the config
reader's errors, and ONNX Runtime's com.microsoft LinearAttention / CausalConvWithState ops."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402

from dflash2.errors import CheckpointError, TensorSetError  # noqa: E402
from dflash2.reference.gated_deltanet import conv_rows, gated_delta_rows, l2norm  # noqa: E402
from dflash2.reference.qwen3_5 import (Qwen35Target, State, commit, load_hf_state_dict, mrope_cos_sin,  # noqa: E402
                                       read_qwen3_5_config)

TOL = 1e-4  # prefill logits and taps vs transformers (fp32; transformers runs the chunked rule, we the loop)
ROW_TOL = 1e-4  # fp32 k-row verify vs k one-row steps of the same reference (only matmul blocking differs)

# name: (tied, layers, interval, k_heads, v_heads, k_dim, v_dim, kernel, heads, kv_heads, head_dim, partial, bias)
SHAPES = {
    "untied-gqa-k4-i2": (False, 4, 2, 2, 4, 16, 16, 4, 4, 2, 32, 0.25, False),
    "tied-k2-i4": (True, 4, 4, 2, 2, 16, 8, 2, 2, 1, 16, 0.5, False),
    "untied-k4-i4-5layers": (False, 5, 4, 1, 3, 8, 16, 4, 2, 2, 32, 1.0, True),
}


def _hf_config(name: str) -> Qwen3_5TextConfig:
    tied, L, every, hk, hv, dk, dv, K, nh, kv, hd, partial, bias = SHAPES[name]
    rd2 = int(hd * partial) // 2
    section = [rd2 - 2 * (rd2 // 3), rd2 // 3, rd2 // 3]  # sums to rotary_dim / 2
    return Qwen3_5TextConfig(
        vocab_size=211, hidden_size=48, intermediate_size=96, num_hidden_layers=L, full_attention_interval=every,
        num_attention_heads=nh, num_key_value_heads=kv, head_dim=hd, attention_bias=bias,
        linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk, linear_value_head_dim=dv,
        linear_conv_kernel_dim=K, tie_word_embeddings=tied, initializer_range=0.1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial,
                         "mrope_section": section, "mrope_interleaved": True})


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Move the parameters transformers initialises to constants (norm weights 0 or 1, dt_bias 1, biases 0) off
    them, so (1 + w) norms, the plain-weight gated norm, the decay and the biases are all exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name or "A_log" in name or name.endswith(".bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))


_CACHE: dict = {}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices: one thread is fastest, and on a shared machine several threads spin-wait for seconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _pair(name: str):
    """(transformers model, reference with every layer tapped), built once per shape."""
    if name not in _CACHE:
        torch.manual_seed(1234)
        cfg = _hf_config(name)
        hf = Qwen3_5ForCausalLM(cfg).eval()
        _randomize(hf, 7)
        raw = {**cfg.to_dict(), "architectures": ["Qwen3_5ForCausalLM"]}
        c = read_qwen3_5_config(raw, f"<{name}>/config.json")
        ref = Qwen35Target(c, tap_ids=tuple(range(c.num_layers))).eval()
        load_hf_state_dict(ref, hf.state_dict(), name)
        _CACHE[name] = (hf, ref)
    return _CACHE[name]


def _prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 211, (n,), generator=torch.Generator().manual_seed(seed))


def _step(ref, ids, state, **kw):
    with torch.no_grad():
        return ref(ids, state, **kw)


def _run_rows(ref, ids, state):
    """Feed ids one row at a time; -> (logits [n, V], the state after each row)."""
    logits, states = [], []
    for t in ids:
        lg, _, step = _step(ref, t[None], state)
        state = commit(state, step, 1)
        logits.append(lg[0])
        states.append(state)
    return torch.stack(logits), states


def _rel(x: torch.Tensor, y: torch.Tensor) -> float:
    """max |x - y| / max(1, max |y|)."""
    assert x.shape == y.shape and x.dtype == y.dtype
    return (x - y).abs().max().item() / max(1.0, y.abs().max().item()) if x.numel() else 0.0


def _state_diff(a: State, b: State) -> float:
    return max(_rel(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------------------- transformers

@pytest.mark.parametrize("name", list(SHAPES))
def test_prefill_logits_and_taps_match_transformers(name):
    hf, ref = _pair(name)
    ids = _prompt(24)
    outs = {}
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: outs.__setitem__(i, o[0] if isinstance(o, tuple) else o))
             for i, layer in enumerate(hf.model.layers)]
    try:
        with torch.no_grad():
            out = hf(ids[None], output_hidden_states=True)
    finally:
        for h in hooks:
            h.remove()
    logits, taps, step = _step(ref, ids, ref.empty_state())
    # relative, as the taps below: transformers' chunked fp32 rule is itself ~9e-5 from its float64 run on the
    # 5-layer shape (ours 3e-5 from it), so an absolute 1e-4 on logits of ~3 passed or failed by the host's kernels
    d = _rel(logits, out.logits[0])
    assert d < TOL, f"prefill logits differ by {d:.2e} of their scale"
    H, L = ref.config.hidden_size, ref.config.num_layers
    for i in range(L):
        tap = taps[:, i * H:(i + 1) * H]
        d = (outs[i][0] - tap).abs().max().item()
        assert d < TOL * max(1.0, outs[i].abs().max().item()), f"tap {i} differs by {d:.2e}"
        if i < L - 1:  # transformers' last hidden_states entry is the post-norm state
            assert torch.equal(out.hidden_states[i + 1][0], outs[i][0])
    assert step.kv.shape == (24, len(ref.config.full_layers), 2, ref.config.num_kv_heads, ref.config.head_dim)
    assert step.rec.shape[:2] == (24, len(ref.config.linear_layers)) and step.rec.dtype == torch.float32


@pytest.mark.parametrize("name", list(SHAPES))
def test_greedy_64_tokens_equal_generate(name):
    hf, ref = _pair(name)
    ids = _prompt(12, seed=3)
    with torch.no_grad():
        want = hf.generate(ids[None], do_sample=False, max_new_tokens=64, min_new_tokens=64,
                           pad_token_id=0)[0, 12:]
    logits, _, step = _step(ref, ids, ref.empty_state())
    state = commit(ref.empty_state(), step, 12)
    got = [int(logits[-1].argmax())]
    while len(got) < 64:
        lg, _, step = _step(ref, torch.tensor(got[-1:]), state)
        state = commit(state, step, 1)
        got.append(int(lg[0].argmax()))
    assert got == want.tolist()


# ---------------------------------------------------------------------------------------------------- rollback

def _rollback_worst(ref, ks=range(1, 9)) -> float:
    """From the state after a prompt: a k-row verify of arbitrary tokens (k = 1..8), commit a in 0..k, continue
    with two more rows; compared with decoding the first a tokens one row at a time. -> the largest difference over
    the verify's row logits, the committed state (K/V rows, conv state, recurrent state) and the continuation's
    logits (relative to max(1, magnitude)); argmax must agree everywhere."""
    dtype = ref.embed_tokens.weight.dtype
    prompt = _prompt(9, seed=5)
    _, _, step = _step(ref, prompt, ref.empty_state(dtype))
    base = commit(ref.empty_state(dtype), step, 9)
    tail = _prompt(2, seed=99)
    worst = 0.0
    for k in ks:
        drafts = _prompt(k, seed=100 + k)
        seq_logits, seq_states = _run_rows(ref, drafts, base)
        v_logits, _, v_step = _step(ref, drafts, base)
        worst = max(worst, _rel(v_logits, seq_logits))
        assert torch.equal(v_logits.argmax(-1), seq_logits.argmax(-1))
        for a in range(k + 1):
            got = commit(base, v_step, a)
            want = base if a == 0 else seq_states[a - 1]
            worst = max(worst, _state_diff(got, want))
            g_logits, _, _ = _step(ref, tail, got)
            w_logits, _, _ = _step(ref, tail, want)
            worst = max(worst, _rel(g_logits, w_logits))
            assert torch.equal(g_logits.argmax(-1), w_logits.argmax(-1)), (k, a)
    return worst


@pytest.mark.parametrize("name", list(SHAPES))
def test_verify_then_commit_equals_sequential_decoding(name):
    """Every k in 1..8 and a in 0..k, in fp64: the only difference left between a k-row verify and k one-row
    steps is matmul blocking (~1e-15), so the commit selects exactly the sequential state. In fp32 the same
    blocking (a GEMV vs a GEMM) gives up to ~5e-5 relative after 5 random layers, with identical argmax."""
    import copy

    _, ref = _pair(name)
    worst64 = _rollback_worst(copy.deepcopy(ref).double())
    assert worst64 < 1e-10, f"fp64 verify+commit vs sequential: max difference {worst64:.2e}"
    worst32 = _rollback_worst(ref)
    assert worst32 < ROW_TOL, f"fp32 verify+commit vs sequential: max difference {worst32:.2e}"


def test_gdn_layer_rows_are_bitwise_row_invariant():
    """One GDN layer alone: the conv states and the recurrence give the same bits for a k-row step and k one-row
    steps (what else depends on n in the model: matmul blocking, and silu's vectorised path, 1 ulp)."""
    torch.manual_seed(0)
    Hv, dk, dv, C, K, n = 4, 16, 8, 24, 4, 7
    x, w, st = torch.randn(n, C), torch.randn(C, K), torch.randn(C, K - 1)
    q, k = l2norm(torch.randn(n, Hv, dk)) * dk ** -0.5, l2norm(torch.randn(n, Hv, dk))
    v, g, beta, S = torch.randn(n, Hv, dv), -torch.rand(n, Hv), torch.rand(n, Hv), torch.randn(Hv, dk, dv)
    y, window, rows = conv_rows(st, x, w)
    o, srows = gated_delta_rows(q, k, v, g, beta, S)
    for t in range(n):
        y1, _, r1 = conv_rows(st, x[t:t + 1], w)
        o1, s1 = gated_delta_rows(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], S)
        assert torch.equal(r1[0], rows[t]) and torch.equal(rows[t], window[:, t + 1:t + K])
        assert torch.allclose(y1[0], y[t], rtol=1e-6, atol=0)  # silu's vectorised and scalar paths: 1 ulp apart
        assert torch.equal(o1[0], o[t]) and torch.equal(s1[0], srows[t])
        st, S = r1[0], s1[0]


def test_commit_refuses_a_count_outside_the_step():
    _, ref = _pair("tied-k2-i4")
    _, _, step = _step(ref, _prompt(3), ref.empty_state())
    with pytest.raises(ValueError, match="outside 0..3"):
        commit(ref.empty_state(), step, 4)


def test_chunked_prefill_equals_the_row_loop():
    _, ref = _pair("untied-gqa-k4-i2")
    ids = _prompt(70, seed=11)
    l1, t1, s1 = _step(ref, ids, ref.empty_state())
    l2, t2, s2 = _step(ref, ids, ref.empty_state(), chunk=16)
    assert (l1 - l2).abs().max().item() < TOL and (t1 - t2).abs().max().item() < TOL
    assert (s1.rec[-1] - s2.rec[0]).abs().max().item() < TOL and s2.rec.shape[0] == 1
    a, b = commit(ref.empty_state(), s1, 70), commit(ref.empty_state(), s2, 70)
    with pytest.raises(ValueError, match="only its final GDN state"):
        commit(ref.empty_state(), s2, 69)
    tail = _prompt(3, seed=12)
    la, _, _ = _step(ref, tail, a)
    lb, _, _ = _step(ref, tail, b)
    assert (la - lb).abs().max().item() < TOL


# ---------------------------------------------------------------------------------------------------- M-RoPE, loading

def test_mrope_matches_transformers_rotary_embedding():
    hf, ref = _pair("untied-gqa-k4-i2")
    rot = hf.model.rotary_emb
    x = torch.zeros(1, 5, 48)
    text = torch.arange(3, 8)
    cos_h, sin_h = rot(x, text.view(1, 1, -1).expand(3, 1, -1))
    cos, sin = mrope_cos_sin(text.expand(3, -1), ref.inv_freq, ref.config.mrope_section)
    assert torch.equal(cos_h[0], cos) and torch.equal(sin_h[0], sin)
    # for text the interleaving changes nothing: plain RoPE on the rotary slice
    f = text.float()[:, None] * ref.inv_freq
    assert torch.equal(cos, torch.cat([f, f], -1).cos())
    pos3 = torch.stack([text, text * 2 + 1, text * 3 + 2])  # distinct T/H/W positions (vision rows)
    cos_h, sin_h = rot(x, pos3[:, None, :])
    cos, sin = mrope_cos_sin(pos3, ref.inv_freq, ref.config.mrope_section)
    assert torch.equal(cos_h[0], cos) and torch.equal(sin_h[0], sin)


def test_conditional_generation_wrapper_loads_and_matches():
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(5)
    text = _hf_config("untied-k4-i4-5layers")
    cfg = Qwen3_5Config(text_config=text.to_dict(), tie_word_embeddings=True,
                        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                                           out_hidden_size=48, patch_size=4, num_position_embeddings=16))
    hf = Qwen3_5ForConditionalGeneration(cfg).eval()
    _randomize(hf, 3)
    sd = hf.state_dict()
    text_keys = [k for k in sd if not k.startswith("model.visual.")]
    assert any(k.startswith("model.visual.") for k in sd)
    assert all(k.startswith("model.language_model.") or k == "lm_head.weight" for k in text_keys)
    raw = {**cfg.to_dict(), "architectures": ["Qwen3_5ForConditionalGeneration"]}
    c = read_qwen3_5_config(raw)
    assert c.tie_word_embeddings and c.layer_types == tuple(text.layer_types)
    ref = Qwen35Target(c).eval()
    sd = {**sd, "mtp.fc.weight": torch.zeros(3, 3), "mtp.layers.0.mlp.up_proj.weight": torch.zeros(2)}  # ignored
    load_hf_state_dict(ref, sd, "cg")
    ids = _prompt(16, seed=8)
    with torch.no_grad():
        want = hf(input_ids=ids[None]).logits[0]
    got, _, _ = _step(ref, ids, ref.empty_state())
    assert (want - got).abs().max().item() < TOL


def test_tensor_set_errors_list_every_problem():
    hf, ref = _pair("untied-gqa-k4-i2")
    sd = dict(hf.state_dict())
    del sd["model.layers.0.linear_attn.A_log"]
    sd["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    sd["model.extra.weight"] = torch.zeros(1)
    with pytest.raises(TensorSetError) as e:
        load_hf_state_dict(ref, sd, "ckpt")
    assert e.value.missing == ["layers.0.linear_attn.A_log"] and e.value.unexpected == ["model.extra.weight"]
    assert [m[0] for m in e.value.misshaped] == ["layers.1.self_attn.k_proj.weight"]


# ---------------------------------------------------------------------------------------------------- config reader

def _raw(**text):
    base = {**_hf_config("untied-gqa-k4-i2").to_dict(), "architectures": ["Qwen3_5ForCausalLM"]}
    base.update(text)
    return base


def test_config_reader_defaults_and_layout():
    raw = _raw()
    raw.pop("layer_types")
    raw["full_attention_interval"] = 2
    c = read_qwen3_5_config(raw)
    assert c.layer_types == ("linear_attention", "full_attention") * 2 and c.full_layers == (1, 3)
    assert c.rotary_dim == 8 and c.conv_dim == 2 * 2 * 16 + 4 * 16
    raw.pop("full_attention_interval")  # transformers' default interval is 4
    assert read_qwen3_5_config(raw).full_layers == (3,)


@pytest.mark.parametrize("change, field", [
    ({"architectures": ["Qwen3_5MoeForCausalLM"]}, "architectures"),
    ({"architectures": ["Qwen3_5ForConditionalGeneration"]}, "text_config"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
    ({"layer_types": ["sliding_attention"] * 4}, "layer_types"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_parameters.rope_type"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.03}}, "rope_parameters.partial_rotary_factor"),
    ({"rope_parameters": {"rope_theta": 1e4, "mrope_section": [1, 2]}}, "rope_parameters.mrope_section"),
    ({"hidden_size": "64"}, "hidden_size"),
    ({"attn_output_gate": False}, "attn_output_gate"),
])
def test_config_reader_names_file_field_expected_found(change, field):
    with pytest.raises(CheckpointError) as e:
        read_qwen3_5_config(_raw(**change), "/ckpt/config.json")
    assert e.value.field == field and e.value.file == "/ckpt/config.json" and e.value.expected and e.value.found


def test_config_reader_prefixes_text_config_fields():
    raw = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": _raw(num_hidden_layers=0)}
    with pytest.raises(CheckpointError) as e:
        read_qwen3_5_config(raw, "c.json")
    assert e.value.field == "text_config.num_hidden_layers"


# ---------------------------------------------------------------------------------------------------- ONNX Runtime

def _ort_session(nodes, inputs: dict, outputs: list[str]):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    ins = [helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape)) for k, v in inputs.items()]
    outs = [helper.make_tensor_value_info(k, TensorProto.FLOAT, None) for k in outputs]
    model = helper.make_model(helper.make_graph(nodes, "g", ins, outs),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {k: v.contiguous().numpy() for k, v in inputs.items()})


def _have_op(name: str) -> bool:
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as C
    except ImportError:
        return False
    return any(s.name == name and s.domain == "com.microsoft" for s in C.get_all_operator_schema())


@pytest.mark.skipif(not _have_op("LinearAttention"), reason="this ONNX Runtime has no com.microsoft LinearAttention")
@pytest.mark.parametrize("n", [1, 6])
def test_ort_linear_attention_matches_the_gated_delta_rule(n):
    """Inverse GQA (q at the key heads, k/v at the value heads) as transformers maps it; per-row states through an
    unrolled chain of one-row nodes (the CPU kernel refuses state_window > 0: CUDA only in 1.32)."""
    from onnx import helper

    torch.manual_seed(n)
    hq, hv, dk, dv = 2, 4, 16, 8
    q, k = l2norm(torch.randn(n, hq, dk)), l2norm(torch.randn(n, hv, dk))
    v, g, beta, S = torch.randn(n, hv, dv), -torch.rand(n, hv), torch.rand(n, hv), torch.randn(hv, dk, dv)
    out, rows = gated_delta_rows(q.repeat_interleave(hv // hq, 1) * dk ** -0.5, k, v, g, beta, S)
    attrs = dict(domain="com.microsoft", q_num_heads=hq, kv_num_heads=hv, update_rule="gated_delta")
    feeds = {"S0": S[None]}
    nodes = []
    for t in range(n):
        feeds.update({f"q{t}": q[t].reshape(1, 1, -1), f"k{t}": k[t].reshape(1, 1, -1), f"v{t}": v[t].reshape(1, 1, -1),
                      f"g{t}": g[t].reshape(1, 1, -1), f"b{t}": beta[t].reshape(1, 1, -1)})
        nodes.append(helper.make_node("LinearAttention", [f"q{t}", f"k{t}", f"v{t}", f"S{t}", f"g{t}", f"b{t}"],
                                      [f"o{t}", f"S{t + 1}"], **attrs))
    res = _ort_session(nodes, feeds, [f"o{t}" for t in range(n)] + [f"S{t + 1}" for t in range(n)])
    o_ort = torch.from_numpy(np.stack([r.reshape(hv, dv) for r in res[:n]]))
    s_ort = torch.from_numpy(np.stack([r[0] for r in res[n:]]))
    assert (o_ort - out).abs().max().item() < 1e-6 and (s_ort - rows).abs().max().item() < 1e-6
    # one node over all n rows: same output and final state
    whole = {"q": q.reshape(1, n, -1), "k": k.reshape(1, n, -1), "v": v.reshape(1, n, -1), "S0": S[None],
             "g": g.reshape(1, n, -1), "b": beta.reshape(1, n, -1)}
    o1, s1 = _ort_session([helper.make_node("LinearAttention", ["q", "k", "v", "S0", "g", "b"], ["o", "S"], **attrs)],
                          whole, ["o", "S"])
    assert (torch.tensor(o1).reshape(n, hv, dv) - out).abs().max().item() < 1e-6
    assert (torch.tensor(s1)[0] - rows[-1]).abs().max().item() < 1e-6


@pytest.mark.skipif(not _have_op("CausalConvWithState"), reason="no com.microsoft CausalConvWithState")
@pytest.mark.parametrize("n", [1, 6])
def test_ort_causal_conv_with_state_matches_the_conv(n):
    from onnx import helper

    torch.manual_seed(n)
    C, K = 20, 4
    x, w, st = torch.randn(n, C), torch.randn(C, K), torch.randn(C, K - 1)
    y, _, rows = conv_rows(st, x, w)
    node = helper.make_node("CausalConvWithState", ["x", "w", "", "past"], ["y", "state"], domain="com.microsoft",
                            activation="silu")
    yo, so = _ort_session([node], {"x": x.T[None], "w": w[:, None, :], "past": st[None]}, ["y", "state"])
    assert (torch.tensor(yo)[0].T - y).abs().max().item() < 1e-6
    assert torch.equal(torch.tensor(so)[0], rows[-1])
