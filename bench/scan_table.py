"""The markdown tables of bench/scan_bench.sh: reads its runs.jsonl (one line per run: depth,
round, side nitro|jax, form unrolled|scan, the externally measured wall_s and max_rss_kb, and the
run's own JSON line as `result`; every run cold) and prints, per depth, the median over the
rounds of each figure for the four configurations (with the range when there is more than one
round) and the ratios of the medians — scan / unrolled within each side, nitro / JAX within each
form — then how the figures grow from the smallest depth to the largest. Standard library only.

    python3 bench/scan_table.py target/scan-bench/runs.jsonl
"""

import json
import os
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from twins_table import backend_line, cell, fmt  # noqa: E402

SIDES = (("nitro", "nitro"), ("jax", "JAX"))
FORMS = ("unrolled", "scan")


def res(field):
    return lambda run: run["result"].get(field)


def nitro_programs(table, names):
    """The sum of nitro's per-program figures `table` (compile_ms_by_program, ...) over `names`."""

    def figure(run):
        progs = run["result"].get(table) or {}
        if not all(isinstance(progs.get(n), (int, float)) for n in names):
            return None
        return sum(progs[n] for n in names)

    return figure


# (label, decimals, nitro's figure, JAX's figure, whether ratios mean anything, in the growth
# table); a figure is f(run record) -> number or None.
FIGURES = [
    ("trace: nitro gradient program (trace + emit) / JAX train step (trace + lower), ms ¹", 1,
     nitro_programs("trace_ms_by_program", ["grad"]), res("lower_ms"), True, True),
    ("XLA compile: nitro gradient program / JAX train step, ms ²", 0,
     nitro_programs("compile_ms_by_program", ["grad"]), res("compile_ms"), True, True),
    ("XLA compile: nitro gradient + update programs / JAX train step, ms ²", 0,
     nitro_programs("compile_ms_by_program", ["grad", "update"]), res("compile_ms"), True, True),
    ("first step, ms ³", 0, res("first_step_ms"), res("first_step_ms"), True, True),
    ("steady step, waited, ms ⁴", 2, res("step_ms"), res("step_ms"), True, True),
    ("whole process, s (external) ⁵", 2, lambda run: run["wall_s"], lambda run: run["wall_s"], True, False),
    ("held-out bits per char ⁶", 4, res("val_bits_per_char"), res("val_bits_per_char"), False, False),
]

FOOTNOTES = """\
Each cell: the median over the rounds [min–max, when they differ]; a ratio is of the medians.
Every run is cold: nitro on a fresh, empty `NITRO_CACHE_DIR` with `--serial-compiles` (one
program compiled after another, each compile uncontended); the twin without a persistent cache.
"nitro scan" is `chargpt --scan` (the blocks one `nitro::nn::Repeated`, a scan over stacked
parameters: the gradient program holds one block); "JAX scan" is the twin's `--form scan` (one
`jax.lax.scan` over the stacked leaves); "unrolled" holds one copy of the block per layer on
both sides. Both JAX forms train from the same bundle (nitro's, written with `--scan`).

1. nitro: `trace_ms_by_program.grad`, recording the gradient program's graph and its backward
   pass and emitting StableHLO; JAX: `lower_ms`, `jax.jit(step).lower(...)` of the train step
   (tracing the forward, the gradient and the AdamW update, lowering to StableHLO).
2. nitro: `compile_ms_by_program.grad` (and `+ update`), XLA's compile of the gradient program
   (and of the separate optimizer-update program); JAX: `compile_ms`, `.compile()` of the train
   step, the gradient and the update fused in one program — set against nitro's gradient
   program alone and against its two programs' sum.
3. `first_step_ms`. nitro: from the training handle's creation to the first step's end, all
   three programs (gradient, update, evaluation) compiled first, one after another; the twin:
   from just before lowering the train step to its first loss ready (its evaluation program is
   compiled after it, outside this figure).
4. `step_ms`: the median of steps each timed alone (everything before it finished, its results
   waited for), the batch uploaded from host memory; few samples when STEPS is small.
5. The process's wall time measured outside it (`date +%s.%N` before and after), start-up
   (JAX's import), every compile, training and evaluation included.
6. `val_bits_per_char`, after the last step: a check that the four runs trained the same
   model, not a measure. The twin derives the dropout keys of the model the bundle holds
   (`--scan`'s) in either form, so both JAX forms and nitro's scan run should agree closely;
   nitro's unrolled run keys its dropout calls otherwise (separate blocks, in call order), so
   it differs a little unless the runs use `--dropout 0`."""


