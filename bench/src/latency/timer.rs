//! Where latencies are kept, and how Lily is timed: a `tracing_subscriber::Layer` enabled for
//! Lily's `delivery` and `handoff` spans only (one span a delivery, two with a handoff). A
//! delivery is timed from its publish ([`Sent`], for both contenders) to its span's close; a
//! `handoff` span from its opening to its close (the copy's wait for its confirm).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::{Metadata, Subscriber, span};
use tracing_subscriber::Layer;
use tracing_subscriber::filter::filter_fn;
use tracing_subscriber::layer::{Context, SubscriberExt as _};
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

    /// Records one delivery whose clock started at `started` and that was settled at `settled`.
    pub fn push(&self, started: Instant, settled: Instant) {
        let us = u32::try_from(settled.saturating_duration_since(started).as_micros())
            .unwrap_or(u32::MAX);
        let mut records = self.records.lock().unwrap_or_else(PoisonError::into_inner);
        records.push((started, us));
    }

    /// Takes every record so far, leaving the sink empty.
    pub fn take(&self) -> Vec<(Instant, u32)> {
        std::mem::take(&mut *self.records.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// When the paced publisher published each message, by the index in its id `p-{i}`.
#[derive(Debug)]
pub struct Sent {
    base: Instant,
    /// µs since `base`, plus one (zero: not published).
    at: Vec<AtomicU64>,
}

impl Sent {
    /// Room for `capacity` messages; later ones are not stamped.
    pub fn new(capacity: usize) -> Self {
        let at = (0..capacity).map(|_| AtomicU64::default()).collect();
        Self {
            base: Instant::now(),
            at,
        }
    }

    /// Message `i` is being published now.
    pub fn stamp(&self, i: u64) {
        if let Some(slot) = usize::try_from(i).ok().and_then(|i| self.at.get(i)) {
            let us = u64::try_from(self.base.elapsed().as_micros()).unwrap_or(u64::MAX - 1);
            slot.store(us + 1, Ordering::Relaxed);
        }
    }

    /// When `message_id` was published, if the publisher stamped it.
    pub fn at(&self, message_id: &str) -> Option<Instant> {
        let (_, i) = message_id.rsplit_once('-')?;
        let us = self
            .at
            .get(i.parse::<usize>().ok()?)?
            .load(Ordering::Relaxed);
        Some(self.base + Duration::from_micros(us.checked_sub(1)?))
    }
}

/// Where the timing layer and raw-batch write.
#[derive(Clone, Debug, Default)]
pub struct Sinks {
    /// Publish → settlement (the `delivery` span's close, raw-batch's covering ACK).
    pub settled: Arc<Sink>,
    /// Each copy's wait for its confirm (a `handoff` span; raw-batch's publish written to its
    /// confirm seen), keyed by its start.
    pub copies: Arc<Sink>,
}

/// Installs the timing layer as the global subscriber, feeding `sinks`.
///
/// # Panics
/// When a global subscriber is already set.
pub fn install(sinks: Sinks) {
    let only_timed = filter_fn(|meta: &Metadata<'_>| {
        meta.is_span()
            && matches!(meta.name(), "delivery" | "handoff")
            && meta.target().starts_with("lily_mq_rabbit")
    });
    let layer = DeliveryTimer(sinks).with_filter(only_timed.with_max_level_hint(LevelFilter::INFO));
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer))
        .expect("install the timing subscriber");
}

/// When the span's clock started: its delivery's publish, or a `handoff` span's opening.
struct Opened(Instant);

/// Looks the span's `message_id` field up in the sink's publish times, without copying it.
struct PublishedAt<'a>(&'a Sink, Option<Instant>);

impl Visit for PublishedAt<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message_id" {
            self.1 = Some(self.0.start_of(value));
        }
    }

    fn record_debug(&mut self, _: &Field, _: &dyn fmt::Debug) {}
}

/// The timing layer.
struct DeliveryTimer(Sinks);

impl<S> Layer<S> for DeliveryTimer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        let mut published = PublishedAt(&self.0.settled, None);
        if attrs.metadata().name() != "handoff" {
            attrs.record(&mut published);
        }
        let opened = Opened(published.1.unwrap_or_else(Instant::now));
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(opened);
        }
    }

    fn on_close(&self, id: span::Id, ctx: Context<'_, S>) {
        let closed = Instant::now();
        if let Some(span) = ctx.span(&id)
            && let Some(Opened(opened)) = span.extensions().get::<Opened>()
        {
            let copy = span.name() == "handoff";
            let sink = if copy {
                &self.0.copies
            } else {
                &self.0.settled
            };
            sink.push(*opened, closed);
        }
    }
}
