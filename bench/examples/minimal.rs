//! The simplest consume loop an expert would write, outside the benchmark harness: the check
//! that the bench's own references (`raw-batch`, the no-ack `ceiling`) are not slower than it.
//!
//! It declares a durable queue of its own, publishes `N` persistent 512-byte JSON orders with
//! confirms, then times a plain loop: serde deserialization, one `multiple` ACK every
//! `prefetch / 2` deliveries (or `--no-ack`), on a plain multi-thread tokio runtime. It prints
//! the rate and the CPU of this process and of the broker per message.
//!
//! `SHAPE` says what each message carries besides `delivery_mode`:
//! - `plain`: nothing;
//! - `props`: `message_id`, `type`, `content_type` and `timestamp`, as Lily's publisher sets;
//! - `headers`: those and a table of two headers, Lily's schema version and publish id;
//! - `lily`: published by Lily's own publisher into Lily's topology, as the harness does.
//!
//! ```text
//! cargo run --release -p lily-mq-bench --example minimal -- AMQP_URL [PREFETCH] [N] [--no-ack]
//! ```
//! The broker's CPU is read when `LILY_RABBIT_DIR` names its data directory.

use std::time::Instant;

use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use lily::prelude::QueueKind;
use lily_mq_bench::raw::next;
use lily_mq_bench::report::fixed;
use lily_mq_bench::run::Sample;
use lily_mq_bench::{CpuMeter, Order};

/// The properties a message of `shape` is published with.
fn properties(shape: &str, n: u64) -> BasicProperties {
    let plain = BasicProperties::default().with_delivery_mode(2);
    if shape == "plain" {
        return plain;
    }
    let props = plain
        .with_message_id(format!("m-{n}").as_str().into())
        .with_type("order.placed".into())
        .with_content_type("application/json".into())
        .with_timestamp(1_796_000_000);
    if shape == "props" {
        return props;
    }
    let mut headers = FieldTable::default();
    headers.insert("x-lily-schema-version".into(), AMQPValue::LongUInt(1));
    let id = i64::try_from(n).unwrap_or(i64::MAX);
    headers.insert("x-lily-publish-id".into(), AMQPValue::LongLongInt(id));
    props.with_headers(headers)
}

/// Declares `queue` and fills it with `n` messages of `shape`, confirmed.
async fn fill(connection: &Connection, url: &str, queue: &str, shape: &str, n: u64) {
    if shape == "lily" {
        let delays = lily::consumer::Policy::default().retry_delays;
        lily_mq_bench::fresh_topology(url, queue, QueueKind::Classic, &delays).await;
        let n = usize::try_from(n).expect("a count that fits");
        lily_mq_bench::publish(url, queue, n).await;
        return;
    }
    let channel = lily_mq_bench::raw::confirm_channel(connection).await;
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let declared = channel.queue_declare(queue.into(), durable, FieldTable::default());
    declared.await.expect("queue.declare");
    let body = Order::body();
    for i in 0..n {
        let (options, properties) = (BasicPublishOptions::default(), properties(shape, i));
        let publish = channel.basic_publish("".into(), queue.into(), options, &body, properties);
        publish.await.expect("publish");
        if (i + 1) % 2_000 == 0 || i + 1 == n {
            channel.wait_for_confirms().await.expect("confirms");
        }
    }
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let no_ack = args.iter().any(|a| a == "--no-ack");
    let mut args = args.into_iter().filter(|a| a != "--no-ack");
    let url = args
        .next()
        .expect("usage: minimal AMQP_URL [PREFETCH] [N] [--no-ack]");
    let prefetch: u16 = args.next().map_or(500, |a| a.parse().expect("a prefetch"));
    let n: u64 = args.next().map_or(30_000, |a| a.parse().expect("a count"));
    let shape = std::env::var("SHAPE").unwrap_or_else(|_| "plain".into());
    let queue = format!("minimal-{}", std::process::id());
    let connection = Connection::connect(&url, ConnectionProperties::default())
        .await
        .expect("connect");
    fill(&connection, &url, &queue, &shape, n).await;

    let channel = connection.create_channel().await.expect("channel");
    let qos = channel.basic_qos(prefetch, BasicQosOptions::default());
    qos.await.expect("basic.qos");
    let options = BasicConsumeOptions {
        no_ack,
        ..BasicConsumeOptions::default()
    };
    let consume = channel.basic_consume(
        queue.as_str().into(),
        "".into(),
        options,
        FieldTable::default(),
    );
    let mut consumer = consume.await.expect("basic.consume");
    let (cpu, started) = (CpuMeter::start(), Instant::now());
    let batch = u64::from((prefetch / 2).max(1));
    let mut count = 0;
    while count < n {
        let Some(delivery) = next(&mut consumer).await else {
            break;
        };
        let delivery = delivery.expect("a delivery");
        let order: Order = serde_json::from_slice(&delivery.data).expect("an order");
        std::hint::black_box(order);
        count += 1;
        if !no_ack && (count % batch == 0 || count == n) {
            let ack = channel.basic_ack(delivery.delivery_tag, BasicAckOptions { multiple: true });
            ack.await.expect("ack");
        }
    }
    let mut run = Sample::new(count, n, started.elapsed());
    cpu.stop(&mut run);
    let no_ack = if no_ack { " no-ack" } else { "" };
    println!(
        "minimal {shape}{no_ack}: {count} in {:.3} s = {:.0} msg/s, cpu µs/msg client {} broker {}",
        run.secs,
        run.msgs_per_sec,
        fixed(run.client_cpu_us_per_msg, 1),
        fixed(run.broker_cpu_us_per_msg, 1),
    );
    let delete = channel.queue_delete(queue.as_str().into(), QueueDeleteOptions::default());
    let _ = delete.await;
}
