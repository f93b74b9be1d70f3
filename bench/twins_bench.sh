#!/usr/bin/env bash
# nitro against its JAX twins on this machine: the fashion and chargpt examples and
# bench/twin_fashion.py / bench/twin_chargpt.py, the same run (same model, initial weights,
# batches and schedule, from a twin bundle) on both sides, with a cold and a warm compile cache.
#
#   bench/twins_bench.sh                       # from the repository root
#   ROUNDS=5 PY=/path/to/venv/bin/python bench/twins_bench.sh
#   SHORT=1 ROUNDS=1 bench/twins_bench.sh       # a quick check of the driver (a couple of minutes)
#
# Build the nitro examples first (this script never builds):
#   cargo build --release -p nitro-examples --examples
# and give the twins a throwaway virtual environment (JAX is never a dependency of nitro):
#   python3 -m venv /tmp/jaxvenv && /tmp/jaxvenv/bin/pip install jax==0.10.2 safetensors numpy
#
# Environment:
#   ROUNDS  rounds per model (3); each round runs nitro cold, nitro warm, JAX cold, JAX warm
#   PY      the Python that runs the twins (python3); needs jax==0.10.2, safetensors, numpy
#   OUT     results directory (target/twins-bench)
#   SHORT   1: small runs for testing the driver (fashion --train-rows 1280; chargpt --steps 20
#           --layers 1) instead of the benchmark's (fashion --epochs 1 --train-rows 12800;
#           chargpt --steps 200, its default shape)
#   MODELS  which models, in order ("fashion chargpt")
#   BASE_BIN  a directory of other nitro example binaries (an older build: before/after in one
#           run); when set, each round also runs them cold and warm, as side "base", between
#           nitro's runs and JAX's, and the table adds their column and ratios
#   EXTRA   extra arguments for both nitro sides (e.g. "--layers 8")
#   CHARGPT_STEPS  chargpt's --steps outside SHORT runs (200): fewer for the deep rows
#   JAX_PLUGIN  a PJRT plugin for the twins (--pjrt-plugin): JAX then compiles and runs on that
#           XLA build — nitro's own plugin, so that only the programs differ — instead of
#           jaxlib's CPU backend
#
# Writes under $OUT: bundle-MODEL/ (the twin bundle), raw/MODEL-rR-SIDE-CACHE.{json,out,err}
# (each run's JSON line, its whole stdout and its stderr), runs.jsonl (one line per run: the
# JSON line with the externally measured wall time and peak RSS), table.md (what is printed),
# and the compile caches nitro-cache-MODEL-R/, base-cache-MODEL-R/ and jax-cache-MODEL-R/ (emptied
# at each round's start). Only those paths are removed, never $OUT itself.
set -euo pipefail

ROUNDS=${ROUNDS:-3}
PY=${PY:-python3}
OUT=${OUT:-target/twins-bench}
SHORT=${SHORT:-0}
MODELS=${MODELS:-"fashion chargpt"}
CHARGPT_STEPS=${CHARGPT_STEPS:-200}
BASE_BIN=${BASE_BIN:-}
read -r -a EXTRA_ARGS <<<"${EXTRA:-}"
JAX_ARGS=()
[[ -z "${JAX_PLUGIN:-}" ]] || JAX_ARGS=(--pjrt-plugin "$JAX_PLUGIN")

die() { echo "twins_bench: error: $*" >&2; exit 1; }
say() { echo "twins_bench: $*" >&2; }

[[ -f bench/twin_common.py && -f bench/twins_table.py ]] \
    || die "run from the repository root (bench/twin_common.py not found in $(pwd))"
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "ROUNDS must be a positive integer, not '$ROUNDS'"

NITRO_BIN=./target/release/examples
for model in $MODELS; do
    case "$model" in
        fashion | chargpt) ;;
        *) die "unknown model '$model' in MODELS (fashion, chargpt)" ;;
    esac
    [[ -x "$NITRO_BIN/$model" ]] || die "$NITRO_BIN/$model is missing: build the examples first with
    cargo build --release -p nitro-examples --examples"
    [[ -z "$BASE_BIN" || -x "$BASE_BIN/$model" ]] || die "BASE_BIN=$BASE_BIN has no $model binary"
done

command -v "$PY" >/dev/null 2>&1 || die "PY='$PY' is not a Python found on PATH"
jax_version=$("$PY" -c 'import jax, numpy, safetensors; print(jax.__version__)' 2>/dev/null) \
    || die "PY='$PY' cannot import jax, numpy and safetensors; make a throwaway venv:
    python3 -m venv /tmp/jaxvenv && /tmp/jaxvenv/bin/pip install jax==0.10.2 safetensors numpy
    and run with PY=/tmp/jaxvenv/bin/python"
[[ "$jax_version" == 0.10.2 ]] || say "warning: the twins are written for jax 0.10.2; PY has jax $jax_version"

# External measurement: wall time from `date +%s.%N` around the process; peak RSS from GNU time's
# %M (kilobytes) when /usr/bin/time is GNU time, else not measured (null).
if /usr/bin/time -f '%M' -o /dev/null true >/dev/null 2>&1; then
    HAVE_TIME=1
else
    HAVE_TIME=0
    say "warning: no GNU /usr/bin/time: the external peak RSS is not measured (null)"
fi

if [[ "$SHORT" == 1 ]]; then
    FASHION_ARGS=(--epochs 1 --train-rows 1280 --json --serial-compiles)
    CHARGPT_ARGS=(--steps 20 --layers 1 --json --serial-compiles)
