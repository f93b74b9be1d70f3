#!/usr/bin/env bash
# Generation: nitro::generate (the generate_bench example) against its JAX twin
# (bench/twin_generate.py), on the same weights, prompts and declaration, in the same run on the
# same machine, and nitro's generator against chargpt's full-window recompute (--sample-mode
# recompute). Prints one table: each figure for nitro, for JAX, and nitro/JAX.
#
#   bench/generate_bench.sh                    # from the repository root
#   ROUNDS=3 SLOTS=32 bench/generate_bench.sh
#
# Build first (the script never builds):
#   cargo build --release -p nitro-examples --example generate_bench --example chargpt
# JAX runs from a throwaway virtual environment ($VENV, made here with python3 -m venv and
# pip install jax==0.10.2 safetensors numpy when absent); JAX is never a dependency of nitro.
#
# Environment:
#   ROUNDS        alternating rounds of each measurement (2)
#   SLOTS         slots of the many-slot generators (32)
#   TRAIN_STEPS   chargpt steps trained for the weights (300; 0: the seed's random weights)
#   STARTS        process-start measurements per side (3)
#   FLOOR         1: also the bandwidth-floor model (8 blocks of width 1024, 403 MB of weights)
#   VENV          the JAX venv (/tmp/jaxvenv); PY overrides its python
#   OUT           results directory (target/generate-bench): bundles, caches, raw/ JSON lines,
#                 table.md. Only paths under it that the script names are removed.
set -euo pipefail

ROUNDS=${ROUNDS:-2}
SLOTS=${SLOTS:-32}
TRAIN_STEPS=${TRAIN_STEPS:-300}
STARTS=${STARTS:-3}
FLOOR=${FLOOR:-1}
VENV=${VENV:-/tmp/jaxvenv}
PY=${PY:-$VENV/bin/python}
OUT=${OUT:-target/generate-bench}
BIN=./target/release/examples

die() { echo "generate_bench: error: $*" >&2; exit 1; }
say() { echo "generate_bench: $*" >&2; }

[[ -f bench/twin_generate.py ]] || die "run from the repository root"
for b in generate_bench chargpt; do
    [[ -x $BIN/$b ]] || die "$BIN/$b is missing: cargo build --release -p nitro-examples --example generate_bench --example chargpt"
done
if ! "$PY" -c 'import jax, numpy, safetensors' 2>/dev/null; then
    say "making the JAX venv in $VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q jax==0.10.2 safetensors numpy
    PY=$VENV/bin/python
fi
jax_version=$("$PY" -c 'import jax; print(jax.__version__)')

