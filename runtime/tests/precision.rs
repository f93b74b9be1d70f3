//! The precision policy (`Config::precision`): f32 parameters and optimizer state with the
//! forward and backward passes in bf16 — trains close to the f32 run and never touches the
//! leaves' dtype; is part of the per-batch programs' keys (named in the miss) but not of the
//! update program's; and `nn`'s softmax and losses reduce half-precision input in f32.
#![allow(missing_docs)]

mod common;

#[path = "common/mlp.rs"]
mod mlp;

use mlp::*;
use nitro::backend::Backend;
use nitro::cache::{MissReason, Will};
use nitro::prelude::*;
use nitro::trace::{nn, trace};
use nitro::train::{Config, Nitro, Precision};
use nitro::LeafType;

/// A handle on the shared classifier at `precision` (batch 16, learning rate 0.05) laid out
/// as `config` says, on `backend` (or the mesh `config` names), with a cache of its own.
fn handle(
    backend: &'static dyn Backend,
    config: Config,
    precision: Precision,
) -> Nitro<Mlp, nitro::optim::Adam> {
    let config = config
        .batch(16)
        .lr(0.05)
        .progress(false)
        .precision(precision);
    let backend = common::backend_of(&config, backend);
    Nitro::with_backend(
        mlp(Act::Tanh),
        nitro::optim::Adam::default(),
        config,
        backend,
        common::own_cache(),
    )
    .unwrap()
}

/// The losses of `steps` steps of the shared classifier at `precision` on `backend`, and the
/// handle after them.
fn train(
    backend: &'static dyn Backend,
    precision: Precision,
    steps: usize,
) -> (Vec<f64>, Nitro<Mlp, nitro::optim::Adam>) {
    let mut run = handle(backend, Config::new(), precision);
    let losses = self::steps(&mut run, 0, steps);
    (losses, run)
}

fn bf16_trains_close_to_f32(backend: &'static dyn Backend, what: &str) {
    let (full, mut full_run) = train(backend, Precision::full(), 30);
    let (half, mut half_run) = train(backend, Precision::bf16(), 30);
    for (i, (h, f)) in half.iter().zip(&full).enumerate() {
        assert!(
            (h - f).abs() <= 0.02 * f.abs(),
            "{what}: step {i}: bf16 {h} vs f32 {f}\nbf16: {half:?}\nf32: {full:?}"
        );
    }
    // The policy is in force: bf16's rounding moved the losses.
    assert!(
        half.iter().zip(&full).any(|(h, f)| h != f),
        "{what}: bf16 losses equal f32's bit for bit: {half:?}"
    );
    assert!(half[29] < half[0] * 0.8, "{what}: bf16 trains: {half:?}");
    // The leaves stay f32 (master weights), and the predictions come back in f32.
    let (x, y) = data(16, 9);
    let b = batch(&x, &y, 0, 16, 16);
    let predictions = half_run.predict(&b).unwrap();
    assert_eq!(predictions.dtype(), DType::F32, "{what}");
    let trained = half_run.experiment().unwrap().clone();
    for l in &trained.layers {
        assert_eq!(
            (l.w.dtype(), l.b.dtype()),
            (DType::F32, DType::F32),
            "{what}"
        );
    }
    assert_ne!(
        leaves(&trained),
        leaves(full_run.experiment().unwrap()),
        "{what}: the runs trained apart"
    );
    // Evaluation computes in bf16 too: close to f32's, not equal.
    let (e_half, e_full) = (
        half_run.evaluate(&b, 16).unwrap().mean_loss(),
        full_run.evaluate(&b, 16).unwrap().mean_loss(),
    );
    assert!(
        (e_half - e_full).abs() <= 0.05 * e_full,
        "{what}: {e_half} vs {e_full}"
    );
}

#[test]
fn bf16_compute_trains_f32_leaves_close_to_the_f32_run_on_the_interpreter() {
    bf16_trains_close_to_f32(nitro::backend::interpreter(), "interpreter");
}

