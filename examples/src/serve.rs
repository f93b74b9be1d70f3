//! A model served over HTTP with an OpenAI-style completions endpoint: `POST /v1/completions`
//! (whole, or streamed as server-sent events), `GET /v1/models` and `GET /health`.
//!
//! The server is the third layer of generation, outside the library: the library's
//! [`Engine`] runs a [`Generator`] on a thread of its own (the programs, the KV cache, the
//! slots and the queue), and this module puts an HTTP front on it with axum on tokio. It is
//! generic over the model (any [`Decoder`]) and its [`Tokenizer`] (the character
//! vocabulary, [`Vocab`], implements it).
//!
//! The engine's calls block (a submission waits for the engine's thread to take it between
//! decode chunks, a stream waits for its next chunk), so no tokio worker ever makes them: each
//! request gets a thread of its own that submits it and forwards its stream into a tokio
//! channel, which the handler reads (a whole answer) or turns into the response body (a
//! stream). When a client goes away, hyper drops the handler or the body, the channel closes,
//! the request's thread drops its [`Stream`](nitro::generate::Stream), and the engine frees the
//! request's slot (or its place in the queue).
//!
//! Every refusal is a 4xx with a JSON body naming the field (`param`), never a panic:
//!
//! ```json
//! {"error": {"message": "top_p is 1.5; it must be in (0, 1] (1 is off)",
//!            "type": "invalid_request_error", "param": "top_p", "code": null}}
//! ```
//!
//! A request past the engine's queue bound is a 503 (`type` `overloaded_error`, `param`
//! `queue`). `docs/serving.md` is the user's page.

use std::convert::Infallible;
use std::fmt;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use nitro::data::text::Vocab;
use nitro::generate::{
    Decoder, Engine, Generator, Record, Request, Sampling, StopReason, StreamEvent,
};
use serde_json::{json, Map, Value};
use tokio::sync::{mpsc, oneshot};

/// Text to token ids and back: what the server needs of a model's vocabulary.
///
/// `decode` must be consistent with concatenation as far as streaming goes: the text of a
/// request's first `n` tokens is a prefix of the text of its first `n + 1` (true of a
/// character vocabulary). Stop sequences are matched on token ids by the generator, so a stop
/// string must encode to the ids the model generates for it (true of a character vocabulary).
pub trait Tokenizer: Send + Sync + 'static {
    /// The ids of `text`; a character the vocabulary cannot encode is an
    /// [`UnknownCharacter`] naming it.
    fn encode(&self, text: &str) -> Result<Vec<u32>, UnknownCharacter>;

    /// The text of `ids`.
    fn decode(&self, ids: &[u32]) -> String;
}

/// A character of a request's text that the model's vocabulary lacks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownCharacter {
    /// The character.
    pub character: char,
    /// Its position in the text, in characters from 0.
    pub position: usize,
}

impl fmt::Display for UnknownCharacter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "holds the character {:?} (U+{:04X}) at position {}, which the model's vocabulary \
             does not have",
            self.character, self.character as u32, self.position
        )
    }
}

impl std::error::Error for UnknownCharacter {}

/// The character vocabulary of chargpt: one id per character.
impl Tokenizer for Vocab {
    fn encode(&self, text: &str) -> Result<Vec<u32>, UnknownCharacter> {
        let mut buf = [0u8; 4];
        text.chars()
            .enumerate()
            .map(|(position, character)| {
                let id = Vocab::encode(self, character.encode_utf8(&mut buf))
                    .ok()
                    .and_then(|ids| ids.first().copied())
                    .and_then(|id| u32::try_from(id).ok());
                id.ok_or(UnknownCharacter {
                    character,
                    position,
                })
            })
            .collect()
    }

    fn decode(&self, ids: &[u32]) -> String {
        let ids: Vec<i32> = ids
            .iter()
            .map(|&t| i32::try_from(t).unwrap_or(-1))
            .collect();
        Vocab::decode(self, &ids)
    }
}

