//! The compile cache against its contract (DESIGN.md, "The compile cache"): what must miss and
//! what must hit, the reason each miss names, capacity and the eviction ledger, reuse across
//! processes (L2), single flight, verify mode, the acceptance check, and failures that are never
//! cached.
//!
//! Cross-process tests run this test binary again, filtered to the `#[ignore]`d
//! [`child_process`] test, with the cache directory and the mode in environment variables. The
//! XLA variants print a `skip:` line and pass when no PJRT plugin is installed, unless
//! `NITRO_REQUIRE_XLA=1`.
#![allow(missing_docs)]

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Barrier, OnceLock};
use std::time::Duration;

use common::{sigs, xla_or_skip, TempDir};
use nitro::backend::{self, Backend, Executable, Identity, Interpreter};
use nitro::cache::{self, Cache, CacheStats, DirStore, MissReason};
use nitro::prelude::*;
use nitro::program::{Outputs, Program};
use nitro::trace::Graph;
use nitro::Error;

// ---------------------------------------------------------------------------------------------
// Experiments and programs
// ---------------------------------------------------------------------------------------------

#[derive(ContentHash, Clone, Copy, Debug, PartialEq)]
pub enum Act {
    Tanh,
    Relu,
}

#[derive(Tree, Clone, Debug)]
pub struct Dense {
    pub w: Array,
    pub b: Array,
}

#[derive(Tree, Clone, Debug)]
pub struct Batch {
    pub x: Array,
}

#[experiment]
#[derive(Clone)]
pub struct Net {
    #[graph_const]
    pub act: Act,
    #[graph_const]
    pub scale: u32,
    #[device(trainable)]
    pub layer: Dense,
    #[device]
    pub lr: Array,
    pub note: String,
}

fn forward(v: &NetView<'_>, b: &BatchMirror<Tensor>) -> Tensor {
    let z = (b.x.matmul(v.layer.w) + v.layer.b) * f64::from(*v.scale);
    match v.act {
        Act::Tanh => z.tanh(),
        Act::Relu => z.relu(),
    }
}

/// Another body under the same name: what an edit of `forward` looks like to a later process.
fn forward_edited(v: &NetView<'_>, b: &BatchMirror<Tensor>) -> Tensor {
    forward(v, b) + 1.0
}

fn loss_grads(v: &NetView<'_>, b: &BatchMirror<Tensor>) -> Vec<Tensor> {
    let y = forward(v, b).sum_all();
    let mut out = vec![y];
    out.extend(nitro::trace::grad(y, &[v.layer.w, v.layer.b]));
    out
}

/// A shape bug: `[8,3]·[8,3]` does not multiply.
fn broken(_: &NetView<'_>, b: &BatchMirror<Tensor>) -> Tensor {
    b.x.matmul(b.x)
}

const FORWARD: Program<Net, BatchMirror<Tensor>> = Net::program("forward", forward);
const FORWARD_EDITED: Program<Net, BatchMirror<Tensor>> = Net::program("forward", forward_edited);
const GRAD: Program<Net, BatchMirror<Tensor>, Vec<Tensor>> = Net::program("grad", loss_grads);
const BROKEN: Program<Net, BatchMirror<Tensor>> = Net::program("broken", broken);

fn net(act: Act, scale: u32, inputs: usize, outputs: usize) -> Net {
    Net {
        act,
        scale,
        layer: Dense {
            w: Array::zeros(DType::F32, &[inputs, outputs]),
            b: Array::zeros(DType::F32, &[outputs]),
        },
        lr: Array::scalar(0.1f32),
        note: String::new(),
    }
}

fn batch(rows: usize, cols: usize) -> Batch {
    Batch {
        x: Array::zeros(DType::F32, &[rows, cols]),
    }
}

/// An experiment with one GraphConst to make distinct keys of one program cheaply.
#[experiment]
#[derive(Clone)]
pub struct Keyed {
    #[graph_const]
    pub k: u32,
    #[device]
    pub w: Array,
}

fn scale_by_k(v: &KeyedView<'_>, _: &()) -> Tensor {
    v.w * f64::from(*v.k)
}
fn add_k(v: &KeyedView<'_>, _: &()) -> Tensor {
    v.w + f64::from(*v.k)
}
fn sub_k(v: &KeyedView<'_>, _: &()) -> Tensor {
    v.w - f64::from(*v.k)
}

const SCALE: Program<Keyed> = Keyed::program("scale", scale_by_k);
const ADD: Program<Keyed> = Keyed::program("add", add_k);
const SUB: Program<Keyed> = Keyed::program("sub", sub_k);

fn keyed(k: u32) -> Keyed {
    Keyed {
        k,
        w: Array::zeros(DType::F32, &[4]),
    }
}

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

fn dir_cache(dir: &Path, capacity: usize) -> Cache {
    let store = DirStore::open(dir, 1 << 30, None).expect("the store opens");
    let cache = Cache::new(capacity, Some(Arc::new(store)));
    cache.set_verify(true);
    cache
}

fn memory_cache(capacity: usize) -> Cache {
    let cache = Cache::in_memory(capacity);
    cache.set_verify(true);
    cache
}

#[derive(Clone, Debug, PartialEq)]
enum Outcome {
    Hit,
    Miss(MissReason),
}
use Outcome::{Hit, Miss};

/// One lookup on the interpreter, classified by what it did to the counters.
fn look<E: Experiment, M, O: Outputs, I: Tree<Mirror<Tensor> = M>>(
    cache: &Cache,
    program: &Program<E, M, O>,
    experiment: &E,
    inputs: &I,
) -> Outcome {
    look_on(cache, backend::interpreter(), program, experiment, inputs)
}

fn look_on<E: Experiment, M, O: Outputs, I: Tree<Mirror<Tensor> = M>>(
    cache: &Cache,
    backend: &dyn Backend,
    program: &Program<E, M, O>,
    experiment: &E,
    inputs: &I,
) -> Outcome {
    let before = cache.stats();
    if let Err(e) = cache.get(backend, program, experiment, inputs) {
        panic!("lookup of {program:?} failed: {e}");
    }
    let after = cache.stats();
    if after.misses == before.misses {
        assert_eq!(after.hits, before.hits + 1, "a lookup is a hit or a miss");
        Hit
    } else {
        assert_eq!(after.misses, before.misses + 1, "one lookup, one miss");
        assert_eq!(after.hits, before.hits, "a miss is not also a hit");
        let last = cache.recent_misses().pop().expect("a miss is recorded");
        // These tables check which fields moved; the sub-field changes inside them are
        // checked by `graph_const_reasons_name_the_sub_field_and_its_values`.
        Miss(match last.reason {
            MissReason::GraphConstChanged { fields, .. } => MissReason::GraphConstChanged {
                fields,
                changes: Vec::new(),
            },
            other => other,
        })
    }
}

fn gc(fields: &[&str]) -> MissReason {
    MissReason::GraphConstChanged {
        fields: fields.iter().map(|f| (*f).to_owned()).collect(),
        changes: Vec::new(),
    }
}

fn sig(leaf: &str, from: &str, to: &str) -> MissReason {
    sigs(&[(leaf, from, to)])
}

fn backend_changed(component: &str, from: &str, to: &str) -> MissReason {
    MissReason::BackendChanged {
        component: component.into(),
        from: from.into(),
        to: to.into(),
    }
}

fn reason_count(stats: &CacheStats, name: &str) -> u64 {
    stats.misses_by_reason.get(name).copied().unwrap_or(0)
}

/// The interpreter under another identity: what a cache sees when the plugin, platform or CPU
/// features (or only the compile options) differ.
#[derive(Debug)]
struct Renamed {
    identity: Identity,
}

impl Renamed {
    fn new(digest: &str, options: Option<&str>) -> Renamed {
        let base = backend::interpreter().identity();
        Renamed {
            identity: Identity {
                digest: Digest::of(digest),
                options: options.map_or(base.options, Digest::of),
                description: format!("renamed interpreter ({digest})"),
                components: vec![
                    ("backend".to_owned(), digest.to_owned()),
                    ("version".to_owned(), env!("CARGO_PKG_VERSION").to_owned()),
                ],
            },
        }
    }
}