#[test]
fn bf16_compute_trains_f32_leaves_close_to_the_f32_run_on_xla() {
    let Some(xla) =
        common::xla_or_skip("bf16_compute_trains_f32_leaves_close_to_the_f32_run_on_xla")
    else {
        return;
    };
    bf16_trains_close_to_f32(xla, "xla");
}

/// A precision change recompiles the gradient program, naming the setting and both values;
/// the update program (f32 arithmetic either way) is a hit; going back is a hit too.
#[test]
fn a_precision_change_recompiles_the_batch_programs_and_says_so() {
    let backend = nitro::backend::interpreter();
    let cache: &'static nitro::cache::Cache = common::own_cache();
    let (x, y) = data(16, 4);
    let b = batch(&x, &y, 0, 16, 16);
    let handle = |precision| {
        let config = Config::new().batch(16).progress(false).precision(precision);
        Nitro::with_backend(
            mlp(Act::Tanh),
            nitro::optim::Adam::default(),
            config,
            backend,
            cache,
        )
        .unwrap()
    };
    let mut full = handle(Precision::full());
    full.step(&b, 16).unwrap();
    full.evaluate(&b, 16).unwrap();
    let half = handle(Precision::bf16());
    let plan = half.plan(&b, true).unwrap();
    let entry = |role: &str| {
        plan.entries
            .iter()
            .find(|e| e.role == role)
            .unwrap_or_else(|| panic!("{role} in {plan}"))
    };
    assert_eq!(entry("update").probe.will, Will::Hit, "{plan}");
    for role in ["grad", "eval"] {
        assert_eq!(entry(role).probe.will, Will::Compile, "{plan}");
        let reason = entry(role).probe.reason.clone().expect("a reason");
        assert_eq!(
            reason,
            MissReason::SettingChanged {
                setting: "precision".into(),
                from: "the leaves' dtypes".into(),
                to: "bf16".into(),
            },
            "{role}"
        );
        assert_eq!(
            reason.to_string(),
            "setting_changed: precision the leaves' dtypes → bf16"
        );
    }
    let mut half = half;
    half.step(&b, 16).unwrap();
    // And back: every program of the f32 run is still held.
    let again = handle(Precision::full());
    let plan = again.plan(&b, true).unwrap();
    assert_eq!(plan.count(Will::Hit), plan.entries.len(), "{plan}");
}

/// The values `f` gives on one input of type `ty` holding `values`, on the interpreter.
fn run_one(ty: LeafType, values: Array, f: impl Fn(Tensor) -> Tensor) -> Array {
    let g = trace(&[("x".to_owned(), ty)], |x| vec![f(x[0])]).unwrap();
    let exe = nitro::backend::interpreter()
        .compile(&g, &nitro::emit::emit(&g))
        .unwrap();
    exe.run(&[&values]).unwrap().remove(0)
}

/// Softmax of bf16 input is f32's softmax of the same values, rounded once to bf16; the
/// cross-entropy of bf16 logits is f32, equal to that of the same logits in f32.
#[test]
fn softmax_and_cross_entropy_reduce_half_precision_input_in_f32() {
    // Logits whose bf16 softmax would round its sum and exponentials at every step.
    let v: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 6.0).collect();
    let halves: Vec<nitro::bf16> = v.iter().map(|&x| nitro::bf16::from_f32(x)).collect();
    let widened: Vec<f32> = halves.iter().map(|h| h.to_f32()).collect();
    let half = Array::from_vec(&[4, 16], halves).unwrap();
    let wide = Array::from_vec(&[4, 16], widened).unwrap();
    let soft_half = run_one(LeafType::new(DType::BF16, &[4, 16]), half.clone(), |x| {
        nn::softmax(x, 1)
    });
    let soft_wide = run_one(LeafType::new(DType::F32, &[4, 16]), wide.clone(), |x| {
        nn::softmax(x, 1).convert(DType::BF16)
    });
    assert_eq!(soft_half.dtype(), DType::BF16);
    assert_eq!(soft_half, soft_wide);
    let labels = || Tensor::iota(DType::I32, &[4], 0);
    let ce_half = run_one(LeafType::new(DType::BF16, &[4, 16]), half, |x| {
        nn::softmax_cross_entropy(x, labels())
    });
    let ce_wide = run_one(LeafType::new(DType::F32, &[4, 16]), wide, |x| {
        nn::softmax_cross_entropy(x, labels())
    });
    assert_eq!(
        ce_half.dtype(),
        DType::F32,
        "the loss of bf16 logits is f32"
    );
    assert_eq!(ce_half, ce_wide);
}

