"""The markdown tables of bench/twins_bench.sh: reads its runs.jsonl (one line per run: model,
round, side nitro|base|jax (base: an older nitro build, when the bench ran one), cache cold|warm, the externally measured wall_s and max_rss_kb, and the
run's own JSON line as `result`) and prints, per model, the median over the rounds of each figure
on both sides (with the range when there is more than one round) and the ratio of the medians,
nitro / JAX. Standard library only.

    python3 bench/twins_table.py target/twins-bench/runs.jsonl
"""

import json
import os
import re
import statistics
import sys

QUALITY = {"fashion": ("test accuracy", "test_accuracy", 4),
           "chargpt": ("held-out bits per char", "val_bits_per_char", 4)}


def nitro_programs(r, names):
    progs = r.get("compile_ms_by_program") or {}
    if not all(isinstance(progs.get(n), (int, float)) for n in names):
        return None
    return sum(progs[n] for n in names)


def nitro_all_programs(r):
    progs = r.get("compile_ms_by_program") or {}
    return sum(progs.values()) if progs else None


def jax_all_programs(r):
    return r["compile_ms"] + r["eval_compile_ms"]


# (label, cache of the runs it is taken from ("cold", "warm" or "both"), decimals,
#  nitro's figure, JAX's figure); a figure is f(run record) -> number or None.
def rows(model):
    q_label, q_field, q_dec = QUALITY[model]

    def res(field):
        return lambda run: run["result"].get(field)

    def rss_mb(run):
        return None if run["max_rss_kb"] is None else run["max_rss_kb"] / 1024

    return [
        ("steady step, waited (ms) ¹", "warm", 2, res("step_ms"), res("step_ms")),
        ("steady step, pipelined (ms) ²", "warm", 2, res("step_ms_pipelined"), res("step_ms_pipelined")),
        ("gradient program, XLA compile, cold (ms) ³", "cold", 0,
         lambda run: nitro_programs(run["result"], ["grad"]), res("compile_ms")),
        ("gradient + update programs, XLA compile, cold (ms) ³", "cold", 0,
         lambda run: nitro_programs(run["result"], ["grad", "update"]), res("compile_ms")),
        ("every program (+ eval), XLA compile, cold (ms) ⁴", "cold", 0,
         lambda run: nitro_all_programs(run["result"]), lambda run: jax_all_programs(run["result"])),
        ("gradient + update programs, warm: cache load (ms) ⁵", "warm", 1,
         lambda run: nitro_programs(run["result"], ["grad", "update"]), res("compile_ms")),
        ("first step, cold (ms) ⁶", "cold", 0, res("first_step_ms"), res("first_step_ms")),
        ("first step, warm (ms) ⁶", "warm", 1, res("first_step_ms"), res("first_step_ms")),
        ("whole process, cold (s, external) ⁷", "cold", 2, lambda run: run["wall_s"], lambda run: run["wall_s"]),
        ("whole process, warm (s, external) ⁷", "warm", 2, lambda run: run["wall_s"], lambda run: run["wall_s"]),
        ("peak RSS, cold (MB, external) ⁸", "cold", 0, rss_mb, rss_mb),
        ("peak RSS, warm (MB, external) ⁸", "warm", 0, rss_mb, rss_mb),
        ("peak RSS, warm (MB, self-reported) ⁸", "warm", 0, res("peak_rss_mb"), res("peak_rss_mb")),
        (f"{q_label} ⁹", "both", q_dec, res(q_field), res(q_field)),
    ]


