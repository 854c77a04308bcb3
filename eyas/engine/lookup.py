"""Lookup candidates: propose what followed the latest earlier occurrence of the context's last n tokens.

Greedy output of a small target repeats itself (lists, code, loops); a lookup chain costs no model call and,
merged into the EAGLE-3 tree, is verified in the same target forward, so it can only add accepted tokens
(at the price of a few more verified rows). Verification keeps decoding lossless whatever proposed a token.
"""

from __future__ import annotations


def lookup_chain(context: list[int], length: int, max_ngram: int = 3, min_ngram: int = 2,
                 window: int = 4096) -> list[int]:
    """Up to `length` tokens that followed the most recent earlier match of the last n tokens of `context`
    (longest n first, n from max_ngram down to min_ngram; only the last `window` tokens are searched).
    A match close to the end continues into the proposal itself, so a loop of period p < length is
    proposed in full. [] when nothing matches."""
    if length < 1 or len(context) < min_ngram + 1:
        return []
    ctx = context[-window:]
    n_ctx = len(ctx)
    for n in range(min(max_ngram, n_ctx - 1), min_ngram - 1, -1):
        tail = ctx[-n:]
        first = tail[0]
        # scan right to left: the latest occurrence predicts a loop best
        for i in range(n_ctx - n - 1, -1, -1):
            if ctx[i] == first and ctx[i:i + n] == tail:
                out: list[int] = []
                for j in range(i + n, i + n + length):  # past the end of ctx, continue from the proposal itself
                    out.append(ctx[j] if j < n_ctx else out[j - n_ctx])
                return out
    return []
