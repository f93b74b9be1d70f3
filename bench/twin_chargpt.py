"""The JAX twin of nitro's chargpt example (`examples/examples/chargpt.rs`): the same
character-level GPT (token + position embeddings, pre-norm causal blocks as nitro::nn's
TransformerBlock, a final LayerNorm, a linear head), from the same initial weights, on the same
windows, with nitro's AdamW and cosine schedule, timed the way nitro times its training handle.

    python bench/twin_chargpt.py BUNDLE [--steps N] [--losses N] [--losses-out F.npy] [--json]
                                        [--dump-hlo DIR] [--cache DIR] [--pjrt-plugin PATH] [--form unrolled|scan]
                                        [--fsdp N] [--precision f32|bf16|f16]
    python bench/twin_chargpt.py --make-test-bundle DIR [--form unrolled|scan]

`--precision` (default: run.json's `precision`, else f32) computes as nitro's Config::precision
does: f32 parameters and Adam state, every float leaf and input converted to the half dtype
where the model reads it, LayerNorm's statistics, the attention softmax and the log-softmax in
f32, the loss reduced in f32; f16 scales the loss dynamically (run.json's `loss_scaling`).

Besides the common bundle files (twin_common.py) the bundle holds `train.npy` and `val.npy`,
`int32 [rows, context + 1]` windows (x = w[:, :T], y = w[:, 1:]). A window's loss is the mean
cross-entropy over its positions in nats; after the last step the validation windows are
evaluated in order and `val_bits_per_char` is their mean loss / ln 2.

A bucketed bundle (`chargpt --buckets K --twin DIR`: `"buckets"` in run.json; the format is
documented in examples/src/twin.rs) holds whole documents as ragged columns and the epoch's
plan instead. Step i of edge e trains `bucket_rows[e]` rows padded (id 0) or truncated to e
positions: the plan's real rows, then weight-0 copies of them; a row's loss is its mean
cross-entropy over its real positions (`valid`), the step's loss the mean over the batch's real
positions (rows weighted by their real positions). The one jitted train step is compiled ahead
of time for every edge before the first step (jit specializes by shape), the evaluation likewise
after it; validation bins the val rows by edge and reports the mean over all their real
positions. The JSON line adds `train_loss` and `val_loss` (nats, means over real positions, as
nitro's epoch table), the per-edge compile times, `tokens_per_s` and the padding fractions.

The blocks' leaves come in one of two layouts, as nitro's model has them: unrolled
(`blocks[i].X`, one leaf per block) or, from `chargpt --scan` (`"scan": true` in run.json),
stacked (`stack.X`, `[layers, ...]`, row i block i's X; run.json's `decayed` names `stack.*`).
`--form` chooses how the twin runs the blocks, whatever the bundle's layout (default: the
bundle's): `unrolled`, a Python loop over per-block leaves (one copy of the block per layer in
the program), or `scan`, one `jax.lax.scan` over the stacked leaves (the activation the carry,
the stacked leaves and the layer index the xs: one copy of the block). The loaded weights are
stacked or unstacked once, at load time, into the form's layout, and the decayed set mapped with
them (`stack.X` <-> every `blocks[i].X`), so the optimizer sees one layout throughout. The JSON
line adds `form` and `layers`.

The block, as nitro's: x + drop(attn(ln1(x))), then x + drop(fc2(gelu(fc1(ln2(x))))), exact
(erf) GELU, the causal mask a finite -1e9, scores scaled by 1/sqrt(head width). Dropout (while
training only) is on the attention's output projection and on the MLP's output, before each
residual add, nowhere else. Its keys are derived as nitro derives them for the model it ran (the
bundle's layout), in either form, so both forms draw the same masks: from the step's key
fold_in(PRNGKey(seed), step), separate blocks (unrolled bundles) fold in the call's index in
forward order (2 calls a block: fold_in(step_key, 2 i + c)), a stacked model (`--scan`) the
layer and then the call (fold_in(fold_in(step_key, i), c)); c is 0 for the attention's call and
1 for the MLP's. (JAX's threefry and bernoulli here; on the bundles tried, the losses with dropout
on tracked nitro's as closely as without it.)

`--fsdp N` (N >= 1; default 0, off: one device) trains fully sharded data parallel over the first
N of `jax.devices()`, a mesh of one axis, "data". The flag is read from the command line before
JAX is imported, to append `--xla_force_host_platform_device_count=N` to XLA_FLAGS (so JAX on CPU
has N host devices; spell it `--fsdp N` or `--fsdp=N`). Every parameter leaf, and Adam's m and v
beside it, is split along "data" on its largest dim that N divides (ties: the earliest dim; a leaf
with no such dim, whole on every device); the gradients are constrained to their parameters'
sharding; the training (and evaluation) batch is split by rows, so the batch (each edge's
`bucket_rows`, bucketed) must be a multiple of N. The jitted step is twin_common's, with explicit
in/out shardings (params and optimizer state keep theirs across steps and are donated, as without
--fsdp; the loss comes back replicated), and the initial leaves are put in their shards before the
first step: only placement changes, not the loss or the optimizer's math (the losses match the
one-device run's up to float reassociation in the cross-device reductions). The timing is
measured as without it. The JSON line adds `fsdp` (N, 0 when off) and `state_bytes_per_device`,
the bytes of parameters and optimizer state on the mesh's first device after the last step (off:
the one device's, 3 x the parameters' bytes); `peak_rss_mb` is the process's, all devices.
Unbucketed, it also adds `place_ms` (putting the parameters and zeroed optimizer state on their
devices, before the first step's clock starts) and `first_step_from_host_ms` (that plus the
first step: the work nitro's first step, counted from the handle, covers).
"""