impl Backend for Renamed {
    fn identity(&self) -> &Identity {
        &self.identity
    }
    fn persistent(&self) -> bool {
        true
    }
    fn compile(&self, graph: &Graph, text: &str) -> nitro::Result<Box<dyn Executable>> {
        backend::interpreter().compile(graph, text)
    }
    fn load(&self, payload: &[u8], graph: &Graph) -> nitro::Result<Box<dyn Executable>> {
        backend::interpreter().load(payload, graph)
    }
}

/// The interpreter, counting compiles, taking `delay` for each, optionally failing or panicking.
#[derive(Debug)]
struct Counting {
    compiles: AtomicUsize,
    delay: Duration,
    fail: bool,
    panic: bool,
}

impl Counting {
    fn new(delay: Duration) -> Counting {
        Counting {
            compiles: AtomicUsize::new(0),
            delay,
            fail: false,
            panic: false,
        }
    }

    fn inner() -> &'static Interpreter {
        backend::interpreter()
    }
}

impl Backend for Counting {
    fn identity(&self) -> &Identity {
        Counting::inner().identity()
    }
    fn persistent(&self) -> bool {
        true
    }
    fn compile(&self, graph: &Graph, text: &str) -> nitro::Result<Box<dyn Executable>> {
        self.compiles.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(self.delay);
        if self.panic {
            panic!("the backend crashed while compiling");
        }
        if self.fail {
            return Err(Error::InvalidSerializedExecutable {
                reason: "this backend refuses every program".into(),
            });
        }
        Counting::inner().compile(graph, text)
    }
    fn load(&self, payload: &[u8], graph: &Graph) -> nitro::Result<Box<dyn Executable>> {
        Counting::inner().load(payload, graph)
    }
}

fn entry_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "entry"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

// ---------------------------------------------------------------------------------------------
// 1. Must miss, must hit
// ---------------------------------------------------------------------------------------------

