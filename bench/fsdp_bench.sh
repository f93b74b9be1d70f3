#!/usr/bin/env bash
# nitro's FSDP against JAX's, in one run on this machine: the chargpt example with --fsdp on
# DEVICES CPU devices, the same model replicated (Config::devices), and its JAX twin
# (bench/twin_chargpt.py --fsdp DEVICES: NamedSharding with the same per-leaf rule, on DEVICES
# host devices) on a twin bundle of the same weights and windows. Every run is cold (its own
# empty compile cache). nitro runs with --serial-compiles, so that each program's compile time
# is its own, and once more with the default (concurrent compiles) for the first step a user
# meets. nitro's first step counts from the handle, which places the parameters and the zeroed
# optimizer state at its first step; the twin's "first step from host" adds its own placement
# (device_put of the same) to its first call, so the two cover the same work.
#
#   bench/fsdp_bench.sh                      # from the repository root, after
#   cargo build --release -p nitro-examples --example chargpt
#   PY=/tmp/fixvenv/bin/python ARGS="--steps 4 --layers 2" bench/fsdp_bench.sh
#
# Environment:
#   PY       the Python that runs the twin (python3); needs jax==0.10.2, safetensors, numpy
#   DEVICES  the FSDP axis size (4)
#   ARGS     chargpt's model and run flags (the ~100M-parameter model of issue 33:
#            --width 1024 --heads 16 --layers 8 --scan --batch 8 --steps 4 --dropout 0)
#   OUT      results directory (target/fsdp-bench)
#
# Writes $OUT/runs.jsonl (one line per run: its JSON line, wall time and external peak RSS)
# and prints a table of the figures the issue names.
set -euo pipefail

PY=${PY:-python3}
DEVICES=${DEVICES:-4}
OUT=${OUT:-target/fsdp-bench}
read -r -a MODEL_ARGS <<<"${ARGS:---width 1024 --heads 16 --layers 8 --scan --batch 8 --steps 4 --dropout 0}"
BIN=./target/release/examples/chargpt

die() { echo "fsdp_bench: error: $*" >&2; exit 1; }
say() { echo "fsdp_bench: $*" >&2; }
[[ -x $BIN ]] || die "$BIN is missing: cargo build --release -p nitro-examples --example chargpt"
"$PY" -c 'import jax, numpy, safetensors' 2>/dev/null \
    || die "PY='$PY' cannot import jax, numpy and safetensors (python3 -m venv /tmp/jaxvenv && /tmp/jaxvenv/bin/pip install jax==0.10.2 safetensors numpy)"
/usr/bin/time -f '%M' -o /dev/null true 2>/dev/null || die "needs GNU /usr/bin/time"

mkdir -p "$OUT"
RUNS="$OUT/runs.jsonl"
: >"$RUNS"
CACHES="$OUT/caches"
rm -rf "$CACHES" "$OUT/bundle"
mkdir -p "$CACHES"

# run SIDE CMD...: runs CMD, records its last JSON line with wall time and peak RSS.
run() {
    local side=$1
    shift
    say "$side: $*"
    local started ended
    started=$(date +%s.%N)
    /usr/bin/time -f '%M' -o "$OUT/$side.time" "$@" >"$OUT/$side.out" 2>"$OUT/$side.err" \
        || { tail -n 20 "$OUT/$side.err" >&2; die "$side failed"; }
    ended=$(date +%s.%N)
    "$PY" - "$OUT/$side.out" "$side" "$started" "$ended" "$(tail -n 1 "$OUT/$side.time")" >>"$RUNS" <<'EOF'
import json, sys
path, side, started, ended, rss = sys.argv[1:]
line = [l for l in open(path) if l.startswith("{")][-1]
print(json.dumps({"side": side, "wall_s": round(float(ended) - float(started), 3),
                  "max_rss_kb": int(rss), "result": json.loads(line)}))
EOF
}

say "writing the twin bundle"
NITRO_DEVICES=$DEVICES NITRO_CACHE_DIR="$CACHES/bundle" "$BIN" "${MODEL_ARGS[@]}" --json --fsdp \
    --twin "$OUT/bundle" >"$OUT/bundle.out" 2>"$OUT/bundle.err" || die "writing the bundle failed"
run nitro-fsdp env NITRO_DEVICES="$DEVICES" NITRO_CACHE_DIR="$CACHES/fsdp" \
    "$BIN" "${MODEL_ARGS[@]}" --json --serial-compiles --fsdp
run nitro-fsdp-default env NITRO_DEVICES="$DEVICES" NITRO_CACHE_DIR="$CACHES/fsdp-default" \
    "$BIN" "${MODEL_ARGS[@]}" --json --fsdp
run nitro-replicated env NITRO_DEVICES="$DEVICES" NITRO_CACHE_DIR="$CACHES/replicated" \
    "$BIN" "${MODEL_ARGS[@]}" --json --serial-compiles
run jax-fsdp "$PY" bench/twin_chargpt.py "$OUT/bundle" --json --fsdp "$DEVICES" --cache "$CACHES/jax"

"$PY" - "$RUNS" <<'EOF' | tee "$OUT/table.md"
import json, sys
runs = {r["side"]: r for r in map(json.loads, open(sys.argv[1]))}
def nitro(r):
    d = r["result"]; m = d["memory"]
    return {"rss": r["max_rss_kb"] / 1024, "state": m["parameters"] + m["optimizer_state"],
            "grad_compile": d["compile_ms_by_program"]["grad"], "first": d["first_step_ms"],
            "step": d["step_ms"], "loss": d.get("val_bits_per_char")}
def jax(r):
    d = r["result"]
    return {"rss": r["max_rss_kb"] / 1024, "state": d["state_bytes_per_device"],
            "grad_compile": d["lower_ms"] + d["compile_ms"], "first": d["first_step_ms"],
            "step": d["step_ms"], "loss": d.get("val_bits_per_char")}
n, rep, j = nitro(runs["nitro-fsdp"]), nitro(runs["nitro-replicated"]), jax(runs["jax-fsdp"])
# nitro's default (concurrent compiles) against JAX's first step from its host values.
n["first_default"] = runs["nitro-fsdp-default"]["result"]["first_step_ms"]
n["first_from_host"] = n["first"]
rep["first_default"], rep["first_from_host"] = float("nan"), rep["first"]
j["first_default"] = j["first_from_host"] = runs["jax-fsdp"]["result"]["first_step_from_host_ms"]
rows = [("peak host RSS (MB, external)", "rss", "{:.0f}"),
        ("state bytes per device (params + optimizer)", "state", "{:,}"),
        ("gradient program compile (ms; JAX: lower + compile of the step)", "grad_compile", "{:.0f}"),
        ("first step (ms, from the handle / the first call)", "first", "{:.0f}"),
        ("first step (ms; nitro: from the handle, serial compiles / JAX: placement + first call)", "first_from_host", "{:.0f}"),
        ("first step (ms; nitro: from the handle, concurrent compiles, the default / JAX: placement + first call)", "first_default", "{:.0f}"),
        ("steady step (ms, median waited)", "step", "{:.0f}"),
        ("held-out bits per char", "loss", "{:.6f}")]
print("| | nitro FSDP | JAX FSDP | nitro / JAX | nitro replicated |")
print("|---|---|---|---|---|")
for name, key, fmt in rows:
    ratio = "" if key == "loss" else f"{n[key] / j[key]:.2f}x"
    print(f"| {name} | {fmt.format(n[key])} | {fmt.format(j[key])} | {ratio} | {fmt.format(rep[key])} |")
EOF
