//! A Lily service as an application outside Lily's workspace writes it: consumes
//! `LILY_QUEUE` at `LILY_AMQP_URL`, prints `handled <message id>` for each `order.placed` it
//! handles, and on SIGTERM shuts down and prints the shutdown report (JSON), its exit status
//! saying whether the shutdown was clean.

use lily::prelude::*;

#[tokio::main]
async fn main() -> Result<ShutdownReport, Box<dyn std::error::Error>> {
    let router = Router::new().route("order.placed", |meta: Meta| async move {
        println!("handled {}", meta.message_id());
        Ok::<(), QueueHandlerError>(())
    });
    let config = ConsumerConfig::new(std::env::var("LILY_QUEUE")?).prefetch(10);
    let consumer = Consumer::new(std::env::var("LILY_AMQP_URL")?, config, router);
    Ok(consumer.run_until_signal(ReportSinks::default()).await?)
}
