//! A pool's worker: one confirm channel, its publishes in flight and their evidence.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};

use lapin::BasicProperties;
use lapin::options::BasicPublishOptions;
use lapin::types::ShortString;
use lapin::{Channel, Confirmation, PublisherConfirm};
use lily_mq_core::transport::{Confirm, HandoffResult, InFlight, Retired, Seq};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::link::{BLOCKED_POLL, Gate, Link, PROBE_ROUTE};
use super::request::{Copy, Request, Route};
use crate::sync::lock;

/// A worker: publishes the requests it is given on its confirm channel as they come, without
/// waiting for earlier ones' confirms, and answers each once [`InFlight`] judged it.
pub(super) async fn work(
    link: Arc<Link>,
    mut requests: mpsc::UnboundedReceiver<Request>,
    closed: CancellationToken,
) {
    let mut worker = Worker {
        link,
        held: VecDeque::new(),
        pipe: None,
        probing: None,
        cleared: false,
    };
    let mut open = true;
    // Made once, not once per turn of the loop: each would register anew.
    let mut cancelled = std::pin::pin!(closed.cancelled());
    let mut timer = std::pin::pin!(tokio::time::sleep_until(Instant::now()));
    let mut armed = None;
    loop {
        let wake_at = worker.wake_at();
        if wake_at != armed {
            if let Some(at) = wake_at {
                timer.as_mut().reset(at);
            }
            armed = wake_at;
        }
        let pipe_woken = worker.pipe.as_ref().map(|pipe| Arc::clone(&pipe.wakes));
        if worker.can_publish() {
            // A probe judged, or a channel dropped, while the last turn published: go on now,
            // for nothing else may wake the worker before the held requests' deadline.
            tokio::task::consume_budget().await;
        } else {
            tokio::select! {
                biased;
                () = &mut cancelled => break,
                () = async { pipe_woken.as_ref().expect("guarded").notify.notified().await },
                    if pipe_woken.is_some() => {}
                request = requests.recv(), if open => match request {
                    Some(request) => {
                        worker.held.push_back(request);
                        // Other deliveries finishing now hand their copies over too: they go
                        // out together, in one write.
                        tokio::task::yield_now().await;
                    }
                    None => open = false,
                },
                () = &mut timer, if armed.is_some() => armed = None,
            }
        }
        while let Ok(request) = requests.try_recv() {
            worker.held.push_back(request);
        }
        worker.settle();
        worker.expire(Instant::now());
        if worker.pipe.is_none() && !worker.held.is_empty() {
            match worker.link.gate(Instant::now()) {
                Gate::Open => tokio::select! {
                    () = &mut cancelled => break,
                    () = worker.open() => {}
                },
                // Another worker's channel tries: its verdict is theirs too.
                Gate::Wait => {}
                Gate::Shut => {
                    // Refused, and tried a moment ago: no channel for these.
                    for request in worker.held.drain(..) {
                        let _ = request.reply.send(HandoffResult::Refused);
                    }
                }
            }
        }
        worker.publish_held();
        if !open && worker.held.is_empty() && worker.pipe.is_none() {
            return;
        }
    }
    // Closed and awaited before the pool closes the connection (see `Confirms::close`); a
    // blocked connection writes nothing, not even this.
    if let Some(pipe) = worker.pipe.take()
        && !worker.link.blocked()
    {
        let _ = pipe.channel.close(200, "lily shutdown".into()).await;
    }
}

/// One worker's requests and its confirm channel.
struct Worker {
    link: Arc<Link>,
    /// Requests not published yet: no channel, the connection is blocked, a probe is out, or
    /// the channel drains.
    held: VecDeque<Request>,
    pipe: Option<Pipe>,
    /// The probe in flight, which held requests wait for.
    probing: Option<Seq>,
    /// A probe was just confirmed: what is held goes out without another, however long the
    /// worker took to get to it.
    cleared: bool,
}

