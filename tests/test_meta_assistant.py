"""Meta's DFlash drafter format (transformers `muse_glimmer_assistant`, MuseGlimmerAssistantModel) read into dflash2's
DFlash v1 drafter (dflash2.drafter_formats, dflash2.reference.drafter): its config (top-level block_size /
mask_token_id / target_layer_ids, the target's layer count and vocabulary), its tensor names (encoder.fc,
encoder.output_norm_enc), its inclusive bidirectional window; per round, the drafter's logits against transformers'
own DFlash loop (`generate(..., assistant_model=..., speculation_type="dflash")`) on a tiny Muse-Glimmer pair whose
prompt and context are longer than the window; z-lab's `<` window rule and a causal reading shown to disagree;
refusals naming the field. Through dflash2-export and the runtime: tests/test_meta_assistant_export.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel  # noqa: E402
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator  # noqa: E402

from dflash2.checkpoint import check_tensors, drafter_tensor_shapes  # noqa: E402
from dflash2.config import load_drafter_config  # noqa: E402
from dflash2.drafter_formats import META, for_target  # noqa: E402
from dflash2.errors import CheckpointError  # noqa: E402
from dflash2.reference.drafter import Drafter  # noqa: E402
from dflash2.reference.load import load_drafter  # noqa: E402
from dflash2.reference.muse_glimmer import load_target  # noqa: E402

from tests.test_muse_glimmer_reference import pair as target_pair, prompt  # noqa: E402

TOL = 1e-4  # raw LM-head logits of the drafter vs transformers' candidate logits
WINDOW, BLOCK, TAPS, MASK = 4, 4, [1, 4], 255


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def asst_config(**over) -> MuseGlimmerAssistantConfig:
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, block_size=BLOCK, mask_token_id=MASK,
              target_layer_ids=TAPS, max_position_embeddings=512)
    kw.update(over)
    return MuseGlimmerAssistantConfig(**kw)


_CACHE: dict = {}


def assistant(tmp_path_factory):
    """(transformers' assistant, its save_pretrained folder); norms off 1 so they matter."""
    if "asst" not in _CACHE:
        torch.manual_seed(99)
        asst = MuseGlimmerAssistantModel(asst_config()).eval()
        with torch.no_grad():
            for n, p in asst.named_parameters():
                if "norm" in n:
                    p.normal_(1, 0.2)
        folder = tmp_path_factory.mktemp("assistant")
        asst.save_pretrained(folder)
        _CACHE["asst"] = asst, folder
    return _CACHE["asst"]


def transformers_rounds(hf_target, asst, ids, max_new: int = 30):
    """transformers' DFlash loop on ids [n]: (its output ids, per drafting round (the sequence so far, the
    drafter's candidate logits [B-1, V]))."""
    rounds = []
    orig = DFlashTokenCandidateGenerator.get_candidates

    def spy(self, input_ids, **kw):
        cand, logits = orig(self, input_ids, **kw)
        if logits is not None:  # round 0 is the prefill: no candidates
            rounds.append((input_ids[0].clone(), logits[0].clone()))
        return cand, logits
    DFlashTokenCandidateGenerator.get_candidates = spy
    try:
        with torch.no_grad():
            out = hf_target.generate(ids[None], assistant_model=asst, speculation_type="dflash",
                                     max_new_tokens=max_new, do_sample=False, pad_token_id=0)
    finally:
        DFlashTokenCandidateGenerator.get_candidates = orig
    return out[0], rounds


def drafter_logits(ref_target, drafter: Drafter, seq: torch.Tensor) -> torch.Tensor:
    """dflash2's round for the sequence so far: context = every row before the last token (their taps, at their
    positions), the block [last token, MASK * (B-1)] after them -> raw LM-head logits [B-1, V]."""
    with torch.no_grad():
        _, taps, _ = ref_target(seq[:-1], torch.zeros(0, *ref_target.kv_row_shape()))
        hidden, _ = drafter(drafter.context(taps), torch.zeros(0, *drafter.kv_row_shape()), seq[-1:])
        return drafter.logits(hidden)


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    hf, _, target_dir = target_pair("untied", tmp_path_factory)
    asst, folder = assistant(tmp_path_factory)
    ref = load_target(target_dir, tuple(TAPS))
    ids = prompt(3 * WINDOW, seed=11)
    out, rounds = transformers_rounds(hf, asst, ids)
    return ref, load_drafter(folder, ref), out, rounds, ids


def test_config_reads_meta_fields_and_takes_the_rest_from_the_target(tmp_path_factory, loop):
    _, folder = assistant(tmp_path_factory)
    ref, drafter = loop[0], loop[1]
    dc = load_drafter_config(folder)
    assert (dc.format, dc.version, dc.block_size, dc.mask_token_id, dc.target_layer_ids) == (META, 1, BLOCK, MASK,
                                                                                           tuple(TAPS))
    assert dc.num_target_layers is None and dc.vocab_size is None  # not in Meta's config: the target's
    assert dc.layer_causal == (False, False) and dc.layer_window == (WINDOW + 1,) * 2  # |q - k| <= W as < W + 1
    assert dc.rope.theta == 500000.0 and (dc.output_multiplier, dc.logit_softcap) == (1.0, 0.0)
    full = drafter.config
    assert (full.num_target_layers, full.vocab_size) == (ref.config.num_layers, ref.config.vocab_size)


def test_tensor_names_are_metas(tmp_path_factory, loop):
    _, folder = assistant(tmp_path_factory)
    shapes = drafter_tensor_shapes(loop[1].config, 64)
    assert "encoder.fc.weight" in shapes and "encoder.output_norm_enc.weight" in shapes and "fc.weight" not in shapes
    check_tensors(folder, shapes)  # exactly the checkpoint's set


def test_drafter_logits_equal_transformers_dflash_loop_per_round(loop):
    """Every round of transformers' loop (contexts past the window: prompt 3x the window): the same raw logits,
    the same candidates; and the loop's output is the target's own greedy continuation."""
    ref, drafter, out, rounds, ids = loop
    assert len(rounds) >= 5 and len(rounds[0][0]) > 2 * WINDOW
    worst = 0.0
    for seq, want in rounds:
        got = drafter_logits(ref, drafter, seq)
        worst = max(worst, (got - want).abs().max().item())
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert worst < TOL, f"max |logit diff| over {len(rounds)} rounds {worst:.2e}"
    with torch.no_grad():  # lossless: the speculative output is greedy's
        logits, _, past = ref(ids, torch.zeros(0, *ref.kv_row_shape()))
        greedy = [int(logits[-1].argmax())]
        while len(greedy) < len(out) - len(ids):
            lg, _, kv = ref(torch.tensor(greedy[-1:]), past)
            past = torch.cat([past, kv])
            greedy.append(int(lg[0].argmax()))
    assert out[len(ids):].tolist() == greedy


@pytest.mark.parametrize("change", ["z-lab's < window", "causal"])
def test_the_window_rule_and_bidirectionality_matter(change, loop):
    """z-lab's exclusive window (|q - k| < W) or a causal reading of the sliding layers (vLLM's rule) gives other
    logits than transformers' on the same rounds."""
    ref, drafter, _, rounds, _ = loop
    c = drafter.config
    c = dataclasses.replace(c, layer_window=(WINDOW,) * 2) if change == "z-lab's < window" else \
        dataclasses.replace(c, layer_causal=(True,) * 2)
    other = Drafter(c, drafter.embed_weight, drafter.head_weight, 64).eval()
    other.load_state_dict(drafter.state_dict())
    worst = max((drafter_logits(ref, other, seq) - want).abs().max().item() for seq, want in rounds)
    assert worst > 100 * TOL, f"{change}: still within {worst:.2e}"


def _saved(tmp_path, **changes):
    raw = json.loads(json.dumps(asst_config().to_dict()))
    raw["architectures"] = ["MuseGlimmerAssistantModel"]
    raw.update(changes)
    for k in [k for k, v in changes.items() if v is ...]:
        del raw[k]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize("change, field", [
    ({"block_size": ...}, "block_size"),
    ({"mask_token_id": ...}, "mask_token_id"),
    ({"target_layer_ids": ...}, "target_layer_ids"),
    ({"target_layer_ids": []}, "target_layer_ids"),
    ({"dflash_config": {"mask_token_id": 3}}, "dflash_config"),
    ({"is_causal": True}, "is_causal"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"layer_types": ["chunked_attention"] * 2}, "layer_types"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_refusals_name_the_field(change, field, tmp_path):
    folder = _saved(tmp_path, **change)
    with pytest.raises(CheckpointError) as e:
        load_drafter_config(folder)
    assert f"{folder / 'config.json'}: {field}: expected" in str(e.value), str(e.value)


@pytest.mark.parametrize("change, field", [({"target_layer_ids": [1, 8]}, "target_layer_ids"),
                                           ({"mask_token_id": 256}, "mask_token_id")])
def test_taps_and_mask_are_checked_against_the_target(change, field, tmp_path, tmp_path_factory):
    _, ref, _ = target_pair("untied", tmp_path_factory)
    dc = load_drafter_config(_saved(tmp_path, **change))
    with pytest.raises(CheckpointError, match=rf"config\.json: {field}: expected .*the target's"):
        for_target(dc, ref.config, tmp_path)