import time

STARTED = time.perf_counter()

import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _fsdp_from_argv():
    """`--fsdp N` (or `--fsdp=N`; the last, as argparse) from the command line, 0 without it or
    when N is not an integer (argparse then says so): read before JAX is imported, which fixes
    its device count."""
    argv, value = sys.argv[1:], "0"
    for i, a in enumerate(argv):
        if a == "--fsdp" and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith("--fsdp="):
            value = a.split("=", 1)[1]
    try:
        return int(value)
    except ValueError:
        return 0


if _fsdp_from_argv() >= 1:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={_fsdp_from_argv()}").strip()

import twin_common as tc  # noqa: E402  (imports JAX, after --dump-hlo and --fsdp)

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

MASKED = -1e9
FORMS = ("unrolled", "scan")
STACK = "stack."


def block_prefix(i):
    return f"blocks[{i}]."


def hidden_of(run):
    return int(run.get("hidden", 4 * run["width"]))


def layout_of(run):
    """The bundle's layout of the blocks' leaves: "scan" (stacked) or "unrolled"."""
    return "scan" if run.get("scan") else "unrolled"


def block_leaves(run):
    """One block's leaves, by their name inside the block, and their shapes."""
    d, h = run["width"], hidden_of(run)
    leaves = {"ln1.gain": (d,), "ln1.bias": (d,), "ln2.gain": (d,), "ln2.bias": (d,)}
    for n in "qkvo":
        leaves.update({f"attention.{n}.w": (d, d), f"attention.{n}.b": (d,)})
    leaves.update({"fc1.w": (d, h), "fc1.b": (h,), "fc2.w": (h, d), "fc2.b": (d,)})
    return leaves


def expected_leaves(run, form=None):
    """Every leaf's name and shape in `form`'s layout (default: the bundle's): unrolled
    `blocks[i].X`, or scan `stack.X` with a leading axis of the layer count."""
    d, v, t, layers = run["width"], run["vocab"], run["context"], run["layers"]
    block = block_leaves(run)
    leaves = {"tokens.table": (v, d), "positions.table": (t, d)}
    if (form or layout_of(run)) == "scan":
        leaves.update({STACK + n: (layers, *shape) for n, shape in block.items()})
    else:
        for i in range(layers):
            leaves.update({block_prefix(i) + n: shape for n, shape in block.items()})
    leaves.update({"norm.gain": (d,), "norm.bias": (d,), "head.w": (d, v), "head.b": (v,)})
    return leaves


def to_form(run, params, form):
    """The bundle's parameters (checked against its layout) and run.json's decayed leaves in
    `form`'s layout: block i's leaves stacked as row i of `stack.X`, or the stacked leaves split
    into `blocks[i].X`; `stack.X` is decayed exactly when every `blocks[i].X` is."""
    decayed = list(run.get("decayed", []))
    if form == layout_of(run):
        return params, decayed
    layers, block = run["layers"], block_leaves(run)
    per_layer = {block_prefix(i) + n for i in range(layers) for n in block} | {STACK + n for n in block}
    out = {k: v for k, v in params.items() if k not in per_layer}
    new_decayed = [n for n in decayed if n not in per_layer]
    decayed = set(decayed)
    for n, shape in block.items():
        names = [block_prefix(i) + n for i in range(layers)]
        if form == "scan":
            out[STACK + n] = (np.stack([params[m] for m in names]) if names
                              else np.zeros((0, *shape), np.float32))
            flags = {m in decayed for m in names}
            if len(flags) > 1:
                raise SystemExit(f"error: run.json decays {n} in some blocks and not in others: "
                                 "one stacked leaf (--form scan) cannot")
            if True in flags:
                new_decayed.append(STACK + n)
        else:
            for i, m in enumerate(names):
                out[m] = np.ascontiguousarray(params[STACK + n][i])
            if STACK + n in decayed:
                new_decayed.extend(names)
    return out, new_decayed