/// A confirm channel, its publishes in flight and their evidence.
struct Pipe {
    channel: Channel,
    evidence: InFlight,
    flights: HashMap<Seq, Flight>,
    /// Deadlines of the publishes in flight.
    deadlines: BTreeSet<(Instant, Seq)>,
    wakes: Arc<Wakes>,
    /// The broker refused a publish on the channel (a permission), closing it: what fails on
    /// it was refused, not lost.
    refused: bool,
    /// The exchange the broker closed the channel for not finding (`NOT_FOUND`): what fails on
    /// it, published there, reached no queue.
    missing: Option<ShortString>,
}

/// One publish in flight.
struct Flight {
    stage: Stage,
    waker: Waker,
    /// Where its result goes; `None` for a probe.
    reply: Option<oneshot::Sender<HandoffResult>>,
    until: Instant,
    /// The exchange it is published to, named when the broker refuses it.
    exchange: ShortString,
}

enum Stage {
    /// Its frames are being written.
    Writing(Pin<Box<dyn Future<Output = lapin::Result<PublisherConfirm>> + Send>>),
    /// Its confirm is awaited.
    Awaiting(PublisherConfirm),
    /// Its confirm came; the evidence judges it.
    Seen,
}

/// The publishes of a channel that woke since the worker last looked, in the order they woke.
#[derive(Default)]
struct Wakes {
    woken: Mutex<Vec<Seq>>,
    notify: Notify,
}

/// The waker of one publish: notes it in its channel's [`Wakes`]. A publish that completes
/// (its write or its confirm) is noted before the client completes anything after it, which is
/// what [`InFlight`]'s quiet points rest on.
struct Woken {
    seq: Seq,
    wakes: Arc<Wakes>,
}

impl Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        lock(&self.wakes.woken).push(self.seq);
        self.wakes.notify.notify_one();
    }
}

impl Worker {
    /// When the worker must look again without a wake-up: the earliest deadline, or shortly
    /// while the connection is blocked and requests wait.
    fn wake_at(&self) -> Option<Instant> {
        let held = self.held.iter().map(|r| r.copy.until).min();
        let flying = self
            .pipe
            .as_ref()
            .and_then(|pipe| pipe.deadlines.first().map(|(at, _)| *at));
        let now = Instant::now();
        let waiting = !self.held.is_empty()
            && (self.link.blocked() || (self.pipe.is_none() && self.link.trying(now)));
        let poll = waiting.then(|| now + BLOCKED_POLL);
        [held, flying, poll].into_iter().flatten().min()
    }

    /// Handles every wake-up of the channel up to a quiet point and answers what was judged.
    fn settle(&mut self) {
        let Some(pipe) = self.pipe.as_mut() else {
            return;
        };
        loop {
            let woken = std::mem::take(&mut *lock(&pipe.wakes.woken));
            if woken.is_empty() {
                break;
            }
            for seq in woken {
                pipe.poll(seq, &self.link);
            }
        }
        pipe.evidence.handle_quiet();
        self.answer();
    }

    /// Judges what is past its deadline: held requests time out unpublished.
    fn expire(&mut self, now: Instant) {
        if self.held.iter().any(|r| r.copy.until <= now) {
            let (expired, held): (Vec<_>, Vec<_>) =
                self.held.drain(..).partition(|r| r.copy.until <= now);
            self.held = held.into();
            for request in expired {
                let _ = request.reply.send(self.link.timed_out());
            }
        }
        let Some(pipe) = self.pipe.as_mut() else {
            return;
        };
        let mut expired = Vec::new();
        while let Some(&(at, seq)) = pipe.deadlines.first()
            && at <= now
        {
            pipe.deadlines.pop_first();
            expired.push(seq);
        }
        if !expired.is_empty() {
            pipe.evidence.handle_expired(&expired);
            self.answer();
        }
    }

