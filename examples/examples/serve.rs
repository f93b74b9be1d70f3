//! Serves the character GPT over HTTP with an OpenAI-style completions endpoint
//! (`nitro_examples::serve`; docs/serving.md is the user's page).
//!
//! The model is a chargpt checkpoint (`--checkpoint PATH`, written by `--example chargpt
//! --checkpoint PATH` with the same shape flags), or else trained here for `--steps` steps on
//! the fortunes. Its vocabulary is the fortunes' characters, as chargpt's is.
//!
//! ```sh
//! cargo run --release -p nitro-examples --example serve -- --steps 300 --addr 127.0.0.1:8080
//! curl -s 127.0.0.1:8080/v1/completions -d '{"prompt": "The ", "max_tokens": 64, "seed": 1}'
//! ```

use std::path::PathBuf;

use clap::Parser;
use nitro::checkpoint::Saved;
use nitro::data::text;
use nitro::generate::{GenerateConfig, Generator};
use nitro::train::{Config, Nitro};
use nitro_examples::chargpt::{self, CharGpt, GptShape};
use nitro_examples::report::{exit_status, install_log};
use nitro_examples::serve::{ServeOptions, Server};
use nitro_examples::{at_least_one, check_checkpoint_input, FlagError};

/// The command line.
#[derive(Parser, Debug)]
#[command(
    name = "serve",
    about = "Serves the character GPT over HTTP: POST /v1/completions (OpenAI-style, streamed \
             with \"stream\": true), GET /v1/models, GET /health."
)]
struct Args {
    /// The address to listen on (port 0: the system picks one, printed at start).
    #[arg(long, default_value = "127.0.0.1:8080")]
    addr: String,
    /// A chargpt checkpoint (file or directory) to serve; its shape flags must be the ones
    /// chargpt was given. Without it the model is trained here for --steps steps.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Training steps when no --checkpoint is given.
    #[arg(long, default_value_t = 300)]
    steps: usize,
    /// The directory of the fortune files (default: the Debian package's).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Transformer blocks.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// Model width.
    #[arg(long, default_value_t = 128)]
    width: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Context length.
    #[arg(long, default_value_t = 128)]
    context: usize,
    /// The blocks as one scan over stacked parameters (as chargpt --scan).
    #[arg(long)]
    scan: bool,
    /// Dropout while training (chargpt's default; part of the model's shape, so a checkpoint
    /// needs the value it was trained with).
    #[arg(long, default_value_t = 0.1)]
    dropout: f64,
    /// Windows per training step.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// The seed of the initial weights and the training windows.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The most requests decoded at once (the KV cache's rows).
    #[arg(long, default_value_t = 4)]
    slots: usize,
    /// Prompt-length buckets, comma-separated (default: powers of two from 16 up to the
    /// context, and the context): the longest prompt served is the largest.
    #[arg(long, value_delimiter = ',')]
    buckets: Vec<usize>,
    /// Decode chunk sizes, comma-separated: a stream gets tokens this many at a time.
    #[arg(long, value_delimiter = ',', default_value = "8")]
    chunk: Vec<usize>,
    /// The most requests waiting for a slot; past it a request is refused with a 503.
    #[arg(long, default_value_t = 64)]
    queue: usize,
    /// The largest top_k a request may ask for.
    #[arg(long, default_value_t = 64)]
    max_top_k: usize,
    /// The most tokens one request may ask for.
    #[arg(long, default_value_t = 1024)]
    max_tokens: usize,
    /// The model's name in answers and /v1/models.
    #[arg(long, default_value = "chargpt")]
    model: String,
}

