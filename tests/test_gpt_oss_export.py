"""gpt-oss's standard-op target graphs (dflash2.export.gpt_oss: portable + TensorRT flavour) on ONNX Runtime against
the reference and transformers, on the tiny pairs of test_gpt_oss_reference (window 8, 4 experts top-2 routed at
std 0.5, sinks at std 1, YaRN; float experts and the same experts x25 as MXFP4 so the SwiGLU clamp is hit): a
prefill 5x the window (logits, next ids, new K/V, taps), the fixed-buffer flavour with stale rows, greedy ids over
64 tokens past the window equal to transformers' `generate`, and verification with rollback at every accepted count
0..S equal to greedy (lossless); then through dflash2-export (validated whole and truncated, row-checked) and the
runtime, float and MXFP4 checkpoints as dflash2-make-tiny writes them."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")

from dflash2.export import gpt_oss as graph  # noqa: E402
from dflash2.export import signature as N  # noqa: E402
from dflash2.export.weights import ModuleWeights  # noqa: E402

from tests.test_gpt_oss_reference import WINDOW, pair, prompt  # noqa: E402

TOL = 1e-4
TAPS, BLOCK = (1, 3), 4
_BUILT: dict = {}


def built(name: str, tmp_path_factory):
    """(transformers model, reference, portable session, fixed session) of pair `name`; the graph built from the
    loaded reference's parameters (ModuleWeights), taps TAPS unfused (the context is the taps themselves)."""
    if name not in _BUILT:
        torch.set_num_threads(1)
        hf, ref, _ = pair(name, tmp_path_factory)
        dc = SimpleNamespace(block_size=BLOCK, target_layer_ids=TAPS)
        portable, fixed = graph.build(ref.config, dc, ModuleWeights(ref), None, fuse_context=False)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        _BUILT[name] = (hf, ref, *(ort.InferenceSession(m.SerializeToString(), opts,
                                                        providers=["CPUExecutionProvider"]) for m in (portable, fixed)))
    return _BUILT[name]


def step(sess, ids, past):
    out = sess.run(None, {N.INPUT_IDS: np.asarray(ids, np.int32), N.PAST_KV: past})
    return dict(zip([o.name for o in sess.get_outputs()], out))


def empty(ref):
    return np.zeros((0, *ref.kv_row_shape()), np.float32)


@pytest.mark.parametrize("name", ["float", "mxfp4"])
def test_prefill_past_the_window_matches_the_reference(name, tmp_path_factory):
    _, ref, portable, _ = built(name, tmp_path_factory)
    ids = prompt(5 * WINDOW, seed=2)
    out = step(portable, ids.numpy(), empty(ref))
    with torch.no_grad():
        logits, taps, kv = ref(ids, torch.zeros(0, *ref.kv_row_shape()))
    H = ref.config.hidden_size
    scale = max(1.0, float(logits.abs().max()))
    assert np.abs(out[N.LOGITS] - logits[-BLOCK:].numpy()).max() < TOL * scale
    assert (out[N.NEXT_IDS] == logits.argmax(-1).numpy()).all()
    assert np.abs(out[N.NEW_KV] - kv.numpy()).max() < TOL * max(1.0, float(kv.abs().max()))
    want = torch.cat([taps[:, t * H:(t + 1) * H] for t in TAPS], dim=-1).numpy()  # the reference taps every layer
    assert np.abs(out[N.CONTEXT] - want).max() < TOL * max(1.0, float(np.abs(want).max()))


def test_the_fixed_flavour_masks_stale_rows(tmp_path_factory):
    _, ref, portable, fixed = built("float", tmp_path_factory)
    ids = prompt(3 * WINDOW, seed=4)
    first = step(portable, ids[:20].numpy(), empty(ref))
    cache = np.random.default_rng(0).standard_normal((64, *ref.kv_row_shape())).astype(np.float32) * 50
    cache[:20] = first[N.NEW_KV]
    want = step(portable, ids[20:].numpy(), first[N.NEW_KV])
    got = fixed.run(None, {N.INPUT_IDS: ids[20:].numpy().astype(np.int32), N.KV_CACHE: cache,
                           N.PAST_LEN: np.array([20], np.int32)})
    got = dict(zip([o.name for o in fixed.get_outputs()], got))
    for key in (N.LOGITS, N.NEW_KV, N.CONTEXT):
        assert np.abs(got[key] - want[key]).max() < TOL * max(1.0, float(np.abs(want[key]).max())), key
    assert (got[N.NEXT_IDS] == want[N.NEXT_IDS]).all()