/// What the server promises its clients, beside the generator's own declaration.
#[derive(Clone, Debug, PartialEq)]
pub struct ServeOptions {
    /// The model's name in `/v1/models` and in every answer.
    pub model: String,
    /// The most tokens one request may ask for; more is refused (`max_tokens`). A request holds
    /// its slot until it ends, so this bounds how long one client can hold one.
    pub max_tokens: usize,
    /// The tokens generated when a request does not say (`max_tokens` absent): 16, as OpenAI's.
    pub default_max_tokens: usize,
    /// The most stop strings a request may give: 4, as OpenAI's.
    pub max_stops: usize,
    /// The tokio worker threads serving HTTP (the generation runs on the engine's thread, and
    /// each request waits on a thread of its own, so few are needed).
    pub workers: usize,
}

impl ServeOptions {
    /// Options for serving `model`: up to 1024 tokens a request, 16 by default, 4 stop strings,
    /// 2 workers.
    pub fn new(model: impl Into<String>) -> ServeOptions {
        ServeOptions {
            model: model.into(),
            max_tokens: 1024,
            default_max_tokens: 16,
            max_stops: 4,
            workers: 2,
        }
    }

    /// With at most `n` tokens a request.
    pub fn max_tokens(mut self, n: usize) -> ServeOptions {
        self.max_tokens = n;
        self
    }
}

/// Why the server could not start.
#[derive(Debug)]
pub enum ServeError {
    /// The address could not be bound or listened on.
    Bind {
        /// The address asked for.
        addr: String,
        /// What the system said.
        source: std::io::Error,
    },
    /// The HTTP runtime or its thread could not start.
    Runtime(std::io::Error),
    /// The generator's engine could not start.
    Engine(nitro::Error),
    /// An option is out of range: which, and why.
    Option {
        /// The option (`max_tokens`, `workers`, …).
        name: &'static str,
        /// What is wrong with it.
        why: String,
    },
}

impl fmt::Display for ServeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ServeError::Bind { addr, source } => write!(f, "cannot listen on {addr}: {source}"),
            ServeError::Runtime(e) => write!(f, "cannot start the HTTP runtime: {e}"),
            ServeError::Engine(e) => write!(f, "cannot start the generator: {e}"),
            ServeError::Option { name, why } => write!(f, "the option {name} {why}"),
        }
    }
}

impl std::error::Error for ServeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ServeError::Bind { source, .. } => Some(source),
            ServeError::Runtime(e) => Some(e),
            ServeError::Engine(e) => Some(e),
            ServeError::Option { .. } => None,
        }
    }
}

/// What the server knows of its model, shown by `/v1/models` and used to check requests.
#[derive(Clone, Debug)]
struct ModelInfo {
    context: usize,
    largest_prompt: usize,
}

/// What every handler shares.
struct Shared<T: Tokenizer> {
    engine: Arc<Engine>,
    tokenizer: T,
    options: ServeOptions,
    info: ModelInfo,
    seeds: AtomicU64,
}

/// A running server: the engine on its thread, the HTTP runtime on another. Dropping it (or
/// [`shutdown`](Server::shutdown)) stops both; requests in flight are cancelled.
pub struct Server {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
    engine: Option<Arc<Engine>>,
}

