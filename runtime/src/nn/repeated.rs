//! A stack of identical layers with stacked parameters, run as one [`Scan`] over depth.

use crate::error::{Error, Result};
use crate::init::Seed;
use crate::ops::random::{self, StepKey};
use crate::trace::{Remat, Scan, Tensor};
use crate::tree::{Array, ArrayData, DType, Tree};

use super::{init_stack, Layer};

/// `depth` copies of `layer`, each with its own parameters, applied in order — with the
/// parameters **stacked**: every leaf of `layer`'s parameter tree gets a leading axis of
/// `depth` (`blocks.fc1.w: f32[depth, 128, 512]`). Traced as a [`Scan`] over that axis, the
/// program holds the layer once, so its compile time stays about that of one layer however deep
/// the stack (as Flax's `nn.scan` over layers); [`Repeated::unrolled`] traces the same
/// parameters as `depth` copies instead, for comparison.
///
/// Dropout inside the layer draws a different mask in every layer: layer `i` runs with the
/// step's key folded with `i` (`fold_in(step_key, i)`), in both forms, so the scanned and the
/// unrolled stack draw the same masks (not those of `depth` separate layers, which draw from
/// the step's key in call order).
///
/// ```
/// use nitro::nn::{Layer, Repeated, TransformerBlock};
///
/// let blocks = Repeated::new(TransformerBlock::causal(32, 4)?, 6);
/// let params = blocks.init(nitro::init::Seed(1));
/// assert_eq!(params.fc1.w.dims(), &[6, 32, 128]);
/// assert_eq!(params.ln1.gain.dims(), &[6, 32]);
/// # Ok::<(), nitro::Error>(())
/// ```
#[derive(crate::ContentHash, Clone, Copy, Debug, PartialEq)]
pub struct Repeated<L> {
    /// The layer repeated.
    pub layer: L,
    /// How many copies.
    pub depth: usize,
    /// What the reverse pass keeps of each layer ([`Remat`]).
    pub remat: Remat,
    /// Whether to trace `depth` copies instead of a scan (same parameters, same values).
    pub unrolled: bool,
}

impl<L: Layer> Repeated<L> {
    /// `depth` copies of `layer` as a scan that saves residuals.
    pub fn new(layer: L, depth: usize) -> Repeated<L> {
        Repeated {
            layer,
            depth,
            remat: Remat::Save,
            unrolled: false,
        }
    }

    /// With the reverse pass keeping what `remat` says.
    pub fn remat(mut self, remat: Remat) -> Repeated<L> {
        self.remat = remat;
        self
    }

    /// Traced as `depth` copies (`true`) or as a scan (`false`, the default).
    pub fn unrolled(mut self, unrolled: bool) -> Repeated<L> {
        self.unrolled = unrolled;
        self
    }

    /// Per-layer parameters (as [`init_stack`] makes them) stacked into this layer's
    /// parameters: row `i` of every leaf is `layers[i]`'s.
    ///
    /// [`Error::InvalidDataArgument`] unless there are exactly `depth` layers whose leaves have
    /// one structure, dtype and shape (naming the first leaf that differs): a stack of another
    /// depth, or none, would not be this layer's parameters.
    pub fn stack_params(&self, layers: &[L::Params]) -> Result<L::Params>
    where
        L::Params: Clone,
    {
        let wrong = |what: String| Error::InvalidDataArgument {
            what: format!("Repeated::stack_params: {what}"),
        };
        if layers.len() != self.depth {
            return Err(wrong(format!(
                "{} layers' parameters given for a stack of depth {}; give one per layer",
                layers.len(),
                self.depth
            )));
        }
        let declared = crate::init::declaring();
        let mut columns: Vec<Vec<Array>> = Vec::new();
        let mut paths: Vec<String> = Vec::new();
        for (i, p) in layers.iter().enumerate() {
            let mut k = 0;
            let mut bad = None;
            p.for_each_leaf("", &mut |path, a| {
                let path = path.as_str();
                if i == 0 {
                    columns.push(Vec::new());
                    paths.push(path.to_owned());
                }
                match columns.get(k).and_then(|c| c.first()) {
                    Some(first) if first.leaf_type() != a.leaf_type() || paths[k] != path => {
                        bad.get_or_insert(format!(
                            "layer {i}'s leaf `{path}` is {} and layer 0's `{}` is {}",
                            a.leaf_type(),
                            paths[k],
                            first.leaf_type()
                        ));
                    }
                    _ => {}
                }
                // Declared leaves (`init::declared`) are never copied: their stack is zeros
                // of its type, which cost nothing until written.
                match (columns.get_mut(k), declared) {
                    (Some(c), false) => c.push(a.clone()),
                    (Some(c), true) if c.is_empty() => c.push(a.clone()),
                    _ => {}
                }
                k += 1;
            });
            if k != columns.len() {
                bad.get_or_insert(format!(
                    "layer {i} has {k} leaves and layer 0 has {}",
                    columns.len()
                ));
            }
            if let Some(bad) = bad {
                return Err(wrong(bad));
            }
        }
        let Some(first) = layers.first() else {
            return Err(wrong("no layers given".into()));
        };
        let mut stacked = first.clone();
        let mut k = 0;
        let mut failed = None;
        stacked.visit_mut(&mut crate::tree::LeafPath::root(""), &mut |_, a| {
            if declared {
                let mut dims = vec![self.depth];
                dims.extend(a.dims());
                match Array::try_zeros(a.dtype(), &dims) {
                    Ok(z) => *a = z,
                    Err(e) => {
                        failed.get_or_insert(e);
                    }
                }
            } else if let Some(column) = columns.get(k) {
                match stack(a, column) {
                    Ok(s) => *a = s,
                    Err(e) => {
                        failed.get_or_insert(e);
                    }
                }
            }
            k += 1;
        });
        match failed {
            Some(e) => Err(e),
            None => Ok(stacked),
        }
    }

