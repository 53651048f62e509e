//! The connection a pool's workers share: dialled once for all of them, replaced when lost or
//! worn by refusals; whether the broker blocks it or refuses its publishes.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_core::Stream;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::ShortString;
use lapin::{BasicProperties, Channel, Connection, Event};
use lily_mq_core::transport::{HandoffId, HandoffResult};
use tokio::time::Instant;
use tracing::{info, warn};

use super::request::Role;
use crate::connect::Dialer;
use crate::error::{MissingPermission, Needs, missing_permission};
use crate::sync::lock;

/// How often publishes waiting for the broker to unblock the connection look again.
pub(super) const BLOCKED_POLL: Duration = Duration::from_millis(25);

/// How long without a confirm on the connection before a worker probes it first.
pub(super) const PROBE_AFTER: Duration = Duration::from_millis(100);

/// Routing key of the probe: RabbitMQ reserves `amq.` queue names, so nothing can route it.
pub(super) const PROBE_ROUTE: &str = "amq.lily.probe";

/// While the broker refuses the pool's publishes, how often at most a worker opens a channel
/// to try again: two a second, under the five the security chapter allows.
pub(super) const REFUSED_RETRY: Duration = Duration::from_millis(500);

/// How long the other workers' publishes wait for a try (a channel opened while refused) to
/// show whether the broker still refuses, before they are answered without it.
pub(super) const TRY_WAIT: Duration = Duration::from_secs(1);

/// How many channels the broker may close for a refusal on one connection before the pool
/// dials a new one: with lapin 4.12, a connection that had 2047 channels refused (RabbitMQ's
/// `channel_max`) opens no channel again, the permission given back or not (seen with a plain
/// lapin loop against 3.10.8). Half of that: at [`REFUSED_RETRY`], a new connection every eight
/// minutes or so of a refusal.
pub(super) const REFUSED_PER_CONNECTION: u32 = 1024;

/// How long a connection replaced for [`REFUSED_PER_CONNECTION`] stays open for what is still in
/// flight on it: far longer than a publish's deadline (the settlement budget, 10 s by default).
/// A publish still unconfirmed when it closes fails, as on any lost connection: not confirmed.
pub(super) const WORN_GRACE: Duration = Duration::from_secs(120);

/// The connection the workers share.
pub(super) struct Link {
    pub(super) role: Role,
    /// Set by the first [`Confirms::warm`].
    pub(super) dialer: std::sync::OnceLock<Dialer>,
    /// The current connection; replaced when it is lost.
    pub(super) current: Mutex<Option<Arc<Connection>>>,
    /// Held while connecting, so the workers open one connection, not one each.
    pub(super) connecting: tokio::sync::Mutex<()>,
    /// The next [`HandoffId`], counted for the pool's life.
    pub(super) next_id: AtomicU64,
    /// When the broker last confirmed a publish on the current connection: it was reading it.
    pub(super) last_confirm: Mutex<Option<Instant>>,
    /// Whether the broker blocks the current connection, as its last notice said.
    pub(super) blocked: Arc<AtomicBool>,
    /// Registered on first use, so a recorder installed after [`Confirms::new`] (by
    /// `health::serve`, say) still gets it.
    pub(super) blocked_gauge: std::sync::OnceLock<metrics::Gauge>,
    /// Whether the broker refuses the pool's publishes, and when a worker may try again.
    pub(super) refusal: Mutex<Refusal>,
    pub(super) label: String,
}

/// The broker's refusal of the pool's publishes (a permission), while it lasts.
#[derive(Default)]
pub(super) struct Refusal {
    /// The permission refused; `None` while publishes are accepted.
    pub(super) missing: Option<MissingPermission>,
    /// The permission refused last, kept once publishes are accepted again.
    pub(super) last: Option<MissingPermission>,
    /// When a worker may next open a channel to try again.
    pub(super) next_try: Option<Instant>,
    /// When the try under way began, until its channel is refused or a publish confirmed.
    pub(super) trying_since: Option<Instant>,
    /// How many times publishes came to be refused, for the pool's life.
    pub(super) spells: u64,
    /// Channels refused on the current connection.
    pub(super) on_connection: u32,
    /// Registered at the first refusal.
    pub(super) gauge: Option<metrics::Gauge>,
}

