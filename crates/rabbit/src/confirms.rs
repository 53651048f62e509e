//! A confirm pool: a connection of its own, and a few confirm channels on which publishes are
//! pipelined. The handoff publisher and the public [`Publisher`](crate::Publisher) are both
//! built on it.
//!
//! - **Own connection.** RabbitMQ blocks a publishing connection during a memory or disk alarm,
//!   and lapin then writes nothing on it. Publishing copies on the consuming connection would
//!   stall its ACKs, the `basic.qos` round trips that confirm them, `basic.cancel` and close.
//! - **Pipelined.** Publishes take turns among [`WORKERS`] workers, each owning one confirm
//!   channel. A worker publishes what it is given at once, each carrying its [`HandoffId`] in
//!   the pool's id header, without waiting for earlier publishes' confirms or for one to be
//!   written before the next, so a copy that comes while the broker syncs its queues to disk
//!   joins the sync under way instead of waiting for the one after it. Each publish has a waker
//!   of its own, which notes it in its channel's wake list; the worker polls what woke, and at
//!   each quiet point (nothing left in the list) [`InFlight`] judges every publish whose
//!   evidence is complete: a return counts only against the publish whose id it carries, and an
//!   ACK proves the copy was stored only once its return, had there been one, must have been
//!   seen (see `lily_mq_core`'s `confirms` module for why the order of wake-ups proves that).
//! - **Channel errors.** A channel error fails every publish in flight on it that has no
//!   evidence yet. No handoff copy is known to cause one: what RabbitMQ checks per message
//!   (`user_id`, `expiration`, `CC`/`BCC`) is moved aside on copies, copies go through the
//!   default exchange for every lane, and the broker's `max_message_size` counts the body,
//!   which is the original's.
//! - **Channels.** A channel whose evidence is confused (a publish timed out or failed, a
//!   return without a known id) is dropped at once, and lapin closes it with its last handle,
//!   which also discards the confirms it still kept for publishes nobody awaits any more; the
//!   worker opens a new one for what comes next. A channel that was nacked takes nothing new
//!   and is dropped once what is in flight on it is judged: a quorum queue with `overflow:
//!   reject-publish` tells each channel publishing to it that it is full, and RabbitMQ may
//!   never tell that channel otherwise once the queue takes messages again
//!   (rabbitmq-server#12206: a cleared `max-length` policy), so the lane would fail for good.
//! - **Blocked.** While the broker blocks the connection, nothing is published: publishes
//!   wait for the unblock within their deadline and otherwise fail as
//!   [`HandoffResult::Blocked`], so no message lands later, after its sender gave up on it.
//!   RabbitMQ only says a connection is blocked once it publishes during the alarm, and that
//!   publish stays unread until the alarm clears. So when the connection has had no confirm for
//!   [`PROBE_AFTER`], a worker first publishes a probe that RabbitMQ drops (not mandatory, to a
//!   queue name no queue can have) and holds its publishes until the probe is confirmed: if an
//!   alarm started in the quiet, the probe is what stays stuck, not a message. Under a steady
//!   stream of publishes their own confirms are the evidence and no probe is sent; a message
//!   published in the instant an alarm starts can still be held by the broker, time out and
//!   land later.
//! - **Refused.** A publish the broker refuses for want of a permission (`ACCESS_REFUSED`:
//!   `write` on the exchange, taken from the user while Lily runs) closes its channel. The pool
//!   then knows it is refused and names the permission ([`Confirms::refused`]). One worker at a
//!   time, at most every [`REFUSED_RETRY`], opens a channel and tries what it holds (a probe
//!   first, after a quiet spell); the others' publishes wait for that try's answer, at most
//!   [`TRY_WAIT`], and are otherwise answered [`HandoffResult::Refused`] at once, without a
//!   channel. So a refusal costs the broker a few channels a second, not one per publish, and
//!   the first publish it confirms once the permission is granted again ends the refusal,
//!   without a reconnect. The refusal is the pool's, not one exchange's: the
//!   handoff copies all go through the default exchange; a [`Publisher`](crate::Publisher)
//!   publishing to several exchanges, one of them refused, publishes to all at that pace.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use futures_core::Stream;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::ShortString;
use lapin::{BasicProperties, Channel, Confirmation, Connection, Event, PublisherConfirm};
use lily_mq_core::transport::{Confirm, HandoffId, HandoffResult, InFlight, Retired, Seq};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::connect::{Dialer, Endpoint};
use crate::error::{MissingPermission, Needs, missing_permission};
use crate::sync::lock;

