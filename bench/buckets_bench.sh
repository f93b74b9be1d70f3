#!/usr/bin/env bash
# Shape buckets on the character model's documents (the fortunes, one per row, capped at the
# context): nitro with (a) one program at the largest length, (b) the planner's 4 buckets,
# (c) one program per distinct length — the recompile storm — each from an empty compile cache,
# compile time included; and the JAX twin (bench/twin_chargpt.py) on (a)'s and (b)'s bundles,
# the same documents, batches and buckets (its users' hand-made answer), from an empty cache.
#
#   PY=/tmp/jaxvenv/bin/python bench/buckets_bench.sh        # after cargo build --release -p nitro-examples --examples
#
# PY needs jax==0.10.2, safetensors and numpy (a throwaway venv, never a project dependency).
# FLAGS overrides the model and run (default: 1 block, 100 steps' worth of documents, dropout
# off so the twin's losses match nitro's). Writes $OUT (default target/buckets-bench): each
# run's JSON line, and table.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-target/buckets-bench}
FLAGS=${FLAGS:---layers 1 --steps 100 --dropout 0}
BIN=./target/release/examples/chargpt
[ -x "$BIN" ] || { echo "buckets_bench: build first: cargo build --release -p nitro-examples --examples" >&2; exit 2; }
"$PY" -c "import jax, numpy, safetensors" 2>/dev/null || { echo "buckets_bench: $PY lacks jax/numpy/safetensors: python3 -m venv V && V/bin/pip install jax==0.10.2 safetensors numpy" >&2; exit 2; }
mkdir -p "$OUT"
now() { date +%s.%N; }
for variant in "a 1" "b 4" "c 1000000"; do
    set -- $variant
    name=$1 k=$2
    cache=$(mktemp -d)
    twin=()
    [ "$name" != c ] && twin=(--twin "$OUT/bundle-$name")
    echo "buckets_bench: nitro ($name) --buckets $k" >&2
    t0=$(now)
    # shellcheck disable=SC2086
    NITRO_CACHE_DIR="$cache" "$BIN" --buckets "$k" $FLAGS --json "${twin[@]}" > "$OUT/nitro-$name.json"
    t1=$(now)
    echo "{\"wall_s\": $(awk "BEGIN{print $t1 - $t0}")}" > "$OUT/nitro-$name.wall.json"
    rm -rf "$cache"
    if [ "$name" != c ]; then
        jcache=$(mktemp -d)
        echo "buckets_bench: JAX ($name)" >&2
        t0=$(now)
        "$PY" bench/twin_chargpt.py "$OUT/bundle-$name" --json --cache "$jcache" > "$OUT/jax-$name.json"
        t1=$(now)
        echo "{\"wall_s\": $(awk "BEGIN{print $t1 - $t0}")}" > "$OUT/jax-$name.wall.json"
        rm -rf "$jcache"
    fi
done
"$PY" - "$OUT" <<'PYEOF' | tee "$OUT/table.md"
import json, sys, os
out = sys.argv[1]
def load(name):
    p = os.path.join(out, name + ".json")
    if not os.path.exists(p):
        return None
    d = json.loads(open(p).read().strip().splitlines()[-1])
    d.update(json.load(open(os.path.join(out, name + ".wall.json"))))
    return d
rows = [("a", "one program at the largest length"), ("b", "the planner's 4 buckets"), ("c", "one program per distinct length")]
print("| run | programs | buckets | padding waste | compile (s) | first step (s) | tokens/s, steady | tokens/s, end to end | process (s) | held-out bits/char |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for key, what in rows:
    n = load("nitro-" + key)
    if n:
        b = n.get("buckets") or []
        shown = str(b) if len(b) <= 6 else f"{len(b)} edges"
        print(f"| nitro ({key}) {what} | {n['inventory']} | {shown} | {100*n['padding_waste']:.1f}% | {n['compile_s']:.1f} | {n['first_step_ms']/1e3:.1f} | {n['tokens_per_s_steady']:.0f} | {n['tokens_per_s']:.0f} | {n['wall_s']:.1f} | {n['val_bits_per_char']:.4f} |")
    j = load("jax-" + key)
    if j:
        comp = (j["compile_ms"] + j["eval_compile_ms"]) / 1e3
        print(f"| JAX ({key}) same buckets | {2*len(j['buckets'])} jitted | {j['buckets']} | {100*j['padding_waste_rows']:.1f}% | {comp:.1f} | {j['first_step_ms']/1e3:.1f} | {j['tokens_per_s']:.0f} | — | {j['wall_s']:.1f} | {j['val_bits_per_char']:.4f} |")
for key, _ in rows[:2]:
    n, j = load("nitro-" + key), load("jax-" + key)
    if n and j:
        print(f"\n({key}) end-to-end wall, nitro / JAX: {n['wall_s']/j['wall_s']:.2f}×; steady tokens/s, nitro / JAX: {n['tokens_per_s_steady']/j['tokens_per_s']:.2f}×")
PYEOF
