//! Adversarial tests of the compile key, one section per class of key error: structure that
//! leaves no leaf behind, signature diffs by path, precomputed key parts, what each lookup
//! reports, and misses named across processes. (Trait objects as GraphConsts are compile
//! errors: `ui-tests/tests/ui/unhashable/dyn_*.rs`; program identity in a release build:
//! `tests/program_identity.rs`.)
//!
//! Each structural case checks two things on both backends: the lookup misses with a reason
//! that names what moved, and the program it serves computes what the current structure asks
//! for (a stale hit would compute the old structure's answer). XLA cases print `skip:` without a
//! plugin, unless `NITRO_REQUIRE_XLA=1`.
#![allow(missing_docs)]

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use common::{sigs, xla_or_skip, TempDir};
use nitro::backend::{self, Backend};
use nitro::cache::{Cache, DirStore, MissReason, Outcome, Prepared};
use nitro::prelude::*;
use nitro::program::Program;
use nitro::LeafPath;
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// The backends a test runs on: the interpreter, and XLA when a plugin is installed.
fn backends(test: &str) -> Vec<&'static dyn Backend> {
    let mut v: Vec<&'static dyn Backend> = vec![backend::interpreter()];
    v.extend(xla_or_skip(test));
    v
}

fn ones(n: usize) -> Array {
    Array::full(&[n], 1.0f32)
}

fn values(out: &[Array]) -> Vec<f32> {
    out[0].as_slice::<f32>().expect("f32 output").to_vec()
}

// ---------------------------------------------------------------------------------------------
// 1. Structure that leaves no leaf behind
// ---------------------------------------------------------------------------------------------

/// A tree without leaves.
#[derive(Tree, Clone, Debug)]
pub struct Nothing {}

#[experiment]
#[derive(Clone)]
pub struct Shapes {
    #[graph_const]
    pub k: u32,
    #[device]
    pub w: Array,
    #[device]
    pub opt: Option<Option<Array>>,
    #[device]
    pub units: Vec<()>,
    #[device]
    pub empties: Vec<Nothing>,
    #[device]
    pub maybe_list: Option<Vec<Array>>,
}

/// Branches on every structural fact of its view: option presence at both levels, the length
/// of a sequence of `()`, of a sequence of leafless trees, and an optional empty list.
fn structural(v: &ShapesView<'_>, _: &()) -> Tensor {
    let mut y = v.w * f64::from(*v.k);
    y = match v.opt {
        None => y,
        Some(None) => y + 1.0,
        Some(Some(t)) => y + t * 2.0,
    };
    y = y + 10.0 * v.units.len() as f64;
    y = y + 100.0 * v.empties.len() as f64;
    match &v.maybe_list {
        None => y,
        Some(list) => list
            .iter()
            .fold(y + 1000.0 * (list.len() as f64 + 1.0), |acc, t| acc + *t),
    }
}

const STRUCTURAL: Program<Shapes> = Shapes::program("structural", structural);

/// What [`structural`] computes, on the host.
fn expected(e: &Shapes) -> f32 {
    let mut y = e.k as f32;
    y += match &e.opt {
        None => 0.0,
        Some(None) => 1.0,
        Some(Some(_)) => 2.0,
    };
    y += 10.0 * e.units.len() as f32 + 100.0 * e.empties.len() as f32;
    if let Some(list) = &e.maybe_list {
        y += 1000.0 * (list.len() as f32 + 1.0) + list.len() as f32;
    }
    y
}

fn shapes() -> Shapes {
    Shapes {
        k: 1,
        w: ones(4),
        opt: None,
        units: vec![],
        empties: vec![],
        maybe_list: None,
    }
}

type Change = fn(&mut Shapes);

