//! `lily dlq` and `lily parking` against the real RabbitMQ node (and mongod for the inbox),
//! with a real Lily consumer where the lane's messages come from or go to. Every check is made
//! from outside, by message id: the queues drained, the handler's calls, the effects in the
//! database.

#[path = "../../../tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{config, fast_policy, header_str, header_u32, props};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lily::prelude::*;
use lily::topology::Topology;
use lily_mq_mongo::mongodb::bson::{Document, doc};
use lily_mq_mongo::{MongoConfig, MongoScope, MongoTx};
use lily_mq_testkit::{Broker, Client, MongoNode, eventually};

const WAIT: Duration = Duration::from_secs(60);

/// Runs `lily` with `args`, the broker's URL in the environment, stdin closed.
fn lily(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(args)
        .env("LILY_AMQP_URL", Broker::from_env().url())
        .stdin(Stdio::null())
        .output()
        .expect("run lily")
}

/// Runs `lily` with `args` and checks its exit status, showing its output when it differs.
fn exits(code: i32, args: &[&str]) -> Output {
    let out = lily(args);
    assert_eq!(
        out.status.code(),
        Some(code),
        "lily {args:?}:\n{}{}",
        stdout(&out),
        stderr(&out)
    );
    out
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}{}", stdout(out), stderr(out)))
}

fn long(text: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(text.as_bytes().to_vec()))
}

/// `table` with the seal Lily writes on a copy of `id` (the public key).
fn sealed(id: &str, mut table: FieldTable) -> FieldTable {
    let seal = lily::consumer::HeaderKey::public().seal(id, &table);
    table.insert("x-lily-seal".into(), seal);
    table
}

/// The audit lines of a command's stderr.
fn audit_lines(out: &Output) -> Vec<String> {
    stderr(out)
        .lines()
        .filter(|l| l.starts_with("lily audit:"))
        .map(str::to_owned)
        .collect()
}

fn kinds() -> [QueueKind; 2] {
    [QueueKind::Classic, QueueKind::Quorum]
}

/// What the handler saw on each call: the attempt and the headers a replay restores or adds.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Seen {
    attempt: u32,
    cc: Option<String>,
    replayed_from: Option<String>,
    replays: Option<u32>,
}

type Calls = Arc<Mutex<BTreeMap<String, Vec<Seen>>>>;

/// `order.placed` fails for good while `broken` is set and succeeds otherwise, recording every
/// call; `order.refunded` has no handler, so it is a dispatch failure.
fn shop(broken: &Arc<AtomicBool>, calls: &Calls) -> Router {
    let (broken, calls) = (Arc::clone(broken), Arc::clone(calls));
    Router::new().route("order.placed", move |meta: Meta, headers: Headers| {
        let (broken, calls) = (broken.load(Ordering::Acquire), Arc::clone(&calls));
        let seen = Seen {
            attempt: meta.attempt(),
            cc: headers
                .get_str("CC")
                .map(str::to_owned)
                .or_else(|| match headers.get("CC") {
                    Some(AMQPValue::FieldArray(a)) => a.as_slice().first().and_then(|v| match v {
                        AMQPValue::LongString(s) => {
                            Some(String::from_utf8_lossy(s.as_bytes()).into_owned())
                        }
                        _ => None,
                    }),
                    _ => None,
                }),
            replayed_from: headers.get_str("x-lily-replayed-from").map(str::to_owned),
            replays: headers
                .get("x-lily-replays")
                .and_then(lily::headers::as_u32),
        };
        calls
            .lock()
            .unwrap()
            .entry(meta.message_id().to_owned())
            .or_default()
            .push(seen);
        async move {
            if broken {
                return Err(QueueHandlerError::permanent("stock rule refused the order"));
            }
            Ok(())
        }
    })
}