else
    FASHION_ARGS=(--epochs 1 --train-rows 12800 --json --serial-compiles)
    CHARGPT_ARGS=(--steps "$CHARGPT_STEPS" --json --serial-compiles)
fi
FASHION_ARGS+=("${EXTRA_ARGS[@]}")
CHARGPT_ARGS+=("${EXTRA_ARGS[@]}")

mkdir -p "$OUT/raw"
rm -f "$OUT"/raw/* "$OUT/runs.jsonl" "$OUT/table.md"
RUNS="$OUT/runs.jsonl"
: >"$RUNS"

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

now() { date +%s.%N; }

# run_one MODEL ROUND SIDE CACHE CMD... : runs CMD, keeps its stdout/stderr and JSON line under
# raw/, appends the run's record to runs.jsonl.
run_one() {
    local model=$1 round=$2 side=$3 cache=$4
    shift 4
    local base="$OUT/raw/$model-r$round-$side-$cache"
    local started ended rss=null
    say "round $round/$ROUNDS $model: $side $cache"
    started=$(now)
    if [[ $HAVE_TIME == 1 ]]; then
        if ! /usr/bin/time -f '%M' -o "$base.time" "$@" >"$base.out" 2>"$base.err"; then
            tail -n 20 "$base.err" >&2
            die "$model $side $cache (round $round) failed: $*  (stderr: $base.err)"
        fi
    else
        if ! "$@" >"$base.out" 2>"$base.err"; then
            tail -n 20 "$base.err" >&2
            die "$model $side $cache (round $round) failed: $*  (stderr: $base.err)"
        fi
    fi
    ended=$(now)
    if [[ $HAVE_TIME == 1 ]]; then
        rss=$(tail -n 1 "$base.time")
        rm -f "$base.time"
        [[ "$rss" =~ ^[0-9]+$ ]] || rss=null
    fi
    grep '^{' "$base.out" | tail -n 1 >"$base.json" || true
    [[ -s "$base.json" ]] || die "$model $side $cache (round $round) printed no JSON line (see $base.out)"
    "$PY" - "$base.json" "$model" "$round" "$side" "$cache" "$started" "$ended" "$rss" >>"$RUNS" <<'EOF'
import json, sys
path, model, rnd, side, cache, started, ended, rss = sys.argv[1:]
with open(path) as f:
    result = json.loads(f.read())
print(json.dumps({"model": model, "round": int(rnd), "side": side, "cache": cache,
                  "wall_s": round(float(ended) - float(started), 4),
                  "max_rss_kb": None if rss == "null" else int(rss), "result": result}))
EOF
}

for model in $MODELS; do
    if [[ $model == fashion ]]; then args=("${FASHION_ARGS[@]}"); else args=("${CHARGPT_ARGS[@]}"); fi
    bundle="$OUT/bundle-$model"
    rm -rf "$bundle"
    say "$model: writing the twin bundle ($NITRO_BIN/$model ${args[*]} --twin $bundle)"
    if ! NITRO_CACHE_DIR="$TMP/bundle-cache-$model" "$NITRO_BIN/$model" "${args[@]}" --twin "$bundle" \
        >"$OUT/raw/$model-bundle.out" 2>"$OUT/raw/$model-bundle.err"; then
        tail -n 20 "$OUT/raw/$model-bundle.err" >&2
        die "$model: writing the twin bundle failed"
    fi
    [[ -f "$bundle/run.json" ]] || die "$model: no $bundle/run.json after --twin"
    for ((r = 1; r <= ROUNDS; r++)); do
        ncache="$OUT/nitro-cache-$model-$r"
        jcache="$OUT/jax-cache-$model-$r"
        bcache="$OUT/base-cache-$model-$r"
        rm -rf "$ncache" "$jcache" "$bcache"
        run_one "$model" "$r" nitro cold env NITRO_CACHE_DIR="$ncache" "$NITRO_BIN/$model" "${args[@]}"
        run_one "$model" "$r" nitro warm env NITRO_CACHE_DIR="$ncache" "$NITRO_BIN/$model" "${args[@]}"
        if [[ -n "$BASE_BIN" ]]; then
            run_one "$model" "$r" base cold env NITRO_CACHE_DIR="$bcache" "$BASE_BIN/$model" "${args[@]}"
            run_one "$model" "$r" base warm env NITRO_CACHE_DIR="$bcache" "$BASE_BIN/$model" "${args[@]}"
        fi
        run_one "$model" "$r" jax cold "$PY" "bench/twin_$model.py" "$bundle" --json --cache "$jcache" \
            ${JAX_ARGS[@]+"${JAX_ARGS[@]}"}
        run_one "$model" "$r" jax warm "$PY" "bench/twin_$model.py" "$bundle" --json --cache "$jcache" \
            ${JAX_ARGS[@]+"${JAX_ARGS[@]}"}
    done
done

{
    echo "# nitro vs JAX twins — $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo
    model_name=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1 || true)
    echo "Machine: $(nproc) cores${model_name:+, $model_name}, $(uname -sr); ROUNDS=$ROUNDS SHORT=$SHORT; jax $jax_version."
    echo "fashion: \`fashion ${FASHION_ARGS[*]}\`; chargpt: \`chargpt ${CHARGPT_ARGS[*]}\`."
    echo
    "$PY" bench/twins_table.py "$RUNS"
} | tee "$OUT/table.md"
say "wrote $OUT/table.md, $RUNS and $OUT/raw/"