def greedy(sess, ref, ids, count: int) -> list[int]:
    out = step(sess, ids.numpy(), empty(ref))
    past, got = out[N.NEW_KV], [int(out[N.NEXT_IDS][-1])]
    while len(got) < count:
        out = step(sess, [got[-1]], past)
        past = np.concatenate([past, out[N.NEW_KV]])
        got.append(int(out[N.NEXT_IDS][0]))
    return got


@pytest.mark.parametrize("name", ["float", "mxfp4"])
def test_greedy_64_tokens_through_the_graph_equal_transformers(name, tmp_path_factory):
    hf, ref, portable, _ = built(name, tmp_path_factory)
    ids = prompt(3 * WINDOW, seed=3)
    with torch.no_grad():
        want = hf.generate(ids[None], do_sample=False, max_new_tokens=64, min_new_tokens=64, pad_token_id=0)
    got = greedy(portable, ref, ids, 64)
    assert got == want[0, ids.shape[0]:].tolist() and len(set(got)) > 8


def test_speculative_verify_through_the_graph_is_lossless_at_every_accepted_count(tmp_path_factory):
    """Rounds of S drafts verified as one (S+1)-row step: the drafts are greedy's continuation with draft a wrong
    (a = round mod S+1; a = S: all right), so every accepted count 0..S occurs; the rejected rows' K/V dropped; the
    emitted ids are greedy's, token for token, past several windows."""
    _, ref, portable, _ = built("mxfp4", tmp_path_factory)
    S, ids, count = BLOCK - 1, prompt(2 * WINDOW + 3, seed=8), 48
    truth = greedy(portable, ref, ids, count + S + 1)
    out = step(portable, ids.numpy(), empty(ref))
    past, emitted, seen, r = out[N.NEW_KV], [int(out[N.NEXT_IDS][-1])], set(), 0
    while len(emitted) < count:
        a = r % (S + 1)
        drafts = list(truth[len(emitted):len(emitted) + S])
        if a < S:
            drafts[a] = (drafts[a] + 1) % ref.config.vocab_size
        out = step(portable, [emitted[-1], *drafts], past)
        verified = out[N.NEXT_IDS].tolist()
        acc = next((j for j in range(S) if drafts[j] != verified[j]), S)
        assert acc == a
        past = np.concatenate([past, out[N.NEW_KV][:acc + 1]])
        emitted += verified[:acc + 1]
        seen.add(acc)
        r += 1
    assert emitted[:count] == truth[:count] and seen == set(range(S + 1))
    assert past.shape[0] > 4 * WINDOW


def test_the_sinks_and_the_clamp_are_in_the_graph(tmp_path_factory):
    """Zeroing the sinks or lifting the SwiGLU limit in the config changes the graph's logits (so the comparisons
    above would see either missing)."""
    import dataclasses

    _, ref, portable, _ = built("mxfp4", tmp_path_factory)
    ids = prompt(2 * WINDOW, seed=5)
    base = step(portable, ids.numpy(), empty(ref))[N.LOGITS]
    dc = SimpleNamespace(block_size=BLOCK, target_layer_ids=TAPS)
    unclamped = dataclasses.replace(ref.config, swiglu_limit=1e9)
    w = ModuleWeights(ref)
    for k in [k for k in w.params if k.endswith("sinks")]:
        w.params[k] = torch.zeros_like(w.params[k])
    for c, src in ((unclamped, ModuleWeights(ref)), (ref.config, w)):
        model = graph.build(c, dc, src, None, fuse_context=False)[0]
        s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        assert np.abs(step(s, ids.numpy(), empty(ref))[N.LOGITS] - base).max() > 1e-2
