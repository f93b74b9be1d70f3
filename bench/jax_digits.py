"""The digits example in JAX on CPU: the same MLP (64 -> 128 tanh -> 10), Adam, batch 32, a
cosine learning-rate schedule from 1e-2 with a 5% warm-up, 10 epochs over an 80/20 split with
the ragged last batch padded and masked, validation after every epoch — what
`cargo run --release -p nitro-examples --example digits` runs through nitro — timed the same
way, for the wall-time comparison of the training handle.

Run in a throwaway virtual environment (JAX is never a dependency of nitro), from the
workspace root:

    python3 -m venv /tmp/jaxvenv && /tmp/jaxvenv/bin/pip install jax==0.10.2
    /tmp/jaxvenv/bin/python bench/jax_digits.py [epochs]

Prints one JSON line: the validation accuracy, the first step (tracing and compiling
included), the training loop's wall time (`fit_s`: every epoch, validation included) and the
process's wall time from its start (`process_s`, the interpreter and the import of JAX
included). The split and the shuffles use NumPy's generator, not nitro's, so accuracies differ
by split; the timed work is the same.
"""

import time

STARTED = time.perf_counter()

import gzip  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402

import os  # noqa: E402

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

# The same initial parameters as the step benchmark's.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_jax import init  # noqa: E402

EPOCHS = int(sys.argv[1]) if len(sys.argv) > 1 else 10
BATCH, LR, B1, B2, EPS = 32, 1e-2, 0.9, 0.999, 1e-8


def load():
    rows = [
        [int(v) for v in line.split(",")]
        for line in gzip.open("examples/data/digits.csv.gz", "rt")
        if line.strip()
    ]
    data = np.array(rows)
    return (data[:, :64] / 16.0).astype(np.float32), data[:, 64].astype(np.int32)


def per_example(params, x, y):
    w1, b1, w2, b2 = params
    logits = jnp.tanh(x @ w1 + b1) @ w2 + b2
    logp = jax.nn.log_softmax(logits)
    loss = -jnp.take_along_axis(logp, y[:, None], axis=1)[:, 0]
    return loss, (jnp.argmax(logits, axis=1) == y).astype(jnp.float32)


def mean_loss(params, x, y, mask):
    loss, _ = per_example(params, x, y)
    return jnp.sum(loss * mask) / jnp.maximum(jnp.sum(mask), 1.0)


grad = jax.jit(jax.value_and_grad(mean_loss))


def adam(params, grads, m, v, t, lr):
    m = [B1 * mi + (1 - B1) * g for mi, g in zip(m, grads)]
    v = [B2 * vi + (1 - B2) * g * g for vi, g in zip(v, grads)]
    t = t + 1.0
    c1, c2 = 1 - B1**t, 1 - B2**t
    params = [p - lr * (mi / c1) / (jnp.sqrt(vi / c2) + EPS) for p, mi, vi in zip(params, m, v)]
    return params, m, v, t


update = jax.jit(adam, donate_argnums=(0, 2, 3, 4))


@jax.jit
def evaluate(params, x, y, mask):
    loss, correct = per_example(params, x, y)
    return jnp.sum(loss * mask), jnp.sum(correct * mask)


def batches(x, y, order):
    for start in range(0, len(order), BATCH):
        idx = order[start : start + BATCH]
        real = len(idx)
        pad = np.concatenate([idx, np.repeat(idx[:1], BATCH - real)]) if real < BATCH else idx
        mask = (np.arange(BATCH) < real).astype(np.float32)
        yield x[pad], y[pad], mask, real


def cosine(step, total):
    warmup = total // 20
    if step < warmup:
        return LR * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    low = LR / 100
    return low + 0.5 * (LR - low) * (1 + math.cos(math.pi * p))


def main():
    x, y = load()
    rng = np.random.default_rng(1)
    order = rng.permutation(len(x))
    cut = round(0.8 * len(x))
    train, val = np.sort(order[:cut]), np.sort(order[cut:])
    params = init(jax.random.PRNGKey(1))
    m = [jnp.zeros_like(p) for p in params]
    v = [jnp.zeros_like(p) for p in params]
    t = jnp.float32(0.0)
    total = math.ceil(len(train) / BATCH) * EPOCHS
    step, first_step = 0, None
    fit_started = time.perf_counter()
    acc = 0.0
    for epoch in range(EPOCHS):
        shuffled = np.random.default_rng(epoch).permutation(train)
        losses = []
        for bx, by, mask, _ in batches(x, y, shuffled):
            loss, g = grad(params, bx, by, mask)
            params, m, v, t = update(params, g, m, v, t, jnp.float32(cosine(step, total)))
            losses.append(loss)
            step += 1
            if first_step is None:
                jax.block_until_ready(params)
                first_step = time.perf_counter() - fit_started
        jax.block_until_ready(losses)
        correct = rows = 0
        for bx, by, mask, real in batches(x, y, val):
            _, c = evaluate(params, bx, by, mask)
            correct += float(c)
            rows += real
        acc = correct / rows
    fit_s = time.perf_counter() - fit_started
    print(json.dumps({
        "bench": "jax_digits", "jax": jax.__version__, "epochs": EPOCHS,
        "val_accuracy": round(acc, 4), "first_step_ms": round(first_step * 1e3, 1),
        "fit_s": round(fit_s, 3), "process_s": round(time.perf_counter() - STARTED, 3),
    }))


if __name__ == "__main__":
    main()
