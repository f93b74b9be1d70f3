"""Golden values from JAX for leaves created on the devices (`Config::initialize`).

Each case is one leaf: its path, type and rule, and the values JAX draws for it with the key
nitro documents — `fold_in(fold_in(PRNGKey(seed), INIT_DOMAIN), leaf_id(path))`, where
`leaf_id` is the first four bytes of blake3(path), little-endian, top bit cleared — and the
rule's distribution (`jax.random.uniform` / `normal`, scaled by the fans `Init::fans` documents).
Writes `runtime/tests/goldens/init.safetensors`: tensors `<case>.out` (f32), and per case in
the metadata a JSON object with `path`, `dims`, `seed` and `rule` (`glorot_uniform`,
`glorot_normal`, `he_normal`, `he_uniform`, `normal` with `mean`/`std`, `uniform` with
`low`/`high`).

Run it in a throwaway virtual environment (JAX is never a dependency of nitro; CI reads the
committed file):

    python3 -m venv V && V/bin/pip install jax==0.10.2 safetensors numpy blake3 \
        && V/bin/python bench/jax_init_goldens.py
"""

import argparse
import json
import math
import pathlib

import blake3
import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

INIT_DOMAIN = 0x696E6974


def leaf_id(path: str) -> int:
    return int.from_bytes(blake3.blake3(path.encode()).digest()[:4], "little") & 0x7FFFFFFF


def fans(dims):
    """nitro's `Init::fans`: a weight `[in, out]` or a stack of them `[layers, in, out]` takes
    its last two dims; a 2-D convolution kernel (HWIO) `[kh, kw, in, out]`, or a stack of them,
    the receptive field times the channels (as `Conv2d`'s own initializer and JAX's
    `variance_scaling`); higher ranks every dim before the last two as the receptive field."""
    if len(dims) == 0:
        return 1.0, 1.0
    if len(dims) == 1:
        return float(dims[0]), float(dims[0])
    if len(dims) <= 3:
        return float(dims[-2]), float(dims[-1])
    field = math.prod(dims[-4:-2]) if len(dims) <= 5 else math.prod(dims[:-2])
    return float(field * dims[-2]), float(field * dims[-1])


def draw(seed, path, dims, rule):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), INIT_DOMAIN), leaf_id(path))
    fan_in, fan_out = fans(dims)
    kind = rule["kind"]

    def uniform(lo, hi):
        return jax.random.uniform(key, dims, jnp.float32, lo, hi)

    def normal(mean, std):
        return jax.random.normal(key, dims, jnp.float32) * std + mean

    if kind == "glorot_uniform":
        limit = math.sqrt(6.0 / max(fan_in + fan_out, 1.0))
        return uniform(-limit, limit)
    if kind == "glorot_normal":
        return normal(0.0, math.sqrt(2.0 / max(fan_in + fan_out, 1.0)))
    if kind == "he_normal":
        return normal(0.0, math.sqrt(2.0 / max(fan_in, 1.0)))
    if kind == "he_uniform":
        limit = math.sqrt(6.0 / max(fan_in, 1.0))
        return uniform(-limit, limit)
    if kind == "normal":
        return normal(rule["mean"], rule["std"])
    if kind == "uniform":
        return uniform(rule["low"], rule["high"])
    raise ValueError(kind)


CASES = [
    ("w_glorot", 11, "layers[0].w", [4, 16], {"kind": "glorot_uniform"}),
    ("w_stack", 11, "stack.fc1.w", [3, 8, 32], {"kind": "glorot_uniform"}),
    ("w_glorot_normal", 5, "head.w", [16, 10], {"kind": "glorot_normal"}),
    ("w_he_normal", 5, "conv.w", [3, 3, 4, 8], {"kind": "he_normal"}),
    ("w_he_uniform", 0, "fc.w", [8, 4], {"kind": "he_uniform"}),
    ("table", 7, "tokens.table", [50, 12], {"kind": "normal", "mean": 0.0, "std": 0.02}),
    ("shifted", 7, "x.table", [33], {"kind": "normal", "mean": 0.5, "std": 2.0}),
    ("range", 1 << 40, "u", [7, 5], {"kind": "uniform", "low": -3.0, "high": 1.5}),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    root = pathlib.Path(__file__).resolve().parent.parent
    parser.add_argument("--out", default=str(root / "runtime/tests/goldens"))
    args = parser.parse_args()
    jax.config.update("jax_platforms", "cpu")
    tensors, meta = {}, {}
    for case, seed, path, dims, rule in CASES:
        if seed >= 1 << 32:
            jax.config.update("jax_enable_x64", True)
        out = np.asarray(draw(seed, path, dims, rule), dtype=np.float32)
        jax.config.update("jax_enable_x64", False)
        tensors[f"{case}.out"] = out
        meta[case] = json.dumps({"path": path, "dims": dims, "seed": seed, "rule": rule,
                                 "leaf_id": leaf_id(path)})
    out = pathlib.Path(args.out) / "init.safetensors"
    save_file(tensors, str(out), metadata=meta)
    print(f"wrote {out}: {len(CASES)} cases")


if __name__ == "__main__":
    main()