#[test]
fn precision_reads_its_names_and_refuses_others() {
    for (name, p) in [
        ("f32", Precision::full()),
        ("bf16", Precision::bf16()),
        ("f16", Precision::f16()),
    ] {
        assert_eq!(name.parse::<Precision>().unwrap(), p);
        assert_eq!(p.to_string(), name);
    }
    assert_eq!(Precision::bf16().compute(), Some(DType::BF16));
    assert_eq!(Precision::default(), Precision::full());
    let err = "tf32".parse::<Precision>().unwrap_err().to_string();
    assert!(err.contains("tf32") && err.contains("bf16"), "{err}");
}

/// A dot or convolution of two half operands is emitted as such, or — for a CPU plugin
/// (`EmitOptions::widen_half_dots`) — as the op over their f32 widening, rounded back; on XLA
/// the widened program gives the interpreter's numbers within one rounding of the half dtype.
fn check_widened(
    op: &str,
    dtype: DType,
    dims: [&[usize]; 2],
    out: &str,
    body: fn(&[Tensor]) -> Tensor,
) {
    let ty = |d: &[usize]| LeafType::new(dtype, d);
    let g = trace(
        &[("a".to_owned(), ty(dims[0])), ("b".to_owned(), ty(dims[1]))],
        |x| vec![body(x)],
    )
    .unwrap();
    let plain = nitro::emit::emit(&g);
    let widened = nitro::emit::emit_with(
        &g,
        &nitro::emit::EmitOptions {
            widen_half_dots: true,
            ..Default::default()
        },
    );
    let half = if dtype == DType::BF16 { "bf16" } else { "f16" };
    let op_line = |text: &str| {
        text.lines()
            .find(|l| l.contains(op))
            .unwrap_or_else(|| panic!("no {op} in:\n{text}"))
            .to_owned()
    };
    assert!(
        op_line(&plain).ends_with(&format!("-> tensor<{out}x{half}>")),
        "{plain}"
    );
    assert!(
        op_line(&widened).ends_with(&format!("-> tensor<{out}xf32>")),
        "{widened}"
    );
    assert!(
        widened.contains("stablehlo.convert %widened")
            && widened.contains(&format!("-> tensor<{out}x{half}>")),
        "{widened}"
    );
    let values = |d: &[usize], seed: u32| {
        let n: usize = d.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| ((i as u32 * 7 + seed) % 13) as f32 * 0.37 - 2.0)
            .collect();
        match dtype {
            DType::BF16 => Array::from_vec(
                d,
                v.into_iter().map(nitro::bf16::from_f32).collect::<Vec<_>>(),
            ),
            _ => Array::from_vec(
                d,
                v.into_iter().map(nitro::f16::from_f32).collect::<Vec<_>>(),
            ),
        }
        .unwrap()
    };
    let wide = |a: &Array| -> Vec<f32> {
        match a.dtype() {
            DType::BF16 => a
                .as_slice::<nitro::bf16>()
                .unwrap()
                .iter()
                .map(|h| h.to_f32())
                .collect(),
            _ => a
                .as_slice::<nitro::f16>()
                .unwrap()
                .iter()
                .map(|h| h.to_f32())
                .collect(),
        }
    };
    let (a, b) = (values(dims[0], 1), values(dims[1], 5));
    let want = nitro::backend::interpreter()
        .compile(&g, &plain)
        .unwrap()
        .run(&[&a, &b])
        .unwrap()
        .remove(0);
    let Some(xla) = common::xla_or_skip("half dots and convolutions widened") else {
        return;
    };
    let got = xla
        .compile(&g, &widened)
        .unwrap()
        .run(&[&a, &b])
        .unwrap()
        .remove(0);
    assert_eq!(got.dtype(), dtype);
    let (got, want) = (wide(&got), wide(&want));
    for (g, w) in got.iter().zip(&want) {
        assert!(
            (g - w).abs() <= w.abs() / 128.0 + 1e-6,
            "{op}: {got:?} vs {want:?}"
        );
    }
}

