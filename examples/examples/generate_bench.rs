//! The nitro side of `bench/generate_bench.sh`: chargpt's model generating through
//! `nitro::generate`, measured the way `bench/twin_generate.py` measures its JAX twin, from the
//! same bundle (the same weights, prompts and declaration).
//!
//! ```sh
//! generate_bench --bundle DIR --write [--layers 4 --width 128 --heads 4 --context 128]
//! generate_bench --bundle DIR --mode measure --slots 32 --json   # decode, TTFT, compiles
//! generate_bench --bundle DIR --mode start --json                # process start → first token
//! generate_bench --bundle DIR --mode floor --json                # 1-slot decode + copy bandwidth
//! ```
//!
//! `--write` makes the bundle: `weights.safetensors` (the model's leaves by path, initialised
//! from `--seed` by the layer library's rules, or `--weights FILE` loaded over them) and
//! `run.json` (the shape, the corpus's characters, the prompt buckets, the chunk size, the
//! largest top-k and the prompts). Every other mode reads it.
//!
//! `measure` builds two generators (1 slot and `--slots` slots) and reports: the programs
//! compiled and loaded getting their inventory, the greedy text of the 32-character prompt
//! (the two sides must agree), the time to first token of the 32- and 120-character prompts
//! (median of `--rounds` × 5 requests on an idle generator), decode tokens/s at 1 slot and at
//! all slots (median of `--rounds`; each request `--tokens` tokens, the decode time being from
//! the last first token to the last token), and the compiles after warm-up under a mix of
//! prompt lengths, temperatures, top-k/top-p and more requests than slots. `start` prints the
//! wall-clock time of its first token (`first_token_unix`), for the script to subtract the
//! time it launched the process. `floor` measures decode at 1 slot and the machine's copy
//! bandwidth (a `--copy-mb` buffer copied, on every core, best of 5), and the bytes a decode
//! step reads (the weights and one row of the KV cache).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use nitro::data::text;
use nitro::generate::{GenerateConfig, Generator, Request, Sampling};
use nitro::prelude::*;
use nitro_examples::chargpt::{CharGpt, GptShape};
use serde_json::{json, Value};

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Measure,
    Start,
    Floor,
}

#[derive(Parser, Debug)]
#[command(about = "chargpt generating through nitro::generate, measured against its JAX twin")]
struct Args {
    /// The bundle directory (written with --write, read otherwise).
    #[arg(long)]
    bundle: PathBuf,
    /// Write the bundle and exit.
    #[arg(long)]
    write: bool,
    /// Model shape for --write.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    #[arg(long, default_value_t = 128)]
    width: usize,
    #[arg(long, default_value_t = 4)]
    heads: usize,
    #[arg(long, default_value_t = 128)]
    context: usize,
    /// The seed of the weights (--write).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Trained weights to put in the bundle instead (a safetensors file named by leaf path,
    /// e.g. `chargpt --checkpoint run.safetensors`; extra tensors ignored).
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Prompt buckets for --write (default: powers of two from 16, and the context).
    #[arg(long, value_delimiter = ',')]
    buckets: Vec<usize>,
    /// Decode chunk size (steps per call) for --write.
    #[arg(long, default_value_t = 16)]
    chunk: usize,
    /// The largest top-k the programs allow (--write).
    #[arg(long, default_value_t = 40)]
    max_top_k: usize,
    #[arg(long, value_enum, default_value_t = Mode::Measure)]
    mode: Mode,
    /// Slots of the many-slot generator.
    #[arg(long, default_value_t = 32)]
    slots: usize,
    /// Tokens per request when measuring decode.
    #[arg(long, default_value_t = 97)]
    tokens: usize,
    /// Repeats of each measurement.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// The copy loop's buffer (MiB), --mode floor.
    #[arg(long, default_value_t = 1024)]
    copy_mb: usize,
    /// One JSON line only.
    #[arg(long)]
    json: bool,
}