impl Server {
    /// Serves `generator`'s model on `addr` (`127.0.0.1:0` lets the system pick a port: see
    /// [`addr`](Server::addr)), its texts read and written by `tokenizer`. The address is bound
    /// before this returns, so a client may connect at once.
    pub fn start<E: Decoder + Send, T: Tokenizer>(
        generator: Generator<E>,
        tokenizer: T,
        options: ServeOptions,
        addr: &str,
    ) -> Result<Server, ServeError> {
        if options.max_tokens == 0 || options.max_tokens > i32::MAX as usize {
            return Err(ServeError::Option {
                name: "max_tokens",
                why: format!("is {}: give 1 ..= {}", options.max_tokens, i32::MAX),
            });
        }
        if options.default_max_tokens == 0 || options.default_max_tokens > options.max_tokens {
            return Err(ServeError::Option {
                name: "default_max_tokens",
                why: format!(
                    "is {}: give 1 ..= max_tokens ({})",
                    options.default_max_tokens, options.max_tokens
                ),
            });
        }
        let info = ModelInfo {
            context: generator.decode_shape().context,
            largest_prompt: generator.config().largest_bucket(),
        };
        let bind_error = |source| ServeError::Bind {
            addr: addr.to_owned(),
            source,
        };
        let listener = StdListener::bind(addr).map_err(bind_error)?;
        listener.set_nonblocking(true).map_err(bind_error)?;
        let local = listener.local_addr().map_err(bind_error)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(options.workers.max(1))
            .thread_name("nitro-serve")
            .enable_io()
            .enable_time()
            .build()
            .map_err(ServeError::Runtime)?;
        let listener = {
            let _entered = runtime.enter();
            tokio::net::TcpListener::from_std(listener).map_err(bind_error)?
        };
        let engine = Arc::new(Engine::start(generator).map_err(ServeError::Engine)?);
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let shared = Arc::new(Shared {
            engine: engine.clone(),
            tokenizer,
            options,
            info,
            seeds: AtomicU64::new(seed),
        });
        let app = router(shared);
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("nitro-serve-http".into())
            .spawn(move || {
                runtime.block_on(async move {
                    let serving = tokio::spawn(async move { axum::serve(listener, app).await });
                    // Until the server is told to stop (or dropped, which drops `stop`).
                    let _ = stopped.await;
                    serving.abort();
                });
                // The connections still open are dropped with their tasks: their streams
                // cancel their requests.
                runtime.shutdown_timeout(Duration::from_secs(2));
            })
            .map_err(ServeError::Runtime)?;
        Ok(Server {
            addr: local,
            stop: Some(stop),
            thread: Some(thread),
            engine: Some(engine),
        })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves until the process ends.
    pub fn wait(mut self) {
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }

    /// Stops serving: the listener closes, connections still open are dropped (their requests
    /// cancelled), and the engine's thread ends.
    pub fn shutdown(self) {
        drop(self);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        // The last handle to the engine: its drop waits for the requests in it to end, which
        // their dropped streams cancel. Waited for a while, not for ever: a request a stream
        // still holds (a bug) must not hang the process that drops the server.
        if let Some(engine) = self.engine.take() {
            let (done, ended) = std::sync::mpsc::channel();
            let dropping = std::thread::Builder::new()
                .name("nitro-serve-stop".into())
                .spawn(move || {
                    drop(engine);
                    let _ = done.send(());
                });
            if dropping.is_ok() {
                let _ = ended.recv_timeout(Duration::from_secs(5));
            }
        }
    }
}

/// The routes.
fn router<T: Tokenizer>(shared: Arc<Shared<T>>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models::<T>))
        .route("/v1/completions", post(completions::<T>))
        .fallback(not_found)
        .with_state(shared)
}

async fn health() -> Response {
    json_response(StatusCode::OK, json!({"status": "ok"}))
}

async fn models<T: Tokenizer>(State(shared): State<Arc<Shared<T>>>) -> Response {
    json_response(
        StatusCode::OK,
        json!({
            "object": "list",
            "data": [{
                "id": shared.options.model,
                "object": "model",
                "created": unix_seconds(),
                "owned_by": "nitro",
                "context_length": shared.info.context,
                "max_prompt_tokens": shared.info.largest_prompt,
                "max_tokens": shared.options.max_tokens,
            }],
        }),
    )
}

async fn not_found() -> Response {
    ApiError {
        status: StatusCode::NOT_FOUND,
        kind: "invalid_request_error",
        param: None,
        message: "no such route: the server answers POST /v1/completions, GET /v1/models and \
                  GET /health"
            .into(),
    }
    .into_response()
}

/// A refusal or a failure, as its HTTP answer.
#[derive(Clone, Debug, PartialEq)]
struct ApiError {
    status: StatusCode,
    kind: &'static str,
    param: Option<&'static str>,
    message: String,
}

