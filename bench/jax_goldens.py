"""Golden test data from JAX for nitro's convolution, windowed-reduction, indexing,
elementwise, random-number and scan ops.

Writes one safetensors file per op family under `runtime/tests/goldens/`:

    conv.safetensors         jax.lax.conv_general_dilated: outputs and both gradients
    window.safetensors       jax.lax.reduce_window (sum / max / min): outputs and gradients
    index.safetensors        jnp.take, jnp.take_along_axis, .at[].add / .at[].set,
                             lax.dynamic_slice, lax.dynamic_update_slice
    elementwise.safetensors  erf, erf_inv, sin, cos, log1p, expm1, sign, floor, ceil, round,
                             atan2, rem, clamp; u32 bit ops; bitcast_convert_type
    random.safetensors       jax.random with the default threefry2x32 implementation, and the
                             raw Threefry-2x32 block function
    scan.safetensors         jax.lax.scan: final carries and stacked outputs, and gradients

File layout: every tensor is named `<case>.<role>` (`conv_odd.lhs`, `conv_odd.out`, ...); the
safetensors metadata holds one entry per case, `"<case>"` -> a JSON object (as a string) of
that case's attributes, always with an `"op"` key. For differentiable cases a fixed random
cotangent `<case>.cot` of the output's shape is stored, and `<case>.grad_<input>` is the
gradient of `sum(out * cot)` with respect to that float input (the VJP of `cot`). Float data
is f32, indices i32, bits u32, booleans u8. The attributes in the metadata and the functions
below are the record of exactly what each case computes.

Before it writes `random.safetensors` the script re-derives threefry2x32, `PRNGKey`,
`random_bits`, `split`, `fold_in`, `uniform`, `normal` and `bernoulli` in plain NumPy (see
`NumpyThreefry`, `erf_inv_f32`, `xla_log1p_f32` and `xla_log_f32` below) and asserts that they
reproduce JAX's results bit for bit; that NumPy code is the reference description of what the
Rust side implements. It also reports how closely the NumPy versions of XLA:CPU's f32 erf, log,
log1p and erf_inv match XLA (exactly, on the sweeps it runs).

Run it in a throwaway virtual environment; JAX is never a dependency of nitro and CI does not
run this script (the Rust tests read the committed golden files):

    python3 -m venv V && V/bin/pip install jax==0.10.2 safetensors && V/bin/python bench/jax_goldens.py

Options: `--out DIR` (default: runtime/tests/goldens next to this script's repository root),
`--lowered DIR` to also dump `jax.jit(f).lower(...).as_text()` (StableHLO) of one
representative case per op into DIR. The output is deterministic: every input comes from a
NumPy generator with a fixed seed, and JAX runs on the CPU with 64-bit mode off.
"""

import argparse
import json
import os
import sys

# Must be set before JAX is imported: CPU only, f32 by default.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_ENABLE_X64"] = "0"

import numpy as np  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
import jax.extend.random as jex_random  # noqa: E402

try:
    from safetensors.numpy import load_file as _st_load_file
except ImportError:  # only used to read the files back as a check
    _st_load_file = None

JAX_VERSION = "0.10.2"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

F32 = np.float32
U32 = np.uint32
I32 = np.int32


def f32(a):
    return np.asarray(a, dtype=F32)


# ---------------------------------------------------------------------------------------------
# Writing safetensors files


_DTYPE_NAMES = {np.dtype(F32): "F32", np.dtype(I32): "I32", np.dtype(U32): "U32",
                np.dtype(np.uint8): "U8"}


def write_safetensors(path, tensors, metadata):
    """Writes `tensors` (name -> array) with string->string `metadata` as a safetensors file.

    The format: an 8-byte little-endian header length, a JSON header {"__metadata__": {...},
    name: {dtype, shape, data_offsets}}, then the tensors' little-endian bytes back to back.
    Written by hand rather than with `safetensors.numpy.save_file` so that the bytes are
    reproducible (that writer's metadata order varies between runs): metadata keys sorted,
    tensors ordered by element size (largest first, so every tensor stays aligned) then name,
    the header padded with spaces to a multiple of 8 bytes.
    """
    order = sorted(tensors, key=lambda n: (-tensors[n].dtype.itemsize, n))
    header = {"__metadata__": dict(sorted(metadata.items()))}
    blobs, offset = [], 0
    for name in order:
        arr = tensors[name]
        if arr.dtype not in _DTYPE_NAMES:
            raise TypeError(f"{name}: unexpected dtype {arr.dtype}")
        raw = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": _DTYPE_NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for raw in blobs:
            f.write(raw)
    if _st_load_file is not None:  # read it back with the reference reader
        back = _st_load_file(path)
        assert sorted(back) == sorted(tensors)
        for name, arr in tensors.items():
            assert back[name].dtype == arr.dtype and np.array_equal(
                back[name].view(np.uint8), np.ascontiguousarray(arr).view(np.uint8)), name


class Family:
    """The cases of one golden file: tensors `<case>.<role>` and one metadata entry per case."""

    def __init__(self, name):
        self.name = name
        self.tensors = {}
        self.attrs = {}

    def add(self, case, attrs, tensors):
        if case in self.attrs:
            raise ValueError(f"duplicate case {case}")
        if "." in case:
            raise ValueError(f"case names may not contain '.': {case}")
        self.attrs[case] = attrs
        for role, value in tensors.items():
            arr = np.asarray(value)
            if arr.dtype == np.bool_:
                arr = arr.astype(np.uint8)
            self.tensors[f"{case}.{role}"] = np.ascontiguousarray(arr)

    def save(self, out_dir):
        path = os.path.join(out_dir, f"{self.name}.safetensors")
        metadata = {case: json.dumps(a, separators=(",", ":")) for case, a in self.attrs.items()}
        write_safetensors(path, self.tensors, metadata)
        return path


def with_vjp(rng, fn, inputs, wrt):
    """Evaluates `fn(**inputs)` and the VJP of a random cotangent.

    `inputs` maps argument names to NumPy arrays (all of them are stored); `wrt` names the float
    inputs to differentiate. Returns the tensors to store: the inputs, `out`, `cot` and
    `grad_<name>` for each name in `wrt`.
    """
    fixed = {k: jnp.asarray(v) for k, v in inputs.items() if k not in wrt}

    def f(*diff_args):
        return fn(**fixed, **dict(zip(wrt, diff_args)))

    out, vjp = jax.vjp(f, *[jnp.asarray(inputs[k]) for k in wrt])
    cot = f32(rng.standard_normal(out.shape))
    grads = vjp(jnp.asarray(cot))
    result = dict(inputs)
    result["out"] = np.asarray(out)
    result["cot"] = cot
    for name, g in zip(wrt, grads):
        result[f"grad_{name}"] = np.asarray(g)
    return result


def distinct_values(rng, shape, scale=0.25):
    """f32 values that are pairwise distinct (a shuffled, centred, scaled range): max and min
    windows then have one unambiguous winner, so their gradients are well defined."""
    n = int(np.prod(shape))
    perm = rng.permutation(n).astype(F32)
    return f32((perm - n / 2) * scale).reshape(shape)


# ---------------------------------------------------------------------------------------------
# conv: jax.lax.conv_general_dilated


