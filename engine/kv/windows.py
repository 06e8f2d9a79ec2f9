"""Per-layer windows for bounded layers: a model's window profile and the allocation of a byte
budget across its sliding layers.

Sliding layers are not equally sensitive to how many recent positions their row keeps between
forwards. A *window profile* records, per sliding layer, the model's perplexity with that layer's
window changed alone, at one or more windows, and the perplexity with every sliding layer bounded
to each window (measured once per model by `python -m bench.fidelity --ppl`, stored beside the
converted model as `kv-windows.json`). "Alone" is around an operating point: every other layer
exact (`base_window` None), or every other layer bounded to `base_window`, where the layers'
effects are measured where an allocation will use them (they do not add up from the exact model:
each layer cut alone costs more, summed, than all of them cut together). `solve_windows` then
picks one window per sliding layer that minimises the summed change of log perplexity within a
budget of resident bytes per session: a multiple-choice knapsack, solved exactly by dynamic
programming. The restored-S5 rule is the same for every window; only how many positions each
bounded layer keeps differs.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

PROFILE_NAME = "kv-windows.json"
# the embedded model's profile, as measured (bench/results/fidelity-profile-*.json)
SHIPPED = Path(__file__).parent / "profiles"


@dataclass
class WindowProfile:
    model: str
    weights: str
    sink: int
    native_window: int
    native_ppl: float
    layer_ppl: dict[int, dict[int, float]]  # sliding layer -> window -> perplexity, that layer's window alone changed
    uniform_ppl: dict[int, float]  # window -> perplexity, every sliding layer bounded to it
    scored_tokens: int
    base_window: int | None = None  # the other layers' window in `layer_ppl` (None: exact)
    base_ppl: float | None = None  # every sliding layer at `base_window`

    def cost(self) -> dict[int, dict[int, float]]:
        """Per layer and window, the change of log perplexity it brings. Around a base window: as
        measured (the base window itself 0; the native window may be measured too). Around the
        exact model: per window of `uniform_ppl`, the measured increase where the profile has it,
        else the layer's share of the increase at its measured windows times the increase of
        every layer bounded together at that window (never below 0)."""
        if self.base_window is not None:
            ref = math.log(self.base_ppl)
            return {i: {self.base_window: 0.0, **{w: math.log(p) - ref for w, p in ws.items()}}
                    for i, ws in self.layer_ppl.items()}
        base = math.log(self.native_ppl)
        up = {w: max(1e-9, math.log(p) - base) for w, p in self.uniform_ppl.items()}
        total = {w: sum(max(0.0, math.log(self.layer_ppl[i][w]) - base) for i in self.layer_ppl) or 1e-9
                 for w in up if all(w in ws for ws in self.layer_ppl.values())}
        out = {}
        for i, ws in self.layer_ppl.items():
            shares = [max(0.0, math.log(ws[w]) - base) / total[w] for w in total]
            share = sum(shares) / len(shares) if shares else 0.0
            out[i] = {w: max(0.0, math.log(ws[w]) - base if w in ws else share * up[w]) for w in up}
        return out

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls, path: Path) -> WindowProfile:
        d = json.loads(Path(path).read_text())
        d["layer_ppl"] = {int(i): {int(w): p for w, p in ws.items()} for i, ws in d["layer_ppl"].items()}
        d["uniform_ppl"] = {int(w): p for w, p in d["uniform_ppl"].items()}
        return cls(**d)


def profile_path(model_dir: Path) -> Path:
    return Path(model_dir) / PROFILE_NAME


def find_profile(model_dir: Path | None, name: str) -> WindowProfile | None:
    """The profile beside the model, else the one shipped for it (the embedded model), else None."""
    for path in ([profile_path(model_dir)] if model_dir is not None else []) + [SHIPPED / f"{name}.json"]:
        if path.is_file():
            return WindowProfile.load(path)
    return None


def solve_windows(cost: dict[int, dict[int, float]], position_bytes: dict[int, int], sink: int,
                  native_window: int, budget_bytes: int) -> dict[int, int] | None:
    """Per sliding layer, the window (one of the profile's, or the native window, which costs
    what the profile says, else nothing) minimising the summed cost with sum((sink + window) *
    position_bytes) within `budget_bytes`. Returns {layer: window}, or None when the smallest
    windows do not fit."""
    layers = sorted(cost)
    options = {i: sorted({*(w for w in cost[i] if w < native_window), native_window}) for i in layers}
    unit = math.gcd(*[position_bytes[i] for i in layers]) if layers else 1
    units = budget_bytes // unit
    best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}  # used units -> (cost, windows)
    for i in layers:
        nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
        for used, (c, ws) in best.items():
            for w in options[i]:
                u = used + (sink + w) * position_bytes[i] // unit
                cw = c + cost[i].get(w, 0.0)
                if u <= units and (u not in nxt or cw < nxt[u][0]):
                    nxt[u] = (cw, (*ws, w))
        best, floor = {}, math.inf  # drop states that cost more than one using fewer bytes
        for u in sorted(nxt):
            if nxt[u][0] < floor:
                best[u], floor = nxt[u], nxt[u][0]
        if not best:
            return None
    _, ws = min(best.values(), key=lambda cw: cw[0])
    return dict(zip(layers, ws))


def model_dir(config) -> Path | None:
    """Where the model's files (and its window profile) live, if on this machine."""
    if config.model == "embedded":
        from engine.model.source import embedded_dir

        return embedded_dir(config.cache_dir, progress=False)
    return Path(config.model) if Path(config.model).is_dir() else None


def budget_windows(config, model_name: str, geometry, item_bytes: int) -> tuple[int, ...]:
    """Per sliding layer (layer order), the windows solved from the model's window profile within
    `config.kv_budget` bytes per session on those layers (K and V of `item_bytes` elements)."""
    from engine.kv.policy import bounded_layers

    profile = find_profile(model_dir(config), model_name)
    if profile is None:
        raise ValueError(f"kv_budget needs the window profile of {model_name}: measure it once with "
                         f"`python -m bench.fidelity --ppl --model {config.model}` (or give kv_windows)")
    layers = bounded_layers(config.kv_policy, geometry.layer_types)
    missing = set(layers) - set(profile.layer_ppl)
    if missing or geometry.native_window != profile.native_window:
        raise ValueError(f"the window profile of {model_name} does not match the model (layers {sorted(missing)})")
    position_bytes = {i: 2 * h * d * item_bytes for i, (h, d) in enumerate(geometry.kv_shapes)}
    solved = solve_windows(profile.cost(), position_bytes, config.kv_sink, profile.native_window, config.kv_budget)
    if solved is None:
        smallest = sum((config.kv_sink + min(profile.layer_ppl[i])) * position_bytes[i] for i in layers)
        raise ValueError(f"kv_budget {config.kv_budget} bytes is below the smallest windows' {smallest} bytes")
    return tuple(solved[i] for i in layers)
