"""Convolution, max-pool (reduce_window), gather and matmul workloads in JAX on CPU: forward + backward
of each, jitted, with lowering, compiling and executing timed separately — the JAX twin of
nitro's benchmark of the same three ops.

Run in a throwaway virtual environment (JAX is never a dependency of nitro), from the
workspace root:

    python3 -m venv /tmp/jaxvenv-b && /tmp/jaxvenv-b/bin/pip install jax==0.10.2
    JAX_PLATFORMS=cpu /tmp/jaxvenv-b/bin/python bench/ops_jax.py [--workload conv|maxpool|avgpool|gather|matmul] [--runs N]

Workloads (all f32; each loss is sum(out * cot) with a fixed cotangent input, so the backward
is a plain VJP of the op):

    conv     lax.conv_general_dilated, x [64,28,28,16], w [3,3,16,32], stride 1, SAME,
             NHWC/HWIO/NHWC, precision HIGHEST; gradients w.r.t. x and w
    maxpool  lax.reduce_window(max), 2x2 window, stride 2, VALID, x [64,28,28,32];
             gradient w.r.t. x
    avgpool  lax.reduce_window(add) / 4, 2x2 window, stride 2, VALID, x [64,28,28,32];
             gradient w.r.t. x
    gather   embedding lookup jnp.take(table, ids, axis=0), table [50000,512], ids [8,512]
             i32; gradient w.r.t. table
    matmul   x [1024,1024] @ w [1024,4096] (a transformer block's dot at width 1024 over 1024
             tokens); gradients w.r.t. x and w: 3 dots, 25.8 GFLOP, reported as gflop_per_s

Prints one JSON line per workload:

    {"workload", "lower_ms", "compile_ms", "execute_us_median", "execute_us_min", "runs"}

lower_ms is `jitted.lower(*args)` (tracing included) and compile_ms is `.compile()` of that
lowering, each the median over 5 fresh compiles (a new `jax.jit` after `jax.clear_caches()`,
the persistent compilation cache off). execute_us_* is the compiled executable called on
device-resident inputs, waited on with `jax.block_until_ready` each run, after 3 warm-up runs.

Note: the loss is linear in the op's output, so JAX's `grad` never needs the forward values and
the forward op is dead code in the lowered program (and for gather the table itself is an unused
argument, pruned from the program): the default measures the backward alone. `--with-value` jits
`jax.value_and_grad` instead, which keeps the forward (and the loss) in the program; its lines
carry "with_value": true and its dumps are named bench_<workload>.value.*.

Also writes each workload's lowered StableHLO to /tmp/jax_lowered/bench_<workload>.mlir and
XLA's optimized HLO to /tmp/jax_lowered/bench_<workload>.opt.hlo, for structural comparison
with nitro's program text.

The figures are machine- and load-dependent: compare them only as ratios with nitro's twin
measured in the same run on the same machine.
"""

import os

# CPU only; set before JAX is imported so the platform choice takes effect.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

# No persistent compilation cache: every compile measured must be a real compile.
jax.config.update("jax_enable_compilation_cache", False)
jax.config.update("jax_compilation_cache_dir", None)

COMPILES = 5  # fresh lower + compile rounds per workload
WARMUP = 3  # executions before timing
DUMP_DIR = "/tmp/jax_lowered"


# --- workloads --------------------------------------------------------------------------------
# Each builder returns (loss, argnums, host inputs). The loss takes the differentiated inputs
# first and the fixed cotangent last, so grad(loss) is the op's VJP applied to the cotangent.


def conv_workload(rng):
    def loss(x, w, cot):
        out = lax.conv_general_dilated(
            x, w, (1, 1), "SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            precision=lax.Precision.HIGHEST,
        )
        return jnp.sum(out * cot)

    x = rng.standard_normal((64, 28, 28, 16), dtype=np.float32)
    w = rng.standard_normal((3, 3, 16, 32), dtype=np.float32)
    cot = rng.standard_normal((64, 28, 28, 32), dtype=np.float32)
    return loss, (0, 1), (x, w, cot)


def maxpool_workload(rng):
    def loss(x, cot):
        out = lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        return jnp.sum(out * cot)

    x = rng.standard_normal((64, 28, 28, 32), dtype=np.float32)
    cot = rng.standard_normal((64, 14, 14, 32), dtype=np.float32)
    # grad with a single argnum returns one array; keep it a tuple for uniform handling.
    return loss, (0,), (x, cot)