# ---- the model ---------------------------------------------------------------------------------


def make_nll(run, form):
    """The per-position cross-entropy `nll(params, x, y, key)` -> `[n, T]` in nats (dropout on
    when `key` is given); T is x's length, at most the context (positions 0..T-1). `params` in
    `form`'s layout; the blocks run as a Python loop (unrolled) or one lax.scan (scan)."""
    layers, heads = run["layers"], run["heads"]
    # nitro's TransformerBlock normalizes with LayerNorm::new (eps 1e-5) whatever the final
    # norm's eps (run.json's ln_eps) is.
    block_eps, final_eps = 1e-5, float(run.get("ln_eps", 1e-5))
    rate = float(run.get("dropout", 0.0))

    def linear(p, name, x):
        return x @ p[name + ".w"] + p[name + ".b"]

    def layer_norm(p, name, x, eps=block_eps):
        def normalized(x):
            centered = x - jnp.mean(x, axis=-1, keepdims=True)
            var = jnp.mean(centered * centered, axis=-1, keepdims=True)
            return centered * jax.lax.rsqrt(var + eps)

        # Half-precision input is normalized in f32, then scaled in its own dtype (nitro's).
        return tc.in_f32(x, normalized) * p[name + ".gain"] + p[name + ".bias"]

    def attention(p, name, x):
        b, t, d = x.shape
        dh = d // heads

        def split(n):
            return linear(p, f"{name}.{n}", x).reshape(b, t, heads, dh).transpose(0, 2, 1, 3)

        q, k, v = split("q"), split("k"), split("v")
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(dh)
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(causal, scores, MASKED)
        out = tc.in_f32(scores, lambda s: jax.nn.softmax(s, axis=-1)) @ v
        return linear(p, f"{name}.o", out.transpose(0, 2, 1, 3).reshape(b, t, d))

    # The dropout keys follow the model nitro ran (the bundle's layout), whatever the form:
    # nitro's Repeated (--scan) runs layer i on fold_in(step_key, i), its calls folded in
    # after; separate blocks draw from the step's key in call order (2 calls a block).
    per_layer_keys = layout_of(run) == "scan"

    def call_key(key, i, call):
        if key is None:
            return None
        if per_layer_keys:
            return jax.random.fold_in(jax.random.fold_in(key, i), call)
        return jax.random.fold_in(key, 2 * i + call)

    def block(b, h, key, i):
        """Block `i` (an int, or the scan's traced index) on the activation `h`; `b` its leaves
        by their names inside the block, `key` the step's dropout key (None: no dropout)."""

        def drop(a, call):
            return tc.dropout(a, rate, call_key(key, i, call))

        h = h + drop(attention(b, "attention", layer_norm(b, "ln1", h)), 0)
        m = linear(b, "fc1", layer_norm(b, "ln2", h))
        return h + drop(linear(b, "fc2", jax.nn.gelu(m, approximate=False)), 1)

    def inside(p, prefix):
        return {k[len(prefix):]: v for k, v in p.items() if k.startswith(prefix)}

    def logits(p, x, key):
        t = x.shape[1]
        h = p["tokens.table"][x] + p["positions.table"][:t]
        if form == "scan":
            def body(h, xs):
                b, i = xs
                return block(b, h, key, i), None

            h, _ = jax.lax.scan(body, h, (inside(p, STACK), jnp.arange(layers, dtype=jnp.int32)))
        else:
            for i in range(layers):
                h = block(inside(p, block_prefix(i)), h, key, i)
        return linear(p, "head", layer_norm(p, "norm", h, final_eps))

    def nll(p, x, y, key):
        # Half-precision logits are widened first, as nitro's softmax_cross_entropy does.
        logp = jax.nn.log_softmax(logits(p, x, key).astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]

    return nll