impl ApiError {
    /// A bad request: 400, naming `param`.
    fn invalid(param: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            param: Some(param),
            message: message.into(),
        }
    }

    /// The server failed (the engine's thread stopped, or the device failed): 500.
    fn server(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            param: None,
            message: message.into(),
        }
    }

    /// The engine refused or failed a submission: a full queue is 503, another refusal 400
    /// naming its field, anything else 500.
    fn from_engine(error: nitro::Error) -> ApiError {
        match error {
            nitro::Error::InvalidRequest {
                field: "queue",
                why,
            } => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                kind: "overloaded_error",
                param: Some("queue"),
                message: format!("the server is busy: every slot is taken and the queue {why}"),
            },
            nitro::Error::InvalidRequest { field, why } => {
                ApiError::invalid(field, format!("{field} {why}"))
            }
            other => ApiError::server(other.to_string()),
        }
    }

    fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": Value::Null,
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        json_response(self.status, self.body())
    }
}

fn json_response(status: StatusCode, body: Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A completion request, checked and tokenized.
#[derive(Debug)]
struct Completion {
    request: Request,
    stream: bool,
    stops: Vec<String>,
}

/// Replaces the bare `NaN`, `Infinity` and `-Infinity` that some encoders write (Python's
/// `json.dumps` does by default) with a marker object, so that a non-finite number is refused
/// naming its field rather than as a malformed body. Text inside strings is left alone.
fn mark_non_finite(body: &str) -> std::borrow::Cow<'_, str> {
    const WORDS: [&str; 3] = ["-Infinity", "Infinity", "NaN"];
    if !WORDS.iter().any(|w| body.contains(w)) {
        return body.into();
    }
    let mut out = String::with_capacity(body.len() + 32);
    let mut in_string = false;
    let mut escaped = false;
    let mut rest = body;
    while let Some(c) = rest.chars().next() {
        if in_string {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
        } else if c == '"' {
            in_string = true;
        } else if let Some(w) = WORDS.iter().find(|w| rest.starts_with(**w)) {
            out.push_str(&format!("{{\"{NON_FINITE}\":\"{w}\"}}"));
            rest = &rest[w.len()..];
            continue;
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out.into()
}

/// The key of the marker object [`mark_non_finite`] writes.
const NON_FINITE: &str = "nitro:non_finite";

/// A number field: `Ok(None)` when absent or null; an error naming it when it is not a number.
fn number(body: &Map<String, Value>, field: &'static str) -> Result<Option<f64>, ApiError> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => Ok(n.as_f64()),
        Some(Value::Object(o)) if o.len() == 1 => match o.get(NON_FINITE).and_then(Value::as_str) {
            Some("NaN") => Ok(Some(f64::NAN)),
            Some("Infinity") => Ok(Some(f64::INFINITY)),
            Some("-Infinity") => Ok(Some(f64::NEG_INFINITY)),
            _ => Err(ApiError::invalid(
                field,
                format!("{field} must be a number"),
            )),
        },
        Some(other) => Err(ApiError::invalid(
            field,
            format!("{field} must be a number, not {}", kind_of(other)),
        )),
    }
}

/// A whole-number field in `0 ..= max`: `Ok(None)` when absent or null.
fn whole(
    body: &Map<String, Value>,
    field: &'static str,
    max: u64,
) -> Result<Option<u64>, ApiError> {
    let Some(x) = number(body, field)? else {
        return Ok(None);
    };
    let exact = body.get(field).and_then(Value::as_u64);
    match exact {
        Some(n) if n <= max => Ok(Some(n)),
        _ => Err(ApiError::invalid(
            field,
            format!("{field} is {x}: give a whole number 0 ..= {max}"),
        )),
    }
}

fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

impl<T: Tokenizer> Shared<T> {
    /// The request in `body`, checked field by field (each refusal names its field); what the
    /// generator checks itself (the prompt's length, the sampling ranges, top-k against the
    /// declared maximum) it refuses when submitted, naming the field the same way.
    fn parse(&self, body: &[u8]) -> Result<Completion, ApiError> {
        let text = std::str::from_utf8(body)
            .map_err(|e| ApiError::invalid("body", format!("the body is not UTF-8: {e}")))?;
        let value: Value = serde_json::from_str(&mark_non_finite(text))
            .map_err(|e| ApiError::invalid("body", format!("the body is not valid JSON: {e}")))?;
        let Value::Object(body) = value else {
            return Err(ApiError::invalid(
                "body",
                format!("the body must be a JSON object, not {}", kind_of(&value)),
            ));
        };
        let prompt = match body.get("prompt") {
            Some(Value::String(s)) => s.as_str(),
            None | Some(Value::Null) => {
                return Err(ApiError::invalid(
                    "prompt",
                    "prompt is missing: give a string",
                ))
            }
            Some(other) => {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("prompt must be a string, not {}", kind_of(other)),
                ))
            }
        };
        if prompt.is_empty() {
            return Err(ApiError::invalid(
                "prompt",
                "prompt is empty: give at least one character",
            ));
        }
        let prompt_ids = self
            .tokenizer
            .encode(prompt)
            .map_err(|e| ApiError::invalid("prompt", format!("prompt {e}")))?;
        if prompt_ids.len() > self.info.largest_prompt {
            return Err(ApiError::invalid(
                "prompt",
                format!(
                    "prompt holds {} tokens, and this server takes at most {} (the model's \
                     context is {})",
                    prompt_ids.len(),
                    self.info.largest_prompt,
                    self.info.context
                ),
            ));
        }
        let limit = self.options.max_tokens;
        let max_tokens = match whole(&body, "max_tokens", u64::MAX)? {
            None => self.options.default_max_tokens,
            Some(n) if n >= 1 && n <= limit as u64 => n as usize,
            Some(n) => {
                return Err(ApiError::invalid(
                    "max_tokens",
                    format!("max_tokens is {n}: this server generates 1 ..= {limit} a request"),
                ))
            }
        };
        let temperature = number(&body, "temperature")?.unwrap_or(1.0);
        if !(temperature.is_finite() && temperature >= 0.0) {
            return Err(ApiError::invalid(
                "temperature",
                format!(
                    "temperature is {temperature}: give a finite number at least 0 (0 is greedy)"
                ),
            ));
        }
        let top_p = number(&body, "top_p")?.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid(
                "top_p",
                format!("top_p is {top_p}: give a number in (0, 1] (1 is off)"),
            ));
        }
        let top_k = whole(&body, "top_k", u64::from(u32::MAX))?.unwrap_or(0) as u32;
        let seed = match whole(&body, "seed", u64::MAX)? {
            Some(s) => s,
            None => {
                let mut mix = crate::SplitMix64(self.seeds.fetch_add(1, Ordering::Relaxed));
                mix.next_u64()
            }
        };
        let stream = match body.get("stream") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(other) => {
                return Err(ApiError::invalid(
                    "stream",
                    format!("stream must be true or false, not {}", kind_of(other)),
                ))
            }
        };
        let stops: Vec<String> = match body.get("stop") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    other => Err(ApiError::invalid(
                        "stop",
                        format!("stop must hold strings, not {}", kind_of(other)),
                    )),
                })
                .collect::<Result<_, _>>()?,
            Some(other) => {
                return Err(ApiError::invalid(
                    "stop",
                    format!(
                        "stop must be a string or a list of strings, not {}",
                        kind_of(other)
                    ),
                ))
            }
        };
        if stops.len() > self.options.max_stops {
            return Err(ApiError::invalid(
                "stop",
                format!(
                    "stop holds {} strings: give at most {}",
                    stops.len(),
                    self.options.max_stops
                ),
            ));
        }
        let mut request = Request::new(prompt_ids, max_tokens).sampling(
            Sampling::greedy()
                .temperature(temperature as f32)
                .top_p(top_p as f32)
                .top_k(top_k)
                .seed(seed),
        );
        for s in &stops {
            if s.is_empty() {
                return Err(ApiError::invalid("stop", "stop holds an empty string"));
            }
            let ids = self
                .tokenizer
                .encode(s)
                .map_err(|e| ApiError::invalid("stop", format!("stop {s:?} {e}")))?;
            request = request.stop(ids);
        }
        // What this server does not do, refused rather than ignored.
        let unsupported = [
            ("n", Value::from(1)),
            ("best_of", Value::from(1)),
            ("echo", Value::from(false)),
        ];
        for (field, default) in unsupported {
            match body.get(field) {
                None | Some(Value::Null) => {}
                Some(v) if *v == default => {}
                Some(v) => {
                    return Err(ApiError::invalid(
                        field,
                        format!("{field} {v} is not supported: leave it out (it is {default})"),
                    ))
                }
            }
        }
        for field in ["logprobs", "suffix"] {
            if !matches!(body.get(field), None | Some(Value::Null)) {
                return Err(ApiError::invalid(
                    field,
                    format!("{field} is not supported: leave it out"),
                ));
            }
        }
        Ok(Completion {
            request,
            stream,
            stops,
        })
    }
}

