//! A character-level GPT (decoder-only transformer: token and position embeddings, pre-norm
//! causal blocks from `nitro::nn`, a final norm and a linear head) trained through the training
//! handle on the `fortunes` corpus (Debian package), reporting held-out bits per character
//! against the corpus's unigram entropy — the bar a model that learned nothing would reach.
//!
//! Defaults: 4 blocks, width 128, 4 heads, context 128, dropout 0.1 (the in-graph RNG: a new
//! key every step, never a recompile), AdamW with a cosine schedule, 1000 steps of 16 windows.
//! `--sample N` then generates N characters from `--prompt`, with `--temperature` and
//! `--top-k`, through the evaluation program only: a fixed-length window, so generating compiles
//! nothing. `--checkpoint PATH` saves the run — a checkpoint directory, each device's shards a
//! part of their own, or one file for a path ending in `.safetensors` — (and with
//! `--save-every N`, every N steps while it trains, in the background); `--resume PATH`
//! continues one, on any `--mesh`.
//!
//! Measured here (2 cores, CPU XLA): the defaults train in 116 s to 2.90 held-out bits per
//! character (the corpus's unigram entropy is 4.76).
//!
//! `--layers N --scan` runs the N blocks as one scan over stacked parameters
//! (`nitro::nn::Repeated`), so the gradient program holds one block and compiles in about the
//! time of one whatever N; without `--scan` they are unrolled. `--remat` (with `--scan`)
//! recomputes each block in the reverse pass instead of saving its intermediates.
//!
//! Every flag is checked before anything compiles (`nitro_examples::chargpt::Args`): a setting
//! that cannot train, an output path that cannot be written, a `--context` beyond the corpus or
//! a `--steps` beyond memory is one sentence naming the flag, and exit status 1. `--check`
//! prints the preflight and exits (`--json`: as one JSON line).
//!
//! `cargo run --release -p nitro-examples --example chargpt [-- --steps N --layers N --scan --sample N --json]`

use clap::Parser;
use nitro::cache;
use nitro::checkpoint::Saved;
use nitro::data::buckets::{padding_waste, plan_edges, Buckets, Overflow, Ragged};
use nitro::data::{text, Dataset};
use nitro::optim::AdamW;
use nitro::prelude::*;
use nitro::train::{Config, FromBatch, Nitro};
use nitro_examples::chargpt::{self, Args, CharGpt, InitOn, SampleMode, Windows};
use nitro_examples::report::{available_memory, exit_status, install_log, peak_rss_mb, Summary};
use nitro_examples::twin;
use serde_json::json;

/// Whole documents under shape buckets (`--buckets K`).
struct Documents {
    train: Ragged,
    val: Ragged,
    buckets: Buckets,
    /// Padded positions under the buckets, and under one program at the largest edge.
    waste: f64,
    waste_one: f64,
    /// Batches of one epoch.
    steps: usize,
}

