//! `lily::Publisher` against the real node, checked by message id from outside Lily: many
//! concurrent publishes, some unroutable or to a missing exchange, each answered with its own
//! evidence; a full quorum queue's nacks; messages the consumer's gate would refuse never
//! published.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use lapin::types::{AMQPValue, FieldTable};
use lily::prelude::*;
use lily_mq_testkit::{Broker, Client, eventually_every};

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

/// Publishes go out while earlier ones still await their confirms, as they must while the
/// broker syncs its queues to disk: with every confirm held back in a proxy, eight publishes
/// made one after the other (two on each confirm channel) all reach the broker. Once the
/// confirms are released each is confirmed, and each id is in the queue exactly once. They
/// must all go out within 100 ms of the last confirm, before the connection looks quiet and a
/// probe goes first, so the test looks for each every millisecond.
async fn publishes_go_out_while_earlier_confirms_are_held(quorum: bool) {
    const N: u64 = 8;
    let broker = Broker::from_env();
    let queue = Broker::unique(if quorum { "pipeq" } else { "pipec" });
    let client = Client::connect(broker.url()).await;
    client.declare(&queue, quorum).await;
    let proxy = lily_mq_testkit::FaultProxy::start(broker.addr()).await;
    proxy.disarm();
    let publisher = Arc::new(
        Publisher::connect(&proxy.url(broker.url()))
            .await
            .expect("connect"),
    );
    let to = Destination::queue(&queue);
    let publish = |id: String| {
        let (publisher, to) = (Arc::clone(&publisher), to.clone());
        async move {
            let message = Outgoing::json("order.placed", &id, &serde_json::json!({ "id": id }))
                .expect("serializes");
            publisher.publish(&to, message).await
        }
    };
    let mut expected = Vec::new();
    let mut proven = false;
    for attempt in 0..3 {
        // Confirmed just before, so the connection is not quiet and no probe goes first, and
        // each of the pool's confirm channels is open (with every frame from the broker held,
        // no channel could open).
        let mut warming = tokio::task::JoinSet::new();
        for w in 0..8 {
            let warm = format!("warm-{attempt}-{w}");
            expected.push(warm.clone());
            warming.spawn(publish(warm));
        }
        while let Some(joined) = warming.join_next().await {
            assert_eq!(joined.expect("publish task"), Published::Confirmed);
        }
        proxy.hold_confirms(true);
        let (before, probes) = (
            proxy.publishes_to(&queue),
            proxy.publishes_to("amq.lily.probe"),
        );
        let mut tasks = tokio::task::JoinSet::new();
        let mut reached = 0;
        for i in 0..N {
            let id = format!("m-{attempt}-{i}");
            expected.push(id.clone());
            tasks.spawn(publish(id));
            let sent = || proxy.publishes_to(&queue) == before + i + 1;
            let every = Duration::from_millis(1);
            if !eventually_every(every, Duration::from_secs(3), sent).await {
                break;
            }
            reached = i + 1;
        }
        // A probe means the connection looked quiet (the machine stalled for 100 ms): the
        // publishes after it wait for its confirm by design, so this attempt proves nothing.
        let probed = proxy.publishes_to("amq.lily.probe") > probes;
        proxy.hold_confirms(false);
        while let Some(joined) = tasks.join_next().await {
            assert_eq!(joined.expect("publish task"), Published::Confirmed);
        }
        if !probed {
            assert_eq!(
                reached, N,
                "publishes that reached the broker while confirms were held"
            );
            proven = true;
            break;
        }
    }
    assert!(proven, "a probe went out in every attempt");
    let found = client.drain_ids(&queue).await;
    let doubled: Vec<_> = found.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        doubled.is_empty(),
        "ids not present exactly once: {doubled:?}"
    );
    expected.sort();
    assert_eq!(found.keys().cloned().collect::<Vec<_>>(), expected);
    Arc::into_inner(publisher)
        .expect("tasks done")
        .close()
        .await;
    client.delete(&queue).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_go_out_while_earlier_confirms_are_held_classic() {
    publishes_go_out_while_earlier_confirms_are_held(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishes_go_out_while_earlier_confirms_are_held_quorum() {
    publishes_go_out_while_earlier_confirms_are_held(true).await;
}

/// What a publish sets: id, type, content type, schema version, persistence, and the
/// application's own headers; `publish_all` answers in order.
/// 300 publishes in flight at once, every third to an exchange that does not exist (the broker
/// closes the channel with `NOT_FOUND`): each of those says no exchange, never failed, so a
/// caller knows to stop rather than publish again; the rest are confirmed or, sharing a closed
/// channel, failed, and the queue holds each confirmed one exactly once and nothing else. The
/// publisher goes on publishing on fresh channels afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_exchange_is_told_apart_from_a_failure() {
    let broker = Broker::from_env();
    let queue = Broker::unique("pubx");
    let client = Client::connect(broker.url()).await;
    client.declare(&queue, false).await;
    let publisher = Arc::new(Publisher::connect(broker.url()).await.expect("connect"));
    let (to, missing) = (
        Destination::queue(&queue),
        Destination::exchange(&format!("{queue}.no-such-exchange"), "k"),
    );
    let publish_all = |round: &'static str, with_missing: bool| {
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..300 {
            let to = if with_missing && i % 3 == 0 {
                missing.clone()
            } else {
                to.clone()
            };
            let publisher = Arc::clone(&publisher);
            tasks.spawn(async move {
                let id = format!("{round}-{i}");
                let message = Outgoing::json("order.placed", &id, &serde_json::json!({ "n": i }))
                    .expect("serializes");
                (i, id, publisher.publish(&to, message).await)
            });
        }
        tasks
    };
    let mut tasks = publish_all("a", true);
    let (mut confirmed, mut failed, mut tally) = (Vec::new(), Vec::new(), BTreeMap::new());
    while let Some(joined) = tasks.join_next().await {
        let (i, id, published) = joined.expect("publish task");
        *tally.entry(format!("{published:?}")).or_insert(0) += 1;
        if i % 3 == 0 {
            assert_eq!(published, Published::NoExchange, "{id}");
            assert!(published.is_absent());
        } else {
            match published {
                Published::Confirmed => confirmed.push(id),
                Published::Failed => failed.push(id),
                other => panic!("{id}: {other:?}"),
            }
        }
    }
    let mut tasks = publish_all("b", false);
    while let Some(joined) = tasks.join_next().await {
        let (_, id, published) = joined.expect("publish task");
        assert_eq!(
            published,
            Published::Confirmed,
            "{id}, after the channels closed"
        );
        confirmed.push(id);
    }
    let found = client.drain_ids(&queue).await;
    for id in &confirmed {
        assert_eq!(found.get(id), Some(&1), "{id} confirmed: in the queue once");
    }
    for (id, n) in &found {
        assert!(
            *n == 1 && (confirmed.contains(id) || failed.contains(id)),
            "{id} found {n} times, published {tally:?}"
        );
    }
    Arc::into_inner(publisher)
        .expect("tasks done")
        .close()
        .await;
    client.delete(&queue).await;
}

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
    assert!(headers.contains_key(lily::publish::PUBLISH_ID));
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
    assert!(matches!(err, lily::Error::Refused { .. }), "{text}");
    assert!(!text.contains("hunter2"), "{text}");
}

