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

    written = {}
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
