//! Data parallelism: `all_sum` over replicas (interpreter, autodiff, emission, XLA), replicated
//! training on 1, 2 and 4 devices giving the same parameters, replicas staying in sync, the
//! program inventory unchanged by the device count, keys that never share an entry between
//! device counts, and typed errors for counts that cannot serve.
#![allow(missing_docs)]

mod common;

#[path = "common/mlp.rs"]
mod mlp;

use common::xla_devices_or_skip;
use mlp::*;
use nitro::backend::{self, interp, Backend};
use nitro::cache::{Cache, MissReason, Outcome};
use nitro::optim::Adam;
use nitro::prelude::*;
use nitro::trace::{self, Op};
use nitro::train::{Config, Nitro};
use nitro::{Error, LeafType};

fn f32s(v: &[f32], dims: &[usize]) -> Array {
    Array::from_vec(dims, v.to_vec()).unwrap()
}

/// The example: `[0,1,2] + [3,4,5] + [6,7,8] + [9,10,11]` on every replica.
fn four_replica_sum() -> (nitro::trace::Graph, Vec<Array>) {
    let ty = LeafType {
        dtype: DType::F32,
        dims: vec![3],
    };
    let graph =
        trace::trace_replicated(4, || vec![trace::input("x", ty.clone()).all_sum()]).unwrap();
    let inputs = (0..4)
        .map(|r| {
            let base = 3.0 * r as f32;
            f32s(&[base, base + 1.0, base + 2.0], &[3])
        })
        .collect();
    (graph, inputs)
}

#[test]
fn all_sum_adds_over_replicas_on_the_interpreter_and_is_the_tensor_itself_on_one() {
    let (graph, inputs) = four_replica_sum();
    assert_eq!(graph.replicas, 4);
    assert!(graph.nodes.iter().any(|n| n.op == Op::AllReduce));
    let lists: Vec<Vec<&Array>> = inputs.iter().map(|a| vec![a]).collect();
    let refs: Vec<&[&Array]> = lists.iter().map(Vec::as_slice).collect();
    let out = interp::run_replicas(&graph, &refs).unwrap();
    assert_eq!(out.len(), 4);
    for replica in &out {
        assert_eq!(replica[0].as_slice::<f32>().unwrap(), &[18.0, 22.0, 26.0]);
    }
    // Input lists for another replica count are refused, typed.
    let err = interp::run_replicas(&graph, &refs[..2]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::ReplicaCount {
                expected: 4,
                got: 2
            }
        ),
        "{err}"
    );
    // Traced for one device, `all_sum` adds no node and `all_mean` divides by 1.
    let ty = inputs[0].leaf_type();
    let one = trace::trace_with(|| {
        let x = trace::input("x", ty.clone());
        vec![x.all_sum(), x.all_mean()]
    })
    .unwrap();
    assert_eq!(one.replicas, 1);
    assert!(one.nodes.iter().all(|n| n.op != Op::AllReduce));
}

#[test]
fn all_mean_divides_by_the_replica_count() {
    let ty = LeafType {
        dtype: DType::F32,
        dims: vec![2],
    };
    let graph = trace::trace_replicated(2, || {
        assert_eq!(trace::replicas(), 2);
        vec![trace::input("x", ty.clone()).all_mean()]
    })
    .unwrap();
    let (a, b) = (f32s(&[1.0, 2.0], &[2]), f32s(&[3.0, 6.0], &[2]));
    let out = interp::run_replicas(&graph, &[&[&a], &[&b]]).unwrap();
    assert_eq!(out[0][0].as_slice::<f32>().unwrap(), &[2.0, 4.0]);
    assert_eq!(out[1][0], out[0][0]);
}