fn main() -> std::process::ExitCode {
    match try_main() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("generate_bench: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The bundle's run.json and the model it describes with its weights loaded.
struct Bundle {
    run: Value,
    vocab: text::Vocab,
    model: CharGpt,
}

impl Bundle {
    fn shape(run: &Value) -> Res<GptShape> {
        let n = |k: &str| -> Res<usize> {
            run[k]
                .as_u64()
                .map(|v| v as usize)
                .ok_or_else(|| format!("run.json has no {k}").into())
        };
        Ok(GptShape {
            layers: n("layers")?,
            width: n("width")?,
            heads: n("heads")?,
            context: n("context")?,
            dropout: 0.0,
            seed: run["seed"].as_u64().unwrap_or(1),
            scan: false,
        })
    }

    fn read(dir: &Path) -> Res<Bundle> {
        let run: Value = serde_json::from_slice(&std::fs::read(dir.join("run.json"))?)?;
        let chars = run["chars"].as_str().ok_or("run.json has no chars")?;
        let vocab = text::Vocab::of(chars);
        let shape = Bundle::shape(&run)?;
        let mut model = nitro::init::declared(|| CharGpt::new(&shape, vocab.len()));
        nitro::weights::load_into(
            &mut model,
            dir.join("weights.safetensors"),
            &nitro::weights::Import::new(),
        )?;
        Ok(Bundle { run, vocab, model })
    }

    fn list(&self, key: &str) -> Vec<usize> {
        self.run[key]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.as_u64())
                    .map(|v| v as usize)
                    .collect()
            })
            .unwrap_or_default()
    }

    fn config(&self, slots: usize) -> GenerateConfig {
        GenerateConfig::new()
            .slots(slots)
            .buckets(self.list("buckets"))
            .chunks([self.run["chunk"].as_u64().unwrap_or(16) as usize])
            .max_top_k(self.run["max_top_k"].as_u64().unwrap_or(40) as usize)
            .queue(4096)
    }

    fn prompt(&self, key: &str) -> Res<Vec<u32>> {
        let text = self.run[key].as_str().ok_or("run.json lacks a prompt")?;
        Ok(self.vocab.encode(text)?.iter().map(|&t| t as u32).collect())
    }
}

fn write_bundle(args: &Args) -> Res<()> {
    let corpus = text::fortunes(None)?;
    let vocab = text::Vocab::of(&corpus);
    let chars: String = {
        let mut c: Vec<char> = corpus.chars().collect();
        c.sort_unstable();
        c.dedup();
        c.into_iter().collect()
    };
    let shape = GptShape {
        layers: args.layers,
        width: args.width,
        heads: args.heads,
        context: args.context,
        dropout: 0.0,
        seed: args.seed,
        scan: false,
    };
    let mut model = nitro::init::declared(|| CharGpt::new(&shape, vocab.len()));
    nitro::train::initialize_on_host(&mut model, nitro::init::layer_defaults(), args.seed)?;
    if let Some(path) = &args.weights {
        nitro::weights::load_into(
            &mut model,
            path,
            &nitro::weights::Import::new().allow_extra(),
        )?;
    }
    let mut buckets = args.buckets.clone();
    if buckets.is_empty() {
        buckets = (4..)
            .map(|p| 1usize << p)
            .take_while(|&b| b < args.context)
            .collect();
        buckets.push(args.context);
    }
    // Prompts: the corpus's opening characters, newlines as spaces.
    let flat: String = corpus
        .chars()
        .map(|c| if c == '\n' { ' ' } else { c })
        .collect();
    let take = |n: usize| -> String { flat.chars().take(n).collect() };
    let mut weight_bytes = 0u64;
    model.visit_device(&mut |_, _, node| {
        if let nitro::tree::Node::Leaf(a) = node {
            weight_bytes += a.leaf_type().size_bytes().unwrap_or(0);
        }
    });
    let run = json!({
        "model": "chargpt-generate",
        "layers": args.layers, "width": args.width, "heads": args.heads,
        "context": args.context, "vocab": vocab.len(), "chars": chars, "seed": args.seed,
        "ln_eps": model.arch.norm.eps,
        "buckets": buckets, "chunk": args.chunk, "max_top_k": args.max_top_k,
        "prompt16": take(16), "prompt32": take(32), "prompt120": take(120),
        "weight_bytes": weight_bytes,
        "trained_weights": args.weights.is_some(),
    });
    std::fs::create_dir_all(&args.bundle)?;
    nitro::weights::export(&model, args.bundle.join("weights.safetensors"))?;
    std::fs::write(
        args.bundle.join("run.json"),
        serde_json::to_vec_pretty(&run)?,
    )?;
    if !args.json {
        println!(
            "bundle {} written: {} MB of weights",
            args.bundle.display(),
            weight_bytes as f64 / 1e6
        );
    }
    Ok(())
}

