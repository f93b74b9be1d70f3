//! Twin bundles: everything a JAX twin (`bench/twin_fashion.py`, `bench/twin_chargpt.py`)
//! needs to train the same model as a nitro example from the same initial weights, on the same
//! batches, with the same optimizer — written by the example's `--twin DIR`.
//!
//! A bundle is a directory of plain files that numpy and `safetensors` read:
//!
//! | file | contents |
//! | --- | --- |
//! | `init.safetensors` | the initial parameters, one tensor per Device leaf named by its path ([`nitro::weights::export`]) |
//! | `run.json` | the hyperparameters: model shape, steps, batch, schedule, optimizer constants, the decayed leaves |
//! | `batches.npy` | `i32 [steps, batch]`: the training-set row of each batch row of each step, in the handle's order |
//! | `real.npy` | `i32 [steps]`: how many of a step's rows are real (the rest repeat them, weight 0) |
//!
//! plus whatever data the model's twin cannot rebuild itself (the character model's windows).
//!
//! A bucketed run ([`write_ragged`]) has, instead of `batches.npy` and `real.npy`, its data as
//! ragged columns — `train_x.npy`, `train_y.npy` (every row's ids one after another) and
//! `train_offsets.npy` (`i32 [rows + 1]`: row `r` is `offsets[r]..offsets[r + 1]`), the same
//! for `val_` — and its epoch's batches as `plan.npy` (`i32 [steps, 3]`: the bucket's edge, the
//! first index into `rows.npy`, the count of real rows) and `rows.npy` (the rows, in order).
//! A batch of edge `e` holds `run.json`'s `bucket_rows[e]` rows: the real ones, then copies of
//! them weighing nothing; a row longer than `e` keeps its first `e` positions.

use std::path::Path;

use nitro::data::{Dataset, Order};
use nitro::experiment::Experiment;
use nitro::Array;
use serde_json::Value;

/// The rows of every step of `epochs` epochs over `data` in batches of `batch`, as the training
/// handle forms them with seed `seed` ([`Order::Shuffled`]): each step's row indices padded to
/// `batch` by repeating its real rows, and the real count.
pub fn step_rows(
    data: &Dataset,
    batch: usize,
    seed: u64,
    epochs: usize,
) -> nitro::Result<Vec<(Vec<usize>, usize)>> {
    let plan = data.plan(batch, Order::Shuffled { seed })?;
    let mut steps = Vec::new();
    for epoch in 0..epochs as u64 {
        for span in plan.epoch(epoch).spans() {
            let rows: Vec<usize> = (0..batch).map(|i| span[i % span.len()]).collect();
            steps.push((rows, span.len()));
        }
    }
    Ok(steps)
}

/// Writes a twin bundle into `dir` (created if absent): `experiment`'s initial parameters,
/// `run` as `run.json`, the steps' rows, and each of `extra` as `NAME.npy`.
pub fn write<E: Experiment>(
    dir: &Path,
    experiment: &E,
    run: &Value,
    steps: &[(Vec<usize>, usize)],
    extra: &[(&str, &Array)],
) -> Result<(), Box<dyn std::error::Error>> {
    std::fs::create_dir_all(dir)?;
    nitro::weights::export(experiment, dir.join("init.safetensors"))?;
    std::fs::write(dir.join("run.json"), serde_json::to_vec_pretty(run)?)?;
    let batch = steps.first().map_or(0, |(rows, _)| rows.len());
    let rows: Vec<i32> = steps
        .iter()
        .flat_map(|(rows, _)| rows.iter().map(|&r| r as i32))
        .collect();
    let real: Vec<i32> = steps.iter().map(|&(_, real)| real as i32).collect();
    nitro::npy::write(
        dir.join("batches.npy"),
        &Array::from_vec(&[steps.len(), batch], rows)?,
    )?;
    nitro::npy::write(
        dir.join("real.npy"),
        &Array::from_vec(&[steps.len()], real)?,
    )?;
    for (name, array) in extra {
        nitro::npy::write(dir.join(format!("{name}.npy")), array)?;
    }
    Ok(())
}

/// The trainable leaves of `experiment` that `decays` says are decayed, by path.
pub fn decayed_leaves<E: Experiment>(experiment: &E, decays: impl Fn(&str) -> bool) -> Vec<String> {
    let mut out = Vec::new();
    experiment.visit_device(&mut |field, path, node| {
        if let nitro::tree::Node::Leaf(_) = node {
            let trainable = field.role == (nitro::experiment::Role::Device { trainable: true });
            if trainable && decays(path.as_str()) {
                out.push(path.as_str().to_owned());
            }
        }
    });
    out
}

/// Writes the twin bundle of a bucketed run into `dir`: the initial parameters, `run` as
/// `run.json`, the ragged columns `x` and `y` of `train` and `val`, and `plan` (one epoch's
/// batches as `(bucket, rows)`, bucket indices into `edges`).
pub fn write_ragged<E: Experiment>(
    dir: &Path,
    experiment: &E,
    run: &Value,
    data: [(&str, &nitro::data::buckets::Ragged); 2],
    plan: &[(usize, Vec<usize>)],
    edges: &[usize],
) -> Result<(), Box<dyn std::error::Error>> {
    std::fs::create_dir_all(dir)?;
    nitro::weights::export(experiment, dir.join("init.safetensors"))?;
    std::fs::write(dir.join("run.json"), serde_json::to_vec_pretty(run)?)?;
    for (prefix, ragged) in data {
        let mut offsets = vec![0i32];
        for (c, name) in ragged.names().iter().enumerate() {
            let ids: Vec<i32> = (0..ragged.rows())
                .flat_map(|r| ragged.row(c, r).iter().copied())
                .collect();
            let n = ids.len();
            nitro::npy::write(
                dir.join(format!("{prefix}_{name}.npy")),
                &Array::from_vec(&[n], ids)?,
            )?;
        }
        for l in ragged.lengths() {
            offsets.push(offsets[offsets.len() - 1] + l as i32);
        }
        let n = offsets.len();
        nitro::npy::write(
            dir.join(format!("{prefix}_offsets.npy")),
            &Array::from_vec(&[n], offsets)?,
        )?;
    }
    let mut steps = Vec::with_capacity(plan.len() * 3);
    let mut rows = Vec::new();
    for (b, r) in plan {
        steps.extend([edges[*b] as i32, rows.len() as i32, r.len() as i32]);
        rows.extend(r.iter().map(|&r| r as i32));
    }
    nitro::npy::write(
        dir.join("plan.npy"),
        &Array::from_vec(&[plan.len(), 3], steps)?,
    )?;
    let n = rows.len();
    nitro::npy::write(dir.join("rows.npy"), &Array::from_vec(&[n], rows)?)?;
    Ok(())
}