/// Confirm channels publishing, each with many publishes in flight.
const WORKERS: usize = 4;

/// How often publishes waiting for the broker to unblock the connection look again.
const BLOCKED_POLL: Duration = Duration::from_millis(25);

/// How long without a confirm on the connection before a worker probes it first.
const PROBE_AFTER: Duration = Duration::from_millis(100);

/// Routing key of the probe: RabbitMQ reserves `amq.` queue names, so nothing can route it.
const PROBE_ROUTE: &str = "amq.lily.probe";

/// While the broker refuses the pool's publishes, how often at most a worker opens a channel
/// to try again: two a second, under the five the README allows.
pub(crate) const REFUSED_RETRY: Duration = Duration::from_millis(500);

/// How long the other workers' publishes wait for a try (a channel opened while refused) to
/// show whether the broker still refuses, before they are answered without it.
const TRY_WAIT: Duration = Duration::from_secs(1);

/// How many channels the broker may close for a refusal on one connection before the pool
/// dials a new one: with lapin 4.12, a connection that had 2047 channels refused (RabbitMQ's
/// `channel_max`) opens no channel again, the permission given back or not (seen with a plain
/// lapin loop against 3.10.8). Half of that: at [`REFUSED_RETRY`], a new connection every eight
/// minutes or so of a refusal.
const REFUSED_PER_CONNECTION: u32 = 1024;

/// How long a connection replaced for [`REFUSED_PER_CONNECTION`] stays open for what is still in
/// flight on it: far longer than a publish's deadline (the settlement budget, 10 s by default).
/// A publish still unconfirmed when it closes fails, as on any lost connection: not confirmed.
const WORN_GRACE: Duration = Duration::from_secs(120);

/// What a pool is for: how its connection is named, the header its publishes carry their id
/// in, and the gauge that says the broker blocks it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Role {
    /// The connection's role, in its name `lily:<label>:<role>`.
    pub(crate) name: &'static str,
    /// The header each publish carries its [`HandoffId`] in, to attribute returns.
    pub(crate) id_header: &'static str,
    /// The gauge set to 1 while the broker blocks the connection, labelled `queue=<label>`.
    pub(crate) blocked_gauge: &'static str,
    /// The gauge set to 1 while the broker refuses the pool's publishes (a permission),
    /// labelled `queue=<label>`.
    pub(crate) refused_gauge: &'static str,
    /// What the publishes are for, in the text naming a refused permission: `publish handoff
    /// copies`.
    pub(crate) doing: &'static str,
}

/// Where one publish goes: an exchange (`""` is the default one) and a routing key.
pub(crate) struct Route {
    pub(crate) exchange: ShortString,
    pub(crate) routing_key: ShortString,
}

impl Route {
    /// The route, or `None` when a name is over 255 bytes.
    pub(crate) fn new(exchange: &str, routing_key: &str) -> Option<Self> {
        Some(Self {
            exchange: ShortString::try_new(exchange).ok()?,
            routing_key: ShortString::try_new(routing_key).ok()?,
        })
    }
}

/// One message to publish.
struct Copy {
    route: Route,
    id: HandoffId,
    body: Vec<u8>,
    properties: BasicProperties,
    until: Instant,
}

/// A message, and where its result goes.
struct Request {
    copy: Copy,
    reply: oneshot::Sender<HandoffResult>,
}

