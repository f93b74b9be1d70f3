//! The small classifier the training-handle tests share: 4 features into 3 classes, its
//! data and its batches. Included with `#[path]` by the test files that train it.
#![allow(dead_code)]

use nitro::data::Dataset;
use nitro::init::{self, Rng, Seed};
use nitro::prelude::*;
use nitro::trace::nn;
use nitro::train::{FromBatch, Model};

#[derive(ContentHash, Clone, Copy, Debug, PartialEq)]
pub enum Act {
    Tanh,
    Relu,
}

#[derive(Tree, Clone, Debug, PartialEq)]
pub struct Dense {
    pub w: Array,
    pub b: Array,
}

#[derive(Tree, Clone, Debug)]
pub struct Batch {
    pub x: Array,
    pub y: Array,
}

/// A two-layer classifier of 4 features into 3 classes, with a frozen (non-trainable) input
/// scale to show that Device leaves that are not trained stay as they are.
#[experiment]
#[derive(Clone)]
pub struct Mlp {
    #[graph_const]
    pub act: Act,
    #[device(trainable)]
    pub layers: Vec<Dense>,
    #[device]
    pub scale: Array,
}

impl Model for Mlp {
    type Batch = Batch;

    fn loss(v: &MlpView<'_>, b: &BatchMirror<Tensor>) -> Tensor {
        nn::softmax_cross_entropy(logits(v, b.x), b.y)
    }

    fn correct(v: &MlpView<'_>, b: &BatchMirror<Tensor>) -> Option<Tensor> {
        Some(nn::correct(logits(v, b.x), b.y))
    }

    fn predict(v: &MlpView<'_>, b: &BatchMirror<Tensor>) -> Option<Tensor> {
        Some(logits(v, b.x))
    }
}

pub fn logits(v: &MlpView<'_>, x: Tensor) -> Tensor {
    let x = x * v.scale;
    let (last, hidden) = v.layers.split_last().expect("layers");
    let h = hidden.iter().fold(x, |h, l| {
        let z = h.matmul(l.w) + l.b;
        match v.act {
            Act::Tanh => z.tanh(),
            Act::Relu => z.relu(),
        }
    });
    h.matmul(last.w) + last.b
}

pub fn mlp(act: Act) -> Mlp {
    Mlp {
        act,
        layers: vec![
            Dense {
                w: init::glorot_uniform(4, 16, Seed(1)),
                b: Array::zeros(DType::F32, &[16]),
            },
            Dense {
                w: init::glorot_uniform(16, 3, Seed(2)),
                b: Array::zeros(DType::F32, &[3]),
            },
        ],
        scale: Array::full(&[4], 1.0f32),
    }
}

/// A learnable problem: the class is which of the first three features is largest.
pub fn data(rows: usize, seed: u64) -> (Vec<f32>, Vec<i32>) {
    let mut rng = Rng::new(Seed(seed));
    let mut x = Vec::with_capacity(rows * 4);
    let mut y = Vec::with_capacity(rows);
    for _ in 0..rows {
        let row: Vec<f32> = (0..4).map(|_| rng.next_f64() as f32 * 2.0 - 1.0).collect();
        let class = (0..3)
            .max_by(|&a, &b| row[a].total_cmp(&row[b]))
            .unwrap_or(0);
        x.extend(&row);
        y.push(class as i32);
    }
    (x, y)
}

/// Rows `start..start + real` of `(x, y)`, padded with zeros to `rows`.
pub fn batch(x: &[f32], y: &[i32], start: usize, real: usize, rows: usize) -> Batch {
    let mut bx = x[start * 4..(start + real) * 4].to_vec();
    bx.resize(rows * 4, 0.0);
    let mut by = y[start..start + real].to_vec();
    by.resize(rows, 0);
    Batch {
        x: Array::from_vec(&[rows, 4], bx).unwrap(),
        y: Array::from_vec(&[rows], by).unwrap(),
    }
}

impl FromBatch for Batch {
    fn from_batch(b: nitro::data::Batch) -> nitro::Result<Batch> {
        Ok(Batch {
            x: b.column("x").cloned().expect("an x column"),
            y: b.column("y").cloned().expect("a y column"),
        })
    }
}

/// `rows` rows of [`data`] as a data set with columns `x` and `y`.
pub fn dataset(rows: usize, seed: u64) -> Dataset {
    let (x, y) = data(rows, seed);
    Dataset::new([
        ("x", Array::from_vec(&[rows, 4], x).unwrap()),
        ("y", Array::from_vec(&[rows], y).unwrap()),
    ])
    .unwrap()
}

/// The trainable leaves' values, layer by layer.
pub fn leaves(e: &Mlp) -> Vec<Vec<f32>> {
    e.layers
        .iter()
        .flat_map(|l| [&l.w, &l.b])
        .map(|a| a.as_slice::<f32>().unwrap().to_vec())
        .collect()
}
