//! The completions server (`nitro_examples::serve`) on loopback, with a small randomly
//! initialised character GPT on the interpreter, talked to by a real HTTP client (`ureq`) and,
//! where a client must vanish mid-answer, by a bare socket: whole and streamed answers agree and
//! depend on the seed alone, streams read at once from several threads equal the same requests
//! alone, stop strings end a request and are left out, a client that disconnects frees its
//! slot, requests past the slots queue and all complete, past the queue bound a 503, and every
//! bad request a 400 whose JSON names the field — after which the server still answers.
//!
//! No assertion is timed: the timeouts only turn a hang into a failure.
#![allow(missing_docs)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use nitro::cache::Cache;
use nitro::data::text::Vocab;
use nitro::generate::{GenerateConfig, Generator};
use nitro_examples::chargpt::{CharGpt, GptShape};
use nitro_examples::serve::{ServeOptions, Server};
use serde_json::{json, Value};

/// Long enough that nothing waits this long unless something is wedged.
const PATIENCE: Duration = Duration::from_secs(120);

/// More tokens than a test ever waits for: a request that only ends when its client leaves.
const ENDLESS: usize = 1_000_000;

const CHARS: &str = "abcdefghijklmnopqrstuvwxyz ,.!?'\n";

fn vocab() -> Vocab {
    Vocab::of(CHARS)
}

/// A server of a fresh chargpt (width 32, 2 blocks, context 64) with `slots` slots and room
/// for `queue` waiting requests, prompt buckets up to the context, decode chunks of 4 and top-k
/// up to 8.
fn start(slots: usize, queue: usize) -> Server {
    let shape = GptShape {
        layers: 2,
        width: 32,
        heads: 4,
        context: 64,
        dropout: 0.0,
        seed: 5,
        scan: false,
    };
    let model = CharGpt::new(&shape, vocab().len());
    let config = GenerateConfig::new()
        .slots(slots)
        .buckets([16, 64])
        .chunks([4])
        .max_top_k(8)
        .queue(queue);
    let cache = Cache::in_memory(16);
    let generator =
        Generator::with_backend(model, config, nitro::backend::interpreter(), &cache).unwrap();
    let options = ServeOptions::new("chargpt-test").max_tokens(ENDLESS);
    Server::start(generator, vocab(), options, "127.0.0.1:0").unwrap()
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(PATIENCE))
        .build()
        .into()
}

fn url(addr: SocketAddr, path: &str) -> String {
    format!("http://{addr}{path}")
}

/// A request's status, content type and JSON body.
fn answer(mut response: ureq::http::Response<ureq::Body>) -> (u16, String, Value) {
    let status = response.status().as_u16();
    let kind = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let text = response.body_mut().read_to_string().unwrap();
    let body = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("status {status}: the body is not JSON ({e}): {text}"));
    (status, kind, body)
}

fn post(addr: SocketAddr, body: &str) -> (u16, Value) {
    let response = agent()
        .post(url(addr, "/v1/completions"))
        .header("content-type", "application/json")
        .send(body)
        .unwrap();
    let (status, kind, body) = answer(response);
    assert_eq!(kind, "application/json", "{body}");
    (status, body)
}

fn get(addr: SocketAddr, path: &str) -> (u16, Value) {
    let (status, _, body) = answer(agent().get(url(addr, path)).call().unwrap());
    (status, body)
}

/// A whole completion: its text and answer (asserted a 200).
fn complete(addr: SocketAddr, request: &Value) -> (String, Value) {
    let (status, body) = post(addr, &request.to_string());
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "text_completion");
    let text = body["choices"][0]["text"].as_str().unwrap().to_owned();
    (text, body)
}

/// A streamed completion read to `[DONE]`: its text (the chunks' texts joined) and its last
/// chunk (the finish reason and the figures). Every chunk but the last has no finish reason.
fn stream(addr: SocketAddr, request: &Value) -> (String, Value) {
    let mut request = request.clone();
    request["stream"] = json!(true);
    let response = agent()
        .post(url(addr, "/v1/completions"))
        .header("content-type", "application/json")
        .send(request.to_string())
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let kind = response.headers().get("content-type").unwrap();
    assert_eq!(kind.to_str().unwrap(), "text/event-stream");
    let reader = BufReader::new(response.into_body().into_reader());
    let mut chunks: Vec<Value> = Vec::new();
    let mut done = false;
    for line in reader.lines() {
        let line = line.unwrap();
        let Some(data) = line.strip_prefix("data: ") else {
            continue; // blank separators and keep-alive comments
        };
        assert!(!done, "data after [DONE]: {data}");
        if data == "[DONE]" {
            done = true;
            continue;
        }
        chunks.push(serde_json::from_str(data).unwrap());
    }
    assert!(done, "the stream ended without [DONE]");
    let last = chunks.pop().expect("a final chunk");
    let mut text = String::new();
    for c in &chunks {
        assert_eq!(c["object"], "text_completion");
        assert!(c["choices"][0]["finish_reason"].is_null(), "{c}");
        text.push_str(c["choices"][0]["text"].as_str().unwrap());
    }
    assert!(last["choices"][0]["finish_reason"].is_string(), "{last}");
    text.push_str(last["choices"][0]["text"].as_str().unwrap());
    (text, last)
}