/// The gradient of `all_sum`, checked against finite differences of the replicated program's
/// objective: the sum over replicas of each replica's scalar output. With
/// `out_r = Σ_i (Σ_s x_s)_i · w_r,i`, replica `r`'s gradient in `x` is `Σ_s w_s`.
#[test]
fn the_gradient_of_all_sum_matches_finite_differences_over_replicas() {
    let ty = LeafType {
        dtype: DType::F64,
        dims: vec![3],
    };
    let replicas = 3;
    let forward = |with_grad: bool| {
        let ty = ty.clone();
        trace::trace_replicated(replicas, move || {
            let x = trace::input("x", ty.clone());
            let w = trace::input("w", ty.clone());
            let out = (x.all_sum() * w).sum_all();
            let mut outs = vec![out];
            if with_grad {
                outs.extend(trace::grad(out, &[x, w]));
            }
            outs
        })
        .unwrap()
    };
    let xs: Vec<Vec<f64>> = vec![
        vec![0.5, -1.0, 2.0],
        vec![1.5, 0.25, -0.75],
        vec![-2.0, 1.0, 0.125],
    ];
    let ws: Vec<Vec<f64>> = vec![
        vec![1.0, 2.0, -1.0],
        vec![0.5, -0.5, 3.0],
        vec![2.0, 1.0, 1.0],
    ];
    let arr = |v: &[f64]| Array::from_vec(&[3], v.to_vec()).unwrap();
    let objective = |xs: &[Vec<f64>]| -> f64 {
        let g = forward(false);
        let (xa, wa): (Vec<Array>, Vec<Array>) = (
            xs.iter().map(|v| arr(v)).collect(),
            ws.iter().map(|v| arr(v)).collect(),
        );
        let lists: Vec<Vec<&Array>> = (0..replicas).map(|r| vec![&xa[r], &wa[r]]).collect();
        let refs: Vec<&[&Array]> = lists.iter().map(Vec::as_slice).collect();
        interp::run_replicas(&g, &refs)
            .unwrap()
            .iter()
            .map(|o| o[0].as_slice::<f64>().unwrap()[0])
            .sum()
    };
    let g = forward(true);
    let (xa, wa): (Vec<Array>, Vec<Array>) = (
        xs.iter().map(|v| arr(v)).collect(),
        ws.iter().map(|v| arr(v)).collect(),
    );
    let lists: Vec<Vec<&Array>> = (0..replicas).map(|r| vec![&xa[r], &wa[r]]).collect();
    let refs: Vec<&[&Array]> = lists.iter().map(Vec::as_slice).collect();
    let out = interp::run_replicas(&g, &refs).unwrap();
    let h = 1e-6;
    for r in 0..replicas {
        let dx = out[r][1].as_slice::<f64>().unwrap();
        for i in 0..3 {
            let mut plus = xs.clone();
            plus[r][i] += h;
            let mut minus = xs.clone();
            minus[r][i] -= h;
            let numeric = (objective(&plus) - objective(&minus)) / (2.0 * h);
            assert!(
                (dx[i] - numeric).abs() < 1e-6,
                "replica {r}, x[{i}]: autodiff {} vs finite differences {numeric}",
                dx[i]
            );
            let expected: f64 = ws.iter().map(|w| w[i]).sum();
            assert!((dx[i] - expected).abs() < 1e-12);
        }
    }
}

#[test]
fn a_replicated_program_declares_its_replicas_and_runs_on_xla() {
    let (graph, inputs) = four_replica_sum();
    let text = nitro::emit::emit(&graph);
    assert!(
        text.starts_with(
            "module @nitro attributes {mhlo.num_partitions = 1 : i32, mhlo.num_replicas = 4 : i32}"
        ),
        "{text}"
    );
    assert!(
        text.contains("replica_groups = dense<[[0, 1, 2, 3]]> : tensor<1x4xi64>"),
        "{text}"
    );
    let Some(xla) = xla_devices_or_skip(
        "a_replicated_program_declares_its_replicas_and_runs_on_xla",
        4,
    ) else {
        return;
    };
    assert_eq!(xla.replicas(), 4);
    assert!(xla.client().device_count() >= 4);
    let exe = xla.compile(&graph, &text).unwrap();
    assert_eq!(exe.replicas(), 4);
    let lists: Vec<Vec<&Array>> = inputs.iter().map(|a| vec![a]).collect();
    let refs: Vec<&[&Array]> = lists.iter().map(Vec::as_slice).collect();
    for replica in exe.run_replicas(&refs).unwrap() {
        assert_eq!(replica[0].as_slice::<f32>().unwrap(), &[18.0, 22.0, 26.0]);
    }
    // It serializes with its replica count, and loads for a 4-replica program only.
    let bytes = exe.serialize().unwrap();
    let loaded = xla.load(&bytes, &graph).unwrap();
    assert_eq!(
        loaded.run_replicas(&refs).unwrap()[3][0]
            .as_slice::<f32>()
            .unwrap(),
        &[18.0, 22.0, 26.0]
    );
    let two = backend::xla_for(2).unwrap();
    let err = two.load(&bytes, &graph).unwrap_err();
    assert!(
        matches!(
            err,
            Error::ReplicaCount {
                expected: 2,
                got: 4
            }
        ),
        "{err}"
    );
    // Running it as one replica is refused, typed.
    let err = exe.run(&[&inputs[0]]).unwrap_err();
    assert!(
        matches!(
            err,
            Error::ReplicaCount {
                expected: 4,
                got: 1
            }
        ),
        "{err}"
    );
    // The identities differ in the device count.
    assert_ne!(xla.identity().digest, two.identity().digest);
    assert!(xla
        .identity()
        .components
        .contains(&("devices".to_owned(), "4".to_owned())));
}