def avgpool_workload(rng):
    def loss(x, cot):
        out = lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") * 0.25
        return jnp.sum(out * cot)

    x = rng.standard_normal((64, 28, 28, 32), dtype=np.float32)
    cot = rng.standard_normal((64, 14, 14, 32), dtype=np.float32)
    return loss, (0,), (x, cot)


def gather_workload(rng):
    def loss(table, ids, cot):
        out = jnp.take(table, ids, axis=0)
        return jnp.sum(out * cot)

    table = rng.standard_normal((50000, 512), dtype=np.float32)
    # The same ids as nitro's twin (examples/examples/ops_bench.rs): row i*7919 mod 50000, so
    # both scatter into the same rows in the same order.
    ids = ((np.arange(8 * 512, dtype=np.int64) * 7919) % 50000).astype(np.int32).reshape(8, 512)
    cot = rng.standard_normal((8, 512, 512), dtype=np.float32)
    return loss, (0,), (table, ids, cot)


def matmul_workload(rng):
    def loss(x, w, cot):
        return jnp.sum(jnp.matmul(x, w, precision=lax.Precision.HIGHEST) * cot)

    x = rng.standard_normal((1024, 1024), dtype=np.float32)
    w = rng.standard_normal((1024, 4096), dtype=np.float32)
    cot = rng.standard_normal((1024, 4096), dtype=np.float32)
    return loss, (0, 1), (x, w, cot)


# The multiply-adds of a workload's forward + backward, for a rate: the matmul's forward and
# its two gradient dots, 2·M·K·N flops each.
FLOPS = {"matmul": 3 * 2 * 1024 * 1024 * 4096}


WORKLOADS = {
    "conv": conv_workload,
    "matmul": matmul_workload,
    "maxpool": maxpool_workload,
    "avgpool": avgpool_workload,
    "gather": gather_workload,
}


# --- measurement ------------------------------------------------------------------------------


def bench(name, runs, with_value=False):
    loss, argnums, host_args = WORKLOADS[name](np.random.default_rng(0))
    # Inputs on the device once; every timed run reuses them.
    args = tuple(jax.device_put(a) for a in host_args)
    jax.block_until_ready(args)

    lower_ms, compile_ms = [], []
    lowered = compiled = None
    for _ in range(COMPILES):
        # Drop every in-memory cache (tracing, lowering, executables) and build a new jit so
        # the next lower and compile start from nothing.
        jax.clear_caches()
        transform = jax.value_and_grad if with_value else jax.grad
        jitted = jax.jit(transform(loss, argnums=argnums))
        t0 = time.perf_counter()
        lowered = jitted.lower(*args)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        lower_ms.append((t1 - t0) * 1e3)
        compile_ms.append((t2 - t1) * 1e3)

    # Texts of the last round's program, for structural comparison with nitro's.
    os.makedirs(DUMP_DIR, exist_ok=True)
    stem = f"bench_{name}.value" if with_value else f"bench_{name}"
    with open(os.path.join(DUMP_DIR, f"{stem}.mlir"), "w") as f:
        f.write(lowered.as_text())
    with open(os.path.join(DUMP_DIR, f"{stem}.opt.hlo"), "w") as f:
        f.write(compiled.as_text())

    # One run = one finished forward + backward (all gradients ready).
    for _ in range(WARMUP):
        jax.block_until_ready(compiled(*args))
    times_us = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times_us.append((time.perf_counter() - t0) * 1e6)

    result = {
        "workload": name,
        "lower_ms": round(statistics.median(lower_ms), 3),
        "compile_ms": round(statistics.median(compile_ms), 3),
        "execute_us_median": round(statistics.median(times_us), 1),
        "execute_us_min": round(min(times_us), 1),
        "runs": runs,
    }
    if name in FLOPS:
        result["gflop_per_s"] = round(FLOPS[name] / statistics.median(times_us) / 1e3, 1)
    if with_value:
        result["with_value"] = True
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), help="run only this one")
    parser.add_argument("--runs", type=int, default=20, help="timed executions (default 20)")
    parser.add_argument("--with-value", action="store_true",
                        help="jit value_and_grad (forward kept) instead of grad")
    opts = parser.parse_args()
    names = [opts.workload] if opts.workload else list(WORKLOADS)
    for name in names:
        print(json.dumps(bench(name, opts.runs, opts.with_value)), flush=True)


if __name__ == "__main__":
    main()