/// A streamed request on a bare socket, its response head read (so the request is in the
/// engine: a slot or the queue). Dropping the socket is a client going away.
fn open_stream(addr: SocketAddr, request: &Value) -> BufReader<TcpStream> {
    let mut request = request.clone();
    request["stream"] = json!(true);
    let body = request.to_string();
    let mut socket = TcpStream::connect(addr).unwrap();
    socket.set_read_timeout(Some(PATIENCE)).unwrap();
    write!(
        socket,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reader = BufReader::new(socket);
    let mut status = String::new();
    reader.read_line(&mut status).unwrap();
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        if line == "\r\n" || line.is_empty() {
            return reader;
        }
    }
}

/// Reads a bare stream until its first token chunk: its request holds a slot.
fn first_tokens(reader: &mut BufReader<TcpStream>) {
    loop {
        let mut line = String::new();
        let n = reader.read_line(&mut line).unwrap();
        assert!(n > 0, "the stream ended before its first tokens");
        if line.contains("\"text_completion\"") {
            return;
        }
    }
}

fn sampled(prompt: &str, max_tokens: usize, seed: u64) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.9, "seed": seed})
}

#[test]
fn health_models_and_unknown_routes() {
    let server = start(1, 4);
    let addr = server.addr();
    assert_eq!(get(addr, "/health"), (200, json!({"status": "ok"})));
    let (status, models) = get(addr, "/v1/models");
    assert_eq!(status, 200);
    assert_eq!(models["data"][0]["id"], "chargpt-test");
    assert_eq!(models["data"][0]["context_length"], 64);
    assert_eq!(models["data"][0]["max_prompt_tokens"], 64);
    let (status, body) = get(addr, "/v2/nothing");
    assert_eq!(status, 404);
    assert_eq!(body["error"]["type"], "invalid_request_error");
}

/// A completion whole and streamed: the same text for the same seed, the figures filled in,
/// and another seed another text.
#[test]
fn whole_and_streamed_answers_agree_and_follow_the_seed() {
    let server = start(2, 4);
    let addr = server.addr();
    let request = json!({"prompt": "the cat ", "max_tokens": 20, "temperature": 0.9,
                         "top_k": 6, "top_p": 0.9, "seed": 7});
    let (text, body) = complete(addr, &request);
    assert_eq!(text.chars().count(), 20, "{text:?}");
    assert!(text.chars().all(|c| CHARS.contains(c)), "{text:?}");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["choices"][0]["index"], 0);
    assert!(body["id"].as_str().unwrap().starts_with("cmpl-"), "{body}");
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": 8, "completion_tokens": 20, "total_tokens": 28})
    );
    assert!(body["nitro"]["time_to_first_token_ms"].as_f64().unwrap() >= 0.0);
    assert!(body["nitro"]["tokens_per_s"].as_f64().unwrap() >= 0.0);
    assert_eq!(body["nitro"]["context_shifts"], 0);

    let (again, _) = complete(addr, &request);
    assert_eq!(again, text, "the same seed gave another text");
    let (streamed, last) = stream(addr, &request);
    assert_eq!(streamed, text, "streamed and whole differ");
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["usage"], body["usage"]);

    let others: Vec<String> = (1..4)
        .map(|seed| {
            let mut r = request.clone();
            r["seed"] = json!(seed);
            complete(addr, &r).0
        })
        .collect();
    assert!(
        others.iter().any(|t| *t != text),
        "four seeds gave one text: {text:?}"
    );
}