/// The DLQ grouped by reason, kind and type. A replay while the cause persists replays each
/// message once, though each is back in the DLQ before the pass ends. Once fixed, a replay by
/// reason sends back exactly that group, once each, with its identity, the attempt reset, `CC`
/// restored and the replay recorded; the other group stays. Classic and quorum queues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_by_reason_sends_back_that_group_once_each_with_its_identity_restored() {
    for kind in kinds() {
        let broker = Broker::from_env();
        let queue = Broker::unique("dlq-replay");
        let broken = Arc::new(AtomicBool::new(true));
        let calls = Calls::default();
        let running = common::start(
            broker.url(),
            config(&queue, kind).prefetch(50),
            shop(&broken, &calls),
        );
        running.wait_ready().await;
        let client = Client::connect(broker.url()).await;
        let dlq = format!("{queue}.dlq");

        let placed: Vec<String> = (0..40).map(|i| format!("placed-{i}")).collect();
        let refunded: Vec<String> = (0..7).map(|i| format!("refunded-{i}")).collect();
        for id in &placed {
            let mut table = FieldTable::default();
            // Routes nowhere yet; a replay must restore it, and must not send a copy anywhere
            // through it.
            table.insert(
                "CC".into(),
                AMQPValue::FieldArray(vec![long(&format!("audit-of-{queue}"))].into()),
            );
            let p = props(id, "order.placed")
                .with_headers(table)
                .with_expiration("600000".into());
            client.publish(&queue, b"{\"qty\":1}", p).await;
        }
        for id in &refunded {
            client.send(&queue, "order.refunded", id, b"{}").await;
        }
        common::wait_settled("every order dead-lettered", &queue, 47).await;

        let out = exits(0, &["dlq", "list", "-q", &queue, "--json"]);
        let listed = json(&out);
        assert_eq!(listed["messages"], 47, "{listed}");
        let groups = listed["groups"].as_array().expect("groups");
        assert_eq!(groups.len(), 2, "{listed}");
        assert_eq!(groups[0]["count"], 40);
        assert_eq!(groups[0]["type"], "order.placed");
        assert_eq!(groups[0]["kind"], "permanent");
        assert!(
            groups[0]["reason"]
                .as_str()
                .is_some_and(|r| r.contains("stock rule")),
            "{listed}"
        );
        assert_eq!(groups[1]["count"], 7);
        assert_eq!(groups[1]["type"], "order.refunded");
        let text = lily(&["dlq", "list", "-q", &queue]);
        let text = stdout(&text);
        assert!(
            text.contains(&format!("{dlq}: 47 messages in 2 groups")),
            "{text}"
        );
        assert!(
            text.lines()
                .any(|l| l.trim_start().starts_with("40  permanent  order.placed")),
            "{text}"
        );
        // Listing put everything back (a quorum queue makes returned messages ready a moment
        // after the channel closed).
        assert_eq!(ready_soon(&client, &dlq, 47).await, 47);

        // Replayed while the cause persists, every message fails again at once and is back in
        // the DLQ while the pass goes on: each is still replayed exactly once (the pass takes
        // only as many messages as the DLQ held, from its head).
        let out = exits(0, &["dlq", "replay", "-q", &queue, "--all"]);
        assert!(
            stdout(&out).contains("replayed 47 messages"),
            "{}",
            stdout(&out)
        );
        common::wait_settled("every order dead-lettered again", &queue, 47).await;
        let twice = calls.lock().unwrap().clone();
        for id in &placed {
            assert_eq!(
                twice[id].len(),
                2,
                "{kind:?}: {id} replayed once: {:?}",
                twice[id]
            );
        }
        assert_eq!(ready_soon(&client, &dlq, 47).await, 47);

        // A queue named as the CC key: a replay through the default exchange would route a
        // copy to it.
        let audit = format!("audit-of-{queue}");
        client.declare(&audit, false).await;
        broken.store(false, Ordering::Release);
        let before: BTreeMap<String, usize> = calls
            .lock()
            .unwrap()
            .iter()
            .map(|(id, c)| (id.clone(), c.len()))
            .collect();
        let out = exits(
            0,
            &["dlq", "replay", "-q", &queue, "--reason", "stock rule"],
        );
        assert!(
            stdout(&out).contains(&format!("replayed 40 messages from {dlq} to {queue}")),
            "{}",
            stdout(&out)
        );
        common::wait_settled("the replayed orders handled", &queue, 7).await;
        let report = running.stop().await;

        let calls = calls.lock().unwrap().clone();
        for id in &placed {
            let after = &calls[id][before[id]..];
            assert_eq!(
                after.len(),
                1,
                "{id} handled once after the replay: {after:?}"
            );
            assert_eq!(
                after[0],
                Seen {
                    attempt: 1,
                    cc: Some(format!("audit-of-{queue}")),
                    replayed_from: Some("dead-letter".into()),
                    replays: Some(2),
                },
                "{id}"
            );
        }
        assert_eq!(report.totals.acked, 40, "{:?}", report.totals);
        let left = client.drain_ids(&dlq).await;
        let expected: BTreeMap<String, usize> = refunded.iter().map(|id| (id.clone(), 1)).collect();
        assert_eq!(left, expected, "{kind:?}: only the other group stays");
        assert_eq!(client.depth(&audit).await, 0, "nothing routed by CC");
        client.delete(&audit).await;
    }
}