/// Publishes with confirms on a connection of its own.
pub(crate) struct Confirms {
    link: Arc<Link>,
    /// Each worker's queue; publishes take turns.
    requests: Vec<mpsc::UnboundedSender<Request>>,
    turn: AtomicUsize,
    /// Taken by the first [`Confirms::warm`], which starts the workers.
    pending: Mutex<Vec<mpsc::UnboundedReceiver<Request>>>,
    closed: CancellationToken,
    /// The workers, which [`Confirms::close`] waits for before it closes the connection.
    workers: TaskTracker,
}

/// The connection the workers share.
struct Link {
    role: Role,
    /// Set by the first [`Confirms::warm`].
    dialer: std::sync::OnceLock<Dialer>,
    /// The current connection; replaced when it is lost.
    current: Mutex<Option<Arc<Connection>>>,
    /// Held while connecting, so the workers open one connection, not one each.
    connecting: tokio::sync::Mutex<()>,
    /// The next [`HandoffId`], counted for the pool's life.
    next_id: AtomicU64,
    /// When the broker last confirmed a publish on the current connection: it was reading it.
    last_confirm: Mutex<Option<Instant>>,
    /// Whether the broker blocks the current connection, as its last notice said.
    blocked: Arc<AtomicBool>,
    /// Registered on first use, so a recorder installed after [`Confirms::new`] (by
    /// `health::serve`, say) still gets it.
    blocked_gauge: std::sync::OnceLock<metrics::Gauge>,
    /// Whether the broker refuses the pool's publishes, and when a worker may try again.
    refusal: Mutex<Refusal>,
    label: String,
}

/// The broker's refusal of the pool's publishes (a permission), while it lasts.
#[derive(Default)]
struct Refusal {
    /// The permission refused; `None` while publishes are accepted.
    missing: Option<MissingPermission>,
    /// The permission refused last, kept once publishes are accepted again.
    last: Option<MissingPermission>,
    /// When a worker may next open a channel to try again.
    next_try: Option<Instant>,
    /// When the try under way began, until its channel is refused or a publish confirmed.
    trying_since: Option<Instant>,
    /// How many times publishes came to be refused, for the pool's life.
    spells: u64,
    /// Channels refused on the current connection.
    on_connection: u32,
    /// Registered at the first refusal.
    gauge: Option<metrics::Gauge>,
}

impl Confirms {
    /// A pool for `role`, labelled `label` (the work queue of a consumer) in connection names
    /// and metrics. It connects on [`Confirms::warm`].
    pub(crate) fn new(label: &str, role: Role) -> Self {
        let (requests, pending) = (0..WORKERS).map(|_| mpsc::unbounded_channel()).unzip();
        Self {
            link: Arc::new(Link {
                role,
                dialer: std::sync::OnceLock::new(),
                current: Mutex::new(None),
                connecting: tokio::sync::Mutex::new(()),
                next_id: AtomicU64::new(0),
                last_confirm: Mutex::new(None),
                blocked: Arc::new(AtomicBool::new(false)),
                blocked_gauge: std::sync::OnceLock::new(),
                refusal: Mutex::new(Refusal::default()),
                label: label.to_owned(),
            }),
            requests,
            turn: AtomicUsize::new(0),
            pending: Mutex::new(pending),
            closed: CancellationToken::new(),
            workers: TaskTracker::new(),
        }
    }

    /// Whether the broker blocks the connection (a resource alarm): publishes wait.
    pub(crate) fn blocked(&self) -> bool {
        self.link.blocked.load(Ordering::Acquire)
    }

    /// The permission the broker refuses the pool's publishes for, while it does: publishes
    /// answer [`HandoffResult::Refused`] until one is confirmed again.
    pub(crate) fn refused(&self) -> Option<MissingPermission> {
        lock(&self.link.refusal).missing.clone()
    }

    /// The permission the broker last refused the pool's publishes for, if it ever did.
    pub(crate) fn last_refused(&self) -> Option<MissingPermission> {
        lock(&self.link.refusal).last.clone()
    }

