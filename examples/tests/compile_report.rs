//! Why a compile is slow: the compile report of chargpt with its blocks unrolled finds the
//! blocks repeated back to back and suggests `nn::Repeated`; with the blocks as one scan it
//! finds no such repeat, and its gradient program holds far fewer ops.
#![allow(missing_docs)]

use nitro::backend;
use nitro::cache::Cache;
use nitro::train::{Config, Nitro};
use nitro::{Array, DType};
use nitro_examples::chargpt::{optimizer, CharGpt, GptShape, Windows};

fn report(scan: bool) -> nitro::cache::CompileReport {
    let shape = GptShape {
        layers: 4,
        width: 32,
        heads: 2,
        context: 16,
        dropout: 0.0,
        seed: 1,
        scan,
    };
    let mut model = CharGpt::new(&shape, 20);
    if scan {
        model = model.stacked().unwrap();
    }
    let cache: &'static Cache = Box::leak(Box::new(Cache::in_memory(8)));
    let config = Config::new().batch(4).lr(1e-3);
    let mut run =
        Nitro::with_backend(model, optimizer(), config, backend::interpreter(), cache).unwrap();
    let batch = Windows {
        x: Array::zeros(DType::I32, &[4, 16]),
        y: Array::zeros(DType::I32, &[4, 16]),
        valid: None,
    };
    run.prepare(&batch).unwrap();
    run.compile_report()
}

#[test]
fn unrolled_chargpt_is_told_to_use_repeated_and_the_scan_is_not() {
    let unrolled = report(false);
    let grad = unrolled.get("grad").expect("a gradient program");
    println!("{unrolled}");
    // The four blocks, forward (and their gradients), are found back to back.
    let blocks = grad
        .repeats
        .iter()
        .find(|r| r.copies >= 3)
        .unwrap_or_else(|| panic!("no repeat of 3 or more copies:\n{grad}"));
    assert!(blocks.ops >= 20, "{grad}");
    assert!(grad.families.iter().any(|(f, n)| f == "matmul" && *n > 0));
    assert!(grad.hlo_bytes > 1000);
    assert!(grad.trace_ms.is_some() && grad.compile_ms.is_some());
    let lints = unrolled.lints();
    assert!(
        lints.iter().any(|l| l.contains("nn::Repeated")),
        "{lints:?}\n{unrolled}"
    );
    assert!(unrolled.to_string().contains("repeated"), "{unrolled}");

    let scanned = report(true);
    let scan_grad = scanned.get("grad").expect("a gradient program");
    assert!(
        scan_grad.ops * 2 < grad.ops,
        "the scan traces one block: {} ops against {}",
        scan_grad.ops,
        grad.ops
    );
    assert!(
        !scanned.lints().iter().any(|l| l.contains("nn::Repeated")),
        "{scanned}"
    );
}