def same_pads(in_spatial, kernel_spatial, strides, rhs_dilation):
    """Explicit [lo, hi] pads equivalent to padding="SAME" (lax.padtype_to_pads on the
    dilated kernel size)."""
    dilated = [(k - 1) * d + 1 for k, d in zip(kernel_spatial, rhs_dilation)]
    return [list(p) for p in lax.padtype_to_pads(in_spatial, dilated, strides, "SAME")]


def conv_family(rng):
    fam = Family("conv")

    def spatial_of(shape, spec):
        return [shape[i] for i, c in enumerate(spec) if c not in "NCIO"]

    cases = [
        # name, lhs shape, rhs shape, dimension_numbers, strides, padding, lhs_dil, rhs_dil, groups
        ("conv_same_s1", (2, 5, 5, 3), (3, 3, 3, 4), ("NHWC", "HWIO", "NHWC"),
         (1, 1), "SAME", (1, 1), (1, 1), 1),
        ("conv_same_s2", (1, 6, 6, 2), (3, 3, 2, 3), ("NHWC", "HWIO", "NHWC"),
         (2, 2), "SAME", (1, 1), (1, 1), 1),
        ("conv_valid", (1, 6, 5, 2), (3, 2, 2, 3), ("NHWC", "HWIO", "NHWC"),
         (1, 1), "VALID", (1, 1), (1, 1), 1),
        ("conv_odd", (2, 7, 5, 2), (3, 2, 2, 2), ("NHWC", "HWIO", "NHWC"),
         (2, 1), [[1, 2], [0, 1]], (1, 1), (1, 1), 1),
        ("conv_rhs_dil2", (1, 7, 7, 2), (3, 3, 2, 2), ("NHWC", "HWIO", "NHWC"),
         (1, 1), "SAME", (1, 1), (2, 2), 1),
        ("conv_lhs_dil2", (1, 3, 4, 2), (3, 3, 2, 2), ("NHWC", "HWIO", "NHWC"),
         (1, 1), [[1, 2], [2, 2]], (2, 2), (1, 1), 1),
        ("conv_groups2", (1, 5, 5, 4), (3, 3, 2, 6), ("NHWC", "HWIO", "NHWC"),
         (1, 1), "SAME", (1, 1), (1, 1), 2),
        ("conv_depthwise", (1, 5, 5, 3), (3, 3, 1, 6), ("NHWC", "HWIO", "NHWC"),
         (1, 1), "SAME", (1, 1), (1, 1), 3),
        ("conv_nchw", (2, 3, 5, 5), (4, 3, 3, 3), ("NCHW", "OIHW", "NCHW"),
         (1, 1), "SAME", (1, 1), (1, 1), 1),
        ("conv_nchw_s2_g2", (1, 4, 7, 6), (4, 2, 3, 3), ("NCHW", "OIHW", "NCHW"),
         (2, 2), [[0, 1], [1, 1]], (1, 1), (1, 1), 2),
        ("conv_1d", (2, 8, 3), (3, 3, 4), ("NWC", "WIO", "NWC"),
         (1,), "SAME", (1,), (1,), 1),
        ("conv_1d_s2_dil", (1, 11, 2), (3, 2, 3), ("NWC", "WIO", "NWC"),
         (2,), [[2, 1]], (1,), (2,), 1),
    ]
    for name, lshape, rshape, dn, strides, padding, lhs_dil, rhs_dil, groups in cases:
        lhs = f32(rng.standard_normal(lshape))
        rhs = f32(rng.standard_normal(rshape) * 0.5)
        if padding == "SAME":
            pads = same_pads(spatial_of(lshape, dn[0]), spatial_of(rshape, dn[1]), strides,
                             rhs_dil)
        elif padding == "VALID":
            pads = [[0, 0] for _ in strides]
        else:
            pads = padding

        def conv(lhs, rhs, pads=pads, strides=strides, lhs_dil=lhs_dil, rhs_dil=rhs_dil,
                 dn=dn, groups=groups):
            return lax.conv_general_dilated(
                lhs, rhs, window_strides=strides, padding=[tuple(p) for p in pads],
                lhs_dilation=lhs_dil, rhs_dilation=rhs_dil, dimension_numbers=dn,
                feature_group_count=groups, precision=lax.Precision.HIGHEST)

        if padding == "SAME" and lhs_dil == (1,) * len(strides):
            # The explicit pads are exactly what padding="SAME" means.
            same = lax.conv_general_dilated(
                lhs, rhs, strides, "SAME", lhs_dil, rhs_dil, dn, groups,
                precision=lax.Precision.HIGHEST)
            assert np.array_equal(np.asarray(same), np.asarray(conv(lhs, rhs))), name

        attrs = {"op": "conv_general_dilated", "window_strides": list(strides),
                 "padding": pads, "lhs_dilation": list(lhs_dil), "rhs_dilation": list(rhs_dil),
                 "feature_group_count": groups, "batch_group_count": 1,
                 "dimension_numbers": list(dn), "precision": "HIGHEST"}
        fam.add(name, attrs, with_vjp(rng, conv, {"lhs": lhs, "rhs": rhs}, ["lhs", "rhs"]))
    return fam


# ---------------------------------------------------------------------------------------------
# window: jax.lax.reduce_window


REDUCERS = {
    "sum": (lax.add, 0.0),
    "max": (lax.max, -np.inf),
    "min": (lax.min, np.inf),
}


def window_family(rng):
    fam = Family("window")
    cases = [
        # name, kind, x shape, window, strides, padding, window_dilation
        ("max_pool_2x2", "max", (2, 4, 4, 3), (1, 2, 2, 1), (1, 2, 2, 1),
         [[0, 0]] * 4, (1, 1, 1, 1)),
        ("max_3x3_s2_p1", "max", (1, 5, 5, 2), (1, 3, 3, 1), (1, 2, 2, 1),
         [[0, 0], [1, 1], [1, 1], [0, 0]], (1, 1, 1, 1)),
        ("sum_pool_2x2", "sum", (1, 4, 6, 2), (1, 2, 2, 1), (1, 2, 2, 1),
         [[0, 0]] * 4, (1, 1, 1, 1)),
        ("sum_dilated", "sum", (1, 7, 7, 1), (1, 2, 2, 1), (1, 1, 1, 1),
         [[0, 0]] * 4, (1, 2, 2, 1)),
        ("cumsum_axis1", "sum", (3, 6), (1, 6), (1, 1), [[0, 0], [5, 0]], (1, 1)),
        ("min_2x3", "min", (2, 5, 4), (1, 2, 3), (1, 1, 1), [[0, 0], [0, 1], [1, 1]], (1, 1, 1)),
        ("max_odd", "max", (1, 7, 5, 1), (1, 3, 2, 1), (1, 2, 2, 1),
         [[0, 0], [0, 1], [1, 0], [0, 0]], (1, 1, 1, 1)),
        ("sum_odd_pad", "sum", (2, 7, 5), (1, 3, 2), (1, 2, 2), [[0, 0], [1, 2], [0, 1]],
         (1, 1, 1)),
    ]
    for name, kind, shape, window, strides, padding, wdil in cases:
        if kind == "sum":
            x = f32(rng.standard_normal(shape))
        else:
            x = distinct_values(rng, shape)
        op, init = REDUCERS[kind]

        def reduce(x, op=op, init=init, window=window, strides=strides, padding=padding,
                   wdil=wdil):
            return lax.reduce_window(x, jnp.asarray(init, F32), op, window, strides,
                                     [tuple(p) for p in padding], window_dilation=wdil)

        attrs = {"op": "reduce_window", "kind": kind, "init": kind_init_name(kind),
                 "window_dimensions": list(window), "window_strides": list(strides),
                 "padding": padding, "window_dilation": list(wdil),
                 "base_dilation": [1] * len(shape)}
        fam.add(name, attrs, with_vjp(rng, reduce, {"x": x}, ["x"]))
    return fam