/// The ready messages of `queue` once they reach `expected`, or after 10 s.
async fn ready_soon(client: &Client, queue: &str, expected: u32) -> u32 {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let depth = client.depth(queue).await;
        if depth == expected || std::time::Instant::now() > deadline {
            return depth;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// DLQ copies as Lily writes them, published straight into a lane that exists.
async fn seed_lane(client: &Client, lane: &str, ids: impl IntoIterator<Item = String>) {
    for id in ids {
        let mut table = FieldTable::default();
        table.insert("x-lily-failure-kind".into(), long("permanent"));
        table.insert("x-lily-reason".into(), long("handler failure: unknown sku"));
        table.insert("x-lily-attempt".into(), AMQPValue::LongUInt(3));
        table.insert(
            "x-lily-last-failure-at".into(),
            AMQPValue::LongLongInt(1_764_000_000_000),
        );
        let p = props(&id, "order.placed").with_headers(sealed(&id, table));
        client.publish(lane, b"{\"qty\":1}", p).await;
    }
}

/// A work queue and its lanes, declared as Lily would but without a consumer, with a DLQ
/// holding `seeded` copies `order-0`, `order-1`, ...
struct Lanes {
    broker: Broker,
    client: Client,
    queue: String,
    dlq: String,
}

impl Lanes {
    async fn new(prefix: &str, kind: QueueKind, seeded: usize) -> Self {
        let broker = Broker::from_env();
        let queue = Broker::unique(prefix);
        let client = Client::connect(broker.url()).await;
        let dlq = format!("{queue}.dlq");
        for name in [&queue, &dlq, &format!("{queue}.parking")] {
            client.declare(name, kind == QueueKind::Quorum).await;
        }
        seed_lane(&client, &dlq, (0..seeded).map(|i| format!("order-{i}"))).await;
        Self {
            broker,
            client,
            queue,
            dlq,
        }
    }

    /// Deletes the queues.
    async fn remove(self) {
        for name in [&self.queue, &self.dlq, &format!("{}.parking", self.queue)] {
            self.client.delete(name).await;
        }
    }
}

/// The CLI is killed with SIGKILL in the middle of a replay of 3 000 messages: every message is
/// in the DLQ or the work queue, at most one in both, none twice in one; a second replay
/// finishes the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_killed_midway_loses_nothing_and_doubles_at_most_one_message() {
    const N: usize = 3000;
    for kind in kinds() {
        let lanes = Lanes::new("dlq-kill", kind, N).await;
        let (broker, client) = (&lanes.broker, &lanes.client);
        let (queue, dlq) = (lanes.queue.clone(), lanes.dlq.clone());
        let ids: Vec<String> = (0..N).map(|i| format!("order-{i}")).collect();

        let mut child = Command::new(env!("CARGO_BIN_EXE_lily"))
            .args(["dlq", "replay", "-q", &queue, "--all"])
            .env("LILY_AMQP_URL", broker.url())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            // Its audit lines are not read here: a full pipe would stop it.
            .stderr(Stdio::null())
            .spawn()
            .expect("run lily");
        // Read over AMQP, in milliseconds: rabbitmqctl takes so long that the replay could
        // finish before the kill.
        let started = std::time::Instant::now();
        let mut midway = false;
        while !midway && started.elapsed() < WAIT {
            midway = client.depth(&queue).await >= (N / 5) as u32;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(midway, "the replay never got going");
        child.kill().expect("SIGKILL");
        let status = child.wait().expect("wait");
        assert!(!status.success(), "killed before it finished");

        // After the kill the broker puts the unacknowledged messages back into the DLQ.
        let settled = eventually(WAIT, || {
            let depths = broker.depths();
            depths.get(&dlq).copied().unwrap_or(0) + depths.get(&queue).copied().unwrap_or(0)
                >= N as u64
        })
        .await;
        assert!(settled, "messages missing: {:?}", broker.depths());
        let in_dlq = client.drain_ids(&dlq).await;
        let in_work = client.drain_ids(&queue).await;
        assert!(!in_work.is_empty() && !in_dlq.is_empty(), "killed midway");
        let mut both = 0;
        for id in &ids {
            let (d, w) = (
                in_dlq.get(id).copied().unwrap_or(0),
                in_work.get(id).copied().unwrap_or(0),
            );
            assert!(d + w >= 1, "{kind:?}: {id} lost");
            assert!(d <= 1 && w <= 1, "{kind:?}: {id} twice in one queue");
            both += usize::from(d + w == 2);
        }
        assert!(both <= 1, "{kind:?}: {both} messages in both queues");
        assert_eq!(in_dlq.len() + in_work.len(), N + both);

        // Put the DLQ's share back and finish: everything ends in the work queue, once.
        seed_lane(client, &dlq, in_dlq.keys().cloned()).await;
        let out = exits(0, &["dlq", "replay", "-q", &queue, "--all", "--json"]);
        assert_eq!(
            json(&out)["replayed"].as_array().map(Vec::len),
            Some(in_dlq.len())
        );
        let work = client.drain_ids(&queue).await;
        assert_eq!(work.len(), in_dlq.len());
        assert_eq!(client.depth(&dlq).await, 0);
        lanes.remove().await;
    }
}

/// `show` prints properties and Lily's headers, never the body unless asked; `replay
/// --dry-run` and `--batch` do what they say; a message whose `user_id` belongs to another
/// user stays in the lane unless kept aside; `purge` asks first and refuses without a
/// terminal or `--yes`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_dry_run_batch_user_id_and_purge_each_do_what_they_say() {
    let lanes = Lanes::new("dlq-ops", QueueKind::Classic, 5).await;
    let client = &lanes.client;
    let (queue, dlq) = (lanes.queue.clone(), lanes.dlq.clone());
    let mut table = FieldTable::default();
    table.insert("x-lily-failure-kind".into(), long("retryable"));
    table.insert("x-lily-reason".into(), long("attempts exhausted"));
    table.insert("x-lily-original-user-id".into(), long("producer"));
    table.insert("customer-secret".into(), long("MARKER-IN-HEADER"));
    client
        .publish(
            &dlq,
            b"MARKER-IN-BODY",
            props("foreign", "order.placed").with_headers(sealed("foreign", table)),
        )
        .await;

    let text = stdout(&exits(0, &["dlq", "show", "-q", &queue, "foreign"]));
    for expected in [
        "message_id",
        "foreign",
        "x-lily-reason",
        "attempts exhausted",
        "x-lily-original-user-id",
        "customer-secret",
        "body not shown",
    ] {
        assert!(text.contains(expected), "{expected}: {text}");
    }
    assert!(
        !text.contains("MARKER-IN-BODY") && !text.contains("MARKER-IN-HEADER"),
        "{text}"
    );
    let out = exits(0, &["dlq", "show", "-q", &queue, "foreign", "--body"]);
    assert!(stdout(&out).contains("MARKER-IN-BODY"), "{}", stdout(&out));
    let out = exits(1, &["dlq", "show", "-q", &queue, "nobody"]);
    assert!(
        stderr(&out).contains("no message with id"),
        "{}",
        stderr(&out)
    );

    let out = exits(4, &["dlq", "replay", "-q", &queue, "--all", "--dry-run"]);
    assert!(
        stdout(&out).contains("would replay 5 messages"),
        "{}",
        stdout(&out)
    );
    assert!(
        stdout(&out).contains("foreign: its original user_id"),
        "{}",
        stdout(&out)
    );
    assert_eq!(
        (client.depth(&dlq).await, client.depth(&queue).await),
        (6, 0)
    );

    let out = exits(0, &["dlq", "replay", "-q", &queue, "--all", "--batch", "2"]);
    // No progress bar when stderr is not a terminal: only an audit line per message moved.
    let audit = audit_lines(&out);
    assert_eq!(audit.len(), 2, "{}", stderr(&out));
    assert_eq!(stderr(&out).lines().count(), 2, "{}", stderr(&out));
    assert!(
        audit.iter().all(|l| l.contains("action=replayed")),
        "{audit:?}"
    );
    assert_eq!(
        (client.depth(&dlq).await, client.depth(&queue).await),
        (4, 2)
    );
    exits(4, &["dlq", "replay", "-q", &queue, "--all"]);
    assert_eq!(
        (client.depth(&dlq).await, client.depth(&queue).await),
        (1, 5)
    );
    exits(
        0,
        &[
            "dlq",
            "replay",
            "-q",
            &queue,
            "--id",
            "foreign",
            "--keep-user-id-aside",
        ],
    );
    let replayed = client.drain(&queue).await;
    let foreign = replayed
        .iter()
        .find(|m| {
            m.delivery
                .properties
                .message_id()
                .as_ref()
                .map(|s| s.as_str())
                == Some("foreign")
        })
        .expect("foreign replayed");
    assert_eq!(foreign.delivery.properties.user_id(), &None);
    assert_eq!(
        header_str(&foreign.delivery.properties, "x-lily-original-user-id").as_deref(),
        Some("producer")
    );
    assert_eq!(
        header_u32(&foreign.delivery.properties, "x-lily-attempt"),
        None
    );

    seed_lane(client, &dlq, (0..4).map(|i| format!("purge-{i}"))).await;
    let out = exits(2, &["dlq", "purge", "-q", &queue, "--all"]);
    assert!(stderr(&out).contains("pass --yes"), "{}", stderr(&out));
    assert_eq!(
        client.depth(&dlq).await,
        4,
        "nothing purged without confirmation"
    );
    let out = exits(
        0,
        &[
            "dlq", "purge", "-q", &queue, "--id", "purge-1", "--yes", "--json",
        ],
    );
    assert_eq!(json(&out)["purged"], 1);
    let out = exits(0, &["dlq", "purge", "-q", &queue, "--all", "--dry-run"]);
    assert!(
        stdout(&out).contains("would purge 3 messages"),
        "{}",
        stdout(&out)
    );
    assert!(audit_lines(&out).is_empty());
    assert_eq!(
        ready_soon(client, &dlq, 3).await,
        3,
        "a dry run purges nothing"
    );
    let out = lily(&["dlq", "purge", "-q", &queue, "--all", "--yes"]);
    assert!(
        stdout(&out).contains("purged 3 messages"),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    let audit = audit_lines(&out);
    assert_eq!(audit.len(), 3, "one audit line per message: {audit:?}");
    for id in ["purge-0", "purge-2", "purge-3"] {
        assert!(
            audit
                .iter()
                .any(|l| l.contains("action=purged") && l.contains(id)),
            "{id}: {audit:?}"
        );
    }
    assert_eq!(client.depth(&dlq).await, 0);
    let out = exits(1, &["parking", "list", "-q", "no-such-queue-anywhere"]);
    assert!(
        stderr(&out).contains("no-such-queue-anywhere.parking"),
        "{}",
        stderr(&out)
    );
    lanes.remove().await;
}

/// The effect: one document per handled order, in the inbox's transaction.
async fn record_effect(tx: &MongoTx, meta: &Meta) -> Result<(), QueueHandlerError> {
    let effects = tx.database().collection::<Document>("effects");
    let mut session = tx.session().await;
    effects
        .insert_one(doc! { "message_id": meta.message_id() })
        .session(&mut *session)
        .await
        .map_err(|e| QueueHandlerError::retryable("effect write failed").with_source(e))?;
    Ok(())
}

async fn effects(scope: &MongoScope, message_id: &str) -> u64 {
    scope
        .database()
        .collection::<Document>("effects")
        .count_documents(doc! { "message_id": message_id })
        .await
        .expect("count effects")
}

/// How the `parked` handler answers.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Answer {
    Indeterminate,
    Retryable,
    Succeed,
}

/// Row 13 of the failure matrix, through `lily parking replay` with the Mongo inbox:
/// - a parked message whose effect had in fact committed is replayed: the inbox suppresses it,
///   no second effect;
/// - a parked message replayed while its cause persists fails retryably and goes back to
///   parking, not to a retry bucket: it is not retried without an operator;
/// - replayed again once fixed, it commits its one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parking_replay_is_judged_by_the_inbox_and_never_retried_without_an_operator() {
    let broker = Broker::from_env();
    let queue = Broker::unique("parking-replay");
    let node = MongoNode::from_env();
    let scope = MongoScope::connect(
        node.url(),
        &MongoNode::database_name("parking"),
        MongoConfig::new("cli-parking"),
    )
    .await
    .expect("mongo scope");
    let answer = Arc::new(Mutex::new(Answer::Succeed));
    let calls = Arc::new(Mutex::new(BTreeMap::<String, u32>::new()));
    let (rule, seen) = (Arc::clone(&answer), Arc::clone(&calls));
    let router = Router::new().route("order.placed", move |tx: MongoTx, meta: Meta| {
        let answer = *rule.lock().unwrap();
        *seen
            .lock()
            .unwrap()
            .entry(meta.message_id().to_owned())
            .or_default() += 1;
        async move {
            match answer {
                Answer::Indeterminate => Err(QueueHandlerError::indeterminate(
                    "payment gateway timed out; charge unknown",
                )),
                Answer::Retryable => Err(QueueHandlerError::retryable("gateway still down")),
                Answer::Succeed => record_effect(&tx, &meta).await,
            }
        }
    });
    let cfg = config(&queue, QueueKind::Quorum).policy(fast_policy());
    let running = common::start_with(broker.url(), cfg, router, |c| c.scope(scope.clone()));
    running.wait_ready().await;
    let client = Client::connect(broker.url()).await;
    let parking = format!("{queue}.parking");
    let topology =
        lily::topology::Topology::new(&queue, QueueKind::Quorum, &fast_policy().retry_delays);
    let mut quiet: Vec<(&str, u64)> = vec![(&queue, 0)];
    quiet.extend(topology.buckets().map(|(b, _)| (b, 0)));

    // charged-1 commits its effect. Its copy then reaches parking as an ambiguous commit's
    // would: same id, body and type.
    client
        .send(&queue, "order.placed", "charged-1", b"{\"qty\":1}")
        .await;
    running
        .wait_for("charged-1 acked", WAIT, |t| t.acked == 1)
        .await;
    let mut charged = FieldTable::default();
    charged.insert("x-lily-failure-kind".into(), long("indeterminate"));
    charged.insert("x-lily-reason".into(), long("requeue limit reached"));
    let charged = sealed("charged-1", charged);
    client
        .publish(
            &parking,
            b"{\"qty\":1}",
            props("charged-1", "order.placed").with_headers(charged.clone()),
        )
        .await;
    // unknown-1 is parked by the handler itself.
    *answer.lock().unwrap() = Answer::Indeterminate;
    client
        .send(&queue, "order.placed", "unknown-1", b"{\"qty\":2}")
        .await;
    let mut depths = quiet.clone();
    depths.push((&parking, 2));
    common::wait_depths("both parked", WAIT, &depths).await;

    // The operator checked the gateway: replay. It is still down for unknown-1.
    *answer.lock().unwrap() = Answer::Retryable;
    let out = exits(0, &["parking", "replay", "-q", &queue, "--all"]);
    assert!(
        stdout(&out).contains("replayed 2 messages"),
        "{}",
        stdout(&out)
    );
    running
        .wait_for("charged-1 suppressed", WAIT, |t| {
            t.duplicates_suppressed == 1
        })
        .await;
    let mut back = quiet.clone();
    back.push((&parking, 1));
    common::wait_depths("unknown-1 back in parking", WAIT, &back).await;
    // Longer than both retry delays: a bucket would have brought it back by now.
    tokio::time::sleep(Duration::from_secs(4)).await;
    common::wait_depths("still parked", WAIT, &back).await;
    assert_eq!(
        calls.lock().unwrap().get("unknown-1"),
        Some(&2),
        "no automatic retry"
    );
    let parked = client.drain(&parking).await;
    let ids: Vec<_> = parked
        .iter()
        .map(|m| {
            m.delivery
                .properties
                .message_id()
                .clone()
                .map(|s| s.to_string())
        })
        .collect();
    assert_eq!(ids, [Some("unknown-1".to_owned())]);
    let p = &parked[0].delivery.properties;
    assert_eq!(
        header_str(p, "x-lily-replayed-from").as_deref(),
        Some("parking")
    );
    assert_eq!(
        header_str(p, "x-lily-failure-kind").as_deref(),
        Some("retryable")
    );
    // Drained to look at it: put it back as it was, and charged-1's copy once more.
    client
        .publish(&parking, &parked[0].delivery.data, p.clone())
        .await;
    client
        .publish(
            &parking,
            b"{\"qty\":1}",
            props("charged-1", "order.placed").with_headers(charged.clone()),
        )
        .await;

    // Fixed: the next replay commits unknown-1 once, and charged-1 is suppressed again.
    *answer.lock().unwrap() = Answer::Succeed;
    exits(0, &["parking", "replay", "-q", &queue, "--all"]);
    let mut done = quiet.clone();
    done.push((&parking, 0));
    common::wait_depths("parking empty", WAIT, &done).await;
    running
        .wait_for("charged-1 suppressed twice", WAIT, |t| {
            t.duplicates_suppressed == 2
        })
        .await;
    running.stop().await;
    assert_eq!(
        effects(&scope, "charged-1").await,
        1,
        "charged-1: one effect"
    );
    assert_eq!(
        effects(&scope, "unknown-1").await,
        1,
        "unknown-1: one effect"
    );
    assert_eq!(
        calls.lock().unwrap().get("charged-1"),
        Some(&1),
        "suppressed, not run"
    );
}

