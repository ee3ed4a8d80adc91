import torch
torch.set_num_threads(1); torch.manual_seed(0)
from transformers import GptOssForCausalLM, MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator
tgt = GptOssForCausalLM.from_pretrained("/tmp/i48/oss_mxfp4", dtype=torch.float32).eval()
a = MuseGlimmerAssistantModel(MuseGlimmerAssistantConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=6, block_size=5, mask_token_id=255, target_layer_ids=[1, 2])).eval()
rounds = []; orig = DFlashTokenCandidateGenerator.update_candidate_strategy
DFlashTokenCandidateGenerator.update_candidate_strategy = lambda self, i, s, n: (rounds.append(int(n)), orig(self, i, s, n))[1]
ids = torch.randint(3, 200, (1, 21))   # prompt longer than the sliding window 8
with torch.no_grad():
    ar = tgt.generate(ids, max_new_tokens=30, do_sample=False)
    sp = tgt.generate(ids, assistant_model=a, speculation_type="dflash", max_new_tokens=30, do_sample=False)
print("gpt-oss (MXFP4 checkpoint, dequantized) + Meta-format assistant: dflash == greedy:", torch.equal(ar, sp), "rounds:", len(rounds))
