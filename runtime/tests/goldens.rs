//! The new ops, and `scan` against `lax.scan`, held to JAX, the peer:
//! `runtime/tests/goldens/*.safetensors` hold inputs,
//! outputs and VJPs that `bench/jax_goldens.py` computed with `jax==0.10.2` (in a throwaway
//! venv; CI needs no JAX). Each case runs on the interpreter and, when a plugin is installed,
//! on XLA; floats must agree to 1e-5 (relative, plus 1e-5 absolute for the sums of
//! convolutions and windows, 1e-6 for the rest), integers and random bits exactly.
//!
//! Where JAX's Python API adds semantics on top of StableHLO, the test states the mapping:
//! `jnp.take`'s default "fill" mode gives NaN rows for out-of-range ids where nitro clamps (only
//! in-range rows and no gradient are compared for that case); `x.at[i].add` and
//! `lax.dynamic_slice` wrap negative indices once before dropping or clamping, which the test
//! does to the indices it passes to nitro.
#![allow(missing_docs)]

mod common;

use common::xla_or_skip;

use std::collections::BTreeMap;

use nitro::trace::{self, grad, random, Conv, ConvDims, ScatterDims, ScatterKind, Tensor, Window};
use nitro::{Array, ArrayData, DType, LeafType};
use serde_json::Value;

/// A traced body: the case's inputs to its outputs.
type Body<'a> = Box<dyn Fn(&[Tensor]) -> Vec<Tensor> + 'a>;

struct Golden {
    tensors: BTreeMap<String, Array>,
    cases: BTreeMap<String, Value>,
}

fn load(family: &str) -> Golden {
    let path = format!(
        "{}/tests/goldens/{family}.safetensors",
        env!("CARGO_MANIFEST_DIR")
    );
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors = BTreeMap::new();
    for (name, view) in st.tensors() {
        let data = view.data();
        let shape = view.shape().to_vec();
        let words = |n: usize| data.chunks_exact(n);
        let array = match view.dtype() {
            safetensors::Dtype::F32 => Array::from_vec(
                &shape,
                words(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect::<Vec<_>>(),
            ),
            safetensors::Dtype::I32 => Array::from_vec(
                &shape,
                words(4)
                    .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                    .collect::<Vec<_>>(),
            ),
            safetensors::Dtype::U32 => Array::from_vec(
                &shape,
                words(4)
                    .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                    .collect::<Vec<_>>(),
            ),
            safetensors::Dtype::U8 => Array::from_vec(&shape, data.to_vec()),
            other => panic!("{name}: unexpected dtype {other:?}"),
        }
        .unwrap();
        tensors.insert(name, array);
    }
    let cases = meta
        .metadata()
        .as_ref()
        .expect("golden files carry metadata")
        .iter()
        .map(|(k, v)| (k.clone(), serde_json::from_str(v).unwrap()))
        .collect();
    Golden { tensors, cases }
}

impl Golden {
    fn get(&self, case: &str, role: &str) -> Array {
        self.tensors
            .get(&format!("{case}.{role}"))
            .unwrap_or_else(|| panic!("{case}.{role} is missing"))
            .clone()
    }
    fn has(&self, case: &str, role: &str) -> bool {
        self.tensors.contains_key(&format!("{case}.{role}"))
    }
}

fn usizes(v: &Value) -> Vec<usize> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as usize)
        .collect()
}

fn pairs(v: &Value) -> Vec<(i64, i64)> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].as_i64().unwrap(), p[1].as_i64().unwrap()))
        .collect()
}

/// One comparison: `inputs` through `body` gives outputs that must match `want` (in order).
struct Check<'a> {
    case: &'a str,
    inputs: Vec<Array>,
    want: Vec<Option<Array>>,
    abs: f64,
}

