"""What `twin_fashion.py` and `twin_chargpt.py` share: the twin bundle reader, nitro's Adam/AdamW
and cosine schedule, the timed training loop and the JSON report.

A twin bundle is what a nitro example writes with `--twin DIR`: `init.safetensors` (the initial
parameters by nitro leaf path), `run.json` (the hyperparameters), `batches.npy` (`int32 [steps,
batch]`, the training-set row of every batch row of every step) and `real.npy` (`int32 [steps]`,
how many of a step's rows are real; the rest are padding and weigh nothing).

Importing this module imports JAX, so it first reads `--dump-hlo DIR` from the command line and
sets `XLA_FLAGS` (it must be set before JAX starts), and `--pjrt-plugin PATH`: JAX then runs on
that PJRT plugin — nitro's own XLA CPU plugin, say — instead of jaxlib's built-in CPU backend, so
that both sides compile with the same XLA build and only their programs differ. Its device count
is `--xla_force_host_platform_device_count` from `XLA_FLAGS` (what `--fsdp N` sets), else 1.
"""

import os
import sys


def _flag_from_argv(flag):
    """`FLAG VALUE` or `FLAG=VALUE` from the command line (None without it): read before JAX is
    imported, which these flags must precede."""
    argv = sys.argv[1:]
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


_DUMP = _flag_from_argv("--dump-hlo")
if _DUMP:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={_DUMP}").strip()


def _register_plugin(path):
    """JAX on the PJRT plugin at `path`, as the platform `plugin` (the only one it uses)."""
    if not os.path.isfile(path):
        raise SystemExit(f"error: --pjrt-plugin {path}: no such file")
    count = 1
    for flag in os.environ.get("XLA_FLAGS", "").split():
        if flag.startswith("--xla_force_host_platform_device_count="):
            count = int(flag.split("=", 1)[1])
    os.environ["JAX_PLATFORMS"] = "plugin"  # read when JAX is imported, just below
    from jax._src import xla_bridge
    xla_bridge.register_plugin("plugin", priority=500, library_path=path,
                               options={"cpu_device_count": count})


PLUGIN = _flag_from_argv("--pjrt-plugin")
if PLUGIN:
    _register_plugin(PLUGIN)

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

jax.config.update("jax_enable_x64", False)

# How many steps are timed alone (spread evenly over the run).
WAITED_SAMPLES = 20


def ms(seconds):
    return round(seconds * 1e3, 3)


# ---- command line and bundle -------------------------------------------------------------------


def parse_args(name, extra=None):
    p = argparse.ArgumentParser(prog=f"twin_{name}.py", description=f"The JAX twin of nitro's {name} example.")
    p.add_argument("bundle", nargs="?", help="the twin bundle directory nitro wrote (--twin DIR)")
    p.add_argument("--steps", type=int, help="optimizer steps to run (default: run.json's steps)")
    p.add_argument("--losses", type=int, default=10, help="how many first step losses to report (10)")
    p.add_argument("--losses-out", metavar="FILE.npy", help="write the first N losses here (float64)")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.add_argument("--dump-hlo", metavar="DIR", help="XLA's dumps (--xla_dump_to=DIR)")
    p.add_argument("--pjrt-plugin", metavar="PATH",
                   help="run JAX on this PJRT plugin (nitro's XLA build) instead of jaxlib's CPU")
    p.add_argument("--cache", metavar="DIR",
                   help="JAX's persistent compilation cache in DIR (every program, however small "
                        "or quick to compile): a second run with the same DIR loads, not compiles")
    p.add_argument("--make-test-bundle", metavar="DIR", help="write a small synthetic bundle here and exit")
    p.add_argument("--precision", choices=sorted(PRECISIONS),
                   help="what the model computes in (default: run.json's `precision`, else f32): "
                        "f32 parameters and Adam state, the loss and its gradient in this dtype")
    if extra:
        extra(p)
    args = p.parse_args()
    if not args.make_test_bundle and not args.bundle:
        p.error("a bundle directory is required (or --make-test-bundle DIR)")
    if args.cache:
        enable_cache(args.cache)
    return args