mkdir -p "$OUT/raw"
rm -f "$OUT"/raw/*.json "$OUT/table.md"
now() { date +%s.%N; }

# run NAME CMD...: CMD's last JSON line into raw/NAME.json (stderr to raw/NAME.err).
run() {
    local name=$1
    shift
    say "$name"
    "$@" >"$OUT/raw/$name.out" 2>"$OUT/raw/$name.err" || { tail -n 20 "$OUT/raw/$name.err" >&2; die "$name failed: $*"; }
    grep '^{' "$OUT/raw/$name.out" | tail -n 1 >"$OUT/raw/$name.json"
}
# start NAME CMD...: like run, adding start_to_first_token_ms (the first token's wall clock minus
# the launch's).
start() {
    local name=$1 t0
    shift
    t0=$(now)
    run "$name" "$@"
    "$PY" - "$OUT/raw/$name.json" "$t0" <<'EOF'
import json, sys
path, t0 = sys.argv[1], float(sys.argv[2])
d = json.load(open(path))
d["start_to_first_token_ms"] = (d["first_token_unix"] - t0) * 1e3
json.dump(d, open(path, "w"))
EOF
}

# The weights: chargpt at its default shape trained briefly, or the seed's.
bundle=$OUT/bundle
rm -rf "$bundle" "$OUT/bundle-floor"
if [[ $TRAIN_STEPS -gt 0 ]]; then
    rm -f "$OUT/trained.safetensors"
    run train env NITRO_CACHE_DIR="$OUT/train-cache" "$BIN/chargpt" --steps "$TRAIN_STEPS" --dropout 0 \
        --checkpoint "$OUT/trained.safetensors" --json
    "$BIN/generate_bench" --bundle "$bundle" --write --weights "$OUT/trained.safetensors" >/dev/null
else
    "$BIN/generate_bench" --bundle "$bundle" --write >/dev/null
fi

for ((r = 1; r <= ROUNDS; r++)); do
    nc=$OUT/nitro-cache-$r jc=$OUT/jax-cache-$r
    rm -rf "$nc" "$jc"
    run "nitro-cold-$r" env NITRO_CACHE_DIR="$nc" "$BIN/generate_bench" --bundle "$bundle" --slots "$SLOTS" --json
    run "jax-cold-$r" "$PY" bench/twin_generate.py "$bundle" --slots "$SLOTS" --cache "$jc"
    run "nitro-warm-$r" env NITRO_CACHE_DIR="$nc" "$BIN/generate_bench" --bundle "$bundle" --slots "$SLOTS" --json
    run "jax-warm-$r" "$PY" bench/twin_generate.py "$bundle" --slots "$SLOTS" --cache "$jc"
done
for ((s = 1; s <= STARTS; s++)); do
    start "nitro-start-$s" env NITRO_CACHE_DIR="$OUT/nitro-cache-1" "$BIN/generate_bench" --bundle "$bundle" --mode start --json
    start "jax-start-$s" "$PY" bench/twin_generate.py "$bundle" --mode start --cache "$OUT/jax-cache-1"
    start "jaxlazy-start-$s" "$PY" bench/twin_generate.py "$bundle" --mode start --lazy --cache "$OUT/jax-cache-1"
done
# The recompute path against the generator, at chargpt's default shape (1 slot, 200 characters).
for ((r = 1; r <= ROUNDS; r++)); do
    for mode in cache recompute; do
        run "chargpt-$mode-$r" env NITRO_CACHE_DIR="$OUT/chargpt-cache" "$BIN/chargpt" --steps 20 --sample 200 \
            --sample-mode "$mode" --json
    done
done
if [[ $FLOOR == 1 ]]; then
    fb=$OUT/bundle-floor
    "$BIN/generate_bench" --bundle "$fb" --write --layers 8 --width 1024 --heads 16 --context 128 --buckets 16 >/dev/null
    rm -rf "$OUT/nitro-cache-floor" "$OUT/jax-cache-floor"
    run nitro-floor env NITRO_CACHE_DIR="$OUT/nitro-cache-floor" "$BIN/generate_bench" --bundle "$fb" --mode floor --json
    run jax-floor "$PY" bench/twin_generate.py "$fb" --mode floor --cache "$OUT/jax-cache-floor"
fi

{
    echo "# generation: nitro vs JAX twin — $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo
    model_name=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1 || true)
    echo "Machine: $(nproc) cores${model_name:+, $model_name}, load average $(cut -d' ' -f1-3 /proc/loadavg); ROUNDS=$ROUNDS SLOTS=$SLOTS TRAIN_STEPS=$TRAIN_STEPS; jax $jax_version."
    echo
    "$PY" - "$OUT/raw" "$SLOTS" <<'EOF'
import glob, json, os, statistics, sys
raw, slots = sys.argv[1], int(sys.argv[2])
def load(pattern):
    return [json.load(open(p)) for p in sorted(glob.glob(os.path.join(raw, pattern + ".json")))]
def runs(docs, key):
    out = []
    for d in docs:
        v = d.get("runs", {}).get(key)
        out += v if isinstance(v, list) else []
    return out
def med(v):
    return statistics.median(v) if v else float("nan")
def spread(v):
    return f"{min(v):.4g}–{max(v):.4g}" if v else ""
nw, jw, nc, jc = load("nitro-warm-*"), load("jax-warm-*"), load("nitro-cold-*"), load("jax-cold-*")
table = []
for label, key, goal, low in [("decode tokens/s, 1 slot", "decode1", 1.25, False),
                              (f"decode tokens/s, {slots} slots", "decode_all", 1.25, False),
                              ("time to first token, 32-char prompt (ms)", "ttft32", 0.8, True),
                              ("time to first token, 120-char prompt (ms)", "ttft120", 0.8, True)]:
    nv, jv = runs(nw, key), runs(jw, key)
    table.append((label, med(nv), med(jv), spread(nv), spread(jv), goal, low))
ns = [d["start_to_first_token_ms"] for d in load("nitro-start-*")]
js = [d["start_to_first_token_ms"] for d in load("jax-start-*")]
jl = [d["start_to_first_token_ms"] for d in load("jaxlazy-start-*")]
table.append(("process start → first token, warm cache (ms)", med(ns), med(js), spread(ns), spread(js), 0.5, True))
table.append(("  … JAX compiling only the prefill it needs (ms)", med(ns), med(jl), spread(ns), spread(jl), 0.5, True))
print("| figure | nitro | JAX | nitro / JAX | goal | met |")
print("| --- | --- | --- | --- | --- | --- |")
for label, n, j, ns_, js_, goal, low in table:
    ratio = n / j
    ok = ratio <= goal if low else ratio >= goal
    print(f"| {label} | {n:.4g} ({ns_}) | {j:.4g} ({js_}) | {ratio:.2f} | {'≤' if low else '≥'} {goal} | {'yes' if ok else 'no'} |")
def comp(docs, key):
    return "/".join(str(d.get(key)) for d in docs)
inv = nc[0]["inventory"] if nc else "?"
print(f"| compiles, cold cache (inventory {inv}) | {comp(nc, 'compiles')} | {comp(jc, 'compiles')} | | = inventory | {'yes' if all(d['compiles'] == d['inventory'] for d in nc) else 'no'} |")
print(f"| compiles, warm cache | {comp(nw, 'compiles')} | {comp(jw, 'compiles')} | | 0 | {'yes' if all(d['compiles'] == 0 for d in nw) else 'no'} |")
mix = nw[0].get("mix_requests") if nw else "?"
print(f"| compiles after warm-up (nitro: a mix of {mix} requests) | {comp(nc + nw, 'compiles_after_warm_up')} | {comp(jc + jw, 'compiles_after_warm_up')} | | 0 | {'yes' if all(d['compiles_after_warm_up'] == 0 for d in nc + nw) else 'no'} |")
print(f"| warm-up: getting the inventory, cold (ms) | {med([d['warm_up_ms'] for d in nc]):.0f} | {med([d['warm_up_ms'] for d in jc]):.0f} | {med([d['warm_up_ms'] for d in nc]) / med([d['warm_up_ms'] for d in jc]):.2f} | | |")
print(f"| warm-up: getting the inventory, warm (ms) | {med([d['warm_up_ms'] for d in nw]):.0f} | {med([d['warm_up_ms'] for d in jw]):.0f} | {med([d['warm_up_ms'] for d in nw]) / med([d['warm_up_ms'] for d in jw]):.2f} | | |")
same = [a["greedy_text"] == b["greedy_text"] for a in nw for b in jw]
print()
print(f"Greedy text of the 32-character prompt (64 tokens), nitro: {nw[0]['greedy_text']!r}; "
      f"the same as JAX's in every pair of runs: {all(same)}.")
cache = [json.load(open(p))["decode_tokens_per_s"] for p in sorted(glob.glob(os.path.join(raw, "chargpt-cache-*.json")))]
rec = [json.load(open(p))["decode_tokens_per_s"] for p in sorted(glob.glob(os.path.join(raw, "chargpt-recompute-*.json")))]
if cache and rec:
    print()
    print("| chargpt --sample 200 (default shape, 1 slot) | tokens/s | runs |")
    print("| --- | --- | --- |")
    print(f"| --sample-mode cache (the generator) | {med(cache):.4g} | {spread(cache)} |")
    print(f"| --sample-mode recompute (full window, full batch) | {med(rec):.4g} | {spread(rec)} |")
    print(f"| cache / recompute (goal ≥ 200) | {med(cache) / med(rec):.0f}× | |")
nf, jf = load("nitro-floor"), load("jax-floor")
if nf and jf:
    n, j = nf[0], jf[0]
    floor = n["floor_tokens_per_s"]
    print()
    print(f"Bandwidth floor (8 blocks, width 1024, context 128, 1 slot): weights {n['weight_bytes'] / 1e6:.0f} MB + "
          f"KV cache row {n['kv_bytes_per_token'] / 1e6:.1f} MB = {n['bytes_per_token'] / 1e6:.0f} MB read per token; "
          f"copy bandwidth {n['copy_gb_per_s']:.1f} GB/s (read + write, every core) → floor {floor:.1f} tokens/s.")
    print()
    print("| 1-slot decode | tokens/s (runs) | fraction of the floor (goal ≥ 0.5) |")
    print("| --- | --- | --- |")
    print(f"| nitro | {n['decode_tokens_per_s_1']:.1f} ({spread(n['decode_runs'])}) | {n['decode_tokens_per_s_1'] / floor:.2f} |")
    print(f"| JAX | {j['decode_tokens_per_s_1']:.1f} ({spread(j['decode_runs'])}) | {j['decode_tokens_per_s_1'] / floor:.2f} |")
EOF
} | tee "$OUT/table.md"
say "wrote $OUT/table.md and $OUT/raw/"
