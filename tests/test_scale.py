"""Scale is a feature: the streamed export stages hold one tensor (plus a constant), never the model.

A checkpoint shaped so that a whole-model copy is many times its largest tensor (24 layers, a 32k
vocabulary): in a fresh process, the gqa target built from the checkpoint (fp32 and int4, weights
streamed into the data file, quantized as written) and a forward of the layer-streamed reference must
raise the peak resident memory by at most a few largest tensors over the process after its imports.
Loading the model whole (~450 MB of fp32 here) fails it."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from dflash2.bench.scalecheck import Shape, make_pair

SHAPE = Shape("many-layers", hidden=512, layers=24, heads=8, kv_heads=4, intermediate=2048, vocab=32000, tied=False,
              draft_layers=1, taps=(1, 12, 22), block=8, top_k=8, rank=32, head_dim=64, tokens=31_900,
              sliding_window=None, max_positions=4096)

CHILD = r"""
import json, sys
from pathlib import Path
import torch
from dflash2.checkpoint import Weights
from dflash2.config import load_drafter_config, load_target_config
from dflash2.export import gqa, weights as W
from dflash2.export.quantize import OrtQuant
from dflash2.reference.streamed import StreamedTarget

def status(key):
    return int(Path("/proc/self/status").read_text().split(key + ":")[1].split()[0]) * 1024

d, t, out = map(Path, sys.argv[1:4])
tc, dc = load_target_config(t), load_drafter_config(d)
W.NBits(OrtQuant("int4"))  # ONNX Runtime's quantizer imported before the baseline
base = status("VmRSS")
for q in (None, OrtQuant("int4")):
    with W.DataFile(out / "target.onnx.data") as data:
        gqa.build(tc, dc, Weights(t), Weights(d), True, 256, data, quant=q)
st = StreamedTarget(tc, dc.target_layer_ids, Weights(t))
with torch.no_grad():
    st(torch.arange(9), torch.zeros(0, *st.kv_row_shape()))
