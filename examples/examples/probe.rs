#![allow(missing_docs)]
use nitro::backend::pjrt::Arg;
use nitro::backend::Backend;
use nitro::trace::Tensor;
use nitro::tree::{Array, DType, LeafType};
use std::time::Instant;
fn t(d: &[usize]) -> LeafType {
    Array::zeros(DType::F32, d).leaf_type()
}
fn adam(p: Tensor, m: Tensor, v: Tensor, g: Tensor) -> [Tensor; 3] {
    let s = |x: f64| Tensor::scalar(x, DType::F32);
    let m2 = m * s(0.9) + g * s(0.1);
    let v2 = v * s(0.999) + g * g * s(0.001);
    let p2 = p - m2 * s(0.001) / (v2.sqrt() + s(1e-8));
    [p2, m2, v2]
}
fn main() {
    let xla = nitro::backend::xla().unwrap();
    let shapes: Vec<Vec<usize>> = vec![vec![64, 128], vec![128], vec![128, 10], vec![10]];
    for flat in [false, true] {
        let leaves: Vec<Vec<usize>> = if flat {
            vec![vec![64 * 128 + 128 + 1280 + 10]]
        } else {
            shapes.clone()
        };
        let n = leaves.len();
        let mut inputs = Vec::new();
        for k in ["p", "m", "v", "g"] {
            for (i, d) in leaves.iter().enumerate() {
                inputs.push((format!("{k}{i}"), t(d)));
            }
        }
        let graph = nitro::trace::trace(&inputs, |x| {
            let mut outs = vec![];
            for i in 0..n {
                let [a, b, c] = adam(x[i], x[n + i], x[2 * n + i], x[3 * n + i]);
                outs.push(a);
                outs.push(b);
                outs.push(c);
            }
            outs
        })
        .unwrap();
        let text = nitro::emit::emit(&graph);
        let exe = xla.compile(&graph, &text).unwrap();
        let pj = exe.as_pjrt().unwrap();
        let client = pj.client();
        let bufs: Vec<_> = inputs
            .iter()
            .map(|(_, ty)| client.upload(&Array::zeros(DType::F32, &ty.dims)).unwrap())
            .collect();
        let mut times = Vec::new();
        for _ in 0..4000 {
            let s = Instant::now();
            let out = pj
                .execute_donating(bufs.iter().map(Arg::Borrow).collect())
                .unwrap();
            drop(out);
            times.push(s.elapsed().as_secs_f64() * 1e6);
        }
        times.sort_by(f64::total_cmp);
        println!(
            "flat {flat}: {} inputs, median {:.1} us p10 {:.1}",
            inputs.len(),
            times[2000],
            times[400]
        );
    }
}
