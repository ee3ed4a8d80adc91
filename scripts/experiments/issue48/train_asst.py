# Brief DFlash training of a tiny MuseGlimmerAssistantModel on the tiny target's own greedy text (1 CPU thread).
import torch, time
exec(open(__file__.rsplit("/", 1)[0] + "/plan_snippets.py").read().split("# --- gpt-oss")[0])        # the tiny Muse-Glimmer target `mg`
from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel, GenerationConfig
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator
torch.manual_seed(1)
B, taps = 4, [1, 4]
asst = MuseGlimmerAssistantModel(MuseGlimmerAssistantConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16, block_size=B, mask_token_id=255,
        target_layer_ids=taps, max_position_embeddings=512))
emb, head = mg.model.language_model.embed_tokens.weight.detach(), mg.lm_head.weight.detach()
with torch.no_grad():
    seqs = [mg.generate(torch.randint(3, 200, (1, 12)), max_new_tokens=60, do_sample=False)[0] for _ in range(16)]
    feats = [torch.cat([h[0] for i, h in enumerate(mg(input_ids=s[None], output_hidden_states=True).hidden_states) if i - 1 in taps], -1) for s in seqs]
opt = torch.optim.AdamW(asst.parameters(), lr=1e-3); t0 = time.time()
for step in range(3000):
    j = step % 2; s, f = seqs[j], feats[j]
    a = int(torch.randint(12, len(s) - B, ()))                 # anchor position
    noise = emb[torch.cat([s[a:a + 1], torch.full((B - 1,), 255)])][None]
    h = asst(noise_embeds=noise, context_hidden_states=f[None, :a], position_ids=torch.arange(a + B)[None]).last_hidden_state
    loss = torch.nn.functional.cross_entropy((h[0, 1:] @ head.T), s[a + 1:a + B])
    opt.zero_grad(); loss.backward(); opt.step()
    if step % 300 == 0: print(step, round(loss.item(), 2))
print(f"trained 3000 steps in {time.time() - t0:.0f}s, last loss {loss.item():.2f}")
asst.eval(); rounds = []; _o = DFlashTokenCandidateGenerator.update_candidate_strategy
DFlashTokenCandidateGenerator.update_candidate_strategy = lambda self, i, sc, n: (rounds.append(int(n)), _o(self, i, sc, n))[1]
p = seqs[0][None, :12]   # a prompt it was trained on: acceptance is not trivial
with torch.no_grad():
    ar = mg.generate(p, max_new_tokens=48, do_sample=False)
    sp = mg.generate(p, assistant_model=asst, generation_config=GenerationConfig(speculation_type="dflash", max_new_tokens=48, do_sample=False))
print("dflash == greedy:", torch.equal(ar, sp), "accepted per round:", rounds[1:])
