"""The streamed references (dflash2.reference.streamed / vocab) against the loaded modules: the same outputs bit
for bit on every graph's validation feeds, tied and untied heads, DFlash and DFlash2, with and without a draft
vocabulary; and they hold no vocabulary-sized matrix and no layer beyond the one running."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash2 import tiny
from dflash2.checkpoint import Weights
from dflash2.export.graphs import graph_specs
from dflash2.export.validate import reference_outputs
from dflash2.reference.load import load_pair, load_streamed_pair
from dflash2.reference import vocab
from dflash2.reference.vocab import StreamedRows

CASES = {"untied-v2": (False, 2), "tied-v2": (True, 2), "untied-v1": (False, 1)}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    tied, version = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    target = tiny.make_target(root / "target", tie_word_embeddings=tied, dtype=torch.bfloat16)
    drafter = tiny.make_drafter(root / "drafter", target, version=version, num_layers=2, dtype=torch.bfloat16)
    return drafter, target


def _outputs(target, drafter):
    return {s.name: reference_outputs(s, s.feeds()) for s in graph_specs(target, drafter)}


@pytest.mark.parametrize("slices", ["one", "eight"])
@pytest.mark.parametrize("draft_ids", [None, list(range(0, 384, 3))])
def test_streamed_pair_equals_the_loaded_pair(pair, draft_ids, slices, monkeypatch):
    """One vocabulary slice: bit for bit. Eight slices of 50 rows: to fp32 rounding (a narrow GEMM takes another
    kernel than the whole product; at a real vocabulary's 64 MB slices it is the same one), the same ids."""
    if slices == "eight":
        monkeypatch.setattr(vocab, "CHUNK_BYTES", 4 * 64 * 50)  # 50 rows of 64
    loaded, streamed = load_pair(*pair), load_streamed_pair(*pair)
    for t, d in (loaded, streamed):
        d.set_draft_vocab(draft_ids)
    want, got = _outputs(*loaded), _outputs(*streamed)
    assert want.keys() == got.keys() and {"target", "drafter"} <= set(want)
    for graph in want:
        for step, (w, g) in enumerate(zip(want[graph], got[graph])):
            for name in w:
                if slices == "one" or not np.issubdtype(w[name].dtype, np.floating):
                    assert np.array_equal(w[name], g[name]), f"{graph}.{name} step {step} differs"
                else:
                    np.testing.assert_allclose(g[name], w[name], rtol=1e-5, atol=1e-5 * float(np.abs(w[name]).max()),
                                               err_msg=f"{graph}.{name} step {step}")


def test_streamed_pair_holds_no_vocabulary_matrix_and_one_layer_at_a_time(pair):
    target, drafter = load_streamed_pair(*pair)
    tc, dc = target.config, drafter.config
    _outputs(target, drafter)  # a forward of every graph: what it read is dropped after it
    held = [t for m in (target, drafter) for t in (*m.parameters(), *m.buffers()) if t.device.type != "meta"]
    assert held and max(t.numel() for t in held) < tc.vocab_size * tc.hidden_size  # codebooks are [V, rank]
    for template in (*target._layers, drafter.layers):  # the templates (one per layer), never loaded
        assert all(p.device.type == "meta" for p in template.parameters())
    seen = [id(layer) for layer in drafter.iter_layers()]
    assert len(seen) == dc.num_layers


def test_streamed_rows_reads_any_ids_and_names_a_bad_one(pair, monkeypatch):
    monkeypatch.setattr(vocab, "CHUNK_BYTES", 4 * 64 * 50)
    _, target_dir = pair
    w = Weights(target_dir)
    rows = StreamedRows(w, "embed_tokens.weight")
    full = torch.from_numpy(w.get("embed_tokens.weight"))
    ids = torch.tensor([[5, 3, 3, 4], [383, 0, 6, 5]])  # unsorted, repeated, both ends, runs and gaps
    assert torch.equal(rows.rows(ids), full[ids])
    assert rows.rows(torch.zeros(0, dtype=torch.long)).shape == (0, full.shape[1])
    x = torch.randn(3, full.shape[1], generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(rows.project(x), x @ full.T)  # 8 slices: to rounding
    assert torch.equal(rows.project(x)[:, 50:100], x @ full[50:100].T)  # each slice is its own product
    with pytest.raises(IndexError, match=r"embed_tokens.weight: ids must lie in 0..383, found 0..384"):
        rows.rows(torch.tensor([0, 384]))


def test_truncated_depth_keeps_four_layers_unless_their_fp32_bytes_pass_the_budget(pair):
    import dataclasses

    from dflash2.config import load_target_config
    from dflash2.export.stages import TRUNCATED_LAYER_BYTES, truncated_depth

    tc = load_target_config(pair[1])
    assert truncated_depth(tc) == 4
    qwen3_8b = dataclasses.replace(tc, hidden_size=4096, intermediate_size=12288, num_heads=32, num_kv_heads=8,
                                   head_dim=128, num_layers=36)  # 0.77 GB of fp32 per layer
    assert truncated_depth(qwen3_8b) == 2 and 2 * 0.77e9 < TRUNCATED_LAYER_BYTES < 3 * 0.77e9
    huge = dataclasses.replace(qwen3_8b, hidden_size=8192, intermediate_size=29568)  # still a tap in the loop
    assert truncated_depth(huge) == 2
