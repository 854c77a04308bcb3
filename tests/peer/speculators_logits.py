"""Run by the peer's own environment (a venv with `speculators` installed), never by eyas's.

Loads an eyas speculators export with speculators' own config and model classes and writes the draft's
step-0 logits on the given inputs, plus what the peer read (ids, vocab map, embeddings), for
tests/test_peer_speculators.py to compare with eyas. Usage: python speculators_logits.py EXPORT INPUTS OUT
"""

import json
import sys
import warnings
from importlib.metadata import version

import torch
from safetensors.torch import load_file, save_file
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

warnings.filterwarnings("ignore")
export_dir, inputs, out = sys.argv[1:4]
cfg = Eagle3SpeculatorConfig.from_pretrained(export_dir)  # the peer's pydantic validation of config.json
# the peer defaults to flex attention (GPU-oriented); eager takes the same math on any device
cfg.transformer_layer_config._attn_implementation = "eager"
model = Eagle3DraftModel.from_pretrained(export_dir, config=cfg).eval().float()
x = load_file(inputs)
seen = {}
hook = model.lm_head.register_forward_hook(lambda mod, args, o: seen.setdefault("logits", o.detach()))
with torch.no_grad():
    model(hidden_states=x["aux"], input_ids=x["input_ids"], document_ids=torch.zeros_like(x["input_ids"]),
          position_ids=x["position_ids"], ttt_steps=1)
hook.remove()
save_file({"logits": seen["logits"].contiguous(), "d2t": model.d2t.contiguous(), "t2d": model.t2d.contiguous(),
           "embed": model.embed_tokens.weight.detach().contiguous()}, out)
with open(out + ".json", "w") as f:
    json.dump({"target_layer_ids": list(model.target_layer_ids), "class": type(model).__name__,
               "norm_before_residual": cfg.norm_before_residual,
               "versions": {p: version(p) for p in ("speculators", "torch", "transformers")}}, f)
