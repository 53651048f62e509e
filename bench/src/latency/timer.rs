//! Where latencies are kept, and how Lily is timed: a `tracing_subscriber::Layer` enabled for
//! Lily's `delivery` and `handoff` spans only (one span a delivery, two with a handoff). A
//! delivery is timed from its publish ([`stamp_slots`], for both contenders) to its span's
//! close; a `handoff` span from its opening to its close (the copy's wait for its confirm).

use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Instant;

use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::{Metadata, Subscriber, span};
use tracing_subscriber::Layer;
use tracing_subscriber::filter::filter_fn;
use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::registry::LookupSpan;

use crate::latency::Latencies;

/// Latencies: when each message's clock started and how long it took, in µs.
pub struct Sink(Mutex<Vec<(Instant, u32)>>);

/// Publish → settlement (the `delivery` span's close, raw-batch's covering ACK).
pub static SETTLED: Sink = Sink(Mutex::new(Vec::new()));
/// Each copy's wait for its confirm (a `handoff` span; raw-batch's publish written to its
/// confirm seen), keyed by its start.
pub static COPIES: Sink = Sink(Mutex::new(Vec::new()));

/// When the paced publisher of the run in progress published each message, by the index in its
/// id `p-{i}`.
static SENT: Mutex<Option<Arc<[OnceLock<Instant>]>>> = Mutex::new(None);

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Sink {
    /// Records one delivery whose clock started at `started` and that was settled at `settled`.
    pub fn push(&self, started: Instant, settled: Instant) {
        let us = u32::try_from(settled.saturating_duration_since(started).as_micros())
            .unwrap_or(u32::MAX);
        lock(&self.0).push((started, us));
    }

    /// Empties the sink; returns the percentiles of the records whose clock started in `window`.
    pub fn take(&self, window: Range<Instant>) -> Latencies {
        let records = std::mem::take(&mut *lock(&self.0));
        let kept = records.into_iter().filter(|(at, _)| window.contains(at));
        Latencies::of(kept.map(|(_, us)| us).collect())
    }
}

/// Times the deliveries from now on from the publish times of the paced publisher's next `n`
/// messages, which it stamps in the slots returned (later ones are not stamped).
pub fn stamp_slots(n: usize) -> Arc<[OnceLock<Instant>]> {
    let sent: Arc<[OnceLock<Instant>]> = (0..n).map(|_| OnceLock::new()).collect();
    *lock(&SENT) = Some(Arc::clone(&sent));
    sent
}

/// When the message `message_id` was published; now, when the paced publisher did not stamp it
/// (the drain runs, whose latencies are not kept).
pub fn published_at(message_id: &str) -> Instant {
    let sent = lock(&SENT);
    let i = message_id
        .rsplit_once('-')
        .and_then(|(_, i)| i.parse().ok());
    let at = i.and_then(|i: usize| sent.as_ref()?.get(i)?.get().copied());
    at.unwrap_or_else(Instant::now)
}

/// Installs the timing layer as the global subscriber, feeding [`SETTLED`] and [`COPIES`].
///
/// # Panics
/// When a global subscriber is already set.
pub fn install() {
    let only_timed = filter_fn(|meta: &Metadata<'_>| {
        meta.is_span()
            && matches!(meta.name(), "delivery" | "handoff")
            && meta.target().starts_with("lily_mq_rabbit")
    });
    let layer = DeliveryTimer.with_filter(only_timed.with_max_level_hint(LevelFilter::INFO));
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer))
        .expect("install the timing subscriber");
}

/// When the span's clock started: its delivery's publish (looked up by its `message_id` field,
/// without copying it), or a `handoff` span's opening.
struct Opened(Instant);

impl Visit for Opened {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message_id" {
            self.0 = published_at(value);
        }
    }

    fn record_debug(&mut self, _: &Field, _: &dyn fmt::Debug) {}
}

/// The timing layer.
struct DeliveryTimer;

impl<S> Layer<S> for DeliveryTimer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        let mut opened = Opened(Instant::now());
        if attrs.metadata().name() != "handoff" {
            attrs.record(&mut opened);
        }
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(opened);
        }
    }

    fn on_close(&self, id: span::Id, ctx: Context<'_, S>) {
        let closed = Instant::now();
        if let Some(span) = ctx.span(&id)
            && let Some(Opened(opened)) = span.extensions().get::<Opened>()
        {
            let sink = if span.name() == "handoff" {
                &COPIES
            } else {
                &SETTLED
            };
            sink.push(*opened, closed);
        }
    }
}