fn structural_steps() -> Vec<(&'static str, Change, MissReason)> {
    vec![
        ("first", |_| {}, MissReason::Empty),
        (
            "opt: None → Some(None)",
            |e| e.opt = Some(None),
            sigs(&[("opt", "None", "Some"), ("opt", "", "None")]),
        ),
        (
            "opt: Some(None) → Some(Some(_))",
            |e| e.opt = Some(Some(ones(4))),
            // The inner option's presence (the second option node at `opt`), and its leaf.
            sigs(&[("opt", "None", "Some"), ("opt", "", "f32[4]")]),
        ),
        (
            "Vec<()>: 0 → 2",
            |e| e.units = vec![(), ()],
            sigs(&[("units", "len 0", "len 2")]),
        ),
        (
            "Vec<()>: 2 → 3",
            |e| e.units = vec![(); 3],
            sigs(&[("units", "len 2", "len 3")]),
        ),
        (
            "Vec<Nothing>: 0 → 1",
            |e| e.empties = vec![Nothing {}],
            sigs(&[("empties", "len 0", "len 1")]),
        ),
        (
            "Vec<Nothing>: 1 → 2",
            |e| e.empties.push(Nothing {}),
            sigs(&[("empties", "len 1", "len 2")]),
        ),
        (
            "Option<Vec<Array>>: None → Some(vec![])",
            |e| e.maybe_list = Some(vec![]),
            sigs(&[("maybe_list", "None", "Some"), ("maybe_list", "", "len 0")]),
        ),
        (
            "Option<Vec<Array>>: Some(vec![]) → Some(vec![a])",
            |e| e.maybe_list = Some(vec![ones(4)]),
            sigs(&[
                ("maybe_list", "len 0", "len 1"),
                ("maybe_list[0]", "", "f32[4]"),
            ]),
        ),
    ]
}

fn check_structure_on(backend: &'static dyn Backend) {
    let cache = Cache::in_memory(64);
    cache.set_verify(true);
    let mut e = shapes();
    let mut states = Vec::new();
    for (what, change, reason) in structural_steps() {
        change(&mut e);
        let served = cache.get(backend, &STRUCTURAL, &e, &()).unwrap();
        assert_eq!(
            served.outcome,
            Outcome::Compiled {
                reason: reason.clone()
            },
            "{what} on {}",
            backend.identity().description
        );
        let out = served
            .executable
            .run(&STRUCTURAL.arguments(&e, &()))
            .unwrap();
        assert_eq!(
            values(&out),
            vec![expected(&e); 4],
            "{what}: runs its own program"
        );
        states.push((what, e.clone()));
    }
    // Every state again, in another order: all held, each serving its own program.
    for (what, state) in states.iter().rev() {
        let served = cache.get(backend, &STRUCTURAL, state, &()).unwrap();
        assert!(served.outcome.is_hit(), "{what}: {}", served.outcome);
        let out = served
            .executable
            .run(&STRUCTURAL.arguments(state, &()))
            .unwrap();
        assert_eq!(values(&out), vec![expected(state); 4], "{what} again");
    }
    let stats = cache.stats();
    assert_eq!(stats.misses, structural_steps().len() as u64, "{stats}");
    assert_eq!(stats.entries, stats.misses);
}

#[test]
fn leafless_structure_is_in_the_key_on_the_interpreter() {
    check_structure_on(backend::interpreter());
}

#[test]
fn leafless_structure_is_in_the_key_on_xla() {
    if let Some(xla) = xla_or_skip("leafless_structure_is_in_the_key_on_xla") {
        check_structure_on(xla);
    }
}

/// Program inputs are keyed on their whole structure too, not only the experiment's.
fn count_units(v: &ShapesView<'_>, units: &(Vec<()>, Option<Option<Tensor>>)) -> Tensor {
    let extra = match units.1 {
        None => 0.0,
        Some(None) => 0.5,
        Some(Some(_)) => 0.25,
    };
    v.w * (units.0.len() as f64 + extra)
}

/// The inputs of [`count_units`]: leafless structure only (and an optional scalar).
type UnitInputs = (Vec<()>, Option<Option<Array>>);

const COUNT_UNITS: Program<Shapes, <UnitInputs as Tree>::Mirror<Tensor>> =
    Shapes::program("count_units", count_units);