/// The fortunes as documents: the last tenth held out; about `--steps` batches' worth of
/// training documents (a token budget of `--batch × --context` per batch), drawn with the seed;
/// K edges planned over their lengths capped at `--context`, longer documents truncated.
fn documents(
    args: &Args,
    vocab: &text::Vocab,
    replicas: usize,
) -> Result<Documents, Box<dyn std::error::Error>> {
    let records = text::fortune_records(args.data.as_deref())?;
    let mut docs: Vec<Vec<i32>> = records
        .iter()
        .map(|r| vocab.encode(r))
        .collect::<nitro::Result<_>>()?;
    let held = docs.split_off(docs.len() * 9 / 10);
    let t = args.context;
    let tokens = |d: &Vec<i32>| d.len().saturating_sub(1).min(t);
    let take = |docs: &[Vec<i32>], order: &[usize], budget: usize| -> Vec<Vec<i32>> {
        let mut out = Vec::new();
        let mut total = 0;
        for &i in order {
            if total >= budget {
                break;
            }
            if docs[i].len() >= 2 {
                total += tokens(&docs[i]);
                out.push(docs[i].clone());
            }
        }
        out
    };
    let order = nitro::data::permutation(docs.len(), args.seed);
    let budget = args.steps.saturating_mul(args.batch).saturating_mul(t);
    let train = Ragged::next_token(&take(&docs, &order, budget))?;
    let val_order: Vec<usize> = (0..held.len()).collect();
    let val = Ragged::next_token(&take(
        &held,
        &val_order,
        args.batch.saturating_mul(4).saturating_mul(t),
    ))?;
    if train.rows() == 0 || val.rows() == 0 {
        return Err(format!(
            "--buckets {}: the corpus has no fortune of 2 or more characters in its {} (of {} \
             fortunes, the last tenth held out); pass a larger corpus (--data DIR)",
            args.buckets,
            if train.rows() == 0 {
                "training part"
            } else {
                "held-out last tenth"
            },
            records.len()
        )
        .into());
    }
    let capped: Vec<usize> = train.lengths().iter().map(|&l| l.min(t)).collect();
    let edges = plan_edges(&capped, args.buckets)?.edges;
    let buckets = Buckets::new(edges.iter().copied())?
        .token_budget(args.batch * t)
        .overflow(Overflow::Truncate);
    let steps = train
        .epoch_batches(
            &buckets,
            |e| buckets.rows_for(e, args.batch, replicas),
            args.seed,
            0,
        )?
        .len();
    Ok(Documents {
        waste: padding_waste(&capped, &edges)?,
        waste_one: padding_waste(&capped, &[t])?,
        train,
        val,
        buckets,
        steps,
    })
}

/// Random windows of the fortunes (without `--buckets`): `--steps × --batch` for training from
/// the first nine tenths, `4 × --batch` held out from the last tenth, and their starts.
struct Drawn {
    train: Dataset,
    val: Dataset,
    train_starts: Vec<usize>,
    val_starts: Vec<usize>,
}

/// What the run trains on: random windows, or whole documents under shape buckets.
enum Data {
    Windows(Drawn),
    Documents(Documents),
}

impl Data {
    /// The documents of a `--buckets` run.
    fn documents(&self) -> Option<&Documents> {
        match self {
            Data::Documents(d) => Some(d),
            Data::Windows(_) => None,
        }
    }
}

/// The experiment `args` describe over a vocabulary of `vocab` characters (its initial
/// weights fixed by --seed: every call makes the same).
fn make_experiment(args: &Args, vocab: usize) -> CharGpt {
    // The model is declared by its types; the layer library's rules create its values from
    // --seed, here on the host or with --init device on the devices: the same model either way.
    let mut experiment = nitro::init::declared(|| CharGpt::new(&args.shape(), vocab));
    if args.init == InitOn::Host {
        nitro::train::initialize_on_host(&mut experiment, nitro::init::layer_defaults(), args.seed)
            .expect("the layer library's rules create every parameter of chargpt");
    }
    if args.remat {
        experiment.arch.stack = experiment
            .arch
            .stack
            .map(|blocks| blocks.remat(nitro::trace::Remat::Recompute));
    }
    experiment
}

/// The windows of `ids` at `starts` as one `i32 [n, T + 1]` array (inputs, then the last target).
fn window_array(ids: &[i32], starts: &[usize], t: usize) -> nitro::Result<Array> {
    let mut out = Vec::with_capacity(starts.len() * (t + 1));
    for &s in starts {
        out.extend_from_slice(&ids[s..s + t + 1]);
    }
    Array::from_vec(&[starts.len(), t + 1], out)
}

fn main() -> std::process::ExitCode {
    exit_status("chargpt", try_main())
}