def enable_cache(directory):
    """JAX's persistent compilation cache in `directory`, for every program: no minimum compile
    time, no minimum entry size. Called before anything is compiled (parse_args, first thing in a
    twin's main), so the training step and the evaluation program are both cached."""
    os.makedirs(directory, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def load_run(path, model):
    """A bundle's `run.json` (checked to be `model`'s) and initial parameters."""
    with open(os.path.join(path, "run.json")) as f:
        run = json.load(f)
    if run.get("model") != model:
        raise SystemExit(f"error: {path}/run.json is for model {run.get('model')!r}, not {model!r}")
    return run, load_file(os.path.join(path, "init.safetensors"))


def load_bundle(path, model):
    run, params = load_run(path, model)
    batches = np.load(os.path.join(path, "batches.npy"))
    real = np.load(os.path.join(path, "real.npy"))
    if batches.ndim != 2 or batches.shape[1] != run["batch"] or real.shape != (batches.shape[0],):
        raise SystemExit(
            f"error: batches.npy {batches.shape} / real.npy {real.shape} do not fit batch {run['batch']}"
        )
    if batches.shape[0] < run["steps"]:
        raise SystemExit(f"error: batches.npy holds {batches.shape[0]} steps, run.json says {run['steps']}")
    if np.any(real < 1) or np.any(real > run["batch"]):
        raise SystemExit("error: real.npy holds a count outside 1..batch")
    return run, params, batches.astype(np.int64), real.astype(np.int64)


def check_params(params, expected):
    """Every leaf of `expected` (name -> shape) present with its shape as float32, nothing else."""
    missing = sorted(set(expected) - set(params))
    unknown = sorted(set(params) - set(expected))
    if missing or unknown:
        raise SystemExit(f"error: init.safetensors: missing leaves {missing}, unknown leaves {unknown}")
    for name, shape in expected.items():
        a = params[name]
        if a.dtype != np.float32 or tuple(a.shape) != tuple(shape):
            raise SystemExit(
                f"error: init.safetensors: {name} is {a.dtype}{list(a.shape)}, expected float32{list(shape)}"
            )


def write_test_bundle(path, run, params, batches, real, arrays=None):
    os.makedirs(path, exist_ok=True)
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in params.items()},
              os.path.join(path, "init.safetensors"))
    with open(os.path.join(path, "run.json"), "w") as f:
        json.dump(run, f, indent=1)
    np.save(os.path.join(path, "batches.npy"), batches.astype(np.int32))
    np.save(os.path.join(path, "real.npy"), real.astype(np.int32))
    for name, a in (arrays or {}).items():
        np.save(os.path.join(path, name), a)


def test_batches(rows, batch, steps, rng):
    """Shuffled epochs over `rows` rows, the ragged last batch of each padded with copies."""
    out, real = [], []
    while len(out) < steps:
        order = rng.permutation(rows)
        for s in range(0, rows, batch):
            idx = order[s:s + batch]
            real.append(len(idx))
            out.append(np.resize(idx, batch))
    return np.array(out[:steps]), np.array(real[:steps])


def test_schedule(base, steps, min_ratio, warmup_ratio):
    return {"base": base, "min": base * min_ratio, "warmup": int(steps * warmup_ratio), "total": steps}


# ---- optimizer and schedule (nitro's optim.rs) -----------------------------------------------------


def cosine(schedule, step):
    """nitro's `Cosine::lr`, `step` counted from 0."""
    base, low = schedule["base"], schedule["min"]
    warmup, total = int(schedule["warmup"]), int(schedule["total"])
    if step < warmup:
        return base * (step + 1) / warmup
    span = max(total - warmup, 1)
    t = min(step - warmup, span) / span
    return low + 0.5 * (base - low) * (1.0 + math.cos(math.pi * t))


def adam_update(run, params, grads, state, lr, number):
    """nitro's Adam / AdamW step: `number` counts from 1; decoupled decay on the decayed leaves."""
    b1, b2, eps = run["adam"]["beta1"], run["adam"]["beta2"], run["adam"]["eps"]
    wd = float(run.get("weight_decay", 0.0))
    decayed = set(run.get("decayed", []))
    c1 = 1.0 - jnp.exp(number * math.log(b1))
    c2 = 1.0 - jnp.exp(number * math.log(b2))
    new_p, new_m, new_v = {}, {}, {}
    for name, p in params.items():
        g = grads[name]
        m = state["m"][name] * b1 + g * (1.0 - b1)
        v = state["v"][name] * b2 + g * g * (1.0 - b2)
        d = (m / c1) / (jnp.sqrt(v / c2) + eps)
        if wd != 0.0 and name in decayed:
            d = d + p * wd
        new_p[name] = p - lr * d
        new_m[name], new_v[name] = m, v
    return new_p, {"m": new_m, "v": new_v}