def kind_init_name(kind):
    return {"sum": "0", "max": "-inf", "min": "+inf"}[kind]


# ---------------------------------------------------------------------------------------------
# index: take / take_along_axis / scatter / dynamic_slice / dynamic_update_slice


def index_family(rng):
    fam = Family("index")
    i32 = lambda a: np.asarray(a, dtype=I32)  # noqa: E731

    # jnp.take(table, ids, axis, mode=...). mode "fill" is jnp.take's default.
    take_cases = [
        ("take_axis0", (6, 4), [5, 0, 2, 2, 3], 0, "fill"),
        ("take_axis0_ids2d", (5, 3), [[4, 1, 1], [0, 3, 4]], 0, "fill"),
        ("take_axis1", (3, 5), [4, 0, 2, 4], 1, "fill"),
        ("take_clip", (5, 3), [-1, 2, 4, -6, 9, 0], 0, "clip"),
        ("take_fill_oob", (5, 3), [-1, 2, 4, -6, 9, 0], 0, "fill"),
    ]
    for name, tshape, ids, axis, mode in take_cases:
        table = f32(rng.standard_normal(tshape))

        def take(table, ids, axis=axis, mode=mode):
            return jnp.take(table, ids, axis=axis, mode=mode)

        attrs = {"op": "take", "axis": axis, "mode": mode}
        case = with_vjp(rng, take, {"table": table, "ids": i32(ids)}, ["table"])
        if mode == "fill":  # what jnp.take does when no mode is given
            default = np.asarray(jnp.take(table, i32(ids), axis=axis))
            assert np.array_equal(default, case["out"], equal_nan=True), name
        fam.add(name, attrs, case)

    # jnp.take_along_axis(x, idx, axis=-1), indices in range.
    for name, idx in [("take_along_k1", [[3], [0], [5], [5]]),
                      ("take_along_k3", [[0, 5, 0], [2, 2, 1], [4, 3, 5], [1, 0, 1]])]:
        x = f32(rng.standard_normal((4, 6)))

        def along(x, idx):
            return jnp.take_along_axis(x, idx, axis=-1, mode="fill")

        attrs = {"op": "take_along_axis", "axis": -1, "mode": "fill"}
        fam.add(name, attrs, with_vjp(rng, along, {"x": x, "idx": i32(idx)}, ["x"]))

    # x.at[idx].add(upd) / .set(upd), indexing the leading axis.
    scatter_cases = [
        ("scatter_add", "scatter_add", (6, 3), [1, 3, 1, 0, 3], None),
        ("scatter_add_oob", "scatter_add", (4, 2), [0, 4, -1, -5, 9, 3], None),
        ("scatter_add_clip", "scatter_add", (4, 2), [0, 4, -1, -5, 9, 3], "clip"),
        ("scatter_set", "scatter_set", (6, 3), [4, 0, 2], None),
    ]
    for name, op, xshape, idx, mode in scatter_cases:
        x = f32(rng.standard_normal(xshape))
        upd = f32(rng.standard_normal((len(idx),) + xshape[1:]))

        def scatter(x, idx, upd, op=op, mode=mode):
            ref = x.at[idx]
            return ref.add(upd, mode=mode) if op == "scatter_add" else ref.set(upd, mode=mode)

        attrs = {"op": op, "axis": 0, "mode": "drop" if mode is None else mode,
                 "mode_is_default": mode is None}
        fam.add(name, attrs,
                with_vjp(rng, scatter, {"x": x, "idx": i32(idx), "upd": upd}, ["x", "upd"]))

    # lax.dynamic_slice(x, starts, sizes): starts given as an i32 vector.
    for name, starts, sizes in [("dynamic_slice", [1, 2], [3, 3]),
                                ("dynamic_slice_clamped", [4, 5], [3, 2]),
                                ("dynamic_slice_negative", [-1, -9], [2, 3])]:
        x = f32(rng.standard_normal((5, 6)))

        def dslice(x, starts, sizes=tuple(sizes)):
            return lax.dynamic_slice(x, [starts[i] for i in range(len(sizes))], sizes)

        attrs = {"op": "dynamic_slice", "sizes": sizes, "allow_negative_indices": True}
        fam.add(name, attrs, with_vjp(rng, dslice, {"x": x, "starts": i32(starts)}, ["x"]))

    # lax.dynamic_update_slice(x, upd, starts).
    for name, starts, ushape in [("dynamic_update_slice", [1, 2], (2, 3)),
                                 ("dynamic_update_slice_clamped", [4, 5], (2, 3)),
                                 ("dynamic_update_slice_negative", [-2, -9], (2, 3))]:
        x = f32(rng.standard_normal((5, 6)))
        upd = f32(rng.standard_normal(ushape))

        def dupdate(x, upd, starts):
            return lax.dynamic_update_slice(x, upd, [starts[i] for i in range(upd.ndim)])

        attrs = {"op": "dynamic_update_slice", "sizes": list(ushape),
                 "allow_negative_indices": True}
        fam.add(name, attrs, with_vjp(rng, dupdate, {"x": x, "upd": upd,
                                                     "starts": i32(starts)}, ["x", "upd"]))
    return fam


# ---------------------------------------------------------------------------------------------
# elementwise


def mixed(rng, fixed, n_random, lo, hi):
    """Hand-picked values followed by `n_random` uniform draws in [lo, hi), as f32."""
    return f32(np.concatenate([f32(fixed), f32(rng.uniform(lo, hi, n_random))]))


def away_from_bounds(rng, n, bounds, gap, scale):
    """n normal*scale f32 values none of which lies within `gap` of any of `bounds`."""
    out = []
    while len(out) < n:
        v = F32(rng.standard_normal() * scale)
        if all(abs(v - b) > gap for b in bounds):
            out.append(v)
    return f32(out)


