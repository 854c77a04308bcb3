"""Tiny randomly initialised MoE and MLA targets (Qwen3-MoE, gpt-oss, DeepSeek-V3) saved as HF folders with the
bundled target's tokenizer, for the pipeline tests: what users draft for, at a size that runs in seconds."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

VOCAB = 49152  # the bundled tokenizer's
SHARPEN = 8.0  # random init gives near-uniform next tokens; a sharper head gives replies a draft can learn
REPLY_TOKENS = 64  # the head's rows kept: greedy replies use these tokens only, so a small run learns them


def moe_config(family: str):
    import transformers as tf

    # head_dim 64: vLLM's CPU attention refuses 16 ("Unsupported CPU attention configuration: head_dim=16")
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=2048, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(head_dim=64, intermediate_size=128, moe_intermediate_size=64, num_experts=8,
                                 num_experts_per_tok=2, norm_topk_prob=True, **common), tf.Qwen3MoeForCausalLM
    if family == "gpt_oss":
        return tf.GptOssConfig(head_dim=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                               sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2,
                               **common), tf.GptOssForCausalLM
    if family == "deepseek_v3":
        common["num_key_value_heads"] = common["num_attention_heads"]  # MLA: HF's attention expects one per head
        # kv_lora_rank 512 and a 64-wide rope part: the only MLA shape vLLM's CPU backend runs (head dim 576);
        # noaux_tc routing, so the checkpoint carries e_score_correction_bias as vLLM expects
        return tf.DeepseekV3Config(intermediate_size=128, moe_intermediate_size=64, n_routed_experts=8,
                                   n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                                   first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=512, qk_nope_head_dim=16,
                                   qk_rope_head_dim=64, v_head_dim=16, topk_method="noaux_tc",
                                   routed_scaling_factor=2.5,
                                   **common), tf.DeepseekV3ForCausalLM
    raise KeyError(family)


def save_moe_target(family: str, folder: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    cfg, cls = moe_config(family)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # a random model's next token is mostly a function of the current one (the layers add
        # little at init), so with REPLY_TOKENS head rows its greedy replies are learnable from a few conversations
        w = model.get_output_embeddings().weight
        g = torch.Generator().manual_seed(seed)
        keep = torch.zeros(VOCAB, dtype=torch.bool)
        keep[torch.randperm(VOCAB - 100, generator=g)[:REPLY_TOKENS] + 100] = True
        w[~keep] = 0.0
        w[keep] *= SHARPEN
    model.config.architectures = [cls.__name__]
    model.generation_config.eos_token_id = 2
    model.save_pretrained(folder)
    for f in Path(tokenizer_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")) or f.suffix == ".jinja":
            shutil.copy(f, folder / f.name)
    return folder
