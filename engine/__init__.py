"""s5serve engine: restored-S5 KV rows and a continuous-batching step engine.

Map of the package (one owner per resource, data flows top to bottom):

    config.py        EngineConfig (frozen): model, device, dtype, KV policy, limits
    types.py         plain data shared across the engine: SamplingParams, Request, outputs, errors
    model_loader.py  turns a model spec ("embedded", a path, an id, "tiny-random") into weights
    kv_policy.py     which positions each layer keeps between forwards (pure functions)
    kv_rows.py       RowPool: owns every K/V byte (ring slots, paged blocks, rows, snapshots)
    attention.py     StepAttention: ragged attention of one step's tokens over the pool
    hf_adapter.py    the stock transformers forward with the engine's attention (a registered
                     attention function)
    fused_forward.py the engine's own Gemma 3 layer forward: fused weights and elementwise kernels
    fused_gemma4.py  the same for Gemma 4 (dense or mixture of experts)
    model_runner.py  one batched forward per step: packs tokens, returns logits of sampled rows
    decode_graph.py  decode-only steps as fixed-size batches, replayed from CUDA graphs on CUDA
    quant.py         int8 linear layers for the CPU (module substitution)
    kernels/         q8_matmul.c (CPU int8), decode_attention / fused_ops / moe / rmsnorm /
                     small_linear (Triton), launch (programmatic dependent launch)
    sampler.py       greedy / temperature / top-k / top-p / seeded sampling, per row
    detokenizer.py   incremental UTF-8-safe detokenization and stop strings
    passkey.py       passkey-retrieval prompts for recall tests and benchmarks
    scheduler.py     admission, token budget, prefill chunks + decodes (no torch)
    engine.py        Engine.step(): schedule -> run -> apply; sessions; abort and rollback
    ipc.py           the wire to the engine process: typed messages (msgspec) over ZeroMQ
    process.py       the engine process: EngineCore loops commands in -> step -> one message out
    client.py        EngineClient: the front end's only way to the engine (async, typed)
"""

from engine.config import EngineConfig
from engine.engine import Engine
from engine.types import (
    EngineError,
    FinishReason,
    Request,
    RequestOutput,
    SamplingParams,
)

__all__ = [
    "Engine",
    "EngineConfig",
    "EngineError",
    "FinishReason",
    "Request",
    "RequestOutput",
    "SamplingParams",
]
