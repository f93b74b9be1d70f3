#!/usr/bin/env bash
# XLA compile settings on the installed plugin: the chargpt and fashion examples run cold (empty
# compile cache) and warm (the same cache) under each setting of XLA_FLAGS, rounds interleaved,
# and bench/flags_table.py prints each figure's median and its ratio to the run without flags.
#
#   bench/flags_bench.sh                    # from the repository root, after
#   cargo build --release -p nitro-examples --examples
#   ROUNDS=5 OUT=target/flags-bench bench/flags_bench.sh
#
# XLA_FLAGS is part of nitro's backend identity, so each setting compiles into its own store
# entries (a setting never loads another's programs). Writes $OUT/runs.jsonl (one line per
# setting, model and round: the cold and the warm run's JSON lines) and $OUT/table.md.
set -euo pipefail

ROUNDS=${ROUNDS:-3}
OUT=${OUT:-target/flags-bench}
BIN=./target/release/examples
SETTINGS=(
    "none="
    "fast_compile=--xla_cpu_opt_preset=FAST_COMPILE"
    "opt_level_1=--xla_backend_optimization_level=1"
    "codegen_split_4=--xla_cpu_parallel_codegen_split_count=4"
    "no_ynn_fusion=--xla_cpu_experimental_ynn_fusion_type="
)

die() { echo "flags_bench: error: $*" >&2; exit 1; }
for m in chargpt fashion; do
    [[ -x "$BIN/$m" ]] || die "$BIN/$m is missing: cargo build --release -p nitro-examples --examples"
done
mkdir -p "$OUT"
RUNS="$OUT/runs.jsonl"
: >"$RUNS"
for ((r = 1; r <= ROUNDS; r++)); do
    for setting in "${SETTINGS[@]}"; do
        name=${setting%%=*}
        flags=${setting#*=}
        for m in chargpt fashion; do
            if [[ $m == chargpt ]]; then
                args=(--steps 60 --json --serial-compiles)
            else
                args=(--epochs 1 --train-rows 6000 --json --serial-compiles)
            fi
            cache="$OUT/cache"
            rm -rf "$cache"
            echo "flags_bench: round $r/$ROUNDS $m $name" >&2
            cold=$(XLA_FLAGS="$flags" NITRO_CACHE_DIR="$cache" "$BIN/$m" "${args[@]}" 2>/dev/null \
                | grep '^{' | tail -n 1)
            warm=$(XLA_FLAGS="$flags" NITRO_CACHE_DIR="$cache" "$BIN/$m" "${args[@]}" 2>/dev/null \
                | grep '^{' | tail -n 1)
            [[ -n "$cold" && -n "$warm" ]] || die "$m under '$flags' printed no JSON line"
            echo "{\"round\":$r,\"flags\":\"$name\",\"model\":\"$m\",\"cold\":$cold,\"warm\":$warm}" >>"$RUNS"
        done
    done
done
python3 bench/flags_table.py "$RUNS" | tee "$OUT/table.md"
