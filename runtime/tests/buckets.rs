//! Shape buckets: the planner against brute force and its waste figures; ragged data sets and
//! their bucketed batches; and a handle with declared buckets — its inventory (the update
//! program plus programs × buckets, all before the first step, none after), a second process
//! that loads them all, a padded step's gradient equal to the unpadded rows', a row longer than
//! every bucket, a length outside the declared set, and the recompile budget.
#![allow(missing_docs)]

mod common;

use std::sync::Arc;

use nitro::backend::{self, interp, Backend};
use nitro::cache::{Cache, DirStore, Outcome};
use nitro::data::buckets::{padding_waste, plan_edges, Buckets, Overflow, Ragged, VALID};
use nitro::data::{Batch, BatchMirror};
use nitro::init::{self, Seed};
use nitro::optim::{Adam, Sgd};
use nitro::prelude::*;
use nitro::trace::{self, nn};
use nitro::train::{Config, Model, Nitro};
use nitro::Error;

// ---- the planner --------------------------------------------------------------------------------

/// The padded positions of `lengths` under `edges` (each row to the smallest edge holding it).
fn padded(lengths: &[usize], edges: &[usize]) -> Option<u64> {
    lengths
        .iter()
        .map(|&l| {
            edges
                .iter()
                .filter(|&&e| e >= l)
                .min()
                .map(|e| (e - l) as u64)
        })
        .sum()
}

/// The least padding over every choice of at most `k` edges among the distinct lengths.
fn brute_force(lengths: &[usize], k: usize) -> u64 {
    let mut distinct: Vec<usize> = lengths.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    let m = distinct.len();
    let mut best = u64::MAX;
    for subset in 1u32..(1 << m) {
        if subset.count_ones() as usize > k {
            continue;
        }
        let edges: Vec<usize> = (0..m)
            .filter(|i| subset & (1 << i) != 0)
            .map(|i| distinct[i])
            .collect();
        if let Some(p) = padded(lengths, &edges) {
            best = best.min(p);
        }
    }
    best
}

#[test]
fn the_planner_is_optimal_against_brute_force() {
    let mut rng = init::Rng::new(Seed(5));
    for case in 0..200 {
        let n = 1 + (rng.next_f64() * 12.0) as usize;
        let spread = 1 + (rng.next_f64() * 40.0) as usize;
        let lengths: Vec<usize> = (0..n)
            .map(|_| 1 + (rng.next_f64() * spread as f64) as usize)
            .collect();
        for k in 1..=4 {
            let plan = plan_edges(&lengths, k).unwrap();
            assert!(plan.edges.len() <= k, "case {case}: {plan:?}");
            assert_eq!(
                plan.edges.last().copied(),
                lengths.iter().max().copied(),
                "case {case}: the longest length is an edge"
            );
            assert_eq!(
                Some(plan.padded),
                padded(&lengths, &plan.edges),
                "case {case}: the plan's own count"
            );
            assert_eq!(
                plan.padded,
                brute_force(&lengths, k),
                "case {case}, k {k}: {lengths:?} → {:?}",
                plan.edges
            );
        }
    }
}

#[test]
fn waste_figures_on_a_fixed_histogram() {
    // 10 rows of 10, 10 of 20, 10 of 100: 1300 real positions.
    let lengths: Vec<usize> = [10, 20, 100]
        .iter()
        .flat_map(|&l| std::iter::repeat_n(l, 10))
        .collect();
    // One program at 100: 90·10 + 80·10 padded of 3000 positions.
    let one = padding_waste(&lengths, &[100]).unwrap();
    assert!((one - 1700.0 / 3000.0).abs() < 1e-12, "{one}");
    let plan = plan_edges(&lengths, 2).unwrap();
    assert_eq!(plan.edges, [20, 100]);
    assert_eq!((plan.padded, plan.real), (100, 1300));
    assert!((plan.waste() - 100.0 / 1400.0).abs() < 1e-12);
    let three = plan_edges(&lengths, 3).unwrap();
    assert_eq!(
        (three.edges.as_slice(), three.padded),
        (&[10, 20, 100][..], 0)
    );
    // More buckets than lengths: no more edges than lengths.
    assert_eq!(plan_edges(&lengths, 8).unwrap().edges.len(), 3);
    assert!(padding_waste(&lengths, &[50]).is_err(), "100 fits no edge");
    assert!(plan_edges(&[], 2).is_err() && plan_edges(&lengths, 0).is_err());
}

