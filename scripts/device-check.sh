#!/usr/bin/env bash
# The device check (issue 43, item 4): on a machine with an NVIDIA GPU, everything nitro can
# check there, in one run, with one summary. Elsewhere it prints `skip: no GPU` and exits 0.
#
#   scripts/device-check.sh                     # from anywhere in the repository
#   NITRO_GPU_CUDA=13 scripts/device-check.sh   # the CUDA 13 plugin
#   SKIP_TWINS=1 scripts/device-check.sh        # without the twins benchmark (the longest part)
#
# What it does, each step logged under $OUT (target/device-check) and tallied in
# $OUT/summary.md:
#   1. installs the CUDA PJRT plugin from the package registry at the version matching the
#      pinned JAX's XLA (jax-cudaNN-pjrt and jax-cudaNN-plugin[with-cuda] 0.11.2: the same XLA
#      release as the CPU plugin the tests pin), and puts the CUDA libraries it brings on the
#      loader path;
#   2. runs nitro's XLA test suites on the GPU (NITRO_PJRT_PLATFORM=cuda NITRO_REQUIRE_XLA=1:
#      nothing falls back to a CPU plugin, nothing is skipped for want of XLA; tests that need
#      more devices than the machine has say `skip:`);
#   3. runs the examples: digits on one GPU and data parallel on all; chargpt replicated over
#      the GPUs and under FSDP over them (`--mesh data=N --fsdp`), with its parameters created
#      on the devices, saved to a checkpoint directory every 50 steps and resumed;
#   4. runs the twins benchmark (bench/twins_bench.sh, one round) against JAX 0.10.2 with CUDA
#      in a throwaway virtual environment under $OUT (JAX is never a dependency of nitro);
#   5. writes the summary: each step's status and time, and the examples' figures (step,
#      first step, peak memory) from their JSON lines.
# It exits 1 when any step failed (the summary says which), 0 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "skip: no GPU (nvidia-smi finds no NVIDIA GPU here); nothing to check"
    exit 0
fi

CUDA="${NITRO_GPU_CUDA:-12}"
VERSION="${NITRO_GPU_PLUGIN_VERSION:-0.11.2}"
JAX_VERSION="${NITRO_JAX_VERSION:-0.10.2}"
OUT="${OUT:-target/device-check}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.md"
GPUS="$(nvidia-smi -L | wc -l)"
FAILED=0

{
    echo "# nitro device check"
    echo
    echo "$(date -u +%Y-%m-%dT%H:%M:%SZ), ${GPUS} GPU(s), CUDA ${CUDA} plugin ${VERSION}:"
    echo
    nvidia-smi -L | sed 's/^/    /'
    echo
    echo "| step | status | seconds |"
    echo "|---|---|---|"
} >"$SUMMARY"

# step NAME CMD...: runs CMD with its output in $OUT/NAME.log and one summary row.
step() {
    local name=$1
    shift
    echo "== $name"
    local started status
    started=$(date +%s)
    if "$@" >"$OUT/$name.log" 2>&1; then
        status=ok
    else
        status="FAILED (see $OUT/$name.log)"
        FAILED=1
        tail -n 20 "$OUT/$name.log" >&2
    fi
    echo "| $name | $status | $(($(date +%s) - started)) |" >>"$SUMMARY"
}

install_plugin() {
    python3 -m pip install --quiet --disable-pip-version-check \
        "jax-cuda${CUDA}-pjrt==${VERSION}" "jax-cuda${CUDA}-plugin[with-cuda]==${VERSION}"
}
step install-plugin install_plugin

# The CUDA libraries the plugin's extra installs, on the loader path for plugins that do not
# find them relative to themselves.
NVIDIA_LIBS="$(python3 - <<'PY'
import glob, os, site
dirs = site.getsitepackages() + [site.getusersitepackages()]
libs = sorted({os.path.dirname(p) for d in dirs for p in glob.glob(os.path.join(d, "nvidia", "*", "lib", "*.so*"))})
print(":".join(libs))
PY
)"
export LD_LIBRARY_PATH="${NVIDIA_LIBS}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
export NITRO_BACKEND=xla NITRO_PJRT_PLATFORM=cuda NITRO_REQUIRE_XLA=1
NITRO_CACHE_DIR="$(mktemp -d)/nitro-cache"
export NITRO_CACHE_DIR

step build cargo build --release -p nitro-examples --examples
step tests cargo test --release -p nitro-xla --no-fail-fast

BIN=target/release/examples
json_of() { grep '^{' "$OUT/$1.log" | tail -n 1 >"$OUT/$1.json"; }
example() {
    local name=$1
    shift
    step "$name" "$@" --json
    json_of "$name"
}
example digits-1 "$BIN/digits"
if [ "$GPUS" -gt 1 ]; then
    example digits-all "$BIN/digits" --devices "$GPUS"
fi
CHARGPT=(--steps 200 --dropout 0)
example chargpt-replicated env NITRO_DEVICES="$GPUS" "$BIN/chargpt" "${CHARGPT[@]}"
rm -rf "$OUT/chargpt-ckpt"
example chargpt-fsdp "$BIN/chargpt" "${CHARGPT[@]}" --mesh "data=$GPUS" --fsdp --init device \
    --checkpoint "$OUT/chargpt-ckpt" --save-every 50
example chargpt-resumed "$BIN/chargpt" "${CHARGPT[@]}" --mesh "data=$GPUS" --fsdp --init device \
    --resume "$OUT/chargpt-ckpt"

if [ -z "${SKIP_TWINS:-}" ]; then
    twins() {
        python3 -m venv "$OUT/jaxvenv" \
            && "$OUT/jaxvenv/bin/pip" install --quiet "jax[cuda${CUDA}]==${JAX_VERSION}" safetensors numpy \
            && ROUNDS=1 PY="$OUT/jaxvenv/bin/python" OUT="$OUT/twins" bench/twins_bench.sh
    }
    step twins twins
    [ -f "$OUT/twins/table.md" ] && cp "$OUT/twins/table.md" "$OUT/twins-table.md"
fi

python3 - "$OUT" >>"$SUMMARY" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = []
for f in sorted(out.glob("*.json")):
    try:
        d = json.loads(f.read_text())
    except ValueError:
        continue
    def ms(k):
        v = d.get(k)
        return "—" if v is None else f"{v:.1f}"
    rows.append(f"| {f.stem} | {d.get('devices', '—')} | {ms('step_ms')} | {ms('first_step_ms')} "
                f"| {ms('peak_rss_mb')} | {d.get('val_bits_per_char', d.get('val_accuracy', '—'))} |")
if rows:
    print("\n| example | devices | step (ms) | first step (ms) | peak host RSS (MB) | held-out |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
twins = out / "twins-table.md"
if twins.exists():
    print("\nTwins benchmark (one round):\n")
    print(twins.read_text())
PY

echo "== summary ($SUMMARY)"
cat "$SUMMARY"
exit "$FAILED"