    /// How many times the broker came to refuse the pool's publishes, for its life.
    pub(crate) fn refusals(&self) -> u64 {
        lock(&self.link.refusal).spells
    }

    /// Opens the connection, so a broker that refuses it is known before the first publish,
    /// and the first time takes `endpoint`, which it dials on its own (the pool's connection may
    /// land on another node than a consumer's), and starts the workers.
    pub(crate) async fn warm(&self, endpoint: &Endpoint) -> lapin::Result<()> {
        self.link
            .dialer
            .get_or_init(|| Dialer::new(endpoint.clone(), self.link.role.name));
        self.link.connection().await?;
        for requests in std::mem::take(&mut *lock(&self.pending)) {
            self.workers
                .spawn(work(Arc::clone(&self.link), requests, self.closed.clone()));
        }
        Ok(())
    }

    /// Publishes one probe on a channel of its own and awaits its confirm: the broker refuses
    /// it (`ACCESS_REFUSED`, closing that channel only) when the user may not write to the
    /// default exchange. The probe's routing key names no queue, so it goes nowhere.
    pub(crate) async fn check_write(&self) -> lapin::Result<()> {
        let connection = self.link.connection().await?;
        let channel = confirm_channel(&connection).await?;
        // Dropping the channel closes it without waiting for the broker's close-ok.
        probe(&channel).await
    }

    /// A fresh id for the next publish to carry in the role's id header.
    pub(crate) fn next_id(&self) -> HandoffId {
        self.link.next_id()
    }

    /// Publishes `body` with `properties`, which carry `id` (from [`Self::next_id`]) in the
    /// role's id header, on `route` (mandatory, so an unroutable message comes back as a
    /// return) and awaits its confirm, all within `deadline`.
    ///
    /// # Cancel safety
    /// Dropping the future leaves the message to its worker, which publishes it and judges it
    /// unobserved: the message may exist. Callers bound the wait with `deadline` instead.
    pub(crate) async fn publish(
        &self,
        route: Route,
        id: HandoffId,
        body: Vec<u8>,
        properties: BasicProperties,
        deadline: Duration,
    ) -> HandoffResult {
        let (reply, result) = oneshot::channel();
        let copy = Copy {
            route,
            id,
            body,
            properties,
            until: Instant::now() + deadline,
        };
        let turn = self.turn.fetch_add(1, Ordering::Relaxed) % self.requests.len();
        if self.requests[turn].send(Request { copy, reply }).is_err() {
            return HandoffResult::Failed;
        }
        // Its worker answers by this message's deadline (one whose deadline passed before it
        // could be published fails unpublished); the worker is gone only once the pool closed.
        result.await.unwrap_or(HandoffResult::Failed)
    }

    /// Stops the workers and closes the connection, waiting at most `within`: a blocked
    /// connection writes nothing, not even its close.
    pub(crate) async fn close(&self, within: Duration) {
        let until = Instant::now() + within;
        self.closed.cancel();
        // The workers close their channels first: lapin logs a channel that closes while the
        // connection does (as one dropped then) as a connection error.
        self.workers.close();
        let _ = tokio::time::timeout_at(until, self.workers.wait()).await;
        let Some(connection) = lock(&self.link.current).take() else {
            return;
        };
        let closing = connection.close(200, "lily shutdown".into());
        if tokio::time::timeout_at(until, closing).await.is_err() {
            warn!(
                role = self.link.role.name,
                "publishing connection did not close in time; dropping it"
            );
        }
    }
}

impl std::fmt::Debug for Confirms {
    // Not derived: the endpoint's URL may carry credentials.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Confirms")
            .field("role", &self.link.role.name)
            .field("blocked", &self.blocked())
            .finish_non_exhaustive()
    }
}