fn try_main() -> Result<(), Box<dyn std::error::Error>> {
    let started = std::time::Instant::now();
    install_log();
    let args = Args::parse();
    // Everything that can be refused is refused here, before the corpus is read or anything
    // compiles: a run must not be lost at its end to a flag that could never work.
    args.validate()?;
    let say = |line: String| {
        if !args.run.json {
            println!("{line}");
        }
    };
    let corpus = text::fortunes(args.data.as_deref())?;
    let vocab = text::Vocab::of(&corpus);
    let ids = vocab.encode(&corpus)?;
    // The last tenth is held out, as one contiguous piece.
    let cut = ids.len() * 9 / 10;
    let (train_ids, held) = ids.split_at(cut);
    args.check_corpus(train_ids.len(), held.len())?;
    args.check_prompt(&vocab)?;
    args.check_memory(available_memory())?;
    let config = Config::new()
        .batch(args.batch)
        .epochs(1)
        .seed(args.seed)
        .concurrent_compiles(!args.run.serial_compiles)
        .progress(!args.run.json);
    // A `model` axis in --mesh splits the blocks Megatron-style along it.
    let mut config = chargpt::with_tensor_parallel(args.run.apply_layout(config)?, args.scan);
    if let (n @ 1.., Some(path)) = (args.save_every, &args.checkpoint) {
        config = config.save_every(n, path);
    }
    if args.init == InitOn::Device {
        config = config.initialize_all(nitro::init::layer_defaults());
    }
    // With --warm-up: the model's shape is known, so its programs load (or compile) and run
    // once on a thread of their own while the windows are drawn and the bundle written (not
    // for buckets, whose shapes come from the data, nor for the preflight, which must compile
    // nothing).
    let warm = (args.run.warm_up && !args.run.check && args.buckets == 0).then(|| {
        let windows = || Array::zeros(DType::I32, &[args.batch, args.context]);
        Nitro::warm_up(
            make_experiment(&args, vocab.len()),
            chargpt::optimizer(),
            config.clone(),
            Windows {
                x: windows(),
                y: windows(),
                valid: None,
            },
            true,
        )
    });
    let unigram = text::unigram_bits(train_ids);
    // The devices the handle runs on (a mesh, or --devices), not the process's default.
    let backend = config.backend()?;
    say(format!(
        "data     fortunes: {} characters, vocabulary {}, unigram {unigram:.3} bits/char",
        ids.len(),
        vocab.len()
    ));
    say(format!("backend  {}", backend.identity().description));
    say(format!(
        "model    {} blocks{}, width {}, {} heads, context {}, dropout {}, adamw, peak lr {}, {} steps of {}",
        args.layers,
        match (args.scan, args.remat) {
            (true, true) => " (one scan, recomputed in the reverse pass)",
            (true, false) => " (one scan)",
            _ => " (unrolled)",
        },
        args.width, args.heads, args.context, args.dropout, args.lr, args.steps, args.batch
    ));
    let data = if args.buckets > 0 {
        let d = documents(&args, &vocab, config.row_multiple()?)?;
        say(format!(
            "buckets  {:?} over {} documents (lengths capped at {}): {:.1}% padding, against {:.1}% with one program at {}",
            d.buckets.edges(),
            d.train.rows(),
            args.context,
            100.0 * d.waste,
            100.0 * d.waste_one,
            args.context
        ));
        config = config.buckets(d.buckets.clone());
        Data::Documents(d)
    } else {
        let (train, train_starts) = chargpt::random_windows(
            train_ids,
            args.context,
            args.steps.saturating_mul(args.batch),
            args.seed,
        )?;
        let (val, val_starts) = chargpt::random_windows(
            held,
            args.context,
            args.batch.saturating_mul(4),
            args.seed.wrapping_add(1),
        )?;
        Data::Windows(Drawn {
            train,
            val,
            train_starts,
            val_starts,
        })
    };
    let steps = data.documents().map_or(args.steps, |d| d.steps) as u64;
    let config = config.schedule(chargpt::schedule(args.lr, steps));
    let made = std::time::Instant::now();
    let experiment = make_experiment(&args, vocab.len());
    let host_init = made.elapsed();
    let optimizer = chargpt::optimizer();
    if let Some(dir) = &args.run.twin {
        let schedule = chargpt::schedule(args.lr, steps);
        let adam = optimizer.adam;
        let mut run = json!({
            "model": "chargpt",
            "steps": steps,
            "batch": args.batch,
            "seed": args.seed,
            "schedule": {"base": schedule.base, "min": schedule.min,
                         "warmup": schedule.warmup, "total": schedule.total},
            "adam": {"beta1": adam.beta1, "beta2": adam.beta2, "eps": adam.eps},
            "weight_decay": optimizer.weight_decay,
            "decayed": twin::decayed_leaves(&experiment, |p| optimizer.decays(p)),
            "dropout": args.dropout,
            "layers": args.layers,
            "scan": args.scan,
            "width": args.width,
            "heads": args.heads,
            "context": args.context,
            "vocab": vocab.len(),
            "ln_eps": experiment.arch.norm.eps,
            "precision": args.run.precision.to_string(),
            "loss_scaling": args.run.precision.loss_scaling().map(|s| json!({
                "initial": s.initial, "growth_interval": s.growth_interval,
            })),
        });
        let written = match &data {
            Data::Documents(d) => {
                let rows_for = |e| d.buckets.rows_for(e, args.batch, 1);
                let plan = d.train.epoch_batches(&d.buckets, rows_for, args.seed, 0)?;
                let bucket_rows: serde_json::Map<String, serde_json::Value> = d
                    .buckets
                    .edges()
                    .iter()
                    .map(|&e| (e.to_string(), json!(rows_for(e))))
                    .collect();
                run["buckets"] = json!(d.buckets.edges());
                run["bucket_rows"] = json!(bucket_rows);
                twin::write_ragged(
                    dir,
                    &experiment,
                    &run,
                    [("train", &d.train), ("val", &d.val)],
                    &plan,
                    d.buckets.edges(),
                )
            }
            Data::Windows(w) => {
                let rows = twin::step_rows(&w.train, args.batch, args.seed, 1)?;
                let windows = window_array(train_ids, &w.train_starts, args.context)?;
                let held_windows = window_array(held, &w.val_starts, args.context)?;
                twin::write(
                    dir,
                    &experiment,
                    &run,
                    &rows,
                    &[("train", &windows), ("val", &held_windows)],
                )
            }
        };
        written.map_err(|e| format!("--twin {}: cannot write the bundle: {e}", dir.display()))?;
        say(format!(
            "twin     bundle for bench/twin_chargpt.py in {}",
            dir.display()
        ));
    }
    // The warm-up has done its work before the handle looks its programs up (it would
    // otherwise wait for the same lookups, and run its first step beside ours).
    let warm_up_ms = match warm.map(nitro::train::WarmUp::wait) {
        Some(Ok(report)) => Some(report.took.as_secs_f64() * 1e3),
        Some(Err(e)) => {
            eprintln!("chargpt: {e}");
            None
        }
        None => None,
    };
    let handle_at = started.elapsed();
    // The process before the handle: the baseline of the memory floor the FSDP bench prints.
    let rss_before_handle = peak_rss_mb();
    let mut run = match &args.resume {
        Some(path) => {
            let saved = Saved::open(path)
                .map_err(|e| format!("--resume {}: cannot read it: {e}", path.display()))?;
            let mut run = Nitro::resume(experiment, optimizer, config, saved)?;
            // A resumed run trains one more pass of --steps.
            run.set_epochs(run.epochs_done() as usize + 1);
            run
        }
        None => Nitro::new(experiment, optimizer, config)?,
    };
    if args.run.check {
        let mut plan = match &data {
            Data::Documents(d) => run.plan_buckets(&d.train, true)?,
            Data::Windows(w) => {
                let rows: Vec<usize> = (0..args.batch).collect();
                run.plan(
                    &Windows::from_batch(w.train.gather(&rows, args.batch)?)?,
                    true,
                )?
            }
        };
        if args.sample > 0 && args.sample_mode == SampleMode::Cache {
            // The generator's programs too: a prefill per prompt bucket, a decode per chunk.
            let generating = nitro::generate::Generator::plan(
                run.experiment()?,
                &generate_config(&args, vocab.len()),
                nitro::backend::current()?,
                nitro::cache::global(),
            )?;
            plan.entries.extend(generating.entries);
        }
        args.run.print_plan("chargpt", &plan);
        return Ok(());
    }
    let fit_started = std::time::Instant::now();
    let history = match &data {
        Data::Documents(d) => run.fit_ragged(&d.train, Some(&d.val))?,
        Data::Windows(w) => run.fit(&w.train, Some(&w.val))?,
    };
    let fit_s = fit_started.elapsed().as_secs_f64();
    // The run is saved first: nothing after training may lose it. A background save still
    // writing (--save-every) finishes first, so the last file written is the final state.
    let background = run
        .wait_saved()
        .map_err(|e| format!("--save-every: a background save failed: {e}"))?;
    let saves = background.or_else(|| run.last_save().cloned());
    if let Some(path) = &args.checkpoint {
        run.save(path)
            .map_err(|e| format!("--checkpoint {}: cannot save the run: {e}", path.display()))?;
    }
    // The real positions trained: every document's (capped at the largest edge), or every
    // window's.
    let real_positions: usize = match &data {
        Data::Documents(d) => {
            let largest = d.buckets.largest();
            d.train.lengths().iter().map(|&l| l.min(largest)).sum()
        }
        Data::Windows(w) => w.train.rows() * args.context,
    };
    say(history.to_string());
    let stats = cache::cache_stats();
    say(format!("cache    {stats}"));
    cache::assert_no_recompile_after_warmup()?;
    say("no recompile after warm-up: ok".into());
    if let Some(path) = &args.run.manifest {
        run.manifest()
            .write(path)
            .map_err(|e| format!("--manifest {}: cannot write it: {e}", path.display()))?;
        say(format!("manifest {}", path.display()));
    }
    let last = history.epochs.last().ok_or("no epoch ran")?;
    let val_bits = last.val_loss.unwrap_or(f64::NAN) / std::f64::consts::LN_2;
    say(format!(
        "held out {val_bits:.3} bits/char (unigram {unigram:.3})"
    ));
    if let Some(path) = &args.checkpoint {
        say(format!("saved    {}", path.display()));
    }
    let mut generated = None;
    if args.sample > 0 {
        match args.sample_mode {
            SampleMode::Recompute => {
                let started = std::time::Instant::now();
                let text = sample(&mut run, &vocab, &args, data.documents().is_some())?;
                let s = started.elapsed().as_secs_f64();
                say(format!(
                    "sample   {text:?} ({:.1} chars/s, recomputing the window)",
                    args.sample as f64 / s
                ));
                generated = Some(json!({
                    "mode": "recompute",
                    "decode_tokens_per_s": args.sample as f64 / s,
                }));
            }
            SampleMode::Cache => {
                let g = generate(&mut run, &vocab, &args)?;
                for text in &g.texts {
                    say(format!("sample   {text:?}"));
                }
                say(format!(
                    "generate {} compiles, first token {:.1} ms, {:.0} tokens/s decoding \
                     ({} slots), KV cache {:.2} MB",
                    g.compiles, g.ttft_ms, g.decode_tokens_per_s, args.slots, g.kv_cache_mb
                ));
                generated = Some(json!({
                    "mode": "cache",
                    "ttft_ms": g.ttft_ms,
                    "decode_tokens_per_s": g.decode_tokens_per_s,
                    "generate_compiles": g.compiles,
                    "kv_cache_mb": g.kv_cache_mb,
                    "slots": args.slots,
                }));
            }
        }
    }
    let docs = data.documents();
    let summary = Summary::new("chargpt", backend)
        .history(&history)
        .cache(&stats)
        .first_step(run.first_step_time())
        .field("layers", args.layers)
        .field("scan", args.scan)
        .field("remat", args.remat)
        .field("val_bits_per_char", val_bits)
        .field("unigram_bits_per_char", unigram)
        .handle(last, run.program_times())
        .warm_floor(
            run.first_step_time(),
            last,
            run.program_times(),
            run.first_runs(),
        )
        .layout(&run)
        .field("loss_scale", json!(run.loss_scale()?))
        .field("inventory", run.declared_inventory(true))
        .field("padding_waste", docs.map_or(0.0, |d| d.waste))
        .field("padding_waste_one_program", docs.map(|d| d.waste_one))
        .field("real_positions", real_positions)
        .field("tokens_per_s", real_positions as f64 / fit_s)
        .field(
            "tokens_per_s_steady",
            real_positions as f64 / (last.step_us_pipelined * last.steps as f64 / 1e6),
        )
        .field("buckets", docs.map(|d| d.buckets.edges().to_vec()))
        .field("fit_s", fit_s)
        .field(
            "save_ms",
            saves.as_ref().map(|s| s.write.as_secs_f64() * 1e3),
        )
        .field(
            "save_copy_ms",
            saves.as_ref().map(|s| s.copy.as_secs_f64() * 1e3),
        )
        .field(
            "step_ms_saving",
            last.step_us_median_saving.map(|us| us / 1e3),
        )
        .field("warm_up_ms", warm_up_ms)
        .field("init", format!("{:?}", args.init).to_lowercase())
        .field("rss_before_handle_mb", rss_before_handle)
        .field(
            "init_ms",
            match (args.init, &args.resume) {
                (_, Some(_)) => None,
                (InitOn::Host, None) => Some(host_init.as_secs_f64() * 1e3),
                (InitOn::Device, None) => run.creation_time().map(|t| t.as_secs_f64() * 1e3),
            },
        )
        .field(
            "first_step_since_start_ms",
            run.first_step_time()
                .map(|t| (handle_at + t).as_secs_f64() * 1e3),
        )
        .field("process_s", started.elapsed().as_secs_f64());
    let summary = match &generated {
        Some(g) => summary
            .field("ttft_ms", g.get("ttft_ms").cloned())
            .field("decode_tokens_per_s", g["decode_tokens_per_s"].clone())
            .field("generate_compiles", g.get("generate_compiles").cloned())
            .field("kv_cache_mb", g.get("kv_cache_mb").cloned())
            .field("sample_mode", g["mode"].clone()),
        None => summary,
    };
    println!("{summary}");
    Ok(())
}

