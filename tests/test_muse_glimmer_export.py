"""Muse-Glimmer's standard-op target graphs (dflash2.export.muse_glimmer: portable + TensorRT flavour) on ONNX
Runtime against the reference and transformers, on the tiny pair of test_muse_glimmer_reference (window 8, NoPE full
layers) with Meta's assistant's taps and block (test_meta_assistant): a prefill 5x the window holding image / video
ids (logits, next ids, new K/V, fused context), the fixed-buffer flavour with stale rows, greedy ids over 64 tokens
past the window equal to transformers' `generate`, and speculative verification through the graph with rollback
at every accepted count 0..S equal to greedy (lossless)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")

from dflash2.export import muse_glimmer as graph  # noqa: E402
from dflash2.export import signature as N  # noqa: E402
from dflash2.export.weights import ModuleWeights  # noqa: E402
from dflash2.reference.load import load_drafter  # noqa: E402
from dflash2.reference.muse_glimmer import load_target  # noqa: E402

from tests.test_meta_assistant import TAPS, assistant  # noqa: E402
from tests.test_muse_glimmer_reference import IMAGE, VIDEO, WINDOW, pair, prompt  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    torch.set_num_threads(1)
    hf, _, target_dir = pair("untied", tmp_path_factory)
    _, drafter_dir = assistant(tmp_path_factory)
    ref = load_target(target_dir, tuple(TAPS))
    drafter = load_drafter(drafter_dir, ref)
    portable, fixed = graph.build(ref.config, drafter.config, ModuleWeights(ref), ModuleWeights(drafter),
                                  fuse_context=True)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    sessions = [ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
                for m in (portable, fixed)]
    return hf, ref, drafter, sessions


def step(sess, ids, past):
    """The portable graph on ids [n] after past [P, L, 2, kv, hd] -> (next_ids, context, new_kv, logits)."""
    out = sess.run(None, {N.INPUT_IDS: np.asarray(ids, np.int32), N.PAST_KV: past})
    return dict(zip([o.name for o in sess.get_outputs()], out))


def test_prefill_past_the_window_matches_the_reference(built):
    _, ref, drafter, (portable, _) = built
    ids = prompt(5 * WINDOW, seed=2)
    ids[4], ids[17] = IMAGE, VIDEO  # remapped to 0 in the graph too
    out = step(portable, ids.numpy(), np.zeros((0, *ref.kv_row_shape()), np.float32))
    with torch.no_grad():
        logits, taps, kv = ref(ids, torch.zeros(0, *ref.kv_row_shape()))
        context = drafter.context(taps)
    B = drafter.config.block_size
    assert np.abs(out[N.LOGITS] - logits[-B:].numpy()).max() < TOL
    assert (out[N.NEXT_IDS] == logits.argmax(-1).numpy()).all()
    assert np.abs(out[N.NEW_KV] - kv.numpy()).max() < TOL
    assert np.abs(out[N.CONTEXT] - context.numpy()).max() < TOL


def test_the_fixed_flavour_masks_stale_rows(built):
    """kv_cache [cap] with garbage past past_len: the same step as the portable graph on the valid prefix."""
    _, ref, _, (portable, fixed) = built
    ids = prompt(3 * WINDOW, seed=4)
    first = step(portable, ids[:20].numpy(), np.zeros((0, *ref.kv_row_shape()), np.float32))
    cache = np.random.default_rng(0).standard_normal((64, *ref.kv_row_shape())).astype(np.float32) * 50
    cache[:20] = first[N.NEW_KV]
    want = step(portable, ids[20:].numpy(), first[N.NEW_KV])
    got = fixed.run(None, {N.INPUT_IDS: ids[20:].numpy().astype(np.int32), N.KV_CACHE: cache,
                           N.PAST_LEN: np.array([20], np.int32)})
    got = dict(zip([o.name for o in fixed.get_outputs()], got))
    for name in (N.LOGITS, N.NEW_KV, N.CONTEXT):
        assert np.abs(got[name] - want[name]).max() < TOL, name
    assert (got[N.NEXT_IDS] == want[N.NEXT_IDS]).all()


def greedy(sess, ref, ids, count: int) -> list[int]:
    out = step(sess, ids.numpy(), np.zeros((0, *ref.kv_row_shape()), np.float32))
    past, got = out[N.NEW_KV], [int(out[N.NEXT_IDS][-1])]
    while len(got) < count:
        out = step(sess, [got[-1]], past)
        past = np.concatenate([past, out[N.NEW_KV]])
        got.append(int(out[N.NEXT_IDS][0]))
    return got


def test_greedy_64_tokens_through_the_graph_equal_transformers(built):
    hf, ref, _, (portable, _) = built
    ids = prompt(3 * WINDOW, seed=3)
    with torch.no_grad():
        want = hf.generate(ids[None], do_sample=False, max_new_tokens=64, min_new_tokens=64, pad_token_id=0)
    assert greedy(portable, ref, ids, 64) == want[0, ids.shape[0]:].tolist()


def test_speculative_verify_through_the_graph_is_lossless_at_every_accepted_count(built):
    """Rounds of S drafts verified as one (S+1)-row step of the graph: the drafts are greedy's continuation with
    draft a replaced (a = round mod S+1; a = S: all right), so every accepted count 0..S occurs; only the accepted
    rows' K/V are kept (rollback), windows are crossed; the emitted ids are greedy's, token for token."""
    _, ref, drafter, (portable, _) = built
    S, ids, count = drafter.config.block_size - 1, prompt(2 * WINDOW + 3, seed=8), 64
    truth = greedy(portable, ref, ids, count + S + 1)
    out = step(portable, ids.numpy(), np.zeros((0, *ref.kv_row_shape()), np.float32))
    past, emitted, seen = out[N.NEW_KV], [int(out[N.NEXT_IDS][-1])], set()
    r = 0
    while len(emitted) < count:
        a = r % (S + 1)
        drafts = list(truth[len(emitted):len(emitted) + S])
        if a < S:
            drafts[a] = (drafts[a] + 1) % ref.config.vocab_size  # a wrong draft at slot a
        out = step(portable, [emitted[-1], *drafts], past)
        verified = out[N.NEXT_IDS].tolist()  # [S+1]: the target's choice after each row
        acc = next((j for j in range(S) if drafts[j] != verified[j]), S)
        assert acc == a
        past = np.concatenate([past, out[N.NEW_KV][:acc + 1]])  # rollback: the rejected rows' K/V dropped
        emitted += verified[:acc + 1]
        seen.add(acc)
        r += 1
    assert emitted[:count] == truth[:count] and seen == set(range(S + 1))
    assert past.shape[0] > 4 * WINDOW