/// The security chapter's `set_permissions` line is enough for every command, and a missing permission
/// stops the command naming the resource, with nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_permissions_suffice_and_a_missing_one_is_named() {
    let lanes = Lanes::new("dlq-perms", QueueKind::Classic, 3).await;
    let (broker, client) = (&lanes.broker, &lanes.client);
    let (queue, dlq) = (lanes.queue.clone(), lanes.dlq.clone());
    let user = Broker::unique("ops");
    broker.ctl(&["add_user", &user, "ops-password"]);
    let escaped = queue.replace('-', "\\-");
    let grant = |configure: &str| {
        broker.ctl(&[
            "set_permissions",
            &user,
            configure,
            &format!("^{escaped}(\\.replay)?$"),
            &format!("^{escaped}\\.(dlq|parking|replay)$"),
        ]);
    };
    let url = broker
        .url()
        .replacen("guest:guest", &format!("{user}:ops-password"), 1);
    let run = |args: &[&str]| {
        let mut all = args.to_vec();
        all.extend(["--url", &url]);
        Command::new(env!("CARGO_BIN_EXE_lily"))
            .args(&all)
            .stdin(Stdio::null())
            .output()
            .expect("run lily")
    };

    // Without `configure` on the replay exchange: refused, named, nothing moved.
    grant("^$");
    let out = run(&["dlq", "replay", "-q", &queue, "--all"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!("exchange '{queue}.replay'")),
        "{}",
        stderr(&out)
    );
    assert!(!stderr(&out).contains("ops-password"));
    assert_eq!(ready_soon(client, &dlq, 3).await, 3);

    grant(&format!("^{escaped}\\.replay$"));
    for args in [
        &["dlq", "list", "-q", &queue][..],
        &["parking", "list", "-q", &queue],
        &["dlq", "show", "-q", &queue, "order-0"],
        &["dlq", "replay", "-q", &queue, "--id", "order-0"],
        &["dlq", "purge", "-q", &queue, "--id", "order-1", "--yes"],
    ] {
        let out = run(args);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
    }
    assert_eq!(
        client.drain_ids(&queue).await.keys().collect::<Vec<_>>(),
        ["order-0"]
    );
    assert_eq!(
        client.drain_ids(&dlq).await.keys().collect::<Vec<_>>(),
        ["order-2"]
    );
    broker.ctl(&["delete_user", &user]);
    lanes.remove().await;
}