/// The generator `--sample` declares: `--slots` slots, prompt buckets of powers of two from 16
/// up to the context, decode chunks of 16 steps, top-k up to `--top-k`.
fn generate_config(args: &Args, vocab: usize) -> nitro::generate::GenerateConfig {
    let mut buckets: Vec<usize> = (4..)
        .map(|p| 1usize << p)
        .take_while(|&b| b < args.context)
        .collect();
    buckets.push(args.context);
    nitro::generate::GenerateConfig::new()
        .slots(args.slots)
        .buckets(buckets)
        .chunks([16])
        .max_top_k(args.top_k.clamp(1, vocab))
}

/// What `--sample` through the generator made and measured.
struct Generated {
    texts: Vec<String>,
    compiles: usize,
    ttft_ms: f64,
    decode_tokens_per_s: f64,
    kv_cache_mb: f64,
}

/// Generates `--sample` characters after `--prompt` in each of `--slots` slots at once, through
/// the generator: its programs got up front (prompt buckets of powers of two up to the context,
/// decode chunks of 16), a KV cache on the device, sampling there.
fn generate(
    run: &mut Nitro<CharGpt, AdamW>,
    vocab: &text::Vocab,
    args: &Args,
) -> Result<Generated, Box<dyn std::error::Error>> {
    use nitro::generate::{Generator, Request, Sampling};
    let experiment = run.experiment()?.clone();
    let mut g = Generator::new(experiment, generate_config(args, vocab.len()))?;
    let prompt: Vec<u32> = vocab
        .encode(&args.prompt)?
        .iter()
        .map(|&t| t as u32)
        .collect();
    // The prompt's tail, when it is longer than the context.
    let prompt = prompt[prompt.len().saturating_sub(args.context)..].to_vec();
    for slot in 0..args.slots {
        let sampling = Sampling::greedy()
            .temperature(args.temperature as f32)
            .top_k(args.top_k as u32)
            .top_p(args.top_p as f32)
            .seed(args.seed.wrapping_add(7 + slot as u64));
        g.submit(Request::new(prompt.clone(), args.sample).sampling(sampling))?;
    }
    let started = std::time::Instant::now();
    let mut records = g.run_to_end()?;
    let wall = started.elapsed().as_secs_f64();
    records.sort_by_key(|r| r.id);
    let ttft = records
        .iter()
        .filter_map(|r| r.time_to_first_token)
        .min()
        .unwrap_or_default();
    let tokens: usize = records.iter().map(|r| r.tokens.len()).sum();
    let decode_s = (wall - ttft.as_secs_f64()).max(1e-9);
    let texts = records
        .iter()
        .map(|r| {
            let ids: Vec<i32> = r.tokens.iter().map(|&t| t as i32).collect();
            format!("{}{}", args.prompt, vocab.decode(&ids))
        })
        .collect();
    Ok(Generated {
        texts,
        compiles: g.inventory().compiles(),
        ttft_ms: ttft.as_secs_f64() * 1e3,
        decode_tokens_per_s: tokens.saturating_sub(records.len()) as f64 / decode_s,
        kv_cache_mb: g.kv_cache_bytes() as f64 / 1e6,
    })
}

