//! Property tests: random element-wise / broadcast / reduce programs, traced and run on the
//! interpreter, against a naive evaluation written here with plain index arithmetic.
#![allow(missing_docs)]

use nitro::backend::interp;
use nitro::trace::{self, Tensor};
use nitro::{Array, LeafType};
use proptest::prelude::*;

/// A value of the naive evaluator: dims and row-major data.
#[derive(Clone, Debug)]
struct Naive {
    dims: Vec<usize>,
    data: Vec<f64>,
}

impl Naive {
    fn index_of(dims: &[usize], mut flat: usize) -> Vec<usize> {
        let mut idx = vec![0; dims.len()];
        for i in (0..dims.len()).rev() {
            idx[i] = flat % dims[i];
            flat /= dims[i];
        }
        idx
    }

    /// The element at a multi-index of a broadcast result (dims aligned right, size-1 dims stretch).
    fn at_broadcast(&self, idx: &[usize]) -> f64 {
        let off = idx.len() - self.dims.len();
        let mut flat = 0;
        for (i, &d) in self.dims.iter().enumerate() {
            let j = if d == 1 { 0 } else { idx[off + i] };
            flat = flat * d + j;
        }
        self.data[flat]
    }

    /// The element-wise combination under NumPy broadcasting; `None` when the dims are
    /// incompatible (the tracer rejects those, so the program skips the step).
    fn zip(&self, other: &Naive, f: impl Fn(f64, f64) -> f64) -> Option<Naive> {
        let n = self.dims.len().max(other.dims.len());
        let get = |d: &[usize], i: usize| {
            if i + d.len() >= n {
                d[i + d.len() - n]
            } else {
                1
            }
        };
        if (0..n).any(|i| {
            let (x, y) = (get(&self.dims, i), get(&other.dims, i));
            x != y && x != 1 && y != 1
        }) {
            return None;
        }
        let dims: Vec<usize> = (0..n)
            .map(|i| get(&self.dims, i).max(get(&other.dims, i)))
            .collect();
        let total = dims.iter().product();
        let data = (0..total)
            .map(|k| {
                let idx = Naive::index_of(&dims, k);
                f(self.at_broadcast(&idx), other.at_broadcast(&idx))
            })
            .collect();
        Some(Naive { dims, data })
    }

    fn map(&self, f: impl Fn(f64) -> f64) -> Naive {
        Naive {
            dims: self.dims.clone(),
            data: self.data.iter().map(|&v| f(v)).collect(),
        }
    }

    fn reduce(&self, axis: usize, init: f64, f: impl Fn(f64, f64) -> f64) -> Naive {
        let mut dims = self.dims.clone();
        dims.remove(axis);
        let total: usize = dims.iter().product();
        let mut data = vec![init; total];
        for (k, &v) in self.data.iter().enumerate() {
            let mut idx = Naive::index_of(&self.dims, k);
            idx.remove(axis);
            let flat = idx.iter().zip(&dims).fold(0, |acc, (&i, &d)| acc * d + i);
            data[flat] = f(data[flat], v);
        }
        Naive { dims, data }
    }
}

#[derive(Clone, Copy, Debug)]
enum Step {
    Neg,
    Tanh,
    Abs,
    Scale(f64),
    Add(bool),
    Sub(bool),
    Mul(bool),
    Max(bool),
    Min(bool),
    Sum(usize),
    ReduceMax(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        Just(Step::Neg),
        Just(Step::Tanh),
        Just(Step::Abs),
        (-3.0f64..3.0).prop_map(Step::Scale),
        any::<bool>().prop_map(Step::Add),
        any::<bool>().prop_map(Step::Sub),
        any::<bool>().prop_map(Step::Mul),
        any::<bool>().prop_map(Step::Max),
        any::<bool>().prop_map(Step::Min),
        (0usize..3).prop_map(Step::Sum),
        (0usize..3).prop_map(Step::ReduceMax),
    ]
}