// ---- ragged data ----------------------------------------------------------------------------------

fn docs(n: usize, seed: u64, longest: usize) -> Vec<Vec<i32>> {
    let mut rng = init::Rng::new(Seed(seed));
    (0..n)
        .map(|_| {
            let len = 2 + (rng.next_f64() * (longest - 1) as f64) as usize;
            (0..len).map(|_| (rng.next_f64() * 7.0) as i32).collect()
        })
        .collect()
}

#[test]
fn epoch_batches_bin_by_length_and_cover_every_row_once() {
    let data = Ragged::next_token(&docs(100, 1, 30)).unwrap();
    let buckets = Buckets::new([8, 16, 30]).unwrap().window(32);
    let lengths = data.lengths();
    for epoch in 0..2 {
        let plan = data.epoch_batches(&buckets, |_| 6, 3, epoch).unwrap();
        let mut seen: Vec<usize> = plan.iter().flat_map(|(_, r)| r.clone()).collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..100).collect::<Vec<_>>(), "every row exactly once");
        for (b, rows) in &plan {
            assert!(rows.len() <= 6);
            for &r in rows {
                assert_eq!(buckets.bucket_of(lengths[r]).unwrap(), *b, "row {r}");
            }
        }
        // At most one ragged batch per bucket, at the end.
        let ragged = plan.iter().filter(|(_, r)| r.len() < 6).count();
        assert!(ragged <= 3, "{ragged}");
    }
    let e0 = data.epoch_batches(&buckets, |_| 6, 3, 0).unwrap();
    let e1 = data.epoch_batches(&buckets, |_| 6, 3, 1).unwrap();
    assert_ne!(e0, e1, "a fresh order each epoch");
    assert_eq!(e0, data.epoch_batches(&buckets, |_| 6, 3, 0).unwrap());
    // A token budget gives short buckets more rows.
    let budget = Buckets::new([8, 16, 32]).unwrap().token_budget(64);
    assert_eq!(
        (budget.rows_for(8, 4, 1), budget.rows_for(32, 4, 1)),
        (8, 2)
    );
    assert_eq!(budget.rows_for(16, 4, 3), 3, "a multiple of the devices");
}

#[test]
fn gather_pads_to_the_edge_and_weighs_real_positions() {
    let data = Ragged::next_token(&[vec![1, 2, 3], vec![4, 5, 6, 7, 8]]).unwrap();
    let buckets = Buckets::new([4, 6]).unwrap().pad(9);
    let (batch, weights) = data.gather(&[1, 0], 6, 3, &buckets).unwrap();
    assert_eq!(weights, [4.0, 2.0, 0.0]);
    assert_eq!(
        batch.column("x").unwrap().as_slice::<i32>().unwrap(),
        &[4, 5, 6, 7, 9, 9, 1, 2, 9, 9, 9, 9, 4, 5, 6, 7, 9, 9]
    );
    assert_eq!(
        batch.column("y").unwrap().as_slice::<i32>().unwrap()[..6],
        [5, 6, 7, 8, 9, 9]
    );
    let valid = batch.column(VALID).unwrap().as_slice::<f32>().unwrap();
    assert_eq!(&valid[..6], &[1.0, 1.0, 1.0, 1.0, 0.0, 0.0]);
    assert_eq!(batch.real_rows(), 2);
    // Too long for the edge: refused, or cut when truncating.
    let long = Ragged::next_token(&[vec![0; 12]]).unwrap();
    let err = buckets.bucket_of(11).unwrap_err().to_string();
    assert!(err.contains("length 11") && err.contains("(6)"), "{err}");
    assert!(long.gather(&[0], 6, 1, &buckets).is_err());
    let cut = buckets.clone().overflow(Overflow::Truncate);
    assert_eq!(cut.bucket_of(11).unwrap(), 1);
    let (b, w) = long.gather(&[0], 6, 1, &cut).unwrap();
    assert_eq!((b.column("x").unwrap().dims(), w), (&[1, 6][..], vec![6.0]));
    assert!(Ragged::new(vec![("x", vec![vec![1, 2]]), ("y", vec![vec![1]])]).is_err());
    assert!(Ragged::new(vec![("valid", vec![vec![1]])]).is_err());
    assert!(Buckets::new([4, 4]).is_err() && Buckets::new([0, 3]).is_err());
}

