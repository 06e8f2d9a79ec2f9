"""s5serve engine: restored-S5 KV rows and a continuous-batching step engine.

Map of the package (one owner per resource, data flows top to bottom):

    client.py        EngineClient: the front end's only way to the engine (async, typed)
    ipc.py           the wire to the engine process: typed messages (msgspec) over ZeroMQ
    process.py       the engine process: EngineCore loops commands in -> step -> one message out
    core/            the engine itself, no torch kernels
      engine.py        Engine.step(): schedule -> run -> apply; requests end in one place
      ahead.py         AheadSteps: steady decoding launched one step ahead of the host
      sessions.py      SessionTable: sessions, their owners, durability, where each row is
      requests.py      a request's validation and plan (what it feeds, how its row comes back)
      scheduler.py     token budget, prefill chunks + decodes; admission through a callback
      session_db.py    session transcripts on disk (SQLite), or in PostgreSQL shared by replicas
      session_sync.py  SharedStore: what the session table asks of a store replicas share (leases)
      responses.py     stored responses of /v1/responses, in the session store beside the sessions
      config.py        EngineConfig (frozen): model, device, dtype, KV policy, limits
      types.py         plain data shared across the engine: SamplingParams, Request, outputs, errors
      detokenizer.py   incremental UTF-8-safe detokenization and stop strings
      structured.py    grammars (llguidance): compiled-grammar LRU, a matcher per request, step masks
    kv/              every K/V byte
      policy.py        which positions each layer keeps between forwards (pure functions)
      rows.py          RowPool: ring slots, paged blocks, rows, snapshots, swaps, invariants
    runner/          one batched forward per step on the device
      model_runner.py  packs a step's tokens, returns the logits of the rows that sample
      attention.py     StepAttention: ragged attention of one step's tokens over the pool
      decode_graph.py  decode-only steps as fixed-size batches, replayed from CUDA graphs on CUDA
      sampler.py       greedy / temperature / top-k / top-p / seeded sampling, per row
      token_mask.py    grammar masks applied to the rows that have one, and their picks
    model/           weights and the forwards that run them
      source.py        a model spec ("embedded", a path, an id, "tiny-random") to its files, tokenizer
      loader.py        a model spec to weights, quantized as configured
      prepare.py       every change the engine makes to a loaded model, and the forward it runs
      hf_adapter.py    the stock transformers forward with the engine's attention
      fused_forward.py the engine's own Gemma 3 layer forward: fused weights, elementwise kernels
      fused_gemma4.py  the same for Gemma 4 (dense or mixture of experts)
      kernel_check.py  the Gemma 4 kernels against their references on a model's weights (CUDA)
      quant.py         int8 linear layers for the CPU (module substitution)
    kernels/         q8_matmul.c (CPU int8), decode_attention / fused_ops / moe / rmsnorm /
                     small_linear (Triton), launch (programmatic dependent launch)
"""

from engine.core.config import EngineConfig
from engine.core.types import (
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


def __getattr__(name: str):
    # Engine on first use: it brings the model runner (torch kernels, transformers' model code),
    # which the HTTP front end, a process that only talks to the engine, never runs
    if name == "Engine":
        from engine.core.engine import Engine

        return Engine
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