print(json.dumps({"base": base, "peak": status("VmHWM")}))
"""


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(SHAPE, tmp_path_factory.mktemp("scale"))


def test_streamed_stages_hold_a_few_tensors_not_the_model(pair, tmp_path):
    from dflash2.checkpoint import target_tensor_shapes
    from dflash2.config import load_target_config

    drafter, target = pair
    shapes = target_tensor_shapes(load_target_config(target))
    largest = 4 * max(math.prod(s) for s in shapes.values())  # fp32 bytes
    model = 4 * sum(math.prod(s) for s in shapes.values())
    assert model > 6 * largest  # the shape can tell a model copy from a tensor
    r = subprocess.run([sys.executable, "-c", CHILD, str(drafter), str(target), str(tmp_path)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    grown = max(0, m["peak"] - m["base"])
    assert grown <= 4 * largest, (f"peak grew {grown / 2**20:.0f} MiB over the imports: more than 4 x the largest "
                                  f"tensor ({largest / 2**20:.0f} MiB); the model is {model / 2**20:.0f} MiB")


def test_the_muse_glimmer_30b_shape_writes_the_configs_it_names(tmp_path, monkeypatch):
    """The muse-glimmer-30b entry (configs only: its weights are ~60 GB bf16, not written here) reads back as
    Muse-Glimmer-30B's text model (52 layers, 3 sliding of window 2048 : 1 NoPE full, 32 / 2 heads of 128, the
    softcap) with a 5-layer DFlash2 drafter on taps 1, 13, 25, 37, 49; its text tensors total ~28 B parameters."""
    from dflash2.bench import scalecheck
    from dflash2.checkpoint import family_tensor_shapes
    from dflash2.config import load_drafter_config, load_target_config

    from dflash2.bench import scalecut

    written = {}
    monkeypatch.setattr(scalecut, "_free_for", lambda path: (1 << 40, 1))  # the disk check passes: nothing written
    monkeypatch.setattr(scalecheck, "write_safetensors",
                        lambda folder, shapes, dtype, seed: written.setdefault(folder.name, shapes))
    drafter, target = make_pair(scalecheck.SHAPES["muse-glimmer-30b"], tmp_path)
    tc, dc = load_target_config(target), load_drafter_config(drafter)
    assert (tc.family, tc.hidden_size, tc.num_layers, tc.num_heads, tc.num_kv_heads, tc.head_dim, tc.vocab_size,
            tc.intermediate_size) == ("muse_glimmer", 6656, 52, 32, 2, 128, 202_048, 19968)
    assert tc.layer_types.count("full_attention") == 13 and tc.layer_types[-1] == "full_attention"
    assert set(tc.layer_windows) == {2048, None} and tc.layer_rope == tuple(w is not None for w in tc.layer_windows)
    assert tc.final_logit_softcapping == 20.0 and not tc.tie_word_embeddings
    assert tuple(dc.target_layer_ids) == (1, 13, 25, 37, 49) and dc.num_layers == 5
    params = sum(math.prod(s) for s in family_tensor_shapes(tc).values())
    assert 27e9 < params < 29e9, params  # the text model: the vision tower makes the rest of "30B"
    assert written["target"] and written["drafter"]

# ------------------------------------------------------------------------------------ the layer cut (scalecut)

HYBRID = Shape("tiny-hybrid", hidden=64, layers=12, heads=4, kv_heads=2, intermediate=128, vocab=512, tied=False,
               draft_layers=2, taps=(1, 5, 10), block=4, top_k=4, rank=8, head_dim=16, tokens=500,
               sliding_window=None, max_positions=1024, family="qwen3_5",
               extra=(("full_attention_interval", 4), ("linear_num_key_heads", 2), ("linear_num_value_heads", 4)))


def test_cut_taps_scaled_distinct_in_range_and_clipped_with_repeats_below_the_count():
    from dflash2.bench.scalecut import cut_taps

    assert cut_taps((5, 19, 33, 47, 61), 64, 8) == (1, 2, 4, 6, 7)  # the 27B drafter's taps on 8 of 64 layers
    assert cut_taps((5, 19, 33, 47, 61), 64, 16) == (1, 5, 8, 12, 15)
    assert cut_taps((60, 61, 62, 63), 64, 4) == (0, 1, 2, 3)  # all crowded at the end: pulled back, one layer each
    assert cut_taps((1, 10, 19, 28, 37), 40, 4) == (0, 1, 2, 3, 3)  # fewer layers than taps: the count kept
    assert cut_taps((1, 10, 19, 28, 37), 40, 40) == (1, 10, 19, 28, 37)


def test_truncated_pair_keeps_the_hybrid_pattern_and_remaps_the_taps(tmp_path):
    from dflash2.bench.scalecut import truncate
    from dflash2.checkpoint import read_headers
    from dflash2.config import load_drafter_config, load_target_config

    with pytest.raises(ValueError, match=r"expected 1\.\.12 for tiny-hybrid \(12 layers\), found 13"):
        truncate(HYBRID, 13)
    assert truncate(HYBRID, 12) is HYBRID
    cut = truncate(HYBRID, 8)
    assert (cut.name, cut.layers, cut.full_layers, cut.taps) == ("tiny-hybrid-L8", 8, 12, (1, 3, 7))
    drafter, target = make_pair(cut, tmp_path / cut.name)
    tc, dc = load_target_config(target), load_drafter_config(drafter)
    assert tc.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + \
        ("full_attention",)
    assert (dc.target_layer_ids, dc.num_target_layers) == ((1, 3, 7), 8)
    layers = {int(n.split(".")[2]) for n in read_headers(target) if n.startswith("model.layers.")}
    assert layers == set(range(8))
    assert read_headers(drafter)["fc.weight"][1] == (64, 3 * 64)  # the real drafter's fc width: three taps


def test_disk_check_refuses_with_the_numbers_before_writing(tmp_path, monkeypatch):
    from dflash2.bench import scalecut

    monkeypatch.setattr(scalecut, "_free_for", lambda path: (1 << 30, 1))  # 1.1 GB free, one file system
    root = tmp_path / "pair"
    with pytest.raises(scalecut.DiskTooSmall, match=r"tiny-hybrid: the pair \(0\.0 GB at .*\) and its export \(up to "
                                                    r"0\.0 GB at .*\) need 4\.3 GB with a 2 GiB margin on one file "
                                                    r"system; 1\.1 GB is free \(truncate it: --layers N\)"):
        make_pair(HYBRID, root, 0.75, tmp_path / "out")
    assert not list((root / "target").glob("*.safetensors")) and not (root / "DONE").exists()
    monkeypatch.setattr(scalecut, "_free_for", lambda path: (100 << 30, 1))
    make_pair(HYBRID, root, 0.75, tmp_path / "out")  # enough room: written
    assert (root / "DONE").is_file()


def test_per_layer_fit_splits_fixed_and_per_layer_cost_and_extrapolates():
    from dflash2.bench.scalecheck import Measured
    from dflash2.bench.scalecut import per_layer, truncate

    shapes = [truncate(HYBRID, 4), truncate(HYBRID, 8)]
    rows = [Measured(shapes[0].name, "int4", 0, 2.0, 100.0, output_gb=1.0),
            Measured(shapes[1].name, "int4", 0, 2.5, 140.0, output_gb=1.4),
            Measured(shapes[1].name, "fp32", 1, None, 5.0),  # failed: no fit from one point
            Measured(HYBRID.name, "fp32", 0, 4.0, 300.0, output_gb=3.0)]  # whole, alone: no fit either
    (fit,) = per_layer(shapes, rows)
    assert (fit["shape"], fit["mode"], fit["layers"], fit["full_layers"]) == ("tiny-hybrid", "int4", [4, 8], 12)
    assert fit["per_layer"] == {"peak_rss_gib": 0.125, "wall_s": 10.0, "output_gb": 0.1}
    assert fit["fixed"] == {"peak_rss_gib": 1.5, "wall_s": 60.0, "output_gb": 0.6}
    assert fit["extrapolated"] == {"peak_rss_gib": 3.0, "wall_s": 180.0, "output_gb": 1.8}
    rows[1].peak_rss_gib = 1.9  # a peak that falls with depth (noise over depth-free steps): the largest kept
    assert per_layer(shapes, rows)[0]["extrapolated"]["peak_rss_gib"] == 2.0
