"""Model specs -> loaded model (weights on the engine's device, quantized as configured) and
tokenizer. Where each spec's files come from: engine/model/source.py.

    quantization        "int8": the CPU engine's int8 linears (engine/model/quant.py);
                        "bnb-4bit": bitsandbytes NF4 weights (CUDA only)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.core.config import EngineConfig
from engine.model import nf4_experts
from engine.model.source import default_cache_dir, load_tokenizer, model_source

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel (causal LM)
    tokenizer: Any | None  # None for tiny random test models
    name: str  # what /v1/models reports


def tiny_random_config(**overrides: Any):
    from transformers import Gemma3TextConfig

    kw: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=16,
        max_position_embeddings=4096,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        eos_token_id=1,
        bos_token_id=2,
        pad_token_id=0,
    )
    kw.update(overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        n = overrides["num_hidden_layers"]
        kw["layer_types"] = [
            "full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(n)
        ]
    return Gemma3TextConfig(**kw)


def tiny_random_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any):
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(tiny_random_config(**overrides)).to(dtype)
    # Random init gives near-uniform logits; widen them so greedy choices are not coin flips.
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)
    return model.eval()


def load_model(config: EngineConfig) -> LoadedModel:
    dtype = TORCH_DTYPES[config.dtype]
    spec = config.model
    if spec.startswith("tiny-random"):
        seed = int(spec.split(":", 1)[1]) if ":" in spec else 0
        model = tiny_random_model(seed, dtype).to(config.device)
        return LoadedModel(_quantize(model, config), None, spec)
    from transformers import AutoConfig, AutoModelForCausalLM

    path, name = model_source(config)
    if spec.startswith("random:"):
        torch.manual_seed(0)
        with torch.device(config.device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype).eval()
        return LoadedModel(_quantize(model, config), load_tokenizer(config), name)
    kwargs: dict[str, Any] = {"dtype": dtype}
    bnb4 = config.quantization == "bnb-4bit"
    prequantized = bnb4 and getattr(AutoConfig.from_pretrained(path), "quantization_config", None) is not None
    if prequantized:  # a bitsandbytes 4-bit checkpoint: transformers loads it as it is
        kwargs["device_map"] = {"": config.device}
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    if bnb4 and not prequantized:
        # read on the CPU, quantized as each module moves to the device: the device never holds
        # the model, or a mixture-of-experts model's experts, at full precision
        model = quantize_bnb4(model, dtype, config.device)
    elif not bnb4:
        model = model.to(config.device)
    return LoadedModel(_quantize(model, config), load_tokenizer(config), name)


def quantize_bnb4(model, compute_dtype: torch.dtype, device: str | torch.device | None = None):
    """bitsandbytes NF4 weights on the CUDA `device` (default: the model's): every `nn.Linear` of the
    decoder layers becomes a `Linear4bit`, quantized as it moves there, and every experts module
    an `NF4Experts` (nf4_experts.py), one layer's at a time; then the rest of the model moves
    there as it is (the embeddings and the output layer, as transformers' own 4-bit loading
    leaves it). A model read on the CPU is thus never on the device at full precision."""
    import bitsandbytes as bnb

    device = torch.device(device) if device is not None else next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError("bnb-4bit quantization needs a CUDA device")
    for parent in list(model.get_decoder().layers.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                  compute_dtype=compute_dtype, quant_type="nf4", device="cpu")
            q.weight = bnb.nn.Params4bit(child.weight.data.to("cpu"), requires_grad=False, quant_type="nf4")
            if child.bias is not None:
                q.bias = torch.nn.Parameter(child.bias.data.to("cpu"), requires_grad=False)
            setattr(parent, name, q.to(device))
    nf4_experts.quantize_experts(model, device)
    return model.to(device)


def _quantize(model, config: EngineConfig):
    if config.quantization == "bnb-4bit":
        if not any(type(m).__name__ == "Linear4bit" for m in model.modules()):  # in-memory models
            quantize_bnb4(model, TORCH_DTYPES[config.dtype])
        nf4_experts.quantize_experts(model)  # transformers' 4-bit loading leaves experts in the dtype
        return model
    if config.quantization == "int8":
        from engine.model.quant import KernelUnavailable, Q8Kernel, quantize_int8

        if TORCH_DTYPES[config.dtype] != torch.float32:
            raise ValueError("int8 quantization keeps float32 activations between its products; use dtype float32")
        cache = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
        try:
            kernel = Q8Kernel(cache, config.cpu_kernel)
            log.info("int8 CPU kernel: %s", kernel.describe())
        except KernelUnavailable as e:
            if config.cpu_kernel != "auto":
                raise
            log.warning("%s; int8 products run in torch (same results, float32 speed)", e)
            kernel = None
        quantize_int8(model, kernel)
    return model
