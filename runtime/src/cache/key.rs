//! The compile key: what a program's key is made of (its components, the details kept to
//! name what moved, the persistent key), computed once per lookup or once per experiment
//! ([`Prepared`]).

use super::*;

/// What a key is made of, kept per entry (and, with a store, per program beside it) so that the
/// next miss can name what moved.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub(super) struct KeyDetails {
    /// The program identity, in words.
    pub(super) program: String,
    pub(super) graph_const: Digest,
    pub(super) graph_const_fields: Vec<(String, Digest)>,
    /// The GraphConst fields' parts ([`Experiment::graph_const_field_parts`]): what a miss
    /// names the moved sub-fields from (empty in details recorded before they were kept).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(super) graph_const_parts: Vec<crate::hash::Part>,
    pub(super) settings: Digest,
    /// The whole input structure: Device fields, then the program's inputs.
    pub(super) signature: Signature,
    pub(super) backend: Digest,
    pub(super) backend_components: Vec<(String, String)>,
    pub(super) options: Digest,
    pub(super) fingerprint: Digest,
    /// On a mesh, each input's name and spec (empty off one, and in details stored before
    /// partitioned programs).
    #[serde(default)]
    pub(super) shardings: Vec<(String, String)>,
    /// The dtype the program computes in when it is not its leaves' own (a handle's
    /// [`Precision`](crate::train::Precision)); absent in details stored before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) compute: Option<String>,
    /// Whether the program's inputs are the trainable leaves' groups as laid out on its mesh
    /// ([`Traced::grouped`]): a change of the partitioning changes its layout and inputs
    /// with it. False in details stored before it was kept.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(super) grouped: bool,
}

/// How [`MissReason::SettingChanged`] names a program's compute dtype.
fn compute_named(compute: &Option<String>) -> String {
    compute
        .clone()
        .unwrap_or_else(|| "the leaves' dtypes".to_owned())
}