def elementwise_family(rng):
    fam = Family("elementwise")
    tiny = [1e-8, -1e-8, 1e-6, -1e-6, 1e-4, -1e-4]

    unary = [
        # name, lax/jnp function, inputs (every one is differentiated; sign/floor/ceil/round
        # have zero gradients)
        ("erf", lax.erf,
         mixed(rng, [0.0, -0.0, 1e-8, -1e-8, 1e-3, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0, 3.5, 3.83,
                     3.84, -3.9, 4.0, 5.0, -6.0, 10.0, -10.0, 1e3, -1e30], 26, -4, 4)),
        ("erf_inv", lax.erf_inv,
         mixed(rng, [0.0, -0.0, 1e-7, -1e-7, 0.1, -0.5, 0.9, -0.99, 0.9966, -0.9967, 0.999,
                     -0.9999, 0.99999, 0.9999999, -0.99999994], 25, -1, 1)),
        ("sin", lax.sin,
         mixed(rng, [0.0, -0.0, np.pi / 2, np.pi, -np.pi, 2 * np.pi, 1e-4, 100.0, -100.0],
               27, -20, 20)),
        ("cos", lax.cos,
         mixed(rng, [0.0, -0.0, np.pi / 2, np.pi, -np.pi, 2 * np.pi, 1e-4, 100.0, -100.0],
               27, -20, 20)),
        ("log1p", lax.log1p,
         mixed(rng, [0.0, -0.0] + tiny + [0.5, -0.5, -0.9, -0.999, 1.0, 10.0, 1e3, 1e6],
               20, -0.99, 5)),
        ("expm1", lax.expm1,
         mixed(rng, [0.0, -0.0] + tiny + [1e-3, 0.5, -0.5, 1.0, -1.0, 5.0, -10.0, -20.0, 20.0,
                                          80.0], 20, -5, 5)),
        ("sign", lax.sign,
         mixed(rng, [0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, 2.5, -7.0, 1e-45, -1e-45, np.inf,
                     -np.inf], 12, -3, 3)),
    ]
    halves = [-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, -0.0, 0.0, 0.49999997, -0.49999997, 2.4999998,
              8388607.5, -8388607.5, 1e10, 3.7, -3.7, 1e-30, -1e-30]
    for name, fn in [("floor", lax.floor), ("ceil", lax.ceil), ("round", jnp.round)]:
        unary.append((name, fn, mixed(rng, halves, 18, -10, 10)))

    for name, fn, x in unary:
        attrs = {"op": name}
        if name == "round":
            attrs["rounding"] = "half_to_even"
        fam.add(name, attrs, with_vjp(rng, lambda x, fn=fn: fn(x), {"x": x}, ["x"]))

    # erf_inv outside (-1, 1) and at +-1: forward values only.
    fam.add("erf_inv_edges", {"op": "erf_inv"},
            {"x": f32([1.0, -1.0, 1.5, -2.0, 0.0, np.inf]),
             "out": np.asarray(lax.erf_inv(f32([1.0, -1.0, 1.5, -2.0, 0.0, np.inf])))})

    # atan2(x, y) = angle of the point (y, x): x is the numerator, as in lax.atan2(x, y).
    pairs = [(0.0, 1.0), (0.0, -1.0), (-0.0, -1.0), (1.0, 0.0), (-1.0, 0.0), (1.0, 1.0),
             (-1.0, -1.0), (1.0, -1.0), (-1.0, 1.0), (3.0, -4.0), (1e-30, 1.0), (1.0, 1e-30)]
    ax = f32([p[0] for p in pairs] + list(rng.standard_normal(20) * 3))
    ay = f32([p[1] for p in pairs] + list(rng.standard_normal(20) * 3))
    fam.add("atan2", {"op": "atan2"},
            with_vjp(rng, lambda x, y: lax.atan2(x, y), {"x": ax, "y": ay}, ["x", "y"]))
    ex = f32([0.0, -0.0, 0.0, -0.0, np.inf, -np.inf, np.inf, 1.0, -1.0, np.nan])
    ey = f32([0.0, 0.0, -0.0, -0.0, np.inf, np.inf, -np.inf, np.inf, -np.inf, 1.0])
    fam.add("atan2_edges", {"op": "atan2"},
            {"x": ex, "y": ey, "out": np.asarray(lax.atan2(ex, ey))})

    # rem(x, y): C fmod, the result has the sign of x. Quotients are kept away from integers so
    # that the gradient with respect to y (-trunc(x / y)) is unambiguous.
    rx, ry = [5.0, -5.0, 5.0, -5.0, 0.5, -0.5, 5.5, -5.5, 7.25], [3.0, 3.0, -3.0, -3.0, 3.0,
                                                                   3.0, 2.0, 2.0, -1.5]
    while len(rx) < 36:
        x = F32(rng.uniform(-10, 10))
        y = F32(rng.uniform(0.5, 4) * rng.choice([-1, 1]))
        q = abs(float(x) / float(y))
        if 0.02 < q - np.floor(q) < 0.98:
            rx.append(x)
            ry.append(y)
    fam.add("rem", {"op": "rem"},
            with_vjp(rng, lambda x, y: lax.rem(x, y), {"x": f32(rx), "y": f32(ry)}, ["x", "y"]))
    ex = f32([5.0, 0.0, -0.0, np.inf, 5.0, -5.0, 6.0, -6.0, np.nan, 1e30])
    ey = f32([0.0, 3.0, 3.0, 3.0, np.inf, np.inf, 3.0, 3.0, 1.0, 7.0])
    fam.add("rem_edges", {"op": "rem"}, {"x": ex, "y": ey, "out": np.asarray(lax.rem(ex, ey))})

    # clamp(lo, x, hi) with scalar bounds and with per-element bounds; no x equals a bound.
    # (jax 0.10.2 cannot differentiate clamp with respect to a scalar bound of a non-scalar x:
    # its JVP rule selects between mismatched shapes. The scalar case has grad_x only.)
    x = away_from_bounds(rng, 32, [-1.0, 1.5], 1e-3, 2.0)
    fam.add("clamp", {"op": "clamp", "bounds": "scalar"},
            with_vjp(rng, lambda lo, x, hi: lax.clamp(lo, x, hi),
                     {"lo": f32(-1.0), "x": x, "hi": f32(1.5)}, ["x"]))
    lo = f32(rng.uniform(-2, 0, 24))
    hi = f32(lo + rng.uniform(0.5, 2, 24))
    x = f32(rng.uniform(-3, 3, 24))
    assert np.all(np.minimum(abs(x - lo), abs(x - hi)) > 1e-4)
    fam.add("clamp_tensor", {"op": "clamp", "bounds": "tensor"},
            with_vjp(rng, lambda lo, x, hi: lax.clamp(lo, x, hi),
                     {"lo": lo, "x": x, "hi": hi}, ["lo", "x", "hi"]))

    # u32 bit operations.
    special = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xDEADBEEF, 0x12345678]
    bx = np.concatenate([np.asarray(special, U32), rng.integers(0, 2**32, 24, dtype=U32)])
    by = np.concatenate([np.asarray(special[::-1], U32), rng.integers(0, 2**32, 24, dtype=U32)])
    for name, fn in [("and", lax.bitwise_and), ("or", lax.bitwise_or),
                     ("xor", lax.bitwise_xor)]:
        fam.add(name, {"op": name, "dtype": "u32"},
                {"x": bx, "y": by, "out": np.asarray(fn(bx, by))})
    fam.add("not", {"op": "not", "dtype": "u32"}, {"x": bx, "out": np.asarray(lax.bitwise_not(bx))})
    fam.add("popcnt", {"op": "popcnt", "dtype": "u32"},
            {"x": bx, "out": np.asarray(lax.population_count(bx))})
    amounts = np.concatenate([np.asarray([0, 1, 5, 31, 32, 33, 63, 64, 100, 0xFFFFFFFF,
                                          0x80000000], U32),
                              rng.integers(0, 40, 21, dtype=U32)])
    for name, fn in [("shift_left", lax.shift_left),
                     ("shift_right_logical", lax.shift_right_logical)]:
        fam.add(name, {"op": name, "dtype": "u32"},
                {"x": bx, "y": amounts, "out": np.asarray(fn(bx, amounts))})
    sx, sa = bx.view(I32), amounts.view(I32)
    fam.add("shift_right_arithmetic", {"op": "shift_right_arithmetic", "dtype": "i32"},
            {"x": sx, "y": sa, "out": np.asarray(lax.shift_right_arithmetic(sx, sa))})

    # bitcast_convert_type both ways.
    fx = f32([0.0, -0.0, 1.0, -1.0, 0.1, np.inf, -np.inf, np.nan, 1e-45, -1e-40,
              np.finfo(F32).max, np.finfo(F32).tiny] + list(rng.standard_normal(12)))
    fam.add("bitcast_f32_u32", {"op": "bitcast_convert", "from": "f32", "to": "u32"},
            {"x": fx, "out": np.asarray(lax.bitcast_convert_type(fx, jnp.uint32))})
    ux = list(np.asarray([0, 0x80000000, 0x3F800000, 0x7F800000, 0xFF800000, 0x7FC00000,
                          0x7FC00001, 0x00000001, 0x7F7FFFFF, 0x807FFFFF], U32))
    while len(ux) < 24:
        v = U32(rng.integers(0, 2**32))
        if (v >> 23) & 0xFF != 0xFF:  # no random NaN payloads
            ux.append(v)
    ux = np.asarray(ux, U32)
    fam.add("bitcast_u32_f32", {"op": "bitcast_convert", "from": "u32", "to": "f32"},
            {"x": ux, "out": np.asarray(lax.bitcast_convert_type(ux, jnp.float32))})
    return fam