fn own_cache() -> &'static Cache {
    Box::leak(Box::new(Cache::in_memory(32)))
}

/// Trains the classifier for a few steps (one ragged) on `devices` devices with a global batch
/// of 8 rows; returns the trained leaves, the losses, every replica's leaves and the cache.
#[allow(clippy::type_complexity)]
fn train_on(
    backend: &'static dyn Backend,
    cache: &'static Cache,
) -> (Vec<Vec<f32>>, Vec<f64>, Vec<Vec<Array>>) {
    let (x, y) = data(40, 21);
    let config = Config::new().batch(8).lr(0.02).devices(backend.replicas());
    let mut run = Nitro::with_backend(mlp(Act::Tanh), Adam::default(), config, backend, cache)
        .expect("handle");
    assert_eq!(run.devices(), backend.replicas());
    let mut losses = Vec::new();
    for (start, real) in [(0, 8), (8, 8), (16, 8), (24, 8), (32, 5)] {
        losses.push(run.step(&batch(&x, &y, start, real, 8), real).unwrap().loss);
    }
    let replicas = run.replica_params().unwrap();
    assert_eq!(replicas.len(), backend.replicas());
    let trained = run.into_experiment().unwrap();
    let leaves = trained
        .layers
        .iter()
        .flat_map(|l| [&l.w, &l.b])
        .map(|a| a.as_slice::<f32>().unwrap().to_vec())
        .collect();
    (leaves, losses, replicas)
}

fn assert_close(a: &[Vec<f32>], b: &[Vec<f32>], tol: f32, what: &str) {
    for (la, lb) in a.iter().zip(b) {
        for (p, q) in la.iter().zip(lb) {
            assert!((p - q).abs() <= tol * (1.0 + p.abs()), "{what}: {p} vs {q}");
        }
    }
}

fn same_parameters_on(pick: impl Fn(usize) -> &'static dyn Backend, tol: f32) {
    let (one, one_losses, _) = train_on(pick(1), own_cache());
    for devices in [2, 4] {
        let (many, losses, replicas) = train_on(pick(devices), own_cache());
        // Replicas run the same update on the same reduced gradient: bit-identical.
        for (r, replica) in replicas.iter().enumerate().skip(1) {
            assert_eq!(replica, &replicas[0], "replica {r} of {devices} diverged");
        }
        for (a, b) in one_losses.iter().zip(&losses) {
            assert!(
                (a - b).abs() <= f64::from(tol) * (1.0 + a.abs()),
                "loss on 1 vs {devices} devices: {a} vs {b}"
            );
        }
        assert_close(&one, &many, tol, &format!("1 vs {devices} devices"));
    }
}

#[test]
fn training_on_one_two_and_four_devices_gives_the_same_parameters_on_the_interpreter() {
    // Documented tolerance: the rows of a batch are summed in another grouping (per replica,
    // then across replicas), so f32 rounding differs; 5 Adam steps stay within 1e-5.
    same_parameters_on(|n| backend::interpreter_for(n), 1e-5);
}

#[test]
fn training_on_one_two_and_four_devices_gives_the_same_parameters_on_xla() {
    let Some(_) = xla_devices_or_skip(
        "training_on_one_two_and_four_devices_gives_the_same_parameters_on_xla",
        4,
    ) else {
        return;
    };
    same_parameters_on(|n| backend::xla_for(n).expect("XLA devices"), 1e-5);
}

