//! Trainable leaves created on the devices ([`Config::initialize`]): an initializer program —
//! traced, keyed and cached like every other — whose outputs are the leaves, each sharded as
//! the handle keeps it, so on a mesh every device draws only its own shard.

use super::*;
use crate::init::Init;
use crate::pattern::path_match;
use config::InitRule;

/// One leaf the initializer program creates: its path (its key is folded from it), type, rule
/// and, on a mesh, its spec's dims (empty off a mesh).
#[derive(crate::ContentHash, Clone, Debug, PartialEq)]
pub struct CreatedLeaf {
    /// The leaf's path.
    pub path: String,
    /// Its dtype and dims.
    pub ty: LeafType,
    /// How it is created.
    pub init: Init,
    /// How it is split over the mesh (per dim, the axis or none); empty off a mesh.
    pub spec: Vec<Option<String>>,
}

/// The initializer program's experiment: the leaves it creates shape it (GraphConst), and the
/// run's key is its one Device input.
#[crate::experiment]
pub struct Initializer {
    /// The leaves, in the handle's walk order.
    #[graph_const]
    pub leaves: Vec<CreatedLeaf>,
    /// The run's key, `u32[2]` (`PRNGKey(seed)`).
    #[device]
    pub key: Array,
}

fn initialize_fn(v: &InitializerView<'_>, _: &()) -> Vec<Tensor> {
    if v.leaves.iter().any(|l| !l.spec.is_empty()) {
        crate::shard::declare_groups(
            v.leaves
                .iter()
                .map(|l| (l.path.clone(), crate::shard::PartitionSpec(l.spec.clone())))
                .collect(),
        );
    }
    v.leaves
        .iter()
        .map(|l| l.init.trace(v.key, &l.path, &l.ty))
        .collect()
}

fn initializer_program() -> Program<Initializer, (), Vec<Tensor>> {
    Initializer::program("nitro.initialize", initialize_fn).grouped_outputs()
}

/// The leaves `rules` create among the trainable leaves of `layout`, each with its group index:
/// the first rule that matches a path applies. A required rule that matches no trainable leaf
/// (or only leaves that are not trainable), rules none of which match, and a random rule on a
/// leaf that is not floating-point are refused, naming them.
pub(super) fn plan<E: Experiment>(
    rules: &[InitRule],
    layout: &Layout,
    experiment: &E,
) -> Result<Vec<(usize, CreatedLeaf)>> {
    if rules.is_empty() {
        return Ok(Vec::new());
    }
    let types = layout.packing.leaf_types();
    let mut used = vec![false; rules.len()];
    let mut out = Vec::new();
    for (g, (path, ty)) in layout.paths.iter().zip(&types).enumerate() {
        let Some(r) = rules
            .iter()
            .position(|rule| path_match(&rule.pattern, path))
        else {
            continue;
        };
        used[r] = true;
        let init = rules[r].init;
        if init.is_random() && !ty.dtype.is_float() {
            return Err(Error::InvalidSetting {
                variable: "Config::initialize",
                value: format!("{} → {init:?}", rules[r].pattern),
                expected: format!(
                    "a constant for leaf `{path}`, which is {ty}: random draws make \
                     floating-point leaves"
                ),
            });
        }
        let spec = crate::shard::group_spec(&layout.specs, g).0.clone();
        let spec = match layout.specs.is_empty() {
            true => Vec::new(),
            false => spec,
        };
        out.push((
            g,
            CreatedLeaf {
                path: path.clone(),
                ty: ty.clone(),
                init,
                spec,
            },
        ));
    }
    // A rule given alone must apply; of a set, one must.
    let unused = rules
        .iter()
        .zip(&used)
        .position(|(rule, used)| !used && rule.required)
        .or_else(|| (!used.contains(&true)).then_some(0));
    if let Some(r) = unused {
        let pattern = &rules[r].pattern;
        let mut frozen = Vec::new();
        experiment.visit_device(&mut |field, path, node| {
            if matches!(node, Node::Leaf(_))
                && field.role != (Role::Device { trainable: true })
                && path_match(pattern, path.as_str())
            {
                frozen.push(path.as_str().to_owned());
            }
        });
        let shown: Vec<&str> = layout.paths.iter().take(8).map(String::as_str).collect();
        let why = match frozen.first() {
            Some(leaf) => format!(
                "it matches only leaves that are not trainable (`{leaf}`), which are read from \
                 the experiment"
            ),
            None => format!(
                "it matches no trainable leaf of {}; they are named like {}{}",
                E::TYPE_PATH,
                shown.join(", "),
                if layout.paths.len() > shown.len() {
                    ", …"
                } else {
                    ""
                }
            ),
        };
        return Err(Error::InvalidSetting {
            variable: "Config::initialize",
            value: pattern.clone(),
            expected: format!("a pattern of trainable leaves to create: {why}"),
        });
    }
    Ok(out)
}

/// Creates `leaves` on `backend`'s devices from `seed`'s key: the initializer program (got
/// from `cache`) run once; one value per leaf, each as the handle keeps its group.
pub(super) fn create(
    backend: &'static dyn Backend,
    cache: &Cache,
    leaves: Vec<CreatedLeaf>,
    seed: u64,
) -> Result<Vec<Value>> {
    let key = crate::trace::random::key(seed);
    let initializer = Initializer { leaves, key };
    let served = cache.get(backend, &initializer_program(), &initializer, &())?;
    let (values, done) = values::exec(&served.compiled, vec![In::Whole(&initializer.key)])?;
    for d in done {
        d.wait()?;
    }
    Ok(values)
}

/// The values a handle creates for the leaf at `path` of type `ty` under `init` from `seed`
/// ([`Config::initialize`]): the initializer program of that one leaf, got from `cache` and
/// run on `backend` (unpartitioned). A leaf's values depend only on the seed, its path, its
/// type and its rule — not on the mesh, nor on the other leaves — so this is what any handle
/// creates for it, on one device or split over many.
///
/// ```
/// use nitro::init::Init;
/// use nitro::LeafType;
/// use nitro::DType;
///
/// let backend = nitro::backend::interpreter();
/// let cache = nitro::cache::global();
/// let ty = LeafType::new(DType::F32, &[4, 16]);
/// let w = nitro::train::create_leaf(backend, cache, 11, "layers[0].w", &ty, Init::GlorotUniform)?;
/// let limit = (6.0f32 / 20.0).sqrt();
/// assert!(w.as_slice::<f32>()?.iter().all(|v| v.abs() <= limit));
/// # Ok::<(), nitro::Error>(())
/// ```
pub fn create_leaf(
    backend: &'static dyn Backend,
    cache: &Cache,
    seed: u64,
    path: &str,
    ty: &LeafType,
    init: Init,
) -> Result<Array> {
    if init.is_random() && !ty.dtype.is_float() {
        return Err(Error::InvalidSetting {
            variable: "Config::initialize",
            value: format!("{path} → {init:?}"),
            expected: format!(
                "a constant for a leaf of {ty}: random draws make floating-point leaves"
            ),
        });
    }
    let leaf = CreatedLeaf {
        path: path.to_owned(),
        ty: ty.clone(),
        init,
        spec: Vec::new(),
    };
    let values = create(backend, cache, vec![leaf], seed)?;
    values.first().ok_or_else(state::unplaced)?.to_host()
}