/// Decode tokens/s of `g` with `rows` requests of `tokens` tokens after `prompt` (greedy):
/// the tokens after each request's first over the time from the last first token to the end.
fn decode_rate(g: &mut Generator<CharGpt>, prompt: &[u32], rows: usize, tokens: usize) -> Res<f64> {
    let submitted = Instant::now();
    for _ in 0..rows {
        g.submit(Request::new(prompt.to_vec(), tokens))?;
    }
    let records = g.run_to_end()?;
    let end = submitted.elapsed();
    let first = records
        .iter()
        .filter_map(|r| r.time_to_first_token)
        .max()
        .unwrap_or_default();
    let after: usize = records
        .iter()
        .map(|r| r.tokens.len().saturating_sub(1))
        .sum();
    Ok(after as f64 / (end - first).as_secs_f64().max(1e-9))
}

/// Time to first token of `prompt` on an idle generator (median of `n`, one unmeasured first).
fn ttft(g: &mut Generator<CharGpt>, prompt: &[u32], n: usize) -> Res<f64> {
    g.generate(Request::new(prompt.to_vec(), 1))?;
    let mut v = Vec::new();
    for _ in 0..n {
        let r = g.generate(Request::new(prompt.to_vec(), 1))?;
        v.push(ms(r.time_to_first_token.unwrap_or_default()));
    }
    Ok(median(v))
}

/// Copy bandwidth: a `mb` MiB buffer copied into another on every core, best of 5, as bytes
/// read plus bytes written per second (STREAM's count), in GB/s.
fn copy_bandwidth(mb: usize) -> f64 {
    let n = mb << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let part = n.div_ceil(threads);
    let mut best = f64::INFINITY;
    for _ in 0..6 {
        let t = Instant::now();
        std::thread::scope(|s| {
            for (d, c) in dst.chunks_mut(part).zip(src.chunks(part)) {
                s.spawn(move || d.copy_from_slice(c));
            }
        });
        best = best.min(t.elapsed().as_secs_f64());
        std::hint::black_box(&dst);
    }
    2.0 * n as f64 / best / 1e9
}

