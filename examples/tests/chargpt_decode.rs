//! The character GPT decodes through a KV cache (`generate::Decoder`), unrolled and with
//! `--scan`: its declared cache, and its logits through the cache held to the full forward pass
//! over the window (`chargpt::logits`) on the interpreter and on XLA — a prefill then one
//! character at a time, and greedy decoding token by token against the full-window recompute.
#![allow(missing_docs)]

use nitro::backend::{self, Backend};
use nitro::cache::Cache;
use nitro::generate::Decoder;
use nitro::prelude::*;
use nitro::program::{Outputs, Program};
use nitro_examples::chargpt::{self, CharGpt, CharGptView, GptShape};

#[derive(Tree, Clone)]
pub struct Step {
    pub tokens: Array,
    pub start: Array,
    pub cache: Vec<Array>,
}

fn decode_step(v: &CharGptView<'_>, s: &StepMirror<Tensor>) -> (Tensor, Vec<Tensor>) {
    CharGpt::decode(v, s.tokens, s.start, s.cache.clone())
}

fn full_logits(v: &CharGptView<'_>, x: &Tensor) -> Tensor {
    chargpt::logits(v, *x)
}

const DECODE: Program<CharGpt, StepMirror<Tensor>, (Tensor, Vec<Tensor>)> =
    CharGpt::program("decode", decode_step);
const FULL: Program<CharGpt, Tensor> = CharGpt::program("logits", full_logits);

const VOCAB: usize = 20;

fn model(context: usize, scan: bool) -> CharGpt {
    let shape = GptShape {
        layers: 2,
        width: 32,
        heads: 4,
        context,
        dropout: 0.0,
        seed: 3,
        scan,
    };
    let mut gpt = CharGpt::new(&shape, VOCAB);
    // Positions that weigh enough for a greedy text to keep changing (so a position read
    // wrongly through the cache shows).
    for x in gpt.positions.table.as_slice_mut::<f32>().unwrap() {
        *x *= 30.0;
    }
    gpt
}

fn backends(test: &str) -> Vec<(&'static str, &'static dyn Backend)> {
    let mut b: Vec<(&'static str, &'static dyn Backend)> =
        vec![("interpreter", backend::interpreter())];
    match backend::xla() {
        Ok(x) => b.push(("xla", x)),
        Err(e) => {
            let required = std::env::var("NITRO_REQUIRE_XLA").is_ok_and(|v| v.trim() == "1");
            assert!(
                !required,
                "{test}: NITRO_REQUIRE_XLA=1 but XLA is unavailable: {e}"
            );
            println!("skip: {test} on XLA: {e}");
        }
    }
    b
}

struct Runner {
    backend: &'static dyn Backend,
    cache: Cache,
}

impl Runner {
    fn new(backend: &'static dyn Backend) -> Runner {
        Runner {
            backend,
            cache: Cache::in_memory(32),
        }
    }

    fn run<M, O: Outputs, I: Tree<Mirror<Tensor> = M>>(
        &self,
        program: &Program<CharGpt, M, O>,
        e: &CharGpt,
        inputs: &I,
    ) -> Vec<Array> {
        let served = self.cache.get(self.backend, program, e, inputs).unwrap();
        served
            .executable
            .run(&program.arguments(e, inputs))
            .unwrap()
    }

    fn full(&self, e: &CharGpt, ids: &[i32], rows: usize) -> Vec<f32> {
        let ids = Array::from_vec(&[rows, ids.len() / rows], ids.to_vec()).unwrap();
        let out = self.run(&FULL, e, &ids).remove(0);
        out.as_slice::<f32>().unwrap().to_vec()
    }

    fn decode(
        &self,
        e: &CharGpt,
        tokens: &[i32],
        rows: usize,
        start: i32,
        cache: Vec<Array>,
    ) -> (Vec<f32>, Vec<Array>) {
        let step = Step {
            tokens: Array::from_vec(&[rows, tokens.len() / rows], tokens.to_vec()).unwrap(),
            start: Array::from_vec(&[rows], vec![start; rows]).unwrap(),
            cache,
        };
        let mut out = self.run(&DECODE, e, &step);
        let logits = out.remove(0).as_slice::<f32>().unwrap().to_vec();
        (logits, out)
    }
}

fn fresh_cache(e: &CharGpt, rows: usize) -> Vec<Array> {
    e.decode_shape()
        .cache
        .iter()
        .map(|c| Array::zeros(c.row.dtype, &c.with_rows(rows).dims))
        .collect()
}

fn text(rows: usize, t: usize, seed: u64) -> Vec<i32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..rows * t)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % VOCAB as u64) as i32
        })
        .collect()
}

/// Position `j`'s logits of each row of `[rows, t, vocab]`.
fn column(x: &[f32], rows: usize, t: usize, j: usize) -> Vec<f32> {
    (0..rows)
        .flat_map(|r| x[(r * t + j) * VOCAB..(r * t + j + 1) * VOCAB].to_vec())
        .collect()
}

