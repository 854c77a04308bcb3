"""Which weights the engine forward runs: the GGUF's native quantized matrices or the HF weights
(`--weights auto|native|native-bf16|fp32`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..errors import EyasError
from ..native import kernels
from ..native.auto import auto_native
from ..target.load import Target

if TYPE_CHECKING:
    from ..native.quant import NativeWeights
from ..target.capture import decoder_parts
from ..target.family import SUPPORTED_MOE, ModelError, text_config
from .forward import TargetModel, check_family
from .params import WEIGHTS  # re-exported: stated in params, which the CLI imports without torch

NATIVE_ACT = {"native": "q8", "native-bf16": "bf16"}  # weights mode -> 4-bit matrices' activations


def engine_model(target: Target, weights: str = "auto") -> TargetModel:
    """The engine forward for `target` in the requested weights mode.

    auto: native for a GGUF target on the CPU in fp32 whose matrices the native kernels cover, where native is
    known or measured faster (eyas/native/auto.py: the AVX2 and AVX-512 variants; on a CPU with neither, a one-time
    probe decides), else fp32.
    native: the GGUF's quantized weights (eyas/native/quant.py), 4-bit matrices with 8-bit activations (llama.cpp's
    numerics); an error when that is not possible.
    native-bf16: the same weights through torch's int4 kernel with bf16 activations.
    fp32: the HF weights as loaded (a GGUF is dequantized), in the target's --dtype, torch's own kernels."""
    if weights not in WEIGHTS:
        raise ModelError(f"--weights {weights!r}: expected one of {', '.join(WEIGHTS)}")
    model = target.model
    if weights == "fp32":
        return TargetModel(model)
    why = None
    if target.gguf is None:
        why = f"{target.source!r} is not a GGUF target (native weights are read from the .gguf file)"
    elif model.dtype != torch.float32 or model.device.type != "cpu":
        why = f"native GGUF weights run on the CPU with fp32 activations; this target is {model.dtype} on " \
              f"{model.device}"
    elif check_family(model).model_type in SUPPORTED_MOE:
        why = f"the native kernels cover dense layers; this {check_family(model).model_type} target's experts " \
              f"and attention run through the fp32 forward"
    act = NATIVE_ACT.get(weights, "q8")
    if why is None and weights == "auto":
        try:
            choice = auto_native()
            why = None if choice.native else choice.why
        except EyasError as e:  # no C compiler, a kernel that does not build
            why = str(e)
    if why is None:
        try:
            native = native_weights(target, act)
        except EyasError as e:  # a type the native kernels do not cover, a foreign layout, no C compiler
            why = str(e)
    if why is not None:
        if weights != "auto":
            raise ModelError(f"--weights {weights}: {why}; use --weights fp32")
        tm = TargetModel(model)
        tm.fallback = why  # auto fell back to fp32: callers say why (a Q4_K_M file holds Q5_0 matrices, say)
        return tm
    return TargetModel(model, native)


def native_weights(target: Target, act: str = "q8") -> NativeWeights:
    """Load (once per target and activation kind) the GGUF's quantized matrices; see eyas/native/quant.py."""
    from ..native.quant import load_native

    cached = target.native_cache if target.native_cache is not None and target.native_cache.act == act else None
    if cached is None:
        assert target.gguf is not None  # engine_model asks for native weights of a GGUF target only
        check_family(target.model)
        cfg = text_config(target.model.config)
        heads = int(cfg.num_attention_heads)
        kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
        cached = load_native(target.gguf, decoder_parts(target.model)[1], target.model.get_output_embeddings(),
                             heads, kv, act)
        kernels.lib()  # build the C kernel now, so a missing compiler is reported before decoding starts
        target.native_cache = cached
    return cached
