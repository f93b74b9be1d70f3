//! Issue 50, items 11 and 15: the in-memory cache keys a mesh by its partitioning, not its
//! axis names (a renamed mesh is a hit in one process, as it is a load across processes); a
//! mesh whose axes are reordered misses naming the mesh, never `code_changed`; and a miss
//! names every component of the key that moved, not only the first.
#![allow(missing_docs)]

mod common;

#[path = "common/mlp.rs"]
mod mlp;

use common::xla_devices_or_skip;
use mlp::*;
use nitro::backend::{self, Backend};
use nitro::cache::{Cache, MissReason, Outcome};
use nitro::optim::Adam;
use nitro::shard::{Mesh, Sharding};
use nitro::train::{Config, Nitro, Precision};

/// A cache with no persistent level: what is not in memory compiles.
fn memory_only() -> &'static Cache {
    Box::leak(Box::new(Cache::in_memory(32)))
}

/// FSDP along `axis` over a mesh of `axes`.
fn meshed(axes: &[(&str, usize)], axis: &str) -> Config {
    Config::new()
        .mesh(Mesh::new(axes.iter().copied()).unwrap())
        .sharding(Sharding::fsdp(axis))
        .batch(8)
        .lr(0.02)
}

fn partitioned(config: &Config) -> &'static dyn Backend {
    backend::for_mesh(&config.partitioning().unwrap().unwrap()).unwrap()
}

/// Prepares a handle on the classifier with `config` on `backend` and `cache`, then takes two
/// steps: the lookups' outcomes and the losses.
fn prepare_and_train(
    config: Config,
    backend: &'static dyn Backend,
    cache: &'static Cache,
) -> (Vec<Outcome>, Vec<f64>) {
    let (x, y) = data(16, 9);
    let mut run = Nitro::with_backend(mlp(Act::Tanh), Adam::default(), config, backend, cache)
        .expect("handle");
    let outcomes = run.prepare(&batch(&x, &y, 0, 8, 8)).expect("prepare");
    let losses = [0, 8]
        .iter()
        .map(|&start| run.step(&batch(&x, &y, start, 8, 8), 8).unwrap().loss)
        .collect();
    (outcomes, losses)
}

/// Whether `reason` has a component `backend_changed: sharding …` whose two sides contain
/// `from` and `to`.
fn names_the_mesh(reason: &MissReason, from: &str, to: &str) -> bool {
    reason.components().iter().any(|r| {
        matches!(r, MissReason::BackendChanged { component, from: a, to: b }
            if component == "sharding" && a.contains(from) && b.contains(to))
    })
}

#[test]
fn a_renamed_mesh_is_served_from_memory_without_a_compile() {
    let test = "a_renamed_mesh_is_served_from_memory_without_a_compile";
    let Some(_) = xla_devices_or_skip(test, 4) else {
        return;
    };
    let cache = memory_only();
    let config = meshed(&[("data", 4)], "data");
    let (first, losses) = prepare_and_train(config.clone(), partitioned(&config), cache);
    assert!(first.iter().all(|o| !o.is_hit()), "{first:?}");
    let compiles = cache.stats().compiles;

    // The same partitioning under other axis names: every program is held already.
    let renamed = meshed(&[("batch", 4)], "batch");
    let (outcomes, again) = prepare_and_train(renamed.clone(), partitioned(&renamed), cache);
    assert!(
        outcomes.iter().all(Outcome::is_hit),
        "a renamed mesh must not compile again: {outcomes:?}"
    );
    assert_eq!(cache.stats().compiles, compiles, "nothing compiled again");
    assert_eq!(losses, again, "the same programs, the same numbers");

    // A mesh of two axes renamed, too.
    let two = meshed(&[("data", 2), ("model", 2)], "data");
    let (outcomes, _) = prepare_and_train(two.clone(), partitioned(&two), cache);
    assert!(outcomes.iter().all(|o| !o.is_hit()), "{outcomes:?}");
    let compiles = cache.stats().compiles;
    let renamed = meshed(&[("rows", 2), ("cols", 2)], "rows");
    let (outcomes, _) = prepare_and_train(renamed.clone(), partitioned(&renamed), cache);
    assert!(outcomes.iter().all(Outcome::is_hit), "{outcomes:?}");
    assert_eq!(cache.stats().compiles, compiles);
}

#[test]
fn a_mesh_with_its_axes_swapped_misses_naming_the_mesh() {
    let test = "a_mesh_with_its_axes_swapped_misses_naming_the_mesh";
    let Some(_) = xla_devices_or_skip(test, 4) else {
        return;
    };
    let cache = memory_only();
    let config = meshed(&[("data", 2), ("model", 2)], "data");
    let (first, losses) = prepare_and_train(config.clone(), partitioned(&config), cache);
    assert!(first.iter().all(|o| !o.is_hit()), "{first:?}");

    // The same names and sizes in the other order: `data` is now the second axis, so every
    // array is split across other devices — other programs, each miss naming the mesh.
    let swapped = meshed(&[("model", 2), ("data", 2)], "data");
    let (outcomes, again) = prepare_and_train(swapped.clone(), partitioned(&swapped), cache);
    assert_eq!(outcomes.len(), 2, "{outcomes:?}");
    for outcome in &outcomes {
        let reason = match outcome {
            Outcome::Compiled { reason } => reason,
            other => panic!("a swapped mesh must compile its own programs: {other}"),
        };
        assert!(
            names_the_mesh(reason, "[data=2, model=2]", "[model=2, data=2]"),
            "the reason must name both meshes: {reason}"
        );
        assert!(
            !reason
                .components()
                .iter()
                .any(|r| matches!(r, MissReason::CodeChanged { .. })),
            "not `code_changed`: {reason}"
        );
        assert!(reason.to_string().contains("model=2, data=2"), "{reason}");
    }
    // Both layouts train the same model.
    for (a, b) in losses.iter().zip(&again) {
        assert!((a - b).abs() <= 1e-5 * (1.0 + a.abs()), "{a} vs {b}");
    }
}