def make_model(run, form):
    """(per-window loss, evaluation sums) for fixed windows: the mean over all T positions."""
    nll = make_nll(run, form)

    def window_loss(p, x, y, key):
        return jnp.mean(nll(p, x, y, key), axis=1)

    def eval_sums(p, x, y, mask):
        return (jnp.sum(window_loss(p, x, y, None) * mask),)

    return tc.with_precision(run, (window_loss, eval_sums))


def make_bucketed_model(run, form):
    """(per-row loss, evaluation sums) for bucketed batches, whose `x` is the pair (ids,
    valid): a row's loss is the mean cross-entropy over its real positions, nitro's
    `(ce * valid).sum(1) / max(valid.sum(1), 1)`; the mask the step and the sums weigh rows by
    is each row's real positions (0 for padding rows), so a step's loss is the mean over its
    batch's real positions."""
    nll = make_nll(run, form)

    def row_loss(p, xv, y, key):
        x, valid = xv
        ce = nll(p, x, y, key)
        return jnp.sum(ce * valid, axis=1) / jnp.maximum(jnp.sum(valid, axis=1), 1.0)

    def eval_sums(p, xv, y, weights):
        return (jnp.sum(row_loss(p, xv, y, None) * weights),)

    return tc.with_precision(run, (row_loss, eval_sums))


# ---- FSDP (--fsdp N) -----------------------------------------------------------------------------


class Fsdp:
    """Fully sharded data parallelism over the first `n` devices (`--fsdp N`; on CPU, the N host
    devices XLA_FLAGS asked for): a one-axis mesh "data"; every parameter leaf, and Adam's m and
    v beside it, split along "data" on its largest dim that N divides (ties: the earliest; none:
    whole on every device, P()), the gradients as their parameters; the batch split by rows.
    Only placement: the step is twin_common's, the same loss and optimizer math."""

    def __init__(self, n):
        devices = jax.devices()
        if len(devices) < n:
            raise SystemExit(f"error: --fsdp {n} needs {n} devices, JAX has {len(devices)} "
                             f"({jax.default_backend()}); on a machine with an accelerator, "
                             "JAX_PLATFORMS=cpu gives the host devices --fsdp asks XLA for")
        self.n = n
        self.mesh = Mesh(np.array(devices[:n]), ("data",))
        self.replicated = NamedSharding(self.mesh, P())

    def spec(self, shape):
        best = None
        for i, d in enumerate(shape):
            if d >= self.n and d % self.n == 0 and (best is None or d > shape[best]):
                best = i
        return P() if best is None else P(*([None] * best), "data")

    def shardings(self, host_params):
        return {k: NamedSharding(self.mesh, self.spec(np.shape(v))) for k, v in host_params.items()}

    def rows(self, ndim):
        """An array split by rows (its first dim), whole along the others."""
        return NamedSharding(self.mesh, P("data", *([None] * (ndim - 1))))

    def check_rows(self, rows, what):
        if rows % self.n:
            raise SystemExit(f"error: --fsdp {self.n} splits the batch by rows; {what} has "
                             f"{rows} rows, not a multiple of {self.n}")

    def place(self, run, host_params, shardings):
        """The initial parameters and (zero) optimizer state, each leaf put in its shards."""
        params = {k: jax.device_put(v, shardings[k]) for k, v in host_params.items()}
        opt_state = tc.initial_optimizer_state(
            run, host_params,
            lambda k: jax.device_put(np.zeros_like(np.asarray(host_params[k])), shardings[k]))
        if "scale" in opt_state:
            opt_state["scale"] = jax.device_put(opt_state["scale"], self.replicated)
        return params, opt_state

    def train_step(self, run, loss, shardings, batch):
        """twin_common's jitted step (the same function, unwrapped) with explicit shardings:
        params and optimizer state in and out as `shardings` (and donated, as there), `batch`
        the x/y/mask inputs', the learning rate, step number, key and loss replicated. The loss
        sees its params through a sharding constraint to `shardings`, a no-op forward whose
        transpose puts the gradients in their parameters' shards."""

        def constrained(p, *rest):
            return loss(jax.lax.with_sharding_constraint(p, shardings), *rest)

        step = tc.make_train_step(run, constrained).__wrapped__
        rep, state = self.replicated, {"m": shardings, "v": shardings}
        if tc.loss_scaling(run) is not None:
            state["scale"] = {"scale": rep, "good": rep, "count": rep}
        return jax.jit(step, in_shardings=(shardings, state, *batch, rep, rep, rep),
                       out_shardings=(shardings, state, rep), donate_argnums=(0, 1))

    def evaluation(self, eval_fn, shardings, batch):
        return jax.jit(eval_fn, in_shardings=(shardings, *batch), out_shardings=self.replicated)

    def state_bytes(self, params, opt_state):
        """Bytes of the parameters and optimizer state held on the mesh's first device."""
        first = self.mesh.devices.flat[0]
        leaves = jax.tree_util.tree_leaves((params, opt_state))
        return int(sum(next(s for s in a.addressable_shards if s.device == first).data.nbytes
                       for a in leaves))

    def describe(self, shardings):
        split = sum(1 for s in shardings.values() if s.spec != P())
        return (f"fsdp     {self.n} devices ({jax.default_backend()}), mesh data={self.n}: "
                f"{split} of {len(shardings)} leaves split, the rest whole on every device")