impl Args {
    /// Refuses, before anything is read or compiled, what cannot serve.
    fn validate(&self) -> Result<(), FlagError> {
        at_least_one("--slots", self.slots, "the slots")?;
        at_least_one("--queue", self.queue, "the queue")?;
        at_least_one("--max-top-k", self.max_top_k, "the largest top-k")?;
        at_least_one("--max-tokens", self.max_tokens, "the most tokens a request")?;
        at_least_one("--context", self.context, "the context")?;
        at_least_one("--width", self.width, "the width")?;
        at_least_one("--heads", self.heads, "the heads")?;
        if !self.width.is_multiple_of(self.heads) {
            return Err(FlagError::new(
                "--heads",
                self.heads,
                format!("the heads must divide the width ({})", self.width),
            ));
        }
        if let Some(&b) = self.buckets.iter().find(|&&b| b == 0 || b > self.context) {
            return Err(FlagError::new(
                "--buckets",
                b,
                format!("each bucket must be 1 ..= the context ({})", self.context),
            ));
        }
        if self.chunk.contains(&0) {
            return Err(FlagError::new(
                "--chunk",
                0,
                "each chunk must be at least 1",
            ));
        }
        match &self.checkpoint {
            Some(path) => check_checkpoint_input("--checkpoint", path),
            None => at_least_one("--steps", self.steps, "the training steps"),
        }
    }

    fn shape(&self) -> GptShape {
        GptShape {
            layers: self.layers,
            width: self.width,
            heads: self.heads,
            context: self.context,
            dropout: self.dropout,
            seed: self.seed,
            scan: self.scan,
        }
    }

    fn buckets(&self) -> Vec<usize> {
        if !self.buckets.is_empty() {
            return self.buckets.clone();
        }
        let mut b: Vec<usize> = (4..)
            .map(|p| 1usize << p)
            .take_while(|&b| b < self.context)
            .collect();
        b.push(self.context);
        b
    }
}

fn main() -> std::process::ExitCode {
    exit_status("serve", try_main())
}

fn try_main() -> Result<(), Box<dyn std::error::Error>> {
    install_log();
    let args = Args::parse();
    args.validate()?;
    let corpus = text::fortunes(args.data.as_deref())?;
    let vocab = text::Vocab::of(&corpus);
    let mut experiment = CharGpt::new(&args.shape(), vocab.len());
    match &args.checkpoint {
        Some(path) => {
            let checkpoint = match Saved::open(path)? {
                Saved::Whole(c) => c,
                Saved::Directory(dir) => dir.load()?,
            };
            let step = checkpoint.step();
            checkpoint.restore_into(&mut experiment).map_err(|e| {
                format!(
                    "--checkpoint {}: {e} (give the shape flags chargpt was run with)",
                    path.display()
                )
            })?;
            println!("model    {} (step {step})", path.display());
        }
        None => {
            let ids = vocab.encode(&corpus)?;
            let count = args.steps * args.batch;
            let (train, _) = chargpt::random_windows(&ids, args.context, count, args.seed)?;
            let config = Config::new()
                .batch(args.batch)
                .epochs(1)
                .seed(args.seed)
                .schedule(chargpt::schedule(args.lr, args.steps as u64));
            let mut run = Nitro::new(experiment, chargpt::optimizer(), config)?;
            let history = run.fit(&train, None)?;
            if let Some(last) = history.epochs.last() {
                println!(
                    "model    trained {} steps: loss {:.3} bits/char",
                    args.steps,
                    last.train_loss / std::f64::consts::LN_2
                );
            }
            experiment = run.experiment()?.clone();
        }
    }
    let config = GenerateConfig::new()
        .slots(args.slots)
        .buckets(args.buckets())
        .chunks(args.chunk.iter().copied())
        .queue(args.queue)
        .max_top_k(args.max_top_k);
    let generator = Generator::new(experiment, config)?;
    let inventory = generator.inventory();
    println!(
        "programs {} prefill, {} decode ({} compiled, {:.0} ms); KV cache {:.1} MB",
        inventory.prefill.len(),
        inventory.decode.len(),
        inventory.compiles(),
        inventory.warm_up.as_secs_f64() * 1e3,
        generator.kv_cache_bytes() as f64 / 1e6
    );
    let options = ServeOptions::new(args.model.clone()).max_tokens(args.max_tokens);
    let server = Server::start(generator, vocab, options, &args.addr)?;
    println!(
        "serving  http://{}/v1/completions ({} slots, queue {})",
        server.addr(),
        args.slots,
        args.queue
    );
    server.wait();
    Ok(())
}