/// Submits `request` on a thread of its own and forwards its stream into a channel: the
/// request's number, and its events. The thread ends (dropping the stream, which cancels the
/// request) once the request ends or the channel's reader is gone.
async fn submit(
    engine: Arc<Engine>,
    request: Request,
) -> Result<(u64, mpsc::Receiver<StreamEvent>), ApiError> {
    let (accepted, answer) = oneshot::channel();
    let (events, reader) = mpsc::channel::<StreamEvent>(32);
    std::thread::Builder::new()
        .name("nitro-serve-request".into())
        .spawn(move || forward(engine, request, accepted, events))
        .map_err(|e| ApiError::server(format!("cannot start a request's thread: {e}")))?;
    match answer.await {
        Ok(Ok(id)) => Ok((id, reader)),
        Ok(Err(e)) => Err(ApiError::from_engine(e)),
        Err(_) => Err(ApiError::server("the request's thread ended unexpectedly")),
    }
}

/// The request's thread (see [`submit`]).
fn forward(
    engine: Arc<Engine>,
    request: Request,
    accepted: oneshot::Sender<nitro::Result<u64>>,
    events: mpsc::Sender<StreamEvent>,
) {
    let submitted = engine.submit(request);
    drop(engine);
    let mut stream = match submitted {
        Ok(stream) => {
            if accepted.send(Ok(stream.id())).is_err() {
                return; // the client left while it was submitted: the drop cancels it
            }
            stream
        }
        Err(e) => {
            let _ = accepted.send(Err(e));
            return;
        }
    };
    // Looked at a few times a second while nothing comes (a request waiting for a slot), so a
    // client that left is noticed without a token to send.
    let poll = Duration::from_millis(100);
    loop {
        if events.is_closed() {
            return;
        }
        match stream.next_within(poll) {
            Ok(Some(event)) => {
                let last = !matches!(event, StreamEvent::Tokens(_));
                if events.blocking_send(event).is_err() || last {
                    return;
                }
            }
            Ok(None) => {}
            Err(()) => {
                let _ = events.blocking_send(StreamEvent::Failed(
                    "the generator's thread stopped before the request ended".into(),
                ));
                return;
            }
        }
    }
}

