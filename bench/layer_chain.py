"""What a kernel boundary costs a one-row decode step, and what one kernel for the whole step
would save: the chain of every decoder layer's four projections (QKV, O, gate/up with its
activation, down; each product's input is the one before's output) at 1-8 rows of x, on one
shape's own weight sizes, three ways on the same weights:

  library     `F.linear` for each product, `gelu_mul` after gate/up
  engine      the fused forward's launches: `gemv` where `plan_gemv` finds it faster than the
              library (timed on these weights), launched with PDL where the forward would
  persistent  the whole chain in one kernel (`chain`): every program resident at once, each
              taking its blocks of each product's rows in turn, a device-wide barrier (an arrival
              counter) between dependent products; each program reads its first weight tile of
              the next product before it waits at the barrier; each launch also runs without its
              barriers (no waiting, so not the chain's result): the time a barrier that cost
              nothing would leave, a bound on what one kernel for the step, built this way, can save

Each is timed from a CUDA graph and stated against the bandwidth floor of its weights' bytes (the
copy bandwidth measured in the same run) and against the engine's launches. Norms, attention and
the residual are left out: the chain holds the step's weight reads and the dependencies between
them, the part a decode step at one row spends most of its time on. The engine's and the persistent
kernel's results are checked against the library's (on the first CHECK_LAYERS layers) before
they are timed.

    python -m bench.layer_chain --shape gemma3-1b gemma3-4b --rows 1
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.throughput import SHAPES, copy_bandwidth, git_commit, source_digest

try:
    import triton
    import triton.language as tl

    from engine.kernels.small_linear import _rows_dot, _store_rows, _weight_tile
except ImportError:  # pragma: no cover - exercised where Triton is absent
    triton = None

if triton is not None:
    SPIN_LIMIT = tl.constexpr(1 << 18)  # polls of the arrival counter before a program gives up

    @triton.jit
    def _arrive_and_wait(COUNT, FAILED, target, BARRIER: tl.constexpr):
        """Count this program's arrival (its stores before it visible first), then wait until
        `target` programs have arrived; set FAILED instead of waiting forever. Without BARRIER
        nothing: the products' own time, whose results are not valid."""
        if BARRIER:
            tl.debug_barrier()
            tl.atomic_add(COUNT, 1, sem="release")
            seen = tl.load(COUNT, volatile=True)
            spins = 0
            while (seen < target) & (spins < SPIN_LIMIT):
                seen = tl.load(COUNT, volatile=True)
                spins += 1
            if seen < target:
                tl.atomic_max(FAILED, 1)
            tl.atomic_add(COUNT, 0, sem="acquire")
            tl.debug_barrier()

    @triton.jit
    def _x_tile(X, K, stride_xm, rm, mm, k0, BLOCK_K: tl.constexpr):
        """x's rows `rm`, columns k0 to k0 + BLOCK_K - 1, read past L1 (another SM wrote them in
        this kernel)."""
        rk = k0 + tl.arange(0, BLOCK_K)
        return tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=mm[:, None] & (rk < K)[None, :], other=0.0,
                       cache_modifier=".cg")

    @triton.jit
    def _product(X, W, Y, M, N, K, stride_xm, stride_ym, COUNT, FAILED, target,
                 MP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GELU: tl.constexpr,
                 BARRIER: tl.constexpr):
        """This program's blocks of Y = X @ W.T (with GELU, W is [gate; up] and Y the activation),
        after `target` programs have arrived at the counter; its first weight tile is read before
        it waits."""
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        rm = tl.arange(0, MP)
        mm = rm < M
        W_up = W + N * K
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = rn < N
        w, w_up = _weight_tile(W, W_up, K, K, rn, nm, 0, BLOCK_K, GELU)
        _arrive_and_wait(COUNT, FAILED, target, BARRIER)
        for block in range(pid, tl.cdiv(N, BLOCK_N), programs):
            rn = block * BLOCK_N + tl.arange(0, BLOCK_N)
            nm = rn < N
            acc = tl.zeros([MP, BLOCK_N], tl.float32)
            acc_up = tl.zeros([MP, BLOCK_N], tl.float32)
            if block != pid:
                w, w_up = _weight_tile(W, W_up, K, K, rn, nm, 0, BLOCK_K, GELU)
            x = _x_tile(X, K, stride_xm, rm, mm, 0, BLOCK_K)
            acc += _rows_dot(x, w)
            if GELU:
                acc_up += _rows_dot(x, w_up)
            for k0 in range(BLOCK_K, K, BLOCK_K):
                w, w_up = _weight_tile(W, W_up, K, K, rn, nm, k0, BLOCK_K, GELU)
                x = _x_tile(X, K, stride_xm, rm, mm, k0, BLOCK_K)
                acc += _rows_dot(x, w)
                if GELU:
                    acc_up += _rows_dot(x, w_up)
            _store_rows(Y, stride_ym, rm, mm, rn, nm, acc, acc_up, GELU)

    @triton.jit
    def _chain_kernel(X, Wqkv, Wo, Wgu, Wd, A, B, C, COUNT, FAILED, M, L,
                      H: tl.constexpr, QKV: tl.constexpr, QO: tl.constexpr, INTER: tl.constexpr, MP: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BARRIER: tl.constexpr):
        """L layers of x -> qkv (A) -> o (B, from A's first QO columns) -> gate/up's activation (C)
        -> down (X, the next layer's input), four products a layer, each after every program has
        arrived at it (so has finished the product before)."""
        programs = tl.num_programs(0)
        phase = 0
        for layer in range(L):
            _product(X, Wqkv + layer * QKV * H, A, M, QKV, H, H, QKV, COUNT, FAILED, (phase + 1) * programs,
                     MP, BLOCK_N, BLOCK_K, False, BARRIER)
            phase += 1
            _product(A, Wo + layer * H * QO, B, M, H, QO, QKV, H, COUNT, FAILED, (phase + 1) * programs,
                     MP, BLOCK_N, BLOCK_K, False, BARRIER)
            phase += 1
            _product(B, Wgu + layer * 2 * INTER * H, C, M, INTER, H, H, INTER, COUNT, FAILED, (phase + 1) * programs,
                     MP, BLOCK_N, BLOCK_K, True, BARRIER)
            phase += 1
            _product(C, Wd + layer * H * INTER, X, M, H, INTER, INTER, H, COUNT, FAILED, (phase + 1) * programs,
                     MP, BLOCK_N, BLOCK_K, False, BARRIER)
            phase += 1