# ---------------------------------------------------------------------------------------------
# random: a NumPy re-derivation of jax.random's threefry2x32 implementation, checked against
# JAX bit for bit before the goldens are written.


class NumpyThreefry:
    """jax.random (default impl threefry2x32, jax_threefry_partitionable=True) in NumPy."""

    ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
    PARITY = U32(0x1BD11BDA)

    @staticmethod
    def rotl(v, r):
        return ((v << U32(r)) | (v >> U32(32 - r))).astype(U32)

    @classmethod
    def block(cls, key, x0, x1):
        """Threefry-2x32 with 20 rounds on counter words (x0, x1) (uint32 arrays)."""
        with np.errstate(over="ignore"):
            ks = [U32(key[0]), U32(key[1]), U32(key[0]) ^ U32(key[1]) ^ cls.PARITY]
            x0 = (x0 + ks[0]).astype(U32)
            x1 = (x1 + ks[1]).astype(U32)
            for i in range(5):  # five groups of four rounds, a key injection after each
                for r in cls.ROTATIONS[i % 2]:
                    x0 = (x0 + x1).astype(U32)
                    x1 = cls.rotl(x1, r) ^ x0
                x0 = (x0 + ks[(i + 1) % 3]).astype(U32)
                x1 = (x1 + ks[(i + 2) % 3] + U32(i + 1)).astype(U32)
        return x0, x1

    @classmethod
    def threefry_2x32(cls, key, count):
        """jax.extend.random.threefry_2x32: the flat count is split in halves (x0 = first
        half, x1 = second, an odd count padded with one 0), outputs concatenated, pad dropped."""
        flat = np.asarray(count, U32).ravel()
        n = flat.size
        padded = np.concatenate([flat, np.zeros(n % 2, U32)])
        half = padded.size // 2
        y0, y1 = cls.block(key, padded[:half], padded[half:])
        return np.concatenate([y0, y1])[:n].reshape(np.shape(count))

    @staticmethod
    def seed(seed):
        """PRNGKey(seed) for a Python int in 32-bit mode: [0, seed mod 2**32]."""
        s = np.int64(seed).astype(I32)  # jnp.asarray(np.int64(seed)) in x32 mode -> int32
        return np.asarray([0, np.uint32(s.view(U32))], U32)

    @classmethod
    def random_bits(cls, key, shape):
        """32-bit random_bits: counter (hi, lo) of the row-major flat index i, x0 ^ x1."""
        n = int(np.prod(shape))
        idx = np.arange(n, dtype=np.uint64)
        hi, lo = (idx >> np.uint64(32)).astype(U32), (idx & np.uint64(0xFFFFFFFF)).astype(U32)
        y0, y1 = cls.block(key, hi, lo)
        return (y0 ^ y1).reshape(shape)

    @classmethod
    def split(cls, key, num):
        """Key i = block(key, (0, i)) (both words, not xored)."""
        y0, y1 = cls.block(key, np.zeros(num, U32), np.arange(num, dtype=U32))
        return np.stack([y0, y1], axis=1)

    @classmethod
    def fold_in(cls, key, data):
        y0, y1 = cls.block(key, np.zeros(1, U32), np.asarray([data], U32))
        return np.asarray([y0[0], y1[0]], U32)

    @classmethod
    def uniform(cls, key, shape, minval=0.0, maxval=1.0):
        """Mantissa trick: 23 high bits under exponent 0 give a float in [1, 2); minus 1 is in
        [0, 1). XLA:CPU fuses `floats * (maxval - minval) + minval` into one fused
        multiply-add (a single rounding), so that step is an FMA here too."""
        bits = cls.random_bits(key, shape)
        floats = ((bits >> U32(9)) | U32(0x3F800000)).view(F32) - F32(1.0)
        lo, hi = F32(minval), F32(maxval)
        return np.maximum(lo, fma32(floats, hi - lo, lo)).astype(F32)

    @classmethod
    def bernoulli(cls, key, p, shape):
        return cls.uniform(key, shape) < F32(p)


def fma32(a, b, c):
    """f32 fused multiply-add, a * b + c with one rounding. The f32 product is exact in f64; the
    f64 sum then rounds twice (f64, then f32), which differs from a true FMA only in rare
    halfway cases."""
    return (f32(a).astype(np.float64) * f32(b).astype(np.float64)
            + f32(c).astype(np.float64)).astype(F32)