def train_fsdp(run, host_params, batches, real, steps, gather, model, eval_set, fsdp):
    """twin_common.train (the same timing: placement, lowering and compile, the first step, the
    waited and pipelined steps, evaluation outside the loop's time) under `fsdp`, evaluating
    after the last step."""
    fsdp.check_rows(run["batch"], "run.json's batch")
    per_row_loss, eval_fn = model
    shardings = fsdp.shardings(host_params)
    inputs_sh = (fsdp.rows(2), fsdp.rows(2), fsdp.rows(1))

    def place():
        key = jax.device_put(jax.random.PRNGKey(int(run.get("seed", 0))), fsdp.replicated)
        return (*fsdp.place(run, host_params, shardings), key)

    layout = tc.Layout(fsdp.train_step(run, per_row_loss, shardings, inputs_sh),
                       fsdp.evaluation(eval_fn, shardings, inputs_sh), place, fsdp.state_bytes)
    return tc.train(run, host_params, batches, real, steps, gather, model, eval_set, set(),
                    STARTED, layout)


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
    if args.form == "scan":  # the layout `chargpt --scan` writes
        params, run["decayed"] = to_form(run, params, "scan")
        run["scan"] = True
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
          f"{layers} blocks ({args.form or 'unrolled'} layout), width {d}")


# ---- bucketed bundles (chargpt --buckets K --twin DIR) --------------------------------------------


def load_ragged(path, prefix, vocab):
    """(x, y, offsets) of `PREFIX_x.npy`, `PREFIX_y.npy`, `PREFIX_offsets.npy`."""
    x, y, off = (np.load(os.path.join(path, f"{prefix}_{n}.npy")).astype(np.int64)
                 for n in ("x", "y", "offsets"))
    if (x.ndim != 1 or x.shape != y.shape or off.ndim != 1 or len(off) < 2 or off[0] != 0
            or off[-1] != len(x) or np.any(np.diff(off) < 0)):
        raise SystemExit(f"error: {prefix}_x/_y/_offsets.npy {x.shape}/{y.shape}/{off.shape} "
                         "are not ragged columns (offsets from 0 to the ids' length, ascending)")
    for n, a in (("x", x), ("y", y)):
        if len(a) and (a.min() < 0 or a.max() >= vocab):
            raise SystemExit(f"error: {prefix}_{n}.npy holds an id outside 0..{vocab}")
    return x, y, off


def load_bucketed(path, run):
    """The bucketed bundle's edges, rows per batch of each edge, plan, rows and ragged data."""
    edges = sorted(int(e) for e in run["buckets"])
    per = {int(k): int(v) for k, v in run["bucket_rows"].items()}
    if not edges or set(per) != set(edges) or min(per.values()) < 1:
        raise SystemExit(f"error: run.json's bucket_rows {run['bucket_rows']} do not fit its "
                         f"buckets {run['buckets']}")
    if edges[0] < 1 or edges[-1] > run["context"]:
        raise SystemExit(f"error: bucket edges {edges} outside 1..context ({run['context']})")
    train = load_ragged(path, "train", run["vocab"])
    val = load_ragged(path, "val", run["vocab"])
    plan = np.load(os.path.join(path, "plan.npy")).astype(np.int64)
    rows = np.load(os.path.join(path, "rows.npy")).astype(np.int64)
    if plan.ndim != 2 or plan.shape[1] != 3 or plan.shape[0] < run["steps"]:
        raise SystemExit(f"error: plan.npy is {list(plan.shape)}, expected [{run['steps']}, 3]")
    for t, (e, s, c) in enumerate(plan):
        if e not in per or not 1 <= c <= per[e] or s < 0 or s + c > len(rows):
            raise SystemExit(f"error: plan.npy step {t} ({e}, {s}, {c}) does not fit the "
                             f"buckets {edges} / bucket_rows / rows.npy ({len(rows)} rows)")
    if len(rows) and (rows.min() < 0 or rows.max() >= len(train[2]) - 1):
        raise SystemExit(f"error: rows.npy names a row outside the {len(train[2]) - 1} training rows")
    return edges, per, plan, rows, train, val