    /// Sends each verdict to its publish's caller, and lets a channel go once it must carry
    /// nothing more and nothing is left on it.
    fn answer(&mut self) {
        let Some(pipe) = self.pipe.as_mut() else {
            return;
        };
        let blocked = self.link.blocked();
        while let Some((seq, result)) = pipe.evidence.poll_verdict() {
            let Some(flight) = pipe.flights.remove(&seq) else {
                continue;
            };
            pipe.deadlines.remove(&(flight.until, seq));
            if self.probing == Some(seq) {
                self.probing = None;
                self.cleared = result == HandoffResult::Confirmed && !self.held.is_empty();
            }
            let result = match result {
                HandoffResult::TimedOut if blocked => HandoffResult::Blocked,
                HandoffResult::Failed if pipe.missing.as_ref() == Some(&flight.exchange) => {
                    HandoffResult::NoExchange
                }
                HandoffResult::Failed if pipe.refused => HandoffResult::Refused,
                HandoffResult::Confirmed => {
                    self.link.accepted();
                    HandoffResult::Confirmed
                }
                r => r,
            };
            if let Some(reply) = flight.reply {
                let _ = reply.send(result);
            }
        }
        let retired = match pipe.evidence.retired() {
            Some(Retired::Confused) => true,
            Some(Retired::Draining) => pipe.evidence.is_empty(),
            None => !pipe.channel.status().connected() && pipe.evidence.is_empty(),
        };
        if retired {
            // Dropped with its last handle, lapin closes it and discards what it still keeps
            // for it.
            self.pipe = None;
            self.probing = None;
        }
    }

    /// Opens a confirm channel, within the held requests' earliest deadline.
    async fn open(&mut self) {
        let Some(until) = self.held.iter().map(|r| r.copy.until).min() else {
            return;
        };
        match tokio::time::timeout_at(until, self.link.open_channel()).await {
            Ok(Ok(channel)) => {
                self.pipe = Some(Pipe {
                    channel,
                    evidence: InFlight::new(),
                    flights: HashMap::new(),
                    deadlines: BTreeSet::new(),
                    wakes: Arc::default(),
                    refused: false,
                    missing: None,
                });
            }
            Ok(Err(_)) => {
                for request in self.held.drain(..) {
                    let _ = request.reply.send(HandoffResult::Failed);
                }
            }
            Err(_) => self.expire(Instant::now()),
        }
    }

    /// Whether held requests can go out now: a channel takes them, or one must be opened.
    fn can_publish(&self) -> bool {
        !self.held.is_empty()
            && self.probing.is_none()
            && !self.link.blocked()
            && match &self.pipe {
                Some(pipe) => pipe.evidence.retired().is_none(),
                None => !self.link.trying(Instant::now()),
            }
    }

    /// Publishes the held requests, unless the channel must not take them yet. After a quiet
    /// spell on the connection a probe goes first (see the module's text).
    fn publish_held(&mut self) {
        if self.held.is_empty() || self.probing.is_some() || self.link.blocked() {
            return;
        }
        let Some(pipe) = self.pipe.as_mut() else {
            return;
        };
        if pipe.evidence.retired().is_some() {
            return;
        }
        let cleared = std::mem::take(&mut self.cleared);
        if self.link.quiet() && !cleared {
            let until = self.held.iter().map(|r| r.copy.until).min().expect("held");
            let probe = Copy {
                route: Route::new("", PROBE_ROUTE).expect("a short name"),
                id: self.link.next_id(),
                body: Vec::new(),
                properties: BasicProperties::default(),
                until,
            };
            self.probing = Some(pipe.start(probe, false, None, &self.link));
        } else {
            for request in self.held.drain(..) {
                pipe.start(request.copy, true, Some(request.reply), &self.link);
            }
        }
        // What the first polls found (a confirm already in, say) is judged at once.
        self.settle();
    }
}

