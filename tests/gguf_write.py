"""Write a tiny HF model to a GGUF the way llama.cpp's convert_hf_to_gguf.py does, with gguf-py's GGUFWriter:
its tensor names (gguf-py's TensorNameMap), its Q/K row permutation for the llama architecture, Gemma's +1 on
norm weights, its metadata keys, and Llama 3 RoPE scaling as the `rope_freqs.weight` divisors only."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: HF's half-rotation rows -> GGML's interleaved rows."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _vocab(writer, vocab: int, arch: str) -> None:
    """A byte-level BPE vocabulary: single characters, no merges (enough for transformers' GGUF tokenizer)."""
    toks = ["<unk>", "<s>", "</s>"] + [chr(0x21 + i) if 0x21 + i < 0x7F else f"<t{i}>" for i in range(vocab - 3)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(toks)
    writer.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    writer.add_token_scores([0.0] * vocab)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _tensor_type(name: str, data: np.ndarray, qtype: str):
    import gguf

    kind = {"F32": gguf.GGMLQuantizationType.F32, "F16": gguf.GGMLQuantizationType.F16,
            "Q8_0": gguf.GGMLQuantizationType.Q8_0, "Q4_0": gguf.GGMLQuantizationType.Q4_0}[qtype]
    if data.ndim < 2 or name.endswith(".bias") or "norm" in name:  # llama.cpp keeps 1-D tensors in F32
        return data.astype(np.float32), None
    if kind == gguf.GGMLQuantizationType.F32:
        return data.astype(np.float32), None
    if kind == gguf.GGMLQuantizationType.F16:
        return data.astype(np.float16), None
    return gguf.quants.quantize(data.astype(np.float32), kind), kind


def write_gguf(model: torch.nn.Module, path: Path, qtype: str = "F32", rope_freqs: torch.Tensor | None = None,
               name: str = "tiny", extra: dict[str, str | float | int] | None = None) -> Path:
    """`model` (a HF *ForCausalLM, fp32) -> a GGUF at `path`; matrices in `qtype` (F32, F16, Q8_0, Q4_0);
    `rope_freqs`: the [head_dim/2] divisors llama.cpp writes for Llama 3 RoPE scaling (llama architecture);
    `extra`: more metadata keys (str, float32 or uint32 values)."""
    import gguf

    cfg = model.config
    family = cfg.model_type
    arch = ARCH[family]
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rp = cfg.rope_parameters
    rp = rp.get("full_attention", rp)
    w.add_rope_freq_base(rp["rope_theta"])
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if arch in ("qwen3", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if rp.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rp["factor"])
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
    for k, v in (extra or {}).items():
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_uint32(k, v)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    _vocab(w, cfg.vocab_size, arch)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        t = t.detach().float()
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            t = _permute(t, heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            t = _permute(t, kv)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            t = t + 1  # llama.cpp's Gemma3Model.norm_shift: its RMSNorm multiplies by w, Gemma's by (1 + w)
        gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise KeyError(hf_name)
        data, kind = _tensor_type(gname, t.numpy(), qtype)
        if kind is None:
            w.add_tensor(gname, data)
        else:
            w.add_tensor(gname, data, raw_dtype=kind)  # uint8 blocks: gguf-py derives the shape
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
