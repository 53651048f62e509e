//! W3C trace context through the real node, seen by an in-memory OpenTelemetry exporter: a
//! delivery's `traceparent` parents its span, on its first delivery and on its retry; the DLQ
//! copy of a message the gate refused keeps it; a handoff runs in a `handoff` span inside its
//! delivery's; and a message the publisher sent inside a span is consumed as that span's
//! child.

mod common;

use std::time::Duration;

use common::{config, header_str, props, scenario};
use lapin::types::{AMQPValue, FieldTable};
use lily::prelude::*;
use opentelemetry::trace::{SpanId, TraceContextExt, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT: &str = "00f067aa0ba902b7";
const REFUSED_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";

fn traced(parent: &str) -> FieldTable {
    let mut table = FieldTable::default();
    table.insert("traceparent".into(), AMQPValue::LongString(parent.into()));
    table
}

fn spans_of<'a>(spans: &'a [SpanData], message_id: &str) -> Vec<&'a SpanData> {
    spans
        .iter()
        .filter(|s| s.name == "delivery")
        .filter(|s| {
            s.attributes
                .iter()
                .any(|kv| kv.key.as_str() == "message_id" && kv.value.as_str() == message_id)
        })
        .collect()
}

fn attribute(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.as_str().into_owned())
}

/// The `handoff` spans whose parent is one of `deliveries`.
fn handoffs_in<'a>(spans: &'a [SpanData], deliveries: &[&SpanData]) -> Vec<&'a SpanData> {
    spans
        .iter()
        .filter(|s| s.name == "handoff")
        .filter(|s| {
            deliveries
                .iter()
                .any(|d| d.span_context.span_id() == s.parent_span_id)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traceparent_parents_every_delivery_of_its_message() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("lily-test")))
        .with(tracing_subscriber::EnvFilter::new("info"));
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");

    // Fails its first attempt, succeeds on its retry.
    let router = Router::new().route("order.placed", |Attempt(attempt): Attempt| async move {
        match attempt {
            1 => Err(QueueHandlerError::retryable("stock service unavailable")),
            _ => Ok(()),
        }
    });
    let (broker, queue, client, running) =
        scenario("trace", router, |q| config(q, QueueKind::Classic)).await;
    let traced_props =
        props("t-1", "order.placed").with_headers(traced(&format!("00-{TRACE}-{PARENT}-01")));
    client.publish(&queue, b"{}", traced_props).await;
    // No type: the gate refuses it, and its sanitized DLQ copy keeps only a valid traceparent.
    let refused = lapin::BasicProperties::default()
        .with_message_id("t-refused".into())
        .with_headers(traced(&format!("00-{REFUSED_TRACE}-{PARENT}-01")));
    client.publish(&queue, b"{}", refused).await;

    // Published inside a span: the consumer's span is its child.
    let publisher = Publisher::connect(broker.url()).await.expect("connect");
    let producer = tracing::info_span!("produce");
    let producer_context = producer.context().span().span_context().clone();
    let published = {
        let message = Outgoing::bytes("order.placed", "p-1", "application/json", b"{}".to_vec());
        let to = Destination::queue(&queue);
        let publish = publisher.publish(&to, message);
        tracing::Instrument::instrument(publish, producer.clone()).await
    };
    assert_eq!(published, Published::Confirmed);
    drop(producer);
    publisher.close().await;

    running
        .wait_for("both retries ACKed", Duration::from_secs(30), |t| {
            t.acked == 2 && t.retried == 2 && t.dead_lettered == 1
        })
        .await;
    let dlq = client.drain(&format!("{queue}.dlq")).await;
    running.stop().await;
    provider.force_flush().expect("flush");
    let spans = exporter.get_finished_spans().expect("spans");

    let deliveries = spans_of(&spans, "t-1");
    assert_eq!(deliveries.len(), 2, "the delivery and its retry");
    for span in &deliveries {
        assert_eq!(
            span.span_context.trace_id(),
            TraceId::from_hex(TRACE).unwrap()
        );
        assert_eq!(span.parent_span_id, SpanId::from_hex(PARENT).unwrap());
    }

    // The first attempt's retry copy, in a span of its own inside that delivery's.
    let [retry] = handoffs_in(&spans, &deliveries)[..] else {
        panic!("one handoff in t-1's deliveries")
    };
    assert_eq!(attribute(retry, "result").as_deref(), Some("Confirmed"));
    let bucket = attribute(retry, "to").expect("the lane's queue");
    assert!(bucket.starts_with(&format!("{queue}.retry")), "{bucket}");

    let [copy] = dlq.as_slice() else {
        panic!("one DLQ copy, got {}", dlq.len())
    };
    assert_eq!(
        header_str(&copy.delivery.properties, "traceparent"),
        Some(format!("00-{REFUSED_TRACE}-{PARENT}-01"))
    );
    let refused_spans = spans_of(&spans, "t-refused");
    assert_eq!(refused_spans.len(), 1);
    assert_eq!(
        refused_spans[0].span_context.trace_id(),
        TraceId::from_hex(REFUSED_TRACE).unwrap()
    );
    let [to_dlq] = handoffs_in(&spans, &refused_spans)[..] else {
        panic!("one handoff in t-refused's delivery")
    };
    assert_eq!(attribute(to_dlq, "result").as_deref(), Some("Confirmed"));
    assert_eq!(attribute(to_dlq, "to"), Some(format!("{queue}.dlq")));

    assert!(producer_context.is_valid(), "the producer span is recorded");
    let consumed = spans_of(&spans, "p-1");
    assert_eq!(consumed.len(), 2, "the delivery and its retry");
    for span in consumed {
        assert_eq!(span.span_context.trace_id(), producer_context.trace_id());
        assert_eq!(span.parent_span_id, producer_context.span_id());
    }
}