impl Pipe {
    /// Numbers `copy` on the channel, publishes it (`mandatory`, or not for a probe) and polls
    /// it once.
    fn start(
        &mut self,
        copy: Copy,
        mandatory: bool,
        reply: Option<oneshot::Sender<HandoffResult>>,
        link: &Link,
    ) -> Seq {
        let seq = self.evidence.handle_published(copy.id);
        let waker = Waker::from(Arc::new(Woken {
            seq,
            wakes: Arc::clone(&self.wakes),
        }));
        let channel = self.channel.clone();
        let Copy {
            route,
            body,
            properties,
            until,
            ..
        } = copy;
        let exchange = route.exchange.clone();
        let publish = Box::pin(async move {
            channel
                .basic_publish(
                    route.exchange,
                    route.routing_key,
                    BasicPublishOptions {
                        mandatory,
                        immediate: false,
                    },
                    &body,
                    properties,
                )
                .await
        });
        self.flights.insert(
            seq,
            Flight {
                stage: Stage::Writing(publish),
                waker,
                reply,
                until,
                exchange,
            },
        );
        self.deadlines.insert((until, seq));
        self.poll(seq, link);
        seq
    }

    /// Polls the publish `seq` (it woke, or was just started) and reports what it shows.
    fn poll(&mut self, seq: Seq, link: &Link) {
        let Some(flight) = self.flights.get_mut(&seq) else {
            // Judged already: a late wake-up.
            return;
        };
        let mut cx = Context::from_waker(&flight.waker);
        if let Stage::Writing(publish) = &mut flight.stage {
            match publish.as_mut().poll(&mut cx) {
                Poll::Pending => return,
                Poll::Ready(Err(err)) => {
                    flight.stage = Stage::Seen;
                    let exchange = flight.exchange.clone();
                    self.note_error(&err, exchange.as_str(), link);
                    self.evidence.handle_failed(seq);
                    return;
                }
                Poll::Ready(Ok(confirm)) => {
                    flight.stage = Stage::Awaiting(confirm);
                    self.evidence.handle_written(seq);
                }
            }
        }
        let Stage::Awaiting(confirm) = &mut flight.stage else {
            return;
        };
        let confirmed = match Pin::new(confirm).poll(&mut cx) {
            Poll::Pending => {
                self.evidence.handle_pending(seq);
                return;
            }
            Poll::Ready(confirmed) => confirmed,
        };
        flight.stage = Stage::Seen;
        match confirmed {
            Ok(Confirmation::Ack(message)) => {
                link.confirmed();
                let brought = message.map(|m| link.returned_id(&m));
                self.evidence.handle_confirm(seq, Confirm::Ack, brought);
            }
            Ok(Confirmation::Nack(message)) => {
                link.confirmed();
                let brought = message.map(|m| link.returned_id(&m));
                self.evidence.handle_confirm(seq, Confirm::Nack, brought);
            }
            Ok(Confirmation::NotRequested) => self.evidence.handle_failed(seq),
            Err(err) => {
                let exchange = flight.exchange.clone();
                self.note_error(&err, exchange.as_str(), link);
                self.evidence.handle_failed(seq);
            }
        }
    }

    /// Notes a publish's error: a refusal marks the channel refused, counted once on `link`
    /// however many publishes it fails; a missing exchange is noted by name.
    fn note_error(&mut self, err: &lapin::Error, exchange: &str, link: &Link) {
        if link.refuses(err, exchange) && !std::mem::replace(&mut self.refused, true) {
            link.channel_refused();
        }
        if let Some(missing) = missing_exchange(err) {
            self.missing = Some(missing.into());
        }
    }
}

/// The exchange named by a channel closed with `NOT_FOUND - no exchange 'name' in vhost ...`.
fn missing_exchange(err: &lapin::Error) -> Option<&str> {
    use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
    let lapin::ErrorKind::ProtocolError(amqp) = err.kind() else {
        return None;
    };
    if amqp.kind() != &AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND) {
        return None;
    }
    let (_, rest) = amqp.get_message().as_str().split_once("no exchange '")?;
    rest.rsplit_once("' in vhost").map(|(name, _)| name)
}