/// Commands run back to back each see the whole lane: a command ends only once what it held is
/// back in the queue. 2 000 copies; list, show the last, list again, at once, on classic and
/// quorum queues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_back_to_back_each_see_the_whole_lane() {
    const N: usize = 2000;
    for kind in kinds() {
        let lanes = Lanes::new("back-to-back", kind, N).await;
        let queue = lanes.queue.clone();
        let count = |out: &Output| json(out)["messages"].as_u64();
        let last = format!("order-{}", N - 1);
        let first = exits(0, &["dlq", "list", "-q", &queue, "--json"]);
        let shown = exits(0, &["dlq", "show", "-q", &queue, &last, "--json"]);
        let second = exits(0, &["dlq", "list", "-q", &queue, "--json"]);
        assert_eq!(count(&first), Some(N as u64), "{kind:?}: the first list");
        assert_eq!(json(&shown)["copies"], 1, "{kind:?}: show finds {last}");
        assert_eq!(count(&second), Some(N as u64), "{kind:?}: the second list");
        let ids = lanes.client.drain_ids(&lanes.dlq).await;
        assert_eq!(ids.len(), N, "{kind:?}: every copy still there");
        assert!(ids.values().all(|n| *n == 1), "{kind:?}: none doubled");
        lanes.remove().await;
    }
}