    /// Layer `i`'s parameters out of a stacked view (slices of every leaf).
    #[track_caller]
    pub fn layer_params(
        &self,
        p: &<L::Params as Tree>::Mirror<Tensor>,
        i: usize,
    ) -> <L::Params as Tree>::Mirror<Tensor> {
        let _caller = crate::trace::caller_scope();
        L::Params::map_mirror(p, &mut |t: &Tensor| {
            let dims = t.dims();
            t.narrow(0, i, 1).reshape(dims.get(1..).unwrap_or(&[]))
        })
    }
}

/// Runs `f` with the step's key folded with `layer`, when there is a step key.
fn with_layer_key<R>(layer: Tensor, f: impl FnOnce() -> R) -> R {
    match random::step_key_state() {
        StepKey::Training(key) => {
            random::with_step_key(StepKey::Training(random::fold_in(key, layer)), f)
        }
        _ => f(),
    }
}

impl<L: Layer> Layer for Repeated<L>
where
    L::Params: Clone,
{
    type Params = L::Params;

    /// Layer `i` from seed part `i` (as [`init_stack`]), its leaves stacked.
    fn init(&self, seed: Seed) -> L::Params {
        if crate::init::declaring() {
            // Declared (`init::declared`): one layer's zeros, each leaf made zeros of its
            // stacked type — nothing drawn, copied or written.
            let mut p = self.layer.init(seed);
            p.visit_mut(&mut crate::tree::LeafPath::root(""), &mut |_, a| {
                let mut dims = vec![self.depth];
                dims.extend(a.dims());
                if let Ok(z) = Array::try_zeros(a.dtype(), &dims) {
                    *a = z;
                }
            });
            return p;
        }
        let layers = init_stack(&vec![self.layer_copy(); self.depth.max(1)], seed);
        if self.depth == 0 {
            // No rows: the leaves of one layer's types with a leading 0.
            let mut p = layers[0].clone();
            p.visit_mut(&mut crate::tree::LeafPath::root(""), &mut |_, a| {
                if let Ok(empty) = stack(a, &[]) {
                    *a = empty;
                }
            });
            return p;
        }
        // `depth` inits of one layer share their structure and types: stacking cannot fail
        // but for the size limit, which `Layer::init` (infallible, like `Array::zeros`) reports
        // as a panic.
        self.stack_params(&layers)
            .unwrap_or_else(|e| panic!("Repeated::init: {e}"))
    }

    #[track_caller]
    fn forward(&self, p: &<L::Params as Tree>::Mirror<Tensor>, x: Tensor) -> Tensor {
        let _caller = crate::trace::caller_scope();
        if self.unrolled {
            let mut h = x;
            for i in 0..self.depth {
                let view = self.layer_params(p, i);
                let index = Tensor::constant(Array::scalar(i as u32));
                h = with_layer_key(index, || self.layer.forward(&view, h));
            }
            return h;
        }
        let mut stacked = L::Params::mirror_leaves(p);
        stacked.push(Tensor::iota(DType::U32, &[self.depth], 0));
        let (carry, _) =
            Scan::new()
                .length(self.depth)
                .remat(self.remat)
                .run(&[x], &stacked, |h, slices| {
                    let (index, leaves) = slices.split_last().expect("the layer index is a slice");
                    let mut leaves = leaves.iter();
                    let view = L::Params::map_mirror(p, &mut |_| {
                        *leaves.next().expect("one slice per stacked leaf")
                    });
                    let h = with_layer_key(*index, || self.layer.forward(&view, h[0]));
                    (vec![h], vec![])
                });
        carry[0]
    }
}

impl<L: Layer> Repeated<L> {
    /// The layer, for [`init_stack`] (which takes a slice of layers).
    fn layer_copy(&self) -> LayerRef<'_, L> {
        LayerRef(&self.layer)
    }
}

/// A borrowed layer, so `init_stack` can seed `depth` copies without `L: Clone`.
struct LayerRef<'a, L>(&'a L);

impl<L> Clone for LayerRef<'_, L> {
    fn clone(&self) -> Self {
        LayerRef(self.0)
    }
}

impl<L: Layer> Layer for LayerRef<'_, L> {
    type Params = L::Params;
    fn init(&self, seed: Seed) -> L::Params {
        self.0.init(seed)
    }
    fn forward(&self, p: &<L::Params as Tree>::Mirror<Tensor>, x: Tensor) -> Tensor {
        self.0.forward(p, x)
    }
}

/// Arrays of `template`'s type stacked along a new leading axis (none: zero rows).
fn stack(template: &Array, parts: &[Array]) -> Result<Array> {
    let mut dims = vec![parts.len()];
    dims.extend(template.dims());
    let datas: Vec<&ArrayData> = parts.iter().map(|a| a.data()).collect();
    let data =
        ArrayData::concat(template.data(), &datas).ok_or_else(|| Error::InvalidDataArgument {
            what: "Repeated::stack_params: the layers' leaves differ in dtype".into(),
        })?;
    Array::from_data(&dims, data)
}
