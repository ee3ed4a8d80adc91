import torch, json, struct, math
torch.set_num_threads(1); torch.manual_seed(0)
from transformers import GptOssConfig, GptOssForCausalLM
cfg = GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                   max_position_embeddings=4096, eos_token_id=1, pad_token_id=0,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})
print("layer_types", cfg.layer_types, "attn impl default:")
m = GptOssForCausalLM(cfg).eval()
print(m.config._attn_implementation, "experts impl:", getattr(m.config, "_experts_implementation", None))
with torch.no_grad():
    for n, p in m.named_parameters():
        if n.endswith("_bias") or n.endswith(".bias"): p.normal_(0, 0.05)
        if "sinks" in n: p.normal_(0, 1.0)
m.save_pretrained("/tmp/i48/oss_target")
f = open("/tmp/i48/oss_target/model.safetensors", "rb"); n = struct.unpack("<Q", f.read(8))[0]; h = json.loads(f.read(n))
for k in sorted(h):
    if k == "__metadata__" or (".layers." in k and ".layers.0." not in k): continue
    print(" ", k, h[k]["dtype"], h[k]["shape"])
print(json.load(open("/tmp/i48/oss_target/config.json")))
ids = torch.randint(3, 200, (1, 20))
g = m.generate(ids, max_new_tokens=24, do_sample=False)
print("greedy", g[0, 20:].tolist())