#[test]
fn a_widened_half_dot_with_an_f32_result_is_not_rounded() {
    // bf16 × bf16 → f32 (`matmul_to`): widened operands, and the f32 product is the node.
    let ty = |d: &[usize]| LeafType::new(DType::BF16, d);
    let g = trace(
        &[("a".to_owned(), ty(&[4, 8])), ("b".to_owned(), ty(&[8, 3]))],
        |x| vec![x[0].matmul_to(x[1], DType::F32)],
    )
    .unwrap();
    let text = nitro::emit::emit_with(
        &g,
        &nitro::emit::EmitOptions {
            widen_half_dots: true,
            ..Default::default()
        },
    );
    let converts = text.matches("stablehlo.convert").count();
    assert_eq!(converts, 2, "the two operands only:\n{text}");
    assert!(
        text.lines()
            .any(|l| l.contains("stablehlo.dot_general %widened")
                && !l.trim_start().starts_with("%widened")),
        "{text}"
    );
}

#[test]
fn half_dots_and_convolutions_are_widened_to_f32_only_when_asked() {
    check_widened(
        "stablehlo.dot_general",
        DType::BF16,
        [&[4, 8], &[8, 3]],
        "4x3",
        |x| x[0].matmul(x[1]),
    );
    check_widened(
        "stablehlo.convolution",
        DType::F16,
        [&[1, 5, 5, 2], &[3, 3, 2, 3]],
        "1x5x5x3",
        |x| {
            x[0].conv(
                x[1],
                &nitro::trace::Conv::channels_last(2).same_for(&[5, 5], &[3, 3]),
            )
        },
    );
}

// ---- f16 with dynamic loss scaling -------------------------------------------------------------

use nitro::train::{LossScaleState, LossScaling};

/// A handle on the shared classifier computing in f16 with `scaling`, on `backend`.
fn scaled_handle(
    backend: &'static dyn Backend,
    scaling: LossScaling,
) -> Nitro<Mlp, nitro::optim::Adam> {
    handle(
        backend,
        Config::new(),
        Precision::f16().with_loss_scaling(Some(scaling)),
    )
}

fn steps(run: &mut Nitro<Mlp, nitro::optim::Adam>, from: usize, n: usize) -> Vec<f64> {
    let (x, y) = data(16 * (from + n), 3);
    (from..from + n)
        .map(|i| run.step(&batch(&x, &y, 16 * i, 16, 16), 16).unwrap().loss)
        .collect()
}

/// A scale so large that the f16 backward pass overflows: the step is skipped (parameters
/// and the optimizer's count unchanged) and the scale halves, until it fits; then it trains.
fn overflow_skips_and_halves(backend: &'static dyn Backend, what: &str) {
    let huge = 2f32.powi(40);
    let mut run = scaled_handle(
        backend,
        LossScaling {
            initial: huge,
            growth_interval: 1000,
        },
    );
    let before = leaves(run.experiment().unwrap());
    steps(&mut run, 0, 1);
    let state = run.loss_scale().unwrap().expect("scaling state");
    assert_eq!(
        state,
        LossScaleState {
            scale: huge / 2.0,
            good_steps: 0,
            optimizer_steps: 0
        },
        "{what}"
    );
    assert_eq!(leaves(run.experiment().unwrap()), before, "{what}: skipped");
    let losses = steps(&mut run, 1, 59);
    let state = run.loss_scale().unwrap().unwrap();
    let skipped = 60 - state.optimizer_steps;
    assert!(
        (2..60).contains(&skipped),
        "{what}: {skipped} skipped, {state:?}"
    );
    assert_eq!(state.scale, huge / 2f32.powi(skipped as i32), "{what}");
    // The finite steps since the last skip (a later step may overflow again at the edge).
    assert!(
        state.good_steps >= 1 && state.good_steps <= 60 - skipped,
        "{what}: {state:?}"
    );
    assert!(losses.iter().all(|l| l.is_finite()), "{what}: {losses:?}");
    assert!(losses[58] < losses[0] * 0.8, "{what}: trains: {losses:?}");
}

