//! Where latencies are kept, and how Lily is timed: a `tracing_subscriber::Layer` enabled for
//! Lily's `delivery` and `handoff` spans only (one span a delivery, two with a handoff). A
//! delivery is timed from its publish ([`Sent`], for both contenders) to its span's close; a
//! `handoff` span from its opening to its close (the copy's wait for its confirm).

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use tracing::field::{Field, Visit};

use tracing::level_filters::LevelFilter;
use tracing::subscriber::Interest;
use tracing::{Metadata, Subscriber, span};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::{Context, Filter, SubscriberExt as _};
use tracing_subscriber::registry::LookupSpan;

/// Settlement latencies: when each message was published and how long it took to settle, in µs.
#[derive(Debug, Default)]
pub struct Sink {
    records: Mutex<Vec<(Instant, u32)>>,
    /// The publish times of the run in progress.
    sent: Mutex<Option<Arc<Sent>>>,
}

impl Sink {
    /// Times the deliveries from now on from `sent`'s publish times.
    pub fn starts_from(&self, sent: Arc<Sent>) {
        *self.sent.lock().unwrap_or_else(PoisonError::into_inner) = Some(sent);
    }

    /// When the message `message_id` was published; now, when it is not one of the paced
    /// publisher's (the drain runs, whose latencies are not kept).
    pub fn start_of(&self, message_id: &str) -> Instant {
        let sent = self.sent.lock().unwrap_or_else(PoisonError::into_inner);
        sent.as_ref()
            .and_then(|sent| sent.at(message_id))
            .unwrap_or_else(Instant::now)
    }

    /// Records one delivery whose clock started at `started` and that was settled now.
    pub fn push(&self, started: Instant) {
        self.push_at(started, Instant::now());
    }

    /// Records one delivery whose clock started at `started` and that was settled at `settled`.
    pub fn push_at(&self, started: Instant, settled: Instant) {
        let us = u32::try_from(settled.saturating_duration_since(started).as_micros())
            .unwrap_or(u32::MAX);
        self.records
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((started, us));
    }

    /// Takes every record so far, leaving the sink empty.
    pub fn take(&self) -> Vec<(Instant, u32)> {
        std::mem::take(&mut *self.records.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// When the paced publisher published each message, by the index in its id `{prefix}-{i}`.
#[derive(Debug)]
pub struct Sent {
    base: Instant,
    /// µs since `base`, plus one (zero: not published).
    at: Vec<std::sync::atomic::AtomicU64>,
}

impl Sent {
    /// Room for `capacity` messages; later ones are not stamped.
    pub fn new(capacity: usize) -> Self {
        Self {
            base: Instant::now(),
            at: (0..capacity).map(|_| Default::default()).collect(),
        }
    }

    /// Message `i` is being published now.
    pub fn stamp(&self, i: u64) {
        let slot = usize::try_from(i).ok().and_then(|i| self.at.get(i));
        if let Some(slot) = slot {
            let us = u64::try_from(self.base.elapsed().as_micros()).unwrap_or(u64::MAX - 1);
            slot.store(us + 1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// When `message_id` was published, if the publisher stamped it.
    pub fn at(&self, message_id: &str) -> Option<Instant> {
        let (_, i) = message_id.rsplit_once('-')?;
        let us = self
            .at
            .get(i.parse::<usize>().ok()?)?
            .load(std::sync::atomic::Ordering::Relaxed);
        let us = us.checked_sub(1)?;
        Some(self.base + std::time::Duration::from_micros(us))
    }
}

/// Where the timing layer writes.
#[derive(Clone, Debug, Default)]
pub struct Sinks {
    /// Publish → settlement (the `delivery` span's close).
    pub settled: Arc<Sink>,
    /// A `handoff` span's opening → its close, keyed by its opening.
    pub copies: Arc<Sink>,
}

/// Installs the timing layer as the global subscriber, feeding `sinks`.
///
/// # Panics
/// When a global subscriber is already set.
pub fn install(sinks: Sinks) {
    let subscriber =
        tracing_subscriber::registry().with(DeliveryTimer { sinks }.with_filter(OnlyTimed));
    tracing::subscriber::set_global_default(subscriber).expect("install the timing subscriber");
}

/// Whether `meta` is one of Lily's `delivery` and `handoff` spans.
fn is_timed(meta: &Metadata<'_>) -> bool {
    meta.is_span()
        && matches!(meta.name(), "delivery" | "handoff")
        && meta.target().starts_with("lily_mq_rabbit")
}

/// The per-layer filter: Lily's `delivery` and `handoff` spans only.
struct OnlyTimed;

impl<S> Filter<S> for OnlyTimed {
    fn enabled(&self, meta: &Metadata<'_>, _: &Context<'_, S>) -> bool {
        is_timed(meta)
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> Interest {
        if is_timed(meta) {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(LevelFilter::INFO)
    }
}

/// When the span's clock started: its delivery's publish, or a `handoff` span's opening.
struct Opened {
    at: Instant,
    copy: bool,
}

/// Looks the span's `message_id` field up in the sink's publish times, without copying it.
struct PublishedAt<'a> {
    sink: &'a Sink,
    at: Option<Instant>,
}

impl Visit for PublishedAt<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message_id" {
            self.at = Some(self.sink.start_of(value));
        }
    }

    fn record_debug(&mut self, _: &Field, _: &dyn fmt::Debug) {}
}

struct DeliveryTimer {
    sinks: Sinks,
}

impl<S> Layer<S> for DeliveryTimer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        let opened = if attrs.metadata().name() == "handoff" {
            Opened {
                at: Instant::now(),
                copy: true,
            }
        } else {
            let mut published = PublishedAt {
                sink: &self.sinks.settled,
                at: None,
            };
            attrs.record(&mut published);
            let at = published.at.unwrap_or_else(Instant::now);
            Opened { at, copy: false }
        };
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(opened);
        }
    }

    fn on_close(&self, id: span::Id, ctx: Context<'_, S>) {
        let closed = Instant::now();
        if let Some(span) = ctx.span(&id)
            && let Some(opened) = span.extensions().get::<Opened>()
        {
            let sink = if opened.copy {
                &self.sinks.copies
            } else {
                &self.sinks.settled
            };
            sink.push_at(opened.at, closed);
        }
    }
}
