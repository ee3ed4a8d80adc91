import torch
torch.set_num_threads(1); torch.manual_seed(0)
from transformers import MuseGlimmerForConditionalGeneration, MuseGlimmerAssistantModel
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator
tgt = MuseGlimmerForConditionalGeneration.from_pretrained("/tmp/i48/mg_target").eval()
with torch.no_grad(): tgt.lm_head.weight.mul_(40)
asst = MuseGlimmerAssistantModel.from_pretrained("/tmp/i48/mg_assistant").eval()
with torch.no_grad():   # non-trivial norms
    for n, p in asst.named_parameters():
        if "norm" in n: p.normal_(1, 0.2)
ac = asst.config; W, B = ac.sliding_window, ac.block_size
rec = []
orig = DFlashTokenCandidateGenerator.get_candidates
def spy(self, input_ids, **kw):
    cid, cl = orig(self, input_ids, **kw)
    if cl is not None: rec.append((input_ids.clone(), cid[:, input_ids.shape[1]:].clone(), cl.clone()))
    return cid, cl
DFlashTokenCandidateGenerator.get_candidates = spy
for attn in ("eager", "sdpa"):
    asst.config._attn_implementation = attn
    rec.clear()
    ids = torch.randint(3, 200, (1, 13))
    with torch.no_grad():
        tgt.generate(ids, assistant_model=asst, speculation_type="dflash", max_new_tokens=30, do_sample=False)
    sd = {k: v for k, v in asst.state_dict().items()}
    def rms(x, w, eps=ac.rms_norm_eps): return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    def rope(x, pos, hd=ac.head_dim):
        inv = 1.0 / (ac.rope_parameters["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float) / hd))
        f = pos[:, None].float() * inv; e = torch.cat([f, f], -1)
        return x * e.cos()[:, None] + torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1) * e.sin()[:, None]
    def draft(seq, rule):
        n = seq.shape[0]
        with torch.no_grad():
            hs = tgt(input_ids=seq[None], output_hidden_states=True).hidden_states
        taps = torch.cat([hs[i + 1][0, :n - 1] for i in ac.target_layer_ids], -1)        # context: every token before the anchor
        ctx = rms(taps @ sd["encoder.fc.weight"].T, sd["encoder.output_norm_enc.weight"])
        emb = tgt.model.language_model.embed_tokens.weight                                 # raw rows (no embed_norm)
        h = emb[torch.cat([seq[-1:], torch.full((B - 1,), ac.mask_token_id)])]
        qpos, cpos = torch.arange(n - 1, n - 1 + B), torch.arange(n - 1)
        kpos = torch.cat([cpos, qpos]); nh, kv, hd = ac.num_attention_heads, ac.num_key_value_heads, ac.head_dim
        d = (qpos[:, None] - kpos[None, :]).abs()
        vis = d <= W if rule == "<=" else d < W
        for i in range(ac.num_hidden_layers):
            p = f"layers.{i}."
            u = rms(h, sd[p + "input_layernorm.weight"])
            kvin = torch.cat([ctx, u])
            q = rope(rms((u @ sd[p + "self_attn.q_proj.weight"].T).view(B, nh, hd), sd[p + "self_attn.q_norm.weight"]), qpos)
            k = rope(rms((kvin @ sd[p + "self_attn.k_proj.weight"].T).view(-1, kv, hd), sd[p + "self_attn.k_norm.weight"]), kpos)
            v = (kvin @ sd[p + "self_attn.v_proj.weight"].T).view(-1, kv, hd)
            k, v = k.repeat_interleave(nh // kv, 1), v.repeat_interleave(nh // kv, 1)
            s = (torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5).masked_fill(~vis, float("-inf")).softmax(-1)
            h = h + torch.einsum("hqk,khd->qhd", s, v).reshape(B, -1) @ sd[p + "self_attn.o_proj.weight"].T
            u = rms(h, sd[p + "post_attention_layernorm.weight"])
            h = h + (torch.nn.functional.silu(u @ sd[p + "mlp.gate_proj.weight"].T) * (u @ sd[p + "mlp.up_proj.weight"].T)) @ sd[p + "mlp.down_proj.weight"].T
        return rms(h, sd["norm.weight"])[1:] @ tgt.lm_head.weight.T                           # raw LM head: no multiplier, no softcap
    for rule in ("<=", "<"):
        errs = [float((draft(seq[0], rule) - cl[0]).abs().max()) for seq, cid, cl in rec]
        print(f"{attn}: rule |q-k| {rule} W: rounds {len(rec)}, max |logit diff| over rounds {max(errs):.2e} (first rounds {['%.1e' % e for e in errs[:4]]})")