class Chain:
    """One shape's stacked weights ([layers, N, K] per projection) and the activations of a
    chain at `rows` rows."""

    def __init__(self, shape: str, rows: int, device: torch.device, dtype=torch.bfloat16, seed: int = 0) -> None:
        cfg = SHAPES[shape]
        self.layers = cfg["num_hidden_layers"]
        self.hidden = h = cfg["hidden_size"]
        self.inter = i = cfg["intermediate_size"]
        self.qo = cfg["num_attention_heads"] * cfg["head_dim"]
        self.qkv = self.qo + 2 * cfg["num_key_value_heads"] * cfg["head_dim"]
        g = torch.Generator(device=device).manual_seed(seed)

        def weight(n: int, k: int) -> torch.Tensor:  # rows of norm about 1: activations stay O(1)
            return (torch.randn(self.layers, n, k, device=device, generator=g) / k ** 0.5).to(dtype)

        self.w_qkv, self.w_o = weight(self.qkv, h), weight(h, self.qo)
        self.w_gu, self.w_d = weight(2 * i, h), weight(h, i)
        self.x0 = torch.randn(rows, h, device=device, generator=g).to(dtype)
        self.rows = rows

    @property
    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in (self.w_qkv, self.w_o, self.w_gu, self.w_d))

    def plans(self, pdl: bool) -> list[dict]:
        """Each projection's plan, as a fused forward makes it on these weights."""
        from engine.model.fused_forward import plan_projection

        on = lambda m: pdl
        return [plan_projection(list(self.w_qkv), on), plan_projection(list(self.w_o), on),
                plan_projection(list(self.w_gu), on, gelu=True), plan_projection(list(self.w_d), on)]

    def products(self, x: torch.Tensor, plans: list[dict], pdl: bool, layers: int | None = None) -> torch.Tensor:
        """The chain (its first `layers` layers) on x with these plans, each product as a fused
        forward runs it (`project`); empty plans: the library's products, `gelu_mul` after gate/up."""
        from engine.model.fused_forward import project

        on = lambda m: pdl
        for layer in range(layers or self.layers):
            a = project(x, self.w_qkv[layer], plans[0], on)
            b = project(a[:, :self.qo], self.w_o[layer], plans[1], on)
            c = project(b, self.w_gu[layer], plans[2], on, gelu=True)
            x = project(c, self.w_d[layer], plans[3], on)
        return x


