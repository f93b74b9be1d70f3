"""The JAX twin of nitro's chargpt example (`examples/examples/chargpt.rs`): the same
character-level GPT (token + position embeddings, pre-norm causal blocks as nitro::nn's
TransformerBlock, a final LayerNorm, a linear head), from the same initial weights, on the same
windows, with nitro's AdamW and cosine schedule, timed the way nitro times its training handle.

    python bench/twin_chargpt.py BUNDLE [--steps N] [--losses N] [--losses-out F.npy] [--json]
                                        [--dump-hlo DIR] [--cache DIR]
    python bench/twin_chargpt.py --make-test-bundle DIR

Besides the common bundle files (twin_common.py) the bundle holds `train.npy` and `val.npy`,
`int32 [rows, context + 1]` windows (x = w[:, :T], y = w[:, 1:]). A window's loss is the mean
cross-entropy over its positions in nats; after the last step the validation windows are
evaluated in order and `val_bits_per_char` is their mean loss / ln 2.

The block, as nitro's: x + drop(attn(ln1(x))), then x + drop(fc2(gelu(fc1(ln2(x))))), exact
(erf) GELU, the causal mask a finite -1e9, scores scaled by 1/sqrt(head width). Dropout (while
training only) is on the attention's output projection and on the MLP's output, before each
residual add, nowhere else; its keys are fold_in(fold_in(PRNGKey(seed), step), call) for the
calls in forward order (nitro draws a fresh key per call from the step's key; the masks are not
nitro's bits).
"""

import time

STARTED = time.perf_counter()

import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import twin_common as tc  # noqa: E402  (imports JAX, after --dump-hlo)

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

MASKED = -1e9


def hidden_of(run):
    return int(run.get("hidden", 4 * run["width"]))


def expected_leaves(run):
    d, v, t, h = run["width"], run["vocab"], run["context"], hidden_of(run)
    leaves = {"tokens.table": (v, d), "positions.table": (t, d)}
    for i in range(run["layers"]):
        b = f"blocks[{i}]."
        leaves.update({b + "ln1.gain": (d,), b + "ln1.bias": (d,),
                       b + "ln2.gain": (d,), b + "ln2.bias": (d,)})
        for n in "qkvo":
            leaves.update({b + f"attention.{n}.w": (d, d), b + f"attention.{n}.b": (d,)})
        leaves.update({b + "fc1.w": (d, h), b + "fc1.b": (h,), b + "fc2.w": (h, d), b + "fc2.b": (d,)})
    leaves.update({"norm.gain": (d,), "norm.bias": (d,), "head.w": (d, v), "head.b": (v,)})
    return leaves


# ---- the model ---------------------------------------------------------------------------------


def make_model(run):
    layers, heads = run["layers"], run["heads"]
    # nitro's TransformerBlock normalizes with LayerNorm::new (eps 1e-5) whatever the final
    # norm's eps (run.json's ln_eps) is.
    block_eps, final_eps = 1e-5, float(run.get("ln_eps", 1e-5))
    rate = float(run.get("dropout", 0.0))

    def linear(p, name, x):
        return x @ p[name + ".w"] + p[name + ".b"]

    def layer_norm(p, name, x, eps=block_eps):
        mean = jnp.mean(x, axis=-1, keepdims=True)
        centered = x - mean
        var = jnp.mean(centered * centered, axis=-1, keepdims=True)
        return centered * jax.lax.rsqrt(var + eps) * p[name + ".gain"] + p[name + ".bias"]

    def attention(p, name, x):
        b, t, d = x.shape
        dh = d // heads

        def split(n):
            return linear(p, f"{name}.{n}", x).reshape(b, t, heads, dh).transpose(0, 2, 1, 3)

        q, k, v = split("q"), split("k"), split("v")
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(dh)
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(causal, scores, MASKED)
        out = jax.nn.softmax(scores, axis=-1) @ v
        return linear(p, f"{name}.o", out.transpose(0, 2, 1, 3).reshape(b, t, d))

    def logits(p, x, key):
        t = x.shape[1]
        h = p["tokens.table"][x] + p["positions.table"][:t]
        calls = 0

        def drop(a):
            nonlocal calls
            k = None if key is None else jax.random.fold_in(key, calls)
            calls += 1
            return tc.dropout(a, rate, k)

        for i in range(layers):
            b = f"blocks[{i}]"
            h = h + drop(attention(p, f"{b}.attention", layer_norm(p, f"{b}.ln1", h)))
            m = linear(p, f"{b}.fc1", layer_norm(p, f"{b}.ln2", h))
            h = h + drop(linear(p, f"{b}.fc2", jax.nn.gelu(m, approximate=False)))
        return linear(p, "head", layer_norm(p, "norm", h, final_eps))

    def window_loss(p, x, y, key):
        logp = jax.nn.log_softmax(logits(p, x, key), axis=-1)
        nll = -jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]
        return jnp.mean(nll, axis=1)

    def eval_sums(p, x, y, mask):
        return (jnp.sum(window_loss(p, x, y, None) * mask),)

    return window_loss, eval_sums


