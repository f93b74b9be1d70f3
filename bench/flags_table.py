"""The table of bench/flags_bench.sh: per model and XLA_FLAGS setting, the median over the rounds
of the gradient program's compile, every program's compile, the first step (cold and warm), the
steady step and the warm run's loads, with each figure's ratio to the run without flags.
Standard library only.

    python3 bench/flags_table.py target/flags-bench/runs.jsonl
"""

import json
import statistics
import sys


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


FIGURES = [
    ("gradient compile (ms)", lambda r: r["cold"]["compile_ms_by_program"]["grad"]),
    ("every compile (ms)", lambda r: sum(r["cold"]["compile_ms_by_program"].values())),
    ("first step, cold (ms)", lambda r: r["cold"]["first_step_ms"]),
    ("steady step, waited (ms)", lambda r: r["warm"]["step_ms"]),
    ("first step, warm (ms)", lambda r: r["warm"]["first_step_ms"]),
    ("loads, warm (ms)", lambda r: sum(r["warm"]["compile_ms_by_program"].values())),
]


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: flags_table.py RUNS.jsonl")
    with open(sys.argv[1]) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    settings = []
    for r in runs:
        if r["flags"] not in settings:
            settings.append(r["flags"])
    for model in sorted({r["model"] for r in runs}):
        print(f"## {model}\n")
        print("| setting | " + " | ".join(label for label, _ in FIGURES) + " |")
        print("|---" * (len(FIGURES) + 1) + "|")
        base = None
        for setting in settings:
            rs = [r for r in runs if r["model"] == model and r["flags"] == setting]
            values = [median([f(r) for r in rs]) for _, f in FIGURES]
            if base is None:
                base = values
            cells = [
                "—" if v is None else (f"{v:.0f}" if b is None or v is b else f"{v:.0f} ({v / b:.2f}×)")
                for v, b in zip(values, base)
            ]
            print(f"| {setting} (n={len(rs)}) | " + " | ".join(cells) + " |")
        print()


if __name__ == "__main__":
    main()