#[test]
fn leafless_input_structure_is_in_the_key() {
    for backend in backends("leafless_input_structure_is_in_the_key") {
        let cache = Cache::in_memory(16);
        let e = shapes();
        let cases: Vec<(UnitInputs, f32)> = vec![
            ((vec![], None), 0.0),
            ((vec![()], None), 1.0),
            ((vec![(); 2], None), 2.0),
            ((vec![(); 2], Some(None)), 2.5),
            ((vec![(); 2], Some(Some(Array::scalar(1.0f32)))), 2.25),
        ];
        for (i, (inputs, want)) in cases.iter().enumerate() {
            let served = cache.get(backend, &COUNT_UNITS, &e, inputs).unwrap();
            assert!(!served.outcome.is_hit(), "case {i}: {}", served.outcome);
            let out = served
                .executable
                .run(&COUNT_UNITS.arguments(&e, inputs))
                .unwrap();
            assert_eq!(values(&out), vec![*want; 4], "case {i}");
        }
        let reasons: Vec<String> = cache
            .recent_misses()
            .iter()
            .map(|m| m.reason.to_string())
            .collect();
        assert_eq!(reasons[1], "signature_changed: 0 len 0 → len 1");
        assert_eq!(
            reasons[3], "signature_changed: 1 None → Some, added 1 None",
            "{reasons:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 2. A property: structurally different trees never share a signature digest or a key
// ---------------------------------------------------------------------------------------------

/// A tree type with every kind of structural node, leafless ones included.
type Rich = (
    Vec<Option<Vec<()>>>,
    Option<Option<(Vec<Array>, ())>>,
    Vec<Vec<Nothing>>,
    [Option<Array>; 2],
);

fn leaf() -> impl Strategy<Value = Array> {
    (
        prop_oneof![Just(DType::F32), Just(DType::I32)],
        prop::collection::vec(0usize..3, 0..3),
    )
        .prop_map(|(dtype, dims)| Array::zeros(dtype, &dims))
}

fn rich() -> impl Strategy<Value = Rich> {
    (
        prop::collection::vec(
            prop::option::of(prop::collection::vec(Just(()), 0..3)),
            0..3,
        ),
        prop::option::of(prop::option::of((
            prop::collection::vec(leaf(), 0..3),
            Just(()),
        ))),
        prop::collection::vec(prop::collection::vec(Just(Nothing {}), 0..3), 0..3),
        [prop::option::of(leaf()), prop::option::of(leaf())],
    )
}

/// An independent description of a tree's structure: its mirror with every leaf replaced by
/// its type, printed. (`mirror` builds the structure; the signature comes from `visit`.)
fn described(t: &Rich) -> String {
    let m = t.mirror(&mut LeafPath::root(""), &mut |_, a| {
        a.leaf_type().to_string()
    });
    format!("{m:?}")
}

#[experiment]
pub struct Probe {
    #[device]
    pub w: Array,
}

fn probe_rich(v: &ProbeView<'_>, _: &<Rich as Tree>::Mirror<Tensor>) -> Tensor {
    v.w * 2.0
}

const PROBE_RICH: Program<Probe, <Rich as Tree>::Mirror<Tensor>> =
    Probe::program("probe_rich", probe_rich);

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn structurally_different_trees_never_share_a_signature(a in rich(), b in rich()) {
        let (da, db) = (described(&a), described(&b));
        let (sa, sb) = (a.signature_at("t"), b.signature_at("t"));
        prop_assert_eq!(da == db, sa.digest() == sb.digest(), "{} vs {}", da, db);
        prop_assert_eq!(da == db, sa.diff(&sb).is_empty());

        // And through the cache: the second lookup hits exactly when the structures agree.
        let cache = Cache::in_memory(4);
        let probe = Probe { w: ones(2) };
        let first = cache.get(backend::interpreter(), &PROBE_RICH, &probe, &a).unwrap();
        prop_assert!(!first.outcome.is_hit());
        let second = cache.get(backend::interpreter(), &PROBE_RICH, &probe, &b).unwrap();
        prop_assert_eq!(second.outcome.is_hit(), da == db, "{} vs {}", da, db);
    }
}

// ---------------------------------------------------------------------------------------------
// 3. Signature diffs by path
// ---------------------------------------------------------------------------------------------

#[derive(Tree, Clone, Debug)]
pub struct Dense {
    pub w: Array,
    pub b: Array,
}

#[experiment]
#[derive(Clone)]
pub struct Stack {
    #[graph_const]
    pub act: u8,
    #[device(trainable)]
    pub layers: Vec<Dense>,
    #[device]
    pub bias: Option<Array>,
}

fn stack_forward(v: &StackView<'_>, x: &Tensor) -> Tensor {
    let y = v
        .layers
        .iter()
        .fold(*x, |h, l| (h.matmul(l.w) + l.b).tanh())
        * f64::from(1 + *v.act);
    match v.bias {
        Some(b) => y + b,
        None => y,
    }
}

const STACK: Program<Stack, Tensor> = Stack::program("forward", stack_forward);

fn stack(layers: usize, bias: bool) -> Stack {
    Stack {
        act: 0,
        layers: (0..layers)
            .map(|_| Dense {
                w: Array::zeros(DType::F32, &[8, 8]),
                b: Array::zeros(DType::F32, &[8]),
            })
            .collect(),
        bias: bias.then(|| Array::zeros(DType::F32, &[8])),
    }
}

#[test]
fn signature_changes_are_named_by_path() {
    for backend in backends("signature_changes_are_named_by_path") {
        let cache = Cache::in_memory(16);
        let x = Array::zeros(DType::F32, &[32, 8]);
        let steps: Vec<(Stack, &str)> = vec![
            (stack(2, false), "empty (never compiled here)"),
            (
                stack(3, false),
                "signature_changed: layers len 2 → len 3, added layers[2].w f32[8,8], \
                 added layers[2].b f32[8]",
            ),
            (
                stack(3, true),
                "signature_changed: bias None → Some, added bias f32[8]",
            ),
            (
                stack(1, true),
                "signature_changed: layers len 3 → len 1, removed layers[1].w f32[8,8], \
                 removed layers[1].b f32[8], removed layers[2].w f32[8,8], \
                 removed layers[2].b f32[8]",
            ),
        ];
        for (e, want) in &steps {
            let served = cache.get(backend, &STACK, e, &x).unwrap();
            let reason = served.outcome.reason().expect("a miss").to_string();
            assert_eq!(reason, *want);
        }
        // A ragged batch names the input, and only it.
        let ragged = Array::zeros(DType::F32, &[17, 8]);
        let served = cache
            .get(backend, &STACK, &stack(1, true), &ragged)
            .unwrap();
        assert_eq!(
            served.outcome.reason(),
            Some(&sigs(&[("input", "f32[32,8]", "f32[17,8]")]))
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 4. Precomputed key parts cannot outlive the values they describe
// ---------------------------------------------------------------------------------------------

#[test]
fn prepared_digests_describe_the_current_values() {
    let cache = Cache::in_memory(8);
    let backend = backend::interpreter();
    let mut e = shapes();
    {
        let prepared = Prepared::new(&e);
        assert_eq!(prepared.graph_const_digest(), e.graph_const_digest());
        for _ in 0..3 {
            cache
                .get_prepared(backend, &STRUCTURAL, &prepared, &())
                .unwrap();
        }
        // `e.k = 2;` here does not compile: `prepared` borrows `e` (see the doctest on
        // `Prepared`).
    }
    e.k = 2;
    let prepared = Prepared::new(&e);
    let served = cache
        .get_prepared(backend, &STRUCTURAL, &prepared, &())
        .unwrap();
    assert!(
        matches!(
            &served.outcome,
            Outcome::Compiled {
                reason: MissReason::GraphConstChanged { fields, .. }
            } if fields == &["k".to_owned()]
        ),
        "{}",
        served.outcome
    );
    let out = served
        .executable
        .run(&STRUCTURAL.arguments(&e, &()))
        .unwrap();
    assert_eq!(values(&out), vec![2.0; 4], "the program for k = 2");
    let stats = cache.stats();
    assert_eq!((stats.misses, stats.hits), (2, 2));
}

// ---------------------------------------------------------------------------------------------
// 5. What each lookup reports
// ---------------------------------------------------------------------------------------------

#[test]
fn each_lookup_says_what_it_did() {
    let tmp = TempDir::new("outcome");
    let store = || Arc::new(DirStore::open(tmp.path(), 1 << 30, None).unwrap());
    let backend = backend::interpreter();
    let e = shapes();
    let first = Cache::new(8, Some(store()));
    let compiled = first.get(backend, &STRUCTURAL, &e, &()).unwrap();
    assert_eq!(
        compiled.outcome,
        Outcome::Compiled {
            reason: MissReason::Empty
        }
    );
    let hit = first.get(backend, &STRUCTURAL, &e, &()).unwrap();
    assert_eq!(hit.outcome, Outcome::Hit);
    assert_eq!(hit.outcome.reason(), None);
    // Another cache on the same store: loaded, and nothing moved since it was recorded.
    let second = Cache::new(8, Some(store()));
    let loaded = second.get(backend, &STRUCTURAL, &e, &()).unwrap();
    assert_eq!(
        loaded.outcome,
        Outcome::Loaded {
            reason: MissReason::Empty
        }
    );
    assert_eq!(loaded.fingerprint, compiled.fingerprint);
    assert_eq!(
        loaded.outcome.to_string(),
        "loaded (empty: first use in this process)"
    );
}

// ---------------------------------------------------------------------------------------------
// 6. Misses named across processes
// ---------------------------------------------------------------------------------------------

/// The child side of the cross-process tests; does nothing unless started by one. Looks up
/// `STACK` with the GraphConst, layer count and batch rows its parent asks for, on the asked
/// backend and store, and prints what the lookup did.
#[test]
#[ignore = "run as a child process by the cross-process tests"]
fn key_child_process() {
    let Ok(dir) = std::env::var("NITRO_TEST_CACHE_DIR") else {
        return;
    };
    let num = |k: &str| -> usize { std::env::var(k).unwrap().parse().unwrap() };
    let backend: &dyn Backend = match std::env::var("NITRO_TEST_BACKEND").as_deref() {
        Ok("xla") => backend::xla().expect("the XLA backend"),
        _ => backend::interpreter(),
    };
    let store = DirStore::open(Path::new(&dir), 1 << 30, None).unwrap();
    let cache = Cache::new(8, Some(Arc::new(store)));
    let mut e = stack(num("NITRO_TEST_LAYERS"), false);
    e.act = num("NITRO_TEST_ACT") as u8;
    let x = Array::zeros(DType::F32, &[num("NITRO_TEST_ROWS"), 8]);
    let served = cache.get(backend, &STACK, &e, &x).unwrap();
    println!(
        "KEY_CHILD {}",
        serde_json::to_string(&served.outcome).unwrap()
    );
}

fn key_child(dir: &Path, backend: &str, act: u8, layers: usize, rows: usize) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "key_child_process",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("NITRO_TEST_CACHE_DIR", dir)
        .env("NITRO_TEST_BACKEND", backend)
        .env("NITRO_TEST_ACT", act.to_string())
        .env("NITRO_TEST_LAYERS", layers.to_string())
        .env("NITRO_TEST_ROWS", rows.to_string())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .find_map(|l| l.split_once("KEY_CHILD ").map(|(_, json)| json))
        .unwrap_or_else(|| panic!("no report:\n{stdout}"))
        .to_owned()
}

fn misses_named_across_processes(backend: &str) {
    let tmp = TempDir::new(&format!("xproc-{backend}"));
    let run = |act, layers, rows| key_child(tmp.path(), backend, act, layers, rows);
    let outcome = |json: &str| -> serde_json::Value { serde_json::from_str(json).unwrap() };
    let first = outcome(&run(0, 2, 32));
    assert_eq!(first["outcome"], "compiled");
    assert_eq!(first["reason"]["reason"], "empty");

    // A GraphConst moved since the last process: named, not `empty`.
    let gc = outcome(&run(1, 2, 32));
    assert_eq!(gc["outcome"], "compiled");
    assert_eq!(gc["reason"]["reason"], "graph_const_changed");
    assert_eq!(gc["reason"]["fields"], serde_json::json!(["act"]));

    // A ragged batch since the last process.
    let ragged = outcome(&run(1, 2, 17));
    assert_eq!(ragged["reason"]["reason"], "signature_changed");
    assert_eq!(
        ragged["reason"]["changes"],
        serde_json::json!([{"path": "input", "from": "f32[32,8]", "to": "f32[17,8]"}])
    );

    // Three layers: the new leaves by path.
    let deeper = outcome(&run(1, 3, 17));
    assert_eq!(deeper["reason"]["reason"], "signature_changed");
    assert_eq!(deeper["reason"]["changes"][0]["path"], "layers");
    assert_eq!(deeper["reason"]["changes"][1]["path"], "layers[2].w");

    // Back to the first configuration: stored, so loaded — and what moved since the last
    // process is still named: the GraphConst and the inputs, both (issue 50, item 15).
    let back = outcome(&run(0, 2, 32));
    assert_eq!(back["outcome"], "loaded");
    assert_eq!(back["reason"]["reason"], "several");
    assert_eq!(
        back["reason"]["reasons"][0]["reason"],
        "graph_const_changed"
    );
    assert_eq!(back["reason"]["reasons"][1]["reason"], "signature_changed");

    // Nothing moved since the last process: `empty`, loaded.
    let same = outcome(&run(0, 2, 32));
    assert_eq!(same["outcome"], "loaded");
    assert_eq!(same["reason"]["reason"], "empty");
}

#[test]
fn misses_are_named_across_processes_on_the_interpreter() {
    misses_named_across_processes("interp");
}

#[test]
fn misses_are_named_across_processes_on_xla() {
    if xla_or_skip("misses_are_named_across_processes_on_xla").is_some() {
        misses_named_across_processes("xla");
    }
}

#[test]
fn backend_changed_names_the_component_across_processes() {
    if xla_or_skip("backend_changed_names_the_component_across_processes").is_none() {
        return;
    }
    let tmp = TempDir::new("xproc-backend");
    key_child(tmp.path(), "interp", 0, 2, 32);
    let json = key_child(tmp.path(), "xla", 0, 2, 32);
    let outcome: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(outcome["outcome"], "compiled");
    assert_eq!(outcome["reason"]["reason"], "backend_changed");
    assert_eq!(outcome["reason"]["component"], "backend");
    assert_eq!(outcome["reason"]["from"], "nitro interpreter");
    assert_eq!(outcome["reason"]["to"], "XLA (PJRT plugin)");
}

#[test]
fn backend_components_name_what_differs() {
    let Some(xla) = xla_or_skip("backend_components_name_what_differs") else {
        return;
    };
    let id = xla.identity();
    let names: Vec<&str> = id.components.iter().map(|(n, _)| n.as_str()).collect();
    for wanted in [
        "backend",
        "plugin file digest",
        "PJRT API version",
        "platform name",
        "CPU features",
        "devices",
    ] {
        assert!(names.contains(&wanted), "{wanted} in {names:?}");
    }
    let mut other = id.components.clone();
    let cpu = other.iter_mut().find(|(n, _)| n == "CPU features").unwrap();
    cpu.1 = "x86_64: sse2".into();
    let (name, from, to) =
        nitro::backend::Identity::first_difference(&id.components, &other).unwrap();
    assert_eq!(
        (name.as_str(), to.as_str()),
        ("CPU features", "x86_64: sse2")
    );
    assert_ne!(from, to);
}
