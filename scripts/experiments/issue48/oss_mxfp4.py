import torch, json, os, shutil, numpy as np
torch.set_num_threads(1); torch.manual_seed(0)
from safetensors.torch import load_file, save_file
from transformers import GptOssForCausalLM
FP4 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
def to_mxfp4(w):  # w [E, rows, K] (out x in, as on disk) -> blocks uint8 [E, rows, K/32, 16], scales uint8 [E, rows, K/32]
    E, R, K = w.shape; g = w.reshape(E, R, K // 32, 32)
    amax = np.abs(g).max(-1, keepdims=True)
    e = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), 0).astype(np.int32)   # 2^e * 6 >= amax
    x = g / np.exp2(e)
    code = np.abs(x[..., None] - FP4[None, None, None, None, :]).argmin(-1).astype(np.uint8)        # nearest E2M1
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)                          # low nibble = even element
    return blocks, (e[..., 0] + 127).astype(np.uint8)
src, dst = "/tmp/i48/oss_target", "/tmp/i48/oss_mxfp4"
os.makedirs(dst, exist_ok=True)
sd = load_file(f"{src}/model.safetensors"); out = {}
for k, v in sd.items():
    if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
        w = v.transpose(1, 2).contiguous().numpy() * 25  # on disk: [E, out, in]; scaled up so routing/clamp matter
        b, s = to_mxfp4(w); out[k + "_blocks"] = torch.from_numpy(b); out[k + "_scales"] = torch.from_numpy(s)
    else:
        out[k] = v
save_file(out, f"{dst}/model.safetensors", metadata={"format": "pt"})
cfg = json.load(open(f"{src}/config.json"))
cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
json.dump(cfg, open(f"{dst}/config.json", "w"))
for k in sorted(out):
    if ".layers.0.mlp.experts" in k: print(" ", k, out[k].dtype, tuple(out[k].shape))
m = GptOssForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
W = m.model.layers[0].mlp.experts.gate_up_proj.detach()        # [E, H, 2I]
b, s = out["model.layers.0.mlp.experts.gate_up_proj_blocks"].numpy(), out["model.layers.0.mlp.experts.gate_up_proj_scales"].numpy()
codes = np.stack([b & 15, b >> 4], -1).reshape(*b.shape[:-1], 32)
deq = FP4[codes] * np.exp2(s.astype(np.int32) - 127)[..., None]            # [E, 2I, H/32, 32]
deq = deq.reshape(deq.shape[0], deq.shape[1], -1).transpose(0, 2, 1)       # [E, H, 2I]
print("loaded type", type(m.model.layers[0].mlp.experts).__name__, W.dtype, tuple(W.shape), "max |transformers - own decode|", float(np.abs(W.numpy() - deq).max()))
ids = torch.randint(3, 200, (1, 20))
print("greedy", m.generate(ids, max_new_tokens=16, do_sample=False)[0, 20:].tolist())