def dropout(x, rate, key):
    """Kept with probability 1 - rate and scaled by 1 / (1 - rate), else zero."""
    if rate == 0.0 or key is None:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


# ---- training ---------------------------------------------------------------------------------------


# ---- the precision policy (nitro's Config::precision) -----------------------------------------

PRECISIONS = {"f32": None, "bf16": jnp.bfloat16, "f16": jnp.float16}


def precision_of(run, args):
    """The precision the run computes in: `--precision`, else run.json's, else f32 (recorded in
    `run` for the report)."""
    name = args.precision or run.get("precision", "f32")
    run["precision"] = name
    return name


def half(dtype):
    return dtype in (jnp.bfloat16, jnp.float16)


def in_f32(x, f):
    """f(x) computed in f32 when x is half precision, the result back in x's dtype (nitro's
    nn::in_f32: softmax, log-softmax, the norms' statistics)."""
    if half(x.dtype):
        return f(x.astype(jnp.float32)).astype(x.dtype)
    return f(x)


def with_precision(run, model):
    """(per_row_loss, eval_fn) computing in run["precision"]: every float leaf of the parameters
    and of x converted to it where the model reads them (the gradients, taken with respect to
    the f32 parameters, come back f32), the per-row loss widened to f32 — nitro's policy."""
    per_row_loss, eval_fn = model
    dtype = PRECISIONS[run.get("precision", "f32")]
    if dtype is None:
        return model

    def cast(tree):
        return jax.tree_util.tree_map(
            lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)

    def loss(p, x, y, key):
        return per_row_loss(cast(p), cast(x), y, key).astype(jnp.float32)

    def evaluate(p, x, y, mask):
        return eval_fn(cast(p), cast(x), y, mask)

    return loss, evaluate


def masked_mean(per_row, mask):
    return jnp.sum(per_row * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def loss_scaling(run):
    """The run's dynamic loss scaling, (initial scale, growth interval), from run.json's
    `loss_scaling` (nitro's Precision::f16; `null`: none), or None. A bundle without the key
    computing in f16 scales as nitro's Precision::f16() does: from 2^16, doubled after 2000."""
    if "loss_scaling" not in run:
        return (65536.0, 2000) if run.get("precision") == "f16" else None
    ls = run["loss_scaling"]
    return None if not ls else (float(ls["initial"]), int(ls["growth_interval"]))


def initial_optimizer_state(run, names, zeros):
    """Adam's zeroed m and v (`zeros(name) -> array` for each parameter name in `names`) and,
    with loss scaling, the scale's state: the scale, the finite steps since it moved, the steps
    applied."""
    state = {s: {k: zeros(k) for k in names} for s in ("m", "v")}
    ls = loss_scaling(run)
    if ls is not None:
        state["scale"] = {"scale": jnp.float32(ls[0]), "good": jnp.int32(0), "count": jnp.int32(0)}
    return state


def make_train_step(run, per_row_loss):
    """The jitted step: `per_row_loss(params, x, y, key)` -> `[batch]` (dropout on when `key`
    is given). `step` is the 0-based step number (int32): Adam's is `step + 1`, the dropout key
    `fold_in(key, step)`.

    With loss scaling (nitro's Precision::f16) the mean loss times the scale is differentiated
    and the gradients divided by it; a step whose gradients are not all finite keeps the
    parameters and Adam's state and halves the scale (never below 1), `growth_interval` finite
    steps in a row double it, and Adam's step number counts the steps applied."""
    ls = loss_scaling(run)

    def mean_loss(params, x, y, mask, key):
        return masked_mean(per_row_loss(params, x, y, key), mask)

    def train_step(params, opt_state, x, y, mask, lr, step, key):
        step_key = jax.random.fold_in(key, step) if run.get("dropout", 0.0) > 0 else None
        if ls is None:
            loss, grads = jax.value_and_grad(mean_loss)(params, x, y, mask, step_key)
            number = (step + 1).astype(jnp.float32)
            params, opt_state = adam_update(run, params, grads, opt_state, lr, number)
            return params, opt_state, loss
        scaling = opt_state["scale"]
        scale = scaling["scale"]

        def scaled(p):
            loss = mean_loss(p, x, y, mask, step_key)
            return loss * scale, loss

        (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(params)
        grads = jax.tree_util.tree_map(lambda g: g / scale, grads)
        finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree_util.tree_leaves(grads)]))
        number = (scaling["count"] + 1).astype(jnp.float32)
        adam = {"m": opt_state["m"], "v": opt_state["v"]}
        new_params, new_adam = adam_update(run, params, grads, adam, lr, number)
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        params = jax.tree_util.tree_map(keep, new_params, params)
        adam = jax.tree_util.tree_map(keep, new_adam, adam)
        good = scaling["good"] + 1
        grows = good >= ls[1]
        scaling = {
            "scale": jnp.where(finite, jnp.where(grows, scale * 2.0, scale), jnp.maximum(scale * 0.5, 1.0)),
            "good": jnp.where(finite, jnp.where(grows, 0, good), 0).astype(jnp.int32),
            "count": scaling["count"] + finite.astype(jnp.int32),
        }
        return params, {**adam, "scale": scaling}, loss

    return jax.jit(train_step, donate_argnums=(0, 1))


