"""The evidence behind `--weights auto` (eyas/native/auto.py): native vs fp32 weights under each instruction-set
variant of the kernels this CPU runs.

For each variant (kernels.select_isa, in one process), plain greedy decoding of the bundled SmolLM2-135M Q4_1 GGUF
with --weights native and with --weights fp32, alternated ROUNDS times (this machine's speed drifts between
minutes; alternating keeps the ratio within one stretch), and auto.probe's matvec. Prints one line per variant:
median decode tok/s of each, their ratio, and the probe's times.

    python benchmarks/native_auto.py [--tokens 64] [--rounds 3] [--threads N]

On a shared machine, --threads 1 keeps the kernels' OpenMP barriers from waiting on threads the OS has parked.
"""

from __future__ import annotations

import argparse
import platform
import statistics

import torch

from eyas.engine.decode import Engine
from eyas.engine.params import SamplingParams, SpecParams
from eyas.engine.prompt import chat_input_ids
from eyas.native import auto, kernels
from eyas.option import DEFAULT_TARGET
from eyas.target.load import load_target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch and kernel threads (0: torch's default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    target = load_target(DEFAULT_TARGET)
    engines = {w: Engine(target, None, SpecParams(method="plain", weights=w)) for w in ("native", "fp32")}
    assert engines["native"].weights == "native", engines["native"].weights_note
    ids = chat_input_ids(target.tokenizer, [{"role": "user", "content": "List five fruits and say one thing about "
                                                                        "each."}])
    print(f"cpu: {platform.processor() or platform.machine()}; threads {torch.get_num_threads()}; "
          f"variants {kernels.supported_isas()}")
    for isa in kernels.supported_isas():
        kernels.select_isa(isa)
        speed: dict[str, list[float]] = {"native": [], "fp32": []}
        for _ in range(a.rounds):
            for w, eng in engines.items():
                speed[w].append(eng.generate(ids, SamplingParams(max_new_tokens=a.tokens)).stats.decode_tok_s)
        nat, f32 = statistics.median(speed["native"]), statistics.median(speed["fp32"])
        p = auto.probe(isa)
        print(f"{isa}: decode native {nat:.1f} tok/s, fp32 {f32:.1f} tok/s, native/fp32 {nat / f32:.2f}x; "
              f"probe {p['shape'][0]}x{p['shape'][1]} matvec native {p['native_s'] * 1e3:.2f} ms, fp32 "
              f"{p['fp32_s'] * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