/// Generates `--sample` characters after `--prompt`: each through the evaluation program on a
/// full batch of fixed-length windows (row 0 holds the text, left-padded), so nothing compiles.
fn sample(
    run: &mut Nitro<CharGpt, AdamW>,
    vocab: &text::Vocab,
    args: &Args,
    bucketed: bool,
) -> Result<String, Box<dyn std::error::Error>> {
    let (t, b) = (args.context, args.batch);
    let mut ids = vocab.encode(&args.prompt)?;
    let mut rng = nitro::init::Rng::new(nitro::init::Seed(args.seed.wrapping_add(7)));
    let pad = ids.first().copied().unwrap_or(0);
    for _ in 0..args.sample {
        let tail: Vec<i32> = ids.iter().rev().take(t).rev().copied().collect();
        let mut row = vec![pad; t - tail.len()];
        row.extend(&tail);
        let mut x = row.clone();
        x.resize(b * t, pad);
        let batch = Windows {
            x: Array::from_vec(&[b, t], x.clone())?,
            y: Array::from_vec(&[b, t], x)?,
            // A bucketed model's programs take the position mask: its largest edge is the
            // context, so the prediction is that bucket's evaluation program.
            valid: bucketed.then(|| Array::full(&[b, t], 1.0f32)),
        };
        let logits = run.predict(&batch)?;
        let v = vocab.len();
        let all = logits.as_slice::<f32>()?;
        let last = &all[(t - 1) * v..t * v];
        let mut order: Vec<usize> = (0..v).collect();
        order.sort_by(|&i, &j| last[j].total_cmp(&last[i]));
        let keep = if args.top_k == 0 {
            v
        } else {
            args.top_k.min(v)
        };
        let top = &order[..keep];
        let max = last[top[0]] as f64;
        let weights: Vec<f64> = top
            .iter()
            .map(|&i| ((last[i] as f64 - max) / args.temperature.max(1e-6)).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let mut pick = rng.next_f64() * total;
        let mut chosen = top[0];
        for (&i, w) in top.iter().zip(&weights) {
            if pick < *w {
                chosen = i;
                break;
            }
            pick -= w;
        }
        ids.push(chosen as i32);
    }
    Ok(vocab.decode(&ids))
}