# ---- a synthetic bundle, for testing the twin without nitro ---------------------------------------


def make_test_bundle(args):
    rng = np.random.default_rng(11)
    layers, d, heads, t, vocab = 2, 64, 4, 32, 60
    batch, steps = 16, 60
    run = {
        "model": "chargpt", "steps": steps, "batch": batch,
        "schedule": tc.test_schedule(3e-3, steps, 0.1, 0.1),
        "adam": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
        "weight_decay": 0.01, "dropout": 0.1, "seed": 1,
        "layers": layers, "width": d, "heads": heads, "context": t, "vocab": vocab, "ln_eps": 1e-5,
    }
    params = {}
    for name, shape in expected_leaves(run).items():
        if name.endswith(".gain"):
            params[name] = np.ones(shape)
        elif name.endswith((".b", ".bias")):
            params[name] = np.zeros(shape)
        elif name.endswith(".table"):
            params[name] = rng.normal(0.0, 0.02, shape)
        else:
            limit = (6.0 / sum(shape)) ** 0.5
            params[name] = rng.uniform(-limit, limit, shape)
    # As nitro's chargpt optimizer: AdamW sparing nn::NO_DECAY ("*.b|*.bias|*.gain").
    run["decayed"] = sorted(n for n in params if not n.endswith((".b", ".bias", ".gain")))
    # A low-entropy "text": a random sparse bigram chain over the vocabulary.
    nexts = rng.integers(0, vocab, (vocab, 3))
    ids = [0]
    for _ in range(20000):
        ids.append(int(nexts[ids[-1], rng.integers(0, 3)]))
    ids = np.array(ids, np.int32)

    def windows(part, count):
        starts = rng.integers(0, len(part) - t - 1, count)
        return np.stack([part[s:s + t + 1] for s in starts]).astype(np.int32)

    cut = len(ids) * 9 // 10
    train, val = windows(ids[:cut], steps * batch), windows(ids[cut:], 4 * batch - 3)
    batches = np.arange(steps * batch).reshape(steps, batch)
    real = np.full(steps, batch)
    real[-1] = batch - 5  # a ragged last step, its padding copies of real rows
    batches[-1, real[-1]:] = batches[-1, :5]
    tc.write_test_bundle(args.make_test_bundle, run, params, batches, real,
                         {"train.npy": train, "val.npy": val})
    print(f"wrote {args.make_test_bundle}: {steps} steps of {batch} windows of {t}, "
          f"{layers} blocks, width {d}")


def main():
    args = tc.parse_args("chargpt")
    if args.make_test_bundle:
        return make_test_bundle(args)
    say = tc.sayer(args)
    run, params, batches, real = tc.load_bundle(args.bundle, "chargpt")
    tc.check_params(params, expected_leaves(run))
    if run["width"] % run["heads"]:
        raise SystemExit("error: width must be a multiple of heads")
    unknown = sorted(set(run.get("decayed", [])) - set(params))
    if unknown:
        raise SystemExit(f"error: run.json decays unknown leaves {unknown}")
    t = run["context"]
    train = np.load(os.path.join(args.bundle, "train.npy")).astype(np.int32)
    val = np.load(os.path.join(args.bundle, "val.npy")).astype(np.int32)
    for name, w in (("train", train), ("val", val)):
        if w.ndim != 2 or w.shape[1] != t + 1:
            raise SystemExit(f"error: {name}.npy is {list(w.shape)}, expected [rows, {t + 1}]")
        if w.min() < 0 or w.max() >= run["vocab"]:
            raise SystemExit(f"error: {name}.npy holds an id outside 0..{run['vocab']}")
    if batches.max() >= len(train):
        raise SystemExit(f"error: batches.npy names row {batches.max()}, train.npy has {len(train)}")
    train_x, train_y = np.ascontiguousarray(train[:, :t]), np.ascontiguousarray(train[:, 1:])
    val_x, val_y = np.ascontiguousarray(val[:, :t]), np.ascontiguousarray(val[:, 1:])
    steps = min(args.steps or run["steps"], run["steps"])
    say(f"data     {len(train)} train / {len(val)} validation windows of {t}, vocabulary {run['vocab']}")
    say(f"backend  jax {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind})")
    say(f"model    {run['layers']} blocks, width {run['width']}, {run['heads']} heads, dropout "
        f"{run.get('dropout', 0.0)}, adamw (decay {run.get('weight_decay', 0.0)}), "
        f"peak lr {run['schedule']['base']}, {steps} steps of {run['batch']}")

    def gather(idx):
        return train_x[idx], train_y[idx]

    timing, losses, sums, n = tc.train(run, params, batches, real, steps, gather,
                                       make_model(run), (val_x, val_y), set(), STARTED)
    bits = sums[0] / n / math.log(2)
    say(f"held out {bits:.4f} bits/char")
    tc.report("chargpt", args, steps, losses, {"val_bits_per_char": round(bits, 6)}, timing, STARTED, say)


if __name__ == "__main__":
    main()
