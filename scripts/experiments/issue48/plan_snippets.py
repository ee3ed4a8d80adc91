# Verified with transformers 5.25.0, torch 2.13 CPU (the /work/main venv): tiny Muse-Glimmer target, tiny gpt-oss
# target, a tiny MuseGlimmerAssistantModel drafter, and transformers' own DFlash loop with per-round accepted counts.
import torch
torch.set_num_threads(1); torch.manual_seed(0)
from transformers import (GenerationConfig, GptOssConfig, GptOssForCausalLM, MuseGlimmerAssistantConfig,
                          MuseGlimmerAssistantModel, MuseGlimmerConfig, MuseGlimmerForConditionalGeneration)
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

# --- Muse-Glimmer (text path of the ConditionalGeneration wrapper; the vision tower must exist, make it tiny)
mg = MuseGlimmerForConditionalGeneration(MuseGlimmerConfig(
    text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, sliding_window=8, max_position_embeddings=512,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                     eos_token_id=1, bos_token_id=2, pad_token_id=0),
    vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
    out_hidden_size=128, projector_hidden_size=64, image_token_id=250, video_token_id=251)).eval()
with torch.no_grad():
    for n, p in mg.named_parameters():          # zero-init (1 + w) norms: give them values; larger head: fewer ties
        if "layernorm" in n: p.normal_(0, 0.1)
    mg.lm_head.weight.mul_(40)
ids = torch.randint(3, 200, (1, 20))            # prompt (20) longer than the window (8)
with torch.no_grad():
    out = mg(input_ids=ids, output_hidden_states=True)
print("muse_glimmer logits", tuple(out.logits.shape), "hidden_states", len(out.hidden_states))

# --- gpt-oss (MoE, sinks, YaRN, alternating sliding / full)
oss = GptOssForCausalLM(GptOssConfig(
    vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
    max_position_embeddings=2048, eos_token_id=1, pad_token_id=0,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 64})).eval()
with torch.no_grad():
    for n, p in oss.named_parameters():
        if "experts" in n and not n.endswith("bias") or "router.weight" in n: p.normal_(0, 0.5)
        if "sinks" in n: p.normal_(0, 1.0)
    print("gpt_oss logits", tuple(oss(input_ids=ids).logits.shape))

# --- Meta's drafter format and transformers' DFlash loop (per-round accepted counts)
asst = MuseGlimmerAssistantModel(MuseGlimmerAssistantConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, sliding_window=4, block_size=4, mask_token_id=255, target_layer_ids=[1, 4],
    max_position_embeddings=512)).eval()
rounds = []
_orig = DFlashTokenCandidateGenerator.update_candidate_strategy
def _log(self, input_ids, scores, num_matches):
    rounds.append(int(num_matches)); return _orig(self, input_ids, scores, num_matches)
DFlashTokenCandidateGenerator.update_candidate_strategy = _log
with torch.no_grad():
    ar = mg.generate(ids, max_new_tokens=40, do_sample=False)
    sp = mg.generate(ids, assistant_model=asst, generation_config=GenerationConfig(
        speculation_type="dflash", max_new_tokens=40, do_sample=False))
print("dflash == greedy:", torch.equal(ar, sp), "| entry 0 is the prefill; accepted per round:", rounds[1:])