impl KeyDetails {
    /// What moved from `self` (an earlier use) to `now`, every component of it, in the order a
    /// user fixes things: the mesh and the handle's settings, the GraphConsts, the input
    /// structure, the backend, the options; the code only when nothing else moved (any other
    /// change moves the fingerprint too). One reason for one component,
    /// [`MissReason::Several`] for more; `None` when nothing moved.
    ///
    /// What a change of the backend or the partitioning brings with it is not named again:
    /// compile options that moved with the backend (they hold its device count), and, in a
    /// program whose inputs are the trainable leaves' groups laid out on the mesh (the update
    /// program's), the layout GraphConst and the inputs' structure.
    pub(super) fn moved_to(&self, now: &KeyDetails) -> Option<MissReason> {
        let mut reasons = Vec::new();
        // The partitioning: the mesh and sharding the backend partitions over (a component of
        // its identity; its digest holds only the mesh's shape).
        let partitioning = |details: &KeyDetails| {
            details
                .backend_components
                .iter()
                .find(|(name, _)| name == "sharding")
                .map(|(_, value)| value.clone())
        };
        let (mesh_before, mesh_now) = (partitioning(self), partitioning(now));
        let partitioning_moved = mesh_before != mesh_now;
        // On the same mesh shape, a spec that moved says the most (a leaf, both specs).
        let spec_moved = (!self.shardings.is_empty()
            && !now.shardings.is_empty()
            && now.backend == self.backend)
            .then(|| {
                now.shardings.iter().find_map(|(input, to)| {
                    let (_, from) = self.shardings.iter().find(|(i, _)| i == input)?;
                    (from != to).then(|| MissReason::ShardingChanged {
                        input: input.clone(),
                        from: from.clone(),
                        to: to.clone(),
                    })
                })
            })
            .flatten();
        match spec_moved {
            Some(moved) => reasons.push(moved),
            // A mesh that came, went, changed shape, or kept its shape with its axes in
            // another order (every spec reads the same, each axis another position).
            None if partitioning_moved => reasons.push(MissReason::BackendChanged {
                component: "sharding".to_owned(),
                from: mesh_before.unwrap_or_else(|| "absent".to_owned()),
                to: mesh_now.unwrap_or_else(|| "absent".to_owned()),
            }),
            None => {}
        }
        let laid_out = partitioning_moved && (self.grouped || now.grouped);

        // The precision the handle computes in: named as a setting, not a GraphConst.
        if now.compute != self.compute {
            reasons.push(MissReason::SettingChanged {
                setting: "precision".to_owned(),
                from: compute_named(&self.compute),
                to: compute_named(&now.compute),
            });
        }

        let before = |name: &str| {
            self.graph_const_fields
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, d)| d)
        };
        let mut fields: Vec<String> = now
            .graph_const_fields
            .iter()
            .filter(|(name, digest)| before(name) != Some(digest))
            .map(|(name, _)| name.clone())
            .collect();
        fields.extend(
            self.graph_const_fields
                .iter()
                .filter(|(name, _)| !now.graph_const_fields.iter().any(|(n, _)| n == name))
                .map(|(name, _)| name.clone()),
        );
        if now.settings != self.settings {
            fields.push("<handle>".to_owned());
        }
        if fields.is_empty() && now.graph_const != self.graph_const {
            fields.push("<graph_const>".to_owned());
        }
        if !fields.is_empty() && !laid_out {
            let changes = reason::graph_const_changes(
                &self.graph_const_parts,
                &now.graph_const_parts,
                &fields,
            );
            reasons.push(MissReason::GraphConstChanged { fields, changes });
        }

        let changes = self.signature.diff(&now.signature);
        if !changes.is_empty() && !laid_out {
            reasons.push(MissReason::SignatureChanged { changes });
        }

        if now.backend != self.backend {
            // Named by its first component that moved, besides the partitioning named above.
            let others = |list: &[(String, String)]| -> Vec<(String, String)> {
                list.iter()
                    .filter(|(name, _)| name != "sharding")
                    .cloned()
                    .collect()
            };
            let moved = Identity::first_difference(
                &others(&self.backend_components),
                &others(&now.backend_components),
            );
            match moved {
                Some((component, from, to)) => reasons.push(MissReason::BackendChanged {
                    component,
                    from,
                    to,
                }),
                None if !partitioning_moved => reasons.push(MissReason::BackendChanged {
                    component: "identity".to_owned(),
                    from: self.backend.short().to_string(),
                    to: now.backend.short().to_string(),
                }),
                None => {}
            }
        }
        // Options that moved with the backend (they hold its device count) are its change.
        if now.options != self.options && now.backend == self.backend && !partitioning_moved {
            reasons.push(MissReason::OptionsChanged);
        }
        if reasons.is_empty() && now.fingerprint != self.fingerprint {
            reasons.push(MissReason::CodeChanged {
                from: self.fingerprint.short().to_string(),
                to: now.fingerprint.short().to_string(),
            });
        }
        MissReason::of_changes(reasons)
    }
}

/// Feeds one node of a walk into the signature digest: its path and kind (leaf types, sequence
/// lengths, option presence), never values. Must agree with [`Signature`]'s entries: a walk
/// that differs in any node gives another digest.
pub(super) fn walk_digest(h: &mut ContentHasher, path: &str, node: Node<'_>) {
    h.write_str(path);
    match node {
        Node::Leaf(a) => {
            h.write_u8(0);
            crate::ContentHash::content_hash(&a.dtype(), h);
            h.write_len(a.dims().len());
            for &d in a.dims() {
                h.write_len(d);
            }
        }
        Node::Seq(len) => {
            h.write_u8(1);
            h.write_len(len);
        }
        Node::None => h.write_u8(2),
        Node::Some => h.write_u8(3),
    }
}

/// The full key of a held program: the key's components and the emitted program's fingerprint.
pub(super) fn full_key(components: &Digest, fingerprint: &Digest) -> Digest {
    let mut h = ContentHasher::new();
    h.write_digest(components);
    h.write_digest(fingerprint);
    h.finish()
}

