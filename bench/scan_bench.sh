#!/usr/bin/env bash
# Scan over layers against unrolled blocks, on both sides: nitro's chargpt with and without
# `--scan` (its transformer blocks one scan over stacked parameters, or one copy each in the
# program) and its JAX twin (bench/twin_chargpt.py) with `--form scan` (one jax.lax.scan over
# the stacked leaves) and `--form unrolled` (a Python loop), at several depths, every run cold.
#
#   PY=/tmp/jaxvenv-a/bin/python bench/scan_bench.sh                 # from the repository root
#   PY=/tmp/jaxvenv-a/bin/python DEPTHS="2 8" ROUNDS=3 bench/scan_bench.sh
#   PY=/tmp/jaxvenv-a/bin/python DEPTHS="1 2" STEPS=3 ROUNDS=1 \
#       CHARGPT_ARGS="--width 32 --context 16 --batch 4" bench/scan_bench.sh   # a check of the driver
#
# Build the example first (this script never builds):
#   cargo build --release -p nitro-examples --example chargpt
# and give the twin a throwaway virtual environment (JAX is never a dependency of nitro):
#   python3 -m venv /tmp/jaxvenv-a && /tmp/jaxvenv-a/bin/pip install jax==0.10.2 safetensors numpy
#
# Environment:
#   DEPTHS        the layer counts (2 8 24)
#   STEPS         optimizer steps of every run (20)
#   ROUNDS        rounds (2); each round runs every depth's four configurations, in the order
#                 nitro unrolled, nitro scan, JAX unrolled, JAX scan
#   PY            the Python that runs the twin (python3); needs jax==0.10.2, safetensors, numpy
#   OUT           results directory (target/scan-bench)
#   CHARGPT_ARGS  more chargpt flags, for every nitro run and the bundles (""): the model's shape
#                 (--width, --heads, --context, --batch), --dropout, --remat, --seed, ...; the
#                 twin reads them from the bundle
#
# Every run is cold: nitro on a fresh, empty NITRO_CACHE_DIR (a `mktemp -d`, removed after),
# with --serial-compiles (each program's compile uncontended); the twin without --cache, and
# with JAX_COMPILATION_CACHE_DIR unset, so nothing persists between its runs. The twin trains
# from a bundle nitro writes once per depth (`chargpt --scan --twin`, before the rounds, not
# timed): the same bundle for both JAX forms.
#
# Writes under $OUT: bundle-DEPTH/ (the twin bundles), raw/dDEPTH-rR-SIDE-FORM.{json,out,err}
# (each run's JSON line, its whole stdout and its stderr), runs.jsonl (one line per run: the
# JSON line with the externally measured wall time and peak RSS) and table.md (what is printed;
# `$PY bench/scan_table.py $OUT/runs.jsonl` remakes it). Only those paths are removed, never
# $OUT itself.
set -euo pipefail

DEPTHS=${DEPTHS:-"2 8 24"}
STEPS=${STEPS:-20}
ROUNDS=${ROUNDS:-2}
PY=${PY:-python3}
OUT=${OUT:-target/scan-bench}
CHARGPT_ARGS=${CHARGPT_ARGS:-}

die() { echo "scan_bench: error: $*" >&2; exit 1; }
say() { echo "scan_bench: $*" >&2; }

[[ -f bench/twin_chargpt.py && -f bench/scan_table.py ]] \
    || die "run from the repository root (bench/twin_chargpt.py not found in $(pwd))"