fn try_main() -> Res<()> {
    let args = Args::parse();
    if args.write {
        return write_bundle(&args);
    }
    let b = Bundle::read(&args.bundle)?;
    match args.mode {
        Mode::Start => {
            let mut g = Generator::new(b.model.clone(), b.config(1))?;
            let r = g.generate(Request::new(b.prompt("prompt32")?, 1))?;
            let at = unix_now();
            let line = json!({
                "side": "nitro", "mode": "start", "first_token_unix": at,
                "compiles": g.inventory().compiles(),
                "inventory": g.inventory().prefill.len() + g.inventory().decode.len(),
                "warm_up_ms": ms(g.inventory().warm_up),
                "ttft_ms": ms(r.time_to_first_token.unwrap_or_default()),
            });
            println!("{line}");
        }
        Mode::Floor => {
            let mut g = Generator::new(b.model.clone(), b.config(1))?;
            let compiles = g.inventory().compiles();
            let prompt = b.prompt("prompt16")?;
            decode_rate(&mut g, &prompt, 1, 8)?;
            let rates: Vec<f64> = (0..args.rounds)
                .map(|_| decode_rate(&mut g, &prompt, 1, args.tokens))
                .collect::<Res<_>>()?;
            let bw = copy_bandwidth(args.copy_mb);
            let weights = b.run["weight_bytes"].as_u64().unwrap_or(0) as f64;
            let kv_row = g.kv_cache_bytes() as f64; // one slot: the whole row is read per step
            let per_token = weights + kv_row;
            let rate = median(rates.clone());
            let floor = bw * 1e9 / per_token;
            let line = json!({
                "side": "nitro", "mode": "floor", "compiles": compiles,
                "decode_tokens_per_s_1": rate, "decode_runs": rates,
                "weight_bytes": weights, "kv_bytes_per_token": kv_row,
                "bytes_per_token": per_token, "copy_gb_per_s": bw,
                "floor_tokens_per_s": floor, "fraction_of_floor": rate / floor,
            });
            println!("{line}");
        }
        Mode::Measure => {
            let built = Instant::now();
            let mut one = Generator::new(b.model.clone(), b.config(1))?;
            let mut many = Generator::new(b.model.clone(), b.config(args.slots))?;
            let warm_up = built.elapsed();
            let inv =
                |g: &Generator<CharGpt>| g.inventory().prefill.len() + g.inventory().decode.len();
            let compiles = one.inventory().compiles() + many.inventory().compiles();
            let inventory = inv(&one) + inv(&many);
            let after_warm_up = nitro::cache::cache_stats();
            // Greedy text: the two sides must write the same.
            let p32 = b.prompt("prompt32")?;
            let greedy = one.generate(Request::new(p32.clone(), 64))?;
            let greedy_ids: Vec<i32> = greedy.tokens.iter().map(|&t| t as i32).collect();
            let p120 = b.prompt("prompt120")?;
            let p16 = b.prompt("prompt16")?;
            let (mut t32, mut t120, mut d1, mut ds) = (vec![], vec![], vec![], vec![]);
            decode_rate(&mut one, &p16, 1, 8)?;
            decode_rate(&mut many, &p16, args.slots, 8)?;
            for _ in 0..args.rounds {
                t32.push(ttft(&mut one, &p32, 5)?);
                t120.push(ttft(&mut one, &p120, 5)?);
                d1.push(decode_rate(&mut one, &p16, 1, args.tokens)?);
                ds.push(decode_rate(&mut many, &p16, args.slots, args.tokens)?);
            }
            // The mix: prompt lengths across every bucket, temperatures, top-k and top-p,
            // token budgets, more requests than slots.
            let corpus = b.prompt("prompt120")?;
            let mut mixed = 0usize;
            for (i, g) in [&mut one, &mut many].into_iter().enumerate() {
                let count = if i == 0 { 6 } else { 3 * args.slots };
                for r in 0..count {
                    let len = [1, 5, 16, 17, 31, 33, 64, 65, 100, 120][r % 10];
                    let s = Sampling::greedy()
                        .temperature([0.0, 0.5, 1.0, 1.7][r % 4])
                        .top_k([0, 1, 7, 40][(r / 2) % 4])
                        .top_p([1.0, 0.9, 0.5][r % 3])
                        .seed(r as u64);
                    g.submit(Request::new(corpus[..len].to_vec(), 1 + (r * 7) % 40).sampling(s))?;
                    mixed += 1;
                }
                g.run_to_end()?;
            }
            let after_mix = nitro::cache::cache_stats();
            let line = json!({
                "side": "nitro", "mode": "measure", "slots": args.slots,
                "compiles": compiles, "inventory": inventory, "warm_up_ms": ms(warm_up),
                "kv_cache_mb": many.kv_cache_bytes() as f64 / 1e6,
                "greedy_text": b.vocab.decode(&greedy_ids),
                "ttft32_ms": median(t32.clone()), "ttft120_ms": median(t120.clone()),
                "decode_tokens_per_s_1": median(d1.clone()),
                "decode_tokens_per_s_all": median(ds.clone()),
                "runs": {"ttft32": t32, "ttft120": t120, "decode1": d1, "decode_all": ds},
                "mix_requests": mixed,
                "compiles_after_warm_up": after_mix.compiles - after_warm_up.compiles,
                "lookups_after_warm_up": (after_mix.hits + after_mix.misses)
                    - (after_warm_up.hits + after_warm_up.misses),
            });
            println!("{line}");
        }
    }
    Ok(())
}
