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
# Then the same FSDP run with its parameters created on the devices (--init device) and saved
# to a checkpoint directory in the background every 2 steps, and a resume of that checkpoint on
# DEVICES / 2 devices.
#
# Writes $OUT/runs.jsonl (one line per run: its JSON line, wall time and external peak RSS)
# and prints two tables of the figures the issues name; the second sets each nitro run's peak
# RSS against its floor: the process before the handle (rss_before_handle_mb) plus, on every
# device, its parameters, optimizer state, gradients (as large as the parameters) and the
# largest program's temporaries, as Nitro::memory reports them (CPU devices keep them in host
# memory).
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
# The model that never lives on the host: parameters created on the devices, a background save
# to a checkpoint directory every 2 steps, then a resume on half the devices.
# (The resume declares its model too: its values come from the checkpoint.)
rm -rf "$OUT/ckpt"
run nitro-fsdp-device env NITRO_DEVICES="$DEVICES" NITRO_CACHE_DIR="$CACHES/fsdp-device" \
    "$BIN" "${MODEL_ARGS[@]}" --json --serial-compiles --fsdp --init device
run nitro-fsdp-device-saving env NITRO_DEVICES="$DEVICES" NITRO_CACHE_DIR="$CACHES/fsdp-device-saving" \
    "$BIN" "${MODEL_ARGS[@]}" --json --fsdp --init device --checkpoint "$OUT/ckpt" --save-every 2
run nitro-resume-half env NITRO_DEVICES=$((DEVICES / 2)) NITRO_CACHE_DIR="$CACHES/resume" \
    "$BIN" "${MODEL_ARGS[@]}" --json --fsdp --init device --resume "$OUT/ckpt"

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

"$PY" - "$RUNS" "$DEVICES" <<'EOF' | tee -a "$OUT/table.md"
import json, sys
runs = {r["side"]: r for r in map(json.loads, open(sys.argv[1]))}
devices = int(sys.argv[2])
def figures(side):
    r = runs[side]; d = r["result"]; m = d["memory"]
    temps = max([p["compiled"]["temporaries"] for p in m["programs"] if p.get("compiled")] or [0])
    per_device = m["parameters"] + m["frozen"] + m["optimizer_state"] + m["parameters"] + temps
    floor = d["rss_before_handle_mb"] + m["devices"] * per_device / 2**20
    return {"rss": r["max_rss_kb"] / 1024, "floor": floor, "over": r["max_rss_kb"] / 1024 / floor,
            "step": d["step_ms"], "saving": d.get("step_ms_saving"), "init": d.get("init_ms"),
            "save": d.get("save_ms"), "loss": d.get("val_bits_per_char"), "devices": m["devices"],
            "group": m["devices"] * (m["parameters"] + m["optimizer_state"]) / devices / 2**20}
host, made = figures("nitro-fsdp"), figures("nitro-fsdp-device")
dev, res = figures("nitro-fsdp-device-saving"), figures("nitro-resume-half")
jax = runs["jax-fsdp"]["max_rss_kb"] / 1024
fmt = lambda v, f="{:.0f}": "—" if v is None else f.format(v)
print()
cols = [host, made, dev, res]
print(f"| | nitro FSDP, host init | created on the devices | created, saving every 2 | resumed on {res['devices']} devices |")
print("|---|---|---|---|---|")
row = lambda name, f: print(f"| {name} | " + " | ".join(f(c) for c in cols) + " |")
row("peak host RSS (MB, external)", lambda c: fmt(c["rss"]))
row(f"peak RSS / JAX FSDP's ({jax:.0f} MB)", lambda c: f"{c['rss']/jax:.2f}x")
row("floor (MB: before the handle + devices' state, gradients, temporaries)", lambda c: fmt(c["floor"]))
row("peak RSS / floor", lambda c: f"{c['over']:.2f}x")
row("creating the parameters (ms)", lambda c: fmt(c["init"]))
row("steady step (ms, median waited)", lambda c: fmt(c["step"]))
# Against the run without saves with the same (default, concurrent) compiles: the saving run's
# own steps without a save in flight are one or two of --steps 4.
plain = runs["nitro-fsdp-default"]["result"]["step_ms"]
saving = "—" if dev["saving"] is None else f"{dev['saving']:.0f} ({dev['saving']/plain:.2f}x the default run's {plain:.0f})"
print(f"| step during a background save (ms) | — | — | {saving} | — |")
print(f"| last background save's write (ms) | — | — | {fmt(dev['save'])} | — |")
print(f"| resumed peak RSS − the saving run's (MB; one shard group: {dev['group']:.0f} MB) | — | — | — | {res['rss'] - dev['rss']:+.0f} |")
row("held-out bits per char", lambda c: fmt(c["loss"], "{:.6f}"))
EOF