/// The largest `|a − b|` over the largest `|b|`.
fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f64, |m, &x| m.max(f64::from(x).abs()));
    let diff = a.iter().zip(b).fold(0f64, |m, (&x, &y)| {
        m.max((f64::from(x) - f64::from(y)).abs())
    });
    assert!(diff.is_finite(), "a non-finite logit");
    diff / scale.max(1e-30)
}

fn argmax(logits: &[f32]) -> Vec<i32> {
    logits
        .chunks(VOCAB)
        .map(|row| {
            (0..row.len()).fold(0, |best, i| if row[i] > row[best] { i } else { best }) as i32
        })
        .collect()
}

#[test]
fn the_declared_cache_follows_the_blocks_form() {
    let unrolled = model(64, false).decode_shape();
    assert_eq!((unrolled.vocab, unrolled.context), (VOCAB, 64));
    let names: Vec<&str> = unrolled.cache.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(
        names,
        ["blocks[0].k", "blocks[0].v", "blocks[1].k", "blocks[1].v"]
    );
    assert_eq!(unrolled.cache[0].with_rows(3).to_string(), "f32[3,4,64,8]");
    let scanned = model(64, true).decode_shape();
    let names: Vec<&str> = scanned.cache.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["stack.k", "stack.v"]);
    assert_eq!(scanned.cache[1].with_rows(3).to_string(), "f32[2,3,4,64,8]");
}

#[test]
fn chargpt_through_the_cache_gives_the_full_windows_logits() {
    let (rows, t, p) = (2, 20, 6);
    let window = text(rows, t, 5);
    let unrolled = model(32, false);
    let scanned = model(32, false).stacked().unwrap();
    for (name, b) in backends("chargpt_through_the_cache_gives_the_full_windows_logits") {
        let run = Runner::new(b);
        let want = run.full(&unrolled, &window, rows);
        for (form, e) in [("unrolled", &unrolled), ("scan", &scanned)] {
            let prompt: Vec<i32> = (0..rows)
                .flat_map(|r| window[r * t..r * t + p].to_vec())
                .collect();
            let (logits, mut cache) = run.decode(e, &prompt, rows, 0, fresh_cache(e, rows));
            let mut worst = 0f64;
            for j in 0..p {
                worst = worst.max(rel_diff(
                    &column(&logits, rows, p, j),
                    &column(&want, rows, t, j),
                ));
            }
            for j in p..t {
                let tokens: Vec<i32> = (0..rows).map(|r| window[r * t + j]).collect();
                let (logits, written) = run.decode(e, &tokens, rows, j as i32, cache);
                cache = written;
                worst = worst.max(rel_diff(&logits, &column(&want, rows, t, j)));
            }
            println!(
                "{name} {form}: prefill {p} + {} single characters vs the full window: max |Δ| / \
                 max |logit| = {worst:.2e}",
                t - p
            );
            assert!(worst <= 1e-5, "{name} {form}: {worst:e}");
        }
    }
}

#[test]
fn chargpt_greedy_through_the_cache_is_the_full_window_recompute() {
    let (context, rows, p, steps) = (64, 2, 4, 48);
    let prompt = text(rows, p, 9);
    let unrolled = model(context, false);
    let scanned = model(context, false).stacked().unwrap();
    for (name, b) in backends("chargpt_greedy_through_the_cache_is_the_full_window_recompute") {
        let run = Runner::new(b);
        // Today's path: the whole window (padded to the context) for every character.
        let mut want: Vec<Vec<i32>> = prompt.chunks(p).map(<[i32]>::to_vec).collect();
        for _ in 0..steps {
            let len = want[0].len();
            let mut window = vec![0i32; rows * context];
            for (r, s) in want.iter().enumerate() {
                window[r * context..r * context + len].copy_from_slice(s);
            }
            let logits = run.full(&unrolled, &window, rows);
            for (s, n) in want
                .iter_mut()
                .zip(argmax(&column(&logits, rows, context, len - 1)))
            {
                s.push(n);
            }
        }
        for (form, e) in [("unrolled", &unrolled), ("scan", &scanned)] {
            let mut got: Vec<Vec<i32>> = prompt.chunks(p).map(<[i32]>::to_vec).collect();
            let (logits, mut cache) = run.decode(e, &prompt, rows, 0, fresh_cache(e, rows));
            let mut next = argmax(&column(&logits, rows, p, p - 1));
            for step in 0..steps {
                for (s, &n) in got.iter_mut().zip(&next) {
                    s.push(n);
                }
                if step + 1 < steps {
                    let at = (p + step) as i32;
                    let (logits, written) = run.decode(e, &next, rows, at, cache);
                    cache = written;
                    next = argmax(&logits);
                }
            }
            assert_eq!(got, want, "{name} {form}");
        }
        for row in &want {
            let distinct: std::collections::BTreeSet<i32> = row.iter().copied().collect();
            println!(
                "{name}: {steps} greedy characters agree ({} distinct): {row:?}",
                distinct.len()
            );
            assert!(distinct.len() > 5, "{name}: a text that varies: {row:?}");
        }
    }
}