def pad_rows(n, batch):
    """Evaluation batches over rows 0..n in order: (row indices padded with copies, real)."""
    for s in range(0, n, batch):
        idx = np.arange(s, min(s + batch, n))
        yield np.resize(idx, batch), len(idx)


class Layout:
    """How `train` lays the run out over devices (the default: everything on one device).

    step_fn: the jitted train step (make_train_step's signature); eval_jit: the jitted
    evaluation; place() -> (params, opt_state, key) on their devices; state_bytes(params,
    opt_state) -> the bytes of both on the first device."""

    def __init__(self, step_fn, eval_jit, place, state_bytes):
        self.step_fn, self.eval_jit, self.place, self.state_bytes = step_fn, eval_jit, place, state_bytes


def one_device(run, host_params, eval_sums):
    """The default Layout: make_train_step and jax.jit(eval_fn) on the default device."""
    per_row_loss, eval_fn = eval_sums

    def place():
        params = {k: jax.device_put(v) for k, v in host_params.items()}
        opt_state = initial_optimizer_state(run, params, lambda k: jnp.zeros_like(params[k]))
        return params, opt_state, jax.random.PRNGKey(int(run.get("seed", 0)))

    return Layout(make_train_step(run, per_row_loss), jax.jit(eval_fn), place, whole_state_bytes)


def whole_state_bytes(params, opt_state):
    """The bytes of the parameters and optimizer state, each whole on one device."""
    return int(sum(a.nbytes for a in jax.tree_util.tree_leaves((params, opt_state))))


