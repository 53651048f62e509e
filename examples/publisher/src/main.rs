//! Publishes `LILY_COUNT` (default 100) `order.placed` messages to `LILY_QUEUE` (default
//! `orders`) at `LILY_AMQP_URL` through [`Publisher`], all in flight at once, and prints what
//! became of them: confirmed, or why not. Exit status 0 when every one was confirmed, 1
//! otherwise; the ids that were not are printed, to publish again. `RUST_LOG` (default `warn`)
//! filters its log, on stderr.

use std::collections::BTreeMap;
use std::process::ExitCode;

use lily::prelude::*;

#[derive(serde::Serialize)]
struct OrderPlaced {
    order_id: String,
    quantity: u32,
}

#[tokio::main]
async fn main() -> Result<ExitCode, Box<dyn std::error::Error>> {
    // WARN and above unless RUST_LOG says otherwise; lapin's returned messages never, as they
    // carry bodies.
    lily::logging::init("warn");
    let env = |name, default: &str| std::env::var(name).unwrap_or_else(|_| default.to_owned());
    let (queue, count) = (
        env("LILY_QUEUE", "orders"),
        env("LILY_COUNT", "100").parse()?,
    );
    let publisher = Publisher::connect(&std::env::var("LILY_AMQP_URL")?).await?;
    let mut messages = Vec::with_capacity(count);
    for n in 1..=count {
        let order = OrderPlaced {
            order_id: format!("A-{n}"),
            quantity: 1,
        };
        // The message id is the order's: a consumer with an inbox takes a republish once.
        messages.push(Outgoing::json("order.placed", &order.order_id, &order)?);
    }
    let ids: Vec<String> = messages.iter().map(|m| m.message_id().to_owned()).collect();
    let published = publisher
        .publish_all(&Destination::queue(&queue), messages)
        .await;
    publisher.close().await;

    let mut tally = BTreeMap::<String, Vec<&str>>::new();
    for (id, evidence) in ids.iter().zip(&published) {
        let name = match evidence {
            Published::Refused(reason) => format!("refused ({reason})"),
            other => format!("{other:?}").to_lowercase(),
        };
        tally.entry(name).or_default().push(id);
    }
    for (evidence, ids) in &tally {
        println!("{evidence}: {}", ids.len());
    }
    let unconfirmed: Vec<_> = tally.iter().filter(|(e, _)| *e != "confirmed").collect();
    for (evidence, ids) in &unconfirmed {
        // Returned, nacked, blocked, refused: in no queue. Timed out, failed: maybe.
        println!("not confirmed ({evidence}): {}", ids.join(" "));
    }
    Ok(if unconfirmed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