// ---- a handle with buckets ------------------------------------------------------------------------

const VOCAB: usize = 7;
const DIM: usize = 5;

/// A tiny next-token model: an embedding and a linear head, its loss per row the mean
/// cross-entropy over the row's real positions.
#[experiment]
#[derive(Clone)]
pub struct TinyLm {
    #[device(trainable)]
    pub emb: Array,
    #[device(trainable)]
    pub head: Array,
}

/// The per-row loss: mean cross-entropy over the positions `valid` marks.
fn row_loss(emb: Tensor, head: Tensor, x: Tensor, y: Tensor, valid: Tensor) -> Tensor {
    let logits = emb.take(x, 0).matmul(head);
    let ce = nn::softmax_cross_entropy(logits, y);
    (ce * valid).sum(&[1]) / valid.sum(&[1]).maximum(1.0)
}

impl Model for TinyLm {
    type Batch = Batch;

    fn loss(v: &TinyLmView<'_>, b: &BatchMirror<Tensor>) -> Tensor {
        let col = |n: &str| *b.get(n).expect("column");
        row_loss(v.emb, v.head, col("x"), col("y"), col(VALID))
    }
}

fn tiny() -> TinyLm {
    TinyLm {
        emb: init::normal(&[VOCAB, DIM], 0.0, 0.5, Seed(1)),
        head: init::normal(&[DIM, VOCAB], 0.0, 0.5, Seed(2)),
    }
}

fn own_cache() -> &'static Cache {
    Box::leak(Box::new(Cache::in_memory(64)))
}

fn bucketed(
    backend: &'static dyn Backend,
    cache: &'static Cache,
    buckets: Buckets,
) -> Nitro<TinyLm, Adam> {
    let config = Config::new()
        .batch(4)
        .epochs(2)
        .seed(3)
        .buckets(buckets)
        .progress(false);
    Nitro::with_backend(tiny(), Adam::default(), config, backend, cache).unwrap()
}

fn inventory_on(backend: &'static dyn Backend) {
    let dir = common::TempDir::new("buckets-store");
    let cache_on_dir = || -> &'static Cache {
        let store = DirStore::open(dir.path(), 1 << 30, None).expect("store");
        Box::leak(Box::new(Cache::new(64, Some(Arc::new(store)))))
    };
    let train = Ragged::next_token(&docs(60, 1, 40)).unwrap();
    let val = Ragged::next_token(&docs(20, 2, 40)).unwrap();
    let buckets = Buckets::new([8, 16, 24, 40]).unwrap().token_budget(64);
    let first = cache_on_dir();
    let mut run = bucketed(backend, first, buckets.clone());
    assert_eq!(run.declared_inventory(true), 1 + 4 * 2);
    assert_eq!(run.declared_inventory(false), 1 + 4);
    // Everything compiles before the first step: after the explicit preparation, the whole
    // inventory; after training, not one more.
    run.prepare_buckets(&train, true).unwrap();
    assert_eq!(first.stats().compiles, 9, "{}", first.stats());
    let history = run.fit_ragged(&train, Some(&val)).unwrap();
    assert_eq!(history.epochs.len(), 2);
    assert!(history
        .epochs
        .iter()
        .all(|e| e.train_loss.is_finite() && e.val_loss.is_some_and(f64::is_finite)));
    let stats = first.stats();
    assert_eq!(
        (stats.misses, stats.entries, stats.compiles),
        (9, 9, 9),
        "2 + 4 × 2 less the shared update: {stats}"
    );
    first.assert_no_recompile_after_warmup().unwrap();
    assert_eq!(run.programs_held(), 9);
    // Four declared variants of each program are expected, not linted as keys that move.
    assert!(first.variant_warning() >= 4);
    // Every program was compiled before the first step: the first 9 lookups compiled, none of
    // the later ones.
    let times = run.program_times();
    let compiled = times
        .iter()
        .filter(|t| matches!(t.outcome, Outcome::Compiled { .. }))
        .count();
    assert_eq!(compiled, 9, "{times:?}");
    // The run's inventory manifest: the nine programs, each with its bucket, all in the store;
    // written and read back unchanged.
    let manifest = run.manifest();
    assert_eq!(manifest.programs.len(), 9);
    let mut edges: Vec<Option<usize>> = manifest.programs.iter().map(|p| p.edge).collect();
    edges.sort_unstable();
    edges.dedup();
    assert_eq!(edges, [None, Some(8), Some(16), Some(24), Some(40)]);
    let store = DirStore::open_existing(dir.path(), None).unwrap();
    for p in &manifest.programs {
        assert!(
            nitro::cache::Store::contains(&store, &p.key.parse().unwrap()),
            "{p:?}"
        );
    }
    let file = dir.path().join("inventory.json");
    manifest.write(&file).unwrap();
    assert_eq!(nitro::cache::Manifest::read(&file).unwrap(), manifest);

    let second = cache_on_dir();
    let mut again = bucketed(backend, second, buckets);
    again.fit_ragged(&train, Some(&val)).unwrap();
    let stats = second.stats();
    assert_eq!(
        (stats.compiles, stats.l2_hits),
        (0, 9),
        "a second process loads all nine: {stats}"
    );
}

