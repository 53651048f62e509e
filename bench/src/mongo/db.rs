//! The MongoDB side of every run: the replica set named by `LILY_MONGO_URL` (never printed with
//! its credentials), a database dropped and re-created for each run, mongod's counters, and the
//! check of a run by message id, read back from the database and the broker.

use std::collections::{BTreeMap, BTreeSet};

use futures_util::TryStreamExt;
use lily::topology::Topology;
use lily_mq_testkit::Client as Inspector;
use mongodb::bson::{Bson, Document, doc, from_bson};
use mongodb::{Client, Database};
use serde::Serialize;

use crate::depth;
use crate::mongo::{
    CONSUMER, COUNTERS, Case, Contender, DATABASE, EFFECTS, EVENTS, HOT_KEYS, LILY_COLLECTIONS,
    RAW_INBOX, hot_key,
};

/// `scheme://hosts/path`: no user info and no query, where a password can hide in options.
pub fn redact(url: &str) -> String {
    crate::redact(url.split('?').next().unwrap_or(url))
}

/// A client for `url`, checked to be on a replica set (transactions need one). The errors name
/// neither the URL nor the driver's text (which may quote it).
pub async fn client(url: &str) -> Result<Client, String> {
    let client = Client::with_uri_str(url).await;
    let client =
        client.map_err(|e| format!("LILY_MONGO_URL is not a usable MongoDB URL ({})", kind(&e)))?;
    let hello = admin(&client, doc! { "hello": 1 }).await;
    let hello = hello.map_err(|e| format!("MongoDB did not answer `hello` ({})", kind(&e)))?;
    if hello.get_str("setName").is_err() {
        return Err("MongoDB is not a replica set member: transactions need one (scripts/mongod.sh starts one)".into());
    }
    Ok(client)
}

async fn admin(client: &Client, command: Document) -> mongodb::error::Result<Document> {
    client.database("admin").run_command(command).await
}

/// The server's version, from `buildInfo`.
pub async fn server_version(client: &Client) -> String {
    let info = admin(client, doc! { "buildInfo": 1 }).await.ok();
    info.and_then(|i| Some(format!("MongoDB {}", i.get_str("version").ok()?)))
        .unwrap_or_else(|| "MongoDB (version unknown)".into())
}

/// Drops [`DATABASE`] and creates every collection any contender writes (so none pays for an
/// implicit creation inside its transactions); the hot-keys case seeds its counters at 0.
pub async fn fresh(client: &Client, case: Case) -> Database {
    let database = client.database(DATABASE);
    database.drop().await.expect("drop the benchmark database");
    for name in [EFFECTS, RAW_INBOX, COUNTERS]
        .iter()
        .chain(&LILY_COLLECTIONS)
    {
        let created = database.create_collection(*name).await;
        created.unwrap_or_else(|e| panic!("create collection {name}: {}", kind(&e)));
    }
    if case == Case::HotKeys {
        let counters = (0..HOT_KEYS).map(|k| doc! { "_id": hot_key(k), "n": 0_i64 });
        let collection = database.collection::<Document>(COUNTERS);
        collection
            .insert_many(counters)
            .await
            .expect("seed the counters");
    }
    database
}

/// A short description of a driver error that never carries the URL or documents.
pub fn kind(err: &mongodb::error::Error) -> String {
    use mongodb::error::ErrorKind;
    match err.kind.as_ref() {
        ErrorKind::Command(e) => format!("server error {} ({})", e.code, e.code_name),
        ErrorKind::Write(_) => "write error".to_owned(),
        ErrorKind::ServerSelection { .. } => "no server available".to_owned(),
        ErrorKind::Io(_) => "network error".to_owned(),
        ErrorKind::Authentication { .. } => "authentication failed".to_owned(),
        _ => "database error".to_owned(),
    }
}

/// The counters of mongod's `serverStatus.opcounters` (transactions' operations included;
/// `command`: commits, aborts, `findAndModify`, `hello`s, …).
pub const OPS: [&str; 6] = ["insert", "query", "update", "delete", "getmore", "command"];

/// Operations by [`OPS`] name.
pub type Ops = BTreeMap<&'static str, f64>;