type Step = (&'static str, fn(&mut Net, &mut Batch), Outcome);

#[test]
fn must_miss_and_must_hit_table() {
    let cache = memory_cache(64);
    let mut exp = net(Act::Tanh, 2, 3, 4);
    let mut b = batch(8, 3);
    let steps: Vec<Step> = vec![
        ("first lookup", |_, _| {}, Miss(MissReason::Empty)),
        ("same again", |_, _| {}, Hit),
        (
            "Device values change",
            |e, _| {
                e.layer.w = Array::full(&[3, 4], 0.5f32);
                e.layer.b = Array::full(&[4], -1.0f32);
                e.lr = Array::scalar(0.01f32);
            },
            Hit,
        ),
        (
            "Host change",
            |e, _| e.note = "a different note".into(),
            Hit,
        ),
        (
            "batch values change",
            |_, b| b.x = Array::full(&[8, 3], 7.0f32),
            Hit,
        ),
        (
            "a new handle with equal values",
            |e, _| *e = net(Act::Tanh, 2, 3, 4),
            Hit,
        ),
        (
            "GraphConst `act` changes",
            |e, _| e.act = Act::Relu,
            Miss(gc(&["act"])),
        ),
        ("`act` back", |e, _| e.act = Act::Tanh, Hit),
        (
            // Named against the last *used* key (Tanh, 2), not the last compiled (Relu, 2).
            "GraphConst `scale` changes",
            |e, _| e.scale = 3,
            Miss(gc(&["scale"])),
        ),
        ("`scale` back", |e, _| e.scale = 2, Hit),
        (
            "both GraphConsts change",
            |e, _| {
                e.act = Act::Relu;
                e.scale = 5;
            },
            Miss(gc(&["act", "scale"])),
        ),
        (
            "both back",
            |e, _| {
                e.act = Act::Tanh;
                e.scale = 2;
            },
            Hit,
        ),
        (
            "Device shape changes",
            |e, _| {
                e.layer.w = Array::zeros(DType::F32, &[3, 5]);
                e.layer.b = Array::zeros(DType::F32, &[5]);
            },
            Miss(sigs(&[
                ("layer.w", "f32[3,4]", "f32[3,5]"),
                ("layer.b", "f32[4]", "f32[5]"),
            ])),
        ),
        (
            "Device shape back",
            |e, _| {
                e.layer.w = Array::zeros(DType::F32, &[3, 4]);
                e.layer.b = Array::zeros(DType::F32, &[4]);
            },
            Hit,
        ),
        (
            "Device dtype changes",
            |e, _| e.lr = Array::scalar(0.1f64),
            Miss(sig("lr", "f32[]", "f64[]")),
        ),
        ("dtype back", |e, _| e.lr = Array::scalar(0.5f32), Hit),
        (
            "batch shape changes (a ragged batch)",
            |_, b| b.x = Array::zeros(DType::F32, &[5, 3]),
            Miss(sig("x", "f32[8,3]", "f32[5,3]")),
        ),
        (
            "batch shape back",
            |_, b| b.x = Array::zeros(DType::F32, &[8, 3]),
            Hit,
        ),
    ];
    let mut got = Vec::new();
    for (what, change, expected) in &steps {
        change(&mut exp, &mut b);
        let outcome = look(&cache, &FORWARD, &exp, &b);
        got.push(format!("{what}: {outcome:?}"));
        assert_eq!(
            &outcome,
            expected,
            "step `{what}`; so far:\n{}",
            got.join("\n")
        );
    }
    let stats = cache.stats();
    assert_eq!(stats.misses, 7, "{stats}");
    assert_eq!(stats.entries, 7, "{stats}");
    assert_eq!(stats.hits, steps.len() as u64 - 7);
    assert_eq!(stats.compiles, 7);
    assert_eq!(stats.evictions, 0);
    assert_eq!(reason_count(&stats, "empty"), 1);
    assert_eq!(reason_count(&stats, "graph_const_changed"), 3);
    assert_eq!(reason_count(&stats, "signature_changed"), 3);
    assert!(stats.estimated_bytes > 0);
    cache.assert_no_recompile_after_warmup().unwrap();
}

#[test]
fn a_hit_runs_on_the_current_values() {
    let cache = memory_cache(8);
    let mut exp = net(Act::Tanh, 2, 3, 4);
    let b = Batch {
        x: Array::full(&[2, 3], 1.0f32),
    };
    exp.layer.w = Array::full(&[3, 4], 0.5f32);
    let run = |exp: &Net| {
        let compiled = cache
            .get(backend::interpreter(), &FORWARD, exp, &b)
            .unwrap();
        let out = compiled
            .executable
            .run(&[&exp.layer.w, &exp.layer.b, &exp.lr, &b.x])
            .unwrap();
        (compiled, out[0].as_slice::<f32>().unwrap().to_vec())
    };
    let (first, y1) = run(&exp);
    exp.layer.w = Array::full(&[3, 4], 0.25f32);
    let (second, y2) = run(&exp);
    assert!(
        Arc::ptr_eq(&first.compiled, &second.compiled),
        "new values are a hit"
    );
    assert_eq!(second.outcome, cache::Outcome::Hit);
    assert_eq!((cache.stats().hits, cache.stats().misses), (1, 1));
    // (3 · 0.5) · 2 and (3 · 0.25) · 2 through tanh.
    assert!(
        y1.iter().all(|&v| (v - 3.0f32.tanh()).abs() < 1e-6),
        "{y1:?}"
    );
    assert!(
        y2.iter().all(|&v| (v - 1.5f32.tanh()).abs() < 1e-6),
        "{y2:?}"
    );
}

#[test]
fn distinct_programs_and_backends_do_not_share_entries() {
    let cache = memory_cache(16);
    let exp = net(Act::Tanh, 2, 3, 4);
    let b = batch(8, 3);
    assert_eq!(look(&cache, &FORWARD, &exp, &b), Miss(MissReason::Empty));
    assert_eq!(look(&cache, &GRAD, &exp, &b), Miss(MissReason::Empty));
    assert_eq!(look(&cache, &FORWARD, &exp, &b), Hit);
    assert_eq!(look(&cache, &GRAD, &exp, &b), Hit);
    // The same program for another backend identity, then other compile options.
    let other = Renamed::new("another backend", None);
    assert_eq!(
        look_on(&cache, &other, &FORWARD, &exp, &b),
        Miss(backend_changed(
            "backend",
            "nitro interpreter",
            "another backend"
        ))
    );
    let options = Renamed::new("another backend", Some("-O0"));
    assert_eq!(
        look_on(&cache, &options, &FORWARD, &exp, &b),
        Miss(MissReason::OptionsChanged)
    );
    assert_eq!(look(&cache, &FORWARD, &exp, &b), Hit);
    // A different experiment type with an equal-looking program name never shares a key.
    assert_eq!(
        look(&cache, &SCALE, &keyed(1), &()),
        Miss(MissReason::Empty)
    );
    assert_eq!(cache.stats().entries, 5);
}

// ---------------------------------------------------------------------------------------------
// 2. Capacity, LRU and the eviction ledger
// ---------------------------------------------------------------------------------------------

#[test]
fn capacity_one_evicts_and_says_so_once() {
    let cache = memory_cache(1);
    let (a, b) = (keyed(1), keyed(2));
    assert_eq!(look(&cache, &SCALE, &a, &()), Miss(MissReason::Empty));
    assert_eq!(cache.stats().evictions, 0);
    assert_eq!(look(&cache, &SCALE, &b, &()), Miss(gc(&["k"])));
    assert_eq!(cache.stats().evictions, 1, "inserting B pushed A out");
    assert_eq!(cache.stats().entries, 1);
    assert_eq!(look(&cache, &SCALE, &a, &()), Miss(MissReason::Evicted));
    let stats = cache.stats();
    assert_eq!(stats.evictions, 2, "reinserting A pushed B out: {stats}");
    assert_eq!(reason_count(&stats, "evicted"), 1);
    assert_eq!(stats.entries, 1);
    assert_eq!(look(&cache, &SCALE, &a, &()), Hit);
    assert_eq!(cache.stats().evictions, 2, "a hit evicts nothing");
    assert!(
        cache.assert_no_recompile_after_warmup().is_err(),
        "evictions break misses == entries"
    );
}

#[test]
fn the_ledger_is_bounded_by_capacity() {
    // One program, three keys, capacity 1: the ledger holds only the latest eviction, so when
    // A is asked for again the cache no longer knows it was evicted; it names what moved since
    // the program was last used instead (never `empty`: the program was compiled here).
    let cache = memory_cache(1);
    let (a, b, c) = (keyed(1), keyed(2), keyed(3));
    assert_eq!(look(&cache, &SCALE, &a, &()), Miss(MissReason::Empty));
    assert_eq!(look(&cache, &SCALE, &b, &()), Miss(gc(&["k"])));
    assert_eq!(look(&cache, &SCALE, &c, &()), Miss(gc(&["k"])));
    assert_eq!(
        look(&cache, &SCALE, &a, &()),
        Miss(gc(&["k"])),
        "A fell out of a ledger of one (it holds B)"
    );
    // Inserting A pushed C out, and C is the latest eviction: still in the ledger.
    assert_eq!(look(&cache, &SCALE, &c, &()), Miss(MissReason::Evicted));
    let stats = cache.stats();
    assert_eq!(stats.evictions, 4);
    assert_eq!(reason_count(&stats, "evicted"), 1);
    assert_eq!(reason_count(&stats, "empty"), 1);

    // Three programs, capacity 1: when the ledger has forgotten P1, the program's last-used key
    // equals the one asked for, so the cache still knows it was here and pushed out.
    let cache = memory_cache(1);
    let e = keyed(1);
    assert_eq!(look(&cache, &SCALE, &e, &()), Miss(MissReason::Empty));
    assert_eq!(look(&cache, &ADD, &e, &()), Miss(MissReason::Empty));
    assert_eq!(look(&cache, &SUB, &e, &()), Miss(MissReason::Empty));
    assert_eq!(look(&cache, &SCALE, &e, &()), Miss(MissReason::Evicted));
    let stats = cache.stats();
    assert_eq!(stats.evictions, 3);
    assert!(reason_count(&stats, "evicted") <= stats.evictions);
}

#[test]
fn reinserting_clears_the_ledger_entry() {
    let cache = memory_cache(2);
    let k = |n| keyed(n);
    let steps: Vec<(u32, Outcome, u64)> = vec![
        // (key, outcome, evictions after)
        (1, Miss(MissReason::Empty), 0),
        (2, Miss(gc(&["k"])), 0),
        (3, Miss(gc(&["k"])), 1),          // evicts 1 (LRU)
        (1, Miss(MissReason::Evicted), 2), // back; evicts 2
        (1, Hit, 2),                       // held again: no stale `evicted`
        (3, Hit, 2),
        (2, Miss(MissReason::Evicted), 3), // evicts 1 (3 was used later)
        (1, Miss(MissReason::Evicted), 4), // evicted a second time, counted again; evicts 3
        (2, Hit, 4),
        (1, Hit, 4),
        (3, Miss(MissReason::Evicted), 5),
    ];
    for (i, (key, outcome, evictions)) in steps.iter().enumerate() {
        assert_eq!(&look(&cache, &SCALE, &k(*key), &()), outcome, "step {i}");
        assert_eq!(cache.stats().evictions, *evictions, "step {i}");
        assert!(cache.stats().entries <= 2);
    }
    let stats = cache.stats();
    assert_eq!(reason_count(&stats, "evicted"), 4);
    assert_eq!(stats.misses, 7);
}

#[test]
fn lru_order_is_deterministic() {
    let run = || {
        let cache = memory_cache(2);
        let seq = [
            1, 2, 1, 3, // 3 evicts 2 (1 was used after 2)
            1, 2, // 1 hits; 2 evicts 3
            3, 2, 1, 1, 3,
        ];
        let outcomes: Vec<(u32, Outcome)> = seq
            .iter()
            .map(|&n| (n, look(&cache, &SCALE, &keyed(n), &())))
            .collect();
        (outcomes, cache.stats().evictions)
    };
    let (first, evictions) = run();
    let hits: Vec<u32> = first
        .iter()
        .filter(|(_, o)| *o == Hit)
        .map(|(n, _)| *n)
        .collect();
    assert_eq!(first[2], (1, Hit));
    assert_eq!(first[3], (3, Miss(gc(&["k"]))));
    assert_eq!(first[4], (1, Hit), "1 survived: 2 was least recently used");
    assert_eq!(first[5], (2, Miss(MissReason::Evicted)));
    assert_eq!(
        first[6],
        (3, Miss(MissReason::Evicted)),
        "3 was pushed out by 2"
    );
    assert_eq!(hits, vec![1, 1, 2, 1]);
    assert_eq!(evictions, 5);
    for _ in 0..3 {
        assert_eq!(run(), (first.clone(), evictions));
    }
}

#[test]
fn reset_forgets_programs_and_keeps_counters() {
    let tmp = TempDir::new("reset");
    let cache = dir_cache(tmp.path(), 1);
    let exp = net(Act::Tanh, 2, 3, 4);
    let b = batch(8, 3);
    assert_eq!(look(&cache, &FORWARD, &exp, &b), Miss(MissReason::Empty));
    assert_eq!(look(&cache, &GRAD, &exp, &b), Miss(MissReason::Empty));
    assert_eq!(look(&cache, &GRAD, &exp, &b), Hit);
    assert_eq!(look(&cache, &FORWARD, &exp, &b), Miss(MissReason::Evicted));
    let before = cache.stats();
    assert_eq!(entry_files(tmp.path()).len(), 2);
    assert!(cache.store().unwrap().size_bytes() > 0);

    cache.reset().unwrap();
    let after = cache.stats();
    assert_eq!(after.clears, 1);
    assert_eq!(
        (after.entries, after.estimated_bytes),
        (0, 0),
        "gauges zeroed"
    );
    assert_eq!(
        (
            after.hits,
            after.misses,
            after.evictions,
            after.compiles,
            after.l2_hits
        ),
        (
            before.hits,
            before.misses,
            before.evictions,
            before.compiles,
            before.l2_hits
        ),
        "counters kept"
    );
    assert_eq!(after.misses_by_reason, before.misses_by_reason);
    assert!(
        entry_files(tmp.path()).is_empty(),
        "persistent entries gone"
    );
    assert_eq!(cache.store().unwrap().size_bytes(), 0);

    // Neither `evicted` (the ledger is cleared) nor code_changed: never compiled here now.
    assert_eq!(look(&cache, &GRAD, &exp, &b), Miss(MissReason::Empty));
    let stats = cache.stats();
    assert_eq!(stats.compiles, before.compiles + 1, "compiled, not loaded");
    assert_eq!(stats.l2_hits, before.l2_hits);
    assert_eq!(stats.entries, 1);
    // The acceptance check counts from the reset: one miss, one entry.
    cache.assert_no_recompile_after_warmup().unwrap();
    cache.reset().unwrap();
    assert_eq!(cache.stats().clears, 2);
}

#[test]
fn capacity_zero_always_misses_and_retains_nothing() {
    let cache = memory_cache(0);
    let e = keyed(1);
    for _ in 0..3 {
        assert_eq!(look(&cache, &SCALE, &e, &()), Miss(MissReason::Empty));
    }
    assert_eq!(look(&cache, &ADD, &e, &()), Miss(MissReason::Empty));
    assert_eq!(look(&cache, &SCALE, &keyed(2), &()), Miss(gc(&["k"])));
    assert_eq!(
        look(&cache, &SCALE, &keyed(2), &()),
        Miss(MissReason::Empty)
    );
    let stats = cache.stats();
    assert_eq!(stats.hits, 0);
    assert_eq!(stats.misses, 6);
    assert_eq!(stats.compiles, 6);
    assert_eq!((stats.entries, stats.estimated_bytes), (0, 0));
    assert_eq!(stats.evictions, 0);
    assert_eq!(reason_count(&stats, "evicted"), 0);
}

// ---------------------------------------------------------------------------------------------
// 3. Across processes
// ---------------------------------------------------------------------------------------------

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct ChildReport {
    stats: CacheStats,
    reasons: Vec<(String, MissReason, bool)>,
    /// The forward program's output, by bit pattern.
    forward: Vec<u32>,
    after_reset: Option<CacheStats>,
}

fn child_backend(kind: &str) -> &'static dyn Backend {
    static OTHER: OnceLock<Renamed> = OnceLock::new();
    static OPTIONS: OnceLock<Renamed> = OnceLock::new();
    match kind {
        "xla" => backend::xla().expect("the XLA backend"),
        "other" => OTHER.get_or_init(|| Renamed::new("another backend", None)),
        "options" => OPTIONS.get_or_init(|| {
            Renamed::new(
                &backend::interpreter().identity().description,
                Some("other options"),
            )
        }),
        _ => backend::interpreter(),
    }
}