/// An experiment with its GraphConst digests computed once, for many lookups
/// ([`Cache::get_prepared`]).
///
/// It borrows the experiment, so no GraphConst can change while it lives: the digests always
/// describe the values the program is traced from. (GraphConst types have no interior
/// mutability — `ContentHash` rules it out — so a shared borrow freezes them.)
///
/// ```
/// use nitro::prelude::*;
/// use nitro::cache::{Cache, Prepared};
/// use nitro::program::Program;
///
/// #[experiment]
/// pub struct Scale { #[graph_const] pub k: u32, #[device] pub w: Array }
///
/// fn apply(v: &ScaleView<'_>, x: &Tensor) -> Tensor { *x * v.w * f64::from(*v.k) }
/// const APPLY: Program<Scale, Tensor> = Scale::program("apply", apply);
///
/// let cache = Cache::in_memory(4);
/// let exp = Scale { k: 2, w: Array::full(&[3], 1.0f32) };
/// let prepared = Prepared::new(&exp);
/// for _ in 0..3 {
///     let x = Array::full(&[3], 0.5f32);
///     cache.get_prepared(nitro::backend::interpreter(), &APPLY, &prepared, &x)?;
/// }
/// assert_eq!((cache.stats().misses, cache.stats().hits), (1, 2));
/// # Ok::<(), nitro::Error>(())
/// ```
///
/// A GraphConst cannot change while its digests are in use:
///
/// ```compile_fail
/// # use nitro::prelude::*;
/// # use nitro::cache::Prepared;
/// # #[experiment] pub struct Scale { #[graph_const] pub k: u32, #[device] pub w: Array }
/// let mut exp = Scale { k: 2, w: Array::full(&[3], 1.0f32) };
/// let prepared = Prepared::new(&exp);
/// exp.k = 3; // error: `exp` is borrowed by `prepared`
/// drop(prepared);
/// ```
#[derive(Debug)]
pub struct Prepared<'e, E: Experiment> {
    pub(super) experiment: &'e E,
    pub(super) fields: Vec<(&'static str, Digest)>,
    pub(super) graph_const: Digest,
}

impl<'e, E: Experiment> Prepared<'e, E> {
    /// Hashes `experiment`'s GraphConst fields.
    pub fn new(experiment: &'e E) -> Prepared<'e, E> {
        let fields = experiment.graph_const_field_digests();
        let graph_const = crate::experiment::combine_graph_const::<E>(&fields);
        Prepared {
            experiment,
            fields,
            graph_const,
        }
    }

    /// The experiment.
    pub fn experiment(&self) -> &'e E {
        self.experiment
    }

    /// Its GraphConst digest ([`Experiment::graph_const_digest`]).
    pub fn graph_const_digest(&self) -> Digest {
        self.graph_const
    }
}

/// Key parts computed once by their owner: the GraphConst digests of an experiment it holds
/// (and recomputes whenever a GraphConst changes) and the digest of the handle settings that
/// shape the program. Crate-internal: see [`Cache::get_keyed`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct KeyParts<'a> {
    /// [`Experiment::graph_const_digest`].
    pub graph_const: Digest,
    /// [`Experiment::graph_const_field_digests`].
    pub graph_const_fields: &'a [(&'static str, Digest)],
    /// Digest of handle settings that shape the program (masking, accumulation, …).
    pub settings: Digest,
}

/// The key's components: program identity (the experiment type with its generic arguments,
/// and the name), GraphConsts, settings, signature, backend, options. The program's code is not
/// among them — its address is not an identity (one `fn` can have several) — so a held program
/// is found by components and code address together, and a new address is traced once and
/// matched by fingerprint.
pub(super) fn key_components<E: Experiment, M, O: Outputs, I: Tree<Mirror<Tensor> = M>>(
    backend: &dyn Backend,
    program: &Program<E, M, O>,
    experiment: &E,
    inputs: &I,
    parts: &KeyParts<'_>,
) -> Digest {
    let identity = backend.identity();
    // The signature digest walks the structure and leaf types, never values: the cost is per
    // node, not per byte.
    let mut h = ContentHasher::new();
    // Each Device leaf's role too: trainable or not changes the traced program (its
    // gradients), so two experiments that differ only there never share a route.
    experiment.visit_device(&mut |field, path, node| {
        h.write_str(field.role.label());
        walk_digest(&mut h, path.as_str(), node)
    });
    inputs.visit(&mut LeafPath::root(""), &mut |path, node| {
        walk_digest(&mut h, crate::program::input_name(path.as_str()), node)
    });
    let signature = h.finish();
    let mut k = ContentHasher::new();
    k.write_str(std::any::type_name::<E>());
    // `type_name` is not unique (two block-local `Net`s, two versions of one crate): the
    // schema (every field's name, type and role) and, where the type has one to give, its
    // `TypeId` (this process only: these components never leave memory) tell them apart.
    k.write_digest(&E::SCHEMA_DIGEST);
    if let Some(id) = E::type_identity() {
        use std::hash::{Hash, Hasher};
        let mut t = std::collections::hash_map::DefaultHasher::new();
        id.hash(&mut t);
        k.write_u8(1);
        k.write_u64(t.finish());
    } else {
        k.write_u8(0);
    }
    k.write_str(program.name());
    k.write_u8(program.layout_flags());
    if program.donated_inputs() > 0 {
        k.write_u64(program.donated_inputs() as u64);
    }
    match program.compute() {
        None => k.write_u8(0),
        Some(dtype) => {
            k.write_u8(1);
            crate::ContentHash::content_hash(&dtype, &mut k);
        }
    }
    k.write_digest(&parts.graph_const);
    k.write_digest(&parts.settings);
    k.write_digest(&signature);
    k.write_digest(&identity.digest);
    k.write_digest(&identity.options);
    if let Some(p) = backend.partitioning() {
        k.write_digest(&resolved_layout(p, experiment));
    }
    k.finish()
}