def train(run, host_params, batches, real, steps, gather, eval_sums, eval_set, eval_after, started,
          layout=None):
    """Trains `steps` steps and evaluates after each step in `eval_after` (a set of step counts).

    gather(rows) -> (x, y) numpy for training-set rows; eval_sums(params, x, y, mask) -> tuple of
    masked sums (the jitted evaluation program); eval_set = (X, Y) numpy; layout: a Layout
    (default: one_device). Returns the report's timing fields, the losses (float64) and the
    last evaluation's sums and real row count. The timing fields also hold "place_ms" (putting
    the parameters and zeroed optimizer state on their devices, before the first step's clock
    starts), "first_step_from_host_ms" (that plus the first step: what a handle that places
    at its first step counts) and "state_bytes_per_device" (after the last step).
    """
    batch = run["batch"]
    layout = layout or one_device(run, host_params, eval_sums)
    step_fn, eval_jit = layout.step_fn, layout.eval_jit
    placing = time.perf_counter()
    params, opt_state, key = layout.place()
    jax.block_until_ready((params, opt_state, key))
    place_s = time.perf_counter() - placing

    def inputs(t):
        x, y = gather(batches[t])
        mask = (np.arange(batch) < real[t]).astype(np.float32)
        return x, y, mask, np.float32(cosine(run["schedule"], t)), np.int32(t)

    # The first step: lowering, XLA's compile, the step itself.
    first_started = time.perf_counter()
    x, y, mask, lr, t32 = inputs(0)
    lowered = step_fn.lower(params, opt_state, x, y, mask, lr, t32, key)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    timing = {"lower_ms": ms(lowered_at - first_started), "compile_ms": ms(compiled_at - lowered_at)}

    every = max(1, -(-steps // WAITED_SAMPLES))
    sampled = {i for i in range(1, steps) if i % every == every // 2}
    waited, losses, excluded = [], [], 0.0
    eval_compiled, last_eval = None, None
    loop_started = compiled_at
    for t in range(steps):
        timed = t in sampled
        if timed:
            jax.block_until_ready((params, opt_state))
            s = time.perf_counter()
        if t > 0:
            x, y, mask, lr, t32 = inputs(t)
        params, opt_state, loss = compiled(params, opt_state, x, y, mask, lr, t32, key)
        losses.append(loss)
        if t == 0:
            loss.block_until_ready()
            timing["first_step_ms"] = ms(time.perf_counter() - first_started)
            timing["place_ms"] = ms(place_s)
            timing["first_step_from_host_ms"] = ms(time.perf_counter() - first_started + place_s)
            # The evaluation program, compiled once, outside the loop's time.
            e0 = time.perf_counter()
            X, Y = eval_set
            rows, _ = next(pad_rows(len(X), batch))
            emask = np.ones(batch, np.float32)
            eval_lowered = eval_jit.lower(params, X[rows], Y[rows], emask)
            e1 = time.perf_counter()
            eval_compiled = eval_lowered.compile()
            e2 = time.perf_counter()
            timing["eval_lower_ms"], timing["eval_compile_ms"] = ms(e1 - e0), ms(e2 - e1)
            excluded += e2 - e0
        if timed:
            jax.block_until_ready((params, opt_state, loss))
            waited.append(time.perf_counter() - s)
        if t + 1 in eval_after or t + 1 == steps:
            jax.block_until_ready((params, opt_state))
            e0 = time.perf_counter()
            X, Y = eval_set
            sums = []
            for rows, n in pad_rows(len(X), batch):
                emask = (np.arange(batch) < n).astype(np.float32)
                sums.append(eval_compiled(params, X[rows], Y[rows], emask))
            last_eval = [float(sum(float(s[i]) for s in sums)) for i in range(len(sums[0]))]
            excluded += time.perf_counter() - e0
    host_losses = np.array([float(v) for v in jax.device_get(losses)], dtype=np.float64)
    loop_wall = time.perf_counter() - loop_started - excluded
    if not waited:
        waited = [timing["first_step_ms"] / 1e3]
    timing["step_ms"] = ms(statistics.median(waited))
    timing["step_ms_pipelined"] = ms(loop_wall / steps)
    timing["eval_ms"] = ms(excluded)
    timing["state_bytes_per_device"] = layout.state_bytes(params, opt_state)
    return timing, host_losses, last_eval, len(eval_set[0])


def report(name, args, steps, losses, fields, timing, started, say):
    n = max(0, args.losses)
    if args.losses_out:
        np.save(args.losses_out, losses[:n].astype(np.float64))
    line = {
        "twin": name,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "pjrt_plugin": os.path.basename(PLUGIN) if PLUGIN else None,
        "steps": steps,
        "losses": [float(v) for v in losses[:n]],
        "final_loss": float(losses[-1]),
        **fields,
        "lower_ms": timing["lower_ms"],
        "compile_ms": timing["compile_ms"],
        "eval_lower_ms": timing["eval_lower_ms"],
        "eval_compile_ms": timing["eval_compile_ms"],
        "first_step_ms": timing["first_step_ms"],
        "step_ms": timing["step_ms"],
        "step_ms_pipelined": timing["step_ms_pipelined"],
        "eval_ms": timing["eval_ms"],
        "process_s": round(time.perf_counter() - started, 3),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    say(f"losses   first {[round(v, 4) for v in line['losses'][:5]]} ... final {line['final_loss']:.4f}")
    say(f"compile  train: lower {line['lower_ms']} ms, XLA {line['compile_ms']} ms; "
        f"eval: lower {line['eval_lower_ms']} ms, XLA {line['eval_compile_ms']} ms")
    say(f"steps    first {line['first_step_ms']} ms, waited {line['step_ms']} ms, "
        f"pipelined {line['step_ms_pipelined']} ms")
    print(json.dumps(line), flush=True)


def sayer(args):
    return (lambda s: None) if args.json else (lambda s: print(s, flush=True))