#[test]
fn f16_loss_scaling_skips_overflowing_steps_and_halves_the_scale_on_the_interpreter() {
    overflow_skips_and_halves(nitro::backend::interpreter(), "interpreter");
}

#[test]
fn f16_loss_scaling_skips_overflowing_steps_and_halves_the_scale_on_xla() {
    let test = "f16_loss_scaling_skips_overflowing_steps_and_halves_the_scale_on_xla";
    let Some(xla) = common::xla_or_skip(test) else {
        return;
    };
    overflow_skips_and_halves(xla, "xla");
}

/// `growth_interval` finite steps in a row double the scale; f16 with scaling trains close to
/// f32.
#[test]
fn f16_loss_scaling_grows_after_its_interval_and_trains_close_to_f32() {
    let backend = nitro::backend::interpreter();
    let mut run = scaled_handle(
        backend,
        LossScaling {
            initial: 1.0,
            growth_interval: 3,
        },
    );
    let half = steps(&mut run, 0, 7);
    assert_eq!(
        run.loss_scale().unwrap(),
        Some(LossScaleState {
            scale: 4.0,
            good_steps: 1,
            optimizer_steps: 7
        })
    );
    let (full, _) = train(backend, Precision::full(), 7);
    for (h, f) in half.iter().zip(&full) {
        assert!((h - f).abs() <= 0.01 * f, "{half:?} vs {full:?}");
    }
    // The default f16 precision scales; a precision without scaling reports none.
    assert!(Precision::f16().loss_scaling().is_some());
    let (_, mut plain) = train(backend, Precision::bf16(), 1);
    assert_eq!(plain.loss_scale().unwrap(), None);
}

/// The scale, its finite steps and the optimizer's count are in the checkpoint, a file or a
/// directory: a resumed run continues exactly as the uninterrupted one.
#[test]
fn loss_scaling_resumes_from_a_checkpoint_exactly() {
    let backend = nitro::backend::interpreter();
    let scaling = LossScaling {
        initial: 2f32.powi(30),
        growth_interval: 4,
    };
    let mut whole = scaled_handle(backend, scaling);
    let all = steps(&mut whole, 0, 12);
    let dir = common::TempDir::new("loss-scale-resume");
    std::fs::create_dir_all(dir.path()).unwrap();
    for name in ["at6.safetensors", "at6"] {
        let mut first = scaled_handle(backend, scaling);
        steps(&mut first, 0, 6);
        let at = first.loss_scale().unwrap().unwrap();
        let path = dir.path().join(name);
        first.save(&path).unwrap();
        let config = Config::new()
            .batch(16)
            .lr(0.05)
            .progress(false)
            .precision(Precision::f16().with_loss_scaling(Some(scaling)));
        let mut resumed = Nitro::resume_with(
            mlp(Act::Tanh),
            nitro::optim::Adam::default(),
            config,
            nitro::checkpoint::Saved::open(&path).unwrap(),
            backend,
            common::own_cache(),
        )
        .unwrap();
        let rest = steps(&mut resumed, 6, 6);
        assert_eq!(rest, all[6..], "{name}");
        assert_eq!(
            resumed.loss_scale().unwrap(),
            whole.loss_scale().unwrap(),
            "{name}"
        );
        assert!(
            at.optimizer_steps < 6,
            "{name}: some steps were skipped: {at:?}"
        );
    }
}

