#!/usr/bin/env bash
# One-shot check of eyas's CUDA path (written for eyas 0.1.0, which had not yet run on a GPU). At most ~8 minutes on one
# GPU: regenerate a few hundred replies, train a draft briefly, bench and doctor with --device cuda. Prints one
# PASS/FAIL line per stage and exits non-zero if any failed; logs stay in $WORK.
#
#     bash benchmarks/gpu_check.sh                 # DEVICE=cuda, WORK=runs/gpu-check, NUM=200
#     DEVICE=cpu NUM=4 STEPS=2 bash benchmarks/gpu_check.sh   # the same commands on the CPU (a smoke test)
#
# Run from the repository root after `make setup` (or with eyas importable from $PY).
set -uo pipefail
DEVICE="${DEVICE:-cuda}"
WORK="${WORK:-runs/gpu-check}"
NUM="${NUM:-200}"
STEPS="${STEPS:-60}"
PY="${PY:-.venv/bin/python}"
EYAS="$PY -m eyas"
mkdir -p "$WORK"
fails=0

stage() {  # stage NAME COMMAND...: run, time, report one line
    local name="$1"; shift
    local t0=$SECONDS
    if "$@" >"$WORK/$name.log" 2>&1; then
        echo "PASS $name ($((SECONDS - t0)) s)"
    else
        echo "FAIL $name ($((SECONDS - t0)) s): $(tail -n 1 "$WORK/$name.log")"
        fails=$((fails + 1))
    fi
}

stage env $PY -c "import torch, sys; print(torch.__version__, torch.cuda.is_available()); \
sys.exit(0 if '$DEVICE' == 'cpu' or torch.cuda.is_available() else 1)"
# regenerated replies (the target's own greedy answers), batched, then features captured on $DEVICE
stage datagen $EYAS datagen --data sharegpt --out "$WORK/data" --num "$NUM" --max-len 512 --max-new-tokens 192 \
    --max-turns 1 --gen-batch 64 --device "$DEVICE" --quiet
# a short training run (bf16 autocast on CUDA), warm-started from the shipped draft
bf16=""; [ "$DEVICE" != "cpu" ] && bf16="--bf16"
stage train $EYAS train --data "$WORK/data" --out "$WORK/train" --init-from default --ttt-steps 3 \
    --max-steps "$STEPS" --lr 1e-4 --batch-tokens 4096 --heldout-pct "${HELDOUT:-5}" $bf16 --device "$DEVICE"
# the engine on $DEVICE: plain vs tree with the new draft, lossless check included (fp32 weights on CUDA)
stage bench $EYAS bench --bench mt-bench --limit 2 --max-new-tokens 64 --methods plain,chain,tree \
    --draft "$WORK/train/draft" --depth 3 --topk 4 --tokens 8 --device "$DEVICE" --out "$WORK/bench"
stage lossless $PY -c "import json, sys; s = json.load(open('$WORK/bench/results.json'))['summary']['methods']; \
bad = [m for m in ('chain', 'tree') if s[m]['identical'] != s[m]['compared']]; print(s['plain']['tok_s'], bad); \
sys.exit(1 if bad else 0)"
stage doctor $EYAS doctor --target smollm2-135m --draft "$WORK/train/draft" --samples 3 --device "$DEVICE"
echo "gpu_check: $fails stage(s) failed; logs in $WORK"
exit $((fails > 0))
