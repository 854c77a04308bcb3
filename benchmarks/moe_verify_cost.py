"""What verifying more rows costs on a MoE target: distinct experts touched and forward time, for 1..16 rows.

    python benchmarks/moe_verify_cost.py [--rows 1,2,4,8,12,16] [--context 256] [--repeats 5] [--seed 0]

Two random Qwen3-MoE targets built in memory (no download): `tiny` (hidden 64, 8 experts, top-2, 4 layers) and
`mid` (hidden 1024, 64 experts, top-8, 4 layers, the routed shape of Qwen3-30B-A3B at a quarter of its width),
router weights scaled so the routing is peaked as a trained one is. For each row count n it runs the engine's
verification forward (eyas.engine.forward.TargetModel) of n new tokens after a --context token prefix in the
KV cache (a chain: causal mask over the n), and prints the median time relative to n = 1 and the mean number of
distinct experts per MoE layer the n rows routed to (each row routes alone; the union is what must be read from
memory). A dense target's verify cost grows slowly with n while weight reads dominate; a MoE target's grows as
the touched experts do, which is what bounds the tree size worth verifying there.

Figures depend on the machine and its load: the header names the CPU (from /proc/cpuinfo) and the thread count.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eyas.bench.environment import cpu_name
from eyas.engine.forward import TargetModel

SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_experts=8,
                 num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64),
    "mid": dict(hidden_size=1024, intermediate_size=3072, moe_intermediate_size=384, num_experts=64,
                num_experts_per_tok=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64),
}
# the dense counterpart of `mid`: the same attention, one MLP as wide as mid's 8 active experts together
# (8 x 384), so one row reads about as many weights as one MoE row does
DENSE = dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=4, head_dim=64)


def build(size: str, seed: int) -> torch.nn.Module:
    import transformers as tf

    if size == "mid-dense":
        torch.manual_seed(seed)
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(vocab_size=4096, num_hidden_layers=4, max_position_embeddings=4096,
                                                  tie_word_embeddings=False, **DENSE)).eval()
    cfg = tf.Qwen3MoeConfig(vocab_size=4096, num_hidden_layers=4, max_position_embeddings=4096,
                            norm_topk_prob=True, tie_word_embeddings=False, **SIZES[size])
    torch.manual_seed(seed)
    m = tf.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.mlp.gate.weight.mul_(8.0)  # random init routes near-uniformly; a trained router does not
    return m


def experts_touched(tm: TargetModel, ids: torch.Tensor, pos: torch.Tensor, cache) -> float:
    """Mean over MoE layers of the distinct experts the rows route to (a hook on each layer's router)."""
    seen: list[int] = []
    wrapped = []
    for L in tm.layers:
        if getattr(L, "moe", None) is None:
            continue
        route = L.moe.route

        def spy(x: torch.Tensor, route=route):
            idx, w = route(x)
            seen.append(int(torch.unique(idx).numel()))
            return idx, w
        L.moe.route = spy
        wrapped.append((L, route))
    tm.forward(ids, pos, cache, logits="all")
    for L, route in wrapped:
        L.moe.route = route
    return sum(seen) / max(len(seen), 1)


def measure(size: str, rows: list[int], context: int, repeats: int, seed: int) -> list[tuple[int, float, float]]:
    tm = TargetModel(build(size, seed))
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 4096, (1, context), generator=g)
    cache = tm.new_cache(1, context + max(rows))
    tm.forward(prefix, torch.arange(context)[None], cache, logits="none")
    cache.length = context
    out = []
    for n in rows:
        new = torch.randint(0, 4096, (1, n), generator=g)
        pos = torch.arange(context, context + n)[None]
        touched = experts_touched(tm, new, pos, cache)
        times = []
        for _ in range(repeats + 1):  # the first run warms up
            t = time.perf_counter()
            tm.forward(new, pos, cache, logits="all")
            times.append(time.perf_counter() - t)
        out.append((n, statistics.median(times[1:]), touched))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,12,16")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rows = sorted({int(r) for r in args.rows.split(",")} | {1})
    print(f"CPU: {cpu_name()}; torch threads {torch.get_num_threads()}; context {args.context} tokens")
    for size in (*SIZES, "mid-dense"):
        res = measure(size, rows, args.context, args.repeats, args.seed)
        base = res[0][1]
        c = SIZES.get(size)
        print(f"\n{size}: " + (f"hidden {c['hidden_size']}, {c['num_experts']} experts, top-{c['num_experts_per_tok']}"
                               if c else f"hidden {DENSE['hidden_size']}, one MLP of {DENSE['intermediate_size']}"))
        print(f"{'rows':>5} {'ms':>9} {'x one row':>10} {'experts/layer':>14}")
        for n, t, touched in res:
            shown = f"{touched:>14.1f}" if c else f"{'-':>14}"
            print(f"{n:>5} {t * 1e3:>9.2f} {t / base:>10.2f} {shown}")


if __name__ == "__main__":
    main()
