//! Half precision: `bf16` and `f16` arrays through hashing, trees and checkpoints; programs in
//! half precision on the interpreter and XLA (conversions round to nearest even, bit for bit;
//! arithmetic within one half-precision rounding); mixed precision — parameters in f32, products
//! in bf16 accumulated in f32 (`matmul_to`, `Conv::preferred_element_type`) — and its gradients.
#![allow(missing_docs)]

mod common;

use common::xla_or_skip;
use nitro::checkpoint::Checkpoint;
use nitro::prelude::*;
use nitro::trace::{self, grad, Conv};
use nitro::{bf16, f16, ArrayData, Digest, LeafType};

fn bf16s(v: &[f32]) -> Array {
    Array::from_vec(
        &[v.len()],
        v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>(),
    )
    .unwrap()
}

fn f32s(dims: &[usize], seed: u32) -> Array {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| {
            let h = (i as u32 ^ seed).wrapping_mul(2_654_435_761);
            (h >> 9) as f32 / (1u32 << 23) as f32 * 2.0 - 1.0
        })
        .collect();
    Array::from_vec(dims, v).unwrap()
}

fn as_f32(a: &Array) -> Vec<f32> {
    match a.data() {
        ArrayData::F32(v) => v.clone(),
        ArrayData::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
        ArrayData::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
        other => panic!("not a float array: {}", other.dtype()),
    }
}

#[derive(Tree, Clone, Debug, PartialEq)]
struct Halves {
    a: Array,
    b: Array,
}

#[experiment]
struct Mixed {
    #[device(trainable)]
    w: Array,
    #[device]
    h: Halves,
}

#[test]
fn half_arrays_hash_by_bits_and_survive_checkpoints() {
    let a = bf16s(&[1.0, -0.0, 3.5]);
    assert_eq!(a.dtype(), DType::BF16);
    assert_eq!(a.leaf_type().to_string(), "bf16[3]");
    assert_ne!(
        Digest::of(&a),
        Digest::of(&bf16s(&[1.0, 0.0, 3.5])),
        "-0 and +0 differ"
    );
    let f = Array::from_vec(&[2], vec![f16::from_f32(0.5), f16::NAN]).unwrap();
    assert_ne!(Digest::of(&f), Digest::of(&a));
    let e = Mixed {
        w: f32s(&[2, 2], 1),
        h: Halves {
            a: a.clone(),
            b: f.clone(),
        },
    };
    let sig = e.h.signature_at("h").to_string();
    assert_eq!(sig, "h.a: bf16[3], h.b: f16[2]");
    let c = Checkpoint::capture(&e, &[], 3).unwrap();
    let back = Checkpoint::from_bytes(&c.to_bytes().unwrap()).unwrap();
    let mut fresh = Mixed {
        w: Array::zeros(DType::F32, &[2, 2]),
        h: Halves {
            a: Array::zeros(DType::BF16, &[3]),
            b: Array::zeros(DType::F16, &[2]),
        },
    };
    back.restore_into(&mut fresh).unwrap();
    assert_eq!(fresh.h.a, a);
    let ArrayData::F16(v) = fresh.h.b.data() else {
        panic!("f16 restored as f16")
    };
    assert_eq!((v[0], v[1].is_nan()), (f16::from_f32(0.5), true));
}

/// Runs `body` on `inputs` on the interpreter and, when present, XLA; returns both outputs.
fn both(
    inputs: &[Array],
    body: impl Fn(&[Tensor]) -> Vec<Tensor>,
) -> (Vec<Array>, Option<Vec<Array>>) {
    let types: Vec<(String, LeafType)> = inputs
        .iter()
        .enumerate()
        .map(|(i, a)| (format!("x{i}"), a.leaf_type()))
        .collect();
    let g = trace::trace(&types, body).unwrap();
    let interp = nitro::backend::interp::run(&g, inputs).unwrap();
    let xla = xla_or_skip("half").map(|x| {
        let refs: Vec<&Array> = inputs.iter().collect();
        let text = nitro::emit::emit(&g);
        x.compile(&g, &text)
            .and_then(|e| e.run(&refs))
            .unwrap_or_else(|e| panic!("XLA failed: {e}\n{text}"))
    });
    (interp, xla)
}

#[test]
fn conversions_round_to_nearest_even_bit_for_bit_on_both_backends() {
    // Values at and between bf16/f16 neighbours: ties must go to even.
    let tricky: Vec<f32> = vec![
        1.0,
        f32::from_bits(0x3F80_8000), // exactly between two bf16s: ties to even (down)
        f32::from_bits(0x3F81_8000), // between two bf16s, odd below: ties up
        f32::from_bits(0x3F80_8001), // just above the tie: up
        65504.0,
        65520.0, // rounds to f16 infinity
        1e-8,
        -2.5,
        f32::INFINITY,
        f32::NAN,
    ];
    let x = Array::from_vec(&[tricky.len()], tricky.clone()).unwrap();
    let (interp, xla) = both(std::slice::from_ref(&x), |t| {
        vec![
            t[0].convert(DType::BF16),
            t[0].convert(DType::F16),
            t[0].convert(DType::BF16).convert(DType::F32),
        ]
    });
    let ArrayData::BF16(b) = interp[0].data() else {
        panic!()
    };
    assert_eq!(b[1].to_bits(), 0x3F80, "a tie rounds to even");
    assert_eq!(b[2].to_bits(), 0x3F82, "a tie rounds to even (up)");
    assert_eq!(b[3].to_bits(), 0x3F81, "above a tie rounds up");
    let ArrayData::F16(h) = interp[1].data() else {
        panic!()
    };
    assert!(h[5].is_infinite(), "65520 overflows f16");
    if let Some(xla) = xla {
        for (k, (i, x)) in interp.iter().zip(&xla).enumerate() {
            let bits = |a: &Array| -> Vec<u32> {
                match a.data() {
                    ArrayData::BF16(v) => v.iter().map(|x| x.to_bits() as u32).collect(),
                    ArrayData::F16(v) => v.iter().map(|x| x.to_bits() as u32).collect(),
                    ArrayData::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
                    _ => unreachable!(),
                }
            };
            // NaN payloads may differ; everything else is bit-exact.
            let (bi, bx) = (bits(i), bits(x));
            for (j, (p, q)) in bi.iter().zip(&bx).enumerate() {
                if !tricky[j].is_nan() {
                    assert_eq!(
                        p, q,
                        "output {k} element {j}: interpreter {p:#x}, XLA {q:#x}"
                    );
                }
            }
        }
    }
}

