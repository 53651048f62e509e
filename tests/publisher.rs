//! `lily::Publisher` against the real node, checked by message id from outside Lily: many
//! concurrent publishes, some unroutable, each answered with its own evidence; a full quorum
//! queue's nacks; messages the consumer's gate would refuse never published.

use std::collections::BTreeMap;
use std::sync::Arc;

use lapin::types::{AMQPValue, FieldTable};
use lily::prelude::*;
use lily_mq_testkit::{Broker, Client};

/// 600 publishes in flight at once, every fifth to a queue that does not exist: each routable
/// one is confirmed and in the queue exactly once, each unroutable one says returned, and no
/// return is taken for another message's (the batches mix both).
async fn concurrent_publishes_each_get_their_own_evidence(quorum: bool) {
    let broker = Broker::from_env();
    let queue = Broker::unique(if quorum { "pubq" } else { "pubc" });
    let client = Client::connect(broker.url()).await;
    client.declare(&queue, quorum).await;
    let publisher = Arc::new(Publisher::connect(broker.url()).await.expect("connect"));
    let (to, nowhere) = (
        Destination::queue(&queue),
        Destination::queue(&format!("{queue}.missing")),
    );
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..600 {
        let (publisher, to) = (
            Arc::clone(&publisher),
            if i % 5 == 0 {
                nowhere.clone()
            } else {
                to.clone()
            },
        );
        tasks.spawn(async move {
            let id = format!("m-{i}");
            let message = Outgoing::json("order.placed", &id, &serde_json::json!({ "n": i }))
                .expect("serializes");
            (i, publisher.publish(&to, message).await)
        });
    }
    let mut confirmed = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        let (i, published) = joined.expect("publish task");
        let expected = if i % 5 == 0 {
            Published::Returned
        } else {
            Published::Confirmed
        };
        assert_eq!(published, expected, "message m-{i}");
        if published.is_confirmed() {
            confirmed.push(format!("m-{i}"));
        }
    }
    let found = client.drain_ids(&queue).await;
    let doubled: Vec<_> = found.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        doubled.is_empty(),
        "ids not present exactly once: {doubled:?}"
    );
    confirmed.sort();
    assert_eq!(found.keys().cloned().collect::<Vec<_>>(), confirmed);
    Arc::into_inner(publisher)
        .expect("tasks done")
        .close()
        .await;
    client.delete(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_publishes_each_get_their_own_evidence_classic() {
    concurrent_publishes_each_get_their_own_evidence(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_publishes_each_get_their_own_evidence_quorum() {
    concurrent_publishes_each_get_their_own_evidence(true).await;
}

/// What a publish sets: id, type, content type, schema version, persistence, and the
/// application's own headers; `publish_all` answers in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_carries_what_the_consumer_reads() {
    let broker = Broker::from_env();
    let queue = Broker::unique("pubprops");
    let client = Client::connect(broker.url()).await;
    client.declare(&queue, false).await;
    let publisher = Publisher::connect(broker.url()).await.expect("connect");
    let messages = (0..50).map(|i| {
        Outgoing::json(
            "order.placed",
            &format!("p-{i}"),
            &serde_json::json!({ "n": i }),
        )
        .expect("serializes")
        .schema_version(2)
        .header("tenant", "acme")
    });
    let results = publisher
        .publish_all(&Destination::queue(&queue), messages)
        .await;
    assert_eq!(results, vec![Published::Confirmed; 50]);
    let got = client.drain(&queue).await;
    assert_eq!(got.len(), 50);
    let by_id: BTreeMap<_, _> = got
        .iter()
        .map(|m| {
            (
                m.delivery
                    .properties
                    .message_id()
                    .clone()
                    .unwrap()
                    .to_string(),
                m,
            )
        })
        .collect();
    let first = &by_id["p-7"].delivery;
    let p = &first.properties;
    assert_eq!(p.kind().as_ref().map(|s| s.as_str()), Some("order.placed"));
    assert_eq!(
        p.content_type().as_ref().map(|s| s.as_str()),
        Some("application/json")
    );
    assert_eq!(*p.delivery_mode(), Some(2));
    let headers = p.headers().as_ref().expect("headers").inner();
    assert_eq!(headers.get("schema-version"), Some(&AMQPValue::LongUInt(2)));
    assert_eq!(
        headers.get("tenant"),
        Some(&AMQPValue::LongString("acme".into()))
    );
    assert!(headers.contains_key(lily::rabbit::PUBLISH_ID));
    assert_eq!(first.data, br#"{"n":7}"#);
    publisher.close().await;
    client.delete(&queue).await;
}

/// A quorum queue with `reject-publish` holds about 5; of 20 publishes, those it took are
/// confirmed and the others nacked, by id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_quorum_queue_nacks_what_it_did_not_take() {
    let broker = Broker::from_env();
    let queue = Broker::unique("pubfull");
    let client = Client::connect(broker.url()).await;
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    args.insert("x-max-length".into(), AMQPValue::LongInt(5));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    client.declare_with(&queue, args).await;
    let publisher = Publisher::connect(broker.url()).await.expect("connect");
    let to = Destination::queue(&queue);
    let mut confirmed = Vec::new();
    for i in 0..20 {
        let id = format!("f-{i:02}");
        let message = Outgoing::json("order.placed", &id, &i).expect("serializes");
        match publisher.publish(&to, message).await {
            Published::Confirmed => confirmed.push(id),
            Published::Nacked => {}
            other => panic!("{id}: {other:?}"),
        }
    }
    // A quorum queue checks its length when it applies a publish, so one or two more may get
    // in than the limit says; what matters is that the evidence says which.
    assert!(
        (5..=7).contains(&confirmed.len()),
        "confirmed: {confirmed:?}"
    );
    let found = client.drain_ids(&queue).await;
    assert_eq!(found.keys().cloned().collect::<Vec<_>>(), confirmed);
    assert!(found.values().all(|n| *n == 1));
    publisher.close().await;
    client.delete(&queue).await;
}

/// What the consumer's gate would refuse is refused before it is published, with a reason
/// that never quotes the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_gate_would_refuse_is_never_published() {
    let broker = Broker::from_env();
    let queue = Broker::unique("pubgate");
    let client = Client::connect(broker.url()).await;
    client.declare(&queue, false).await;
    let publisher = Publisher::connect(broker.url()).await.expect("connect");
    let to = Destination::queue(&queue);
    let secret = "card-4111-secret";
    let cases = [
        Outgoing::bytes("order.placed", "has space", "text/plain", secret.into()),
        Outgoing::bytes("", "ok-id", "text/plain", secret.into()),
        Outgoing::bytes(
            "order.placed",
            "big",
            "text/plain",
            vec![b'x'; 2 * 1024 * 1024],
        ),
        Outgoing::bytes("order.placed", "spoof", "text/plain", secret.into())
            .header("x-lily-attempt", 9i64),
        Outgoing::bytes("order.placed", "long-header", "text/plain", secret.into())
            .header("note", "y".repeat(100_000)),
    ];
    for message in cases {
        let id = message.message_id().to_owned();
        match publisher.publish(&to, message).await {
            Published::Refused(reason) => {
                assert!(!reason.as_str().contains(secret), "{id}: {reason}");
            }
            other => panic!("{id}: {other:?}"),
        }
    }
    assert!(
        client.drain(&queue).await.is_empty(),
        "nothing was published"
    );
    publisher.close().await;
    client.delete(&queue).await;
}

/// A URL with a wrong password is refused at connect, and the error does not repeat it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_are_refused_at_connect() {
    let broker = Broker::from_env();
    let url = broker
        .url()
        .replacen("guest:guest", "guest:hunter2-wrong", 1);
    let err = Publisher::connect(&url).await.expect_err("refused");
    let text = format!("{err} {err:?}");
    assert!(matches!(err, lily::rabbit::Error::Refused { .. }), "{text}");
    assert!(!text.contains("hunter2"), "{text}");
}