fn compare(what: &str, got: &Array, want: &Array, abs: f64, failures: &mut Vec<String>) {
    if got.leaf_type() != want.leaf_type() {
        failures.push(format!(
            "{what}: got {}, JAX {}",
            got.leaf_type(),
            want.leaf_type()
        ));
        return;
    }
    match (got.data(), want.data()) {
        (ArrayData::F32(g), ArrayData::F32(w)) => {
            for (i, (&x, &y)) in g.iter().zip(w).enumerate() {
                let (x, y) = (x as f64, y as f64);
                let ok =
                    (x.is_nan() && y.is_nan()) || x == y || (x - y).abs() <= 1e-5 * y.abs() + abs;
                if !ok {
                    failures.push(format!("{what}[{i}]: nitro {x:e}, JAX {y:e}"));
                    return;
                }
            }
        }
        _ => {
            if got != want {
                failures.push(format!("{what}: differs exactly from JAX"));
            }
        }
    }
}

fn run(test: &str, checks: Vec<(Check<'_>, Body<'_>)>) {
    let xla = xla_or_skip(test);
    let mut failures = Vec::new();
    let count = checks.len();
    for (c, body) in checks {
        let types: Vec<(String, LeafType)> = c
            .inputs
            .iter()
            .enumerate()
            .map(|(i, a)| (format!("x{i}"), a.leaf_type()))
            .collect();
        let graph =
            trace::trace(&types, |x| body(x)).unwrap_or_else(|e| panic!("{test}/{}: {e}", c.case));
        let interp = nitro::backend::interp::run(&graph, &c.inputs)
            .unwrap_or_else(|e| panic!("{test}/{}: {e}", c.case));
        let mut results = vec![("interpreter", interp)];
        if let Some(xla) = xla {
            let refs: Vec<&Array> = c.inputs.iter().collect();
            match xla
                .compile(&graph, &nitro::emit::emit(&graph))
                .and_then(|e| e.run(&refs))
            {
                Ok(out) => results.push(("XLA", out)),
                Err(e) => failures.push(format!("{}: XLA failed: {e}", c.case)),
            }
        }
        for (backend, outs) in &results {
            for (k, (got, want)) in outs.iter().zip(&c.want).enumerate() {
                if let Some(want) = want {
                    compare(
                        &format!("{} ({backend}) output {k}", c.case),
                        got,
                        want,
                        c.abs,
                        &mut failures,
                    );
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{test}: {} mismatches with JAX:\n{}",
        failures.len(),
        failures.join("\n")
    );
    println!("{test}: {count} JAX cases match");
}

/// Outputs `[out, VJP of cot for each float input in wrt]`.
fn with_vjp(y: Tensor, cot: Tensor, wrt: &[Tensor]) -> Vec<Tensor> {
    let mut outs = vec![y];
    if !wrt.is_empty() {
        outs.extend(grad((y * cot).sum_all(), wrt));
    }
    outs
}

// ---- convolution ---------------------------------------------------------------------------------

#[test]
fn convolution_matches_jax() {
    let g = load("conv");
    let mut checks = Vec::new();
    for (case, meta) in &g.cases {
        let dn = meta["dimension_numbers"].as_array().unwrap();
        let dims = ConvDims::parse(
            dn[0].as_str().unwrap(),
            dn[1].as_str().unwrap(),
            dn[2].as_str().unwrap(),
        )
        .unwrap();
        let conv = Conv::new(dims)
            .strides(&usizes(&meta["window_strides"]))
            .padding(&pairs(&meta["padding"]))
            .lhs_dilation(&usizes(&meta["lhs_dilation"]))
            .rhs_dilation(&usizes(&meta["rhs_dilation"]))
            .feature_groups(meta["feature_group_count"].as_u64().unwrap() as usize);
        let c = Check {
            case,
            inputs: vec![g.get(case, "lhs"), g.get(case, "rhs"), g.get(case, "cot")],
            want: vec![
                Some(g.get(case, "out")),
                Some(g.get(case, "grad_lhs")),
                Some(g.get(case, "grad_rhs")),
            ],
            abs: 1e-5,
        };
        let body: Body<'static> =
            Box::new(move |x| with_vjp(x[0].conv(x[1], &conv), x[2], &[x[0], x[1]]));
        checks.push((c, body));
    }
    assert_eq!(checks.len(), 12);
    run("conv", checks);
}

// ---- windows ---------------------------------------------------------------------------------

#[test]
fn reduce_window_matches_jax() {
    let g = load("window");
    let mut checks = Vec::new();
    for (case, meta) in &g.cases {
        let w = Window::new(&usizes(&meta["window_dimensions"]))
            .strides(&usizes(&meta["window_strides"]))
            .padding(&pairs(&meta["padding"]))
            .window_dilation(&usizes(&meta["window_dilation"]))
            .base_dilation(&usizes(&meta["base_dilation"]));
        let kind = meta["kind"].as_str().unwrap().to_owned();
        let c = Check {
            case,
            inputs: vec![g.get(case, "x"), g.get(case, "cot")],
            want: vec![Some(g.get(case, "out")), Some(g.get(case, "grad_x"))],
            abs: 1e-5,
        };
        let body: Body<'static> = Box::new(move |x| {
            let y = match kind.as_str() {
                "sum" => x[0].window_sum(&w),
                "max" => x[0].window_max(&w),
                _ => x[0].window_min(&w),
            };
            with_vjp(y, x[1], &[x[0]])
        });
        checks.push((c, body));
    }
    assert_eq!(checks.len(), 8);
    run("window", checks);
}

// ---- indexing ----------------------------------------------------------------------------------

/// `v` with negative entries wrapped once by `dim` (what JAX's Python API does first).
fn wrapped(a: &Array, dim: i32) -> Array {
    let v: Vec<i32> = a
        .as_slice::<i32>()
        .unwrap()
        .iter()
        .map(|&i| if i < 0 { i + dim } else { i })
        .collect();
    Array::from_vec(a.dims(), v).unwrap()
}

/// Each start wrapped once by its dim, as `lax.dynamic_slice` does before clamping.
fn wrapped_starts(a: &Array, dims: &[usize]) -> Vec<Array> {
    a.as_slice::<i32>()
        .unwrap()
        .iter()
        .zip(dims)
        .map(|(&s, &d)| Array::scalar(if s < 0 { s + d as i32 } else { s }))
        .collect()
}

#[test]
fn indexing_matches_jax() {
    let g = load("index");
    let mut checks: Vec<(Check<'_>, Body<'static>)> = Vec::new();
    for (case, meta) in &g.cases {
        let op = meta["op"].as_str().unwrap();
        let axis = meta.get("axis").and_then(Value::as_i64).unwrap_or(0);
        match op {
            "take" => {
                let table = g.get(case, "table");
                let ids = g.get(case, "ids");
                let axis = axis as usize;
                let n = table.dims()[axis] as i32;
                let fill = meta["mode"] == "fill";
                let oob = ids
                    .as_slice::<i32>()
                    .unwrap()
                    .iter()
                    .any(|&i| i < -n || i >= n);
                // "fill" wraps negative ids (NumPy style) before its range check.
                let ids = if fill { wrapped(&ids, n) } else { ids };
                let (want, wrt) = if fill && oob {
                    // JAX gives NaN rows (and no gradient) where nitro clamps: the test keeps
                    // the in-range rows only, below.
                    (vec![None], false)
                } else {
                    (
                        vec![Some(g.get(case, "out")), Some(g.get(case, "grad_table"))],
                        true,
                    )
                };
                if fill && oob {
                    in_range_rows_match(&table, &ids, &g.get(case, "out"));
                }
                let c = Check {
                    case,
                    inputs: vec![table, ids, g.get(case, "cot")],
                    want,
                    abs: 1e-6,
                };
                checks.push((
                    c,
                    Box::new(move |x| {
                        let y = x[0].take(x[1], axis);
                        if wrt {
                            with_vjp(y, x[2], &[x[0]])
                        } else {
                            vec![y]
                        }
                    }),
                ));
            }
            "take_along_axis" => {
                let c = Check {
                    case,
                    inputs: vec![g.get(case, "x"), g.get(case, "idx"), g.get(case, "cot")],
                    want: vec![Some(g.get(case, "out")), Some(g.get(case, "grad_x"))],
                    abs: 1e-6,
                };
                checks.push((
                    c,
                    Box::new(|x| with_vjp(x[0].take_along_axis(x[1], 1), x[2], &[x[0]])),
                ));
            }
            "scatter_add" | "scatter_set" => {
                let x = g.get(case, "x");
                let rows = x.dims()[0] as i32;
                let idx = g.get(case, "idx");
                // JAX wraps negative indices, then drops (or, in "clip" mode, clamps) the rest.
                let idx = if meta["mode"] == "clip" {
                    let v: Vec<i32> = wrapped(&idx, rows)
                        .as_slice::<i32>()
                        .unwrap()
                        .iter()
                        .map(|&i| i.clamp(0, rows - 1))
                        .collect();
                    Array::from_vec(idx.dims(), v).unwrap()
                } else {
                    wrapped(&idx, rows)
                };
                let kind = if op == "scatter_add" {
                    ScatterKind::Add
                } else {
                    ScatterKind::Replace
                };
                let c = Check {
                    case,
                    inputs: vec![x, idx, g.get(case, "upd"), g.get(case, "cot")],
                    want: vec![
                        Some(g.get(case, "out")),
                        Some(g.get(case, "grad_x")),
                        Some(g.get(case, "grad_upd")),
                    ],
                    abs: 1e-6,
                };
                checks.push((
                    c,
                    Box::new(move |x| {
                        let d = ScatterDims {
                            update_window_dims: vec![1],
                            inserted_window_dims: vec![0],
                            scatter_dims_to_operand_dims: vec![0],
                            index_vector_dim: 1,
                        };
                        with_vjp(x[0].scatter(x[1], x[2], &d, kind), x[3], &[x[0], x[2]])
                    }),
                ));
            }
            "dynamic_slice" => {
                let x = g.get(case, "x");
                let starts = wrapped_starts(&g.get(case, "starts"), x.dims());
                let sizes = usizes(&meta["sizes"]);
                let mut inputs = vec![x, g.get(case, "cot")];
                inputs.extend(starts);
                let c = Check {
                    case,
                    inputs,
                    want: vec![Some(g.get(case, "out")), Some(g.get(case, "grad_x"))],
                    abs: 1e-6,
                };
                checks.push((
                    c,
                    Box::new(move |x| with_vjp(x[0].dynamic_slice(&x[2..], &sizes), x[1], &[x[0]])),
                ));
            }
            "dynamic_update_slice" => {
                let x = g.get(case, "x");
                let starts = wrapped_starts(&g.get(case, "starts"), x.dims());
                let mut inputs = vec![x, g.get(case, "upd"), g.get(case, "cot")];
                inputs.extend(starts);
                let c = Check {
                    case,
                    inputs,
                    want: vec![
                        Some(g.get(case, "out")),
                        Some(g.get(case, "grad_x")),
                        Some(g.get(case, "grad_upd")),
                    ],
                    abs: 1e-6,
                };
                checks.push((
                    c,
                    Box::new(|x| {
                        with_vjp(
                            x[0].dynamic_update_slice(x[1], &x[3..]),
                            x[2],
                            &[x[0], x[1]],
                        )
                    }),
                ));
            }
            other => panic!("{case}: unknown op {other}"),
        }
    }
    assert_eq!(checks.len(), 17);
    run("index", checks);
}

/// For JAX's "fill" mode with out-of-range ids: the rows of in-range ids match a row-by-row
/// lookup on the host, and JAX's other rows are NaN.
fn in_range_rows_match(table: &Array, ids: &Array, jax_out: &Array) {
    let width = table.dims()[1];
    let t = table.as_slice::<f32>().unwrap();
    let out = jax_out.as_slice::<f32>().unwrap();
    for (r, &i) in ids.as_slice::<i32>().unwrap().iter().enumerate() {
        let row = &out[r * width..(r + 1) * width];
        if i >= 0 && (i as usize) < table.dims()[0] {
            assert_eq!(row, &t[i as usize * width..(i as usize + 1) * width]);
        } else {
            assert!(
                row.iter().all(|x| x.is_nan()),
                "JAX's fill mode gives NaN rows"
            );
        }
    }
}

// ---- element-wise ------------------------------------------------------------------------------

#[test]
fn elementwise_matches_jax() {
    let g = load("elementwise");
    let mut checks: Vec<(Check<'_>, Body<'static>)> = Vec::new();
    for (case, meta) in &g.cases {
        let op = meta["op"].as_str().unwrap().to_owned();
        let mut inputs = vec![];
        for role in ["lo", "x", "y", "hi"] {
            if g.has(case, role) {
                let mut a = g.get(case, role);
                // XLA:CPU flushes subnormal inputs to zero (`sign(1e-45)` is 0 there); the
                // interpreter keeps IEEE subnormals. Compare on what both see: zero. (A
                // bitcast keeps the bits on both.)
                if let (Ok(v), false) = (a.as_slice_mut::<f32>(), op == "bitcast_convert") {
                    for x in v.iter_mut().filter(|x| x.is_subnormal()) {
                        *x = 0.0f32.copysign(*x);
                    }
                }
                // Scalar bounds are stored as [1]: pass them as scalars.
                inputs.push(if a.dims() == [1] && op == "clamp" {
                    Array::from_data(&[], a.data().clone()).unwrap()
                } else {
                    a
                });
            }
        }
        let n = inputs.len();
        let mut want = vec![Some(g.get(case, "out"))];
        let has_cot = g.has(case, "cot");
        let mut wrt = Vec::new();
        if has_cot {
            inputs.push(g.get(case, "cot"));
            for (k, role) in ["lo", "x", "y", "hi"]
                .iter()
                .filter(|r| g.has(case, r))
                .enumerate()
            {
                if g.has(case, &format!("grad_{role}")) {
                    want.push(Some(g.get(case, &format!("grad_{role}"))));
                    wrt.push(k);
                }
            }
        }
        let body: Body<'static> = Box::new(move |x| {
            let y = match op.as_str() {
                "erf" => x[0].erf(),
                "erf_inv" => x[0].erf_inv(),
                "sin" => x[0].sin(),
                "cos" => x[0].cos(),
                "log1p" => x[0].log1p(),
                "expm1" => x[0].expm1(),
                "sign" => x[0].sign(),
                "floor" => x[0].floor(),
                "ceil" => x[0].ceil(),
                "round" => x[0].round_nearest_even(),
                "atan2" => x[0].atan2(x[1]),
                "rem" => x[0] % x[1],
                "clamp" => Tensor::clamp(x[0], x[1], x[2]),
                "and" => x[0].and(x[1]),
                "or" => x[0].or(x[1]),
                "xor" => x[0].xor(x[1]),
                "not" => !x[0],
                "popcnt" => x[0].popcnt(),
                "shift_left" => x[0].shift_left(x[1]),
                "shift_right_logical" => x[0].shift_right_logical(x[1]),
                "shift_right_arithmetic" => x[0].shift_right_arithmetic(x[1]),
                "bitcast_convert" if x[0].dtype() == DType::F32 => x[0].bitcast_convert(DType::U32),
                "bitcast_convert" => x[0].bitcast_convert(DType::F32),
                other => panic!("unknown op {other}"),
            };
            if has_cot {
                let xs: Vec<Tensor> = wrt.iter().map(|&k| x[k]).collect();
                with_vjp(y, x[n], &xs)
            } else {
                vec![y]
            }
        });
        checks.push((
            Check {
                case,
                inputs,
                want,
                abs: 1e-6,
            },
            body,
        ));
    }
    assert_eq!(checks.len(), 27);
    run("elementwise", checks);
}

