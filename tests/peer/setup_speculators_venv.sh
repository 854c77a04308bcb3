#!/usr/bin/env bash
# A separate venv with the peer `speculators` for tests/test_peer_speculators.py (never eyas's own venv:
# speculators 0.9.0 pins transformers<=5.19 and pulls torchvision/torchaudio). torch is installed first
# and pinned so nothing can pull a CUDA build; torchvision/torchaudio are removed afterwards because
# their PyPI wheels are CUDA builds that fail to load beside torch 2.13 CPU (speculators' eagle3 path
# does not use them, and transformers imports them only when present).
set -euo pipefail
VENV="${1:-/tmp/peer-venv}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q 'torch==2.13.0'
echo 'torch==2.13.0' > "$VENV/constraints.txt"
"$VENV/bin/pip" install -q -c "$VENV/constraints.txt" 'speculators==0.9.0'
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio || true
"$VENV/bin/python" -c "import torch, transformers, speculators.models.eagle3; print('peer ok: torch', torch.__version__, 'transformers', transformers.__version__)"
