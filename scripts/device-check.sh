#!/usr/bin/env bash
# The device check: everything nitro can check on an NVIDIA GPU, prepared here and run there, in
# two halves, because the GPU machine that is lent has neither cargo nor network (issue 50,
# item 18). It has Python 3.12 with jax, jaxlib, jax-cuda13-pjrt and jax-cuda13-plugin
# (0.11.2) installed, takes at most 64 MiB of files beside the working tree, and runs a command
# for at most 10 minutes.
#
#   scripts/device-check.sh build [BUNDLE]   # here, with cargo: builds the bundle
#   scripts/device-check.sh run [BUNDLE]     # there, from the repository root: runs it
#
# BUNDLE is target/device-check by default (ignored by git, so the device tool can carry it:
# `carry: ["target/device-check"]`, command `bash scripts/device-check.sh run`).
#
# build: release builds, stripped, of the XLA test suites below (SUITES), and of the digits,
# fashion and chargpt examples (fashion and chargpt are also the twins benchmark's nitro side);
# the data the examples need beyond the repository's own digits — the first FASHION_ROWS
# (12800) training images of Fashion-MNIST with its whole test set, and the fortunes — taken
# from the Debian packages' folders (FASHION_DIR, FORTUNES_DIR), or fetched as packages with
# `apt-get download` when those are not installed; then one compressed archive,
# BUNDLE/bundle.tar.xz. It prints the archive's size and the working tree's, and fails when
# together they pass the carry limit (LIMIT_MIB, 64).
#
# run: without a GPU, prints `skip:` and exits 0. With one: finds the preinstalled CUDA 13
# plugin through python3 (jax-cuda13-pjrt; CUDA 12's where 13 is not installed), unpacks the
# bundle, and with NITRO_BACKEND=xla NITRO_PJRT_PLATFORM=cuda NITRO_REQUIRE_XLA=1 (nothing falls
# back to a CPU plugin, nothing is skipped for want of XLA) runs
#   1. the XLA test suites (tests that need more devices than the machine has print `skip:`);
#   2. the examples: digits; fashion; chargpt on one device; chargpt with its parameters created
#      on the device (`--init device`) and saved to a checkpoint directory every 50 steps; and
#      that checkpoint resumed;
#   3. the twins benchmark (bench/twins_bench.sh, one round) against the preinstalled JAX on the
#      same GPU;
# each step under a time limit, and no step started once BUDGET_S (480) seconds have passed,
# so the whole run ends well inside 10 minutes. It writes one summary, $OUT/summary.md (OUT:
# target/device-check/out when unset), with every step's status and time, the examples'
# figures and the twins' table, plus $OUT/logs.tar.gz with every log. It exits 1 when a step
# failed or did not run, 0 otherwise.
#
# DRY_RUN=1 runs the run half without a GPU, on the CPU plugin (NITRO_PJRT_PLATFORM=cpu), to
# try its plumbing where the project builds; its summary says so.
set -euo pipefail
cd "$(dirname "$0")/.."

SUITES=(pjrt differential train devices half precision device_init leaf_views background_save ops scan)
EXAMPLES=(digits fashion chargpt)
FASHION_ROWS=${FASHION_ROWS:-12800}
LIMIT_MIB=${LIMIT_MIB:-64}

die() {
    echo "device-check: error: $*" >&2
    exit 1
}
say() { echo "device-check: $*" >&2; }

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
}

# ---- build (here) -------------------------------------------------------------------------

