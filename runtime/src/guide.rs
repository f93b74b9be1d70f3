//! The user guide in `docs/`, compiled as doctests: every ```rust block of every page is
//! compiled (and run, unless marked `no_run`) by `cargo test -p nitro-xla --doc`, so the guide
//! cannot drift from the API.
#![cfg(doctest)]

/// `docs/README.md`: the guide's index.
#[doc = include_str!("../../docs/README.md")]
pub struct Index;

/// `docs/getting-started.md`.
#[doc = include_str!("../../docs/getting-started.md")]
pub struct GettingStarted;

/// `docs/roles.md`.
#[doc = include_str!("../../docs/roles.md")]
pub struct Roles;

/// `docs/content-hash.md`.
#[doc = include_str!("../../docs/content-hash.md")]
pub struct ContentHashPage;

/// `docs/trees.md`.
#[doc = include_str!("../../docs/trees.md")]
pub struct Trees;

/// `docs/experiment.md`.
#[doc = include_str!("../../docs/experiment.md")]
pub struct ExperimentPage;

/// `docs/layers.md`.
#[doc = include_str!("../../docs/layers.md")]
pub struct Layers;

/// `docs/loops.md`.
#[doc = include_str!("../../docs/loops.md")]
pub struct Loops;

/// `docs/your-data.md`.
#[doc = include_str!("../../docs/your-data.md")]
pub struct YourData;

/// `docs/weights.md`.
#[doc = include_str!("../../docs/weights.md")]
pub struct Weights;

/// `docs/buckets.md`.
#[doc = include_str!("../../docs/buckets.md")]
pub struct Buckets;

/// `docs/tracing.md`.
#[doc = include_str!("../../docs/tracing.md")]
pub struct Tracing;

/// `docs/backends.md`.
#[doc = include_str!("../../docs/backends.md")]
pub struct Backends;

/// `docs/cache.md`.
#[doc = include_str!("../../docs/cache.md")]
pub struct CachePage;

/// `docs/troubleshooting.md`.
#[doc = include_str!("../../docs/troubleshooting.md")]
pub struct Troubleshooting;

/// `docs/cli.md`.
#[doc = include_str!("../../docs/cli.md")]
pub struct Cli;

/// `docs/sharing.md`.
#[doc = include_str!("../../docs/sharing.md")]
pub struct Sharing;

/// `docs/data.md`.
#[doc = include_str!("../../docs/data.md")]
pub struct Data;

/// `docs/training.md`.
#[doc = include_str!("../../docs/training.md")]
pub struct Training;

/// `docs/checkpoints.md`.
#[doc = include_str!("../../docs/checkpoints.md")]
pub struct Checkpoints;

/// `docs/comparison.md`.
#[doc = include_str!("../../docs/comparison.md")]
pub struct Comparison;

/// `docs/devices.md`.
#[doc = include_str!("../../docs/devices.md")]
pub struct Devices;

/// `docs/examples.md`.
#[doc = include_str!("../../docs/examples.md")]
pub struct Examples;

/// `docs/stages.md`.
#[doc = include_str!("../../docs/stages.md")]
pub struct Stages;

/// `docs/generation.md`.
#[doc = include_str!("../../docs/generation.md")]
pub struct Generation;

/// `docs/serving.md`.
#[doc = include_str!("../../docs/serving.md")]
pub struct Serving;

/// `docs/internals.md`.
#[doc = include_str!("../../docs/internals.md")]
pub struct Internals;