/// A worker: publishes the requests it is given on its confirm channel as they come, without
/// waiting for earlier ones' confirms, and answers each once [`InFlight`] judged it.
async fn work(
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

/// What a worker without a channel may do while the broker refuses the pool's publishes.
#[derive(Debug, PartialEq, Eq)]
enum Gate {
    /// Open one: publishes are accepted, or it is this worker's turn to try.
    Open,
    /// Wait for the try another worker's channel makes.
    Wait,
    /// Answer the held publishes [`HandoffResult::Refused`] without a channel.
    Shut,
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
    /// however many publishes it fails.
    fn note_error(&mut self, err: &lapin::Error, exchange: &str, link: &Link) {
        if link.refuses(err, exchange) && !std::mem::replace(&mut self.refused, true) {
            link.channel_refused();
        }
    }
}

impl Link {
    /// A fresh id for the next publish (a probe's included).
    fn next_id(&self) -> HandoffId {
        HandoffId::new(self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// Whether the connection has had no confirm for [`PROBE_AFTER`]: the broker may have
    /// stopped reading it.
    fn quiet(&self) -> bool {
        lock(&self.last_confirm).is_none_or(|at| at.elapsed() > PROBE_AFTER)
    }

    /// The id a returned message carries (`None`: none, so not one of this pool's).
    fn returned_id(&self, message: &lapin::message::BasicReturnMessage) -> Option<HandoffId> {
        let headers = message.delivery.properties.headers().as_ref();
        HandoffId::from_header(headers, self.role.id_header)
    }

    /// A wait that ran out: blocked if the broker said so meanwhile.
    fn timed_out(&self) -> HandoffResult {
        if self.blocked() {
            HandoffResult::Blocked
        } else {
            HandoffResult::TimedOut
        }
    }

    fn blocked(&self) -> bool {
        self.blocked.load(Ordering::Acquire)
    }

    fn confirmed(&self) {
        *lock(&self.last_confirm) = Some(Instant::now());
    }

    /// Whether `err`, of a publish to `exchange`, is the broker refusing the `write`
    /// permission; if so the pool is refused from now on, until a publish is confirmed again.
    fn refuses(&self, err: &lapin::Error, exchange: &str) -> bool {
        let needs = [Needs::exchange(exchange, "write")];
        let Some(missing) = missing_permission(err, || self.role.doing.to_owned(), &needs) else {
            return false;
        };
        let mut refusal = lock(&self.refusal);
        if refusal.missing.is_none() {
            refusal.spells += 1;
            // The broker's text names the resource and the user, never a password.
            warn!(
                queue = %self.label,
                role = self.role.name,
                lacks = %missing,
                "the broker refuses publishes: they fail at once, and a channel tries again at most every {REFUSED_RETRY:?}, until the permission is granted"
            );
            let gauge = refusal.gauge.get_or_insert_with(
                || metrics::gauge!(self.role.refused_gauge, "queue" => self.label.clone()),
            );
            gauge.set(1.0);
        }
        refusal.last = Some(missing.clone());
        refusal.missing = Some(missing);
        refusal.next_try = Some(Instant::now() + REFUSED_RETRY);
        refusal.trying_since = None;
        true
    }

    /// A channel of the current connection was closed for a refusal.
    fn channel_refused(&self) {
        let mut refusal = lock(&self.refusal);
        refusal.on_connection = refusal.on_connection.saturating_add(1);
    }

    /// Whether the current connection has had [`REFUSED_PER_CONNECTION`] channels refused:
    /// its channel ids run out, so the next channel is opened on a new connection.
    fn worn(&self) -> bool {
        lock(&self.refusal).on_connection >= REFUSED_PER_CONNECTION
    }

    /// Whether a worker may open a channel now: always, unless the broker refuses the pool's
    /// publishes, and then one worker every [`REFUSED_RETRY`]; the others wait for that try,
    /// at most [`TRY_WAIT`], or are answered at once when none is under way.
    fn gate(&self, now: Instant) -> Gate {
        let mut refusal = lock(&self.refusal);
        if refusal.missing.is_none() {
            return Gate::Open;
        }
        if refusal.next_try.is_none_or(|at| at <= now) {
            refusal.next_try = Some(now + REFUSED_RETRY);
            refusal.trying_since = Some(now);
            return Gate::Open;
        }
        match refusal.trying_since {
            Some(since) if now < since + TRY_WAIT => Gate::Wait,
            _ => Gate::Shut,
        }
    }

    /// Whether publishes wait for a try under way (see [`Link::gate`]).
    fn trying(&self, now: Instant) -> bool {
        let refusal = lock(&self.refusal);
        refusal.missing.is_some()
            && refusal
                .trying_since
                .is_some_and(|since| now < since + TRY_WAIT)
    }

    /// A publish was confirmed: whatever the broker refused before, it accepts them again.
    fn accepted(&self) {
        let mut refusal = lock(&self.refusal);
        if let Some(missing) = refusal.missing.take() {
            refusal.next_try = None;
            refusal.trying_since = None;
            info!(
                queue = %self.label,
                role = self.role.name,
                was_lacking = %missing,
                "the broker accepts publishes again"
            );
            if let Some(gauge) = &refusal.gauge {
                gauge.set(0.0);
            }
        }
    }

    /// A new confirm channel; waits while the broker blocks the connection.
    async fn open_channel(&self) -> lapin::Result<Channel> {
        if self.worn()
            && let Some(worn) = lock(&self.current).take()
        {
            info!(
                queue = %self.label,
                role = self.role.name,
                "{REFUSED_PER_CONNECTION} channels refused on the publishing connection; opening a new one"
            );
            // Closed once what may still be in flight on it (publishes of channels opened
            // before, each within its deadline) had its time.
            tokio::spawn(async move {
                tokio::time::sleep(WORN_GRACE).await;
                let _ = worn.close(200, "lily: channel ids used up".into()).await;
            });
        }
        loop {
            let connection = self.connection().await?;
            if connection.status().blocked() {
                tokio::time::sleep(BLOCKED_POLL).await;
                continue;
            }
            return confirm_channel(&connection).await;
        }
    }

    /// The current connection, opened again when it was lost.
    async fn connection(&self) -> lapin::Result<Arc<Connection>> {
        if let Some(connection) = self.open() {
            return Ok(connection);
        }
        let _connecting = self.connecting.lock().await;
        if let Some(connection) = self.open() {
            return Ok(connection);
        }
        let dialer = self.dialer.get().ok_or_else(|| {
            lapin::Error::from(std::io::Error::other(
                "the publishing connection was not started",
            ))
        })?;
        let connection = Arc::new(dialer.connect().await?);
        lock(&self.refusal).on_connection = 0;
        *lock(&self.last_confirm) = None;
        self.blocked.store(false, Ordering::Release);
        let gauge = self.blocked_gauge.get_or_init(
            || metrics::gauge!(self.role.blocked_gauge, "queue" => self.label.clone()),
        );
        gauge.set(0.0);
        tokio::spawn(watch_blocked(
            self.role.name,
            connection.events_listener(),
            Arc::clone(&self.blocked),
            gauge.clone(),
        ));
        *lock(&self.current) = Some(Arc::clone(&connection));
        Ok(connection)
    }

    fn open(&self) -> Option<Arc<Connection>> {
        lock(&self.current)
            .as_ref()
            .filter(|c| c.status().connected())
            .cloned()
    }
}

/// Follows the broker's `connection.blocked` and `connection.unblocked` notices for logs,
/// the role's gauge and [`Confirms::blocked`], until the connection is gone.
async fn watch_blocked(
    role: &'static str,
    events: impl Stream<Item = Event> + Send + 'static,
    blocked: Arc<AtomicBool>,
    gauge: metrics::Gauge,
) {
    let mut events = std::pin::pin!(events);
    while let Some(event) = std::future::poll_fn(|cx| events.as_mut().poll_next(cx)).await {
        match event {
            Event::ConnectionBlocked(reason) => {
                // The reason is the broker's own text (for example "low on memory").
                warn!(%reason, role, "broker blocked the publishing connection; publishes wait");
                blocked.store(true, Ordering::Release);
                gauge.set(1.0);
            }
            Event::ConnectionUnblocked => {
                info!(role, "broker unblocked the publishing connection");
                blocked.store(false, Ordering::Release);
                gauge.set(0.0);
            }
            Event::Error(_) => break,
            _ => {}
        }
    }
}

/// Publishes a probe that RabbitMQ confirms and drops, and awaits the confirm.
async fn probe(channel: &Channel) -> lapin::Result<()> {
    channel
        .basic_publish(
            ShortString::from(""),
            ShortString::from(PROBE_ROUTE),
            BasicPublishOptions::default(),
            &[],
            BasicProperties::default(),
        )
        .await?
        .await
        .map(drop)
}

async fn confirm_channel(connection: &Connection) -> lapin::Result<Channel> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}

#[cfg(test)]
mod tests {
    use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPSoftError};

    use super::*;

    fn pool() -> Confirms {
        Confirms::new(
            "orders",
            Role {
                name: "handoffs",
                id_header: "x-test-id",
                blocked_gauge: "lily_test_blocked",
                refused_gauge: "lily_test_refused",
                doing: "publish handoff copies",
            },
        )
    }

    fn refused_write() -> lapin::Error {
        let message = "ACCESS_REFUSED - access to exchange 'amq.default' in vhost '/' refused \
                       for user 'lily'";
        lapin::ErrorKind::ProtocolError(AMQPError::new(
            AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED),
            message.into(),
        ))
        .into()
    }

    #[test]
    fn a_refusal_is_named_and_lets_one_channel_try_at_a_time_every_retry_until_a_confirm() {
        let pool = pool();
        let link = &pool.link;
        assert_eq!(
            link.gate(Instant::now()),
            Gate::Open,
            "accepted: channels open"
        );

        assert!(link.refuses(&refused_write(), ""));
        let missing = pool.refused().expect("refused");
        assert_eq!(
            missing.to_string(),
            "the write permission on exchange 'amq.default' in vhost '/' (needed to publish \
             handoff copies)"
        );
        assert_eq!(pool.refusals(), 1);

        let now = Instant::now();
        assert_eq!(
            link.gate(now),
            Gate::Shut,
            "the refused channel was the try"
        );
        assert!(!link.trying(now));
        let later = now + REFUSED_RETRY;
        assert_eq!(link.gate(later), Gate::Open, "one try every REFUSED_RETRY");
        assert!(link.trying(later));
        assert_eq!(link.gate(later), Gate::Wait, "the others wait for it");
        let late = later + TRY_WAIT;
        assert_eq!(
            link.gate(late),
            Gate::Open,
            "a try that says nothing is given up"
        );
        assert_eq!(link.gate(late), Gate::Wait);
        // Refused again: still one spell, and the waiting publishes are answered.
        assert!(link.refuses(&refused_write(), ""));
        assert_eq!(pool.refusals(), 1);
        assert_eq!(link.gate(Instant::now()), Gate::Shut);

        assert!(!link.worn(), "publishes refused, no channel counted");
        for _ in 0..REFUSED_PER_CONNECTION {
            link.channel_refused();
        }
        assert!(link.worn(), "the next channel goes on a new connection");

        link.accepted();
        assert_eq!(pool.refused(), None);
        assert_eq!(link.gate(now), Gate::Open, "accepted again: channels open");
        assert!(!link.trying(now));
        assert!(link.refuses(&refused_write(), ""));
        assert_eq!(pool.refusals(), 2);
    }

    #[test]
    fn other_channel_errors_are_no_refusal() {
        let pool = pool();
        let not_found: lapin::Error = lapin::ErrorKind::ProtocolError(AMQPError::new(
            AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND),
            "NOT_FOUND - no exchange 'x' in vhost '/'".into(),
        ))
        .into();
        assert!(!pool.link.refuses(&not_found, "x"));
        assert_eq!(pool.refused(), None);
        assert_eq!(pool.link.gate(Instant::now()), Gate::Open);
    }
}
