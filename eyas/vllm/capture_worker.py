"""vLLM side of `eyas datagen --engine vllm`: runs under vLLM's own python (stdlib, vllm, torch, safetensors; never
eyas). Usage: `python capture_worker.py REQUEST.json WORK_DIR`.

It starts one vLLM engine on the target with the `extract_hidden_states` speculative method, whose cache-only
layer stores, per token, the target's states at `eagle_aux_hidden_state_layer_ids` (vLLM's top-level ids mean
the input of layer x: 0 = the embedding output, L = the last layer's output before the final norm, which is
eyas's stream index). Then it answers commands, one JSON object per stdin line, with one
`EYAS-RESULT {json}` line on stdout (vLLM's own log lines are interleaved; eyas skips them):

  {"op": "generate", "prompts": [[ids]], "max_tokens": [n], "temperature", "top_p", "seeds": [s], "stop_ids",
   "ignore_eos" (optional: generate past the model's end tokens)}
      -> {"replies": [[ids]], "finish": ["stop"|"length"], "seconds"}   (the stop token, if any, is included)
  {"op": "capture", "rows": [[ids]], "file": PATH}
      -> writes PATH (safetensors: hidden_states [N, n_ids, H] in ascending id order, lengths [rows]) and
         returns {"file", "tokens", "seconds"}: one prefill per row (max_tokens=1), every position's states
  {"op": "exit"}

Generation runs on the same engine ("generator": "shared", the default on CUDA: one copy of the weights) or on a
second, plain engine ("separate", the default on the CPU): vLLM's CPU worker decodes ~7x slower with a
speculative method configured (measured on SmolLM2-135M fp32, 8 rows x 64 tokens: 8-12 tok/s vs 81-92 plain),
and a small target's second copy costs little there.

Hidden states leave the engine through a KV connector. vLLM's ExampleHiddenStatesConnector copies them through a
CUDA stream into pinned host memory, which raises on vLLM's CPU worker (`pin_memory=True requires a CUDA or other
accelerator backend`), so on a machine without CUDA the worker loads CpuHiddenStatesConnector below (the same
extraction from the cache-only layer, copied synchronously). On CUDA the stock connector runs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    cleanup_hidden_states,
    extract_from_kv_cache,
    load_hidden_states,
)

RESULT = "EYAS-RESULT "


class _Done:
    """Stands in for the CUDA event get_finished polls: the copy below is complete when it returns."""

    def query(self) -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector without CUDA streams, events or pinned memory: the states are read out of the
    cache-only layer's blocks and written (tmp + rename) before the request is reported done, under the lock file
    vLLM's reader (load_hidden_states) waits on."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size)[None, :] + blocks[:, None] * self._block_size).flatten()
        n = pending.token_ids.shape[0]
        hs = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), n).to("cpu", copy=True)
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            import fcntl

            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            tmp = pending.filename + ".tmp"
            save_file({"hidden_states": hs.contiguous(), "token_ids": pending.token_ids.clone()}, tmp)
            os.replace(tmp, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        self._req_copy_events[pending.req_id] = _Done()


def reply(obj: dict) -> None:
    sys.stdout.write(RESULT + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _hidden_states_of(out) -> torch.Tensor:
    path = (out.kv_transfer_params or {}).get("hidden_states_path")
    if not path:
        raise RuntimeError(f"vLLM returned no hidden_states_path for request {out.request_id}: the "
                           "extract_hidden_states connector did not run")
    data = load_hidden_states(path)
    cleanup_hidden_states(path)
    if data["token_ids"].tolist() != list(out.prompt_token_ids):
        raise RuntimeError(f"request {out.request_id}: the saved token ids differ from the prompt")
    return data["hidden_states"]


def main() -> None:
    req = json.loads(Path(sys.argv[1]).read_text())
    work = Path(sys.argv[2])
    work.mkdir(parents=True, exist_ok=True)
    from vllm import LLM, SamplingParams, __version__

    cpu = not torch.cuda.is_available()
    kv = {"kv_connector": "CpuHiddenStatesConnector" if cpu else "ExampleHiddenStatesConnector",
          "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(work / "hidden-states")}}
    if cpu:
        kv["kv_connector_module_path"] = Path(__file__).stem  # this file's folder is sys.path[0], also in spawns
    ids = [int(i) for i in req["aux_ids"]]
    args = {
        "model": req["model"], "dtype": req.get("dtype", "auto"), "max_model_len": int(req["max_model_len"]),
        "seed": int(req.get("seed", 0)),
        # every prompt position must be computed in this request (a cached prefix would not be written again),
        # and vLLM's hidden-states example requires whole prefills
        "enable_prefix_caching": False, "enable_chunked_prefill": False,
        "max_num_batched_tokens": max(int(req["max_model_len"]), int(req.get("batch_tokens", 8192))),
        "speculative_config": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                               "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}},
        "kv_transfer_config": kv,
    }
    if cpu:  # torch.compile of the CPU graph takes minutes on a small machine and gains little there
        args["enforce_eager"] = True
    args.update(req.get("engine_args") or {})
    mode = req.get("generator", "auto")
    separate = cpu if mode == "auto" else mode == "separate"
    t0 = time.perf_counter()
    llm = LLM(**args)
    gen = llm
    if separate:
        plain = {k: v for k, v in args.items() if k not in ("speculative_config", "kv_transfer_config")}
        gen = LLM(**plain)
    cfg = llm.llm_engine.model_config.hf_config
    text_cfg = getattr(cfg, "text_config", None) or cfg  # eyas.target.family.text_config's rule (no eyas here)
    reply({"ready": True, "vllm": __version__, "device": "cpu" if cpu else "cuda",
           "generator": "separate" if separate else "shared", "load_seconds":
           round(time.perf_counter() - t0, 1), "num_layers": int(text_cfg.num_hidden_layers),
           "hidden_size": int(text_cfg.hidden_size), "engine_args": {k: v for k, v in args.items() if k != "model"}})

    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        if op == "exit":
            break
        try:
            t = time.perf_counter()
            if op == "generate":
                prompts = cmd["prompts"]
                params = [SamplingParams(max_tokens=int(m), temperature=float(cmd.get("temperature", 0.0)),
                                         top_p=float(cmd.get("top_p", 1.0)), seed=int(s),
                                         stop_token_ids=list(cmd.get("stop_ids") or []), detokenize=False,
                                         ignore_eos=bool(cmd.get("ignore_eos", False)))
                          for m, s in zip(cmd["max_tokens"], cmd["seeds"], strict=True)]
                outs = gen.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                for o in outs:  # the connector saved the prompt's states too: not wanted here
                    path = (o.kv_transfer_params or {}).get("hidden_states_path")
                    if path:
                        load_hidden_states(path)  # waits for the write to finish before removing it
                        cleanup_hidden_states(path)
                reply({"replies": [list(o.outputs[0].token_ids) for o in outs],
                       "finish": [o.outputs[0].finish_reason for o in outs],
                       "seconds": round(time.perf_counter() - t, 3)})
            elif op == "capture":
                rows = cmd["rows"]
                outs = llm.generate([{"prompt_token_ids": r} for r in rows], SamplingParams(max_tokens=1),
                                    use_tqdm=False)
                states = [_hidden_states_of(o) for o in outs]
                file = Path(cmd["file"])
                save_file({"hidden_states": torch.cat(states).contiguous(),
                           "lengths": torch.tensor([s.shape[0] for s in states], dtype=torch.long)}, str(file))
                reply({"file": str(file), "tokens": sum(s.shape[0] for s in states),
                       "seconds": round(time.perf_counter() - t, 3)})
            else:
                reply({"error": f"unknown op {op!r}"})
        except Exception as e:  # noqa: BLE001 - reported to eyas as one line, which ends the run there
            reply({"error": f"{type(e).__name__}: {e}"})
    reply({"bye": True})


if __name__ == "__main__":
    main()