// ---- random ------------------------------------------------------------------------------------

#[test]
fn threefry_and_samplers_match_jax_bit_for_bit() {
    let g = load("random");
    let mut checks: Vec<(Check<'_>, Body<'static>)> = Vec::new();
    for (case, meta) in &g.cases {
        let op = meta["op"].as_str().unwrap();
        if op == "prng_key" {
            let seed = meta["seed"].as_u64().unwrap();
            assert_eq!(random::key(seed), g.get(case, "out"), "{case}");
            continue;
        }
        if op == "threefry2x32" {
            let key = g.get(case, "key");
            let k = key.as_slice::<u32>().unwrap();
            let count = g.get(case, "count");
            let c = count.as_slice::<u32>().unwrap().to_vec();
            // JAX's raw function: the counters (padded to even) split in halves as (x0, x1).
            let mut padded = c.clone();
            if padded.len() % 2 == 1 {
                padded.push(0);
            }
            let half = padded.len() / 2;
            let mut host = vec![0u32; padded.len()];
            for i in 0..half {
                let y = random::threefry2x32_host([k[0], k[1]], [padded[i], padded[half + i]]);
                host[i] = y[0];
                host[half + i] = y[1];
            }
            assert_eq!(
                &host[..c.len()],
                g.get(case, "out").as_slice::<u32>().unwrap(),
                "{case} on the host"
            );
            let x0 = Array::from_vec(&[half], padded[..half].to_vec()).unwrap();
            let x1 = Array::from_vec(&[half], padded[half..].to_vec()).unwrap();
            let want = Array::from_vec(&[padded.len()], host).unwrap();
            checks.push((
                Check {
                    case,
                    inputs: vec![key, x0, x1],
                    want: vec![Some(want)],
                    abs: 0.0,
                },
                Box::new(|x| {
                    let (y0, y1) = random::threefry2x32(x[0], x[1], x[2]);
                    vec![Tensor::concatenate(&[y0, y1], 0)]
                }),
            ));
            continue;
        }
        let key = g.get(case, "key");
        assert_eq!(
            key,
            random::key(meta["seed"].as_u64().unwrap()),
            "{case}: the key is PRNGKey(seed)"
        );
        let shape = meta.get("shape").map(usizes).unwrap_or_default();
        let want = g.get(case, "out");
        let body: Body<'static> = match op {
            "random_bits" => Box::new(move |x| vec![random::bits(x[0], &shape)]),
            "split" => {
                let n = meta["num"].as_u64().unwrap() as usize;
                Box::new(move |x| vec![random::split(x[0], n)])
            }
            "fold_in" => {
                let d = meta["data"].as_u64().unwrap() as u32;
                Box::new(move |x| vec![random::fold_in(x[0], Tensor::constant(Array::scalar(d)))])
            }
            "uniform" => {
                let (lo, hi) = (
                    meta["minval"].as_f64().unwrap(),
                    meta["maxval"].as_f64().unwrap(),
                );
                Box::new(move |x| vec![random::uniform(x[0], &shape, DType::F32, lo, hi)])
            }
            "normal" => Box::new(move |x| vec![random::normal(x[0], &shape)]),
            "bernoulli" => {
                let p = meta["p"].as_f64().unwrap();
                Box::new(move |x| vec![random::bernoulli(x[0], p, &shape).convert(DType::U8)])
            }
            other => panic!("{case}: unknown op {other}"),
        };
        // Samples are floats: within 1e-5 (XLA fuses the uniform's scale and shift into one
        // multiply-add, which the interpreter rounds twice); bits are compared exactly.
        checks.push((
            Check {
                case,
                inputs: vec![key],
                want: vec![Some(want)],
                abs: 1e-6,
            },
            body,
        ));
    }
    assert_eq!(checks.len(), 4 * 11 + 5);
    run("random", checks);
}