/// mongod's operation counters now, or `None` when `serverStatus` is refused.
pub async fn ops(client: &Client) -> Option<Ops> {
    let status = admin(client, doc! { "serverStatus": 1 }).await.ok()?;
    let counters = status.get_document("opcounters").ok()?;
    // Each a 32- or 64-bit integer, read as a float.
    let count = |name| from_bson(counters.get(name)?.clone()).ok();
    Some(OPS.map(|name| (name, count(name).unwrap_or(0.0))).into())
}

/// `(after - before) / n`: operations a message over a run, to two decimals.
#[allow(clippy::cast_precision_loss)]
pub fn per_message(before: &Ops, after: &Ops, n: u64) -> Ops {
    let per = |name| (after[name] - before[name]) / n.max(1) as f64;
    OPS.map(|name| (name, (per(name) * 100.0).round() / 100.0))
        .into()
}

/// What was found after one run, by message id.
#[derive(Debug, Default, Serialize)]
pub struct Check {
    /// Every check below held.
    pub passed: bool,
    /// Expected ids found exactly once in `effects`, and in the inbox (each must be N).
    pub effects: u64,
    pub inbox: u64,
    /// Documents in either that are no expected id, or repeat one.
    pub strays: u64,
    /// Hot keys: every counter holds exactly the messages of its key.
    pub counters_exact: Option<bool>,
    /// Ready messages left in the work queue.
    pub work_queue_ready: Option<u32>,
    /// Messages drained from the DLQ and the parking lane, and left in the retry buckets: all
    /// are valid, so each is a failure.
    pub dead_lettered: u64,
    pub parked: u64,
    pub in_retry_buckets: u64,
    /// Lily (lease): lease and fence documents left (each message's go when it settles).
    pub lease_documents: Option<u64>,
    /// The outbox case: events found exactly once in their queue (`None` when any was found
    /// twice or was none of the run's).
    pub events: Option<u64>,
    /// A few ids that failed a check.
    pub sample_ids: Vec<String>,
}

/// Checks the run of `who` over `n` messages (panics when the database or the broker cannot be
/// read).
pub async fn check(
    url: &str,
    database: &Database,
    topology: &Topology,
    case: Case,
    who: Contender,
    n: u64,
) -> Check {
    let mut c = Check::default();
    let mut bad = Vec::new();
    let inbox = if who.is_raw() {
        RAW_INBOX
    } else {
        "lily_inbox"
    };
    let (effects, strays_e) = tally(&ids(database, EFFECTS, false).await, n, &mut bad);
    let (inbox, strays_i) = tally(&ids(database, inbox, !who.is_raw()).await, n, &mut bad);
    (c.effects, c.inbox, c.strays) = (effects, inbox, strays_e + strays_i);
    if who == Contender::LilyLease {
        let count = |name: &'static str| async move {
            let documents = database.collection::<Document>(name);
            documents.count_documents(doc! {}).await.unwrap_or(u64::MAX)
        };
        let (leases, fences) = (count("lily_leases").await, count("lily_fences").await);
        c.lease_documents = Some(leases.saturating_add(fences));
    }
    if case == Case::HotKeys {
        c.counters_exact = Some(counters(database, n).await);
    }
    let inspector = Inspector::connect(url).await;
    if case == Case::Outbox {
        // Each message's event in its queue exactly once.
        let events = inspector.drain_ids(EVENTS).await.into_iter();
        let message = |id: &str| id.strip_suffix(".event").unwrap_or("-").to_owned();
        let found = events
            .map(|(id, copies)| (message(&id), copies as u64))
            .collect();
        let (once, strays) = tally(&found, n, &mut bad);
        c.events = Some(once).filter(|_| strays == 0);
    }
    let mut drained = |ids: BTreeMap<String, usize>| {
        bad.extend(ids.keys().cloned());
        ids.values().map(|&c| c as u64).sum::<u64>()
    };
    c.dead_lettered = drained(inspector.drain_ids(&topology.dead_letter_queue()).await);
    c.parked = drained(inspector.drain_ids(&topology.parking_queue()).await);
    for (bucket, _) in topology.buckets() {
        c.in_retry_buckets += u64::from(depth(url, bucket).await.unwrap_or(0));
    }
    c.work_queue_ready = depth(url, topology.queue()).await;
    bad.truncate(10);
    c.sample_ids = bad;
    c.passed = c.effects == n
        && c.inbox == n
        && c.strays == 0
        && c.counters_exact != Some(false)
        && c.work_queue_ready == Some(0)
        && c.dead_lettered + c.parked + c.in_retry_buckets == 0
        && c.lease_documents.is_none_or(|d| d == 0)
        && (case != Case::Outbox || c.events == Some(n));
    c
}

