//! W3C trace context across the broker (feature `otel`).
//!
//! A delivery whose `traceparent` header is valid gets it as the remote parent of its
//! `delivery` span, through tracing-opentelemetry, so the consumer's spans join the producer's
//! trace. Copies keep the header (a retry, DLQ or parking copy carries the original's headers;
//! a sanitized copy keeps only a valid `traceparent`), so each later delivery of the message
//! joins the same trace. [`Publisher`](crate::Publisher) writes the current span's context into
//! what it publishes, unless the message names a trace of its own. Without the feature these are
//! no-ops and the header is only carried on.

use lapin::types::FieldTable;
use tracing::Span;

/// Makes the trace `headers` name the parent of `span`.
#[cfg(feature = "otel")]
pub(crate) fn adopt(span: &Span, headers: Option<&FieldTable>) {
    use lily_mq_core::headers::{TRACEPARENT, TRACESTATE, is_traceparent};
    use lily_mq_core::transport::as_text;
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState,
    };
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    let Some(table) = headers else { return };
    let text = |key| table.inner().get(key).and_then(as_text);
    let Some(parent) = text(TRACEPARENT).filter(|t| is_traceparent(t)) else {
        return;
    };
    // Checked above: `00-<32 hex>-<16 hex>-<2 hex>`.
    let (trace, span_id, flags) = (&parent[3..35], &parent[36..52], &parent[53..55]);
    let (Ok(trace), Ok(span_id), Ok(flags)) = (
        TraceId::from_hex(trace),
        SpanId::from_hex(span_id),
        u8::from_str_radix(flags, 16),
    ) else {
        return;
    };
    let state = text(TRACESTATE)
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    let remote = SpanContext::new(trace, span_id, TraceFlags::new(flags), true, state);
    let context = opentelemetry::Context::new().with_remote_span_context(remote);
    // An error only says that no OpenTelemetry layer listens: nothing to join.
    let _ = span.set_parent(context);
}

#[cfg(not(feature = "otel"))]
pub(crate) fn adopt(_span: &Span, _headers: Option<&FieldTable>) {}

/// The current span's context as a `traceparent` (and `tracestate`, if any), when it has one.
#[cfg(feature = "otel")]
pub(crate) fn current() -> Option<(String, Option<String>)> {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    let context = Span::current().context();
    let span = context.span();
    let sc = span.span_context();
    if !sc.is_valid() {
        return None;
    }
    let parent = format!(
        "00-{}-{}-{:02x}",
        sc.trace_id(),
        sc.span_id(),
        sc.trace_flags().to_u8()
    );
    let state = sc.trace_state().header();
    Some((parent, (!state.is_empty()).then_some(state)))
}

#[cfg(not(feature = "otel"))]
pub(crate) fn current() -> Option<(String, Option<String>)> {
    None
}