/// The child side of the cross-process tests; does nothing unless started by one.
#[test]
#[ignore = "run as a child process by the cross-process tests"]
fn child_process() {
    let Ok(dir) = std::env::var("NITRO_TEST_CACHE_DIR") else {
        return;
    };
    let env = |k: &str| std::env::var(k).unwrap_or_default();
    let backend = child_backend(&env("NITRO_TEST_BACKEND"));
    let local;
    let cache: &Cache = if env("NITRO_TEST_GLOBAL") == "1" {
        // The process-wide cache, configured by NITRO_CACHE_DIR / NITRO_CACHE set by the parent.
        cache::global()
    } else {
        local = dir_cache(Path::new(&dir), 16);
        &local
    };
    let forward_program = if env("NITRO_TEST_CODE") == "edited" {
        FORWARD_EDITED
    } else {
        FORWARD
    };
    let mut exp = net(Act::Tanh, 2, 3, 4);
    exp.layer.w = Array::from_vec(&[3, 4], (0..12).map(|i| i as f32 * 0.1).collect()).unwrap();
    let b = Batch {
        x: Array::from_vec(&[2, 3], vec![1.0f32, -2.0, 0.5, 3.0, 0.0, -1.0]).unwrap(),
    };
    let compiled = cache.get(backend, &forward_program, &exp, &b).unwrap();
    let out = compiled
        .executable
        .run(&[&exp.layer.w, &exp.layer.b, &exp.lr, &b.x])
        .unwrap();
    let forward: Vec<u32> = out[0]
        .as_slice::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect();
    cache.get(backend, &GRAD, &exp, &b).unwrap();
    // Every later step hits.
    cache.mark_warm();
    for _ in 0..3 {
        cache.get(backend, &forward_program, &exp, &b).unwrap();
        cache.get(backend, &GRAD, &exp, &b).unwrap();
    }
    cache.assert_no_recompile_after_warmup().unwrap();
    let stats = if env("NITRO_TEST_GLOBAL") == "1" {
        cache::cache_stats()
    } else {
        cache.stats()
    };
    let after_reset = (env("NITRO_TEST_RESET") == "1").then(|| {
        cache::cache_reset().unwrap();
        cache::cache_stats()
    });
    let report = ChildReport {
        stats,
        reasons: cache
            .recent_misses()
            .into_iter()
            .map(|m| (m.program, m.reason, m.loaded))
            .collect(),
        forward,
        after_reset,
    };
    println!(
        "CHILD_REPORT {}",
        serde_json::to_string(&report).expect("the report serializes")
    );
}

