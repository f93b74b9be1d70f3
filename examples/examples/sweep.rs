//! Two sweeps on the digits MLP, and what each costs in compiles.
//!
//! - A **learning-rate sweep**: the learning rate is a traced scalar the handle writes, so every
//!   run after the first compiles nothing.
//! - A **width sweep**: the hidden width shapes the graph (a GraphConst, and the shapes of the
//!   Device leaves), so each new width compiles its programs once, and a width seen before hits.
//!
//! Each run trains 2 epochs. The example checks those compile counts and ends with one JSON line.
//!
//! `cargo run --release -p nitro-examples --example sweep` (from the workspace root).

use nitro::cache;
use nitro::optim::Adam;
use nitro::train::{Config, Nitro};
use nitro_examples::report::{install_log, Summary};
use nitro_examples::{data, DigitsMlp};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::args().skip(1).any(|a| a == "--help" || a == "-h") {
        println!(
            "Two sweeps on the digits MLP: a learning-rate sweep, which compiles nothing after \
             its first run, and a width sweep, which compiles once per new width. Each run \
             trains 2 epochs; the example checks the compile counts and ends with one JSON \
             line.\n\nUsage: sweep (no flags)"
        );
        return Ok(());
    }
    install_log();
    let data = data::Digits::load(data::DIGITS_PATH)?;
    let split = data.split(0.8, 1)?;
    // In-memory misses are counted per process: a program loaded from the persistent cache
    // (an earlier run) counts like one compiled now.
    let cache = cache::global();
    let mut rows = Vec::new();
    let mut run = |what: &str, hidden: usize, lr: f64| -> nitro::Result<(u64, f64)> {
        let before = cache.stats();
        let config = Config::new().batch(32).lr(lr).epochs(2).progress(false);
        let mut handle = Nitro::new(
            DigitsMlp::tanh(hidden, data.clone()),
            Adam::default(),
            config,
        )?;
        let history = handle.fit(&split.train, Some(&split.validation))?;
        let after = cache.stats();
        let misses = after.misses - before.misses;
        let accuracy = history
            .epochs
            .last()
            .and_then(|e| e.val_accuracy)
            .unwrap_or(0.0);
        let loss = history.epochs.last().map_or(0.0, |e| e.train_loss);
        println!(
            "{what:<14} hidden {hidden:>3}  lr {lr:<6}  programs compiled or loaded {misses}  \
             train loss {loss:.4}  accuracy {:.2}%",
            100.0 * accuracy
        );
        rows.push(serde_json::json!({
            "sweep": what, "hidden": hidden, "lr": lr, "misses": misses, "val_accuracy": accuracy,
        }));
        Ok((misses, accuracy))
    };

    println!("learning-rate sweep (a Device scalar):");
    let (first, _) = run("learning rate", 128, 1e-3)?;
    assert_eq!(first, 3, "gradient, update and evaluation programs");
    for lr in [3e-3, 1e-2, 3e-2] {
        let (misses, _) = run("learning rate", 128, lr)?;
        assert_eq!(misses, 0, "a learning rate never recompiles");
    }

    println!("width sweep (a GraphConst that shapes the graph):");
    for (hidden, expected) in [(32, 3), (64, 3), (32, 0), (128, 0)] {
        let (misses, _) = run("width", hidden, 3e-3)?;
        assert_eq!(
            misses, expected,
            "a new width compiles its programs once; a width seen before hits"
        );
    }
    let stats = cache.stats();
    println!("cache    {stats}");
    let summary = Summary::new("sweep", nitro::backend::current()?)
        .cache(&stats)
        .field("epochs", 2)
        .field("runs", serde_json::Value::Array(rows));
    println!("{summary}");
    Ok(())
}