[[ "$ROUNDS" =~ ^[1-9][0-9]*$ ]] || die "ROUNDS must be a positive integer, not '$ROUNDS'"
[[ "$STEPS" =~ ^[1-9][0-9]*$ ]] || die "STEPS must be a positive integer, not '$STEPS'"
read -r -a depths <<<"$DEPTHS"
((${#depths[@]} > 0)) || die "DEPTHS is empty"
for d in "${depths[@]}"; do
    [[ "$d" =~ ^[1-9][0-9]*$ ]] || die "DEPTHS must be positive integers, not '$d'"
done
read -r -a extra <<<"$CHARGPT_ARGS"

CHARGPT=./target/release/examples/chargpt
[[ -x "$CHARGPT" ]] || die "$CHARGPT is missing: build it first with
    cargo build --release -p nitro-examples --example chargpt"

command -v "$PY" >/dev/null 2>&1 || die "PY='$PY' is not a Python found on PATH"
jax_version=$("$PY" -c 'import jax, numpy, safetensors; print(jax.__version__)' 2>/dev/null) \
    || die "PY='$PY' cannot import jax, numpy and safetensors; make a throwaway venv:
    python3 -m venv /tmp/jaxvenv-a && /tmp/jaxvenv-a/bin/pip install jax==0.10.2 safetensors numpy
    and run with PY=/tmp/jaxvenv-a/bin/python"
[[ "$jax_version" == 0.10.2 ]] || say "warning: the twin is written for jax 0.10.2; PY has jax $jax_version"

# External measurement: wall time from `date +%s.%N` around the process; peak RSS from GNU time's
# %M (kilobytes) when /usr/bin/time is GNU time, else not measured (null).
if /usr/bin/time -f '%M' -o /dev/null true >/dev/null 2>&1; then
    HAVE_TIME=1
else
    HAVE_TIME=0
    say "warning: no GNU /usr/bin/time: the external peak RSS is not measured (null)"
fi

NITRO_ARGS=(--steps "$STEPS" --json --serial-compiles "${extra[@]}")

mkdir -p "$OUT/raw"
rm -f "$OUT"/raw/* "$OUT/runs.jsonl" "$OUT/table.md"
RUNS="$OUT/runs.jsonl"
: >"$RUNS"

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

now() { date +%s.%N; }

# run_one DEPTH ROUND SIDE FORM CMD... : runs CMD, keeps its stdout/stderr and JSON line under
# raw/, appends the run's record to runs.jsonl.
run_one() {
    local depth=$1 round=$2 side=$3 form=$4
    shift 4
    local base="$OUT/raw/d$depth-r$round-$side-$form"
    local what="depth $depth $side $form (round $round)"
    local started ended rss=null
    say "round $round/$ROUNDS: depth $depth, $side $form"
    started=$(now)
    if [[ $HAVE_TIME == 1 ]]; then
        if ! /usr/bin/time -f '%M' -o "$base.time" "$@" >"$base.out" 2>"$base.err"; then
            tail -n 20 "$base.err" >&2
            die "$what failed: $*  (stderr: $base.err)"
        fi
    else
        if ! "$@" >"$base.out" 2>"$base.err"; then
            tail -n 20 "$base.err" >&2
            die "$what failed: $*  (stderr: $base.err)"
        fi
    fi
    ended=$(now)
    if [[ $HAVE_TIME == 1 ]]; then
        rss=$(tail -n 1 "$base.time")
        rm -f "$base.time"
        [[ "$rss" =~ ^[0-9]+$ ]] || rss=null
    fi
    grep '^{' "$base.out" | tail -n 1 >"$base.json" || true
    [[ -s "$base.json" ]] || die "$what printed no JSON line (see $base.out)"
    "$PY" - "$base.json" "$depth" "$round" "$side" "$form" "$started" "$ended" "$rss" >>"$RUNS" <<'EOF' \
        || die "$what: its JSON line is not the configuration's (see $base.json)"
import json, sys
path, depth, rnd, side, form, started, ended, rss = sys.argv[1:]
with open(path) as f:
    result = json.loads(f.read())
# The run must be the configuration asked for: its depth, and the blocks scanned or unrolled.
ran = ("scan" if result.get("scan") else "unrolled") if side == "nitro" else result.get("form")
if result.get("layers") != int(depth) or ran != form:
    sys.exit(f"ran layers {result.get('layers')} {ran}, asked for {depth} {form}")
print(json.dumps({"depth": int(depth), "round": int(rnd), "side": side, "form": form,
                  "wall_s": round(float(ended) - float(started), 4),
                  "max_rss_kb": None if rss == "null" else int(rss), "result": result}))
EOF
}

for d in "${depths[@]}"; do
    bundle="$OUT/bundle-$d"
    rm -rf "$bundle"
    say "depth $d: writing the twin bundle ($CHARGPT --layers $d --scan ${NITRO_ARGS[*]} --twin $bundle)"
    if ! NITRO_CACHE_DIR=$(mktemp -d -p "$TMP") "$CHARGPT" --layers "$d" --scan "${NITRO_ARGS[@]}" \
        --twin "$bundle" >"$OUT/raw/d$d-bundle.out" 2>"$OUT/raw/d$d-bundle.err"; then
        tail -n 20 "$OUT/raw/d$d-bundle.err" >&2
        die "depth $d: writing the twin bundle failed"
    fi
    [[ -f "$bundle/run.json" ]] || die "depth $d: no $bundle/run.json after --twin"
done

for ((r = 1; r <= ROUNDS; r++)); do
    for d in "${depths[@]}"; do
        for form in unrolled scan; do
            scan=()
            [[ $form == scan ]] && scan=(--scan)
            ncache=$(mktemp -d -p "$TMP")
            run_one "$d" "$r" nitro "$form" env NITRO_CACHE_DIR="$ncache" \
                "$CHARGPT" --layers "$d" "${scan[@]}" "${NITRO_ARGS[@]}"
            rm -rf "$ncache"
        done
        for form in unrolled scan; do
            run_one "$d" "$r" jax "$form" env -u JAX_COMPILATION_CACHE_DIR \
                "$PY" bench/twin_chargpt.py "$OUT/bundle-$d" --json --steps "$STEPS" --form "$form"
        done
    done
done

{
    echo "# scan over layers against unrolled blocks, nitro and JAX — $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo
    model_name=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1 || true)
    echo "Machine: $(nproc) cores${model_name:+, $model_name}, $(uname -sr); DEPTHS=\"$DEPTHS\" STEPS=$STEPS ROUNDS=$ROUNDS; jax $jax_version."
    echo "nitro: \`chargpt --layers D [--scan] ${NITRO_ARGS[*]}\`; JAX: \`twin_chargpt.py bundle-D --json --steps $STEPS --form unrolled|scan\` on the bundle of \`chargpt --layers D --scan ... --twin\`."
    echo
    "$PY" bench/scan_table.py "$RUNS"
} | tee "$OUT/table.md"
say "wrote $OUT/table.md, $RUNS and $OUT/raw/"