/// A lane another consumer holds messages of is not acted on: every command says so and exits
/// 5, and nothing moves; two replays at once: one runs, the other refuses; every message is
/// replayed exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_in_use_is_not_acted_on_and_two_replays_cannot_run_at_once() {
    const N: usize = 1500;
    let lanes = Lanes::new("in-use", QueueKind::Classic, N).await;
    let (client, queue, dlq) = (&lanes.client, lanes.queue.clone(), lanes.dlq.clone());

    // Another consumer holds ten of them, unacknowledged.
    let holder = Client::connect(lanes.broker.url()).await;
    let (holding, held) = holder.hold(&dlq, 10).await;
    assert_eq!(held, 10);
    for args in [
        &["dlq", "list", "-q", &queue][..],
        &["dlq", "show", "-q", &queue, "order-0"],
        &["dlq", "replay", "-q", &queue, "--all"],
        &["dlq", "purge", "-q", &queue, "--all", "--yes"],
    ] {
        let out = exits(5, args);
        assert!(
            stderr(&out).contains("consumer"),
            "{args:?}: {}",
            stderr(&out)
        );
        assert!(audit_lines(&out).is_empty());
    }
    drop(holding);
    holder.close().await;
    assert_eq!(
        ready_soon(client, &dlq, N as u32).await,
        N as u32,
        "nothing moved"
    );
    assert_eq!(client.depth(&queue).await, 0);

    // Two operators replay at once.
    let spawn = || {
        Command::new(env!("CARGO_BIN_EXE_lily"))
            .args(["dlq", "replay", "-q", &queue, "--all"])
            .env("LILY_AMQP_URL", Broker::from_env().url())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run lily")
    };
    let a = spawn();
    std::thread::sleep(Duration::from_millis(700));
    let b = spawn();
    let (a, b) = (
        a.wait_with_output().expect("a"),
        b.wait_with_output().expect("b"),
    );
    let mut codes = [a.status.code(), b.status.code()];
    codes.sort();
    assert_eq!(
        codes,
        [Some(0), Some(5)],
        "one replays, the other refuses:\n{}\n{}",
        stderr(&a),
        stderr(&b)
    );
    let refused = if a.status.code() == Some(5) { &a } else { &b };
    assert!(audit_lines(refused).is_empty());
    assert!(stderr(refused).contains("in use") || stderr(refused).contains("consumer"));
    let replayed = client.drain_ids(&queue).await;
    assert_eq!(replayed.len(), N, "every message replayed");
    assert!(replayed.values().all(|n| *n == 1), "none twice");
    assert_eq!(client.depth(&dlq).await, 0);
    lanes.remove().await;
}

