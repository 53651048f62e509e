//! A publisher started under a subscriber that would let lapin log returned messages, bodies
//! included, says so once, at WARN; under Lily's own filter (`lily::logging`) it says nothing.
//! The subscribers are scoped to this test's thread, and the warning is once per process, so
//! this is the only test in its binary.

use std::io::Write;
use std::sync::{Arc, Mutex};

use lily::prelude::*;
use lily_mq_testkit::Broker;
use tracing_subscriber::EnvFilter;

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn subscriber(filter: EnvFilter, captured: &Captured) -> impl tracing::Subscriber + Send + Sync {
    let writer = captured.clone();
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish()
}

async fn connect_and_close(url: &str) {
    let publisher = Publisher::connect(url).await.expect("connect");
    publisher.close().await;
}

// Current-thread runtime: the scoped subscriber sees what `connect` logs.
#[tokio::test]
async fn a_publisher_says_when_the_log_would_show_returned_bodies() {
    let broker = Broker::from_env();

    let quiet = Captured::default();
    {
        let _scope =
            tracing::subscriber::set_default(subscriber(lily::logging::filter("warn"), &quiet));
        connect_and_close(broker.url()).await;
    }
    assert!(!quiet.text().contains("NO_BODY_LOGS"), "{}", quiet.text());

    let loud = Captured::default();
    {
        let _scope = tracing::subscriber::set_default(subscriber(EnvFilter::new("warn"), &loud));
        connect_and_close(broker.url()).await;
        connect_and_close(broker.url()).await;
    }
    let text = loud.text();
    let warnings: Vec<&str> = text
        .lines()
        .filter(|line| line.contains(" WARN ") && line.contains("NO_BODY_LOGS"))
        .collect();
    assert_eq!(warnings.len(), 1, "{text}");
}
