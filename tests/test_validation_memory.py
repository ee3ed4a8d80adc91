"""The bounded-memory validation: the streamed Polygraphy replay files (dflash2.export.replay) byte for byte
Polygraphy's own, comparisons in slices, file-backed parameters, feeds on their own storage."""

import numpy as np
import pytest

from dflash2.export.replay import ReplayWriter
from dflash2.export.validate import save_polygraphy


def _feeds():
    g = np.random.default_rng(0)
    feeds = [{"input_ids": np.arange(5, dtype=np.int32), "past_kv": g.standard_normal((3, 2, 4)).astype(np.float32)},
             {"input_ids": np.array([7], dtype=np.int32), "past_kv": np.zeros((0, 2, 4), np.float32)}]
    refs = [{"next_ids": np.array([1, 2], np.int32), "logits": g.standard_normal((2, 1001)).astype(np.float32),
             "empty": np.zeros((0,), np.float32), "f64": np.asfortranarray(g.standard_normal((3, 5)))},
            {"next_ids": np.array([3], np.int32), "logits": np.full((1, 1001), np.inf, np.float32),
             "empty": np.zeros((0,), np.float32), "f64": np.ones((3, 5))}]
    return feeds, refs


def test_streamed_files_equal_polygraphys(tmp_path):
    feeds, refs = _feeds()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    save_polygraphy(tmp_path / "a", "g", feeds, refs)
    with ReplayWriter(tmp_path / "b", "g") as w:
        for f, r in zip(feeds, refs):
            w.add(f, r)
    for suffix in ("inputs", "reference"):
        assert (tmp_path / "b" / f"g.{suffix}.json").read_bytes() == (tmp_path / "a" / f"g.{suffix}.json").read_bytes()


def test_streamed_files_load_back(tmp_path):
    from polygraphy.comparator import RunResults
    from polygraphy.json import load_json

    feeds, refs = _feeds()
    with ReplayWriter(tmp_path, "g") as w:
        for f, r in zip(feeds, refs):
            w.add(f, r)
    back = load_json(str(tmp_path / "g.inputs.json"))
    assert all(np.array_equal(back[i][k], feeds[i][k]) for i in range(2) for k in feeds[i])
    results = RunResults.load(str(tmp_path / "g.reference.json"))
    its = results["pytorch"]
    assert all(np.array_equal(its[i][k], refs[i][k]) for i in range(2) for k in refs[i])


def test_no_feed_is_refused(tmp_path):
    with pytest.raises(ValueError, match="at least one feed"):
        ReplayWriter(tmp_path, "g").close()


def test_chunked_comparison_equals_one_piece(monkeypatch):
    """compare_floats / max_abs_difference in slices (outputs past numerics.CHUNK): the same maxima and verdict as
    in one piece, a failure in the last slice only still found."""
    from dflash2 import numerics

    g = np.random.default_rng(1)
    want = (g.standard_normal((7, 13)) * 30).astype(np.float32)
    got = want + (g.standard_normal(want.shape) * 1e-4).astype(np.float32)
    want[2, 3] = got[2, 3] = np.inf  # equal infinities: equal to the rule; NaN in max_abs_difference, as in one piece
    bad = got.copy()
    bad[-1, -1] += 1.0  # in the last slice
    whole = {n: numerics.compare_floats(x, want, 1e-5, 1e-5) for n, x in (("got", got), ("bad", bad))}
    monkeypatch.setattr(numerics, "CHUNK", 10)
    for n, x in (("got", got), ("bad", bad)):
        d = numerics.compare_floats(x, want, 1e-5, 1e-5)
        assert np.array_equal([d.max_abs, d.max_rel], [whole[n].max_abs, whole[n].max_rel], equal_nan=True)
        assert d.ok == whole[n].ok
        assert d.scale == pytest.approx(whole[n].scale, rel=1e-12)
        with np.errstate(invalid="ignore"):
            one = np.abs(x.astype(np.float64) - want)
        assert np.array_equal(numerics.max_abs_difference(x, want), one.max(), equal_nan=True)
    assert whole["got"].ok and not whole["bad"].ok


def test_file_backed_parameters_keep_their_values(tmp_path):
    """dflash2.export.filebacked: large parameters mapped from a temporary file, the same values and outputs."""
    import torch

    from dflash2.export.filebacked import file_backed

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 3)).requires_grad_(False)
    x = torch.randn(4, 64)
    want, before = m(x), {k: v.clone() for k, v in m.state_dict().items()}
    moved = file_backed(m, tmp_path, min_bytes=64 * 32 * 4)  # the first weight only
    assert moved == ["0.weight"]
    assert all(torch.equal(m.state_dict()[k], v) for k, v in before.items())
    assert torch.equal(m(x), want)
    assert not list(tmp_path.iterdir())  # the file is unlinked: nothing left behind


def test_own_storage_copies_views_out():
    """validate.own_storage: a feed's view into a larger tensor becomes a tensor of its own, equal values."""
    import torch

    from dflash2.export.validate import own_storage

    big = torch.arange(1000.0).reshape(10, 100)
    whole = torch.arange(5, dtype=torch.int32)
    [f] = own_storage([{"state": big[3], "ids": whole}])
    assert torch.equal(f["state"], big[3]) and f["state"].untyped_storage().nbytes() == 100 * 4
    assert f["ids"] is whole  # already its own: not copied


def test_traced_module_weights_are_freed_after_the_trace():
    """trace._forget_rewriter_matches: onnxscript's rewrite rules no longer hold the traced module's weights (the
    selector's file-backed codebooks stayed mapped into the row check)."""
    import gc
    import warnings
    import weakref

    import torch

    from dflash2.export.trace import _forget_rewriter_matches

    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
    w = weakref.ref(m[0].weight)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(m, (torch.zeros(3, 8),), dynamo=True, optimize=True, verbose=False)
    del program, m
    _forget_rewriter_matches()
    gc.collect()
    assert w() is None