/// Shape `a` (rank 1..=3) and a broadcast-compatible `b`: a suffix of `a` with some dims set to 1.
fn shapes() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    proptest::collection::vec(1usize..4, 1..=3)
        .prop_flat_map(|a| {
            let n = a.len();
            (Just(a), 0..=n, proptest::collection::vec(any::<bool>(), n))
        })
        .prop_map(|(a, keep, ones)| {
            let b: Vec<usize> = a[a.len() - keep..]
                .iter()
                .zip(&ones)
                .map(|(&d, &one)| if one { 1 } else { d })
                .collect();
            (a, b)
        })
}

fn values(dims: &[usize], seed: u64) -> Vec<f64> {
    let mut s = seed;
    (0..dims.iter().product::<usize>())
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64) * 4.0 - 2.0
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, .. ProptestConfig::default() })]

    #[test]
    fn interpreter_matches_naive_evaluation(
        (da, db) in shapes(),
        steps in proptest::collection::vec(step(), 1..8),
        seed in any::<u64>(),
    ) {
        let a = Naive { dims: da.clone(), data: values(&da, seed) };
        let b = Naive { dims: db.clone(), data: values(&db, seed ^ 0xabcdef) };

        // The naive result, skipping reductions over axes the current value does not have.
        let mut cur = a.clone();
        let mut applied = Vec::new();
        for s in &steps {
            let other = |pick_b: bool| if pick_b { &b } else { &a };
            let next = match *s {
                Step::Neg => Some(cur.map(|v| -v)),
                Step::Tanh => Some(cur.map(f64::tanh)),
                Step::Abs => Some(cur.map(f64::abs)),
                Step::Scale(c) => Some(cur.map(|v| v * c)),
                Step::Add(p) => cur.zip(other(p), |x, y| x + y),
                Step::Sub(p) => cur.zip(other(p), |x, y| x - y),
                Step::Mul(p) => cur.zip(other(p), |x, y| x * y),
                Step::Max(p) => cur.zip(other(p), f64::max),
                Step::Min(p) => cur.zip(other(p), f64::min),
                Step::Sum(ax) if ax < cur.dims.len() => Some(cur.reduce(ax, 0.0, |x, y| x + y)),
                Step::ReduceMax(ax) if ax < cur.dims.len() => Some(cur.reduce(ax, f64::NEG_INFINITY, f64::max)),
                _ => None,
            };
            if let Some(n) = next {
                cur = n;
                applied.push(*s);
            }
        }

        let inputs = vec![
            ("a".to_owned(), LeafType { dtype: nitro::DType::F64, dims: da.clone() }),
            ("b".to_owned(), LeafType { dtype: nitro::DType::F64, dims: db.clone() }),
        ];
        let graph = trace::trace(&inputs, |x| {
            let (ta, tb) = (x[0], x[1]);
            let mut t: Tensor = ta;
            for s in &applied {
                let other = |pick_b: bool| if pick_b { tb } else { ta };
                t = match *s {
                    Step::Neg => -t,
                    Step::Tanh => t.tanh(),
                    Step::Abs => t.abs(),
                    Step::Scale(c) => t * c,
                    Step::Add(p) => t + other(p),
                    Step::Sub(p) => t - other(p),
                    Step::Mul(p) => t * other(p),
                    Step::Max(p) => t.maximum(other(p)),
                    Step::Min(p) => t.minimum(other(p)),
                    Step::Sum(ax) => t.sum(&[ax]),
                    Step::ReduceMax(ax) => t.max(&[ax]),
                };
            }
            vec![t]
        }).unwrap();
        let out = interp::run(&graph, &[
            Array::from_vec(&da, a.data.clone()).unwrap(),
            Array::from_vec(&db, b.data.clone()).unwrap(),
        ]).unwrap();
        prop_assert_eq!(out[0].dims(), cur.dims.as_slice());
        for (got, want) in out[0].as_slice::<f64>().unwrap().iter().zip(&cur.data) {
            prop_assert!((got - want).abs() <= 1e-9 * (1.0 + want.abs()), "{got} vs {want} after {applied:?}");
        }
    }
}
