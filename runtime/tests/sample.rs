//! Sampling on the device (`nitro::generate::sample`): greedy, temperature, top-k and top-p as
//! traced per-row inputs, drawn from a Threefry stream per row. Every graph runs on the
//! interpreter and, where the XLA plugin is installed, on XLA too, and the two must give the
//! same tokens (and the same bits for the random streams).

mod common;

use common::xla_or_skip;
use nitro::backend::interp;
use nitro::generate::sample::{
    fold_in_rows, sample, uniform_rows, SampleArrays, SampleParams, Sampling,
};
use nitro::trace::{random, trace, Graph};
use nitro::{Array, DType, Error, LeafType};

fn ty(dtype: DType, dims: &[usize]) -> LeafType {
    LeafType {
        dtype,
        dims: dims.to_vec(),
    }
}

/// Runs `graph` on every input set on the interpreter and, when XLA is there, on XLA (compiled
/// once), asserting both give the same outputs; the interpreter's outputs.
fn run_both(test: &str, graph: &Graph, sets: &[Vec<Array>]) -> Vec<Vec<Array>> {
    let want: Vec<Vec<Array>> = sets
        .iter()
        .map(|inputs| interp::run(graph, inputs).expect("the interpreter runs it"))
        .collect();
    if let Some(xla) = xla_or_skip(test) {
        let exe = xla
            .compile(graph, &nitro::emit::emit(graph))
            .expect("XLA compiles it");
        for (s, (inputs, want)) in sets.iter().zip(&want).enumerate() {
            let refs: Vec<&Array> = inputs.iter().collect();
            let got = exe.run(&refs).expect("XLA runs it");
            assert!(
                got == *want,
                "{test}: input set {s}: XLA and the interpreter disagree:\nxla    {got:?}\ninterp {want:?}"
            );
        }
    }
    want
}

/// The graph `sample(logits, keys, params, max_k)` for `rows` × `vocab` logits of `dtype`,
/// inputs in the order of [`inputs`].
fn sample_graph(rows: usize, vocab: usize, dtype: DType, max_k: usize) -> Graph {
    let inputs = [
        ("logits".to_string(), ty(dtype, &[rows, vocab])),
        ("keys".to_string(), ty(DType::U32, &[rows, 2])),
        ("temperature".to_string(), ty(DType::F32, &[rows])),
        ("top_k".to_string(), ty(DType::I32, &[rows])),
        ("top_p".to_string(), ty(DType::F32, &[rows])),
    ];
    trace(&inputs, |i| {
        let params = SampleParams {
            temperature: i[2],
            top_k: i[3],
            top_p: i[4],
        };
        vec![sample(i[0], i[1], &params, max_k)]
    })
    .expect("sample traces")
}

/// The inputs of [`sample_graph`]: `logits` (row-major, f32) and one setting per row.
fn inputs(logits: &[f32], vocab: usize, settings: &[Sampling], max_k: usize) -> Vec<Array> {
    let rows = settings.len();
    assert_eq!(logits.len(), rows * vocab);
    let a = SampleArrays::new(settings, max_k).expect("valid settings");
    let logits = Array::from_vec(&[rows, vocab], logits.to_vec()).unwrap();
    vec![logits, a.keys, a.temperature, a.top_k, a.top_p]
}

fn tokens(out: &[Array]) -> Vec<i32> {
    out[0].as_slice::<i32>().unwrap().to_vec()
}

/// Deterministic logits in [-3, 3) (a 64-bit LCG).
fn pseudo_logits(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 6.0 - 3.0
        })
        .collect()
}

/// The first index of the largest value.
fn argmax(row: &[f32]) -> i32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as i32
}