# fetch_debs DIR PACKAGE...: unpacks the named Debian packages (downloaded, not installed) into
# DIR/root.
fetch_debs() {
    local dir=$1
    shift
    command -v apt-get >/dev/null && command -v dpkg >/dev/null \
        || die "no apt-get/dpkg here to fetch $*: install them or point FASHION_DIR / FORTUNES_DIR at the data"
    mkdir -p "$dir/debs" "$dir/root"
    say "fetching $* with apt-get download"
    (cd "$dir/debs" && apt-get download "$@" >&2) \
        || die "apt-get download $* failed (try apt-get update, or set FASHION_DIR / FORTUNES_DIR)"
    local deb
    for deb in "$dir"/debs/*.deb; do
        dpkg -x "$deb" "$dir/root"
    done
}

# fashion_data SRC DEST: the first FASHION_ROWS training images and labels, and the whole test
# set, as gzip-compressed idx files (the example reads them with --data DEST).
fashion_data() {
    python3 - "$1" "$2" "$FASHION_ROWS" <<'PY'
import gzip, os, struct, sys

src, dest, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.makedirs(dest, exist_ok=True)

def read(stem):
    for name, opener in ((stem, open), (stem + ".gz", gzip.open)):
        path = os.path.join(src, name)
        if os.path.exists(path):
            with opener(path, "rb") as f:
                return f.read()
    sys.exit(f"device-check: error: {stem}[.gz] is not in {src}")

for stem, keep in (("train-images-idx3-ubyte", rows), ("train-labels-idx1-ubyte", rows),
                   ("t10k-images-idx3-ubyte", None), ("t10k-labels-idx1-ubyte", None)):
    data = read(stem)
    ndims = data[3]
    dims = list(struct.unpack(">" + "I" * ndims, data[4:4 + 4 * ndims]))
    body = data[4 + 4 * ndims:]
    if keep is not None:
        if keep > dims[0]:
            sys.exit(f"device-check: error: FASHION_ROWS={keep} is more than the {dims[0]} rows of {stem}")
        row = len(body) // dims[0]
        dims[0], body = keep, body[:keep * row]
    header = data[:4] + struct.pack(">" + "I" * ndims, *dims)
    with gzip.open(os.path.join(dest, stem + ".gz"), "wb", compresslevel=9) as f:
        f.write(header + body)
PY
}

build() {
    local bundle=$1
    command -v cargo >/dev/null || die "build needs cargo (run it where the project builds)"
    local stage
    stage=$(mktemp -d)
    # shellcheck disable=SC2064 # expand now: the trap outlives this function's locals
    trap "rm -rf '$stage'" EXIT
    mkdir -p "$stage/tests" "$stage/bin" "$stage/data" "$bundle"
    local started=$SECONDS

    local args=() t
    for t in "${SUITES[@]}"; do args+=(--test "$t"); done
    say "building the XLA test suites (release): ${SUITES[*]}"
    cargo test --release --no-run -p nitro-xla "${args[@]}" --message-format=json \
        | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and "test" in m["target"]["kind"]:
        print(m["target"]["name"], m["executable"])
' >"$stage/tests.txt"
    local name exe
    while read -r name exe; do cp "$exe" "$stage/tests/$name"; done <"$stage/tests.txt"
    for t in "${SUITES[@]}"; do
        [[ -x "$stage/tests/$t" ]] || die "cargo built no test binary for suite $t"
    done

    args=()
    for t in "${EXAMPLES[@]}"; do args+=(--example "$t"); done
    say "building the examples (release): ${EXAMPLES[*]}"
    cargo build --release -p nitro-examples "${args[@]}"
    for t in "${EXAMPLES[@]}"; do cp "target/release/examples/$t" "$stage/bin/"; done
    strip "$stage"/tests/* "$stage"/bin/*

    local fetched="$stage/fetched" fashion=${FASHION_DIR:-/usr/share/datasets/fashion-mnist}
    local fortunes=${FORTUNES_DIR:-/usr/share/games/fortunes}
    if [[ ! -d "$fashion" ]]; then
        fetch_debs "$fetched/fashion" dataset-fashion-mnist
        fashion="$fetched/fashion/root/usr/share/datasets/fashion-mnist"
    fi
    if [[ ! -d "$fortunes" ]]; then
        fetch_debs "$fetched/fortunes" fortunes fortunes-min
        fortunes="$fetched/fortunes/root/usr/share/games/fortunes"
    fi
    say "data: Fashion-MNIST from $fashion (the first $FASHION_ROWS training rows), fortunes from $fortunes"
    fashion_data "$fashion" "$stage/data/fashion"
    mkdir -p "$stage/data/fortunes"
    # The fortune files themselves: no .dat indexes, no .u8 links (the loader skips both).
    find "$fortunes" -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' -exec cp {} "$stage/data/fortunes/" \;
    [[ -n "$(ls -A "$stage/data/fortunes")" ]] || die "no fortune files in $fortunes"
    rm -rf "$fetched"

    {
        echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD -- 2>/dev/null || echo ' (with uncommitted changes)')"
        echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m) by $(cargo --version)"
        echo "suites ${SUITES[*]}"
        echo "examples ${EXAMPLES[*]}"
        echo "fashion_rows $FASHION_ROWS"
    } >"$stage/manifest.txt"

    local archive="$bundle/bundle.tar.xz"
    rm -f "$archive"
    tar -C "$stage" -cJf "$archive" manifest.txt tests bin data
    local packed unpacked tree total limit
    packed=$(stat -c %s "$archive")
    unpacked=$(du -sb --exclude=fetched "$stage" | cut -f1)
    # What the device tool sends beside the bundle: tracked files and untracked ones git does
    # not ignore.
    tree=$( (git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null || true) \
        | awk '{ s += $1 } END { print s + 0 }')
    total=$((packed + tree))
    limit=$((LIMIT_MIB * 1024 * 1024))
    awk -v a="$archive" -v p="$packed" -v u="$unpacked" -v t="$tree" -v l="$LIMIT_MIB" -v s=$((SECONDS - started)) \
        'BEGIN { m = 1048576; printf "device-check: bundle %s: %.1f MiB (%.1f MiB unpacked); working tree %.1f MiB; together %.1f MiB of %d MiB (built in %d s)\n", a, p / m, u / m, t / m, (p + t) / m, l, s }'
    (cd "$stage" && du -b tests/* bin/* | sort -rn | awk '{ printf "  %6.1f MiB  %s\n", $1 / 1048576, $2 }')
    ((total <= limit)) || die "the bundle and the working tree pass the ${LIMIT_MIB} MiB carry limit"
}

# ---- run (there) --------------------------------------------------------------------------

run() {
    local bundle=$1 dry=${DRY_RUN:-0} platform=cuda
    if [[ $dry == 1 ]]; then
        platform=cpu
    elif ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
        echo "skip: no GPU (nvidia-smi finds no NVIDIA GPU here); nothing to check"
        exit 0
    fi
    [[ -f "$bundle/bundle.tar.xz" ]] \
        || die "no $bundle/bundle.tar.xz: build it first with \`scripts/device-check.sh build\` where cargo is, and bring it along"
    local budget=${BUDGET_S:-480} out=${OUT:-target/device-check/out}
    mkdir -p "$out"
    out=$(cd "$out" && pwd)
    local work
    work=$(mktemp -d)
    # shellcheck disable=SC2064
    trap "rm -rf '$work'" EXIT
    local logs="$work/logs" summary="$out/summary.md" root
    root=$(pwd)
    mkdir -p "$logs"
    tar -C "$work" -xJf "$bundle/bundle.tar.xz" 2>/dev/null \
        || python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
            "$bundle/bundle.tar.xz" "$work"
    local B="$work"

    # The preinstalled CUDA PJRT plugin, as python3 reports it: CUDA 13's first.
    local plugin=""
    [[ $dry == 1 ]] || plugin=$(python3 - <<'PY' || true
import importlib.util, os
for name in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
    try:
        spec = importlib.util.find_spec(name)
    except ImportError:
        continue
    if spec and spec.submodule_search_locations:
        so = os.path.join(list(spec.submodule_search_locations)[0], "xla_cuda_plugin.so")
        if os.path.exists(so):
            print(so)
            break
PY
)
    # The CUDA libraries the plugin package brings (nvidia-*), on the loader path for a plugin
    # that does not find them relative to itself.
    local libs
    libs=$(python3 - <<'PY' || true
import glob, os, site
dirs = site.getsitepackages() + [site.getusersitepackages()]
print(":".join(sorted({os.path.dirname(p) for d in dirs for p in glob.glob(os.path.join(d, "nvidia", "*", "lib", "*.so*"))})))
PY
)
    export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
    export NITRO_BACKEND=xla NITRO_PJRT_PLATFORM=$platform NITRO_REQUIRE_XLA=1
    export NITRO_CACHE_DIR="$work/cache"

    local failed=0 started=$SECONDS
    {
        echo "# nitro device check"
        echo
        echo "$(date -u +%Y-%m-%dT%H:%M:%SZ); the bundle's $(head -n 1 "$B/manifest.txt")."
        echo
        if [[ $dry == 1 ]]; then
            echo "DRY RUN (DRY_RUN=1): no GPU, the CPU plugin (NITRO_PJRT_PLATFORM=cpu)."
        else
            nvidia-smi -L | sed 's/^/    /'
            echo
            echo "CUDA plugin: ${plugin:-none found by python3} (NITRO_PJRT_PLATFORM=cuda finds it the same way)."
        fi
        echo "python3: $(command -v python3); jax $(python3 -c 'import jax; print(jax.__version__)' 2>/dev/null || echo 'not importable')."
        echo
        echo "| step | status | seconds |"
        echo "|---|---|---|"
    } >"$summary"

    # step NAME LIMIT CMD...: runs CMD (at most LIMIT seconds, and never past the budget) with
    # its output in the step's log, and writes its row.
    step() {
        local name=$1 limit=$2
        shift 2
        local left=$((budget - (SECONDS - started)))
        if ((left < 15)); then
            echo "| $name | not run: the ${budget} s budget was spent | 0 |" >>"$summary"
            failed=1
            return 0
        fi
        ((limit <= left)) || limit=$left
        echo "== $name" >&2
        local t0=$SECONDS status
        if timeout --kill-after=10 "$limit" "$@" >"$logs/$name.log" 2>&1; then
            status=ok
        else
            local rc=$?
            if ((rc == 124 || rc == 137)); then status="FAILED: over ${limit} s"; else status="FAILED (exit $rc)"; fi
            failed=1
            tail -n 15 "$logs/$name.log" >&2
        fi
        echo "| $name | $status | $((SECONDS - t0)) |" >>"$summary"
    }

    if [[ $dry != 1 && -z "$plugin" ]]; then
        echo "| find the CUDA plugin | FAILED: python3 has neither jax-cuda13-pjrt nor jax-cuda12-pjrt | 0 |" >>"$summary"
        failed=1
    else
        # 1. The XLA test suites, from the crate's folder as cargo runs them; one test at a
        #    time, each alone on the GPU.
        local t
        for t in "${SUITES[@]}"; do
            # Skipped: a test that reads its fixture by the build machine's absolute path.
            local skip=()
            [[ $t != device_init ]] || skip=(--skip created_values_match_jaxs_draws_for_the_same_key)
            step "test-$t" 120 bash -c 'cd runtime && exec "$@"' _ "$B/tests/$t" --test-threads=1 \
                ${skip[@]+"${skip[@]}"}
        done

        # 2. The examples, each ending with its JSON line.
        local ckpt="$work/chargpt-ckpt"
        step digits 90 "$B/bin/digits" --json
        step fashion 120 "$B/bin/fashion" --data "$B/data/fashion" --epochs 2 --json
        step chargpt 120 "$B/bin/chargpt" --data "$B/data/fortunes" --steps 300 --json
        step chargpt-device-init 120 "$B/bin/chargpt" --data "$B/data/fortunes" --steps 200 \
            --init device --checkpoint "$ckpt" --save-every 50 --json
        step chargpt-resumed 120 "$B/bin/chargpt" --data "$B/data/fortunes" --steps 100 \
            --init device --resume "$ckpt" --json

        # 3. The twins: nitro's fashion and chargpt against bench/twin_*.py on the preinstalled
        #    JAX, one round each, from a folder whose target/release/examples holds the bundle's
        #    binaries (twins_bench.sh runs those; it never builds).
        local twins="$work/twins-root"
        mkdir -p "$twins/target/release"
        ln -s "$root/bench" "$twins/bench"
        ln -s "$B/bin" "$twins/target/release/examples"
        local m data
        for m in fashion chargpt; do
            data="$B/data/fashion"
            [[ $m == fashion ]] || data="$B/data/fortunes"
            step "twins-$m" 150 bash -c 'cd "$1" && shift && exec "$@"' _ "$twins" \
                env ROUNDS=1 MODELS="$m" OUT="$work/twins-$m" EXTRA="--data $data" PY=python3 \
                bash bench/twins_bench.sh
        done
    fi

    # The suites' tallies, the examples' figures and the twins' tables.
    python3 - "$logs" "$work" >>"$summary" <<'PY' || echo "(the figures could not be read)" >>"$summary"
import json, pathlib, re, sys
logs, work = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
rows = []
for log in sorted(logs.glob("test-*.log")):
    text = log.read_text(errors="replace")
    results = re.findall(r"test result: (\w+)\. (\d+) passed; (\d+) failed; (\d+) ignored", text)
    skips = len(re.findall(r"^skip:", text, re.M))
    failed = re.findall(r"^test (\S+) \.\.\. FAILED", text, re.M)
    if results:
        r = results[-1]
        rows.append(f"| {log.stem[5:]} | {r[1]} | {r[2]} | {r[3]} | {skips} | {', '.join(failed[:5]) or '—'} |")
    else:
        rows.append(f"| {log.stem[5:]} | — | — | — | {skips} | no test result line (see its log) |")
if rows:
    print("\n| suite | passed | failed | ignored | `skip:` lines | failures |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
rows = []
for name in ("digits", "fashion", "chargpt", "chargpt-device-init", "chargpt-resumed"):
    log = logs / f"{name}.log"
    if not log.exists():
        continue
    lines = [l for l in log.read_text(errors="replace").splitlines() if l.startswith("{")]
    try:
        d = json.loads(lines[-1])
    except (IndexError, ValueError):
        rows.append(f"| {name} | no JSON line | | | | |")
        continue
    def num(k):
        v = d.get(k)
        return "—" if not isinstance(v, (int, float)) else f"{v:.1f}"
    held = d.get("val_bits_per_char", d.get("test_accuracy", d.get("val_accuracy", "—")))
    rows.append(f"| {name} | {d.get('backend', '—')} | {num('first_step_ms')} | {num('step_us_median')} "
                f"| {num('peak_rss_mb')} | {held} |")
if rows:
    print("\n| example | backend | first step (ms) | step, median (µs) | peak host RSS (MB) | held-out |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
for model in ("fashion", "chargpt"):
    table = work / f"twins-{model}" / "table.md"
    if table.exists():
        print(f"\nTwins, {model} (one round):\n")
        print(table.read_text())
PY
    echo >>"$summary"
    echo "Whole run: $((SECONDS - started)) s of a ${budget} s budget. Logs: logs.tar.gz beside this file." >>"$summary"
    for t in fashion chargpt; do
        [[ -d "$work/twins-$t/raw" ]] && cp -r "$work/twins-$t/raw" "$logs/twins-$t-raw"
    done
    tar -C "$work" -czf "$out/logs.tar.gz" logs
    cat "$summary"
    return "$failed"
}

case "${1:-}" in
    build) build "${2:-target/device-check}" ;;
    run) run "${2:-target/device-check}" ;;
    -h | --help | help) usage ;;
    *)
        usage >&2
        exit 2
        ;;
esac
