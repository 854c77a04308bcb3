"""The decoding engine: decoding settings and the device's tree defaults (params), the one engine assembly (load),
the round loop (decode) over one sequence's state (sequence), drafting the tree (tree) and lossless verification
(verify), sampling (sampling), the lookup and n-gram proposers (lookup, ngram), the prompt's token ids (prompt),
the counters (stats), and the forward over the target's weights (forward) in the chosen weights mode (weights)."""
