//! Trainable leaves created on the devices ([`Config::initialize`]): an initializer program —
//! traced, keyed and cached like every other — whose outputs are the leaves, each sharded as
//! the handle keeps it, so on a mesh every device draws only its own shard.

use super::*;
use crate::init::Init;
use crate::pattern::path_match;
use config::InitRule;

/// One leaf the initializer program creates: its path (its key is folded from it), type and
/// rule. How it is split over a mesh is the program's [`Initializer::layout`].
#[derive(crate::ContentHash, Clone, Debug, PartialEq)]
pub struct CreatedLeaf {
    /// The leaf's path.
    pub path: String,
    /// Its dtype and dims.
    pub ty: LeafType,
    /// How it is created.
    pub init: Init,
}

/// The initializer program's experiment: the leaves it creates shape it (GraphConst), and the
/// run's key is its one Device input.
#[crate::experiment]
pub struct Initializer {
    /// The leaves, in the handle's walk order.
    #[graph_const]
    pub leaves: Vec<CreatedLeaf>,
    /// On a mesh, each leaf's path and spec (empty off a mesh): keyed by the mesh's axes'
    /// positions, so a renamed mesh keys the same program ([`crate::shard::GroupLayout`]).
    #[graph_const]
    pub layout: crate::shard::GroupLayout,
    /// The run's key, `u32[2]` (`PRNGKey(seed)`).
    #[device]
    pub key: Array,
}

