"""The Muse-Glimmer text reference (dflash2.reference.muse_glimmer) against transformers' own
MuseGlimmerForConditionalGeneration on tiny random checkpoints written by save_pretrained and read back through the
family (dflash2.families.muse_glimmer): prefill logits and taps with a prompt 5x the sliding window, greedy
decoding over 64 tokens past the window, the image / video id remap, NoPE layers, tying by the top-level flag; each
of window, NoPE and remap shown to matter (the reference without it disagrees); the config reader's refusals."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import MuseGlimmerConfig as HfConfig, MuseGlimmerForConditionalGeneration  # noqa: E402

from dflash2 import families  # noqa: E402
from dflash2.errors import CheckpointError  # noqa: E402
from dflash2.reference.muse_glimmer import MuseGlimmerTarget, load_target  # noqa: E402

TOL = 1e-4  # fp32 logits (capped at 20) / taps vs transformers
WINDOW, VOCAB, IMAGE, VIDEO = 8, 256, 250, 251


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def hf_config(tied: bool = False, **text) -> HfConfig:
    t = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, max_position_embeddings=512,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, eos_token_id=1, bos_token_id=2,
             pad_token_id=0, **text)
    return HfConfig(text_config=t, vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                      num_attention_heads=2),
                    out_hidden_size=128, projector_hidden_size=64, image_token_id=IMAGE, video_token_id=VIDEO,
                    tie_word_embeddings=tied)


_CACHE: dict = {}


def pair(name: str, tmp_path_factory, tied: bool = False):
    """(transformers model, the reference with every layer tapped, its folder). The zero-initialised (1 + w) norms
    get values and the head is scaled x40: with transformers' init the capped logits are near-flat (ties)."""
    if name not in _CACHE:
        torch.manual_seed(1234)
        hf = MuseGlimmerForConditionalGeneration(hf_config(tied)).eval()
        with torch.no_grad():
            for n, p in hf.named_parameters():
                if "layernorm" in n:
                    p.normal_(0, 0.3)
                elif n.endswith("language_model.norm.weight"):
                    p.normal_(1, 0.1)
            hf.lm_head.weight.mul_(40)
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder)
        fam, c = families.load(folder)
        assert fam.name == "muse_glimmer"
        _CACHE[name] = (hf, load_target(folder, tuple(range(c.num_layers)), config=c), folder)
    return _CACHE[name]


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 240, (n,), generator=torch.Generator().manual_seed(seed))


def run(ref, ids):
    return ref(ids, torch.zeros(0, *ref.kv_row_shape()))


def test_config_is_read_as_transformers_builds_it(tmp_path_factory):
    hf, ref, _ = pair("untied", tmp_path_factory)
    c, t = ref.config, hf.config.text_config
    assert c.layer_types == tuple(t.layer_types) and c.layer_rope == tuple(bool(x) for x in t.layer_rope_theta)
    assert c.layer_types.count("full_attention") == 2
    assert c.layer_rope == (True,) * 3 + (False,) + (True,) * 3 + (False,)
    assert (c.sliding_window, c.image_token_id, c.video_token_id) == (WINDOW, IMAGE, VIDEO)
    assert (c.qk_scale_factor, c.output_multiplier, c.final_logit_softcapping) == \
        (t.qk_scale_factor, t.output_multiplier, t.final_logit_softcapping)


@pytest.mark.parametrize("name", ["untied", "tied"])
def test_prefill_logits_and_taps_match_transformers(name, tmp_path_factory):
    hf, ref, _ = pair(name, tmp_path_factory, tied=name == "tied")
    assert (ref.lm_head is None) == (name == "tied")
    ids = prompt(5 * WINDOW)  # every query past the first window sees a cut window on the sliding layers
    with torch.no_grad():
        out = hf(input_ids=ids[None], output_hidden_states=True)
        logits, taps, kv = run(ref, ids)
    d = (out.logits[0] - logits).abs().max().item()
    assert d < TOL, f"prefill logits differ by {d:.2e}"
    assert out.logits.abs().max().item() > 2  # not flat: the parity compares decisive logits
    H = ref.config.hidden_size
    for i in range(ref.config.num_layers - 1):  # transformers' last hidden_states entry is the final-normed state
        want = out.hidden_states[i + 1][0]
        d = (want - taps[:, i * H:(i + 1) * H]).abs().max().item()
        assert d < TOL * max(1.0, want.abs().max().item()), f"tap {i} differs by {d:.2e}"
    assert kv.shape == (5 * WINDOW, *ref.kv_row_shape())