def xla_log_f32(x):
    """XLA:CPU's f32 log (a Cephes-style polynomial, as in Eigen's plog): x = m * 2**e with m in
    [sqrt(1/2), sqrt(2)), a degree-8 polynomial in m - 1, and ln 2 added in two parts. Subnormal
    inputs count as 0 (-> -inf); negative -> NaN; +inf -> +inf."""
    x = f32(x)
    p = (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
         -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m, e = np.frexp(np.where(np.isfinite(x) & (x >= np.finfo(F32).tiny), x, F32(1)))
        m, e = f32(m), f32(e)  # m in [0.5, 1)
        below = m < F32(0.707106781186547524)
        e = f32(e - np.where(below, F32(1), F32(0)))
        t = f32(m - F32(1))
        t = f32(t + np.where(below, m, F32(0)))  # t = 2m - 1 when m < sqrt(1/2), else m - 1
        t2 = f32(t * t)
        t3 = f32(t2 * t)
        # Three interleaved Horner chains (p0..p2, p3..p5, p6..p8), joined through t**3.
        y0 = fma32(fma32(F32(p[0]), t, F32(p[1])), t, F32(p[2]))
        y1 = fma32(fma32(F32(p[3]), t, F32(p[4])), t, F32(p[5]))
        y2 = fma32(fma32(F32(p[6]), t, F32(p[7])), t, F32(p[8]))
        y = fma32(fma32(y0, t3, y1), t3, y2)
        y = fma32(y, t3, f32(e * F32(-2.12194440e-4)))
        r = f32(f32(t - f32(t2 * F32(0.5))) + y)
        r = f32(r + f32(e * F32(0.693359375)))
        r = np.where(x >= np.finfo(F32).tiny, r, F32(-np.inf))  # 0 and subnormals
        r = np.where(x < 0, F32(np.nan), r)
        return np.where(np.isfinite(x) | (x < 0), r, x).astype(F32)  # +inf and NaN pass


def xla_log1p_f32(x):
    """XLA:CPU's f32 log1p: for |x| < sqrt(2) - 1 a Cephes rational x - x**2/2 + x**3 * P(x)/Q(x)
    (Horner with FMAs), otherwise log(1 + x) with the log above."""
    x = f32(x)
    num = (4.5270000862445199635215e-5, 4.9854102823193375972212e-1, 6.5787325942061044846969,
           2.9911919328553073277375e1, 6.0949667980987787057556e1, 5.7112963590585538103336e1,
           2.0039553499201281259648e1)
    den = (1.0, 1.5062909083469192043167e1, 8.3047565967967209469434e1,
           2.2176239823732856465394e2, 3.0909872225312059774938e2, 2.1642788614495947685003e2,
           6.0118660497603843919306e1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        pn = np.full_like(x, F32(num[0]))
        pd = np.full_like(x, F32(den[0]))
        for cn, cd in zip(num[1:], den[1:]):
            pn, pd = fma32(pn, x, F32(cn)), fma32(pd, x, F32(cd))
        x2 = f32(x * x)
        small = f32(x + fma32(F32(-0.5), x2, f32(f32(x * x2) * f32(pn / pd))))
        large = xla_log_f32(f32(x + F32(1)))
        return np.where(np.abs(x) < F32(0.41421356237309504880), small, large).astype(F32)


def erf_inv_f32(x, fused=True, log1p=None):
    """XLA's ErfInv32 (Giles' single-precision approximation) evaluated in f32 with NumPy.
    `fused` evaluates each Horner step `c + p * w` as one FMA (as XLA:CPU does); `log1p` is the
    log1p used (default: XLA:CPU's, `xla_log1p_f32`)."""
    x = f32(x)
    log1p = xla_log1p_f32 if log1p is None else log1p
    small = (2.81022636e-08, 3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
             -0.00125372503, -0.00417768164, 0.246640727, 1.50140941)
    large = (-0.000200214257, 0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
             -0.0076224613, 0.00943887047, 1.00167406, 2.83297682)
    with np.errstate(invalid="ignore", divide="ignore"):
        w = -log1p(f32(-x * x))
        lt = w < F32(5)
        w = np.where(lt, w - F32(2.5), np.sqrt(w) - F32(3)).astype(F32)
        p = np.where(lt, F32(small[0]), F32(large[0])).astype(F32)
        for cs, cl in zip(small[1:], large[1:]):
            c = np.where(lt, F32(cs), F32(cl)).astype(F32)
            p = fma32(p, w, c) if fused else (c + p * w).astype(F32)
        return np.where(np.abs(x) == F32(1), x * F32(np.inf), p * x).astype(F32)


def ulp_distance(a, b):
    """Largest distance in units in the last place between two f32 arrays (sign-aware)."""
    def ordered(v):
        i = f32(v).view(I32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)
    return int(np.max(np.abs(ordered(a) - ordered(b)))) if np.size(a) else 0


def random_family(rng):
    fam = Family("random")
    ref = NumpyThreefry
    checks = []

    def check(what, got, want):
        assert np.array_equal(np.asarray(got), np.asarray(want)), what
        checks.append(what)

    for seed in (0, 1, 42, 2**31 - 1):
        key = jax.random.PRNGKey(seed)
        kd = np.asarray(jax.random.key_data(key))
        s = f"s{seed}"
        check(f"PRNGKey({seed})", ref.seed(seed), kd)
        fam.add(f"key_{s}", {"op": "prng_key", "seed": seed}, {"out": kd})

        for shape in [(4,), (3, 5), (2, 3, 4)]:
            out = np.asarray(jax.random.bits(key, shape, dtype=jnp.uint32))
            check(f"bits{shape} seed {seed}", ref.random_bits(kd, shape), out)
            tag = "x".join(map(str, shape))
            fam.add(f"bits_{tag}_{s}", {"op": "random_bits", "seed": seed, "shape": list(shape),
                                        "bit_width": 32}, {"key": kd, "out": out})

        for num in (2, 3):
            out = np.asarray(jax.random.key_data(jax.random.split(key, num)))
            check(f"split({num}) seed {seed}", ref.split(kd, num), out)
            fam.add(f"split{num}_{s}", {"op": "split", "seed": seed, "num": num},
                    {"key": kd, "out": out})

        for data in (7, 123456):
            out = np.asarray(jax.random.key_data(jax.random.fold_in(key, data)))
            check(f"fold_in({data}) seed {seed}", ref.fold_in(kd, data), out)
            fam.add(f"fold_in{data}_{s}", {"op": "fold_in", "seed": seed, "data": data},
                    {"key": kd, "out": out})

        for name, lo, hi in [("uniform", 0.0, 1.0), ("uniform_range", -2.0, 3.0)]:
            out = np.asarray(jax.random.uniform(key, (1000,), jnp.float32, lo, hi))
            check(f"{name} seed {seed}", ref.uniform(kd, (1000,), lo, hi), out)
            fam.add(f"{name}_{s}", {"op": "uniform", "seed": seed, "shape": [1000],
                                    "minval": lo, "maxval": hi}, {"key": kd, "out": out})

        out = np.asarray(jax.random.normal(key, (1000,), jnp.float32))
        lo = np.nextafter(F32(-1), F32(0))
        u = ref.uniform(kd, (1000,), lo, 1.0)
        check(f"normal seed {seed}", F32(np.sqrt(2)) * erf_inv_f32(u), out)
        libm = F32(np.sqrt(2)) * erf_inv_f32(u, log1p=np.log1p)
        checks.append(f"normal seed {seed} with NumPy's (libm) log1p instead of XLA's: within "
                      f"{ulp_distance(libm, out)} ulp, {np.sum(libm != out)} of 1000 differ")
        fam.add(f"normal_{s}", {"op": "normal", "seed": seed, "shape": [1000]},
                {"key": kd, "out": out})

        out = np.asarray(jax.random.bernoulli(key, 0.3, (1000,)))
        check(f"bernoulli seed {seed}", ref.bernoulli(kd, 0.3, (1000,)), out)
        fam.add(f"bernoulli_{s}", {"op": "bernoulli", "seed": seed, "p": 0.3, "shape": [1000]},
                {"key": kd, "out": out.astype(np.uint8)})

    # The raw block function through jax.extend.random.threefry_2x32(key, count).
    raw = [
        ([0x13198A2E, 0x03707344], [0x243F6A88, 0x85A308D3]),  # Random123 known answer
        ([0, 0], [0, 0]),
        ([0xFFFFFFFF, 0xFFFFFFFF], [0xFFFFFFFF, 0xFFFFFFFF]),
        ([0, 42], list(range(8))),
        ([0xDEADBEEF, 0x01234567], [5, 4, 3, 2, 1]),  # odd length: padded with a 0
    ]
    for i, (k, c) in enumerate(raw):
        k, c = np.asarray(k, U32), np.asarray(c, U32)
        out = np.asarray(jex_random.threefry_2x32(jnp.asarray(k), jnp.asarray(c)))
        check(f"threefry_2x32 #{i}", ref.threefry_2x32(k, c), out)
        fam.add(f"threefry2x32_{i}", {"op": "threefry2x32"}, {"key": k, "count": c, "out": out})
    assert np.array_equal(fam.tensors["threefry2x32_0.out"], np.asarray([0xC4923A9C,
                                                                          0x483DF7A0], U32))

    return fam, checks


def erf_f32(x):
    """XLA:CPU's f32 erf (its LLVM intrinsic, Eigen's rational approximation): odd numerator
    and even denominator in x*x, each Horner step one FMA, +-1 from |x| >= 3.8325069."""
    x = f32(x)
    alpha = (0.00022905065861350646, 0.0034082910107109506, 0.050955695062380861,
             0.18520832239976145, 1.128379143519084)
    beta = (-1.1791602954361697e-7, 0.000023547966471313185, 0.0010179625278914885,
            0.014070470171167667, 0.11098505178285362, 0.49746925110067538, 1.0)
    x2 = f32(x * x)
    p = np.full_like(x, F32(alpha[0]))
    for c in alpha[1:]:
        p = fma32(x2, p, F32(c))
    p = f32(x * p)
    q = np.full_like(x, F32(beta[0]))
    for c in beta[1:]:
        q = fma32(x2, q, F32(c))
    with np.errstate(invalid="ignore"):
        return np.where(np.abs(x) >= F32(3.832506856900711), np.copysign(F32(1), x),
                        f32(p / q)).astype(F32)


def xla_math_checks():
    """Compares the NumPy erf / ErfInv32 above with XLA:CPU's over dense sweeps."""
    checks = []
    sweep = f32(np.linspace(-6, 6, 24001))
    xla, mine = np.asarray(lax.erf(sweep)), erf_f32(sweep)
    checks.append(f"erf sweep: NumPy erf within {ulp_distance(mine, xla)} ulp of XLA, "
                  f"{np.sum(mine != xla)} of {sweep.size} differ")
    bits = np.random.default_rng(6).integers(0, 0x7F800000, 200000, dtype=U32)
    for name, sweep, mine_fn, xla_fn in [
        ("log", bits.view(F32), xla_log_f32, lax.log),
        ("log1p", f32(np.linspace(-0.999999, 10, 40001)), xla_log1p_f32, lax.log1p),
        ("erf_inv", f32(np.linspace(-0.9999999, 0.9999999, 20001)), erf_inv_f32, lax.erf_inv),
    ]:
        xla, mine = np.asarray(xla_fn(sweep)), mine_fn(sweep)
        checks.append(f"{name} sweep: NumPy {name} within {ulp_distance(mine, xla)} ulp of "
                      f"XLA, {np.sum(mine != xla)} of {sweep.size} differ")
    x = f32(np.linspace(-0.9999999, 0.9999999, 20001))
    xla = np.asarray(lax.erf_inv(x))
    for fused, log1p, what in [(False, np.log1p, "plain Horner, libm log1p"),
                               (True, np.log1p, "FMA Horner, libm log1p")]:
        mine = erf_inv_f32(x, fused, log1p)
        checks.append(f"erf_inv sweep ({what}): within {ulp_distance(mine, xla)} ulp of XLA, "
                      f"{np.sum(mine != xla)} of {x.size} differ")
    return checks


# ---------------------------------------------------------------------------------------------
# scan: jax.lax.scan


def scan_family(rng):
    """Loops with a static trip count. Every case returns one f32 vector: the final carry
    followed by the stacked per-iteration outputs, each flattened row-major (several carry
    parts or outputs are concatenated in the order the case lists them)."""
    fam = Family("scan")
    normal = lambda *shape: f32(rng.standard_normal(shape) * 0.5)  # noqa: E731

    def flat(*parts):
        return jnp.concatenate([p.ravel() for p in parts])

    def rnn(h0, xs, w, u, b):
        """h = tanh(h @ w + x @ u + b) over the rows of xs, y = sin(h); out = [h, ys]."""
        def step(h, x):
            h = jnp.tanh(jnp.matmul(h, w) + jnp.matmul(x, u) + b)
            return h, jnp.sin(h)
        h, ys = lax.scan(step, h0, xs)
        return flat(h, ys)

    # rnn: 6 steps of a tanh recurrence with a sin readout.
    inputs = {"h0": normal(2, 4), "xs": normal(6, 2, 4), "w": normal(4, 4), "u": normal(4, 4),
              "b": normal(4)}
    fam.add("rnn", {"op": "scan", "length": 6, "reverse": False},
            with_vjp(rng, rnn, inputs, ["h0", "xs", "w", "u", "b"]))

    # reverse: c = c * x + 0.1 over the rows of xs from the last to the first, y = c; the ys
    # are stored in xs order (ys[t] comes from xs[t]); out = [c, ys].
    def reverse(c0, xs):
        def step(c, x):
            c = c * x + 0.1
            return c, c
        c, ys = lax.scan(step, c0, xs, reverse=True)
        return flat(c, ys)

    fam.add("reverse", {"op": "scan", "length": 5, "reverse": True},
            with_vjp(rng, reverse, {"c0": normal(3), "xs": normal(5, 3)}, ["c0", "xs"]))

    # nested: an outer scan over xs [3, 4, 2] with carry c; each outer step runs an inner scan
    # over the 4 rows xr of its slice with carry s (starting at c): s = s * 0.9 + tanh(xr * w),
    # inner y = s * s. The outer step's new carry is (inner final s) + c, its y the inner ys
    # [4, 2]; out = [c, ys [3, 4, 2]].
    def nested(c0, xs, w):
        def outer(c, xo):
            def inner(s, xr):
                s = s * 0.9 + jnp.tanh(xr * w)
                return s, s * s
            s, ys = lax.scan(inner, c, xo)
            return s + c, ys
        c, ys = lax.scan(outer, c0, xs)
        return flat(c, ys)

    fam.add("nested", {"op": "scan", "outer": 3, "inner": 4},
            with_vjp(rng, nested, {"c0": normal(2), "xs": normal(3, 4, 2), "w": normal(2)},
                     ["c0", "xs", "w"]))

    # layers: a residual stack scanned over the stacked weights (ws, bs) with carry x:
    # x = x + tanh(x @ w + b), no per-iteration outputs; out = final x, flattened.
    def layers(x0, ws, bs):
        x, ys = lax.scan(lambda x, wb: (x + jnp.tanh(jnp.matmul(x, wb[0]) + wb[1]), None),
                         x0, (ws, bs))
        assert ys is None
        return x.ravel()

    fam.add("layers", {"op": "scan", "depth": 3},
            with_vjp(rng, layers, {"x0": normal(2, 4), "ws": normal(3, 4, 4), "bs": normal(3, 4)},
                     ["x0", "ws", "bs"]))

    # counter: carry (i, x) with i an i32 step counter from 0: x = x * cos(x_t) + f32(i),
    # i = i + 1, y = x; out = [x, ys] (i is not part of the output).
    def counter(x0, xs):
        def step(carry, xt):
            i, x = carry
            x = x * jnp.cos(xt) + i.astype(F32)
            return (i + 1, x), x
        (i, x), ys = lax.scan(step, (jnp.asarray(0, I32), x0), xs)
        return flat(x, ys)

    fam.add("counter", {"op": "scan", "length": 4},
            with_vjp(rng, counter, {"x0": normal(3), "xs": normal(4, 3)}, ["x0", "xs"]))

    # one_step: rnn with a single step.
    inputs = {"h0": normal(2, 4), "xs": normal(1, 2, 4), "w": normal(4, 4), "u": normal(4, 4),
              "b": normal(4)}
    fam.add("one_step", {"op": "scan", "length": 1},
            with_vjp(rng, rnn, inputs, ["h0", "xs", "w", "u", "b"]))
    return fam


# ---------------------------------------------------------------------------------------------
# StableHLO dumps of representative cases


def dump_lowered(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    z = lambda *s: jnp.zeros(s, F32)  # noqa: E731
    nhwc = ("NHWC", "HWIO", "NHWC")

    def conv(lhs, rhs, groups=1):
        return lax.conv_general_dilated(lhs, rhs, (2, 2), [(0, 1), (1, 1)], (1, 1), (1, 1),
                                        nhwc, groups, precision=lax.Precision.HIGHEST)

    def vjp_of(f, argnum):
        def g(*args):
            *xs, cot = args
            return jax.vjp(f, *xs)[1](cot)[argnum]
        return g

    maxpool = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1),  # noqa: E731
                                          (1, 2, 2, 1), [(0, 0), (1, 1), (1, 1), (0, 0)])
    sumpool = lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1),  # noqa: E731
                                          (1, 2, 2, 1), "VALID")
    take = lambda t, i: jnp.take(t, i, axis=0)  # noqa: E731
    ids = jnp.zeros((5,), I32)
    key = jax.random.PRNGKey(0)
    items = {
        "conv_fwd": (conv, (z(1, 6, 6, 2), z(3, 3, 2, 4))),
        "conv_grad_lhs": (vjp_of(conv, 0), (z(1, 6, 6, 2), z(3, 3, 2, 4), z(1, 3, 3, 4))),
        "conv_grad_rhs": (vjp_of(conv, 1), (z(1, 6, 6, 2), z(3, 3, 2, 4), z(1, 3, 3, 4))),
        "conv_groups2_grad_rhs": (vjp_of(lambda l, r: conv(l, r, 2), 1),
                                  (z(1, 6, 6, 4), z(3, 3, 2, 4), z(1, 3, 3, 4))),
        "reduce_window_max": (maxpool, (z(1, 5, 5, 2),)),
        "reduce_window_max_grad": (vjp_of(maxpool, 0), (z(1, 5, 5, 2), z(1, 3, 3, 2))),
        "reduce_window_sum": (sumpool, (z(1, 4, 4, 2),)),
        "reduce_window_sum_grad": (vjp_of(sumpool, 0), (z(1, 4, 4, 2), z(1, 2, 2, 2))),
        "take": (take, (z(6, 4), ids)),
        "take_clip": (lambda t, i: jnp.take(t, i, axis=0, mode="clip"), (z(6, 4), ids)),
        "take_grad": (lambda t, i, c: jax.vjp(lambda t: take(t, i), t)[1](c)[0],
                      (z(6, 4), ids, z(5, 4))),
        "take_along_axis": (lambda x, i: jnp.take_along_axis(x, i, axis=-1),
                            (z(4, 6), jnp.zeros((4, 3), I32))),
        "scatter_add": (lambda x, i, u: x.at[i].add(u), (z(6, 3), ids, z(5, 3))),
        "scatter_set": (lambda x, i, u: x.at[i].set(u), (z(6, 3), ids, z(5, 3))),
        "dynamic_slice": (lambda x, s: lax.dynamic_slice(x, [s[0], s[1]], (3, 3)),
                          (z(5, 6), jnp.zeros((2,), I32))),
        "dynamic_slice_grad": (lambda x, s, c: jax.vjp(
            lambda x: lax.dynamic_slice(x, [s[0], s[1]], (3, 3)), x)[1](c)[0],
            (z(5, 6), jnp.zeros((2,), I32), z(3, 3))),
        "dynamic_update_slice": (lambda x, u, s: lax.dynamic_update_slice(x, u, [s[0], s[1]]),
                                 (z(5, 6), z(2, 3), jnp.zeros((2,), I32))),
        "erf": (lax.erf, (z(8),)),
        "erf_inv": (lax.erf_inv, (z(8),)),
        "elementwise_misc": (lambda x, y: (lax.log1p(x), lax.expm1(x), jnp.round(x),
                                           lax.atan2(x, y), lax.rem(x, y),
                                           lax.clamp(-1.0, x, 1.0), lax.sign(x)),
                             (z(8), z(8))),
        "bit_ops": (lambda x, y: (lax.shift_left(x, y), lax.shift_right_logical(x, y),
                                  lax.population_count(x), lax.bitcast_convert_type(x, F32)),
                    (jnp.zeros(8, U32), jnp.zeros(8, U32))),
        "random_bits": (lambda k: jax.random.bits(k, (3, 5), jnp.uint32), (key,)),
        "uniform": (lambda k: jax.random.uniform(k, (1000,)), (key,)),
        "normal": (lambda k: jax.random.normal(k, (1000,)), (key,)),
        "split_fold_in": (lambda k: (jax.random.split(k, 3), jax.random.fold_in(k, 7)), (key,)),
    }
    for name, (fn, args) in items.items():
        text = jax.jit(fn).lower(*args).as_text()
        with open(os.path.join(out_dir, f"{name}.mlir"), "w") as f:
            f.write(text)
    return sorted(items)