/// `POST /v1/completions`.
async fn completions<T: Tokenizer>(State(shared): State<Arc<Shared<T>>>, body: Bytes) -> Response {
    let completion = match shared.parse(&body) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    let (id, events) = match submit(shared.engine.clone(), completion.request).await {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    let text = TextState::new(completion.stops);
    let head = Head {
        id: format!("cmpl-{id}"),
        created: unix_seconds(),
        model: shared.options.model.clone(),
    };
    if completion.stream {
        let body = SseBody {
            shared,
            events,
            text,
            head,
            finished: false,
            done_sent: false,
        };
        Sse::new(body)
            .keep_alive(KeepAlive::new().interval(Duration::from_secs(10)))
            .into_response()
    } else {
        whole_answer(shared, events, head, text).await
    }
}

/// What every answer and chunk of one completion repeats.
#[derive(Clone, Debug)]
struct Head {
    id: String,
    created: u64,
    model: String,
}

impl Head {
    fn chunk(&self, text: &str, finish: Option<&str>) -> Map<String, Value> {
        let value = json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [{
                "text": text,
                "index": 0,
                "logprobs": Value::Null,
                "finish_reason": finish,
            }],
        });
        match value {
            Value::Object(map) => map,
            _ => Map::new(),
        }
    }
}