def bucket_batch(data, rows, edge, size):
    """nitro's `Ragged::gather`: `size` rows (the real `rows`, then copies of them), each's ids
    truncated to `edge` and padded with id 0; `valid` 1 at a row's kept positions (copies
    included); the weights, each real row's kept positions, 0 for copies."""
    ids_x, ids_y, off = data
    x = np.zeros((size, edge), np.int32)
    y = np.zeros((size, edge), np.int32)
    valid = np.zeros((size, edge), np.float32)
    weights = np.zeros(size, np.float32)
    for j in range(size):
        r = rows[j % len(rows)]
        s = off[r]
        n = min(off[r + 1] - s, edge)
        x[j, :n], y[j, :n], valid[j, :n] = ids_x[s:s + n], ids_y[s:s + n], 1.0
        if j < len(rows):
            weights[j] = n
    return (x, valid), y, weights


def val_batches(val, edges, per):
    """The validation rows binned as nitro bins them (the smallest edge holding a row's length,
    the largest for longer rows), in row order, cut into batches of each edge's rows: (edge,
    rows). Validation is a sum over rows, so the order does not matter."""
    lengths = np.diff(val[2])
    bins = {e: [] for e in edges}
    for r, n in enumerate(lengths):
        bins[next((e for e in edges if e >= n), edges[-1])].append(r)
    for e in edges:
        for s in range(0, len(bins[e]), per[e]):
            yield e, bins[e][s:s + per[e]]


