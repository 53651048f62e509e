//! No message body and no header value reaches a log: a marker placed in bodies and header
//! values never appears in what every log line of a run printed, at the examples' default
//! filter with Lily's crates at TRACE. The run returns handoffs (lapin logs returned messages
//! in full), retries, refuses an envelope at the gate and succeeds. The subscriber is global,
//! so this is the only test in its binary.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{config, props};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lily::prelude::*;
use tracing_subscriber::EnvFilter;

const MARKER: &str = "MARKER-7f3a-SECRET";

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_body_or_header_value_reaches_any_log_line() {
    let captured = Captured::default();
    let writer = captured.clone();
    let filter =
        EnvFilter::new("warn,lily_mq_rabbit=trace,lily_mq_core=trace,lily=trace,lily_mq_e2e=trace")
            .add_directive(lily::logging::NO_BODY_LOGS.parse().unwrap());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .init();

    let router = Router::new().route("order.placed", |meta: Meta| async move {
        match meta.message_id().split('-').next() {
            Some("ok") => Ok(()),
            Some("retry") => Err(QueueHandlerError::retryable("downstream down")),
            _ => Err(QueueHandlerError::permanent("malformed order")),
        }
    });
    let (_, queue, client, running) =
        common::scenario("no-bodies", router, |q| config(q, QueueKind::Classic)).await;
    // The DLQ is gone: every dead-letter copy comes back as a return, then waits as a held
    // copy.
    client.delete(&format!("{queue}.dlq")).await;

    let body = format!(r#"{{"note":"{MARKER}"}}"#);
    let with_marker = |id: &str| {
        let mut headers = FieldTable::default();
        headers.insert(
            "customer-note".into(),
            AMQPValue::LongString(LongString::from(MARKER.as_bytes().to_vec())),
        );
        headers.insert(
            "x-lily-reason".into(),
            AMQPValue::LongString(LongString::from(MARKER.as_bytes().to_vec())),
        );
        props(id, "order.placed").with_headers(headers)
    };
    for i in 0..10 {
        for kind in ["ok", "retry", "dead"] {
            let id = format!("{kind}-{i}");
            client
                .publish(&queue, body.as_bytes(), with_marker(&id))
                .await;
        }
    }
    // Refused at the gate: a type no handler has, the marker in the type and the app id.
    let refused = with_marker("refused-1")
        .with_type(ShortString::from(MARKER))
        .with_app_id(ShortString::from(MARKER));
    client.publish(&queue, body.as_bytes(), refused).await;
    // A held copy (as a producer could forge one): its reason header must not be logged either.
    let mut held = with_marker("held-1");
    if let Some(headers) = held.headers().clone() {
        let mut headers = headers;
        headers.insert(
            "x-lily-held-for".into(),
            AMQPValue::LongString(LongString::from(b"dead-letter".to_vec())),
        );
        held = held.with_headers(headers);
    }
    client.publish(&queue, body.as_bytes(), held).await;

    let stats = running.stats.clone();
    let taken = lily_mq_testkit::eventually(Duration::from_secs(30), || {
        let t = stats.totals();
        t.acked >= 10 && t.retried >= 10 && t.held >= 10
    })
    .await;
    let output = || String::from_utf8(captured.0.lock().unwrap().clone()).expect("utf-8 logs");
    let totals = stats.totals();
    let report = running.stop().await;
    assert!(taken, "not every path was taken: {totals:?}\n{}", output());
    let report_json = serde_json::to_string(&report).expect("report serializes");

    let output = output();
    assert!(
        output.contains("handoff failed") && output.contains("settled"),
        "the run logged its settlements:\n{output}"
    );
    assert!(
        !output.contains(MARKER),
        "a body or header value was logged:\n{output}"
    );
    assert!(
        !report_json.contains(MARKER),
        "the report holds a body or header value"
    );
}
