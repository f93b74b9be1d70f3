"""The digits MLP step (64 -> 128 tanh -> 10, batch 32, Adam) in JAX on CPU, measured the way
`cargo run --release -p nitro-examples --example step_bench` measures nitro's training handle.

Run in a throwaway virtual environment (JAX is never a dependency of nitro):

    python3 -m venv /tmp/jaxvenv && /tmp/jaxvenv/bin/pip install jax==0.10.2
    /tmp/jaxvenv/bin/python bench/compare_jax.py [steps]

Prints one JSON line: median step time of the split step (jit(grad) + jit(adam update) with
donated parameters and state) and of the fused step (one jit, donated), each with the batch
already on the device and with the batch coming from host memory every step (as nitro's
step_bench does), each timed per step (dispatch, then wait for the new parameters) and pipelined
(steps dispatched back to back, one wait at the end: total / steps), and the first step time
(tracing and compiling included).
"""

import numpy as np

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
B1, B2, EPS, LR = 0.9, 0.999, 1e-8, 1e-3


def init(key):
    k1, k2 = jax.random.split(key)
    def glorot(k, fan_in, fan_out):
        limit = (6.0 / (fan_in + fan_out)) ** 0.5
        return jax.random.uniform(k, (fan_in, fan_out), jnp.float32, -limit, limit)
    return [glorot(k1, 64, 128), jnp.zeros(128), glorot(k2, 128, 10), jnp.zeros(10)]


def loss_fn(params, x, y):
    w1, b1, w2, b2 = params
    logits = jnp.tanh(x @ w1 + b1) @ w2 + b2
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def adam(params, grads, m, v, t):
    m = [B1 * mi + (1 - B1) * g for mi, g in zip(m, grads)]
    v = [B2 * vi + (1 - B2) * g * g for vi, g in zip(v, grads)]
    t = t + 1.0
    c1, c2 = 1 - B1 ** t, 1 - B2 ** t
    params = [p - LR * (mi / c1) / (jnp.sqrt(vi / c2) + EPS) for p, mi, vi in zip(params, m, v)]
    return params, m, v, t


grad = jax.jit(jax.value_and_grad(loss_fn))
update = jax.jit(adam, donate_argnums=(0, 2, 3, 4))


@jax.jit
def _fused(params, m, v, t, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    params, m, v, t = adam(params, grads, m, v, t)
    return loss, params, m, v, t


fused = jax.jit(_fused, donate_argnums=(0, 1, 2, 3))


def batches(on_device):
    rng = np.random.default_rng(0)
    out = []
    for i in range(56):
        x = rng.random((32, 64), dtype=np.float32)
        y = rng.integers(0, 10, size=(32,), dtype=np.int32)
        out.append((jax.device_put(x), jax.device_put(y)) if on_device else (x, y))
    return out


def run_split(data):
    params = init(jax.random.PRNGKey(1))
    m = [jnp.zeros_like(p) for p in params]
    v = [jnp.zeros_like(p) for p in params]
    t = jnp.float32(0.0)
    started = time.perf_counter()
    loss, g = grad(params, *data[0])
    params, m, v, t = update(params, g, m, v, t)
    jax.block_until_ready(params)
    first_ms = (time.perf_counter() - started) * 1e3
    times = []
    for i in range(STEPS):
        s = time.perf_counter()
        loss, g = grad(params, *data[(i + 1) % len(data)])
        params, m, v, t = update(params, g, m, v, t)
        jax.block_until_ready(params)
        times.append((time.perf_counter() - s) * 1e6)
    # Pipelined: steps dispatched back to back, one wait at the end.
    s = time.perf_counter()
    for i in range(STEPS):
        loss, g = grad(params, *data[(i + 1) % len(data)])
        params, m, v, t = update(params, g, m, v, t)
    jax.block_until_ready(params)
    pipelined = (time.perf_counter() - s) * 1e6 / STEPS
    return statistics.median(times), first_ms, float(loss), pipelined


def run_fused(data):
    params = init(jax.random.PRNGKey(1))
    m = [jnp.zeros_like(p) for p in params]
    v = [jnp.zeros_like(p) for p in params]
    t = jnp.float32(0.0)
    started = time.perf_counter()
    loss, params, m, v, t = fused(params, m, v, t, *data[0])
    jax.block_until_ready(params)
    first_ms = (time.perf_counter() - started) * 1e3
    times = []
    for i in range(STEPS):
        s = time.perf_counter()
        loss, params, m, v, t = fused(params, m, v, t, *data[(i + 1) % len(data)])
        jax.block_until_ready(params)
        times.append((time.perf_counter() - s) * 1e6)
    s = time.perf_counter()
    for i in range(STEPS):
        loss, params, m, v, t = fused(params, m, v, t, *data[(i + 1) % len(data)])
    jax.block_until_ready(params)
    pipelined = (time.perf_counter() - s) * 1e6 / STEPS
    return statistics.median(times), first_ms, float(loss), pipelined


def trivial_dispatch():
    """Median time of one call of a trivial cached program (x + 1 on a scalar already on the
    device), waited for: the runtime's own cost per execute."""
    f = jax.jit(lambda x: x + 1.0)
    x = jnp.float32(0.0)
    jax.block_until_ready(f(x))
    times = []
    for _ in range(STEPS):
        s = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append((time.perf_counter() - s) * 1e6)
    return statistics.median(times)


def grad_compile_ms(data, runs=5):
    """Median time XLA takes to compile the gradient program (lowering excluded), a fresh
    compile each run: the floor any first step pays."""
    params = init(jax.random.PRNGKey(1))
    times = []
    for _ in range(runs):
        lowered = jax.jit(jax.value_and_grad(loss_fn)).lower(params, *data[0])
        s = time.perf_counter()
        lowered.compile()
        times.append((time.perf_counter() - s) * 1e3)
        jax.clear_caches()
    return statistics.median(times)


if __name__ == "__main__":
    dispatch_us = trivial_dispatch()
    on_device = batches(True)
    split_us, split_first, _, split_pipe = run_split(on_device)
    fused_us, fused_first, _, fused_pipe = run_fused(on_device)
    compile_ms = grad_compile_ms(on_device)
    from_host = batches(False)
    split_host_us, _, _, split_host_pipe = run_split(from_host)
    fused_host_us, _, _, fused_host_pipe = run_fused(from_host)
    print(json.dumps({
        "bench": "jax", "jax": jax.__version__, "steps": STEPS,
        "split_step_us_median": round(split_us, 1), "fused_step_us_median": round(fused_us, 1),
        "split_host_batch_step_us_median": round(split_host_us, 1),
        "fused_host_batch_step_us_median": round(fused_host_us, 1),
        "split_pipelined_step_us": round(split_pipe, 1), "fused_pipelined_step_us": round(fused_pipe, 1),
        "split_host_batch_pipelined_step_us": round(split_host_pipe, 1),
        "fused_host_batch_pipelined_step_us": round(fused_host_pipe, 1),
        "split_first_step_ms": round(split_first, 1), "fused_first_step_ms": round(fused_first, 1),
        "trivial_dispatch_us": round(dispatch_us, 1),
        "grad_compile_ms": round(compile_ms, 1),
    }))