fn run_child(dir: &Path, vars: &[(&str, &str)]) -> ChildReport {
    let exe = std::env::current_exe().expect("the test binary");
    let mut cmd = Command::new(exe);
    cmd.args([
        "child_process",
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("NITRO_TEST_CACHE_DIR", dir)
    .env_remove("NITRO_CACHE")
    .env_remove("NITRO_CACHE_KEY")
    .env_remove("NITRO_VERIFY_KEYS");
    for (k, v) in vars {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("the child process runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "child {vars:?} failed:\n{stdout}\n{stderr}"
    );
    let line = stdout
        .lines()
        .find_map(|l| l.split_once("CHILD_REPORT ").map(|(_, json)| json))
        .unwrap_or_else(|| panic!("child {vars:?} printed no report:\n{stdout}\n{stderr}"));
    serde_json::from_str(line).expect("the report parses")
}

fn reasons_of(report: &ChildReport) -> Vec<(&str, &MissReason, bool)> {
    report
        .reasons
        .iter()
        .map(|(p, r, l)| {
            let name = p.rsplit("::").next().unwrap_or(p);
            (name, r, *l)
        })
        .collect()
}

fn warm_start_across_processes(backend: &str) {
    let tmp = TempDir::new(&format!("l2-{backend}"));
    let first = run_child(tmp.path(), &[("NITRO_TEST_BACKEND", backend)]);
    assert_eq!(first.stats.compiles, 2, "{}", first.stats);
    assert_eq!(first.stats.l2_hits, 0);
    assert_eq!(first.stats.hits, 6);
    assert_eq!(
        reasons_of(&first),
        vec![
            ("forward", &MissReason::Empty, false),
            ("grad", &MissReason::Empty, false)
        ]
    );
    assert_eq!(entry_files(tmp.path()).len(), 2);

    let second = run_child(tmp.path(), &[("NITRO_TEST_BACKEND", backend)]);
    assert_eq!(second.stats.l2_hits, 2, "loaded both: {}", second.stats);
    assert_eq!(
        second.stats.compiles, 0,
        "compiled nothing: {}",
        second.stats
    );
    assert_eq!(second.stats.misses, 2);
    assert_eq!(second.stats.compile_ms, 0.0);
    assert_eq!(
        reasons_of(&second),
        vec![
            ("forward", &MissReason::Empty, true),
            ("grad", &MissReason::Empty, true)
        ]
    );
    assert_eq!(
        second.forward, first.forward,
        "the loaded program computes what the compiled one did"
    );
}

#[test]
fn l2_warm_start_across_processes_on_the_interpreter() {
    warm_start_across_processes("interp");
}

#[test]
fn l2_warm_start_across_processes_on_xla() {
    if xla_or_skip("l2_warm_start_across_processes_on_xla").is_some() {
        warm_start_across_processes("xla");
    }
}

#[test]
fn an_edit_below_the_hooks_is_code_changed_across_processes() {
    let tmp = TempDir::new("code");
    let first = run_child(tmp.path(), &[]);
    assert_eq!(first.stats.compiles, 2);
    // Same program name, experiment type, GraphConsts and signature; another body.
    let edited = run_child(tmp.path(), &[("NITRO_TEST_CODE", "edited")]);
    let reasons = reasons_of(&edited);
    match reasons[0] {
        ("forward", MissReason::CodeChanged { from, to }, false) => assert_ne!(from, to),
        other => panic!("expected code_changed for forward, got {other:?}"),
    }
    assert_eq!(
        reasons[1],
        ("grad", &MissReason::Empty, true),
        "the unedited program still loads"
    );
    assert_eq!((edited.stats.compiles, edited.stats.l2_hits), (1, 1));
    assert_ne!(edited.forward, first.forward, "the edit changed the output");
    assert_eq!(reason_count(&edited.stats, "code_changed"), 1);

    // Back to the original code: both programs are still stored, so both load.
    let back = run_child(tmp.path(), &[]);
    assert_eq!((back.stats.compiles, back.stats.l2_hits), (0, 2));
    assert_eq!(back.forward, first.forward);
}

#[test]
fn another_backend_identity_is_backend_changed_across_processes() {
    let tmp = TempDir::new("backend");
    run_child(tmp.path(), &[("NITRO_TEST_BACKEND", "interp")]);
    let other = run_child(tmp.path(), &[("NITRO_TEST_BACKEND", "other")]);
    // Named: which component of the identity differs, from what to what.
    let moved = backend_changed("backend", "nitro interpreter", "another backend");
    assert_eq!(
        reasons_of(&other),
        vec![("forward", &moved, false), ("grad", &moved, false)]
    );
    assert_eq!((other.stats.compiles, other.stats.l2_hits), (2, 0));
    assert_eq!(entry_files(tmp.path()).len(), 4, "one entry per backend");
    let again = run_child(tmp.path(), &[("NITRO_TEST_BACKEND", "other")]);
    assert_eq!((again.stats.compiles, again.stats.l2_hits), (0, 2));
    // Nothing moved since the last process used these programs: `empty`, and loaded.
    assert!(reasons_of(&again)
        .iter()
        .all(|(_, r, loaded)| **r == MissReason::Empty && *loaded));
    // Both backends' entries are kept: going back loads, and says what moved since last time.
    let back = run_child(tmp.path(), &[("NITRO_TEST_BACKEND", "interp")]);
    assert_eq!((back.stats.compiles, back.stats.l2_hits), (0, 2));
    let moved_back = backend_changed("backend", "another backend", "nitro interpreter");
    assert_eq!(
        reasons_of(&back),
        vec![("forward", &moved_back, true), ("grad", &moved_back, true)]
    );

    // The interpreter's identity with other compile options.
    let options = run_child(tmp.path(), &[("NITRO_TEST_BACKEND", "options")]);
    assert_eq!(
        reasons_of(&options),
        vec![
            ("forward", &MissReason::OptionsChanged, false),
            ("grad", &MissReason::OptionsChanged, false)
        ]
    );
    assert_eq!((options.stats.compiles, options.stats.l2_hits), (2, 0));
}

#[test]
fn the_global_cache_reads_its_directory_from_the_environment() {
    let tmp = TempDir::new("global");
    let dir = tmp.path().to_str().unwrap().to_owned();
    let vars = [
        ("NITRO_TEST_GLOBAL", "1"),
        ("NITRO_CACHE_DIR", dir.as_str()),
    ];
    let first = run_child(tmp.path(), &vars);
    assert_eq!((first.stats.compiles, first.stats.l2_hits), (2, 0));
    assert_eq!(entry_files(tmp.path()).len(), 2);
    let second = run_child(tmp.path(), &vars);
    assert_eq!((second.stats.compiles, second.stats.l2_hits), (0, 2));
    assert_eq!(second.forward, first.forward);

    // `cache_reset` clears the global cache and its directory, keeping the counters.
    let reset = run_child(tmp.path(), &[vars[0], vars[1], ("NITRO_TEST_RESET", "1")]);
    let after = reset.after_reset.expect("stats after the reset");
    assert_eq!(after.clears, 1);
    assert_eq!(after.entries, 0);
    assert_eq!(after.misses, reset.stats.misses);
    assert!(entry_files(tmp.path()).is_empty());

    // NITRO_CACHE=off: no persistent level, every process compiles.
    let off = [vars[0], vars[1], ("NITRO_CACHE", "off")];
    let a = run_child(tmp.path(), &off);
    let b = run_child(tmp.path(), &off);
    assert_eq!((a.stats.compiles, b.stats.compiles), (2, 2));
    assert_eq!(b.stats.l2_hits, 0);
    assert!(entry_files(tmp.path()).is_empty());
}

// ---------------------------------------------------------------------------------------------
// 5. Single flight
// ---------------------------------------------------------------------------------------------

fn concurrent_lookups(
    cache: &Cache,
    backend: &Counting,
    threads: usize,
) -> Vec<nitro::Result<cache::Served>> {
    let barrier = Barrier::new(threads);
    let exp = net(Act::Tanh, 2, 3, 4);
    let b = batch(8, 3);
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    barrier.wait();
                    cache.get(backend, &FORWARD, &exp, &b)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("no lookup panics"))
            .collect()
    })
}

#[test]
fn concurrent_requests_for_one_key_compile_once() {
    let backend = Counting::new(Duration::from_millis(50));
    let cache = memory_cache(16);
    let results = concurrent_lookups(&cache, &backend, 8);
    let served: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
    assert!(served
        .iter()
        .all(|c| Arc::ptr_eq(&c.compiled, &served[0].compiled)));
    // Each call says what it did: one compiled, seven were served the shared compile.
    let outcomes: Vec<_> = served.iter().map(|s| &s.outcome).collect();
    assert_eq!(
        outcomes
            .iter()
            .filter(|o| matches!(
                o,
                cache::Outcome::Compiled {
                    reason: MissReason::Empty
                }
            ))
            .count(),
        1,
        "{outcomes:?}"
    );
    assert_eq!(outcomes.iter().filter(|o| o.is_hit()).count(), 7);
    assert_eq!(backend.compiles.load(Ordering::SeqCst), 1);
    let stats = cache.stats();
    assert_eq!(stats.compiles, 1, "{stats}");
    assert_eq!(stats.misses, 1, "{stats}");
    assert_eq!(stats.hits, 7, "{stats}");
    assert_eq!(stats.entries, 1);
}

#[test]
fn concurrent_requests_with_a_store_compile_once_and_store_once() {
    let tmp = TempDir::new("flight");
    let backend = Counting::new(Duration::from_millis(50));
    let cache = dir_cache(tmp.path(), 16);
    let results = concurrent_lookups(&cache, &backend, 8);
    assert!(results.iter().all(|r| r.is_ok()));
    assert_eq!(backend.compiles.load(Ordering::SeqCst), 1);
    assert_eq!(
        (
            cache.stats().misses,
            cache.stats().hits,
            cache.stats().compiles
        ),
        (1, 7, 1)
    );
    assert_eq!(entry_files(tmp.path()).len(), 1);

    // Two caches on one store (two processes, in effect): the second loads, never compiles.
    let other = dir_cache(tmp.path(), 16);
    let results = concurrent_lookups(&other, &backend, 8);
    assert!(results.iter().all(|r| r.is_ok()));
    assert_eq!(backend.compiles.load(Ordering::SeqCst), 1);
    assert_eq!((other.stats().l2_hits, other.stats().hits), (1, 7));
}

#[test]
fn concurrent_requests_at_capacity_zero_share_one_compile() {
    let backend = Counting::new(Duration::from_millis(50));
    let cache = memory_cache(0);
    let results = concurrent_lookups(&cache, &backend, 8);
    assert!(results.iter().all(|r| r.is_ok()));
    assert_eq!(backend.compiles.load(Ordering::SeqCst), 1);
    let stats = cache.stats();
    assert_eq!(
        stats.hits + stats.misses,
        8,
        "every lookup is counted once: {stats}"
    );
    assert_eq!((stats.misses, stats.entries), (1, 0));
}

#[test]
fn a_failed_compile_is_shared_by_its_waiters_and_retried_later() {
    let mut backend = Counting::new(Duration::from_millis(50));
    backend.fail = true;
    let cache = memory_cache(16);
    let results = concurrent_lookups(&cache, &backend, 8);
    assert!(results.iter().all(|r| r.is_err()));
    let waited = results
        .iter()
        .filter(|r| matches!(r, Err(Error::CompileFailedElsewhere { .. })))
        .count();
    assert_eq!(waited, 7, "the others waited for the one compile");
    assert_eq!(backend.compiles.load(Ordering::SeqCst), 1);
    // Not cached: the next request compiles again.
    assert!(concurrent_lookups(&cache, &backend, 1)[0].is_err());
    assert_eq!(backend.compiles.load(Ordering::SeqCst), 2);
    let stats = cache.stats();
    assert_eq!((stats.misses, stats.entries, stats.compiles), (0, 0, 0));
}

