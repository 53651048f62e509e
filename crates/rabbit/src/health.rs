//! Liveness, readiness and metrics over HTTP (feature `health`), served by hyper.
//!
//! - `GET /livez` answers 200 while the process serves requests.
//! - `GET /readyz` answers 200 while the consumer is consuming and 503 otherwise (before it
//!   connects, while it reconnects and from the start of draining), so Kubernetes stops routing
//!   to a pod that is shutting down. While the broker blocks the handoff connection (a resource
//!   alarm), `/readyz` still answers 200, since deliveries are still consumed and ACKed, and
//!   its body adds `handoffs blocked`; likewise `lane failing: <queue>` for each lane whose
//!   latest handoff failed, and `handoffs refused: <the permission, its resource and what
//!   for>` while the broker refuses handoff copies for want of a permission: failures are then
//!   held unacknowledged and may fill the prefetch.
//! - `GET /metrics` answers every `lily_*` metric in the Prometheus text format, through a
//!   `metrics-exporter-prometheus` recorder that [`serve`] installs for the process. An
//!   application that installed another recorder first keeps it, and `/metrics` answers 404
//!   saying so.
//!
//! ```no_run
//! # async fn run(consumer: lily_mq_rabbit::Consumer) -> std::io::Result<()> {
//! // Before `run`, so the consumer's metrics are registered with the recorder.
//! let (addr, _server) =
//!     lily_mq_rabbit::health::serve("0.0.0.0:8080".parse().unwrap(), consumer.stats()).await?;
//! # Ok(()) }
//! ```

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tracing::{debug, warn};

use crate::consumer::Stats;

/// How long a client may take to send its request head.
const HEADER_TIMEOUT: Duration = Duration::from_secs(2);

/// The process's Prometheus recorder, installed by the first [`serve`]; `None` when another
/// recorder was installed first.
static PROMETHEUS: OnceLock<Option<PrometheusHandle>> = OnceLock::new();

fn prometheus() -> Option<&'static PrometheusHandle> {
    PROMETHEUS
        .get_or_init(|| match PrometheusBuilder::new().install_recorder() {
            Ok(handle) => Some(handle),
            Err(err) => {
                warn!(error = %err, "/metrics is off: another metrics recorder is installed");
                None
            }
        })
        .as_ref()
}

/// The `/readyz` status and body. Still consuming, the consumer is ready even while handoffs
/// wait for the broker or a lane fails: successes are ACKed, failures wait (see
/// [`Stats::failing_lanes`]).
fn readiness(stats: &Stats) -> (StatusCode, String) {
    if !stats.ready() {
        return (StatusCode::SERVICE_UNAVAILABLE, "not ready\n".to_owned());
    }
    let mut body = "ready\n".to_owned();
    if stats.handoffs_blocked() {
        body.push_str("handoffs blocked\n");
    }
    if let Some(missing) = stats.handoffs_refused() {
        body.push_str(&format!("handoffs refused: {missing}\n"));
    }
    for lane in stats.failing_lanes() {
        body.push_str("lane failing: ");
        body.push_str(&lane);
        body.push('\n');
    }
    (StatusCode::OK, body)
}

/// Answers one request.
fn answer(request: &Request<Incoming>, stats: &Stats) -> Response<Full<Bytes>> {
    const TEXT: &str = "text/plain; charset=utf-8";
    let (status, content_type, body) = match (request.method(), request.uri().path()) {
        (&Method::GET, "/livez") => (StatusCode::OK, TEXT, "live\n".to_owned()),
        (&Method::GET, "/readyz") => {
            let (status, body) = readiness(stats);
            (status, TEXT, body)
        }
        (&Method::GET, "/metrics") => match prometheus() {
            Some(handle) => (
                StatusCode::OK,
                "text/plain; version=0.0.4; charset=utf-8",
                handle.render(),
            ),
            None => (
                StatusCode::NOT_FOUND,
                TEXT,
                "metrics: another recorder is installed\n".to_owned(),
            ),
        },
        (&Method::GET, _) => (StatusCode::NOT_FOUND, TEXT, "not found\n".to_owned()),
        _ => (
            StatusCode::METHOD_NOT_ALLOWED,
            TEXT,
            "only GET\n".to_owned(),
        ),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    response
}

/// Serves `/livez`, `/readyz` and `/metrics` on `addr` until the task is aborted; returns the
/// bound address (useful with port 0) and the task. Installs the Prometheus recorder first:
/// call it before [`Consumer::run`](crate::Consumer::run), so the consumer's metrics are
/// registered with it.
///
/// # Errors
/// The address could not be bound.
pub async fn serve(
    addr: SocketAddr,
    stats: Stats,
) -> std::io::Result<(SocketAddr, JoinHandle<()>)> {
    let _ = prometheus();
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let task = tokio::spawn(async move {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(err) => {
                    // Out of file descriptors, say: wait instead of spinning.
                    debug!(error = %err, "health endpoint: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let stats = stats.clone();
            tokio::spawn(async move {
                let service = service_fn(move |request: Request<Incoming>| {
                    let response = answer(&request, &stats);
                    async move { Ok::<_, Infallible>(response) }
                });
                let served = http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEADER_TIMEOUT)
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
                if let Err(err) = served {
                    debug!(error = %err, "health endpoint: connection ended");
                }
            });
        }
    });
    Ok((local, task))
}