/// A stop string ends the request where the text first holds it, and is left out of the
/// answer, whole or streamed (the stream held back what might have begun it).
#[test]
fn a_stop_string_ends_the_request_and_is_left_out() {
    let server = start(1, 4);
    let addr = server.addr();
    let greedy = json!({"prompt": "hello there", "max_tokens": 24, "temperature": 0});
    let (text, _) = complete(addr, &greedy);
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[6..8].iter().collect();
    let first = text.find(&stop).unwrap();
    let mut request = greedy.clone();
    request["stop"] = json!(["zzzz", stop]);
    let (whole, body) = complete(addr, &request);
    assert_eq!(whole, text[..first], "stop {stop:?} in {text:?}");
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    let (streamed, last) = stream(addr, &request);
    assert_eq!(streamed, whole);
    assert_eq!(last["choices"][0]["finish_reason"], "stop");
    // One string, not a list, works too.
    request["stop"] = json!(stop);
    assert_eq!(complete(addr, &request).0, whole);
}

/// Six requests of different prompts, lengths and settings streamed at once from six threads
/// through two slots (four wait in the queue): each text equals the same request's alone.
#[test]
fn concurrent_streams_equal_their_requests_alone() {
    let server = start(2, 8);
    let addr = server.addr();
    let requests: Vec<Value> = (0..6u64)
        .map(|i| {
            let prompt = [
                "a",
                "the ",
                "once upon a time, ",
                "why?",
                "x",
                "hello world\n",
            ];
            let mut r = sampled(prompt[i as usize], 8 + 3 * i as usize, 100 + i);
            if i % 2 == 1 {
                r["top_k"] = json!(4);
                r["top_p"] = json!(0.8);
            }
            r
        })
        .collect();
    let alone: Vec<String> = requests.iter().map(|r| complete(addr, r).0).collect();
    let together: Vec<String> = std::thread::scope(|s| {
        let readers: Vec<_> = requests
            .iter()
            .map(|r| s.spawn(move || stream(addr, r).0))
            .collect();
        readers.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(together, alone);
    for (text, r) in alone.iter().zip(&requests) {
        assert_eq!(
            text.chars().count(),
            r["max_tokens"].as_u64().unwrap() as usize
        );
    }
}

/// With one slot: a client that leaves mid-stream (a request that would otherwise run for a
/// million tokens) frees the slot, so the next request completes.
#[test]
fn a_client_that_disconnects_frees_its_slot() {
    let server = start(1, 4);
    let addr = server.addr();
    let mut held = open_stream(addr, &sampled("abc", ENDLESS, 1));
    first_tokens(&mut held);
    drop(held);
    let (text, body) = complete(addr, &sampled("abc", 5, 2));
    assert_eq!(text.chars().count(), 5);
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    // And once more: the slot is free again after an ordinary request too.
    let mut held = open_stream(addr, &sampled("xyz", ENDLESS, 3));
    first_tokens(&mut held);
    let mut rest = [0u8; 256];
    let _ = held.read(&mut rest).unwrap();
    drop(held);
    assert_eq!(complete(addr, &sampled("x", 3, 4)).0.chars().count(), 3);
    // A client waiting for a whole answer that leaves: its request ends too.
    let body = sampled("abc", ENDLESS, 5).to_string();
    let mut socket = TcpStream::connect(addr).unwrap();
    write!(
        socket,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Not an assertion: time for the request to reach its slot before the client leaves
    // (it is freed either way).
    std::thread::sleep(Duration::from_millis(200));
    drop(socket);
    assert_eq!(complete(addr, &sampled("x", 3, 6)).0.chars().count(), 3);
}

/// One slot and a queue of one: a request in the slot, one waiting, and the next refused with
/// a 503 whose JSON says why — until the clients leave, when requests run again.
#[test]
fn past_the_queue_bound_a_503() {
    let server = start(1, 1);
    let addr = server.addr();
    let mut running = open_stream(addr, &sampled("abc", ENDLESS, 1));
    first_tokens(&mut running);
    let waiting = open_stream(addr, &sampled("def", ENDLESS, 2));
    for stream in [false, true] {
        let mut r = sampled("ghi", 4, 3);
        r["stream"] = json!(stream);
        let (status, body) = post(addr, &r.to_string());
        assert_eq!(status, 503, "{body}");
        assert_eq!(body["error"]["type"], "overloaded_error");
        assert_eq!(body["error"]["param"], "queue");
        assert!(body["error"]["message"].as_str().unwrap().contains("busy"));
    }
    drop(running);
    drop(waiting);
    // Both left: once the server notices (the next write to each fails), the slot and the
    // queue are free again, and a request runs. Retried while busy, as a client would.
    let request = sampled("ghi", 4, 3).to_string();
    let started = std::time::Instant::now();
    let body = loop {
        let (status, body) = post(addr, &request);
        if status != 503 {
            assert_eq!(status, 200, "{body}");
            break body;
        }
        assert!(
            started.elapsed() < PATIENCE,
            "still busy: the slot stayed held"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = body["choices"][0]["text"].as_str().unwrap();
    assert_eq!(text.chars().count(), 4);
}

/// Every bad request is a 400 whose JSON names the field; none wedges a slot (the one slot
/// still serves afterwards).
#[test]
fn bad_requests_name_their_field() {
    let server = start(1, 4);
    let addr = server.addr();
    let long = "a".repeat(65);
    let five_stops = json!(["a", "b", "c", "d", "e"]);
    let cases: Vec<(String, &str)> = vec![
        ("{\"prompt\": \"abc\"".into(), "body"),
        ("not json".into(), "body"),
        ("[1, 2]".into(), "body"),
        (json!({"max_tokens": 4}).to_string(), "prompt"),
        (json!({"prompt": ""}).to_string(), "prompt"),
        (json!({"prompt": 17}).to_string(), "prompt"),
        (json!({"prompt": "caf\u{e9}"}).to_string(), "prompt"),
        (json!({"prompt": "ABC"}).to_string(), "prompt"),
        (json!({"prompt": long}).to_string(), "prompt"),
        (
            json!({"prompt": "a", "max_tokens": 0}).to_string(),
            "max_tokens",
        ),
        (
            json!({"prompt": "a", "max_tokens": -1}).to_string(),
            "max_tokens",
        ),
        (
            json!({"prompt": "a", "max_tokens": 2.5}).to_string(),
            "max_tokens",
        ),
        (
            json!({"prompt": "a", "max_tokens": "9"}).to_string(),
            "max_tokens",
        ),
        (
            json!({"prompt": "a", "max_tokens": 1_000_001}).to_string(),
            "max_tokens",
        ),
        (
            json!({"prompt": "a", "max_tokens": 1e30}).to_string(),
            "max_tokens",
        ),
        (
            json!({"prompt": "a", "temperature": -0.5}).to_string(),
            "temperature",
        ),
        (
            "{\"prompt\": \"a\", \"temperature\": NaN}".into(),
            "temperature",
        ),
        (
            "{\"prompt\": \"a\", \"temperature\": Infinity}".into(),
            "temperature",
        ),
        (
            json!({"prompt": "a", "temperature": "hot"}).to_string(),
            "temperature",
        ),
        (json!({"prompt": "a", "top_p": 0}).to_string(), "top_p"),
        (json!({"prompt": "a", "top_p": 1.5}).to_string(), "top_p"),
        (json!({"prompt": "a", "top_p": -0.2}).to_string(), "top_p"),
        ("{\"prompt\": \"a\", \"top_p\": NaN}".into(), "top_p"),
        (json!({"prompt": "a", "top_k": 9}).to_string(), "top_k"),
        (json!({"prompt": "a", "top_k": -1}).to_string(), "top_k"),
        (json!({"prompt": "a", "seed": -3}).to_string(), "seed"),
        (json!({"prompt": "a", "stop": 5}).to_string(), "stop"),
        (json!({"prompt": "a", "stop": ["b", 3]}).to_string(), "stop"),
        (json!({"prompt": "a", "stop": ""}).to_string(), "stop"),
        (json!({"prompt": "a", "stop": "\u{e9}"}).to_string(), "stop"),
        (
            json!({"prompt": "a", "stop": five_stops}).to_string(),
            "stop",
        ),
        (
            json!({"prompt": "a", "stream": "yes"}).to_string(),
            "stream",
        ),
        (json!({"prompt": "a", "n": 2}).to_string(), "n"),
        (
            json!({"prompt": "a", "logprobs": 1}).to_string(),
            "logprobs",
        ),
        (
            json!({"prompt": "\u{e9}", "stream": true}).to_string(),
            "prompt",
        ),
        (
            json!({"prompt": "a", "top_k": 9, "stream": true}).to_string(),
            "top_k",
        ),
    ];
    for (body, field) in &cases {
        let (status, answer) = post(addr, body);
        assert_eq!(status, 400, "{body}: {answer}");
        let error = &answer["error"];
        assert_eq!(error["type"], "invalid_request_error", "{body}: {answer}");
        assert_eq!(error["param"], *field, "{body}: {answer}");
        let message = error["message"].as_str().unwrap();
        assert!(!message.is_empty(), "{body}: {answer}");
    }
    // The unknown character is named.
    let (_, answer) = post(addr, &json!({"prompt": "caf\u{e9}"}).to_string());
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(message.contains("'\u{e9}'"), "{message}");
    // Nothing was left holding the one slot.
    let (text, _) = complete(addr, &sampled("abc", 6, 9));
    assert_eq!(text.chars().count(), 6);
}
