//! One program, one compile — however and wherever it is referenced.
//!
//! A `const` [`Program`] is copied into every place that names it, and the `fn` inside it may be
//! too: in a release build an `#[inline]` fn or a non-capturing closure referenced from two
//! modules can have two code addresses. The cache must compile such a program once (the second
//! address is traced once and matched by fingerprint), while two different bodies under one
//! name never share an entry. CI runs this file in a release build too
//! (`cargo test --release -p nitro-xla --test program_identity`).
#![allow(missing_docs)]

use nitro::backend::{self, Backend};
use nitro::cache::{Cache, MissReason, Outcome, Served};
use nitro::prelude::*;
use nitro::program::Program;

#[experiment]
pub struct Id {
    #[graph_const]
    pub k: u32,
    #[device]
    pub w: Array,
}

#[inline]
fn scaled(v: &IdView<'_>, _: &()) -> Tensor {
    v.w * f64::from(*v.k)
}

#[inline(always)]
fn shifted(v: &IdView<'_>, _: &()) -> Tensor {
    v.w + f64::from(*v.k)
}

/// A marker with a constant, for a generic program.
pub trait Factor {
    const VALUE: f64;
}
pub struct Three;
impl Factor for Three {
    const VALUE: f64 = 3.0;
}

fn times<F: Factor>(v: &IdView<'_>, _: &()) -> Tensor {
    v.w * F::VALUE
}

pub const INLINE: Program<Id> = Id::program("inline", scaled);
pub const ALWAYS: Program<Id> = Id::program("always", shifted);
pub const CLOSURE: Program<Id> = Id::program("closure", |v: &IdView<'_>, _: &()| v.w * 5.0 + 1.0);
pub const GENERIC: Program<Id> = Id::program("generic", times::<Three>);

/// A module that names the programs itself, so it has its own copies of the constants.
macro_rules! naming_module {
    ($name:ident) => {
        mod $name {
            use super::*;

            pub fn lookups(cache: &Cache, backend: &dyn Backend, e: &Id) -> Vec<Served> {
                [INLINE, ALWAYS, CLOSURE, GENERIC]
                    .iter()
                    .map(|p| cache.get(backend, p, e, &()).unwrap())
                    .collect()
            }

            pub fn addresses() -> [usize; 4] {
                [
                    INLINE.code_address(),
                    ALWAYS.code_address(),
                    CLOSURE.code_address(),
                    GENERIC.code_address(),
                ]
            }
        }
    };
}
naming_module!(first);
naming_module!(second);

fn check(backend: &dyn Backend) {
    let cache = Cache::in_memory(16);
    cache.set_verify(true);
    let e = Id {
        k: 2,
        w: Array::full(&[3], 1.0f32),
    };
    let (a, b) = (first::addresses(), second::addresses());
    println!(
        "code addresses from two modules: {a:x?} / {b:x?} (equal: {})",
        a == b
    );

    let from_first = first::lookups(&cache, backend, &e);
    assert!(from_first.iter().all(|s| s.outcome
        == Outcome::Compiled {
            reason: MissReason::Empty
        }));
    for round in 0..3 {
        let from_second = second::lookups(&cache, backend, &e);
        let again = first::lookups(&cache, backend, &e);
        for (i, s) in from_second.iter().chain(&again).enumerate() {
            assert!(
                s.outcome.is_hit(),
                "round {round}, lookup {i}: {}",
                s.outcome
            );
        }
    }
    let stats = cache.stats();
    assert_eq!(stats.compiles, 4, "one compile per program: {stats}");
    assert_eq!((stats.misses, stats.entries), (4, 4), "{stats}");
    cache.assert_no_recompile_after_warmup().unwrap();

    // And each runs its own code.
    let want = [[2.0f32; 3], [3.0; 3], [6.0; 3], [3.0; 3]];
    for (s, want) in second::lookups(&cache, backend, &e).iter().zip(want) {
        let out = s.executable.run(&[&e.w]).unwrap();
        assert_eq!(out[0].as_slice::<f32>().unwrap(), &want, "{}", s.program);
    }
}

#[test]
fn one_program_compiles_once_from_every_module_on_the_interpreter() {
    check(backend::interpreter());
}

/// Runs `case` on XLA, or prints `skip:` without a plugin (a failure under
/// `NITRO_REQUIRE_XLA=1`).
fn on_xla(test: &str, case: fn(&dyn Backend)) {
    if let Ok(xla) = backend::xla() {
        case(xla);
    } else {
        let required = std::env::var("NITRO_REQUIRE_XLA").is_ok_and(|v| v.trim() == "1");
        assert!(!required, "NITRO_REQUIRE_XLA=1 but XLA is unavailable");
        println!("skip: {test}: no XLA plugin");
    }
}

#[test]
fn one_program_compiles_once_from_every_module_on_xla() {
    on_xla("one_program_compiles_once_from_every_module_on_xla", check);
}

/// A second `fn` with the same body under the same name: a second code address for one
/// program, whatever the build. (What an inlined copy looks like to the cache.)
#[inline(never)]
fn scaled_copy(v: &IdView<'_>, _: &()) -> Tensor {
    v.w * f64::from(*v.k)
}
const INLINE_COPY: Program<Id> = Id::program("inline", scaled_copy);

/// Another body under the same name: another program.
fn scaled_differently(v: &IdView<'_>, _: &()) -> Tensor {
    v.w * f64::from(*v.k) * 10.0
}
const INLINE_OTHER: Program<Id> = Id::program("inline", scaled_differently);

#[test]
fn a_second_address_of_one_program_is_traced_once_and_never_compiled() {
    let cache = Cache::in_memory(16);
    let backend = backend::interpreter();
    let e = Id {
        k: 2,
        w: Array::full(&[3], 1.0f32),
    };
    let a = cache.get(backend, &INLINE, &e, &()).unwrap();
    let b = cache.get(backend, &INLINE_COPY, &e, &()).unwrap();
    assert!(!a.outcome.is_hit());
    assert!(b.outcome.is_hit(), "{}", b.outcome);
    assert!(std::sync::Arc::ptr_eq(&a.compiled, &b.compiled));
    assert_eq!(cache.stats().compiles, 1);

    // Another body under the same name is another program: compiled, held beside the first,
    // each running its own code.
    let c = cache.get(backend, &INLINE_OTHER, &e, &()).unwrap();
    assert!(matches!(
        c.outcome,
        Outcome::Compiled {
            reason: MissReason::CodeChanged { .. }
        }
    ));
    for (program, want) in [
        (&INLINE, 2.0f32),
        (&INLINE_OTHER, 20.0),
        (&INLINE_COPY, 2.0),
    ] {
        let s = cache.get(backend, program, &e, &()).unwrap();
        assert!(s.outcome.is_hit());
        let out = s.executable.run(&[&e.w]).unwrap();
        assert_eq!(out[0].as_slice::<f32>().unwrap(), &[want; 3]);
    }
    let stats = cache.stats();
    assert_eq!((stats.compiles, stats.entries), (2, 2), "{stats}");
}

// ---- issue 30, item 14: two types one `type_name`, one generic fn, one folded address ----

/// A library program written once for every experiment: twice each trainable leaf. Its code
/// never reads the experiment's type, so a release build may fold every instantiation to one
/// address.
fn doubled_trainable<E: Experiment + 'static>(_: &E::View<'_>, _: &()) -> Vec<Tensor> {
    nitro::program::trainable_leaves()
        .into_iter()
        .map(|t| t * 2.0)
        .collect()
}