fn initialize_fn(v: &InitializerView<'_>, _: &()) -> Vec<Tensor> {
    if !v.layout.is_empty() {
        crate::shard::declare_groups(v.layout.groups().to_vec());
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
    // A rule whose parameters cannot make a finite leaf is refused whether or not it matches.
    for rule in rules {
        if let Some(problem) = rule.init.problem() {
            return Err(refused(&rule.pattern, None, rule.init, problem));
        }
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
        if let Some(problem) = init.problem_for(ty) {
            return Err(refused(&rules[r].pattern, Some(path), init, problem));
        }
        out.push((
            g,
            CreatedLeaf {
                path: path.clone(),
                ty: ty.clone(),
                init,
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

/// The refusal of the rule `pattern → init` ([`Config::initialize`]), for leaf `leaf` when it
/// is about one leaf: `problem` says what is wrong and what to do.
fn refused(pattern: &str, leaf: Option<&str>, init: Init, problem: String) -> Error {
    refused_by("Config::initialize", pattern, leaf, init, problem)
}

/// [`refused`], for the rules given to `variable`.
fn refused_by(
    variable: &'static str,
    pattern: &str,
    leaf: Option<&str>,
    init: Init,
    problem: String,
) -> Error {
    Error::InvalidSetting {
        variable,
        value: format!("{pattern} → {init:?}"),
        expected: match leaf {
            Some(leaf) => format!("a rule that can create leaf `{leaf}`: {problem}"),
            None => format!("a rule that can create the leaves `{pattern}` matches: {problem}"),
        },
    }
}

/// Creates `leaves` (groups `groups` of `layout`) on `backend`'s devices from `seed`'s key:
/// the initializer program (got from `cache`) run once; one value per leaf, each as the handle
/// keeps its group.
pub(super) fn create(
    backend: &'static dyn Backend,
    cache: &Cache,
    leaves: Vec<CreatedLeaf>,
    groups: &[usize],
    layout: &Layout,
    seed: u64,
) -> Result<Vec<Value>> {
    let key = crate::trace::random::key(seed);
    let specs = match layout.specs.is_empty() {
        true => Vec::new(),
        false => leaves
            .iter()
            .zip(groups)
            .map(|(l, &g)| {
                (
                    l.path.clone(),
                    crate::shard::group_spec(&layout.specs, g).clone(),
                )
            })
            .collect(),
    };
    let mesh = backend.partitioning().map(|p| p.mesh());
    let layout = crate::shard::GroupLayout::new(mesh, specs);
    let initializer = Initializer {
        leaves,
        layout,
        key,
    };
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
    if let Some(problem) = init.problem_for(ty) {
        return Err(refused(path, Some(path), init, problem));
    }
    let leaf = CreatedLeaf {
        path: path.to_owned(),
        ty: ty.clone(),
        init,
    };
    let initializer = Initializer {
        leaves: vec![leaf],
        layout: crate::shard::GroupLayout::default(),
        key: crate::trace::random::key(seed),
    };
    let served = cache.get(backend, &initializer_program(), &initializer, &())?;
    let (values, done) = values::exec(&served.compiled, vec![In::Whole(&initializer.key)])?;
    for d in done {
        d.wait()?;
    }
    values.first().ok_or_else(state::unplaced)?.to_host()
}

/// Creates on the host, in `experiment`, the trainable leaves that a handle made with
/// [`Config::initialize_all`]`(rules)` and [`Config::seed`]`(seed)` would create on its devices:
/// the same rules matched the same way (the first rule that matches a leaf's path applies, and
/// one of them must apply), each leaf's values from [`Init::on_host`] — the same Threefry bits
/// and the same arithmetic as the initializer program. So a run moved between host and device
/// creation starts from the same model: bit for bit on the interpreter, and on XLA to within
/// the last bits of the draws that XLA computes with a fused multiply-add
/// (`runtime/tests/init_rules.rs` holds both). Leaves no rule matches, and leaves that are not
/// trainable, keep their values.
///
/// ```
/// use nitro::init::{self, layer_defaults, Seed};
/// use nitro::nn::{self, Layer, Linear};
/// use nitro::prelude::*;
///
/// #[experiment]
/// pub struct Mlp {
///     #[device(trainable)] pub layers: Vec<nn::LinearParams>,
/// }
///
/// let widths = [Linear::new(4, 16), Linear::new(16, 3)];
/// // Declared: nothing is drawn until the rules fill the leaves.
/// let mut mlp = init::declared(|| Mlp { layers: nn::init_stack(&widths, Seed(0)) });
/// nitro::train::initialize_on_host(&mut mlp, layer_defaults(), 7)?;
/// assert!(mlp.layers[0].w.as_slice::<f32>()?.iter().any(|&v| v != 0.0));
/// # Ok::<(), nitro::Error>(())
/// ```
///
/// Errors: [`Error::InvalidSetting`] for a rule that cannot create a leaf it matches (see
/// [`Init::problem_for`]), or rules none of which match a trainable leaf.
pub fn initialize_on_host<E: Experiment, P: Into<String>>(
    experiment: &mut E,
    rules: impl IntoIterator<Item = (P, Init)>,
    seed: u64,
) -> Result<()> {
    const VARIABLE: &str = "train::initialize_on_host";
    let rules: Vec<(String, Init)> = rules.into_iter().map(|(p, i)| (p.into(), i)).collect();
    for (pattern, init) in &rules {
        if let Some(problem) = init.problem() {
            return Err(refused_by(VARIABLE, pattern, None, *init, problem));
        }
    }
    let mut failed: Option<Error> = None;
    let mut applied = false;
    experiment.visit_device_mut(&mut |field, path, leaf| {
        if failed.is_some() || field.role != (Role::Device { trainable: true }) {
            return;
        }
        let path = path.as_str();
        let Some((pattern, init)) = rules.iter().find(|(p, _)| path_match(p, path)) else {
            return;
        };
        applied = true;
        let ty = leaf.leaf_type();
        if let Some(problem) = init.problem_for(&ty) {
            failed = Some(refused_by(VARIABLE, pattern, Some(path), *init, problem));
            return;
        }
        match init.on_host(seed, path, &ty) {
            Ok(values) => *leaf = values,
            Err(e) => failed = Some(e),
        }
    });
    if let Some(e) = failed {
        return Err(e);
    }
    if !applied && !rules.is_empty() {
        let patterns: Vec<&str> = rules.iter().map(|(p, _)| p.as_str()).collect();
        return Err(Error::InvalidSetting {
            variable: VARIABLE,
            value: patterns.join(", "),
            expected: format!(
                "patterns of trainable leaves of {} to create: none of these matches one",
                E::TYPE_PATH
            ),
        });
    }
    Ok(())
}
