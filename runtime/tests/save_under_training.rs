//! Copies off the devices while training runs: on a CPU plugin a buffer is read straight from
//! its memory once it is defined (not queued behind the devices' computations), every dtype and
//! a computed, transposed output bit for bit; a background save to a checkpoint directory under
//! FSDP on 4 devices, written with pauses while steps run, holds the state of its step exactly,
//! and its report's copy and write lie within the time the save took.
#![allow(missing_docs)]

mod common;

use std::time::Instant;

use common::{backend_of, fsdp, own_cache, xla_devices_or_skip, xla_or_skip, TempDir};
use nitro::backend;
use nitro::checkpoint::Checkpoint;
use nitro::optim::Adam;
use nitro::prelude::*;
use nitro::train::Nitro;

#[path = "common/mlp.rs"]
mod mlp;
use mlp::*;

#[test]
fn device_buffers_read_back_bit_for_bit_in_every_dtype() {
    let test = "device_buffers_read_back_bit_for_bit_in_every_dtype";
    let Some(_) = xla_or_skip(test) else {
        return;
    };
    let client = backend::pjrt::client().unwrap();
    let arrays = [
        Array::from_vec(
            &[2, 3],
            vec![1.5f32, -0.0, f32::MIN_POSITIVE, 3e38, -7.25, 0.1],
        )
        .unwrap(),
        Array::from_vec(&[3], vec![1e300f64, -2.5, 1e-300]).unwrap(),
        Array::from_vec(&[2, 2], vec![i32::MIN, -1, 0, i32::MAX]).unwrap(),
        Array::from_vec(&[2], vec![i64::MIN, i64::MAX]).unwrap(),
        Array::from_vec(&[4], vec![0u8, 1, 128, 255]).unwrap(),
        Array::from_vec(&[3], vec![true, false, true]).unwrap(),
        Array::from_vec(&[0, 4], Vec::<f32>::new()).unwrap(),
        Array::scalar(42i64),
    ];
    for a in &arrays {
        let placed = client.upload(a).unwrap();
        assert_eq!(&placed.to_host().unwrap(), a, "{}", a.leaf_type());
    }
    // A computed output, laid out by the compiler: a transpose of a [3, 4] matrix.
    let ty = nitro::LeafType::new(DType::F32, &[3, 4]);
    let graph =
        nitro::trace::trace(&[("x".into(), ty)], |x| vec![x[0].transpose(&[1, 0]) * 2.0]).unwrap();
    let exe = client
        .compile(
            &nitro::emit::emit(&graph),
            &graph.input_types(),
            &graph.output_types(),
        )
        .unwrap();
    let x: Vec<f32> = (0..12).map(|i| i as f32).collect();
    let input = client
        .upload(&Array::from_vec(&[3, 4], x.clone()).unwrap())
        .unwrap();
    let out = exe.execute(&[&input]).unwrap().pop().unwrap();
    let want: Vec<f32> = (0..4)
        .flat_map(|c| (0..3).map(move |r| 2.0 * (r * 4 + c) as f32))
        .collect();
    assert_eq!(
        out.to_host().unwrap(),
        Array::from_vec(&[4, 3], want).unwrap()
    );
}

#[test]
fn a_paced_background_directory_save_under_fsdp_holds_its_steps_state() {
    let test = "a_paced_background_directory_save_under_fsdp_holds_its_steps_state";
    let Some(_) = xla_devices_or_skip(test, 4) else {
        return;
    };
    let dir = TempDir::new("save-under-training");
    std::fs::create_dir_all(dir.path()).unwrap();
    let (x, y) = data(80, 33);
    let config = fsdp(4).batch(8).lr(0.02).progress(false);
    let backend = backend_of(&config, backend::interpreter());
    let mut run = Nitro::with_backend(
        mlp(Act::Tanh),
        Adam::default(),
        config,
        backend,
        own_cache(),
    )
    .unwrap();
    let step = |run: &mut Nitro<Mlp, Adam>, i: usize| {
        run.step(&batch(&x, &y, 8 * i, 8, 8), 8).unwrap();
    };
    for i in 0..3 {
        step(&mut run, i);
    }
    let want = run.checkpoint().unwrap();
    let root = dir.path().join("run");
    let started = Instant::now();
    run.save_in_background(&root).unwrap();
    // The next update hands the buffers over; the save copies and writes them, pausing between
    // pieces, while these steps run; `wait_saved` tells it to hurry.
    for i in 3..10 {
        step(&mut run, i);
    }
    let waited = run.wait_saved().unwrap();
    let took = started.elapsed();
    let report = waited
        .or_else(|| run.last_save().cloned())
        .expect("the save");
    assert_eq!(report.step, 3);
    assert!(
        report.copy + report.write <= took,
        "{report:?} within {took:?}"
    );
    let saved = Checkpoint::load(&root).unwrap();
    assert_eq!(saved.step(), 3);
    assert_eq!(saved.device(), want.device());
    assert_eq!(saved.optimizer(), want.optimizer());
    let bytes: u64 = saved
        .device()
        .iter()
        .chain(saved.optimizer())
        .map(|(_, a)| a.leaf_type().size_bytes().unwrap())
        .sum();
    assert_eq!(report.bytes, bytes);

    // After the last step nothing hands the buffers over: `wait_saved` copies the state on this
    // thread, and that copy is part of the report's `copy`.
    let last = dir.path().join("last");
    let started = Instant::now();
    run.save_in_background(&last).unwrap();
    let report = run.wait_saved().unwrap().expect("the save in flight");
    assert!(
        report.copy + report.write <= started.elapsed(),
        "{report:?}"
    );
    let saved = Checkpoint::load(&last).unwrap();
    assert_eq!(saved.step(), 10);
    assert_eq!(saved.device(), run.checkpoint().unwrap().device());
}
