//! How Lily is timed: a `tracing_subscriber::Layer` that sees only Lily's `delivery` span.
//!
//! Lily opens an INFO span named `delivery` (target `lily_mq_rabbit::…`) when a delivery reaches
//! its delivery task and closes it once the delivery is settled (ACK written, or copy confirmed
//! and ACK written). The layer stamps an [`Instant`] into the span's extensions in
//! `on_new_span` and pushes the elapsed time into a [`Sink`] in `on_close`. Its filter enables
//! that one callsite and no other span or event (`Interest::never` for every other callsite,
//! INFO as the level hint), so the observer costs one span a delivery and nothing else.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use tracing::level_filters::LevelFilter;
use tracing::subscriber::Interest;
use tracing::{Metadata, Subscriber, span};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::{Context, Filter, SubscriberExt as _};
use tracing_subscriber::registry::LookupSpan;

/// Settlement latencies: when each delivery arrived and how long it took, in µs.
#[derive(Debug, Default)]
pub struct Sink(Mutex<Vec<(Instant, u32)>>);

impl Sink {
    /// Records one delivery that arrived at `arrived` and was settled now.
    pub fn push(&self, arrived: Instant) {
        self.push_at(arrived, Instant::now());
    }

    /// Records one delivery that arrived at `arrived` and was settled at `settled`.
    pub fn push_at(&self, arrived: Instant, settled: Instant) {
        let us = u32::try_from(settled.saturating_duration_since(arrived).as_micros())
            .unwrap_or(u32::MAX);
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((arrived, us));
    }

    /// Takes every record so far, leaving the sink empty.
    pub fn take(&self) -> Vec<(Instant, u32)> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// Installs the timing layer as the global subscriber, feeding `sink`.
///
/// # Panics
/// When a global subscriber is already set.
pub fn install(sink: Arc<Sink>) {
    let subscriber =
        tracing_subscriber::registry().with(DeliveryTimer { sink }.with_filter(OnlyDelivery));
    tracing::subscriber::set_global_default(subscriber).expect("install the timing subscriber");
}

/// Whether `meta` is Lily's `delivery` span.
fn is_delivery(meta: &Metadata<'_>) -> bool {
    meta.is_span() && meta.name() == "delivery" && meta.target().starts_with("lily_mq_rabbit")
}

/// The per-layer filter: Lily's `delivery` span only.
struct OnlyDelivery;

impl<S> Filter<S> for OnlyDelivery {
    fn enabled(&self, meta: &Metadata<'_>, _: &Context<'_, S>) -> bool {
        is_delivery(meta)
    }

    fn callsite_enabled(&self, meta: &'static Metadata<'static>) -> Interest {
        if is_delivery(meta) {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(LevelFilter::INFO)
    }
}

/// When the span opened.
struct Opened(Instant);

struct DeliveryTimer {
    sink: Arc<Sink>,
}

impl<S> Layer<S> for DeliveryTimer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, _: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(Opened(Instant::now()));
        }
    }

    fn on_close(&self, id: span::Id, ctx: Context<'_, S>) {
        let closed = Instant::now();
        if let Some(span) = ctx.span(&id)
            && let Some(Opened(opened)) = span.extensions().get::<Opened>()
        {
            self.sink.push_at(*opened, closed);
        }
    }
}