/// A copy whose restored fields the broker would refuse is left in the lane, named and
/// counted, and the messages behind it are replayed; a publisher's unsealed Lily headers are
/// not restored at all. A time past the year 9999 is shown as such.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_that_cannot_be_restored_is_left_and_the_rest_replayed() {
    let lanes = Lanes::new("restore", QueueKind::Classic, 0).await;
    let (client, queue, dlq) = (&lanes.client, lanes.queue.clone(), lanes.dlq.clone());
    seed_lane(client, &dlq, (0..5).map(|i| format!("before-{i}"))).await;
    // Sealed (a publisher who read the public key), but not restorable.
    for (id, header, value) in [
        (
            "bad-expiration",
            "x-lily-original-expiration",
            long("garbage"),
        ),
        ("bad-cc", "x-lily-original-cc", long("not-an-array")),
    ] {
        let mut table = FieldTable::default();
        table.insert(header.into(), value);
        let p = props(id, "order.placed").with_headers(sealed(id, table));
        client.publish(&dlq, b"{}", p).await;
    }
    // Unsealed: a publisher's own headers, which no replay restores.
    let mut forged = FieldTable::default();
    forged.insert("x-lily-original-expiration".into(), long("garbage"));
    forged.insert(
        "x-lily-last-failure-at".into(),
        AMQPValue::LongLongInt(i64::MAX),
    );
    client
        .publish(
            &dlq,
            b"{}",
            props("unsealed", "order.placed").with_headers(forged),
        )
        .await;
    seed_lane(client, &dlq, (0..5).map(|i| format!("after-{i}"))).await;

    let out = exits(0, &["dlq", "show", "-q", &queue, "unsealed"]);
    assert!(
        stdout(&out).contains("after the year 9999"),
        "{}",
        stdout(&out)
    );
    let out = exits(4, &["dlq", "replay", "-q", &queue, "--all", "--json"]);
    let report = json(&out);
    let left: Vec<&str> = report["left"]
        .as_array()
        .expect("left")
        .iter()
        .filter_map(|l| l["message_id"].as_str())
        .collect();
    assert_eq!(left, ["bad-expiration", "bad-cc"], "{report}");
    assert_eq!(report["replayed"].as_array().map(Vec::len), Some(11));
    assert_eq!(audit_lines(&out).len(), 11);
    let replayed = client.drain(&queue).await;
    assert_eq!(replayed.len(), 11);
    for m in &replayed {
        let p = &m.delivery.properties;
        assert_eq!(p.expiration(), &None, "nothing forged restored");
    }
    let still = client.drain_ids(&dlq).await;
    assert_eq!(
        still.keys().map(String::as_str).collect::<Vec<_>>(),
        ["bad-cc", "bad-expiration"]
    );
    lanes.remove().await;
}