# ---------------------------------------------------------------------------------------------


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "runtime", "tests", "goldens"))
    parser.add_argument("--lowered", default=None,
                        help="also dump StableHLO of representative cases into this folder")
    args = parser.parse_args()

    if jax.__version__ != JAX_VERSION:
        print(f"warning: made for jax {JAX_VERSION}, running {jax.__version__}", file=sys.stderr)
    assert jax.config.jax_default_prng_impl == "threefry2x32"
    assert jax.config.jax_threefry_partitionable, "goldens assume partitionable threefry"
    assert jnp.zeros(()).dtype == jnp.float32

    os.makedirs(args.out, exist_ok=True)
    # One generator per family, so changing one family leaves the others' data unchanged.
    random_fam, checks = random_family(np.random.default_rng(5))
    families = [conv_family(np.random.default_rng(1)), window_family(np.random.default_rng(2)),
                index_family(np.random.default_rng(3)),
                elementwise_family(np.random.default_rng(4)), random_fam,
                scan_family(np.random.default_rng(6))]
    for fam in families:
        path = fam.save(args.out)
        print(f"{os.path.relpath(path, REPO_ROOT)}: {len(fam.attrs)} cases, "
              f"{os.path.getsize(path)} bytes")
    exact = [c for c in checks if "ulp" not in c]
    print(f"NumPy re-derivation of jax.random: {len(exact)} bit-exact checks passed")
    for c in [c for c in checks if "ulp" in c] + xla_math_checks():
        print(f"  {c}")
    if args.lowered:
        names = dump_lowered(args.lowered)
        print(f"StableHLO of {len(names)} functions in {args.lowered}")


if __name__ == "__main__":
    main()
