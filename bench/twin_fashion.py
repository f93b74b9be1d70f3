"""The JAX twin of nitro's fashion example (`examples/examples/fashion.rs`): the same CNN
(conv 3x3 16 -> relu -> max-pool 2x2/2 -> conv 3x3 32 -> relu -> max-pool 2x2/2 -> dense 10,
NHWC, HWIO kernels, "SAME" padding), from the same initial weights, on the same batches, with
nitro's Adam and cosine schedule, timed the way nitro times its training handle.

    python bench/twin_fashion.py BUNDLE [--steps N] [--losses N] [--losses-out F.npy] [--json]
                                        [--dump-hlo DIR] [--cache DIR] [--pjrt-plugin PATH]
    python bench/twin_fashion.py --make-test-bundle DIR [--data DIR] [--train-rows N] [--epochs N]

BUNDLE is what the nitro example writes with `--twin DIR` (see twin_common.py); the images are
read from run.json's `data_dir` (the four idx files, gzip'd or not; a relative path is taken
from the working directory, else from the bundle directory). The test accuracy on the 10 000 test images is evaluated after
every epoch (ceil(train_rows / batch) steps) and after the last step; the last one is reported.
"""

import time

STARTED = time.perf_counter()

import gzip  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import twin_common as tc  # noqa: E402  (imports JAX, after --dump-hlo)

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

# The Debian package dataset-fashion-mnist's directory, the default of nitro's idx reader.
DEBIAN_DATA = "/usr/share/datasets/fashion-mnist"


def expected_leaves():
    return {
        "conv1.w": (3, 3, 1, 16), "conv1.b": (16,),
        "conv2.w": (3, 3, 16, 32), "conv2.b": (32,),
        "dense.w": (7 * 7 * 32, 10), "dense.b": (10,),
    }


# ---- the model ---------------------------------------------------------------------------------


def conv(x, w, b):
    y = lax.conv_general_dilated(x, w, window_strides=(1, 1), padding="SAME",
                                 dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y + b


def max_pool(x):
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def logits(p, x):
    h = max_pool(jax.nn.relu(conv(x, p["conv1.w"], p["conv1.b"])))
    h = max_pool(jax.nn.relu(conv(h, p["conv2.w"], p["conv2.b"])))
    h = h.reshape(h.shape[0], -1)
    return h @ p["dense.w"] + p["dense.b"]


def cross_entropy(z, y):
    # Half-precision logits are widened first, as nitro's softmax_cross_entropy does.
    logp = jax.nn.log_softmax(z.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, y[:, None], axis=-1)[:, 0]


def per_row_loss(p, x, y, key):  # no dropout in this model
    return cross_entropy(logits(p, x), y)


def eval_sums(p, x, y, mask):
    z = logits(p, x)
    correct = (jnp.argmax(z, axis=-1) == y).astype(jnp.float32)
    return jnp.sum(cross_entropy(z, y) * mask), jnp.sum(correct * mask)


# ---- data -------------------------------------------------------------------------------------


def read_idx(directory, stem):
    for name in (stem + ".gz", stem):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            opener = gzip.open if name.endswith(".gz") else open
            with opener(path, "rb") as f:
                raw = f.read()
            rank = raw[3]
            dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(rank)]
            return np.frombuffer(raw, np.uint8, offset=4 + 4 * rank).reshape(dims)
    raise SystemExit(f"error: no {stem}(.gz) in {directory}")


def load_fashion(directory):
    def images(stem):
        return (read_idx(directory, stem).astype(np.float32) / 255.0).reshape(-1, 28, 28, 1)

    def labels(stem):
        return read_idx(directory, stem).astype(np.int32)

    return (images("train-images-idx3-ubyte"), labels("train-labels-idx1-ubyte"),
            images("t10k-images-idx3-ubyte"), labels("t10k-labels-idx1-ubyte"))


# ---- a synthetic bundle, for testing the twin without nitro ---------------------------------------


def make_test_bundle(args):
    rng = np.random.default_rng(7)
    rows, batch, epochs = args.train_rows, 128, args.epochs
    steps = -(-rows // batch) * epochs

    def he(*shape):
        return rng.normal(0.0, (2.0 / np.prod(shape[:-1])) ** 0.5, shape)

    limit = (6.0 / (1568 + 10)) ** 0.5
    params = {
        "conv1.w": he(3, 3, 1, 16), "conv1.b": np.zeros(16),
        "conv2.w": he(3, 3, 16, 32), "conv2.b": np.zeros(32),
        "dense.w": rng.uniform(-limit, limit, (1568, 10)), "dense.b": np.zeros(10),
    }
    batches, real = tc.test_batches(rows, batch, steps, rng)
    run = {
        "model": "fashion", "steps": steps, "batch": batch,
        "schedule": tc.test_schedule(2e-3, steps, 0.01, 0.05),
        "adam": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8},
        "weight_decay": 0.0, "decayed": [], "dropout": 0.0, "seed": 1,
        "data_dir": os.path.abspath(args.data), "train_rows": rows, "epochs": epochs,
    }
    tc.write_test_bundle(args.make_test_bundle, run, params, batches, real)
    print(f"wrote {args.make_test_bundle}: {steps} steps of {batch}, {rows} rows, {epochs} epoch(s)")


def main():
    def extra(p):
        p.add_argument("--data", default=DEBIAN_DATA, help="test bundle: the idx directory")
        p.add_argument("--train-rows", type=int, default=6000, help="test bundle: training rows (6000)")
        p.add_argument("--epochs", type=int, default=1, help="test bundle: epochs (1)")

    args = tc.parse_args("fashion", extra)
    if args.make_test_bundle:
        return make_test_bundle(args)
    say = tc.sayer(args)
    run, params, batches, real = tc.load_bundle(args.bundle, "fashion")
    precision = tc.precision_of(run, args)
    tc.check_params(params, expected_leaves())
    data_dir = run["data_dir"]
    if not os.path.isdir(data_dir):  # a relative path not from here: from the bundle
        data_dir = os.path.join(args.bundle, data_dir)
    train_x, train_y, test_x, test_y = load_fashion(data_dir)
    rows = int(run["train_rows"])
    train_x, train_y = train_x[:rows], train_y[:rows]
    if batches.max() >= rows:
        raise SystemExit(f"error: batches.npy names row {batches.max()}, train_rows is {rows}")
    steps = min(args.steps or run["steps"], run["steps"])
    per_epoch = -(-rows // run["batch"])
    say(f"data     Fashion-MNIST, {rows} train / {len(test_x)} test images")
    say(f"backend  jax {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind})")
    say(f"run      {steps} steps of {run['batch']} ({per_epoch} per epoch), adam, peak lr {run['schedule']['base']}, "
        f"computing in {precision}")

    def gather(idx):
        return train_x[idx], train_y[idx]

    eval_after = set(range(per_epoch, steps + 1, per_epoch))
    timing, losses, sums, n = tc.train(run, params, batches, real, steps, gather,
                                       tc.with_precision(run, (per_row_loss, eval_sums)), (test_x, test_y),
                                       eval_after, STARTED)
    accuracy = sums[1] / n
    say(f"test     loss {sums[0] / n:.4f}, accuracy {accuracy:.4f}")
    tc.report("fashion", args, steps, losses, {"test_accuracy": round(accuracy, 6), "precision": precision}, timing, STARTED, say)


if __name__ == "__main__":
    main()
