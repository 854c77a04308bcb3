"""Tiny randomly initialised HF models of each supported family, built in seconds."""

from __future__ import annotations

import torch

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3"]


def tiny_config(family: str, vocab: int = 128, hidden: int = 32, layers: int = 6):
    import transformers as tf

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False)
    if family == "llama":
        return tf.LlamaConfig(**common), tf.LlamaForCausalLM
    if family == "qwen2":
        return tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    if family == "qwen3":
        return tf.Qwen3Config(head_dim=hidden // 4, **common), tf.Qwen3ForCausalLM
    if family == "mistral":
        return tf.MistralConfig(**common), tf.MistralForCausalLM
    if family == "gemma2":
        return tf.Gemma2Config(head_dim=hidden // 4, **common), tf.Gemma2ForCausalLM
    if family in ("gemma3", "gemma3_text"):  # a window of 6 so short test sequences cross it
        return tf.Gemma3TextConfig(head_dim=hidden // 4, sliding_window=6, **common), tf.Gemma3ForCausalLM
    if family == "phi3":
        return tf.Phi3Config(pad_token_id=0, **common), tf.Phi3ForCausalLM
    raise KeyError(family)


def tiny_model(family: str = "llama", seed: int = 0, **kw):
    cfg, cls = tiny_config(family, **kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    model.config.architectures = [cls.__name__]
    return model


def gguf_bytes(arch: str, tensors: list[tuple[str, tuple[int, ...], int, int]] = ()) -> bytes:
    """A small GGUF v3 file: `general.architecture` = arch and tensors (name, ggml dims, ggml type id, data bytes)
    whose data are zeros; a caller cuts the result to make a truncated file."""
    import struct

    def s(x: str) -> bytes:
        return struct.pack("<Q", len(x.encode())) + x.encode()

    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 1) + s("general.architecture") + struct.pack("<I", 8) + s(arch)
    off = 0
    for name, dims, kind, nbytes in tensors:
        out += s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", kind, off)
        off += (nbytes + 31) // 32 * 32
    out += bytes(-len(out) % 32)
    return out + bytes(off)


def tiny_native(model):
    """Native weights for a tiny llama: every decoder matrix rounded in place to a Q4_1 grid (per 32-block
    w = d*q + m, q in 0..15) and packed for eyas's 4-bit kernel, as eyas.native.quant.load_native reads a GGUF: the
    engine then runs the whole decoder stack as one C call (eyas.native.kernels.Q4Stack)."""
    from eyas.native.quant import F32Matrix, NativeWeights, _pack
    from eyas.target.capture import decoder_parts

    def q4_1(lin):
        w = lin.weight.detach().float()
        n, k = w.shape
        blk = w.view(n, k // 32, 32)
        m = blk.amin(-1)
        d = (blk.amax(-1) - m) / 15
        q = torch.where(d[..., None] > 0, (blk - m[..., None]) / d.clamp_min(1e-30)[..., None], 0).round().clamp(0, 15)
        with torch.no_grad():
            lin.weight.copy_((d[..., None] * q + m[..., None]).view(n, k))
        return q.to(torch.int32).view(n, k), d, m

    _, layers, _ = decoder_parts(model)
    out = []
    for layer in layers:
        a, f = layer.self_attn, layer.mlp
        parts = {c: q4_1(lin) for c, lin in (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("o", a.o_proj),
                                             ("g", f.gate_proj), ("u", f.up_proj), ("d", f.down_proj))}
        cat = {f: [torch.cat([parts[c][j] for c in f]) for j in range(3)] for f in ("qkv", "gu")}
        out.append({"qkv": _pack("q8", "Q4_1", *cat["qkv"], None), "o": _pack("q8", "Q4_1", *parts["o"], None),
                    "gu": _pack("q8", "Q4_1", *cat["gu"], None), "d": _pack("q8", "Q4_1", *parts["d"], None)})
    w = model.get_output_embeddings().weight.detach().float().contiguous()
    return NativeWeights(out, F32Matrix(w.shape[0], w.shape[1], w, torch.empty(0), None), {"Q4_1": 7 * len(out)})