/// The inventory at any device count: 2 programs for training, 1 more for evaluation; and the
/// same experiment on 2 and 4 devices shares no entry (the 4-device programs miss, naming the
/// device count).
fn inventory_and_keys_on(pick: impl Fn(usize) -> &'static dyn Backend) {
    let cache = own_cache();
    let (x, y) = data(16, 5);
    let full = batch(&x, &y, 0, 8, 8);
    let ragged = batch(&x, &y, 8, 3, 8);
    for (k, devices) in [2usize, 4].into_iter().enumerate() {
        let config = Config::new().batch(8).devices(devices);
        let mut run = Nitro::with_backend(
            mlp(Act::Tanh),
            Adam::default(),
            config,
            pick(devices),
            cache,
        )
        .unwrap();
        let outcomes = run.prepare(&full).unwrap();
        assert_eq!(outcomes.len(), 2);
        if k == 1 {
            // The gradient program sees 2 rows per replica instead of 4: its signature moved,
            // and the device count with it (a miss names both).
            // The update program's inputs are the same: only the device count moved.
            let grad = outcomes[0].reason().expect("a miss");
            assert!(
                matches!(
                    grad.components(),
                    [
                        MissReason::SignatureChanged { .. },
                        MissReason::BackendChanged { component, .. }
                    ] if component == "devices"
                ),
                "{grad}"
            );
            match &outcomes[1] {
                Outcome::Compiled {
                    reason:
                        MissReason::BackendChanged {
                            component,
                            from,
                            to,
                        },
                } => assert_eq!(
                    (component.as_str(), from.as_str(), to.as_str()),
                    ("devices", "2", "4")
                ),
                other => panic!("4 devices must not reuse a 2-device entry: {other}"),
            }
        }
        run.step(&full, 8).unwrap();
        run.step(&ragged, 3).unwrap();
        run.evaluate(&ragged, 3).unwrap();
        let stats = cache.stats();
        assert_eq!(stats.entries, 3 * (k as u64 + 1), "{stats:?}");
        assert_eq!(stats.misses, stats.entries, "{stats:?}");
    }
}

#[test]
fn the_inventory_is_the_same_at_any_device_count_and_counts_never_share_entries_on_the_interpreter()
{
    inventory_and_keys_on(|n| backend::interpreter_for(n));
}

#[test]
fn the_inventory_is_the_same_at_any_device_count_and_counts_never_share_entries_on_xla() {
    let Some(_) = xla_devices_or_skip("the_inventory_is_the_same_at_any_device_count_on_xla", 4)
    else {
        return;
    };
    inventory_and_keys_on(|n| backend::xla_for(n).expect("XLA devices"));
}

#[test]
fn evaluation_and_predictions_cover_every_replica_s_rows() {
    let (x, y) = data(8, 9);
    let b = batch(&x, &y, 0, 6, 8);
    let mut one = Nitro::with_backend(
        mlp(Act::Tanh),
        Adam::default(),
        Config::new().batch(8),
        backend::interpreter(),
        own_cache(),
    )
    .unwrap();
    let mut two = Nitro::with_backend(
        mlp(Act::Tanh),
        Adam::default(),
        Config::new().batch(8).devices(2),
        backend::interpreter_for(2),
        own_cache(),
    )
    .unwrap();
    let (a, b2) = (one.evaluate(&b, 6).unwrap(), two.evaluate(&b, 6).unwrap());
    assert_eq!(a.rows, b2.rows);
    assert!((a.loss_sum - b2.loss_sum).abs() < 1e-5, "{a:?} vs {b2:?}");
    assert_eq!(a.correct, b2.correct);
    let (p1, p2) = (one.predict(&b).unwrap(), two.predict(&b).unwrap());
    assert_eq!(p1.dims(), &[8, 3]);
    assert_eq!(p1.dims(), p2.dims());
    let (s1, s2) = (p1.as_slice::<f32>().unwrap(), p2.as_slice::<f32>().unwrap());
    for (u, v) in s1.iter().zip(s2) {
        assert!((u - v).abs() < 1e-6, "{u} vs {v}");
    }
}

#[test]
fn device_counts_that_cannot_serve_are_typed_errors_naming_the_count() {
    // A batch that does not split evenly.
    let err = Nitro::with_backend(
        mlp(Act::Tanh),
        Adam::default(),
        Config::new().batch(10).devices(4),
        backend::interpreter_for(4),
        own_cache(),
    )
    .unwrap_err();
    assert!(matches!(err, Error::Devices { requested: 4, .. }), "{err}");
    assert!(err.to_string().contains("multiple of 4"), "{err}");
    // A backend of another count than the config asks for.
    let err = Nitro::with_backend(
        mlp(Act::Tanh),
        Adam::default(),
        Config::new().batch(8).devices(2),
        backend::interpreter_for(4),
        own_cache(),
    )
    .unwrap_err();
    assert!(matches!(err, Error::Devices { requested: 2, .. }), "{err}");
    // No devices at all.
    let err = backend::for_devices(0).unwrap_err();
    assert!(matches!(err, Error::Devices { requested: 0, .. }), "{err}");
    // A client with fewer devices than a replicated backend needs.
    if let Ok(client) = backend::pjrt::client() {
        let n = client.device_count() + 1;
        let err = backend::Xla::replicated(client, n).unwrap_err();
        assert!(
            matches!(err, Error::Devices { requested, .. } if requested == n),
            "{err}"
        );
    }
}
