//! `scan` against the same loop unrolled: forward values bit-equal on the interpreter and within
//! 1e-6 on XLA; the reverse pass (both remat policies) against the unrolled reverse pass and
//! against central finite differences in f64; nested scans, integer and zero-size carry parts,
//! trip counts of 1 and 0, loops run backwards; the errors a body can make; and what the
//! program text holds (one function per body, the trip count and the policy in the fingerprint).
#![allow(missing_docs)]

mod common;

use common::xla_or_skip;
use nitro::backend::interp;
use nitro::trace::{self, grad, trace, Remat, Scan, Tensor};
use nitro::{emit, Array, ArrayData, DType, LeafType};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
    fn array(&mut self, dtype: DType, dims: &[usize]) -> Array {
        let n = dims.iter().product();
        let v: Vec<f64> = (0..n).map(|_| self.next() - 0.5).collect();
        match dtype {
            DType::F64 => Array::from_vec(dims, v).unwrap(),
            _ => Array::from_vec(dims, v.iter().map(|&x| x as f32).collect::<Vec<_>>()).unwrap(),
        }
    }
}

/// How a case's loops run.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Form {
    Scanned(Remat),
    Unrolled,
}

type Body<'a> = &'a dyn Fn(&[Tensor], &[Tensor]) -> (Vec<Tensor>, Vec<Tensor>);

/// The loop `body` over `xs` from `init`, as a scan or unrolled by hand (slicing each row,
/// stacking each output with `concatenate`).
fn looped(
    form: Form,
    length: usize,
    reverse: bool,
    init: &[Tensor],
    xs: &[Tensor],
    body: Body<'_>,
) -> (Vec<Tensor>, Vec<Tensor>) {
    if let Form::Scanned(remat) = form {
        return Scan::new()
            .length(length)
            .reverse(reverse)
            .remat(remat)
            .run(init, xs, |c, x| body(c, x));
    }
    let mut carry = init.to_vec();
    let mut rows: Vec<(usize, Vec<Tensor>)> = Vec::new();
    for step in 0..length {
        let t = if reverse { length - 1 - step } else { step };
        let x: Vec<Tensor> = xs
            .iter()
            .map(|x| {
                let d = x.dims();
                x.narrow(0, t, 1).reshape(&d[1..])
            })
            .collect();
        let (c, y) = body(&carry, &x);
        carry = c;
        rows.push((t, y));
    }
    rows.sort_by_key(|(t, _)| *t);
    let ys = match rows.first() {
        // No iterations: outputs with no rows, of the types one iteration would give.
        None => {
            let x: Vec<Tensor> = xs
                .iter()
                .map(|x| Tensor::scalar(0.0, x.dtype()).broadcast_to(&x.dims()[1..]))
                .collect();
            let (_, y) = body(&carry, &x);
            y.iter()
                .map(|y| {
                    let mut d = vec![0];
                    d.extend(y.dims());
                    Tensor::scalar(0.0, y.dtype()).broadcast_to(&d)
                })
                .collect()
        }
        Some((_, first)) => (0..first.len())
            .map(|j| {
                let parts: Vec<Tensor> = rows
                    .iter()
                    .map(|(_, y)| {
                        let mut d = vec![1];
                        d.extend(y[j].dims());
                        y[j].reshape(&d)
                    })
                    .collect();
                Tensor::concatenate(&parts, 0)
            })
            .collect(),
    };
    (carry, ys)
}