/// The figures of a finished request: `usage` and `nitro`.
fn figures(map: &mut Map<String, Value>, record: &Record) {
    let completion = record.tokens.len();
    map.insert(
        "usage".into(),
        json!({
            "prompt_tokens": record.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": record.prompt_tokens + completion,
        }),
    );
    map.insert(
        "nitro".into(),
        json!({
            "time_to_first_token_ms": record.time_to_first_token.map(|d| d.as_secs_f64() * 1e3),
            "tokens_per_s": record.tokens_per_s,
            "context_shifts": record.context_shifts,
        }),
    );
}

/// OpenAI's name for why a request ended.
fn finish_reason(stop: StopReason) -> &'static str {
    match stop {
        StopReason::Length => "length",
        StopReason::EndToken | StopReason::StopSequence => "stop",
        StopReason::Cancelled => "cancelled",
    }
}

/// A request's text as its tokens come: what has been sent, and what is held back because it
/// may be the start of a stop string (which the answer leaves out, as OpenAI's does).
#[derive(Debug)]
struct TextState {
    stops: Vec<String>,
    tokens: Vec<u32>,
    sent: usize,
}

impl TextState {
    fn new(stops: Vec<String>) -> TextState {
        TextState {
            stops,
            tokens: Vec::new(),
            sent: 0,
        }
    }

    /// The text to send after `tokens` arrived: the new text but any tail that could begin a
    /// stop string (or is one).
    fn push<T: Tokenizer>(&mut self, tokenizer: &T, tokens: &[u32]) -> String {
        self.tokens.extend_from_slice(tokens);
        let full = tokenizer.decode(&self.tokens);
        let mut safe = full.len();
        for s in &self.stops {
            // The longest prefix of `s` (the whole of it included: the request is ending on
            // it) that the text ends with.
            let cuts = s.char_indices().map(|(i, _)| i).skip(1).chain([s.len()]);
            if let Some(cut) = cuts.filter(|&cut| full.ends_with(&s[..cut])).max() {
                safe = safe.min(full.len() - cut);
            }
        }
        self.take(&full, safe)
    }

    /// The text still to send when the request ended with `record`: the rest, without the
    /// stop string it ended on.
    fn finish<T: Tokenizer>(&mut self, tokenizer: &T, record: &Record) -> String {
        let full = tokenizer.decode(&record.tokens);
        let mut end = full.len();
        if record.stop == StopReason::StopSequence {
            if let Some(s) = self.stops.iter().find(|s| full.ends_with(s.as_str())) {
                end = full.len() - s.len();
            }
        }
        self.take(&full, end)
    }

    fn take(&mut self, full: &str, end: usize) -> String {
        let start = self.sent.min(end);
        let piece = full.get(start..end).unwrap_or_default().to_owned();
        self.sent = self.sent.max(end);
        piece
    }
}

/// A non-streaming answer: the events read to the end, one JSON object.
async fn whole_answer<T: Tokenizer>(
    shared: Arc<Shared<T>>,
    mut events: mpsc::Receiver<StreamEvent>,
    head: Head,
    mut text: TextState,
) -> Response {
    loop {
        match events.recv().await {
            Some(StreamEvent::Tokens(_)) => {}
            Some(StreamEvent::Done(record)) => {
                let all = text.finish(&shared.tokenizer, &record);
                let mut map = head.chunk(&all, Some(finish_reason(record.stop)));
                figures(&mut map, &record);
                return json_response(StatusCode::OK, Value::Object(map));
            }
            Some(StreamEvent::Failed(why)) => return ApiError::server(why).into_response(),
            None => {
                return ApiError::server("the request ended without its record").into_response()
            }
        }
    }
}

