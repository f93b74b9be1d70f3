//! Issue 50, item 10: what the public API shows of a program is what the backend compiles.
//! On a CPU plugin the cache compiles half-precision dots and convolutions widened to f32 and
//! rounded back; `Program::trace_for` shows that program — its text, its fingerprint — and
//! it is the one the cache compiled and stored.
#![allow(missing_docs)]

mod common;

use common::{xla_or_skip, TempDir};
use nitro::cache::{Cache, DirStore};
use nitro::prelude::*;
use nitro::program::Program;

#[experiment]
pub struct HalfDot {
    #[device]
    pub w: Array,
}

fn apply(v: &HalfDotView<'_>, x: &Tensor) -> Tensor {
    x.matmul(v.w)
}

const APPLY: Program<HalfDot, Tensor> = HalfDot::program("apply", apply);

/// The line of `text` that holds its one `dot_general`.
fn dot_line(text: &str) -> &str {
    let mut dots = text.lines().filter(|l| l.contains("stablehlo.dot_general"));
    let line = dots.next().unwrap_or_else(|| panic!("no dot in {text}"));
    assert!(dots.next().is_none(), "one dot: {text}");
    line
}

#[test]
fn the_text_for_a_cpu_backend_is_the_widened_program_the_cache_compiled() {
    let test = "the_text_for_a_cpu_backend_is_the_widened_program_the_cache_compiled";
    let Some(xla) = xla_or_skip(test) else {
        return;
    };
    if xla.identity().platform() != Some("cpu") {
        println!("skip: {test}: the plugin is not a CPU one, which does not widen half dots");
        return;
    }
    for dtype in [DType::F16, DType::BF16] {
        let exp = HalfDot {
            w: Array::zeros(dtype, &[4, 2]),
        };
        let x = Array::zeros(dtype, &[3, 4]);
        let half = dtype.to_string();

        // As written: the dot in the half dtype.
        let written = APPLY.trace(&exp, &x).unwrap();
        assert!(
            dot_line(&written.text).contains(&format!("-> tensor<3x2x{half}>")),
            "{}",
            written.text
        );

        // For the backend: the operands converted to f32, the dot in f32, the result rounded
        // back to the half dtype.
        let for_cpu = APPLY.trace_for(&exp, &x, xla).unwrap();
        let text = &for_cpu.text;
        assert!(
            dot_line(text).contains("-> tensor<3x2xf32>"),
            "the dot runs in f32: {text}"
        );
        assert!(
            text.contains(&format!("(tensor<3x4x{half}>) -> tensor<3x4xf32>"))
                && text.contains(&format!("(tensor<4x2x{half}>) -> tensor<4x2xf32>")),
            "the operands widened to f32: {text}"
        );
        assert!(
            text.contains(&format!("(tensor<3x2xf32>) -> tensor<3x2x{half}>")),
            "the result rounded back: {text}"
        );
        assert_ne!(for_cpu.fingerprint, written.fingerprint, "two programs");
        assert_eq!(for_cpu.outputs, written.outputs, "with the same results");

        // It is the program the cache compiles, under the fingerprint it keys...
        let dir = TempDir::new("backend-text");
        let store = DirStore::open(dir.path(), 1 << 30, None).unwrap();
        let cache = Cache::new(4, Some(std::sync::Arc::new(store)));
        let served = cache.get(xla, &APPLY, &exp, &x).unwrap();
        assert!(!served.outcome.is_hit());
        assert_eq!(served.compiled.fingerprint, for_cpu.fingerprint);
        // ...and the one the store keeps: one entry, of this fingerprint, under its key.
        let entries = DirStore::open(dir.path(), 1 << 30, None).unwrap().list();
        assert_eq!(entries.len(), 1, "{entries:?}");
        let meta = entries[0].meta.as_ref().expect("readable metadata");
        assert_eq!(meta.fingerprint, for_cpu.fingerprint);
        assert_eq!(
            meta.key,
            nitro::cache::store_key(xla, &for_cpu.fingerprint),
            "{meta:?}"
        );
        // Run: the widened program computes the dot (zeros in, zeros out, in the half dtype).
        let out = served.compiled.executable.run(&[&exp.w, &x]).unwrap();
        assert_eq!(out[0].dtype(), dtype);
    }
}

#[test]
fn the_text_for_the_interpreter_is_the_program_as_written() {
    // The interpreter computes half dots as they are written: nothing to widen.
    let exp = HalfDot {
        w: Array::zeros(DType::BF16, &[4, 2]),
    };
    let x = Array::zeros(DType::BF16, &[3, 4]);
    let written = APPLY.trace(&exp, &x).unwrap();
    let interp = APPLY
        .trace_for(&exp, &x, nitro::backend::interpreter())
        .unwrap();
    assert_eq!(interp.text, written.text);
    let cache = Cache::in_memory(4);
    let served = cache
        .get(nitro::backend::interpreter(), &APPLY, &exp, &x)
        .unwrap();
    assert_eq!(served.compiled.fingerprint, interp.fingerprint);
}