def train_bucketed(run, host_params, buckets, steps, form, fsdp=None):
    """Trains `steps` steps of the plan and evaluates the validation rows after the last. One
    jitted train step (and one jitted evaluation), compiled ahead of time for every edge (jit
    specializes by shape) before the first step, as nitro compiles its inventory. With `fsdp`
    (an Fsdp), the leaves and every edge's batch rows are split as it says."""
    edges, per, plan, rows, train, val = buckets
    row_loss, eval_fn = make_bucketed_model(run, form)
    if fsdp is None:
        step_fn = tc.make_train_step(run, row_loss)
        eval_jit = jax.jit(eval_fn)
        key = jax.random.PRNGKey(int(run.get("seed", 0)))
        params = {k: jax.device_put(v) for k, v in host_params.items()}
        opt_state = tc.initial_optimizer_state(run, params, lambda k: jnp.zeros_like(params[k]))
    else:
        for e in edges:
            fsdp.check_rows(per[e], f"edge {e}'s batch (bucket_rows)")
        shardings = fsdp.shardings(host_params)
        inputs_sh = ((fsdp.rows(2), fsdp.rows(2)), fsdp.rows(2), fsdp.rows(1))
        step_fn = fsdp.train_step(run, row_loss, shardings, inputs_sh)
        eval_jit = fsdp.evaluation(eval_fn, shardings, inputs_sh)
        key = jax.device_put(jax.random.PRNGKey(int(run.get("seed", 0))), fsdp.replicated)
        params, opt_state = fsdp.place(run, host_params, shardings)
    jax.block_until_ready((params, opt_state, key))

    def blank(e):
        n = per[e]
        return (np.zeros((n, e), np.int32), np.zeros((n, e), np.float32)), \
            np.zeros((n, e), np.int32), np.ones(n, np.float32)

    def inputs(t):
        e, s, c = (int(v) for v in plan[t])
        xv, y, w = bucket_batch(train, rows[s:s + c], e, per[e])
        return e, xv, y, w, np.float32(tc.cosine(run["schedule"], t)), np.int32(t)

    # The first step: every edge's train step lowered and compiled, then the step itself.
    first_started = time.perf_counter()
    compiled, lower_by, compile_by = {}, {}, {}
    for e in edges:
        xv, y, w = blank(e)
        l0 = time.perf_counter()
        lowered = step_fn.lower(params, opt_state, xv, y, w, np.float32(0), np.int32(0), key)
        l1 = time.perf_counter()
        compiled[e] = lowered.compile()
        lower_by[e], compile_by[e] = l1 - l0, time.perf_counter() - l1
    compiled_at = time.perf_counter()
    timing = {"lower_ms": tc.ms(sum(lower_by.values())), "compile_ms": tc.ms(sum(compile_by.values())),
              "compile_ms_by_edge": {str(e): tc.ms(v) for e, v in compile_by.items()}}

    every = max(1, -(-steps // tc.WAITED_SAMPLES))
    sampled = {i for i in range(1, steps) if i % every == every // 2}
    waited, losses, weights, positions, excluded = [], [], [], 0, 0.0
    eval_compiled = {}
    for t in range(steps):
        timed = t in sampled
        if timed:
            jax.block_until_ready((params, opt_state))
            s = time.perf_counter()
        e, xv, y, w, lr, t32 = inputs(t)
        params, opt_state, loss = compiled[e](params, opt_state, xv, y, w, lr, t32, key)
        losses.append(loss)
        weights.append(float(w.sum()))
        positions += w.size * e
        if t == 0:
            loss.block_until_ready()
            timing["first_step_ms"] = tc.ms(time.perf_counter() - first_started)
            # The evaluation program for every edge, compiled once, outside the loop's time.
            e0 = time.perf_counter()
            elower, ecompile = 0.0, {}
            for edge in edges:
                bxv, by, bw = blank(edge)
                c0 = time.perf_counter()
                lowered = eval_jit.lower(params, bxv, by, bw)
                c1 = time.perf_counter()
                eval_compiled[edge] = lowered.compile()
                elower += c1 - c0
                ecompile[edge] = time.perf_counter() - c1
            timing["eval_lower_ms"], timing["eval_compile_ms"] = tc.ms(elower), tc.ms(sum(ecompile.values()))
            timing["eval_compile_ms_by_edge"] = {str(k): tc.ms(v) for k, v in ecompile.items()}
            excluded += time.perf_counter() - e0
        if timed:
            jax.block_until_ready((params, opt_state, loss))
            waited.append(time.perf_counter() - s)
    host_losses = np.array([float(v) for v in jax.device_get(losses)], dtype=np.float64)
    loop_wall = time.perf_counter() - compiled_at - excluded
    # Validation, after the last step: every row once, bucket by bucket.
    e0 = time.perf_counter()
    sums, total = [], 0.0
    for edge, vrows in val_batches(val, edges, per):
        xv, y, w = bucket_batch(val, vrows, edge, per[edge])
        sums.append(eval_compiled[edge](params, xv, y, w)[0])
        total += float(w.sum())
    val_sum = float(sum(float(v) for v in jax.device_get(sums)))
    timing["eval_ms"] = tc.ms(excluded + time.perf_counter() - e0)
    if not waited:
        waited = [timing["first_step_ms"] / 1e3]
    timing["step_ms"] = tc.ms(statistics.median(waited))
    timing["step_ms_pipelined"] = tc.ms(loop_wall / steps)
    weights = np.array(weights)
    real = float(weights.sum())
    lengths = np.minimum(np.diff(train[2]), edges[-1])
    padded_to = np.array([next(e for e in edges if e >= n) for n in lengths])
    fields = {
        "train_loss": float((host_losses * weights).sum() / real),
        "val_loss": val_sum / total,
        "buckets": edges,
        "bucket_rows": {str(e): per[e] for e in edges},
        "compile_ms_by_edge": timing["compile_ms_by_edge"],
        "eval_compile_ms_by_edge": timing["eval_compile_ms_by_edge"],
        "real_positions": int(real),
        "tokens_per_s": round(real / loop_wall, 1),
        "padding_waste": round(1.0 - real / positions, 6),
        "padding_waste_rows": round(float(1.0 - lengths.sum() / padded_to.sum()), 6),
        "fsdp": fsdp.n if fsdp else 0,
        "state_bytes_per_device": (fsdp.state_bytes(params, opt_state) if fsdp
                                   else tc.whole_state_bytes(params, opt_state)),
    }
    return timing, host_losses, fields


def model_line(run, form, steps, what):
    blocks = "one lax.scan" if form == "scan" else "unrolled"
    if form != layout_of(run):
        blocks += f", from the bundle's {'stacked' if layout_of(run) == 'scan' else 'per-block'} leaves"
    return (f"model    {run['layers']} blocks ({blocks}), width {run['width']}, {run['heads']} heads, "
            f"dropout {run.get('dropout', 0.0)}, adamw (decay {run.get('weight_decay', 0.0)}), "
            f"peak lr {run['schedule']['base']}, {steps} {what}, computing in {run['precision']}")


def main_bucketed(args, say, run, params, form, fsdp):
    buckets = load_bucketed(args.bundle, run)
    edges, per, plan, rows, train, val = buckets
    steps = min(args.steps or run["steps"], run["steps"])
    say(f"data     {len(train[2]) - 1} train / {len(val[2]) - 1} validation documents, buckets "
        f"{edges} of {[per[e] for e in edges]} rows, vocabulary {run['vocab']}")
    say(f"backend  jax {jax.__version__} on {jax.default_backend()} ({jax.devices()[0].device_kind})")
    say(model_line(run, form, steps, "bucketed steps"))
    if fsdp:
        say(fsdp.describe(fsdp.shardings(params)))
    timing, losses, fields = train_bucketed(run, params, buckets, steps, form, fsdp)
    bits = fields["val_loss"] / math.log(2)
    say(f"epoch    train loss {fields['train_loss']:.6f}, val loss {fields['val_loss']:.6f} nats "
        f"(means over real positions)")
    say(f"held out {bits:.4f} bits/char; {fields['tokens_per_s']} real positions/s, padding "
        f"{100 * fields['padding_waste']:.1f}% of the batches' positions")
    say(f"compile  by edge {fields['compile_ms_by_edge']} ms")
    tc.report("chargpt", args, steps, losses,
              {"val_bits_per_char": round(bits, 6), **fields, "form": form, "layers": run["layers"]},
              timing, STARTED, say)


def form_option(p):
    p.add_argument("--form", choices=FORMS,
                   help="run the blocks unrolled (a Python loop) or as one lax.scan over stacked "
                        "leaves (default: the bundle's layout); with --make-test-bundle, the "
                        "layout to write (unrolled)")


def fsdp_option(p):
    p.add_argument("--fsdp", type=int, default=0, metavar="N",
                   help="fully sharded data parallelism over N devices (N host devices on CPU): "
                        "parameters, optimizer state and gradients split on their largest dim N "
                        "divides, the batch by rows (default 0: off, one device)")


def options(p):
    form_option(p)
    fsdp_option(p)


def main():
    args = tc.parse_args("chargpt", options)
    if args.make_test_bundle:
        return make_test_bundle(args)
    if args.fsdp < 0:
        raise SystemExit(f"error: --fsdp {args.fsdp}: the device count is 0 (off) or more")
    if args.fsdp != _fsdp_from_argv():
        raise SystemExit("error: spell --fsdp N out (as --fsdp N or --fsdp=N): it is read "
                         "before JAX starts, to ask XLA for N host devices")
    fsdp = Fsdp(args.fsdp) if args.fsdp >= 1 else None
    say = tc.sayer(args)
    with open(os.path.join(args.bundle, "run.json")) as f:
        bucketed = "buckets" in json.load(f)
    if bucketed:
        run, params = tc.load_run(args.bundle, "chargpt")
    else:
        run, params, batches, real = tc.load_bundle(args.bundle, "chargpt")
    tc.check_params(params, expected_leaves(run))
    tc.precision_of(run, args)
    if run["width"] % run["heads"]:
        raise SystemExit("error: width must be a multiple of heads")
    unknown = sorted(set(run.get("decayed", [])) - set(params))
    if unknown:
        raise SystemExit(f"error: run.json decays unknown leaves {unknown}")
    form = args.form or layout_of(run)
    params, decayed = to_form(run, params, form)
    run = {**run, "decayed": decayed}  # what the optimizer reads: the form's leaf names
    if bucketed:
        return main_bucketed(args, say, run, params, form, fsdp)
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
    say(model_line(run, form, steps, f"steps of {run['batch']}"))

    def gather(idx):
        return train_x[idx], train_y[idx]

    if fsdp:
        say(fsdp.describe(fsdp.shardings(params)))
        timing, losses, sums, n = train_fsdp(
            run, params, batches, real, steps, gather, make_model(run, form), (val_x, val_y), fsdp)
    else:
        timing, losses, sums, n = tc.train(run, params, batches, real, steps, gather,
                                           make_model(run, form), (val_x, val_y), set(), STARTED)
    state_bytes = timing["state_bytes_per_device"]
    bits = sums[0] / n / math.log(2)
    say(f"held out {bits:.4f} bits/char")
    say(f"state    {state_bytes} bytes of parameters and optimizer state on the first device")
    fields = {"val_bits_per_char": round(bits, 6), "form": form, "layers": run["layers"],
              "fsdp": args.fsdp, "state_bytes_per_device": state_bytes, "precision": run["precision"]}
    # Under --fsdp: the placement's time, and the first step counted from the host values.
    fields.update({k: timing[k] for k in ("place_ms", "first_step_from_host_ms") if k in timing})
    tc.report("chargpt", args, steps, losses, fields, timing, STARTED, say)


if __name__ == "__main__":
    main()
