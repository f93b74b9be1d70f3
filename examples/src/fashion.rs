//! The Fashion-MNIST CNN of `--example fashion`: conv 3×3 16 → relu → max-pool 2×2, conv 3×3
//! 32 → relu → max-pool 2×2, dense 10, written with [`nitro::nn`]. Here in the library so that
//! the example, its JAX twin's bundle and the tests that hold it to JAX build the same model.

use nitro::data::Dataset;
use nitro::nn::{self, Conv2d, Conv2dParams, Layer, Linear, LinearParams, Pool2d};
use nitro::optim::{Adam, Cosine};
use nitro::prelude::*;
use nitro::train::{FromBatch, Model};

/// The network's shape: a GraphConst, so another width is another program.
#[derive(ContentHash, Clone, Debug)]
pub struct CnnArch {
    /// The first convolution.
    pub conv1: Conv2d,
    /// The second convolution.
    pub conv2: Conv2d,
    /// The pooling after each.
    pub pool: Pool2d,
    /// The classifier.
    pub dense: Linear,
}

/// The experiment: the architecture shapes the graph, the parameters are trained on the device.
#[experiment]
pub struct FashionCnn {
    /// The architecture.
    #[graph_const]
    pub arch: CnnArch,
    /// The first convolution's kernel and bias.
    #[device(trainable)]
    pub conv1: Conv2dParams,
    /// The second convolution's kernel and bias.
    #[device(trainable)]
    pub conv2: Conv2dParams,
    /// The classifier's weights and bias.
    #[device(trainable)]
    pub dense: LinearParams,
}

/// One batch: images `f32 [n, 28, 28, 1]` in `[0, 1]`, labels `i32 [n]`.
#[derive(Tree)]
pub struct Images {
    /// The images.
    pub x: Array,
    /// The labels.
    pub y: Array,
}

impl FromBatch for Images {
    fn from_batch(mut b: nitro::data::Batch) -> nitro::Result<Images> {
        Ok(Images {
            x: b.take("x")?,
            y: b.take("y")?,
        })
    }
}

/// The class scores of images `x`, `[n, 10]`.
pub fn logits(v: &FashionCnnView<'_>, x: Tensor) -> Tensor {
    let a = &v.arch;
    let h = a.pool.forward(&(), a.conv1.forward(&v.conv1, x).relu());
    let h = a.pool.forward(&(), a.conv2.forward(&v.conv2, h).relu());
    let rows = h.dims()[0];
    a.dense
        .forward(&v.dense, h.reshape(&[rows, a.dense.inputs]))
}

impl Model for FashionCnn {
    type Batch = Images;

    fn loss(v: &FashionCnnView<'_>, b: &ImagesMirror<Tensor>) -> Tensor {
        nn::softmax_cross_entropy(logits(v, b.x), b.y)
    }

    fn correct(v: &FashionCnnView<'_>, b: &ImagesMirror<Tensor>) -> Option<Tensor> {
        Some(nn::correct(logits(v, b.x), b.y))
    }
}

impl FashionCnn {
    /// The network with fresh weights from `seed`.
    pub fn new(seed: u64) -> FashionCnn {
        let arch = CnnArch {
            conv1: Conv2d::new(1, 16, (3, 3)),
            conv2: Conv2d::new(16, 32, (3, 3)),
            pool: nn::max_pool2d((2, 2), (2, 2)),
            dense: Linear::new(7 * 7 * 32, 10),
        };
        let s = nitro::init::Seed;
        FashionCnn {
            conv1: arch.conv1.init(s(seed)),
            conv2: arch.conv2.init(s(seed.wrapping_add(1))),
            dense: arch.dense.init(s(seed.wrapping_add(2))),
            arch,
        }
    }
}

/// The optimizer the example trains with.
pub fn optimizer() -> Adam {
    Adam::default()
}

/// The example's learning-rate schedule for `steps` optimizer steps peaking at `lr`: cosine
/// down to `lr / 100`, after a linear warm-up over the first twentieth.
pub fn schedule(lr: f64, steps: u64) -> Cosine {
    Cosine {
        base: lr,
        min: lr / 100.0,
        warmup: steps / 20,
        total: steps,
    }
}

/// Images and labels as a data set: `f32 [n, 28, 28, 1]` scaled to `[0, 1]`, `i32` labels; the
/// first `rows` only when given.
pub fn dataset(images: &Array, labels: &Array, rows: Option<usize>) -> nitro::Result<Dataset> {
    let n = rows.unwrap_or(images.dims()[0]).min(images.dims()[0]);
    let pixels = images.as_slice::<u8>()?;
    let x: Vec<f32> = pixels[..n * 784]
        .iter()
        .map(|&p| p as f32 / 255.0)
        .collect();
    let y: Vec<i32> = labels.as_slice::<u8>()?[..n]
        .iter()
        .map(|&l| l as i32)
        .collect();
    Dataset::new([
        ("x", Array::from_vec(&[n, 28, 28, 1], x)?),
        ("y", Array::from_vec(&[n], y)?),
    ])
}