/// The body of a streamed answer: a `data:` event per chunk of tokens, the last with the
/// finish reason and the figures, then `data: [DONE]`. Dropped (the client went away), it drops
/// the channel, and the request's thread cancels the request.
struct SseBody<T: Tokenizer> {
    shared: Arc<Shared<T>>,
    events: mpsc::Receiver<StreamEvent>,
    text: TextState,
    head: Head,
    finished: bool,
    done_sent: bool,
}

impl<T: Tokenizer> futures_core::Stream for SseBody<T> {
    type Item = Result<SseEvent, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            if this.finished {
                if this.done_sent {
                    return Poll::Ready(None);
                }
                this.done_sent = true;
                return Poll::Ready(Some(Ok(SseEvent::default().data("[DONE]"))));
            }
            let event = match this.events.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(event) => event,
            };
            let data = match event {
                Some(StreamEvent::Tokens(tokens)) => {
                    let piece = this.text.push(&this.shared.tokenizer, &tokens);
                    if piece.is_empty() {
                        continue; // all held back: nothing to send yet
                    }
                    Value::Object(this.head.chunk(&piece, None))
                }
                Some(StreamEvent::Done(record)) => {
                    this.finished = true;
                    let piece = this.text.finish(&this.shared.tokenizer, &record);
                    let mut map = this.head.chunk(&piece, Some(finish_reason(record.stop)));
                    figures(&mut map, &record);
                    Value::Object(map)
                }
                Some(StreamEvent::Failed(why)) => {
                    this.finished = true;
                    ApiError::server(why).body()
                }
                None => {
                    this.finished = true;
                    ApiError::server("the request ended without its record").body()
                }
            };
            return Poll::Ready(Some(Ok(SseEvent::default().data(data.to_string()))));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_numbers_are_marked_outside_strings_only() {
        let body = r#"{"prompt": "NaN Infinity \"NaN\"", "temperature": NaN, "top_p": -Infinity}"#;
        let marked = mark_non_finite(body);
        let v: Value = serde_json::from_str(&marked).unwrap();
        let map = v.as_object().unwrap();
        assert_eq!(map["prompt"], json!("NaN Infinity \"NaN\""));
        assert!(number(map, "temperature").unwrap().unwrap().is_nan());
        assert_eq!(number(map, "top_p").unwrap(), Some(f64::NEG_INFINITY));
    }

    #[test]
    fn the_vocabulary_names_an_unknown_character() {
        let v = Vocab::of("abc ");
        assert_eq!(Tokenizer::encode(&v, "ab c").unwrap().len(), 4);
        let e = Tokenizer::encode(&v, "abé").unwrap_err();
        assert_eq!(
            e,
            UnknownCharacter {
                character: 'é',
                position: 2
            }
        );
        assert!(e.to_string().contains("'é'"), "{e}");
    }

    #[test]
    fn a_stop_string_is_held_back_and_left_out() {
        let v = Vocab::of("abcxyz");
        let ids = |s: &str| Tokenizer::encode(&v, s).unwrap();
        let mut t = TextState::new(vec!["yz".into()]);
        assert_eq!(t.push(&v, &ids("ab")), "ab");
        assert_eq!(t.push(&v, &ids("cy")), "c"); // "y" may start "yz"
        assert_eq!(t.push(&v, &ids("a")), "ya"); // it did not
        let mut all = ids("abcya");
        all.extend(ids("xyz"));
        let record = Record {
            id: 0,
            tokens: all,
            stop: StopReason::StopSequence,
            prompt_tokens: 1,
            time_to_first_token: None,
            elapsed: Duration::ZERO,
            tokens_per_s: 0.0,
            context_shifts: 0,
        };
        assert_eq!(t.push(&v, &ids("x")), "x");
        assert_eq!(t.push(&v, &ids("y")), "");
        assert_eq!(t.finish(&v, &record), "");
        assert_eq!(t.sent, "abcyax".len());
    }
}