FOOTNOTES = """\
Each cell: the median over the rounds [min–max, when they differ]; the ratio is of the
medians, nitro / JAX. "cold": a fresh, empty compile cache (nitro's `NITRO_CACHE_DIR`, JAX's
`--cache DIR`); "warm": the same run again on that cache.

1. `step_ms`, from the warm runs: the median of steps each timed alone (everything before it
   finished, its results waited for), the batch uploaded from host memory.
2. `step_ms_pipelined`, from the warm runs: training wall time over steps, steps enqueued back to
   back. nitro's is its last (here: only) epoch's wall, which starts at its first enqueue and so
   includes the first step (trace + a cache load when warm); the twin's starts after its compile
   and leaves out evaluation.
3. nitro's `compile_ms_by_program.grad` (and `+ update`) against the twin's `compile_ms`: JAX's
   train step is one program, the gradient and the optimizer's update fused, while nitro compiles
   the update as a separate program, so the JAX figure is set against nitro's gradient program
   alone and against nitro's two programs' sum. nitro runs with `--serial-compiles` (one program
   after another, each compile uncontended).
4. nitro: the sum of `compile_ms_by_program` (grad, update, eval); JAX: `compile_ms +
   eval_compile_ms`.
5. The same fields in the warm runs: what a compile costs when the persistent cache has it.
6. `first_step_ms`. nitro: from the training handle's creation to the first step's end, every
   program compiled (or loaded) first; the twin: from just before lowering the train step to its
   first loss ready (the evaluation program is compiled after it). JAX traces and lowers in
   every process (its persistent cache is keyed by the lowered program), so its warm first step
   still pays `lower_ms`.
7. The process's wall time measured outside it (`date +%s.%N` before and after, the
   interpreter's start and JAX's import included), evaluation included.
8. External: GNU time's `%M` (maximum resident set size) / 1024 (— without GNU time).
   Self-reported: the JSON's `peak_rss_mb` (nitro's `VmHWM` from /proc/self/status; the twin's
   `ru_maxrss` / 1024).
9. From every run, cold and warm (each side's runs should repeat one value: a range says they
   did not). The twin trains the same model from the same initial weights and batches;
   chargpt's dropout masks differ, so its figure matches only statistically."""


def fmt(x, dec):
    return "—" if x is None else f"{x:.{dec}f}"


def cell(values, dec):
    values = [v for v in values if v is not None]
    if not values:
        return "—", None
    m = statistics.median(values)
    text = fmt(m, dec)
    lo, hi = fmt(min(values), dec), fmt(max(values), dec)
    if lo != hi:
        text += f" [{lo}–{hi}]"
    return text, m


def backend_line(runs):
    def of(side):
        return [run["result"] for run in runs if run["side"] == side]

    nitro, jax = of("nitro"), of("jax")
    parts = []
    if nitro:
        plugin = nitro[0].get("plugin") or nitro[0].get("backend") or "?"
        plugin = re.sub(r"plugin (\S+)", lambda m: "plugin " + os.path.basename(m.group(1)), str(plugin))
        parts.append(f"nitro: {plugin}")
    if jax:
        where = jax[0].get("backend", "?")
        if jax[0].get("pjrt_plugin"):
            where += f" through the PJRT plugin {jax[0]['pjrt_plugin']} (nitro's XLA build)"
        parts.append(f"JAX {jax[0].get('jax', '?')} on {where}")
    return "; ".join(parts)


def table(model, runs):
    rounds = sorted({run["round"] for run in runs})
    base = any(run["side"] == "base" for run in runs)
    out = [f"## {model} ({len(rounds)} round{'s' if len(rounds) != 1 else ''})", "",
           backend_line(runs), ""]
    if base:
        out += ["| measure | nitro | base | JAX | nitro / JAX | base / JAX | nitro / base |",
                "| --- | --- | --- | --- | --- | --- | --- |"]
    else:
        out += ["| measure | nitro | JAX | nitro / JAX |", "| --- | --- | --- | --- |"]
    for label, cache, dec, nitro_f, jax_f in rows(model):
        def pick(side, f):
            vals = []
            for run in runs:
                if run["side"] == side and (cache == "both" or run["cache"] == cache):
                    try:
                        vals.append(f(run))
                    except (KeyError, TypeError):
                        vals.append(None)
            return vals

        def ratio(a, b):
            return f"{a / b:.2f}×" if a is not None and b else "—"

        n_text, n_med = cell(pick("nitro", nitro_f), dec)
        j_text, j_med = cell(pick("jax", jax_f), dec)
        if base:
            b_text, b_med = cell(pick("base", nitro_f), dec)
            out.append(f"| {label} | {n_text} | {b_text} | {j_text} | {ratio(n_med, j_med)} | "
                       f"{ratio(b_med, j_med)} | {ratio(n_med, b_med)} |")
        else:
            out.append(f"| {label} | {n_text} | {j_text} | {ratio(n_med, j_med)} |")
    return "\n".join(out)


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: twins_table.py RUNS.jsonl")
    with open(sys.argv[1]) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    if not runs:
        raise SystemExit(f"error: {sys.argv[1]} holds no runs")
    models = []
    for run in runs:
        if run["model"] not in models:
            models.append(run["model"])
    for model in models:
        print(table(model, [run for run in runs if run["model"] == model]))
        print()
    print(FOOTNOTES)


if __name__ == "__main__":
    main()
