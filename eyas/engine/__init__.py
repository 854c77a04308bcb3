"""The decoding engine: parameters and tree defaults (params), the decode loop with chain/tree drafting and
lossless verification (decode), sampling (sampling), the lookup and n-gram proposers (lookup, ngram), the
forward over the target's weights (forward) in the chosen weights mode (weights)."""
