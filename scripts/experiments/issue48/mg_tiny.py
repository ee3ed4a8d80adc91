import torch, json, os
torch.set_num_threads(1); torch.manual_seed(0)
from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration
text = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, sliding_window=8, max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            eos_token_id=1, bos_token_id=2, pad_token_id=0)
vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=14,
              pos_emb_height=4, pos_emb_width=4)
cfg = MuseGlimmerConfig(text_config=text, vision_config=vision, out_hidden_size=128, projector_hidden_size=64,
                        image_token_id=250, video_token_id=251)
tc = cfg.text_config
print("layer_types", tc.layer_types)
print("layer_rope_theta", tc.layer_rope_theta)
print("qk_scale", tc.qk_scale_factor, "mult", tc.output_multiplier, "softcap", tc.final_logit_softcapping, "post_eps", tc.post_norm_eps)
print("tie top", getattr(cfg, "tie_word_embeddings", None), "tie text", tc.tie_word_embeddings)
m = MuseGlimmerForConditionalGeneration(cfg).eval()
# give the zero-init (1+w) norms some non-zero weights so parity tests see them
with torch.no_grad():
    for n, p in m.named_parameters():
        if "layernorm" in n or n.endswith("norm.weight"):
            p.normal_(0, 0.1) if "layers." in n else p.normal_(1, 0.1)
print("lm_head tied:", m.lm_head.weight.data_ptr() == m.model.language_model.embed_tokens.weight.data_ptr())
names = [(k, tuple(v.shape)) for k, v in m.state_dict().items() if "vision" not in k]
for k, s in names[:40]: print(" ", k, s)
print("... total text tensors", len(names))
ids = torch.randint(3, 200, (1, 20))
with torch.no_grad():
    out = m(input_ids=ids, output_hidden_states=True)
print("logits", out.logits.shape, "max |logit|", out.logits.abs().max().item(), "(<= softcap)")
print("n hidden", len(out.hidden_states))
g = m.generate(ids, max_new_tokens=24, do_sample=False)
print("greedy", g[0, 20:].tolist())
m.save_pretrained("/tmp/i48/mg_target")
print(json.dumps(json.load(open("/tmp/i48/mg_target/config.json")), indent=None)[:3000])