/// The documents of `collection` matching `filter`, with the fields of `projection` (all when
/// it is empty).
async fn documents(
    database: &Database,
    collection: &str,
    filter: Document,
    projection: Document,
) -> Vec<Document> {
    let read = |e: mongodb::error::Error| -> ! { panic!("read {collection}: {}", kind(&e)) };
    let documents = database.collection::<Document>(collection);
    let found = documents.find(filter).projection(projection).await;
    let cursor = found.unwrap_or_else(|e| read(e));
    cursor.try_collect().await.unwrap_or_else(|e| read(e))
}

/// Each outbox record's time from its staging to its sent mark, in µs (the database's clock,
/// at millisecond resolution).
pub async fn staged_to_sent_us(database: &Database) -> Vec<u64> {
    let times = doc! { "staged_at": 1, "sent_at": 1 };
    let records = documents(database, "lily_outbox", doc! { "state": "sent" }, times).await;
    let at = |record: &Document, field| record.get_datetime(field).map(|t| t.timestamp_millis());
    records
        .iter()
        .filter_map(|r| Some(at(r, "sent_at").ok()? - at(r, "staged_at").ok()?))
        .map(|ms| u64::try_from(ms).unwrap_or(0) * 1000)
        .collect()
}

/// How often each message id occurs in `collection`'s `_id`s (Lily's inbox keys them
/// `{c: consumer, m: message id}`).
async fn ids(database: &Database, collection: &str, lily: bool) -> BTreeMap<String, u64> {
    let mut found = BTreeMap::new();
    for document in documents(database, collection, doc! {}, doc! { "_id": 1 }).await {
        let key = match document.get("_id") {
            Some(Bson::String(id)) if !lily => Some(id.clone()),
            Some(Bson::Document(key)) if lily && key.get_str("c") == Ok(CONSUMER) => {
                key.get_str("m").ok().map(str::to_owned)
            }
            _ => None,
        };
        *found.entry(key.unwrap_or_default()).or_insert(0) += 1;
    }
    found
}

/// (expected ids `m-0` … found exactly once, the other documents); the first ids expected but
/// not found once, and the first unexpected ones, go to `bad`.
fn tally(found: &BTreeMap<String, u64>, n: u64, bad: &mut Vec<String>) -> (u64, u64) {
    let expected: BTreeSet<String> = (0..n).map(|i| format!("m-{i}")).collect();
    let once = |id: &&String| found.get(*id) == Some(&1);
    bad.extend(expected.iter().filter(|id| !once(id)).take(10).cloned());
    bad.extend(
        found
            .keys()
            .filter(|id| !expected.contains(*id))
            .take(10)
            .cloned(),
    );
    let seen = expected.iter().filter(once).count() as u64;
    (seen, found.values().sum::<u64>() - seen)
}

/// Whether counter `k` holds exactly the messages `i` with `hot_key(i) == k`, for every `k`.
async fn counters(database: &Database, n: u64) -> bool {
    let counters = documents(database, COUNTERS, doc! {}, doc! {}).await;
    counters.len() == HOT_KEYS as usize
        && counters.iter().all(|counter| {
            let (Ok(key), Ok(count)) = (counter.get_i64("_id"), counter.get_i64("n")) else {
                return false;
            };
            usize::try_from(count) == Ok((0..n).filter(|&i| hot_key(i) == key).count())
        })
}

#[cfg(test)]
mod tests {
    #[test]
    fn redact_drops_credentials_and_every_option() {
        let url =
            "mongodb://u:secret@127.0.0.1:27700/?replicaSet=lily&tlsCertificateKeyFilePassword=pw";
        assert_eq!(super::redact(url), "mongodb://127.0.0.1:27700/");
    }
}