/// softmax(logits / t) in f64.
fn softmax(logits: &[f32], t: f64) -> Vec<f64> {
    let m = logits
        .iter()
        .fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    let e: Vec<f64> = logits.iter().map(|&x| ((x as f64 - m) / t).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

/// Asserts that `counts` (of `n` draws) fit the probabilities `p`: a token of probability 0 is
/// never drawn, and every count is within 5 standard deviations of a binomial(n, p) (plus one
/// for rounding) — a correct sampler fails one token's check with probability below 10⁻⁶,
/// while a wrong temperature or a wrong kept set moves the counts by far more.
fn assert_frequencies(test: &str, counts: &[usize], p: &[f64], n: usize) {
    for (i, (&c, &p)) in counts.iter().zip(p).enumerate() {
        if p == 0.0 {
            assert_eq!(
                c, 0,
                "{test}: token {i} is filtered out but was drawn {c} times"
            );
            continue;
        }
        let mean = n as f64 * p;
        let sd = (n as f64 * p * (1.0 - p)).sqrt();
        assert!(
            (c as f64 - mean).abs() <= 5.0 * sd + 1.0,
            "{test}: token {i} drawn {c} times of {n}, expected {mean:.1} ± {:.1} (5 sd); counts {counts:?}, p {p:?}",
            5.0 * sd
        );
    }
}

fn count(tokens: &[i32], vocab: usize) -> Vec<usize> {
    let mut c = vec![0; vocab];
    for &t in tokens {
        c[t as usize] += 1;
    }
    c
}

#[test]
fn greedy_is_the_first_argmax_whatever_top_k_and_top_p_say() {
    let (rows, vocab) = (8, 50);
    let mut logits = pseudo_logits(rows * vocab, 1);
    // Row 3 ties at its maximum: the first one wins.
    logits[3 * vocab + 7] = 9.0;
    logits[3 * vocab + 30] = 9.0;
    let settings: Vec<Sampling> = (0..rows)
        .map(|r| {
            Sampling::greedy()
                .top_k([0, 1, 5, 8][r % 4])
                .top_p([1.0, 0.5, 0.01][r % 3])
                .seed(r as u64)
        })
        .collect();
    let want: Vec<i32> = logits.chunks(vocab).map(argmax).collect();
    assert_eq!(want[3], 7);
    let graph = sample_graph(rows, vocab, DType::F32, 8);
    let out = run_both("greedy", &graph, &[inputs(&logits, vocab, &settings, 8)]);
    assert_eq!(tokens(&out[0]), want);

    // bf16 logits are widened to f32 first: the same argmax.
    let halves: Vec<nitro::bf16> = logits.iter().map(|&x| nitro::bf16::from_f32(x)).collect();
    let rounded: Vec<f32> = halves.iter().map(|h| h.to_f32()).collect();
    let mut set = inputs(&rounded, vocab, &settings, 8);
    set[0] = Array::from_vec(&[rows, vocab], halves).unwrap();
    let graph = sample_graph(rows, vocab, DType::BF16, 8);
    let out = run_both("greedy bf16", &graph, &[set]);
    let want: Vec<i32> = rounded.chunks(vocab).map(argmax).collect();
    assert_eq!(tokens(&out[0]), want);
}

#[test]
fn top_k_one_and_a_tiny_top_p_give_the_argmax_at_any_temperature() {
    let (rows, vocab) = (64, 40);
    let logits = pseudo_logits(rows * vocab, 2);
    let want: Vec<i32> = logits.chunks(vocab).map(argmax).collect();
    let graph = sample_graph(rows, vocab, DType::F32, 16);
    let temperatures = [0.5, 1.0, 5.0, 100.0];
    let sets: Vec<Vec<Array>> = temperatures
        .iter()
        .flat_map(|&t| {
            let k1: Vec<Sampling> = (0..rows)
                .map(|r| Sampling::greedy().temperature(t).top_k(1).seed(r as u64))
                .collect();
            let p0: Vec<Sampling> = (0..rows)
                .map(|r| Sampling::greedy().temperature(t).top_p(1e-6).seed(r as u64))
                .collect();
            [
                inputs(&logits, vocab, &k1, 16),
                inputs(&logits, vocab, &p0, 16),
            ]
        })
        .collect();
    for (s, out) in run_both("argmax", &graph, &sets).iter().enumerate() {
        assert_eq!(tokens(out), want, "input set {s}");
    }
    // The same temperatures without a filter do not give the argmax everywhere (the check
    // above could not pass by sampling greedily).
    let hot: Vec<Sampling> = (0..rows)
        .map(|r| Sampling::greedy().temperature(5.0).seed(r as u64))
        .collect();
    let out = run_both("argmax hot", &graph, &[inputs(&logits, vocab, &hot, 16)]);
    let differ = tokens(&out[0])
        .iter()
        .zip(&want)
        .filter(|(a, b)| a != b)
        .count();
    assert!(
        differ > rows / 2,
        "only {differ} of {rows} hot rows left the argmax"
    );
}

#[test]
fn the_same_key_gives_the_same_token_and_different_keys_a_spread() {
    let (rows, vocab) = (4096, 8);
    let row = [0.3f32, -0.2, 0.1, 0.0, 0.25, -0.1, 0.05, 0.15];
    let logits: Vec<f32> = row.iter().copied().cycle().take(rows * vocab).collect();
    let graph = sample_graph(rows, vocab, DType::F32, 0);
    let same: Vec<Sampling> = vec![Sampling::greedy().temperature(1.0).seed(99); rows];
    let spread: Vec<Sampling> = (0..rows)
        .map(|r| Sampling::greedy().temperature(1.0).seed(r as u64))
        .collect();
    let out = run_both(
        "same key",
        &graph,
        &[
            inputs(&logits, vocab, &same, 0),
            inputs(&logits, vocab, &spread, 0),
        ],
    );
    let same = tokens(&out[0]);
    assert!(
        same.iter().all(|&t| t == same[0]),
        "one key, several tokens"
    );
    let spread = count(&tokens(&out[1]), vocab);
    assert!(
        spread.iter().all(|&c| c > rows / 32),
        "4096 keys over 8 near-equal logits should draw every token often: {spread:?}"
    );
}

#[test]
fn frequencies_follow_the_softmax_at_the_temperature() {
    let (rows, vocab) = (4096, 8);
    let row = [2.0f32, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.25];
    let logits: Vec<f32> = row.iter().copied().cycle().take(rows * vocab).collect();
    let graph = sample_graph(rows, vocab, DType::F32, 8);
    let temperatures = [0.7f32, 1.0, 2.5];
    let sets: Vec<Vec<Array>> = temperatures
        .iter()
        .map(|&t| {
            let s: Vec<Sampling> = (0..rows)
                .map(|r| Sampling::greedy().temperature(t).seed(1000 + r as u64))
                .collect();
            inputs(&logits, vocab, &s, 8)
        })
        .collect();
    let outs = run_both("softmax frequencies", &graph, &sets);
    for (&t, out) in temperatures.iter().zip(&outs) {
        let p = softmax(&row, t as f64);
        assert_frequencies(&format!("T={t}"), &count(&tokens(out), vocab), &p, rows);
    }
}

/// softmax(logits / t) over the tokens `keep` holds, 0 elsewhere.
fn renormalised(logits: &[f32], t: f64, keep: &[bool]) -> Vec<f64> {
    let p = softmax(logits, t);
    let s: f64 = p.iter().zip(keep).filter(|(_, &k)| k).map(|(p, _)| p).sum();
    p.iter()
        .zip(keep)
        .map(|(&p, &k)| if k { p / s } else { 0.0 })
        .collect()
}

#[test]
fn top_k_keeps_the_k_largest_ties_included_and_nothing_else() {
    let (rows, vocab) = (4096, 8);
    // The 2nd largest value (2.0) ties three times: top-k 2 keeps four tokens.
    let row = [3.0f32, 1.0, 2.0, 2.0, 0.0, 2.0, -1.0, 1.0];
    let logits: Vec<f32> = row.iter().copied().cycle().take(rows * vocab).collect();
    let graph = sample_graph(rows, vocab, DType::F32, 8);
    let cases: [(u32, f32, [bool; 8]); 3] = [
        (2, 1.5, [true, false, true, true, false, true, false, false]),
        // The 4th largest is the same tied 2.0: the same set.
        (4, 1.5, [true, false, true, true, false, true, false, false]),
        // The 5th largest is 1.0, tied twice: six tokens.
        (5, 3.0, [true, true, true, true, false, true, false, true]),
    ];
    let sets: Vec<Vec<Array>> = cases
        .iter()
        .map(|&(k, t, _)| {
            let s: Vec<Sampling> = (0..rows)
                .map(|r| {
                    Sampling::greedy()
                        .temperature(t)
                        .top_k(k)
                        .seed(7 * r as u64)
                })
                .collect();
            inputs(&logits, vocab, &s, 8)
        })
        .collect();
    let outs = run_both("top-k", &graph, &sets);
    for ((k, t, keep), out) in cases.iter().zip(&outs) {
        let p = renormalised(&row, *t as f64, keep);
        assert_frequencies(
            &format!("top_k={k} T={t}"),
            &count(&tokens(out), vocab),
            &p,
            rows,
        );
    }
}

#[test]
fn top_k_past_the_declared_maximum_is_clamped_on_the_device() {
    // `check` refuses it on the host; a raw array holding more is clamped to max_k.
    let (rows, vocab) = (2048, 6);
    let row = [3.0f32, 2.5, 2.0, 1.5, 1.0, 0.5];
    let logits: Vec<f32> = row.iter().copied().cycle().take(rows * vocab).collect();
    let graph = sample_graph(rows, vocab, DType::F32, 2);
    let s: Vec<Sampling> = (0..rows)
        .map(|r| Sampling::greedy().temperature(4.0).seed(r as u64))
        .collect();
    let mut set = inputs(&logits, vocab, &s, 2);
    set[3] = Array::from_vec(&[rows], vec![6i32; rows]).unwrap();
    let out = run_both("top-k clamp", &graph, &[set]);
    let c = count(&tokens(&out[0]), vocab);
    assert!(c[2..].iter().all(|&c| c == 0), "max_k 2 kept more: {c:?}");
    assert!(c[0] > 0 && c[1] > 0, "{c:?}");
}

/// The tokens top-p keeps at temperature `t`: the smallest most-likely set reaching `p`.
fn top_p_set(logits: &[f32], t: f64, p: f64) -> Vec<bool> {
    let q = softmax(logits, t);
    let mut order: Vec<usize> = (0..q.len()).collect();
    order.sort_by(|&a, &b| q[b].total_cmp(&q[a]));
    let mut keep = vec![false; q.len()];
    let mut mass = 0.0;
    for i in order {
        keep[i] = true;
        mass += q[i];
        if mass >= p {
            break;
        }
    }
    keep
}

#[test]
fn top_p_keeps_the_smallest_set_reaching_p_and_nothing_else() {
    let (rows, vocab) = (4096, 8);
    let row = [2.0f32, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.25];
    let logits: Vec<f32> = row.iter().copied().cycle().take(rows * vocab).collect();
    let graph = sample_graph(rows, vocab, DType::F32, 8);
    // Cuts away from any boundary of the cumulative mass (checked below).
    let cases = [(1.0f32, 0.6f32), (1.0, 0.85), (2.0, 0.5), (0.5, 0.9)];
    let sets: Vec<Vec<Array>> = cases
        .iter()
        .map(|&(t, p)| {
            let s: Vec<Sampling> = (0..rows)
                .map(|r| {
                    Sampling::greedy()
                        .temperature(t)
                        .top_p(p)
                        .seed(5000 + r as u64)
                })
                .collect();
            inputs(&logits, vocab, &s, 8)
        })
        .collect();
    let outs = run_both("top-p", &graph, &sets);
    for (&(t, p), out) in cases.iter().zip(&outs) {
        let keep = top_p_set(&row, t as f64, p as f64);
        let kept = keep.iter().filter(|&&k| k).count();
        assert!(
            kept > 1 && kept < vocab,
            "T={t} p={p}: the case should cut: {keep:?}"
        );
        let want = renormalised(&row, t as f64, &keep);
        assert_frequencies(
            &format!("top_p={p} T={t}"),
            &count(&tokens(out), vocab),
            &want,
            rows,
        );
    }

    // With top-k too: top-p applies to what top-k kept, renormalised.
    let s: Vec<Sampling> = (0..rows)
        .map(|r| {
            Sampling::greedy()
                .temperature(1.0)
                .top_k(3)
                .top_p(0.8)
                .seed(r as u64)
        })
        .collect();
    let out = run_both("top-k then top-p", &graph, &[inputs(&logits, vocab, &s, 8)]);
    // Top 3: tokens 0 (2.0), 6 (1.5), 1 (1.0) with masses ∝ e^2, e^1.5, e^1 = 0.51, 0.31, 0.19:
    // 0.8 needs all but token 1... 0.51 + 0.31 = 0.82 ≥ 0.8, so tokens 0 and 6.
    let keep = [true, false, false, false, false, false, true, false];
    let want = renormalised(&row, 1.0, &keep);
    assert_frequencies(
        "top_k=3 top_p=0.8",
        &count(&tokens(&out[0]), vocab),
        &want,
        rows,
    );
}

/// The graph of a decode step's sampling: per-row keys with each row's position folded in,
/// then `sample`.
fn step_graph(rows: usize, vocab: usize, max_k: usize) -> Graph {
    let inputs = [
        ("logits".to_string(), ty(DType::F32, &[rows, vocab])),
        ("keys".to_string(), ty(DType::U32, &[rows, 2])),
        ("temperature".to_string(), ty(DType::F32, &[rows])),
        ("top_k".to_string(), ty(DType::I32, &[rows])),
        ("top_p".to_string(), ty(DType::F32, &[rows])),
        ("position".to_string(), ty(DType::I32, &[rows])),
    ];
    trace(&inputs, |i| {
        let params = SampleParams {
            temperature: i[2],
            top_k: i[3],
            top_p: i[4],
        };
        vec![sample(i[0], fold_in_rows(i[1], i[5]), &params, max_k)]
    })
    .expect("the step traces")
}

#[test]
fn a_rows_token_is_the_same_alone_and_beside_other_rows() {
    let vocab = 30;
    let max_k = 8;
    // Requests: settings, logits, position.
    let requests: Vec<(Sampling, Vec<f32>, i32)> = (0..6)
        .map(|r| {
            let s = Sampling::greedy()
                .temperature([1.0, 0.7, 2.0, 1.3, 0.0, 1.0][r])
                .top_k([0, 5, 0, 8, 0, 3][r])
                .top_p([1.0, 1.0, 0.9, 0.7, 1.0, 0.95][r])
                .seed(31 * r as u64 + 2);
            (s, pseudo_logits(vocab, 100 + r as u64), 3 * r as i32 + 1)
        })
        .collect();
    let fillers: Vec<(Sampling, Vec<f32>, i32)> = (0..4)
        .map(|r| {
            let s = Sampling::greedy()
                .temperature(0.5 + r as f32)
                .seed(9000 + r as u64);
            (s, pseudo_logits(vocab, 200 + r as u64), 17)
        })
        .collect();
    let batch = |rows: &[&(Sampling, Vec<f32>, i32)]| {
        let settings: Vec<Sampling> = rows.iter().map(|r| r.0).collect();
        let logits: Vec<f32> = rows.iter().flat_map(|r| r.1.clone()).collect();
        let mut set = inputs(&logits, vocab, &settings, max_k);
        set.push(Array::from_vec(&[rows.len()], rows.iter().map(|r| r.2).collect()).unwrap());
        set
    };
    // Alone: one row per call.
    let alone_graph = step_graph(1, vocab, max_k);
    let sets: Vec<Vec<Array>> = requests.iter().map(|r| batch(&[r])).collect();
    let alone: Vec<i32> = run_both("alone", &alone_graph, &sets)
        .iter()
        .map(|o| tokens(o)[0])
        .collect();
    // Two mixes of eight rows: the requests in different places beside different fillers.
    let graph = step_graph(8, vocab, max_k);
    let (q, f) = (&requests, &fillers);
    let mix_a = [&q[0], &q[1], &f[0], &q[2], &q[3], &q[4], &f[1], &q[5]];
    let mix_b = [&f[2], &q[5], &q[3], &q[1], &f[3], &q[0], &q[4], &q[2]];
    let outs = run_both("mixes", &graph, &[batch(&mix_a), batch(&mix_b)]);
    let (a, b) = (tokens(&outs[0]), tokens(&outs[1]));
    let at_a = [0, 1, 3, 4, 5, 7];
    let at_b = [5, 3, 7, 2, 6, 1];
    for r in 0..requests.len() {
        assert_eq!(a[at_a[r]], alone[r], "request {r} in mix a");
        assert_eq!(b[at_b[r]], alone[r], "request {r} in mix b");
    }
    // The check is not vacuous: the hot requests did not all draw their argmax.
    let argmaxes: Vec<i32> = requests.iter().map(|r| argmax(&r.1)).collect();
    assert!(
        alone.iter().zip(&argmaxes).filter(|(t, m)| t != m).count() >= 2,
        "alone {alone:?}, argmaxes {argmaxes:?}"
    );
    assert_eq!(alone[4], argmaxes[4], "request 4 is greedy");
}

#[test]
fn row_streams_are_jax_streams_under_each_rows_key() {
    let rows = 5;
    let n = 1000; // over random::ROLLED_UP_TO in all: the unrolled form
    let keys: Vec<[u32; 2]> = (0..rows as u64)
        .map(|s| random::key_host(s * 977 + 3))
        .collect();
    let data: Vec<i32> = (0..rows as i32).map(|r| 11 * r + 4).collect();
    let tiny = f32::MIN_POSITIVE as f64;
    let graph = trace(
        &[
            ("keys".into(), ty(DType::U32, &[rows, 2])),
            ("data".into(), ty(DType::I32, &[rows])),
        ],
        |i| {
            let folded = fold_in_rows(i[0], i[1]);
            vec![
                folded,
                uniform_rows(folded, n, tiny, 1.0),
                uniform_rows(i[0], 3, 0.0, 1.0),
            ]
        },
    )
    .unwrap();
    let set = vec![
        Array::from_vec(&[rows, 2], keys.concat()).unwrap(),
        Array::from_vec(&[rows], data.clone()).unwrap(),
    ];
    let out = &run_both("row streams", &graph, &[set])[0];
    let folded = out[0].as_slice::<u32>().unwrap();
    let u = out[1].as_slice::<f32>().unwrap();
    let small = out[2].as_slice::<f32>().unwrap();
    for r in 0..rows {
        let f = random::fold_in_host(keys[r], data[r] as u32);
        assert_eq!(&folded[2 * r..2 * r + 2], &f, "row {r}'s folded key");
        let want = random::uniform_host(f, n, tiny, 1.0).unwrap();
        assert_eq!(&u[r * n..(r + 1) * n], &want[..], "row {r}'s uniforms");
        // A small draw (15 elements: the rolled form) gives the same bits.
        let want = random::uniform_host(keys[r], 3, 0.0, 1.0).unwrap();
        assert_eq!(&small[3 * r..3 * r + 3], &want[..], "row {r}'s small draw");
    }
}

#[test]
fn check_refuses_each_bad_setting_naming_its_field() {
    let ok = Sampling::greedy()
        .temperature(0.9)
        .top_k(40)
        .top_p(0.9)
        .seed(3);
    ok.check(40).unwrap();
    Sampling::greedy().check(0).unwrap();
    Sampling::greedy()
        .temperature(0.0)
        .top_p(1.0)
        .check(0)
        .unwrap();
    let cases = [
        (ok.temperature(f32::NAN), "temperature"),
        (ok.temperature(-0.5), "temperature"),
        (ok.temperature(f32::INFINITY), "temperature"),
        (ok.top_p(0.0), "top_p"),
        (ok.top_p(1.5), "top_p"),
        (ok.top_p(-0.1), "top_p"),
        (ok.top_p(f32::NAN), "top_p"),
        (ok.top_k(41), "top_k"),
    ];
    for (s, field) in cases {
        match s.check(40) {
            Err(Error::InvalidRequest { field: f, why }) => {
                assert_eq!(f, field, "{s:?}: {why}");
                let message = Error::InvalidRequest { field: f, why }.to_string();
                assert!(message.contains(field), "{message}");
            }
            other => panic!("{s:?} should be refused naming {field}, got {other:?}"),
        }
    }
    // The batch arrays refuse a bad row too.
    assert!(matches!(
        SampleArrays::new(&[ok, ok.top_p(2.0)], 40),
        Err(Error::InvalidRequest { field: "top_p", .. })
    ));
    let a = SampleArrays::new(&[ok, Sampling::greedy().seed(1 << 40 | 5)], 40).unwrap();
    assert_eq!(a.keys.as_slice::<u32>().unwrap(), &[0, 3, 256, 5]);
    assert_eq!(a.top_k.as_slice::<i32>().unwrap(), &[40, 0]);
}

#[test]
fn wrong_types_fail_the_trace_naming_sample_and_the_input() {
    let attempt = |logits: LeafType, keys: LeafType, top_k: DType| {
        let rows = 4;
        let inputs = [
            ("logits".to_string(), logits),
            ("keys".to_string(), keys),
            ("temperature".to_string(), ty(DType::F32, &[rows])),
            ("top_k".to_string(), ty(top_k, &[rows])),
            ("top_p".to_string(), ty(DType::F32, &[rows])),
        ];
        trace(&inputs, |i| {
            let params = SampleParams {
                temperature: i[2],
                top_k: i[3],
                top_p: i[4],
            };
            vec![sample(i[0], i[1], &params, 4)]
        })
        .map(|_| ())
    };
    let cases = [
        (
            ty(DType::I32, &[4, 10]),
            ty(DType::U32, &[4, 2]),
            DType::I32,
            "logits",
        ),
        (
            ty(DType::F32, &[4, 10, 2]),
            ty(DType::U32, &[4, 2]),
            DType::I32,
            "logits",
        ),
        (
            ty(DType::F32, &[4, 10]),
            ty(DType::U32, &[3, 2]),
            DType::I32,
            "keys",
        ),
        (
            ty(DType::F32, &[4, 10]),
            ty(DType::I32, &[4, 2]),
            DType::I32,
            "keys",
        ),
        (
            ty(DType::F32, &[4, 10]),
            ty(DType::U32, &[4, 2]),
            DType::F32,
            "top_k",
        ),
    ];
    for (logits, keys, top_k, name) in cases {
        match attempt(logits.clone(), keys.clone(), top_k) {
            Err(Error::Trace(e)) => {
                assert_eq!(e.op, "sample", "{e:?}");
                assert!(e.message.contains(&format!("`{name}`")), "{e:?}");
                assert!(e.location.contains("sample.rs"), "{e:?}");
            }
            other => panic!("{logits} {keys} {top_k}: expected a trace error, got {other:?}"),
        }
    }
}
