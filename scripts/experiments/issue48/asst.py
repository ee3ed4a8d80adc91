import torch, json
torch.set_num_threads(1); torch.manual_seed(0)
from transformers import MuseGlimmerForConditionalGeneration, MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel, GenerationConfig
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator
tgt = MuseGlimmerForConditionalGeneration.from_pretrained("/tmp/i48/mg_target").eval()
with torch.no_grad():   # larger logits: fewer near-ties in tiny random models
    tgt.lm_head.weight.mul_(40)
acfg = MuseGlimmerAssistantConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, sliding_window=4, block_size=4, mask_token_id=255,
                                  target_layer_ids=[1, 4], max_position_embeddings=512, bos_token_id=2, eos_token_id=1, pad_token_id=0)
print("assistant layer_types", acfg.layer_types, "rope", acfg.rope_parameters)
asst = MuseGlimmerAssistantModel(acfg).eval()
asst.save_pretrained("/tmp/i48/mg_assistant")
cj = json.load(open("/tmp/i48/mg_assistant/config.json")); print("assistant config.json:", cj)
import struct; f = open("/tmp/i48/mg_assistant/model.safetensors", "rb"); n = struct.unpack("<Q", f.read(8))[0]; h = json.loads(f.read(n))
print("assistant tensors:", sorted((k, tuple(v["shape"])) for k, v in h.items() if k != "__metadata__"))
# per-round log: accepted count per round
rounds = []
orig = DFlashTokenCandidateGenerator.update_candidate_strategy
def log(self, input_ids, scores, num_matches):
    rounds.append(int(num_matches)); return orig(self, input_ids, scores, num_matches)
DFlashTokenCandidateGenerator.update_candidate_strategy = log
ids = torch.randint(3, 200, (1, 13))
with torch.no_grad():
    ar = tgt.generate(ids, max_new_tokens=40, do_sample=False)
    sp = tgt.generate(ids, assistant_model=asst, speculation_type="dflash", max_new_tokens=40, do_sample=False)
print("identical to greedy:", torch.equal(ar, sp), "rounds (accepted drafts per round):", rounds)
# same via a GenerationConfig
gc = GenerationConfig(speculation_type="dflash", max_new_tokens=40, do_sample=False)
with torch.no_grad():
    sp2 = tgt.generate(ids, assistant_model=asst, generation_config=gc)
print("GenerationConfig path identical:", torch.equal(ar, sp2))