/// Every lane of a quorum work queue keeps its messages however often it is read: RabbitMQ 4.0
/// limits each quorum queue to 20 deliveries unless declared otherwise, and drops a message at
/// the limit where the queue has no dead-letter target, as the lanes have none. The DLQ and
/// the parking lane, as the consumer declared them, are listed and shown 100 times each; every
/// message is still there once, by id. The work queue, read and given back past its limit
/// (Lily declares 20), dead-letters into the DLQ instead. Classic queues have no delivery
/// limit on any version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_lane_keeps_its_messages_through_a_hundred_reads() {
    const N: usize = 20;
    const READS: usize = 100;
    let broker = Broker::from_env();
    let queue = Broker::unique("read-often");
    let broken = Arc::new(AtomicBool::new(true));
    let calls = Calls::default();
    let running = common::start(
        broker.url(),
        config(&queue, QueueKind::Quorum),
        shop(&broken, &calls),
    );
    running.wait_ready().await;
    let client = Client::connect(broker.url()).await;
    let dead: Vec<String> = (0..N).map(|i| format!("dead-{i}")).collect();
    for id in &dead {
        client
            .send(&queue, "order.placed", id, b"{\"qty\":1}")
            .await;
    }
    common::wait_settled("every order dead-lettered", &queue, N as u64).await;
    running.stop().await;
    let dlq = format!("{queue}.dlq");
    let parking = format!("{queue}.parking");
    let parked: Vec<String> = (0..N).map(|i| format!("parked-{i}")).collect();
    seed_lane(&client, &parking, parked.iter().cloned()).await;
    assert_eq!(ready_soon(&client, &parking, N as u32).await, N as u32);

    // The two lanes are read at once, each by one command after the other.
    std::thread::scope(|threads| {
        for (lane, ids) in [("dlq", &dead), ("parking", &parked)] {
            let queue = &queue;
            threads.spawn(move || {
                for read in 1..=READS {
                    let listed = exits(0, &[lane, "list", "-q", queue, "--json"]);
                    assert_eq!(
                        json(&listed)["messages"],
                        N,
                        "{lane}, list {read}: {}",
                        stdout(&listed)
                    );
                    let id = &ids[read % N];
                    let shown = exits(0, &[lane, "show", "-q", queue, id, "--json"]);
                    assert_eq!(json(&shown)["copies"], 1, "{lane}, show {read}: {id}");
                }
            });
        }
    });
    let once = |ids: &[String]| -> BTreeMap<String, usize> {
        ids.iter().map(|id| (id.clone(), 1)).collect()
    };
    assert_eq!(
        client.drain_ids(&parking).await,
        once(&parked),
        "the parking lane"
    );
    assert_eq!(client.drain_ids(&dlq).await, once(&dead), "the DLQ");

    // The work queue, read by something that gives its messages back: a limit Lily chose,
    // and the broker dead-letters at it, at least once, into the DLQ.
    let given_back: Vec<String> = (0..5).map(|i| format!("given-back-{i}")).collect();
    for id in &given_back {
        client
            .send(&queue, "order.placed", id, b"{\"qty\":1}")
            .await;
    }
    for _ in 0..25 {
        let reader = Client::connect(broker.url()).await;
        let (_consumer, _held) = reader.hold(&queue, 5).await;
        reader.close().await;
        if client.depth(&queue).await == 0 && client.depth(&dlq).await == 5 {
            break;
        }
    }
    let moved = eventually(WAIT, || broker.messages(&dlq) == 5).await;
    assert!(moved, "the work queue's messages reached the DLQ");
    assert_eq!(
        client.drain_ids(&dlq).await,
        once(&given_back),
        "given back, then dead-lettered"
    );
    assert_eq!(client.depth(&queue).await, 0);
    for name in [&queue, &dlq, &parking] {
        client.delete(name).await;
    }
}

/// RabbitMQ 4.0 and later: lanes declared before the broker limited deliveries (no
/// `x-delivery-limit`, as Lily declares them on 3.10) cannot be declared again with `-1` (406).
/// The consumer starts on them anyway, declaring them as they are, and a policy with
/// `delivery-limit: -1` lifts their limit: the DLQ keeps its messages through 30 reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lanes_declared_before_4_0_keep_the_consumer_running_and_a_policy_lifts_their_limit() {
    const N: usize = 10;
    let broker = Broker::from_env();
    let version = lily::topology::broker_version(broker.url(), None)
        .await
        .expect("connect")
        .expect("the broker names its version");
    if !version.limits_deliveries_by_default() {
        eprintln!("RabbitMQ {version} has no default delivery limit: nothing to migrate");
        return;
    }
    let queue = Broker::unique("upgraded");
    let connection = lapin::Connection::connect(broker.url(), Default::default())
        .await
        .expect("connect");
    let channel = connection.create_channel().await.expect("channel");
    // As the consumer declared them on 3.10: no limit on the lanes.
    Topology::new(&queue, QueueKind::Quorum, &fast_policy().retry_delays)
        .delivery_limit(Some(20))
        .apply(&channel, TopologyMode::Declare)
        .await
        .expect("declared as on 3.10");
    let broken = Arc::new(AtomicBool::new(true));
    let calls = Calls::default();
    let running = common::start(
        broker.url(),
        config(&queue, QueueKind::Quorum),
        shop(&broken, &calls),
    );
    running.wait_ready().await;
    let client = Client::connect(broker.url()).await;
    let dead: Vec<String> = (0..N).map(|i| format!("dead-{i}")).collect();
    for id in &dead {
        client
            .send(&queue, "order.placed", id, b"{\"qty\":1}")
            .await;
    }
    common::wait_settled("every order dead-lettered", &queue, N as u64).await;
    running.stop().await;

    let policy = format!("lily-lanes-{queue}");
    broker.set_policy(
        &policy,
        "quorum_queues",
        &queue,
        "dlq|parking",
        r#"{"delivery-limit":-1}"#,
    );
    for read in 1..=30 {
        let listed = exits(0, &["dlq", "list", "-q", &queue, "--json"]);
        assert_eq!(json(&listed)["messages"], N, "list {read}");
    }
    let dlq = format!("{queue}.dlq");
    let once: BTreeMap<String, usize> = dead.iter().map(|id| (id.clone(), 1)).collect();
    assert_eq!(client.drain_ids(&dlq).await, once);
    broker.ctl(&["clear_policy", &policy]);
    for name in [queue.clone(), dlq, format!("{queue}.parking")] {
        client.delete(&name).await;
    }
    let _ = connection.close(200, "done".into()).await;
}