// ---- scan --------------------------------------------------------------------------------------

/// Flattened and joined, as the JAX cases return a scan's carry and outputs.
fn joined(parts: &[Tensor]) -> Tensor {
    let flat: Vec<Tensor> = parts
        .iter()
        .map(|p| p.reshape(&[p.dims().iter().product()]))
        .collect();
    Tensor::concatenate(&flat, 0)
}

/// One golden scan case as nitro code, with the remat policy to differentiate it with.
fn scan_case(case: &str, x: &[Tensor], remat: trace::Remat) -> Tensor {
    use trace::Scan;
    let scan = Scan::new().remat(remat);
    match case {
        "rnn" | "one_step" => {
            let (w, u, b) = (x[2], x[3], x[4]);
            let (c, ys) = scan.run(&[x[0]], &[x[1]], |c, xt| {
                let h = (c[0].matmul(w) + xt[0].matmul(u) + b).tanh();
                (vec![h], vec![h.sin()])
            });
            joined(&[c[0], ys[0]])
        }
        "reverse" => {
            let (c, ys) = scan.reverse(true).run(&[x[0]], &[x[1]], |c, xt| {
                let c = c[0] * xt[0] + 0.1;
                (vec![c], vec![c])
            });
            joined(&[c[0], ys[0]])
        }
        "nested" => {
            let w = x[2];
            let (c, ys) = scan.run(&[x[0]], &[x[1]], |c, xo| {
                let (s, ys) = scan.run(&[c[0]], &[xo[0]], |s, xr| {
                    let s = s[0] * 0.9 + (xr[0] * w).tanh();
                    (vec![s], vec![s * s])
                });
                (vec![s[0] + c[0]], vec![ys[0]])
            });
            joined(&[c[0], ys[0]])
        }
        "layers" => {
            let (c, _) = scan.run(&[x[0]], &[x[1], x[2]], |c, p| {
                (vec![c[0] + (c[0].matmul(p[0]) + p[1]).tanh()], vec![])
            });
            joined(&[c[0]])
        }
        "counter" => {
            let zero = Tensor::constant(Array::scalar(0i32));
            let (c, ys) = scan.run(&[zero, x[0]], &[x[1]], |c, xt| {
                let v = c[1] * xt[0].cos() + c[0].convert(DType::F32);
                (vec![c[0] + 1.0, v], vec![v])
            });
            joined(&[c[1], ys[0]])
        }
        other => panic!("no nitro code for scan case {other}"),
    }
}

