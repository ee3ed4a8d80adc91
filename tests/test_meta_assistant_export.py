"""Per-round parity with transformers' own DFlash loop through dflash2's exported graphs: a tiny
MuseGlimmerAssistantModel (Meta's format, inclusive window 4, block 4) trained briefly on a tiny Muse-Glimmer target's
greedy text so that every accepted count 0..3 occurs, exported with the target by dflash2-export (fp32, standard
ops), run by the runtime with 3 drafts a round: the same ids and the same accepted count in every round as
`generate(..., assistant_model=..., speculation_type="dflash")`, the prompt and the contexts longer than both
windows."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402
from transformers import (MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel,  # noqa: E402
                          MuseGlimmerForConditionalGeneration)
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator  # noqa: E402

from dflash2 import tiny  # noqa: E402
from dflash2.drafter_formats import ALIASES, META  # noqa: E402
from dflash2.reference.load import load_drafter  # noqa: E402
from dflash2.reference.muse_glimmer import load_target  # noqa: E402

B, TAPS, MASK, WINDOW, NEW = 4, [1, 2], 3, 4, 48  # MASK: the tiny tokenizer's <|mask|>


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(transformers' target, its trained assistant, the pair's folders, the prompt). The assistant is trained with
    dflash2's own Drafter on the Meta-format checkpoint (its loss: the target's next B-1 greedy ids after a random
    anchor, 250 AdamW steps on 2 sequences), the weights written back under Meta's names: partial acceptance."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("meta_pair")
    target = tiny.make_target(root / "target", family="muse_glimmer")
    hf = MuseGlimmerForConditionalGeneration.from_pretrained(target, dtype=torch.float32).eval()
    torch.manual_seed(1)
    MuseGlimmerAssistantModel(MuseGlimmerAssistantConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, sliding_window=WINDOW, block_size=B, mask_token_id=MASK, target_layer_ids=TAPS,
        max_position_embeddings=512)).save_pretrained(root / "drafter")
    ref = load_target(target, tuple(TAPS))
    d = load_drafter(root / "drafter", ref).train()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        seqs = [hf.generate(torch.randint(4, 380, (1, 12), generator=g), max_new_tokens=60, min_new_tokens=60,
                            do_sample=False, eos_token_id=None, pad_token_id=0)[0] for _ in range(2)]
        taps = [ref(s, torch.zeros(0, *ref.kv_row_shape()))[1] for s in seqs]
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-3)
    for step in range(250):
        s, t = seqs[step % 2], taps[step % 2]
        a = int(torch.randint(12, len(s) - B, (), generator=g))  # the anchor's position: context rows 0..a-1
        hidden, _ = d(d.context(t[:a]), torch.zeros(0, *d.kv_row_shape()), s[a:a + 1])
        loss = torch.nn.functional.cross_entropy(d.logits(hidden), s[a + 1:a + B])
        opt.zero_grad()
        loss.backward()
        opt.step()
    names = ALIASES[META]
    save_file({names.get(k, k): v.detach().contiguous() for k, v in d.state_dict().items()},
              str(root / "drafter" / "model.safetensors"), metadata={"format": "pt"})
    asst = MuseGlimmerAssistantModel.from_pretrained(root / "drafter").eval()
    return hf, asst, root, seqs[0][:12]


def transformers_loop(hf, asst, prompt):
    """transformers' DFlash loop: (ids after the prompt, the accepted count of every drafting round)."""
    counts = []
    orig = DFlashTokenCandidateGenerator.update_candidate_strategy

    def log(self, input_ids, scores, num_matches):
        counts.append(int(num_matches))
        return orig(self, input_ids, scores, num_matches)
    DFlashTokenCandidateGenerator.update_candidate_strategy = log
    try:
        with torch.no_grad():
            out = hf.generate(prompt[None], assistant_model=asst, speculation_type="dflash", max_new_tokens=NEW,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
    finally:
        DFlashTokenCandidateGenerator.update_candidate_strategy = orig
    return out[0, len(prompt):].tolist(), counts[1:]  # counts[0]: the prefill, no candidates


def exported(root, name: str = "out", window_kv: bool = True):
    """dflash2-export of the pair into root/name, once per module: the windowed target (its sliding layers on the
    window buffer, the default), or with window_kv=False every layer on the max_seq_len-row KV."""
    from dflash2 import manifest as mf
    from dflash2.export.api import export

    if not (root / name / "manifest.json").exists():
        export(root / "drafter", root / "target", root / name, max_seq_len=160, quiet=True, window_kv=window_kv)
    return mf.load(root / name, mf.ExportManifest, check_files=False)


def test_exported_pair_matches_transformers_dflash_loop_round_by_round(trained):
    from dflash2.runtime.api import Runtime

    hf, asst, root, prompt = trained
    want_ids, want_counts = transformers_loop(hf, asst, prompt)
    with torch.no_grad():
        greedy = hf.generate(prompt[None], max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(prompt):].tolist()
    assert want_ids == greedy and set(want_counts) == {0, 1, 2, 3}  # lossless, and acceptance not trivial

    m = exported(root)
    assert all(v.ok for v in m.validation.values()), m.validation
    assert m.drafter_config["format"] == META and list(m.drafter_config["layer_window"]) == [WINDOW + 1] * 2
    assert m.graphs["target"].signature.window is not None  # the default: the window buffer
    # Meta's drafter slides on every layer (inclusive window 4: q - k < 5): its context KV on the window buffer too
    assert m.graphs["drafter"].signature.window.keep == WINDOW and m.graphs["drafter"].signature.window.layers == [0, 1]
    rt = Runtime(root / "out")
    rt.manifest.eos_token_ids = []
    gen = rt.generate(prompt.tolist(), NEW, draft_len=B - 1)
    assert gen.ids == greedy and rt.session.window.high <= rt.session.window.capacity
    assert rt.session.drafter_kv.high <= rt.session.drafter_kv.capacity
    ours = list(gen.stats.accepted)
    ours[-1] = min(ours[-1], gen.stats.emitted[-1] - 1)  # transformers recounts the last round after the length cut
    assert ours == want_counts and set(gen.stats.verified) == {B - 1}


def test_the_parity_holds_with_every_layer_unbounded_too(trained):
    """The same pair exported with --window-kv off (every layer on the max_seq_len-row KV, the sliding ones masked):
    the same ids and accepted counts as transformers' loop in every round."""
    from dflash2.runtime.api import Runtime

    hf, asst, root, prompt = trained
    want_ids, want_counts = transformers_loop(hf, asst, prompt)
    m = exported(root, "full", window_kv=False)
    assert m.graphs["target"].signature.window is None and all(v.ok for v in m.validation.values())
    assert m.graphs["drafter"].signature.window is None  # every context row kept
    rt = Runtime(root / "full")
    rt.manifest.eos_token_ids = []
    gen = rt.generate(prompt.tolist(), NEW, draft_len=B - 1)
    assert gen.ids == want_ids
    ours = list(gen.stats.accepted)
    ours[-1] = min(ours[-1], gen.stats.emitted[-1] - 1)  # transformers recounts the last round after the length cut
    assert ours == want_counts


def test_the_window_buffer_compacts_and_keeps_the_parity(trained, monkeypatch):
    """The exported windowed target and drafter with ALIGN 1 (runtime/window.py: a compaction every few rounds at
    this size, where ALIGN 64's buffer would hold the whole run): the same ids and accepted counts as transformers'
    loop in every round past both windows (prompt 12 > 8), both buffers compacted in between."""
    from dflash2.runtime import window
    from dflash2.manifest import window as window_rule
    from dflash2.speculative import generate
    from tests.window_kv_pair import windowed_session

    monkeypatch.setattr(window, "ALIGN", 1)

    monkeypatch.setattr(window_rule, "ALIGN", 1)  # the capacity rule reads it there
    hf, asst, root, prompt = trained
    want_ids, want_counts = transformers_loop(hf, asst, prompt)
    exported(root)
    s = windowed_session(root / "out")
    s.manifest.eos_token_ids = []
    gen = generate(s, prompt.tolist(), NEW, draft_len=B - 1)
    assert gen.ids == want_ids and s.window.compactions > 2 and s.window.high <= s.window.capacity
    d = s.drafter_kv  # the drafter's window buffer (keep 4 + 2 x 5 rows) compacted too, the drafts the same
    assert d.compactions > 2 and d.high <= d.capacity < len(prompt) + NEW
    ours = list(gen.stats.accepted)
    ours[-1] = min(ours[-1], gen.stats.emitted[-1] - 1)  # transformers recounts the last round after the length cut
    assert ours == want_counts


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_exports_with_the_assistant(trained, dtype, tmp_path):
    """Meta's assistant as the drafter of an fp16 / bf16 export (its inclusive window in that dtype):
    tests.exports.low_precision_checks: validated (bf16 on its emulation); fp16 row check bitwise and speculative
    decoding = the fp16 target's own greedy ids at every accepted count 0..3 (planned drafts) and with the trained
    assistant itself, past both windows."""
    from tests.exports import low_precision_checks

    _, _, root, prompt = trained
    low_precision_checks((root / "drafter", root / "target"), tmp_path / "out", dtype, prompt.tolist(), NEW,
                         list(range(B)) + [2, 0])