#[test]
fn a_panicking_compile_never_blocks_later_requests() {
    let mut backend = Counting::new(Duration::from_millis(50));
    backend.panic = true;
    let backend = Arc::new(backend);
    let cache = Arc::new(memory_cache(16));
    let (tx, rx) = mpsc::channel();
    {
        let (backend, cache) = (backend.clone(), cache.clone());
        std::thread::spawn(move || {
            let barrier = Barrier::new(4);
            let exp = net(Act::Tanh, 2, 3, 4);
            let b = batch(8, 3);
            let outcomes: Vec<String> = std::thread::scope(|s| {
                let hs: Vec<_> = (0..4)
                    .map(|_| {
                        s.spawn(|| {
                            barrier.wait();
                            cache.get(&*backend, &FORWARD, &exp, &b)
                        })
                    })
                    .collect();
                hs.into_iter()
                    .map(|h| match h.join() {
                        Err(_) => "panicked".to_owned(),
                        Ok(Ok(_)) => "ok".to_owned(),
                        Ok(Err(e)) => e.to_string(),
                    })
                    .collect()
            });
            // A later request, after the panic: it must not wait for the dead leader.
            let later = std::thread::scope(|s| {
                s.spawn(|| cache.get(&*backend, &FORWARD, &exp, &b))
                    .join()
                    .is_err()
            });
            let _ = tx.send((outcomes, later));
        });
    }
    let (outcomes, later_panicked) = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("requests after a panicking compile finish");
    assert!(outcomes.iter().any(|o| o == "panicked"), "{outcomes:?}");
    for o in &outcomes {
        assert!(o == "panicked" || o.contains("panicked"), "{o}");
    }
    assert!(
        later_panicked,
        "the later request compiled (and panicked) itself"
    );
    assert_eq!(cache.stats().entries, 0);
}

// ---------------------------------------------------------------------------------------------
// 6. Verify mode
// ---------------------------------------------------------------------------------------------

static GLOBAL_FACTOR: AtomicU32 = AtomicU32::new(1);

/// Reads a global while tracing: a value the compile key cannot see.
fn reads_a_global(v: &KeyedView<'_>, _: &()) -> Tensor {
    v.w * f64::from(GLOBAL_FACTOR.load(Ordering::SeqCst))
}
const READS_A_GLOBAL: Program<Keyed> = Keyed::program("reads_a_global", reads_a_global);

#[test]
fn verify_mode_reports_a_program_that_moved_without_its_key() {
    let cache = memory_cache(8);
    let e = keyed(1);
    let first = cache
        .get(backend::interpreter(), &READS_A_GLOBAL, &e, &())
        .unwrap();
    assert_eq!(
        look(&cache, &READS_A_GLOBAL, &e, &()),
        Hit,
        "unchanged: a hit"
    );
    GLOBAL_FACTOR.store(2, Ordering::SeqCst);
    let err = cache
        .get(backend::interpreter(), &READS_A_GLOBAL, &e, &())
        .unwrap_err();
    match &err {
        Error::StaleKey { program, was, now } => {
            assert!(program.ends_with("Keyed::reads_a_global"), "{program}");
            assert_eq!(*was, first.fingerprint.short().to_string());
            assert_ne!(was, now);
        }
        other => panic!("expected StaleKey, got {other}"),
    }
    assert!(err.to_string().contains("#[graph_const]"), "{err}");

    // Without verify mode the stale program is served: this is what verify mode is for.
    cache.set_verify(false);
    let stale = cache
        .get(backend::interpreter(), &READS_A_GLOBAL, &e, &())
        .unwrap();
    assert!(Arc::ptr_eq(&stale.compiled, &first.compiled));
    let out = stale.executable.run(&[&Array::full(&[4], 1.0f32)]).unwrap();
    assert_eq!(
        out[0].as_slice::<f32>().unwrap(),
        &[1.0f32; 4],
        "factor 1, not 2"
    );
    GLOBAL_FACTOR.store(1, Ordering::SeqCst);
    assert_eq!(cache.stats().misses, 1);
}

fn twin_a(v: &KeyedView<'_>, _: &()) -> Tensor {
    v.w * 2.0
}
fn twin_b(v: &KeyedView<'_>, _: &()) -> Tensor {
    v.w * 3.0
}
const TWIN_A: Program<Keyed> = Keyed::program("twin", twin_a);
const TWIN_B: Program<Keyed> = Keyed::program("twin", twin_b);

#[test]
fn two_programs_sharing_a_name_never_share_an_entry() {
    // Two bodies under one name emit two programs (two fingerprints): two entries, each
    // running its own code.
    let cache = memory_cache(8);
    let e = keyed(1);
    let a = cache.get(backend::interpreter(), &TWIN_A, &e, &()).unwrap();
    let b = cache.get(backend::interpreter(), &TWIN_B, &e, &()).unwrap();
    assert_ne!(a.fingerprint, b.fingerprint);
    assert_eq!(a.program, b.program, "same identity string: {}", a.program);
    let stats = cache.stats();
    assert_eq!((stats.misses, stats.entries, stats.hits), (2, 2, 0));
    // The second is the same program identity with other code: `code_changed`, naming both
    // fingerprints.
    let reasons: Vec<MissReason> = cache
        .recent_misses()
        .into_iter()
        .map(|m| m.reason)
        .collect();
    assert_eq!(
        reasons,
        vec![
            MissReason::Empty,
            MissReason::CodeChanged {
                from: a.fingerprint.short().to_string(),
                to: b.fingerprint.short().to_string()
            }
        ]
    );
    // Each is then a hit for its own code, and runs it.
    for (program, factor) in [(&TWIN_A, 2.0f32), (&TWIN_B, 3.0), (&TWIN_A, 2.0)] {
        let again = cache.get(backend::interpreter(), program, &e, &()).unwrap();
        assert!(again.outcome.is_hit());
        let w = Array::full(&[4], 1.0f32);
        let out = again.executable.run(&[&w]).unwrap();
        assert_eq!(out[0].as_slice::<f32>().unwrap(), &[factor; 4]);
    }
}

// ---------------------------------------------------------------------------------------------
// 7. The acceptance check
// ---------------------------------------------------------------------------------------------

#[test]
fn no_recompile_after_warmup_passes_after_a_warm_loop() {
    let cache = memory_cache(16);
    let mut exp = net(Act::Tanh, 2, 3, 4);
    let mut b = batch(8, 3);
    for step in 0..10 {
        cache.get(backend::interpreter(), &GRAD, &exp, &b).unwrap();
        cache
            .get(backend::interpreter(), &FORWARD, &exp, &b)
            .unwrap();
        if step == 0 {
            cache.mark_warm();
        }
        // What a training step changes: values only.
        exp.layer.w = Array::full(&[3, 4], step as f32);
        exp.lr = Array::scalar(0.1f32 / (step + 1) as f32);
        b.x = Array::full(&[8, 3], -(step as f32));
        exp.note = format!("step {step}");
    }
    cache.assert_no_recompile_after_warmup().unwrap();
    assert_eq!(cache.stats().misses, 2);
    assert_eq!(cache.stats().hits, 18);

    // A signature change after warm-up fails the check, naming why.
    b.x = Array::zeros(DType::F32, &[5, 3]);
    cache.get(backend::interpreter(), &GRAD, &exp, &b).unwrap();
    let err = cache.assert_no_recompile_after_warmup().unwrap_err();
    match &err {
        Error::Recompiled {
            since_warm,
            misses,
            entries,
            recent,
        } => {
            assert_eq!((*since_warm, *misses, *entries), (1, 3, 3));
            assert!(recent.contains("Net::grad"), "{recent}");
            assert!(
                recent.contains("signature_changed: x f32[8,3] → f32[5,3]"),
                "{recent}"
            );
        }
        other => panic!("expected Recompiled, got {other}"),
    }
    assert!(err.to_string().contains("since warm-up"), "{err}");
}