#[test]
fn scan_matches_jax_lax_scan() {
    let g = load("scan");
    let names: &[(&str, &[&str])] = &[
        ("rnn", &["h0", "xs", "w", "u", "b"]),
        ("one_step", &["h0", "xs", "w", "u", "b"]),
        ("reverse", &["c0", "xs"]),
        ("nested", &["c0", "xs", "w"]),
        ("layers", &["x0", "ws", "bs"]),
        ("counter", &["x0", "xs"]),
    ];
    assert_eq!(g.cases.len(), names.len());
    let mut checks = Vec::new();
    for remat in [trace::Remat::Save, trace::Remat::Recompute] {
        for &(case, inputs) in names {
            let mut arrays: Vec<Array> = inputs.iter().map(|i| g.get(case, i)).collect();
            arrays.push(g.get(case, "cot"));
            let mut want = vec![Some(g.get(case, "out"))];
            want.extend(
                inputs
                    .iter()
                    .map(|i| Some(g.get(case, &format!("grad_{i}")))),
            );
            let c = Check {
                case,
                inputs: arrays,
                want,
                abs: 1e-6,
            };
            let n = inputs.len();
            let body: Body<'static> = Box::new(move |x| {
                let y = scan_case(case, &x[..n], remat);
                with_vjp(y, x[n], &x[..n])
            });
            checks.push((c, body));
        }
    }
    run("scan", checks);
}