#[test]
fn going_onto_a_mesh_and_to_bf16_names_both() {
    let test = "going_onto_a_mesh_and_to_bf16_names_both";
    let Some(one) = xla_devices_or_skip(test, 1) else {
        return;
    };
    xla_devices_or_skip(test, 4).expect("4 devices");
    let cache = memory_only();
    let plain = Config::new().batch(8).lr(0.02);
    let (first, _) = prepare_and_train(plain, one, cache);
    assert!(first.iter().all(|o| !o.is_hit()), "{first:?}");

    let both = meshed(&[("data", 4)], "data").precision(Precision::bf16());
    let (outcomes, _) = prepare_and_train(both.clone(), partitioned(&both), cache);
    let grad = outcomes[0].reason().expect("the gradient program misses");
    assert_eq!(grad.components().len(), 2, "{grad}");
    assert!(names_the_mesh(grad, "absent", "data=4"), "{grad}");
    assert!(
        grad.components().contains(&MissReason::SettingChanged {
            setting: "precision".into(),
            from: "the leaves' dtypes".into(),
            to: "bf16".into(),
        }),
        "{grad}"
    );
    assert_eq!(grad.name(), "several");
    let text = grad.to_string();
    assert!(
        text.contains("backend_changed: sharding absent → mesh [data=4]")
            && text.contains("; setting_changed: precision the leaves' dtypes → bf16"),
        "{text}"
    );
    // The update program does not compute in the precision: only the mesh moved for it (its
    // layout and inputs come with the mesh, and are not named again).
    let update = outcomes[1].reason().expect("the update program misses");
    assert!(
        matches!(update, MissReason::BackendChanged { component, .. } if component == "sharding"),
        "{update}"
    );
}

/// On any backend (the interpreter included): a GraphConst and the precision moved at once,
/// and the gradient program's miss names both, the GraphConst's old and new values too.
#[test]
fn a_graph_const_and_a_precision_change_name_both_on_any_backend() {
    let cache = memory_only();
    let interp = backend::interpreter();
    let (x, y) = data(8, 3);
    let sample = batch(&x, &y, 0, 8, 8);
    let prepare = |act: Act, precision: Precision| {
        let config = Config::new().batch(8).precision(precision);
        let mut run =
            Nitro::with_backend(mlp(act), Adam::default(), config, interp, cache).unwrap();
        run.prepare(&sample).unwrap()
    };
    assert!(prepare(Act::Tanh, Precision::full())
        .iter()
        .all(|o| !o.is_hit()));
    let outcomes = prepare(Act::Relu, Precision::bf16());
    let grad = outcomes[0].reason().expect("the gradient program misses");
    let components = grad.components();
    assert_eq!(components.len(), 2, "{grad}");
    assert!(
        matches!(&components[0], MissReason::SettingChanged { setting, to, .. }
            if setting == "precision" && to == "bf16"),
        "{grad}"
    );
    assert!(
        matches!(&components[1], MissReason::GraphConstChanged { fields, .. }
            if fields == &["act".to_owned()]),
        "{grad}"
    );
    assert_eq!(
        grad.to_string(),
        "setting_changed: precision the leaves' dtypes → bf16; \
         graph_const_changed: act Tanh → Relu"
    );
    // The stats count it once, by its name.
    assert_eq!(cache.stats().misses_by_reason.get("several"), Some(&1));
    // Its JSON lists each component.
    let json = serde_json::to_value(grad).unwrap();
    assert_eq!(json["reason"], "several");
    assert_eq!(json["reasons"][1]["reason"], "graph_const_changed");
}

/// Parameters created on the devices: the initializer program is keyed by the partitioning
/// too, so a renamed mesh compiles nothing at all, the initializer included, and creates the
/// same leaves.
#[test]
fn a_renamed_mesh_creates_its_leaves_with_the_program_it_holds() {
    let test = "a_renamed_mesh_creates_its_leaves_with_the_program_it_holds";
    let Some(_) = xla_devices_or_skip(test, 4) else {
        return;
    };
    let cache = memory_only();
    let created = |c: Config| c.initialize("layers[*].w", nitro::init::Init::GlorotUniform);
    let config = created(meshed(&[("data", 4)], "data"));
    let (_, losses) = prepare_and_train(config.clone(), partitioned(&config), cache);
    let compiles = cache.stats().compiles;
    let renamed = created(meshed(&[("batch", 4)], "batch"));
    let (_, again) = prepare_and_train(renamed.clone(), partitioned(&renamed), cache);
    assert_eq!(
        cache.stats().compiles,
        compiles,
        "the initializer program compiled again on a renamed mesh"
    );
    assert_eq!(losses, again, "the same leaves, the same losses");
}