#[test]
fn a_train_only_run_compiles_the_update_and_one_gradient_per_bucket() {
    let cache = own_cache();
    let train = Ragged::next_token(&docs(40, 3, 40)).unwrap();
    let buckets = Buckets::new([8, 16, 24, 40]).unwrap().token_budget(64);
    let mut run = bucketed(backend::interpreter(), cache, buckets);
    run.fit_ragged(&train, None).unwrap();
    let stats = cache.stats();
    assert_eq!((stats.misses, stats.compiles), (5, 5), "1 + 4 × 1: {stats}");
    cache.assert_no_recompile_after_warmup().unwrap();
    assert_eq!(run.declared_inventory(false), 5);
}

#[test]
fn the_inventory_is_programs_times_buckets_on_the_interpreter() {
    inventory_on(backend::interpreter());
}

#[test]
fn the_inventory_is_programs_times_buckets_on_xla() {
    if let Some(xla) = common::xla_or_skip("the_inventory_is_programs_times_buckets_on_xla") {
        inventory_on(xla);
    }
}

#[test]
fn a_padded_step_has_the_gradient_of_the_unpadded_rows() {
    let rows = vec![vec![1, 2, 3, 4], vec![5, 6, 1, 0, 2, 3]];
    let data = Ragged::next_token(&rows).unwrap();
    let buckets = Buckets::new([8]).unwrap();
    let config = Config::new()
        .batch(4)
        .lr(1.0)
        .buckets(buckets.clone())
        .progress(false);
    let mut run =
        Nitro::with_backend(tiny(), Sgd, config, backend::interpreter(), own_cache()).unwrap();
    // Two real rows (3 and 5 positions) padded to 8 positions and 4 rows.
    let (batch, weights) = data.gather(&[0, 1], 8, 4, &buckets).unwrap();
    let loss = run.step_weighted(&batch, &weights).unwrap().loss;
    let after = run.into_experiment().unwrap();

    // The same loss on the unpadded rows: every real position's cross-entropy, averaged.
    let p = tiny();
    let unpadded = |t: &[Tensor], row: &[i32]| {
        let n = row.len() - 1;
        let x = Tensor::constant(Array::from_vec(&[1, n], row[..n].to_vec()).unwrap());
        let y = Tensor::constant(Array::from_vec(&[1, n], row[1..].to_vec()).unwrap());
        let valid = Tensor::full(&[1, n], 1.0, DType::F32);
        row_loss(t[0], t[1], x, y, valid).sum_all() * n as f64
    };
    let inputs = vec![
        ("emb".to_owned(), p.emb.leaf_type()),
        ("head".to_owned(), p.head.leaf_type()),
    ];
    let g = trace::trace(&inputs, |t| {
        let total = (unpadded(t, &rows[0]) + unpadded(t, &rows[1])) / 8.0;
        let mut out = trace::grad(total, t);
        out.push(total);
        out
    })
    .unwrap();
    let out = interp::run(&g, &[p.emb.clone(), p.head.clone()]).unwrap();
    let want_loss = f64::from(out[2].as_slice::<f32>().unwrap()[0]);
    assert!((loss - want_loss).abs() < 1e-6, "{loss} vs {want_loss}");
    for (name, before, grad, now) in [
        ("emb", &p.emb, &out[0], &after.emb),
        ("head", &p.head, &out[1], &after.head),
    ] {
        let (b, g, n) = (
            before.as_slice::<f32>().unwrap(),
            grad.as_slice::<f32>().unwrap(),
            now.as_slice::<f32>().unwrap(),
        );
        for i in 0..b.len() {
            // Sgd at lr 1: now = before − gradient.
            assert!(
                (b[i] - g[i] - n[i]).abs() < 1e-6,
                "{name}[{i}]: {} vs {}",
                b[i] - g[i],
                n[i]
            );
        }
        assert!(
            g.iter().any(|v| v.abs() > 1e-4),
            "{name}: a gradient to compare"
        );
    }
}