/// A scale below 1, or a growth interval of 0, is refused when the handle is made.
#[test]
fn loss_scaling_refuses_a_scale_below_one_and_an_empty_interval() {
    for (initial, growth_interval) in [(0.5, 10), (f32::INFINITY, 10), (1024.0, 0)] {
        let config =
            Config::new()
                .batch(16)
                .progress(false)
                .precision(Precision::f16().with_loss_scaling(Some(LossScaling {
                    initial,
                    growth_interval,
                })));
        let err = Nitro::with_backend(
            mlp(Act::Tanh),
            nitro::optim::Adam::default(),
            config,
            nitro::backend::interpreter(),
            common::own_cache(),
        )
        .map(|_| ())
        .unwrap_err()
        .to_string();
        assert!(err.contains("Config::precision"), "{err}");
    }
}

/// With gradient accumulation each micro-batch's gradient is unscaled before it joins the
/// window's sums, and a window whose sums are not finite is skipped as a whole: the scale
/// halves once per window, never per micro-batch.
#[test]
fn loss_scaling_with_accumulation_skips_whole_windows() {
    let backend = nitro::backend::interpreter();
    let huge = 2f32.powi(40);
    let config = Config::new()
        .batch(8)
        .lr(0.05)
        .progress(false)
        .accumulate(2)
        .precision(Precision::f16().with_loss_scaling(Some(LossScaling {
            initial: huge,
            growth_interval: 1000,
        })));
    let mut run = Nitro::with_backend(
        mlp(Act::Tanh),
        nitro::optim::Adam::default(),
        config,
        backend,
        common::own_cache(),
    )
    .unwrap();
    let (x, y) = data(8 * 80, 3);
    let micro = |run: &mut Nitro<Mlp, nitro::optim::Adam>, i: usize| {
        run.step(&batch(&x, &y, 8 * i, 8, 8), 8).unwrap().loss
    };
    micro(&mut run, 0);
    micro(&mut run, 1);
    assert_eq!(
        run.loss_scale().unwrap(),
        Some(LossScaleState {
            scale: huge / 2.0,
            good_steps: 0,
            optimizer_steps: 0
        }),
        "one window, one halving"
    );
    let losses: Vec<f64> = (2..80).map(|i| micro(&mut run, i)).collect();
    let state = run.loss_scale().unwrap().unwrap();
    let skipped = 40 - state.optimizer_steps;
    assert!((2..40).contains(&skipped), "{state:?}");
    assert_eq!(state.scale, huge / 2f32.powi(skipped as i32));
    assert!(losses.iter().all(|l| l.is_finite()));
    let early: f64 = losses[..10].iter().sum();
    let late: f64 = losses[losses.len() - 10..].iter().sum();
    assert!(late < early * 0.8, "trains: {losses:?}");
}

/// Under FSDP on 2 devices the scaled f16 step (its finite check over sharded gradients, the
/// skip, the scale) runs as on one device: the same skips and scale, losses within f16's
/// reassociation of the sharded reductions.
#[test]
fn f16_loss_scaling_under_fsdp_skips_and_scales_as_on_one_device() {
    let test = "f16_loss_scaling_under_fsdp_skips_and_scales_as_on_one_device";
    let Some(one) = common::xla_devices_or_skip(test, 1) else {
        return;
    };
    common::xla_devices_or_skip(test, 2).expect("2 devices");
    let precision = Precision::f16().with_loss_scaling(Some(LossScaling {
        initial: 2f32.powi(40),
        growth_interval: 1000,
    }));
    let run_on = |config: Config| {
        let mut run = handle(one, config, precision);
        let losses = steps(&mut run, 0, 30);
        (losses, run.loss_scale().unwrap().unwrap())
    };
    let (single, single_state) = run_on(Config::new());
    let (sharded, sharded_state) = run_on(common::fsdp(2));
    assert_eq!(sharded_state, single_state);
    assert!(single_state.optimizer_steps < 30, "{single_state:?}");
    for (a, b) in sharded.iter().zip(&single) {
        assert!((a - b).abs() <= 1e-3 * b.abs(), "{sharded:?} vs {single:?}");
    }
}