def resident_programs(kernel, warps: int, sms: int, device: torch.device) -> int:
    """How many programs of a compiled kernel fit on the GPU at once (registers, shared memory,
    warps per SM), so that a grid of that many can wait on each other."""
    props = torch.cuda.get_device_properties(device)
    regs = max(kernel.n_regs, 1)
    per_sm = min(props.regs_per_multiprocessor // (((regs * 32 + 255) // 256) * 256 * warps),
                 props.max_threads_per_multi_processor // (32 * warps))
    shared = kernel.metadata.shared
    if shared:
        per_sm = min(per_sm, props.shared_memory_per_multiprocessor // (shared + 1024))
    return max(per_sm, 1) * sms


def chain(ch: Chain, x: torch.Tensor, buffers: tuple, programs: int, block_n: int, block_k: int, warps: int,
          stages: int, barrier: bool = True, layers: int | None = None):
    """The persistent chain (its first `layers` layers) on x, overwritten with the last layer's
    output; returns the compiled kernel. buffers: (A, B, C, COUNT, FAILED)."""
    a, b, c, count, failed = buffers
    count.zero_()
    return _chain_kernel[(programs,)](
        x, ch.w_qkv, ch.w_o, ch.w_gu, ch.w_d, a, b, c, count, failed, x.shape[0], layers or ch.layers,
        H=ch.hidden, QKV=ch.qkv, QO=ch.qo, INTER=ch.inter, MP=max(1, triton.next_power_of_2(x.shape[0])),
        BLOCK_N=block_n, BLOCK_K=block_k, BARRIER=barrier, num_warps=warps, num_stages=stages)


REPS = 5  # chains a graph replays per timing
# Layers of a chain checked against the library's: without norms or residuals each layer's
# activation (gelu(gate) x up of unit-scale sums) is about the square of the one before, so a
# whole chain ends at zero and would agree with anything; two layers keep them near one and still
# cross seven barriers.
CHECK_LAYERS = 2
LAUNCHES = (  # (block_n, block_k, warps, stages)
    (4, 1024, 4, 3), (2, 2048, 4, 3), (4, 512, 2, 3),
)


def agrees(got: torch.Tensor, want: torch.Tensor, tol: float = 2e-2) -> bool:
    assert want.float().norm() > 1e-3, "a reference near zero checks nothing"
    return bool(torch.isfinite(got).all() and (got.float() - want.float()).norm() <= tol * want.float().norm())


@torch.no_grad()
def run(shape: str, rows: int, device: torch.device, bandwidth: float) -> dict:
    from engine.kernels import launch
    from engine.kernels.small_linear import graph_ms

    ch = Chain(shape, rows, device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    pdl = launch.supported(device) and launch.worthwhile(rows, ch.hidden)
    floor_ms = ch.weight_bytes / bandwidth * 1e3
    library = [{}] * 4
    want = ch.products(ch.x0.clone(), library, False, CHECK_LAYERS)
    out: dict = {"shape": shape, "rows": rows, "layers": ch.layers, "weight_bytes": ch.weight_bytes,
                 "floor_ms": floor_ms, "pdl": pdl}
    out["library_ms"] = graph_ms(lambda: ch.products(ch.x0, library, pdl), reps=REPS) / REPS
    plans = ch.plans(pdl)
    out["engine_plans"] = [plan.get(rows) for plan in plans]
    out["engine_agrees"] = agrees(ch.products(ch.x0.clone(), plans, pdl, CHECK_LAYERS), want)
    out["engine_ms"] = graph_ms(lambda: ch.products(ch.x0, plans, pdl), reps=REPS) / REPS
    buffers = tuple(torch.empty(rows, n, device=device, dtype=ch.x0.dtype) for n in (ch.qkv, ch.hidden, ch.inter)) + (
        torch.zeros(1, device=device, dtype=torch.int32), torch.zeros(1, device=device, dtype=torch.int32))
    out["persistent"] = []
    for block_n, block_k, warps, stages in LAUNCHES:
        x = ch.x0.clone()
        kernel = chain(ch, x, buffers, sms, block_n, block_k, warps, stages)  # one program per SM: all resident
        torch.cuda.synchronize()
        programs = resident_programs(kernel, warps, sms, device)
        for barrier in (False, True):
            r = {"block_n": block_n, "block_k": block_k, "warps": warps, "stages": stages, "programs": programs,
                 "regs": kernel.n_regs, "barrier": barrier}
            buffers[4].zero_()
            x = ch.x0.clone()
            chain(ch, x, buffers, programs, block_n, block_k, warps, stages, barrier, CHECK_LAYERS)
            r["agrees"] = barrier and int(buffers[4].item()) == 0 and agrees(x, want)
            if r["agrees"] or not barrier:
                x = ch.x0.clone()
                r["ms"] = graph_ms(lambda: chain(ch, x, buffers, programs, block_n, block_k, warps, stages, barrier),
                                   reps=REPS) / REPS
                r["agrees"] = r["agrees"] and int(buffers[4].item()) == 0  # none gave up waiting while timed
            out["persistent"].append(r)
            print(f"  {shape} rows {rows} persistent {block_n}x{block_k} w{warps} s{stages} programs {programs}"
                  f" regs {kernel.n_regs}: "
                  + (f"agrees {r['agrees']}" if barrier else "no barriers (the products' own time)")
                  + (f", {r['ms']:.3f} ms" if "ms" in r else ""), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", nargs="+", default=["gemma3-1b", "gemma3-4b"], choices=sorted(SHAPES))
    ap.add_argument("--rows", nargs="+", type=int, default=[1])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(str(device))
    results = []
    for shape in args.shape:
        for rows in args.rows:
            results.append(run(shape, rows, device, bandwidth))
            torch.cuda.empty_cache()
    print(f"\n{'shape':>10} {'rows':>4} {'floor ms':>8} {'library':>8} {'engine':>8} {'persistent':>10}"
          f" {'eng/floor':>9} {'pers/floor':>10} {'pers vs eng':>11} {'no barrier':>10}  best persistent launch")
    for r in results:
        best = min((p for p in r["persistent"] if p["agrees"]), key=lambda p: p["ms"], default=None)
        pers = best["ms"] if best else float("nan")
        bare = min((p["ms"] for p in r["persistent"] if best and not p["barrier"] and all(
            p[k] == best[k] for k in ("block_n", "block_k", "warps", "stages"))), default=float("nan"))
        launch = (f"{best['block_n']}x{best['block_k']} w{best['warps']} s{best['stages']} x{best['programs']}"
                  if best else "none agreed")
        print(f"{r['shape']:>10} {r['rows']:>4} {r['floor_ms']:8.3f} {r['library_ms']:8.3f} {r['engine_ms']:8.3f}"
              f" {pers:10.3f} {r['floor_ms'] / r['engine_ms']:8.3f}x {r['floor_ms'] / pers:9.3f}x"
              f" {r['engine_ms'] / pers:10.3f}x {bare:10.3f}  {launch}"
              + ("" if r["engine_agrees"] else "  (engine chain disagrees with the library's)"))
    doc = {"bench": "layer_chain", "device": torch.cuda.get_device_name(device), "commit": git_commit(),
           "engine_source_sha256": source_digest(), "versions": {"torch": torch.__version__,
                                                                   "triton": triton.__version__},
           "copy_bandwidth_bytes_s": bandwidth, "results": results}
    path = Path(args.out) / f"layer-chain-cuda-{date.today().isoformat()}{'-' + args.tag if args.tag else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    print(f"wrote {path} ({time.strftime('%H:%M:%S')})")


if __name__ == "__main__":
    main()
