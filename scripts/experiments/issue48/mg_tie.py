import torch
torch.set_num_threads(1)
from transformers import MuseGlimmerConfig, MuseGlimmerForConditionalGeneration
text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8)
vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
for top, txt in ((None, True), (True, False), (False, True)):
    kw = {} if top is None else {"tie_word_embeddings": top}
    try:
        cfg = MuseGlimmerConfig(text_config={**text, "tie_word_embeddings": txt}, vision_config=vision, out_hidden_size=128, projector_hidden_size=64, **kw)
        m = MuseGlimmerForConditionalGeneration(cfg)
        print(f"top={top} text={txt}: tied =", m.lm_head.weight.data_ptr() == m.model.language_model.embed_tokens.weight.data_ptr(), "cfg.tie:", getattr(cfg, "tie_word_embeddings", "n/a"))
    except Exception as e:
        print(f"top={top} text={txt}: error {str(e)[:200]}")