/// What decides how a program on `partitioning` splits its arrays, resolved, with the mesh's
/// axes named by position (as the program's text names them): the mesh's shape, the batch
/// axis, and each trainable leaf's spec by the sharding's rules. Two shardings whose rules
/// resolve alike (a `Sharding::leaf` pattern restating what FSDP gives the leaf) have one
/// digest, and share programs; so do two meshes that differ only in their axes' names
/// (`data=4`, `batch=4`), while a mesh whose axes are reordered (`data=2, model=2`,
/// `model=2, data=2`) splits differently and has another. The backend's identity holds only
/// the mesh's shape.
pub(super) fn resolved_layout<E: Experiment>(
    partitioning: &crate::shard::Partitioning,
    experiment: &E,
) -> Digest {
    let mut h = ContentHasher::new();
    let mesh = partitioning.mesh();
    h.write_len(mesh.axes().len());
    for (_, size) in mesh.axes() {
        h.write_len(*size);
    }
    let axis = partitioning.sharding().axis();
    match mesh.axes().iter().position(|(name, _)| name == axis) {
        Some(i) => {
            h.write_u8(0);
            h.write_len(i);
        }
        // Not a mesh's axis (a `Partitioning` refuses it): keyed by its name.
        None => {
            h.write_u8(1);
            h.write_str(axis);
        }
    }
    experiment.visit_device(&mut |field, path, node| {
        let trainable = field.role == (crate::experiment::Role::Device { trainable: true });
        if let (true, crate::tree::Node::Leaf(a)) = (trainable, node) {
            h.write_str(path.as_str());
            // A spec that does not fit is the trace's error; its text keys the same.
            match partitioning.leaf_spec(path.as_str(), &a.leaf_type()) {
                Ok(spec) => h.write_str(&spec.canonical_in(mesh).to_string()),
                Err(e) => h.write_str(&e.to_string()),
            }
        }
    });
    h.finish()
}

/// What the key of a traced program is made of.
pub(super) fn key_details(
    backend: &dyn Backend,
    program_id: &str,
    traced: &Traced,
    parts: &KeyParts<'_>,
    graph_const_parts: Vec<crate::hash::Part>,
) -> KeyDetails {
    let identity = backend.identity();
    KeyDetails {
        program: program_id.to_owned(),
        graph_const: parts.graph_const,
        graph_const_fields: parts
            .graph_const_fields
            .iter()
            .map(|(n, d)| ((*n).to_owned(), *d))
            .collect(),
        graph_const_parts,
        settings: parts.settings,
        signature: traced.structure.clone(),
        backend: identity.digest,
        backend_components: identity.components.clone(),
        options: identity.options,
        fingerprint: traced.fingerprint,
        shardings: traced
            .graph
            .sharding
            .iter()
            .flat_map(|s| {
                traced
                    .graph
                    .inputs
                    .iter()
                    .zip(&s.inputs)
                    .map(|(input, spec)| (input.name.clone(), spec.to_string()))
            })
            .collect(),
        compute: traced.compute.map(|d| d.to_string()),
        grouped: traced.grouped,
    }
}

/// The persistent store's key of a traced program: its fingerprint on this backend and options.
pub(super) fn l2_key(backend: &dyn Backend, fingerprint: &Digest) -> Digest {
    let identity = backend.identity();
    let mut s = ContentHasher::new();
    s.write_digest(fingerprint);
    s.write_digest(&identity.digest);
    s.write_digest(&identity.options);
    s.finish()
}