/// A case: named inputs (the float ones are differentiated) and its function of them.
struct Case {
    name: &'static str,
    inputs: Vec<(&'static str, LeafType)>,
    f: fn(Form, &[Tensor]) -> Vec<Tensor>,
}

fn t(dtype: DType, dims: &[usize]) -> LeafType {
    LeafType {
        dtype,
        dims: dims.to_vec(),
    }
}

fn cases(dtype: DType) -> Vec<Case> {
    let d = dtype;
    vec![
        Case {
            name: "rnn",
            inputs: vec![
                ("h0", t(d, &[2, 4])),
                ("xs", t(d, &[6, 2, 4])),
                ("w", t(d, &[4, 4])),
                ("u", t(d, &[4, 4])),
                ("b", t(d, &[4])),
            ],
            f: |form, i| {
                let (w, u, b) = (i[2], i[3], i[4]);
                let body = |c: &[Tensor], x: &[Tensor]| {
                    let h = (c[0].matmul(w) + x[0].matmul(u) + b).tanh();
                    (vec![h], vec![h.sin()])
                };
                let (c, ys) = looped(form, 6, false, &[i[0]], &[i[1]], &body);
                vec![c[0], ys[0]]
            },
        },
        Case {
            name: "reverse",
            inputs: vec![("c0", t(d, &[3])), ("xs", t(d, &[5, 3]))],
            f: |form, i| {
                let body = |c: &[Tensor], x: &[Tensor]| {
                    let c = c[0] * x[0] + 0.1;
                    (vec![c], vec![c])
                };
                let (c, ys) = looped(form, 5, true, &[i[0]], &[i[1]], &body);
                vec![c[0], ys[0]]
            },
        },
        Case {
            name: "nested",
            inputs: vec![
                ("c0", t(d, &[2])),
                ("xs", t(d, &[3, 4, 2])),
                ("w", t(d, &[2])),
            ],
            f: |form, i| {
                let w = i[2];
                let outer = |c: &[Tensor], xo: &[Tensor]| {
                    let inner = |s: &[Tensor], xr: &[Tensor]| {
                        let s = s[0] * 0.9 + (xr[0] * w).tanh();
                        (vec![s], vec![s * s])
                    };
                    let (s, ys) = looped(form, 4, false, &[c[0]], &[xo[0]], &inner);
                    (vec![s[0] + c[0]], vec![ys[0]])
                };
                let (c, ys) = looped(form, 3, false, &[i[0]], &[i[1]], &outer);
                vec![c[0], ys[0]]
            },
        },
        Case {
            name: "layers",
            inputs: vec![
                ("x0", t(d, &[2, 4])),
                ("ws", t(d, &[3, 4, 4])),
                ("bs", t(d, &[3, 4])),
            ],
            f: |form, i| {
                let body = |c: &[Tensor], p: &[Tensor]| {
                    (vec![c[0] + (c[0].matmul(p[0]) + p[1]).tanh()], vec![])
                };
                let (c, _) = looped(form, 3, false, &[i[0]], &[i[1], i[2]], &body);
                vec![c[0]]
            },
        },
        Case {
            name: "counter",
            inputs: vec![("x0", t(d, &[3])), ("xs", t(d, &[4, 3]))],
            f: |form, i| {
                let zero = Tensor::constant(Array::scalar(0i32));
                let body = |c: &[Tensor], x: &[Tensor]| {
                    let (n, v) = (c[0], c[1]);
                    let v = v * x[0].cos() + n.convert(v.dtype());
                    (vec![n + 1.0, v], vec![v])
                };
                let (c, ys) = looped(form, 4, false, &[zero, i[0]], &[i[1]], &body);
                vec![c[0], c[1], ys[0]]
            },
        },
        Case {
            name: "zero_size_parts",
            inputs: vec![
                ("h0", t(d, &[3])),
                ("e0", t(d, &[0, 2])),
                ("xs", t(d, &[4, 3])),
                ("zs", t(d, &[4, 0])),
            ],
            f: |form, i| {
                let body = |c: &[Tensor], x: &[Tensor]| {
                    let h = (c[0] * x[0]).tanh() + c[1].sum_all() + x[1].sum_all();
                    (vec![h, c[1] * 2.0], vec![h, x[1] + 1.0, c[1]])
                };
                let (c, ys) = looped(form, 4, false, &[i[0], i[1]], &[i[2], i[3]], &body);
                vec![c[0], c[1], ys[0], ys[1], ys[2]]
            },
        },
        Case {
            name: "one_step",
            inputs: vec![("h0", t(d, &[2])), ("xs", t(d, &[1, 2])), ("w", t(d, &[2]))],
            f: |form, i| {
                let w = i[2];
                let body = |c: &[Tensor], x: &[Tensor]| {
                    let h = (c[0] * w + x[0]).logistic();
                    (vec![h], vec![h * x[0]])
                };
                let (c, ys) = looped(form, 1, false, &[i[0]], &[i[1]], &body);
                vec![c[0], ys[0]]
            },
        },
        Case {
            name: "no_steps",
            inputs: vec![("h0", t(d, &[2])), ("xs", t(d, &[0, 2])), ("w", t(d, &[2]))],
            f: |form, i| {
                let w = i[2];
                let body = |c: &[Tensor], x: &[Tensor]| {
                    let h = (c[0] * w + x[0]).logistic();
                    (vec![h], vec![h * x[0]])
                };
                let (c, ys) = looped(form, 0, false, &[i[0]], &[i[1]], &body);
                vec![c[0] * w, ys[0]]
            },
        },
    ]
}

/// The case's outputs, then the gradient of Σ_k Σ (output_k ⊙ weights_k) with respect to each
/// float input.
fn graph(c: &Case, form: Form) -> nitro::trace::Graph {
    let types: Vec<(String, LeafType)> = c
        .inputs
        .iter()
        .map(|(n, t)| (n.to_string(), t.clone()))
        .collect();
    trace(&types, |i| {
        let outs = (c.f)(form, i);
        let mut loss: Option<Tensor> = None;
        for (k, o) in outs.iter().enumerate() {
            if !o.dtype().is_float() {
                continue;
            }
            let w = Rng(100 + k as u64).array(o.dtype(), &o.dims());
            let term = (*o * Tensor::constant(w)).sum_all();
            loss = Some(match loss {
                Some(l) => l + term,
                None => term,
            });
        }
        let wrt: Vec<Tensor> = i.iter().copied().filter(|x| x.dtype().is_float()).collect();
        let mut all = outs.clone();
        if let Some(loss) = loss {
            all.push(loss);
            all.extend(grad(loss, &wrt));
        }
        all
    })
    .unwrap_or_else(|e| panic!("{} ({form:?}): {e}", c.name))
}

fn inputs(c: &Case, seed: u64) -> Vec<Array> {
    let mut rng = Rng(seed);
    c.inputs
        .iter()
        .map(|(_, t)| rng.array(t.dtype, &t.dims))
        .collect()
}

fn values(a: &Array) -> Vec<f64> {
    match a.data() {
        ArrayData::F32(v) => v.iter().map(|&x| x as f64).collect(),
        ArrayData::F64(v) => v.clone(),
        ArrayData::I32(v) => v.iter().map(|&x| x as f64).collect(),
        other => panic!("unexpected {:?}", other.dtype()),
    }
}

fn close(what: &str, got: &Array, want: &Array, rel: f64, abs: f64) {
    assert_eq!(got.leaf_type(), want.leaf_type(), "{what}");
    for (i, (x, y)) in values(got).iter().zip(values(want)).enumerate() {
        assert!(
            (x - y).abs() <= rel * y.abs() + abs,
            "{what}[{i}]: {x:e} vs {y:e}"
        );
    }
}

const POLICIES: [Remat; 2] = [Remat::Save, Remat::Recompute];

#[test]
fn forward_is_bit_equal_to_the_unrolled_loop_on_the_interpreter() {
    for c in cases(DType::F32) {
        let x = inputs(&c, 1);
        let unrolled = interp::run(&graph(&c, Form::Unrolled), &x).unwrap();
        for remat in POLICIES {
            let scanned = interp::run(&graph(&c, Form::Scanned(remat)), &x).unwrap();
            // The forward outputs (everything before the loss) are the same bits.
            let n = forward_outputs(&c);
            assert_eq!(
                &scanned[..n],
                &unrolled[..n],
                "{} ({remat:?}): forward differs from the unrolled loop",
                c.name
            );
        }
    }
}

/// How many outputs a case's function returns (traced once to count them).
fn forward_outputs(c: &Case) -> usize {
    let types: Vec<(String, LeafType)> = c
        .inputs
        .iter()
        .map(|(n, t)| (n.to_string(), t.clone()))
        .collect();
    trace(&types, |i| (c.f)(Form::Unrolled, i))
        .unwrap()
        .outputs
        .len()
}

#[test]
fn reverse_pass_matches_the_unrolled_reverse_pass_and_finite_differences() {
    for c in cases(DType::F64) {
        let x = inputs(&c, 2);
        let n = forward_outputs(&c);
        let unrolled = interp::run(&graph(&c, Form::Unrolled), &x).unwrap();
        let float: Vec<usize> = (0..x.len()).filter(|&k| x[k].dtype().is_float()).collect();
        for remat in POLICIES {
            let g = graph(&c, Form::Scanned(remat));
            let scanned = interp::run(&g, &x).unwrap();
            for (k, (s, u)) in scanned.iter().zip(&unrolled).enumerate().skip(n) {
                close(
                    &format!("{} ({remat:?}) output {k}", c.name),
                    s,
                    u,
                    1e-12,
                    1e-12,
                );
            }
            // Central differences of the loss (output n) for every element of every float input.
            let loss = |x: &[Array]| values(&interp::run(&g, x).unwrap()[n])[0];
            let h = 1e-6;
            for (w, &input) in float.iter().enumerate() {
                let analytic = values(&scanned[n + 1 + w]);
                for (e, &want) in analytic.iter().enumerate() {
                    let mut plus = x.clone();
                    let mut minus = x.clone();
                    plus[input].as_slice_mut::<f64>().unwrap()[e] += h;
                    minus[input].as_slice_mut::<f64>().unwrap()[e] -= h;
                    let numeric = (loss(&plus) - loss(&minus)) / (2.0 * h);
                    assert!(
                        (want - numeric).abs() <= 1e-6 + 1e-6 * numeric.abs(),
                        "{} ({remat:?}) d/d{}[{e}]: analytic {want:e}, numeric {numeric:e}",
                        c.name,
                        c.inputs[input].0,
                    );
                }
            }
        }
    }
}

#[test]
fn xla_runs_the_scans_as_the_interpreter_does() {
    let Some(xla) = xla_or_skip("xla_runs_the_scans_as_the_interpreter_does") else {
        return;
    };
    for c in cases(DType::F32) {
        let x = inputs(&c, 3);
        let refs: Vec<&Array> = x.iter().collect();
        let n = forward_outputs(&c);
        let want = interp::run(&graph(&c, Form::Unrolled), &x).unwrap();
        for remat in POLICIES {
            let g = graph(&c, Form::Scanned(remat));
            let text = emit::emit(&g);
            let got = xla
                .compile(&g, &text)
                .and_then(|e| e.run(&refs))
                .unwrap_or_else(|e| panic!("{} ({remat:?}): {e}", c.name));
            for (k, (a, b)) in got.iter().zip(&want).enumerate() {
                let (rel, abs) = if k < n { (1e-6, 1e-7) } else { (1e-5, 1e-6) };
                close(
                    &format!("{} ({remat:?}) XLA output {k}", c.name),
                    a,
                    b,
                    rel,
                    abs,
                );
            }
        }
    }
}

#[test]
fn the_body_is_one_function_and_the_trip_count_and_policy_reach_the_fingerprint() {
    let layers = |n: usize, remat: Remat| {
        let types = vec![
            ("x".to_string(), t(DType::F32, &[2, 4])),
            ("ws".to_string(), t(DType::F32, &[n, 4, 4])),
        ];
        trace(&types, |i| {
            let (c, _) = Scan::new().remat(remat).run(&[i[0]], &[i[1]], |c, w| {
                (vec![c[0] + c[0].matmul(w[0]).tanh()], vec![])
            });
            let loss = c[0].sum_all();
            let mut out = vec![loss];
            out.extend(grad(loss, &[i[1]]));
            out
        })
        .unwrap()
    };
    let text = emit::emit(&layers(3, Remat::Save));
    // The forward body and the backward body, each once, called from a while loop each.
    assert_eq!(text.matches("func.func private @scan").count(), 2, "{text}");
    assert_eq!(text.matches("stablehlo.while").count(), 2);
    // The layer's tanh is written once in the forward body, and once more where the backward
    // body recomputes it (an element-wise value, not stacked).
    assert_eq!(text.matches("stablehlo.tanh").count(), 2, "{text}");
    // The program does not grow with the trip count.
    let deep = emit::emit(&layers(24, Remat::Save));
    let lines = |s: &str| s.lines().count();
    assert_eq!(lines(&text), lines(&deep));
    assert_eq!(deep.matches("stablehlo.tanh").count(), 2);
    let print = |g: &nitro::trace::Graph| emit::fingerprint(&emit::emit(g));
    assert_ne!(
        print(&layers(3, Remat::Save)),
        print(&layers(24, Remat::Save))
    );
    assert_ne!(
        print(&layers(3, Remat::Save)),
        print(&layers(3, Remat::Recompute))
    );
    assert_eq!(
        print(&layers(3, Remat::Save)),
        print(&layers(3, Remat::Save))
    );
}

fn trace_err(body: impl FnOnce(&[Tensor]) -> Vec<Tensor>) -> String {
    let types = vec![
        ("h".to_string(), t(DType::F32, &[3])),
        ("xs".to_string(), t(DType::F32, &[4, 3])),
    ];
    trace(&types, body).unwrap_err().to_string()
}

#[test]
fn mistakes_in_a_scan_fail_the_trace_with_what_to_do() {
    let e = trace_err(|i| {
        let (c, _) = Scan::new().run(&[i[0]], &[i[1]], |c, _| (vec![c[0].sum_all()], vec![]));
        c
    });
    assert!(
        e.contains("new carry 0 is f32[]") && e.contains("f32[3]"),
        "{e}"
    );
    assert!(e.contains(file!()), "{e}");

    let e = trace_err(|i| {
        let (c, _) = Scan::new().run(&[i[0]], &[], |c, _| (vec![c[0]], vec![]));
        c
    });
    assert!(e.contains("Scan::new().length(n)"), "{e}");

    let e = trace_err(|i| {
        let (c, _) = Scan::new()
            .length(5)
            .run(&[i[0]], &[i[1]], |c, _| (vec![c[0]], vec![]));
        c
    });
    assert!(e.contains("has 4 rows but the trip count is 5"), "{e}");

    let e = trace_err(|i| {
        let (c, _) = Scan::new().run(&[i[0]], &[i[0].sum_all()], |c, _| (vec![c[0]], vec![]));
        c
    });
    assert!(e.contains("needs a leading axis"), "{e}");

    let e = trace_err(|i| {
        let (c, _) = Scan::new().run(&[i[0]], &[i[1]], |c, x| (vec![c[0], x[0]], vec![]));
        c
    });
    assert!(
        e.contains("returned 2 carried values for a carry of 1"),
        "{e}"
    );

    // A tensor kept from inside a body and used after it.
    let e = trace_err(|i| {
        let mut kept = None;
        let (c, _) = Scan::new().run(&[i[0]], &[i[1]], |c, x| {
            let y = c[0] + x[0];
            kept = Some(y);
            (vec![y], vec![])
        });
        vec![c[0] + kept.unwrap()]
    });
    assert!(
        e.contains("made inside a scan body was used outside it"),
        "{e}"
    );

    // A program input created inside a body.
    let e = trace_err(|i| {
        let (c, _) = Scan::new().run(&[i[0]], &[i[1]], |c, _| {
            let extra = trace::input("extra", t(DType::F32, &[3]));
            (vec![c[0] + extra], vec![])
        });
        c
    });
    assert!(e.contains("created inside a scan body"), "{e}");
}

#[test]
fn a_body_reads_outer_tensors_as_loop_invariants() {
    // `w` is read inside the body without being passed: it becomes an invariant, and its
    // gradient sums over the iterations.
    let types = vec![
        ("h".to_string(), t(DType::F64, &[2])),
        ("w".to_string(), t(DType::F64, &[2])),
    ];
    let g = trace(&types, |i| {
        let w = i[1];
        let (c, _) = Scan::new()
            .length(3)
            .run(&[i[0]], &[], |c, _| (vec![c[0] * w], vec![]));
        let loss = c[0].sum_all();
        let mut out = vec![c[0]];
        out.extend(grad(loss, &[i[0], i[1]]));
        out
    })
    .unwrap();
    let h = Array::from_vec(&[2], vec![2.0f64, -1.0]).unwrap();
    let w = Array::from_vec(&[2], vec![0.5f64, 3.0]).unwrap();
    let out = interp::run(&g, &[h, w]).unwrap();
    // h·w³, d/dh = w³, d/dw = 3·h·w².
    assert_eq!(out[0].as_slice::<f64>().unwrap(), &[0.25, -27.0]);
    assert_eq!(out[1].as_slice::<f64>().unwrap(), &[0.125, 27.0]);
    assert_eq!(out[2].as_slice::<f64>().unwrap(), &[1.5, -27.0]);
}

#[test]
fn a_while_loop_runs_until_its_traced_condition_fails_and_refuses_a_gradient() {
    use nitro::trace::while_loop;
    // Newton's iteration for √a until the step is below 1e-6: a data-dependent trip count.
    let types = vec![("a".to_string(), t(DType::F32, &[]))];
    let g = trace(&types, |i| {
        let a = i[0];
        let zero = Tensor::constant(Array::scalar(0i32));
        while_loop(
            &[a, zero],
            |c| (c[0] * c[0] - a).abs().greater(1e-5 * a),
            |c| vec![(c[0] + a / c[0]) * 0.5, c[1] + 1.0],
        )
    })
    .unwrap();
    let text = emit::emit(&g);
    assert_eq!(text.matches("stablehlo.while").count(), 1, "{text}");
    for a in [2.0f32, 9.0, 1e4] {
        let x = [Array::scalar(a)];
        let out = interp::run(&g, &x).unwrap();
        let root = out[0].as_slice::<f32>().unwrap()[0];
        let steps = out[1].as_slice::<i32>().unwrap()[0];
        assert!((root - a.sqrt()).abs() <= 1e-5 * a.sqrt(), "√{a}: {root}");
        assert!(steps > 1, "√{a} took {steps} steps");
        if let Some(xla) = xla_or_skip("a_while_loop_runs") {
            let refs: Vec<&Array> = x.iter().collect();
            let got = xla.compile(&g, &text).unwrap().run(&refs).unwrap();
            assert_eq!(got[1], out[1], "√{a}: XLA took another number of steps");
            close("XLA root", &got[0], &out[0], 1e-6, 0.0);
        }
    }
    // More iterations for a larger input: the trip count really is the data's.
    let steps = |a: f32| {
        interp::run(&g, &[Array::scalar(a)]).unwrap()[1]
            .as_slice::<i32>()
            .unwrap()[0]
    };
    assert!(steps(1e4) > steps(2.0));

    let e = trace(&types, |i| {
        let a = i[0];
        let c = while_loop(&[a], |c| c[0].less(100.0), |c| vec![c[0] * 2.0]);
        grad(c[0], &[a])
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("while_loop") && e.contains("Scan"), "{e}");
    // Without a gradient through it, a loop may sit in a differentiated program.
    let ok = trace(&types, |i| {
        let a = i[0];
        let c = while_loop(
            &[a.stop_gradient()],
            |c| c[0].less(100.0),
            |c| vec![c[0] * 2.0],
        );
        grad((c[0] * a).reshape(&[]), &[a])
    });
    assert!(ok.is_ok(), "{:?}", ok.err());

    let e = trace(&types, |i| {
        while_loop(&[i[0]], |c| c[0] * 2.0, |c| vec![c[0]])
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("must be a bool scalar"), "{e}");
}

#[test]
fn a_replicated_program_runs_its_scan_on_every_replica() {
    // Two replicas, each scanning its own rows, then summing over replicas after the loop.
    let g = nitro::trace::trace_replicated(2, || {
        let xs = trace::input("xs", t(DType::F32, &[3, 2]));
        let zero = Tensor::scalar(0.0, DType::F32).broadcast_to(&[2]);
        let (c, _) = Scan::new().run(&[zero], &[xs], |c, x| (vec![c[0] + x[0]], vec![]));
        vec![c[0].all_sum()]
    })
    .unwrap();
    let a = Array::from_vec(&[3, 2], vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
    let b = Array::from_vec(&[3, 2], vec![10.0f32, 20.0, 30.0, 40.0, 50.0, 60.0]).unwrap();
    let out = interp::run_replicas(&g, &[&[&a], &[&b]]).unwrap();
    for replica in &out {
        assert_eq!(replica[0].as_slice::<f32>().unwrap(), &[99.0, 132.0]);
    }
    // A sum over replicas inside a body is refused when tracing.
    let e = nitro::trace::trace_replicated(2, || {
        let xs = trace::input("xs", t(DType::F32, &[3, 2]));
        let zero = Tensor::scalar(0.0, DType::F32).broadcast_to(&[2]);
        let (c, _) = Scan::new().run(&[zero], &[xs], |c, x| {
            (vec![(c[0] + x[0]).all_sum()], vec![])
        });
        c
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("all_sum") && e.contains("scan body"), "{e}");
}
