//! Liveness and readiness over HTTP (feature `health`).
//!
//! `GET /livez` answers 200 while the process serves requests; `GET /readyz` answers 200 while
//! the consumer is consuming and 503 otherwise (before it connects, while it reconnects and from
//! the start of draining), so Kubernetes stops routing to a pod that is shutting down. While the
//! broker blocks the handoff connection (a resource alarm), `/readyz` still answers 200, since
//! deliveries are still consumed and ACKed, and its body adds `handoffs blocked`; likewise
//! `lane failing: <queue>` for each lane whose latest handoff failed.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::consumer::Stats;

/// The `/readyz` status and body. Still consuming, the consumer is ready even while handoffs
/// wait for the broker or a lane fails: successes are ACKed, failures wait (see
/// [`Stats::failing_lanes`]).
fn readiness(stats: &Stats) -> (&'static str, String) {
    if !stats.ready() {
        return ("503 Service Unavailable", "not ready\n".to_owned());
    }
    let mut body = "ready\n".to_owned();
    if stats.handoffs_blocked() {
        body.push_str("handoffs blocked\n");
    }
    for lane in stats.failing_lanes() {
        body.push_str("lane failing: ");
        body.push_str(&lane);
        body.push('\n');
    }
    ("200 OK", body)
}

/// Serves `/livez` and `/readyz` on `addr` until the task is aborted.
///
/// # Errors
/// The address could not be bound.
pub async fn serve(
    addr: SocketAddr,
    stats: Stats,
) -> std::io::Result<(SocketAddr, JoinHandle<()>)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let task = tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let stats = stats.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 512];
                let Ok(Ok(n)) =
                    tokio::time::timeout(std::time::Duration::from_secs(2), stream.read(&mut buf))
                        .await
                else {
                    return;
                };
                let request = &buf[..n];
                let (status, body) = if request.starts_with(b"GET /livez ") {
                    ("200 OK", "live\n".to_owned())
                } else if request.starts_with(b"GET /readyz ") {
                    readiness(&stats)
                } else {
                    ("404 Not Found", "not found\n".to_owned())
                };
                let response = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(response.as_bytes()).await;
            });
        }
    });
    Ok((local, task))
}