#[test]
fn no_recompile_after_warmup_fails_on_a_graph_const_change() {
    let cache = memory_cache(16);
    let mut exp = net(Act::Tanh, 2, 3, 4);
    let b = batch(8, 3);
    cache
        .get(backend::interpreter(), &FORWARD, &exp, &b)
        .unwrap();
    cache.mark_warm();
    cache
        .get(backend::interpreter(), &FORWARD, &exp, &b)
        .unwrap();
    cache.assert_no_recompile_after_warmup().unwrap();
    exp.scale = 7;
    cache
        .get(backend::interpreter(), &FORWARD, &exp, &b)
        .unwrap();
    let err = cache.assert_no_recompile_after_warmup().unwrap_err();
    assert!(
        err.to_string().contains("graph_const_changed: scale"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------
// 8. Failures are never cached
// ---------------------------------------------------------------------------------------------

/// The cache a re-entrant program asks, and what its nested request returned.
static REENTRANT_CACHE: OnceLock<Cache> = OnceLock::new();
static NESTED: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// A traced program that asks the cache for its own key while being traced.
fn asks_for_itself(v: &KeyedView<'_>, _: &()) -> Tensor {
    let cache = REENTRANT_CACHE.get().expect("set by the test");
    let outcome = cache.get(backend::interpreter(), &ASKS_FOR_ITSELF, &keyed(1), &());
    *NESTED.lock().unwrap() = Some(match outcome {
        Ok(s) => format!("served: {}", s.outcome),
        Err(e) => format!("{e:?}"),
    });
    v.w * 2.0
}
const ASKS_FOR_ITSELF: Program<Keyed> = Keyed::program("asks_for_itself", asks_for_itself);

#[test]
fn a_program_asking_for_its_own_key_gets_an_error_not_a_deadlock() {
    let cache = REENTRANT_CACHE.get_or_init(|| memory_cache(4));
    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || {
        let served = cache.get(backend::interpreter(), &ASKS_FOR_ITSELF, &keyed(1), &());
        let _ = done.send(served.map(|s| s.outcome));
    });
    let outcome = finished
        .recv_timeout(Duration::from_secs(60))
        .expect("the lookup finishes: no deadlock on its own compile")
        .unwrap();
    assert_eq!(
        outcome,
        cache::Outcome::Compiled {
            reason: MissReason::Empty
        }
    );
    let nested = NESTED.lock().unwrap().clone().unwrap();
    assert_eq!(nested, "NestedTrace", "the nested request failed, typed");
    assert_eq!(cache.stats().compiles, 1);
}

#[test]
fn a_trace_error_is_reported_every_time_and_never_cached() {
    let tmp = TempDir::new("errors");
    let cache = dir_cache(tmp.path(), 16);
    let exp = net(Act::Tanh, 2, 3, 4);
    let b = batch(8, 3);
    let first = cache
        .get(backend::interpreter(), &BROKEN, &exp, &b)
        .unwrap_err();
    let second = cache
        .get(backend::interpreter(), &BROKEN, &exp, &b)
        .unwrap_err();
    assert_eq!(first.to_string(), second.to_string());
    assert!(first.to_string().contains("`matmul`"), "{first}");
    let stats = cache.stats();
    assert_eq!(
        (stats.hits, stats.misses, stats.entries, stats.compiles),
        (0, 0, 0, 0),
        "{stats}"
    );
    assert!(entry_files(tmp.path()).is_empty());
    assert_eq!(cache.store().unwrap().size_bytes(), 0);
    // A good program afterwards is an ordinary first miss.
    assert_eq!(look(&cache, &FORWARD, &exp, &b), Miss(MissReason::Empty));
}

#[test]
fn a_compile_error_is_reported_every_time_and_never_cached() {
    let tmp = TempDir::new("compile-errors");
    let cache = dir_cache(tmp.path(), 16);
    let mut backend = Counting::new(Duration::ZERO);
    backend.fail = true;
    let exp = net(Act::Tanh, 2, 3, 4);
    let b = batch(8, 3);
    let errors: Vec<String> = (0..2)
        .map(|_| {
            cache
                .get(&backend, &FORWARD, &exp, &b)
                .unwrap_err()
                .to_string()
        })
        .collect();
    assert_eq!(errors[0], errors[1]);
    assert!(errors[0].contains("refuses every program"), "{}", errors[0]);
    assert_eq!(backend.compiles.load(Ordering::SeqCst), 2, "tried again");
    let stats = cache.stats();
    assert_eq!((stats.misses, stats.entries, stats.compiles), (0, 0, 0));
    assert!(entry_files(tmp.path()).is_empty());
    // The same backend identity that works: compiles (nothing poisoned the key).
    assert_eq!(look(&cache, &FORWARD, &exp, &b), Miss(MissReason::Empty));
    assert_eq!(cache.stats().compiles, 1);
}

// ---------------------------------------------------------------------------------------------
// Store selection
// ---------------------------------------------------------------------------------------------

#[test]
fn a_cache_without_a_persistent_backend_never_writes_the_store() {
    #[derive(Debug)]
    struct Volatile;
    impl Backend for Volatile {
        fn identity(&self) -> &Identity {
            backend::interpreter().identity()
        }
        fn persistent(&self) -> bool {
            false
        }
        fn compile(&self, graph: &Graph, text: &str) -> nitro::Result<Box<dyn Executable>> {
            backend::interpreter().compile(graph, text)
        }
        fn load(&self, _: &[u8], _: &Graph) -> nitro::Result<Box<dyn Executable>> {
            panic!("a volatile backend is never asked to load")
        }
    }
    let tmp = TempDir::new("volatile");
    let cache = dir_cache(tmp.path(), 4);
    let e = keyed(1);
    assert_eq!(
        look_on(&cache, &Volatile, &SCALE, &e, &()),
        Miss(MissReason::Empty)
    );
    assert!(entry_files(tmp.path()).is_empty());
    assert_eq!(cache.store().unwrap().size_bytes(), 0);
}

#[test]
fn the_lint_names_a_graph_const_that_keeps_recompiling_and_a_program_with_many_variants() {
    let cache = memory_cache(64);
    cache.set_variant_warning(4);
    for k in 0..7 {
        assert!(!look(&cache, &SCALE, &keyed(k), &()).eq(&Hit));
    }
    // Repeats hit and add nothing.
    for k in 0..7 {
        assert_eq!(look(&cache, &SCALE, &keyed(k), &()), Hit);
    }
    let lints = cache.lints();
    assert_eq!(
        lints,
        vec![
            cache::Lint::RepeatedGraphConst {
                program: SCALE.identity(),
                field: "k".into(),
                compiles: 3,
            },
            cache::Lint::ManyVariants {
                program: SCALE.identity(),
                variants: 5,
            },
        ],
        "each named once"
    );
    let text = lints[0].to_string();
    assert!(text.contains("`k`") && text.contains("#[device]"), "{text}");
}

// ---------------------------------------------------------------------------------------------
// Compiles that say they are running (issue 31, item 5)
// ---------------------------------------------------------------------------------------------

/// The child of [`a_compile_says_it_runs_unless_quiet`]: compiles announced at once, one
/// compile on a quiet thread.
#[test]
#[ignore = "run as a child process by a_compile_says_it_runs_unless_quiet"]
fn announce_child() {
    let cache = Cache::in_memory(8);
    cache.set_announce_after(Duration::ZERO);
    let b = backend::interpreter();
    cache.get(b, &SCALE, &keyed(2), &()).unwrap();
    cache::quietly(true, || cache.get(b, &ADD, &keyed(2), &()).unwrap());
    // A hit compiles nothing, so says nothing.
    cache.get(b, &SCALE, &keyed(2), &()).unwrap();
}

#[test]
fn a_compile_says_it_runs_unless_quiet() {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .args([
            "--exact",
            "announce_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("nitro: compil"))
        .collect();
    assert_eq!(lines.len(), 2, "{stderr}");
    assert!(
        lines[0].starts_with("nitro: compiling ")
            && lines[0].contains("Keyed::scale")
            && lines[0].contains("no earlier compile recorded here"),
        "{stderr}"
    );
    assert!(
        lines[1].starts_with("nitro: compiled ") && lines[1].contains("Keyed::scale"),
        "{stderr}"
    );
    assert!(
        !stderr.contains("Keyed::add"),
        "the quiet compile said nothing: {stderr}"
    );
}

// ---------------------------------------------------------------------------------------------
// A compile preset is part of the key (issue 31, item 3)
// ---------------------------------------------------------------------------------------------

/// A process under another compile preset (`XLA_FLAGS`, which nitro keys as part of the
/// backend's identity) shares the store but loads nothing compiled under the first: it misses
/// naming `XLA_FLAGS`, and compiles its own; the first setting then loads its own again.
#[test]
fn a_compile_preset_misses_naming_xla_flags_and_loads_nothing_stale() {
    if xla_or_skip("a_compile_preset_misses_naming_xla_flags").is_none() {
        return;
    }
    let tmp = TempDir::new("preset");
    let plain = [("NITRO_TEST_BACKEND", "xla"), ("XLA_FLAGS", "")];
    let preset = [
        ("NITRO_TEST_BACKEND", "xla"),
        ("XLA_FLAGS", "--xla_cpu_opt_preset=FAST_COMPILE"),
    ];
    let first = run_child(tmp.path(), &plain);
    assert_eq!(
        (first.stats.compiles, first.stats.l2_hits),
        (2, 0),
        "{}",
        first.stats
    );
    let other = run_child(tmp.path(), &preset);
    assert_eq!(
        (other.stats.compiles, other.stats.l2_hits),
        (2, 0),
        "{}",
        other.stats
    );
    for (program, reason, loaded) in reasons_of(&other) {
        assert!(!loaded, "{program} loaded a program of another preset");
        match reason {
            MissReason::BackendChanged { component, to, .. } => {
                assert_eq!(component, "XLA_FLAGS", "{program}: {reason}");
                assert!(to.contains("FAST_COMPILE"), "{program}: {reason}");
            }
            other => panic!("{program}: {other}"),
        }
    }
    let again = run_child(tmp.path(), &plain);
    assert_eq!(
        (again.stats.compiles, again.stats.l2_hits),
        (0, 2),
        "{}",
        again.stats
    );
    assert_eq!(again.forward, first.forward);
}

// ---- GraphConst reasons by sub-field (issue 40, item 14) ----------------------------------

#[derive(ContentHash, Clone, Debug, PartialEq)]
pub enum Activation {
    Tanh,
    Relu,
    Scale(f64),
}

#[derive(ContentHash, Clone, Debug, PartialEq)]
pub struct Arch {
    pub hidden: usize,
    pub act: Activation,
    pub widths: Vec<usize>,
    pub name: String,
    pub blocks: Vec<Block>,
}

#[derive(ContentHash, Clone, Debug, PartialEq)]
pub struct Block {
    pub heads: u32,
}

#[experiment]
#[derive(Clone)]
pub struct Deep {
    #[graph_const]
    pub arch: Arch,
    #[graph_const]
    pub k: u32,
    #[device]
    pub w: Array,
}

fn deep_step(v: &DeepView<'_>, _: &()) -> Tensor {
    v.w * (v.arch.hidden as f64 + f64::from(*v.k) + v.arch.blocks.len() as f64)
}

const DEEP: Program<Deep> = Deep::program("deep", deep_step);

#[test]
fn graph_const_reasons_name_the_sub_field_and_its_values() {
    let cache = Cache::in_memory(16);
    let base = Deep {
        arch: Arch {
            hidden: 32,
            act: Activation::Tanh,
            widths: vec![8, 4],
            name: "mlp".into(),
            blocks: vec![Block { heads: 2 }, Block { heads: 4 }],
        },
        k: 1,
        w: Array::full(&[3], 1.0f32),
    };
    let reason = |e: &Deep| -> String {
        let before = cache.stats().misses;
        cache.get(backend::interpreter(), &DEEP, e, &()).unwrap();
        assert_eq!(cache.stats().misses, before + 1, "a miss");
        cache.recent_misses().pop().unwrap().reason.to_string()
    };
    assert_eq!(reason(&base), "empty (never compiled here)");
    let mut e = base.clone();
    let mut step = |f: &dyn Fn(&mut Deep), want: &str| {
        f(&mut e);
        assert_eq!(reason(&e), want);
    };
    step(
        &|e| e.arch.hidden = 48,
        "graph_const_changed: arch.hidden 32 → 48",
    );
    step(
        &|e| e.arch.act = Activation::Relu,
        "graph_const_changed: arch.act Tanh → Relu",
    );
    step(
        &|e| e.arch.act = Activation::Scale(0.5),
        "graph_const_changed: arch.act Relu → Scale(…)",
    );
    step(
        &|e| e.arch.act = Activation::Scale(2.0),
        "graph_const_changed: arch.act.0 0.5 → 2.0",
    );
    step(
        &|e| e.arch.widths = vec![8, 5],
        "graph_const_changed: arch.widths [8, 4] → [8, 5]",
    );
    step(
        &|e| e.arch.name = "wide".into(),
        "graph_const_changed: arch.name \"mlp\" → \"wide\"",
    );
    step(
        &|e| e.arch.blocks[1].heads = 8,
        "graph_const_changed: arch.blocks[1].heads 4 → 8",
    );
    // A sequence that grew: its common elements are equal, so the sequence itself is named.
    step(
        &|e| e.arch.blocks.push(Block { heads: 1 }),
        "graph_const_changed: arch.blocks",
    );
    // Two fields at once: each named by what moved in it.
    step(
        &|e| {
            e.arch.hidden = 64;
            e.k = 2;
        },
        "graph_const_changed: arch.hidden 48 → 64, k 1 → 2",
    );
    // The fields are still listed as before (the lint counts them).
    let last = cache.recent_misses().pop().unwrap().reason;
    match last {
        MissReason::GraphConstChanged { fields, changes } => {
            assert_eq!(fields, ["arch", "k"]);
            assert_eq!(changes.len(), 2);
            assert_eq!(changes[0].from.as_deref(), Some("48"));
        }
        other => panic!("{other}"),
    }
}

#[test]
fn graph_const_reasons_by_sub_field_cross_processes_through_the_store() {
    let tmp = TempDir::new("subfield-store");
    let open = || {
        let store = Arc::new(DirStore::open(tmp.path(), 1 << 30, None).unwrap());
        Cache::new(8, Some(store))
    };
    let mut e = Deep {
        arch: Arch {
            hidden: 32,
            act: Activation::Tanh,
            widths: vec![8],
            name: "mlp".into(),
            blocks: Vec::new(),
        },
        k: 1,
        w: Array::full(&[3], 1.0f32),
    };
    open().get(backend::interpreter(), &DEEP, &e, &()).unwrap();
    // A fresh cache (as a new process) on the same store: the record's parts name the move.
    e.arch.act = Activation::Relu;
    let fresh = open();
    fresh.get(backend::interpreter(), &DEEP, &e, &()).unwrap();
    assert_eq!(
        fresh.recent_misses()[0].reason.to_string(),
        "graph_const_changed: arch.act Tanh → Relu"
    );
}

/// Issue 40, item 6: a preflight's recorded times are its entry's own. Two entries of one
/// program (k = 3 and k = 4); only k = 4's is loaded by a later cache, so only its probe reports
/// a load time — k = 3's does not borrow it.
#[test]
fn a_probes_recorded_times_are_its_entrys_own() {
    let tmp = TempDir::new("probe-times");
    let open = || {
        let store = Arc::new(DirStore::open(tmp.path(), 1 << 30, None).unwrap());
        Cache::new(8, Some(store))
    };
    let first = open();
    first
        .get(backend::interpreter(), &SCALE, &keyed(3), &())
        .unwrap();
    first
        .get(backend::interpreter(), &SCALE, &keyed(4), &())
        .unwrap();
    // A second cache loads k = 4 (its entry's record now has a load time).
    let second = open();
    second
        .get(backend::interpreter(), &SCALE, &keyed(4), &())
        .unwrap();
    assert_eq!(second.stats().l2_hits, 1);
    let fresh = open();
    let four = fresh
        .probe(backend::interpreter(), &SCALE, &keyed(4), &())
        .unwrap();
    let three = fresh
        .probe(backend::interpreter(), &SCALE, &keyed(3), &())
        .unwrap();
    assert_eq!(
        (four.will, three.will),
        (cache::Will::Load, cache::Will::Load)
    );
    assert!(four.load_ms.is_some(), "{four:?}");
    assert_eq!(three.load_ms, None, "k = 3 was never loaded: {three:?}");
    assert!(three.compile_ms.is_some() && four.compile_ms.is_some());
}