#[test]
fn arithmetic_in_half_precision_agrees_within_one_rounding() {
    let a = f32s(&[4, 8], 3);
    let b = f32s(&[4, 8], 4);
    for dtype in [DType::BF16, DType::F16] {
        let (interp, xla) = both(&[a.clone(), b.clone()], |t| {
            let (x, y) = (t[0].convert(dtype), t[1].convert(dtype));
            vec![
                x + y,
                x * y,
                (x * 2.0).tanh(),
                x.exp() / (y.abs() + 1.0),
                x.sum(&[1]),
                x.max(&[0]),
                x.matmul(y.t()),
            ]
        });
        assert!(
            interp.iter().all(|o| o.dtype() == dtype),
            "results stay {dtype}"
        );
        let Some(xla) = xla else { continue };
        // One rounding of the half type: 2^-8 (bf16) or 2^-11 (f16), relative; sums and
        // products over 8 terms accumulate a few.
        let eps = if dtype == DType::BF16 {
            1.0 / 256.0
        } else {
            1.0 / 2048.0
        };
        for (k, (i, x)) in interp.iter().zip(&xla).enumerate() {
            for (j, (p, q)) in as_f32(i).iter().zip(as_f32(x)).enumerate() {
                let tol = 8.0 * eps * q.abs().max(1.0);
                assert!(
                    (p - q).abs() <= tol,
                    "{dtype} output {k}[{j}]: interpreter {p}, XLA {q}"
                );
            }
        }
    }
}

#[test]
fn mixed_precision_products_accumulate_in_f32_and_differentiate() {
    // Params f32, compute bf16, accumulate f32: x [8,16] · w [16,4], and a 3×3 convolution.
    let x = f32s(&[8, 16], 5);
    let w = f32s(&[16, 4], 6);
    let img = f32s(&[2, 6, 6, 3], 7);
    let k = f32s(&[3, 3, 3, 4], 8);
    let (interp, xla) = both(&[x, w, img, k], |t| {
        let low = |a: Tensor| a.convert(DType::BF16);
        let y = low(t[0]).matmul_to(low(t[1]), DType::F32);
        let conv = Conv::channels_last(2)
            .same_for(&[6, 6], &[3, 3])
            .preferred_element_type(DType::F32);
        let z = low(t[2]).conv(low(t[3]), &conv);
        let loss = (y * y).mean_all() + (z * z).mean_all();
        let mut out = vec![y, z];
        out.extend(grad(loss, &[t[1], t[3]]));
        out
    });
    assert_eq!(
        interp[0].dtype(),
        DType::F32,
        "accumulated and returned in f32"
    );
    assert_eq!(interp[1].dtype(), DType::F32);
    assert_eq!(
        (interp[2].dtype(), interp[3].dtype()),
        (DType::F32, DType::F32),
        "gradients of f32 params are f32"
    );
    // The products of bf16 values are exact in f32: an f32 product of the rounded inputs.
    let rounded = |a: &Array| -> Vec<f32> {
        as_f32(a)
            .iter()
            .map(|&v| bf16::from_f32(v).to_f32())
            .collect()
    };
    let (xr, wr) = (rounded(&f32s(&[8, 16], 5)), rounded(&f32s(&[16, 4], 6)));
    let y = as_f32(&interp[0]);
    for r in 0..8 {
        for c in 0..4 {
            let want: f64 = (0..16)
                .map(|i| xr[r * 16 + i] as f64 * wr[i * 4 + c] as f64)
                .sum();
            assert!(
                (y[r * 4 + c] as f64 - want).abs() < 1e-5,
                "accumulated in f32, not bf16"
            );
        }
    }
    if let Some(xla) = xla {
        for (k, (i, x)) in interp.iter().zip(&xla).enumerate() {
            for (j, (p, q)) in as_f32(i).iter().zip(as_f32(x)).enumerate() {
                // Gradients pass through bf16 roundings of the cotangent: one bf16 ulp.
                let tol = if k < 2 {
                    1e-5 * q.abs() + 1e-5
                } else {
                    q.abs() / 128.0 + 1e-4
                };
                assert!(
                    (p - q).abs() <= tol,
                    "output {k}[{j}]: interpreter {p}, XLA {q}"
                );
            }
        }
    }
}

#[test]
fn bad_mixed_precision_is_a_trace_error() {
    let t = |d: DType, dims: &[usize]| LeafType {
        dtype: d,
        dims: dims.to_vec(),
    };
    let err = trace::trace(
        &[
            ("a".into(), t(DType::F32, &[2, 2])),
            ("b".into(), t(DType::F32, &[2, 2])),
        ],
        |x| vec![x[0].matmul_to(x[1], DType::BF16)],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("`matmul`") && err.contains("cannot give bf16"),
        "{err}"
    );
}