def pick(runs, depth, side, form, f):
    vals = []
    for run in runs:
        if run["depth"] == depth and run["side"] == side and run["form"] == form:
            try:
                vals.append(f(run))
            except (KeyError, TypeError):
                vals.append(None)
    return vals


def ratio(a, b):
    if a is None or not b:
        return "—"
    r = a / b
    return f"{r:.2f}×" if r >= 0.1 else f"{r:.3f}×"


def depth_table(runs, depth):
    rounds = sorted({run["round"] for run in runs if run["depth"] == depth})
    out = [f"## depth {depth} ({len(rounds)} round{'s' if len(rounds) != 1 else ''})", "",
           "| measure | nitro unrolled | nitro scan | nitro scan / unrolled | JAX unrolled | JAX scan "
           "| JAX scan / unrolled | nitro / JAX, unrolled | nitro / JAX, scan |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for label, dec, nitro_f, jax_f, ratios, _ in FIGURES:
        text, med = {}, {}
        for side, _ in SIDES:
            for form in FORMS:
                f = nitro_f if side == "nitro" else jax_f
                text[side, form], med[side, form] = cell(pick(runs, depth, side, form, f), dec)

        def r(a, b):
            return ratio(med[a], med[b]) if ratios else "—"

        out.append(f"| {label} | {text['nitro', 'unrolled']} | {text['nitro', 'scan']} "
                   f"| {r(('nitro', 'scan'), ('nitro', 'unrolled'))} "
                   f"| {text['jax', 'unrolled']} | {text['jax', 'scan']} "
                   f"| {r(('jax', 'scan'), ('jax', 'unrolled'))} "
                   f"| {r(('nitro', 'unrolled'), ('jax', 'unrolled'))} "
                   f"| {r(('nitro', 'scan'), ('jax', 'scan'))} |")
    return "\n".join(out)


def growth_table(runs, depths):
    lo, hi = depths[0], depths[-1]
    out = [f"## growth with depth: {' → '.join(map(str, depths))} layers (medians; in brackets "
           f"depth {hi} / depth {lo})", "",
           "| measure | nitro unrolled | nitro scan | JAX unrolled | JAX scan |",
           "| --- | --- | --- | --- | --- |"]
    for label, dec, nitro_f, jax_f, _, grows in FIGURES:
        if not grows:
            continue
        cells = []
        for side, _ in SIDES:
            for form in FORMS:
                f = nitro_f if side == "nitro" else jax_f
                meds = [cell(pick(runs, d, side, form, f), dec)[1] for d in depths]
                cells.append(" → ".join(fmt(m, dec) for m in meds) + f" ({ratio(meds[-1], meds[0])})")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def warnings(runs):
    """nitro runs that were not cold: a program hit in memory or loaded from a store."""
    out = []
    for run in runs:
        r = run["result"]
        if run["side"] == "nitro" and (r.get("programs_hit") or r.get("programs_loaded")):
            out.append(f"warning: nitro {run['form']} depth {run['depth']} round {run['round']} "
                       f"was not cold: {r.get('programs_hit')} programs hit, "
                       f"{r.get('programs_loaded')} loaded")
    return out


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: scan_table.py RUNS.jsonl")
    with open(sys.argv[1]) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    if not runs:
        raise SystemExit(f"error: {sys.argv[1]} holds no runs")
    depths = sorted({run["depth"] for run in runs})
    print(backend_line(runs))
    print()
    for depth in depths:
        print(depth_table(runs, depth))
        print()
    if len(depths) > 1:
        print(growth_table(runs, depths))
        print()
    for line in warnings(runs):
        print(line)
        print()
    print(FOOTNOTES)


if __name__ == "__main__":
    main()