fn doubled_program<E: Experiment + 'static>() -> Program<E, (), Vec<Tensor>> {
    Program::generic("doubled_trainable", doubled_trainable::<E>)
}

/// Two block-local `Net`s share `std::any::type_name` and differ only in one Device leaf's role:
/// the second lookup must compile its own program (two outputs, not the first's one), whether
/// or not the compiler or linker folded the two instantiations to one address (which the
/// stale case needed; CI runs this file in a release build too, and the test prints whether
/// they were folded). The unit test `a_leaf_role_and_the_type_itself_are_in_the_key_components`
/// holds the key components apart whatever the build.
fn roles_split(backend: &dyn Backend) {
    let cache = Cache::in_memory(16);
    cache.set_verify(true);
    // A block-local `Net` whose `b` takes the role given, looked up and run: its type name,
    // its program's address, how many outputs it gave, and what the lookup did.
    macro_rules! local_net {
        ($($role:tt)*) => {{
            #[experiment]
            struct Net {
                #[device(trainable)]
                w: Array,
                $($role)*
                b: Array,
            }
            let e = Net {
                w: Array::full(&[2], 1.0f32),
                b: Array::full(&[2], 1.0f32),
            };
            let p = doubled_program::<Net>();
            let s = cache.get(backend, &p, &e, &()).unwrap();
            let out = s.compiled.executable.run(&[&e.w, &e.b]).unwrap();
            (std::any::type_name::<Net>(), p.code_address(), out.len(), s.outcome)
        }};
    }
    let (name_a, addr_a, one, _) = local_net!(#[device]);
    let (name_b, addr_b, two, outcome) = local_net!(#[device(trainable)]);
    println!(
        "type names equal: {}, addresses equal: {}",
        name_a == name_b,
        addr_a == addr_b
    );
    assert_eq!(name_a, name_b, "the case needs one type_name for both");
    assert_eq!(one, 1, "one trainable leaf");
    assert_eq!(
        two, 2,
        "two trainable leaves: the first type's program was served ({outcome})"
    );
    assert!(!outcome.is_hit(), "{outcome}");
    assert_eq!(cache.stats().compiles, 2);
}

#[test]
fn two_types_of_one_name_that_differ_in_a_role_never_share_a_program_on_the_interpreter() {
    roles_split(backend::interpreter());
}

#[test]
fn two_types_of_one_name_that_differ_in_a_role_never_share_a_program_on_xla() {
    on_xla("two_types_of_one_name_on_xla", roles_split);
}
