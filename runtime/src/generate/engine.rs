//! A generator on a thread of its own, for callers on other threads: each submits a request
//! and reads its tokens as a stream, chunk by chunk, while the generator decodes every slot at
//! once. Dropping a stream cancels its request and frees its slot.

use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::Duration;

use super::{Decoder, Event, Generator, Record, Request, RequestId};
use crate::error::{Error, Result};

/// What a [`Stream`] yields: new tokens of its request, then its record.
#[derive(Clone, Debug, PartialEq)]
pub enum StreamEvent {
    /// The request's next tokens, in order.
    Tokens(Vec<u32>),
    /// The request ended: its record (the stream yields nothing after it).
    Done(Record),
    /// The generator failed while the request was in it (a device error): what it said. The
    /// stream yields nothing after it.
    Failed(String),
}

/// What a caller asks the engine's thread.
enum Command {
    Submit(Request, Sender<Result<(RequestId, Receiver<StreamEvent>)>>),
    Cancel(RequestId),
    Stop,
}

/// A [`Generator`] running on a thread of its own: callers on other threads submit requests
/// and read their tokens as [`Stream`]s while it decodes every slot at once.
///
/// ```no_run
/// # use nitro::generate::{Decoder, Engine, Generator, Request, StreamEvent};
/// # fn serve<E: Decoder + Send>(g: Generator<E>) -> nitro::Result<()> {
/// let engine = Engine::start(g)?;
/// let stream = engine.submit(Request::new(vec![1, 2, 3], 64))?;
/// for event in stream {
///     match event {
///         StreamEvent::Tokens(t) => print!("{t:?}"),
///         StreamEvent::Done(record) => println!(" ({:?})", record.stop),
///         StreamEvent::Failed(why) => eprintln!("failed: {why}"),
///     }
/// }
/// # Ok(()) }
/// ```
pub struct Engine {
    commands: Sender<Command>,
    thread: Option<JoinHandle<()>>,
}

/// One request's tokens as they come (an iterator of [`StreamEvent`]s). Dropped before its
/// end, it cancels the request, and the request's slot is free at once.
pub struct Stream {
    id: RequestId,
    events: Receiver<StreamEvent>,
    commands: Sender<Command>,
    ended: bool,
}

impl Stream {
    /// The request's number in its generator.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// The next event, waiting at most `timeout`: `Ok(None)` when none came in time,
    /// `Err(())` once the stream has ended.
    #[allow(clippy::result_unit_err)]
    pub fn next_within(
        &mut self,
        timeout: Duration,
    ) -> std::result::Result<Option<StreamEvent>, ()> {
        if self.ended {
            return Err(());
        }
        match self.events.recv_timeout(timeout) {
            Ok(event) => {
                self.ended = !matches!(event, StreamEvent::Tokens(_));
                Ok(Some(event))
            }
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => {
                self.ended = true;
                Err(())
            }
        }
    }

    /// Reads the stream to its end: every token, and the record.
    pub fn collect_all(mut self) -> Result<Record> {
        loop {
            match self.next() {
                Some(StreamEvent::Done(record)) => return Ok(record),
                Some(StreamEvent::Failed(why)) => {
                    return Err(Error::Misconfigured { message: why })
                }
                Some(StreamEvent::Tokens(_)) => {}
                None => {
                    return Err(Error::Misconfigured {
                        message: "the generator's thread ended before the request did".into(),
                    })
                }
            }
        }
    }
}

impl Iterator for Stream {
    type Item = StreamEvent;

    fn next(&mut self) -> Option<StreamEvent> {
        if self.ended {
            return None;
        }
        let event = self.events.recv().ok();
        self.ended = !matches!(event, Some(StreamEvent::Tokens(_)));
        event
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if !self.ended {
            let _ = self.commands.send(Command::Cancel(self.id));
        }
    }
}

impl Engine {
    /// Starts `generator` on a thread of its own.
    pub fn start<E: Decoder + Send>(generator: Generator<E>) -> Result<Engine> {
        let (commands, inbox) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("nitro-generate".into())
            .spawn(move || run(generator, inbox))
            .map_err(|e| Error::Misconfigured {
                message: format!("cannot start the generator's thread: {e}"),
            })?;
        Ok(Engine {
            commands,
            thread: Some(thread),
        })
    }

    /// Queues `request` (checked as [`Generator::submit`] checks it, with its errors): its
    /// stream.
    pub fn submit(&self, request: Request) -> Result<Stream> {
        let (reply, answer) = mpsc::channel();
        self.commands
            .send(Command::Submit(request, reply))
            .map_err(|_| stopped())?;
        let (id, events) = answer.recv().map_err(|_| stopped())??;
        Ok(Stream {
            id,
            events,
            commands: self.commands.clone(),
            ended: false,
        })
    }
}

impl Drop for Engine {
    /// Stops the thread after the requests in it end (streams still read are cancelled by
    /// their drops).
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Stop);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn stopped() -> Error {
    Error::Misconfigured {
        message: "the generator's thread has stopped".into(),
    }
}

/// The engine's thread: takes commands (waiting for one while nothing is pending), then runs a
/// step and hands each stream its events.
fn run<E: Decoder>(mut generator: Generator<E>, inbox: Receiver<Command>) {
    let mut streams: HashMap<RequestId, Sender<StreamEvent>> = HashMap::new();
    let mut stopping = false;
    loop {
        // Wait for a command while idle; take what is there while busy.
        let first = match generator.busy() {
            false if stopping => return,
            false => match inbox.recv() {
                Ok(c) => Some(c),
                Err(_) => return,
            },
            true => inbox.try_recv().ok(),
        };
        let mut next = first;
        while let Some(command) = next {
            match command {
                Command::Submit(request, reply) => {
                    let answer = match stopping {
                        true => Err(stopped()),
                        false => generator.submit(request).map(|id| {
                            let (tx, rx) = mpsc::channel();
                            streams.insert(id, tx);
                            (id, rx)
                        }),
                    };
                    let _ = reply.send(answer);
                }
                Command::Cancel(id) => {
                    streams.remove(&id);
                    generator.cancel(id);
                }
                Command::Stop => stopping = true,
            }
            next = inbox.try_recv().ok();
        }
        if !generator.busy() {
            continue;
        }
        match generator.step() {
            Ok(events) => {
                for event in events {
                    let (id, event) = match event {
                        Event::Tokens { id, tokens } => (id, StreamEvent::Tokens(tokens)),
                        Event::Finished(record) => (record.id, StreamEvent::Done(record)),
                    };
                    let done = !matches!(event, StreamEvent::Tokens(_));
                    let gone = streams.get(&id).is_none_or(|s| s.send(event).is_err());
                    if done {
                        streams.remove(&id);
                    } else if gone {
                        // Nobody reads it any more: its slot is freed at once.
                        streams.remove(&id);
                        generator.cancel(id);
                    }
                }
            }
            Err(e) => {
                let why = e.to_string();
                for (id, stream) in streams.drain() {
                    let _ = stream.send(StreamEvent::Failed(why.clone()));
                    generator.cancel(id);
                }
            }
        }
    }
}