/// A fresh publisher's first publish waits for the probe that checks its connection, then goes
/// out: it is never left waiting for its deadline when the probe's confirm comes in while the
/// worker is still busy publishing it. 320 fresh publishers, eight at a time, each publishing
/// one message: every one confirmed, and each id in the queue once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_publish_of_a_fresh_publisher_goes_out_after_its_probe() {
    const TASKS: usize = 8;
    const EACH: usize = 40;
    let broker = Broker::from_env();
    let queue = Broker::unique("first");
    let client = Client::connect(broker.url()).await;
    client.declare(&queue, false).await;
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..TASKS {
        let (url, queue) = (broker.url().to_owned(), queue.clone());
        tasks.spawn(async move {
            let mut answers = Vec::new();
            for i in 0..EACH {
                let config = PublisherConfig::default().confirm_timeout(Duration::from_secs(3));
                let publisher = Publisher::connect_with(&url, config)
                    .await
                    .expect("connect");
                let id = format!("f-{t}-{i}");
                let message =
                    Outgoing::bytes("order.placed", &id, "application/json", b"{}".to_vec());
                answers.push((
                    id,
                    publisher
                        .publish(&Destination::queue(&queue), message)
                        .await,
                ));
                publisher.close().await;
            }
            answers
        });
    }
    let mut sent = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        for (id, published) in joined.expect("publishing task") {
            assert_eq!(published, Published::Confirmed, "{id}");
            sent.push(id);
        }
    }
    let found = client.drain_ids(&queue).await;
    sent.sort();
    assert_eq!(found.keys().cloned().collect::<Vec<_>>(), sent);
    assert!(found.values().all(|n| *n == 1), "an id twice: {found:?}");
    client.delete(&queue).await;
}