#[test]
fn outside_the_declared_set_is_an_error_never_a_new_program() {
    let buckets = Buckets::new([8, 16]).unwrap();
    let cache = own_cache();
    let mut run = bucketed(backend::interpreter(), cache, buckets.clone());
    // A row longer than every bucket: refused before anything compiles, naming it.
    let long = Ragged::next_token(&[vec![1; 30], vec![2; 5]]).unwrap();
    let err = run.fit_ragged(&long, None).unwrap_err().to_string();
    assert!(err.contains("length 29") && err.contains("(16)"), "{err}");
    assert_eq!(cache.stats().compiles, 0);
    // A batch whose length is no declared edge: an error naming the buckets.
    let data = Ragged::next_token(&[vec![1, 2, 3]]).unwrap();
    let (batch, w) = data.gather(&[0], 12, 4, &buckets).unwrap();
    let err = run.step_weighted(&batch, &w).unwrap_err().to_string();
    assert!(
        err.contains("length 12 is not a declared bucket [8, 16]"),
        "{err}"
    );
    assert_eq!(cache.stats().compiles, 0);
}

#[test]
fn the_recompile_budget_refuses_the_program_past_it() {
    let cache = own_cache();
    let config = Config::new().batch(4).max_programs(3).progress(false);
    let mut run = Nitro::with_backend(
        tiny(),
        Adam::default(),
        config,
        backend::interpreter(),
        cache,
    )
    .unwrap();
    let data = Ragged::next_token(&docs(8, 4, 30)).unwrap();
    let buckets = Buckets::new([8, 16, 30])
        .unwrap()
        .overflow(Overflow::Truncate);
    // Without declared buckets every length is a new shape: two fit the budget of 3 (update
    // + 2 gradients), the third is refused before it compiles.
    for edge in [8, 16] {
        let (b, w) = data.gather(&[0], edge, 4, &buckets).unwrap();
        run.step_weighted(&b, &w).unwrap();
    }
    let compiled = cache.stats().compiles;
    assert_eq!(compiled, 3);
    let (b, w) = data.gather(&[0], 30, 4, &buckets).unwrap();
    let err = run.step_weighted(&b, &w).unwrap_err();
    assert!(
        matches!(
            err,
            Error::ProgramBudget {
                budget: 3,
                needed: 4,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("i32[4,30]"), "{err}");
    assert_eq!(
        cache.stats().compiles,
        compiled,
        "nothing compiled past the budget"
    );
    // Back to a held shape: no lookup, no error.
    let (b, w) = data.gather(&[0], 8, 4, &buckets).unwrap();
    run.step_weighted(&b, &w).unwrap();
}

#[test]
fn plan_says_what_will_compile_and_never_compiles() {
    use nitro::cache::Will;
    let dir = common::TempDir::new("buckets-plan");
    let cache_on_dir = || -> &'static Cache {
        let store = DirStore::open(dir.path(), 1 << 30, None).expect("store");
        Box::leak(Box::new(Cache::new(64, Some(Arc::new(store)))))
    };
    let backend = backend::interpreter();
    let train = Ragged::next_token(&docs(30, 6, 20)).unwrap();
    let buckets = Buckets::new([10, 20]).unwrap();
    let first = cache_on_dir();
    let mut run = bucketed(backend, first, buckets.clone());
    // Before anything ran: every program compiles, none has a record of its time.
    let plan = run.plan_buckets(&train, true).unwrap();
    assert_eq!(plan.entries.len(), 1 + 2 * 2, "{plan}");
    assert_eq!(plan.count(Will::Compile), 5, "{plan}");
    assert!(plan.entries.iter().all(|e| e.probe.compile_ms.is_none()));
    assert_eq!(plan.expected_ms().1, 5);
    let roles: Vec<(&str, Option<usize>)> = plan
        .entries
        .iter()
        .map(|e| (e.role.as_str(), e.edge))
        .collect();
    assert_eq!(
        roles,
        [
            ("update", None),
            ("grad", Some(10)),
            ("eval", Some(10)),
            ("grad", Some(20)),
            ("eval", Some(20))
        ]
    );
    let stats = first.stats();
    assert_eq!(
        (stats.compiles, stats.misses, stats.hits),
        (0, 0, 0),
        "plan compiles nothing"
    );
    run.fit_ragged(&train, Some(&train)).unwrap();
    // In the same process: every program is held.
    let plan = run.plan_buckets(&train, true).unwrap();
    assert_eq!(plan.count(Will::Hit), 5, "{plan}");
    let fingerprints = plan.fingerprints();
    // A fresh process on the same store: every program loads, its expected time recorded.
    let second = cache_on_dir();
    let fresh = bucketed(backend, second, buckets);
    let plan = fresh.plan_buckets(&train, true).unwrap();
    assert_eq!(plan.count(Will::Load), 5, "{plan}");
    // The record says what each compile cost (and, never loaded yet, no load time).
    assert!(plan
        .entries
        .iter()
        .all(|e| e.probe.compile_ms.is_some_and(|ms| ms > 0.0) && e.probe.load_ms.is_none()));
    assert_eq!(plan.fingerprints(), fingerprints, "the same programs");
    assert!(
        plan.to_string().contains("5 program(s): 0 hit, 5 load"),
        "{plan}"
    );
    assert_eq!(second.stats().compiles + second.stats().l2_hits, 0);
    // Once loaded, the record has the load time too.
    let mut third = bucketed(backend, second, Buckets::new([10, 20]).unwrap());
    third.fit_ragged(&train, Some(&train)).unwrap();
    assert_eq!(second.stats().compiles, 0);
    let plan = bucketed(backend, cache_on_dir(), Buckets::new([10, 20]).unwrap())
        .plan_buckets(&train, true)
        .unwrap();
    assert!(
        plan.entries.iter().all(|e| e.probe.load_ms.is_some()),
        "{plan}"
    );
    assert_eq!(plan.expected_ms().1, 0);
}

/// `prepare_buckets` looks up every edge's programs at once, bounded by
/// `Config::compile_threads`: one thread or four, the same programs compile, each once, each
/// recorded with its edge; and a budget the inventory exceeds is refused before any compile.
#[test]
fn bucket_programs_compile_together_bounded_and_within_the_budget() {
    let train = Ragged::next_token(&docs(40, 7, 40)).unwrap();
    let buckets = Buckets::new([8, 16, 24, 40]).unwrap();
    let backend = backend::interpreter();
    let mut seen = Vec::new();
    for threads in [1, 4] {
        let cache: &'static Cache = Box::leak(Box::new(Cache::in_memory(64)));
        let config = Config::new()
            .batch(4)
            .seed(3)
            .buckets(buckets.clone())
            .compile_threads(threads)
            .progress(false);
        let mut run = Nitro::with_backend(tiny(), Adam::default(), config, backend, cache).unwrap();
        run.prepare_buckets(&train, true).unwrap();
        let stats = cache.stats();
        assert_eq!((stats.compiles, stats.misses), (9, 9), "{threads}: {stats}");
        let mut roles: Vec<(String, Option<usize>)> = run
            .program_times()
            .iter()
            .map(|t| (t.role.clone(), t.edge))
            .collect();
        roles.sort();
        seen.push(roles);
        assert_eq!(run.programs_held(), 9);
    }
    assert_eq!(seen[0], seen[1]);
    assert_eq!(seen[0].iter().filter(|(r, _)| r == "grad").count(), 4);

    // Eight programs allowed, nine declared: refused before anything compiles.
    let cache: &'static Cache = Box::leak(Box::new(Cache::in_memory(64)));
    let config = Config::new()
        .batch(4)
        .buckets(buckets)
        .max_programs(8)
        .progress(false);
    let mut run = Nitro::with_backend(tiny(), Adam::default(), config, backend, cache).unwrap();
    let err = run.prepare_buckets(&train, true).unwrap_err();
    assert!(
        matches!(err, nitro::Error::ProgramBudget { needed: 9, .. }),
        "{err}"
    );
    assert_eq!(cache.stats().compiles, 0);
}