/// What a worker without a channel may do while the broker refuses the pool's publishes.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Gate {
    /// Open one: publishes are accepted, or it is this worker's turn to try.
    Open,
    /// Wait for the try another worker's channel makes.
    Wait,
    /// Answer the held publishes [`HandoffResult::Refused`] without a channel.
    Shut,
}

impl Link {
    /// The link of a pool for `role`, labelled `label`; it dials on its first use.
    pub(super) fn new(label: &str, role: Role) -> Self {
        Self {
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
        }
    }

    /// A fresh id for the next publish (a probe's included).
    pub(super) fn next_id(&self) -> HandoffId {
        HandoffId::new(self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// Whether the connection has had no confirm for [`PROBE_AFTER`]: the broker may have
    /// stopped reading it.
    pub(super) fn quiet(&self) -> bool {
        lock(&self.last_confirm).is_none_or(|at| at.elapsed() > PROBE_AFTER)
    }

    /// The id a returned message carries (`None`: none, so not one of this pool's).
    pub(super) fn returned_id(
        &self,
        message: &lapin::message::BasicReturnMessage,
    ) -> Option<HandoffId> {
        let headers = message.delivery.properties.headers().as_ref();
        HandoffId::from_header(headers, self.role.id_header)
    }

    /// A wait that ran out: blocked if the broker said so meanwhile.
    pub(super) fn timed_out(&self) -> HandoffResult {
        if self.blocked() {
            HandoffResult::Blocked
        } else {
            HandoffResult::TimedOut
        }
    }

    pub(super) fn blocked(&self) -> bool {
        self.blocked.load(Ordering::Acquire)
    }

    pub(super) fn confirmed(&self) {
        *lock(&self.last_confirm) = Some(Instant::now());
    }

    /// Whether `err`, of a publish to `exchange`, is the broker refusing the `write`
    /// permission; if so the pool is refused from now on, until a publish is confirmed again.
    pub(super) fn refuses(&self, err: &lapin::Error, exchange: &str) -> bool {
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
    pub(super) fn channel_refused(&self) {
        let mut refusal = lock(&self.refusal);
        refusal.on_connection = refusal.on_connection.saturating_add(1);
    }

    /// Whether the current connection has had [`REFUSED_PER_CONNECTION`] channels refused:
    /// its channel ids run out, so the next channel is opened on a new connection.
    pub(super) fn worn(&self) -> bool {
        lock(&self.refusal).on_connection >= REFUSED_PER_CONNECTION
    }

    /// Whether a worker may open a channel now: always, unless the broker refuses the pool's
    /// publishes, and then one worker every [`REFUSED_RETRY`]; the others wait for that try,
    /// at most [`TRY_WAIT`], or are answered at once when none is under way.
    pub(super) fn gate(&self, now: Instant) -> Gate {
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
    pub(super) fn trying(&self, now: Instant) -> bool {
        let refusal = lock(&self.refusal);
        refusal.missing.is_some()
            && refusal
                .trying_since
                .is_some_and(|since| now < since + TRY_WAIT)
    }

    /// A publish was confirmed: whatever the broker refused before, it accepts them again.
    pub(super) fn accepted(&self) {
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
    pub(super) async fn open_channel(&self) -> lapin::Result<Channel> {
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
    pub(super) async fn connection(&self) -> lapin::Result<Arc<Connection>> {
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

    pub(super) fn open(&self) -> Option<Arc<Connection>> {
        lock(&self.current)
            .as_ref()
            .filter(|c| c.status().connected())
            .cloned()
    }
}

/// Follows the broker's `connection.blocked` and `connection.unblocked` notices for logs,
/// the role's gauge and [`Confirms::blocked`], until the connection is gone.
pub(super) async fn watch_blocked(
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
pub(super) async fn probe(channel: &Channel) -> lapin::Result<()> {
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

pub(super) async fn confirm_channel(connection: &Connection) -> lapin::Result<Channel> {
    let channel = connection.create_channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await?;
    Ok(channel)
}
