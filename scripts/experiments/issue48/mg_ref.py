import torch, math
torch.set_num_threads(1); torch.manual_seed(0)
from transformers import MuseGlimmerForConditionalGeneration
m = MuseGlimmerForConditionalGeneration.from_pretrained("/tmp/i48/mg_target").eval()
sd = m.state_dict()
print(sorted({".".join(k.split(".")[:2]) for k in sd if not k.startswith("model.language_model")}))
print([k for k in sd if k.startswith("model.language_model") and "layers." not in k], [k for k in sd if k.startswith("lm_head")])
c = m.config.text_config
P = "model.language_model."
def rms(x, eps): return x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)
def crms(x, w, eps): return rms(x, eps) * (1 + w)
def rope(x, pos, theta, hd):
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
    f = pos[:, None].float() * inv; e = torch.cat([f, f], -1); cos, sin = e.cos(), e.sin()
    rot = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * cos[:, None] + rot * sin[:, None]
def ref(ids, taps=()):
    n = ids.shape[0]; hd, nh, kv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    h = rms(sd[P + "embed_tokens.weight"][ids], c.rms_norm_eps)   # weightless embedding norm
    pos = torch.arange(n); out_taps = []
    for i in range(c.num_hidden_layers):
        p = f"{P}layers.{i}."
        u = crms(h, sd[p + "input_layernorm.weight"], c.rms_norm_eps)
        q = (u @ sd[p + "self_attn.q_proj.weight"].T).view(n, nh, hd)
        k = (u @ sd[p + "self_attn.k_proj.weight"].T).view(n, kv, hd)
        v = (u @ sd[p + "self_attn.v_proj.weight"].T).view(n, kv, hd)
        q = rms(q, c.rms_norm_eps) * c.qk_scale_factor; k = rms(k, c.rms_norm_eps)
        if c.layer_rope_theta[i]:
            q, k = rope(q, pos, c.rope_parameters["rope_theta"], hd), rope(k, pos, c.rope_parameters["rope_theta"], hd)
        k = k.repeat_interleave(nh // kv, 1); v = v.repeat_interleave(nh // kv, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
        d = pos[:, None] - pos[None, :]
        ok = d >= 0
        if c.layer_types[i] == "sliding_attention": ok &= d < c.sliding_window
        s = s.masked_fill(~ok, float("-inf")).softmax(-1)
        a = torch.einsum("hqk,khd->qhd", s, v).reshape(n, nh * hd)
        a = a * torch.sigmoid(u @ sd[p + "self_attn.gate_proj.weight"].T)
        a = a @ sd[p + "self_attn.o_proj.weight"].T
        h = h + crms(a, sd[p + "post_attention_layernorm.weight"], c.post_norm_eps)
        u = crms(h, sd[p + "pre_feedforward_layernorm.weight"], c.rms_norm_eps)
        mlp = (torch.nn.functional.silu(u @ sd[p + "mlp.gate_proj.weight"].T) * (u @ sd[p + "mlp.up_proj.weight"].T)) @ sd[p + "mlp.down_proj.weight"].T
        h = h + crms(mlp, sd[p + "post_feedforward_layernorm.weight"], c.post_norm_eps)
        out_taps.append(h)
    y = rms(h, c.rms_norm_eps) * sd[P + "norm.weight"]        # final norm: plain w (not 1 + w)
    logits = y @ sd["lm_head.weight"].T
    T = c.final_logit_softcapping
    return torch.tanh(logits * c.output_multiplier / T) * T, out_taps, y
ids = torch.randint(3, 200, (40,))
with torch.no_grad():
    hf = m(input_ids=ids[None], output_hidden_states=True)
    lg, taps, y = ref(ids)
print("max |logit diff|", (hf.logits[0] - lg).abs().max().item(), "scale", lg.abs().max().item())
print("tap diff layer 2", (hf.hidden_states[3][0] - taps[2]).abs().max().item())
print("hidden_states[-1] == normed final?", (hf.hidden_states[-1][0] - y).abs().max().item(), " raw last layer?", (hf.hidden_states[-1][0] - taps[-1]).abs().max().item())
