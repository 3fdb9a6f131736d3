"""One table from bench_whole_step runs made one variant per process: each run's step times and
memory, then per model each variant's mean against its reduce-overhead baseline (``inductor-ro``
or ``inductor-ro-step``).

Why separate processes: a variant that runs second in a process can be slower for reasons of
order alone (session 48: identical kernels, 15% apart), and its memory is read less what the
first left behind; alone in a process, neither applies. But processes differ too: session 48 ran
module-compiled apollo on HF CLIP at batch 8 in two processes of one call, 9.15 and 13.07 ms per
step, so a few percent needs probes/interleaved_ab.py. Session 48 ran it as (folders numbered in
the order run)::

    n=0; for v in apollo apollo-no-first-step-pool inductor-ro apollo-no-first-step-pool apollo; do
      n=$((n + 1)); python benchmarks/bench_whole_step.py --models hf-clip --batch 8 --steps 40 \
        --variants $v --out "$OUT/ab/$n-hf-clip-$v"; done
    python benchmarks/probes/separate_runs.py "$OUT/ab"
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

KEYS = ("median_ms", "back_to_back_ms", "peak_alloc_gib", "peak_reserved_gib")
BASELINES = ("inductor-ro", "inductor-ro-step")


def runs(root: Path) -> list[dict]:
    """Every ok row under `root`, with its model and folder, in the order the folders were made."""
    rows = []
    for path in sorted(root.glob("*/whole_step_results.json"), key=lambda p: int(p.parent.name.split("-")[0])):
        for entry in json.loads(path.read_text())["results"]:
            for r in entry["variants"]:
                if r.get("status") == "ok":
                    rows.append({"run": path.parent.name, "model": entry["model"], "variant": r["variant"],
                                 **{k: r.get(k) for k in KEYS}})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| run | model | variant | median ms | b2b ms | peak GiB | reserved GiB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['model']} | {r['variant']} | " +
                     " | ".join("-" if r[k] is None else f"{r[k]:.2f}" for k in KEYS) + " |")
    means: dict[tuple[str, str], dict[str, float]] = {}
    groups = defaultdict(list)
    for r in rows:
        groups[(r["model"], r["variant"])].append(r)
    for key, group in groups.items():
        means[key] = {k: statistics.mean(g[k] for g in group) for k in KEYS if all(g[k] is not None for g in group)}
        means[key]["n"] = len(group)
    lines += ["", "| model | variant | runs | median ms | b2b ms | time vs ro | b2b vs ro | peak vs ro | reserved vs ro |",
              "|---|---|---|---|---|---|---|---|---|"]
    for (model, variant), m in means.items():
        base = next((means[(model, b)] for b in BASELINES if (model, b) in means and
                     (b == "inductor-ro-step") == ("step" in variant)), None)

        def ratio(k: str, faster: bool) -> str:
            if not base or k not in base or k not in m:
                return "-"
            return f"{base[k] / m[k]:.2f}x" if faster else f"{m[k] / base[k]:.2f}x"
        lines.append(f"| {model} | {variant} | {m['n']} | {m.get('median_ms', 0):.2f} | {m.get('back_to_back_ms', 0):.2f} | "
                     f"{ratio('median_ms', True)} | {ratio('back_to_back_ms', True)} | {ratio('peak_alloc_gib', False)} | "
                     f"{ratio('peak_reserved_gib', False)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: separate_runs.py FOLDER (bench_whole_step outputs, one per NUMBER-MODEL-VARIANT folder)",
              file=sys.stderr)
        return 2
    rows = runs(Path(argv[0]))
    print(table(rows) if rows else f"no results under {argv[0]}")
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