def test_greedy_64_tokens_past_the_window_equal_generate(tmp_path_factory):
    hf, ref, _ = pair("untied", tmp_path_factory)
    ids = prompt(3 * WINDOW, seed=3)
    with torch.no_grad():
        want = hf.generate(ids[None], do_sample=False, max_new_tokens=64, min_new_tokens=64, pad_token_id=0)
        want = want[0, ids.shape[0]:].tolist()
        logits, _, past = run(ref, ids)
        got = [int(logits[-1].argmax())]
        while len(got) < 64:
            lg, _, kv = ref(torch.tensor(got[-1:]), past)
            past = torch.cat([past, kv])
            got.append(int(lg[0].argmax()))
    assert got == want
    assert len(set(got)) > 8  # not one id repeated


def test_image_and_video_ids_are_embedded_as_id_0(tmp_path_factory):
    """A text prompt holding the placeholder ids: transformers embeds them as id 0, so does the reference."""
    hf, ref, _ = pair("untied", tmp_path_factory)
    ids = prompt(2 * WINDOW, seed=5)
    ids[3], ids[9] = IMAGE, VIDEO
    with torch.no_grad():
        want = hf(input_ids=ids[None]).logits[0]
        got = run(ref, ids)[0]
        zeroed = run(ref, torch.where((ids == IMAGE) | (ids == VIDEO), 0, ids))[0]
    assert (want - got).abs().max().item() < TOL and torch.equal(got, zeroed)


@pytest.mark.parametrize("change", ["no window", "rotary everywhere", "no remap"])
def test_each_muse_glimmer_part_matters(change, tmp_path_factory):
    """The parity above is not blind to the window, the NoPE layers or the remap: the reference without one of
    them disagrees with transformers on the same prompt."""
    hf, ref, _ = pair("untied", tmp_path_factory)
    c = ref.config
    c = {"no window": dataclasses.replace(c, layer_types=("full_attention",) * c.num_layers),
         "rotary everywhere": dataclasses.replace(c, layer_rope=(True,) * c.num_layers),
         "no remap": dataclasses.replace(c, image_token_id=None, video_token_id=None)}[change]
    other = MuseGlimmerTarget(c).eval()
    other.load_state_dict(ref.state_dict())
    ids = prompt(3 * WINDOW, seed=7)
    ids[5] = IMAGE
    with torch.no_grad():
        want = hf(input_ids=ids[None]).logits[0]
        d = (want - run(other, ids)[0]).abs().max().item()
    assert d > 100 * TOL, f"{change}: still within {d:.2e}"


def _raw(**text_changes) -> dict:
    raw = json.loads(json.dumps(hf_config().to_dict()))
    raw["architectures"] = ["MuseGlimmerForConditionalGeneration"]
    raw["text_config"].update(text_changes)
    return raw


@pytest.mark.parametrize("change, field", [
    ({"layer_rope_theta": [10000.0] * 7 + [5000.0]}, "text_config.layer_rope_theta[7]"),
    ({"layer_rope_theta": [0] * 3}, "text_config.layer_rope_theta"),
    ({"layer_types": ["chunked_attention"] * 8}, "text_config.layer_types"),
    ({"hidden_activation": "gelu_pytorch_tanh"}, "text_config.hidden_activation"),
    ({"final_logit_softcapping": None}, "text_config.final_logit_softcapping"),
    ({"sliding_window": 0}, "text_config.sliding_window"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "text_config.rope_parameters.rope_type"),
    ({"num_key_value_heads": 3}, "text_config.num_key_value_heads"),
    ({"output_multiplier": 0}, "text_config.output_multiplier"),
])
def test_config_reader_names_file_field_expected_found(change, field, tmp_path):
    path = tmp_path / "config.json"
    with pytest.raises(CheckpointError) as e:
        families.by_name("muse_glimmer").read_config(path, _raw(**change), "MuseGlimmerForConditionalGeneration")
    assert f"{path}: {field}: expected" in str(e.value), str(e.value)


def test_a_config_without_text_config_is_refused(tmp_path):
    raw = _raw()
    del raw["text_config"]
    with pytest.raises(CheckpointError, match="text_config: expected an object"):
        families.by_name("muse_glimmer").read_config(tmp_path / "config.json", raw, raw["architectures"][0])


def test_the_30b_defaults():
    """A config.json with only the architecture and an empty text_config reads as transformers' defaults: 52 layers,
    39 sliding (window 2048) and 13 full NoPE layers, the last one full."""
    from pathlib import Path

    c = families.by_name("muse_glimmer").read_config(Path("/absent/config.json"), {
        "architectures": ["MuseGlimmerForConditionalGeneration"], "text_config": {}}, "x")
    assert c.num_layers == 52 and c.layer_types.count("sliding_attention") == 39
    assert c.layer_types[-1] == "full_attention"
    assert c.layer_rope == tuple(t == "sliding_attention" for t in c.layer_types)
    assert (c.vocab_size, c.hidden_size, c.num_heads, c.num_kv_heads, c.sliding_window) == (202048, 6656, 32, 2, 2048)
    assert (c.image_token_id, c.video_token_id, c.tie_word_embeddings) == (200092, 200091, False)
