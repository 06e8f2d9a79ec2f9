"""Two `bench.throughput` result files of one run side by side (a tree against an earlier one, on
the same machine): per matching row, decode tok/s and TTFT before and after, the ratio, and each
against the bandwidth floor. Prints a table and writes JSON.

    python -m bench.compare_runs --before A.json --after B.json --out bench/results
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

KEY = ("n", "weights", "layers", "overlap", "policy", "pdl")


def compare(before: dict, after: dict) -> list[dict]:
    """Rows of `after` with their match in `before` (same workload settings)."""
    if before["workload"] != after["workload"] or before["model"] != after["model"]:
        raise SystemExit("the two runs have different workloads or models")
    index = {tuple(r.get(k) for k in KEY): r for r in before["rows"]}
    rows = []
    for a in after["rows"]:
        b = index.get(tuple(a.get(k) for k in KEY))
        if b is None:
            continue
        rows.append({**{k: a.get(k) for k in KEY},
                     "before_tok_s": b["decode_tok_s"], "after_tok_s": a["decode_tok_s"],
                     "after_over_before": a["decode_tok_s"] / b["decode_tok_s"],
                     "before_ttft_s": b["ttft_s"], "after_ttft_s": a["ttft_s"],
                     "before_of_floor": b["decode_tok_s"] / b["floor_tok_s"] if b.get("floor_tok_s") else None,
                     "after_of_floor": a["decode_tok_s"] / a["floor_tok_s"] if a.get("floor_tok_s") else None})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--out", default="bench/results")
    a = ap.parse_args(argv)
    before, after = json.loads(Path(a.before).read_text()), json.loads(Path(a.after).read_text())
    rows = compare(before, after)
    print(f"{after['model']} on {after['device']}: decode tok/s, this tree against the earlier one (same run)")
    print(f"{'N':>4} {'policy':>7} {'before':>10} {'after':>10} {'ratio':>6} {'TTFT before':>12} {'TTFT after':>11} "
          f"{'floor b/a':>11}")
    for r in rows:
        floor = (f"{r['before_of_floor']:.3f}/{r['after_of_floor']:.3f}" if r["before_of_floor"] is not None else "-")
        print(f"{r['n']:>4} {r['policy']:>7} {r['before_tok_s']:>10.1f} {r['after_tok_s']:>10.1f} "
              f"{r['after_over_before']:>6.3f} {r['before_ttft_s']:>12.3f} {r['after_ttft_s']:>11.3f} {floor:>11}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"compare-{Path(a.after).stem.removeprefix('throughput-')}.json"
    path.write_text(json.dumps({"before": a.before, "after": a.after, "model": after["model"],
                                "device": after["device"], "workload": after["workload"], "rows": rows}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
