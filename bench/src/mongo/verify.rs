//! The evidence of a run, read back from outside the contender: the database and the broker,
//! by message id.
//!
//! - `effects` holds exactly the ids `m-0` … `m-{n-1}`, once each (a missing id is a lost
//!   message, an unknown one a stray write);
//! - the inbox (raw: `inbox`, `_id` = message id; Lily: `lily_inbox`, `_id` = `{c, m}` for this
//!   consumer) holds every id once;
//! - hot keys: the counters add up to `n`, and each holds exactly the messages of its key;
//! - the work queue has no ready message, and the DLQ and the parking lane — drained by id —
//!   and the retry buckets hold nothing: every message here is valid, so any id found there is
//!   a valid message that was dead-lettered, parked or sent to retry.

use std::collections::BTreeMap;

use lily::topology::Topology;
use lily_mq_testkit::Client as Inspector;
use mongodb::Database;
use mongodb::bson::{Bson, Document, doc};
use serde::Serialize;

use crate::depth;
use crate::mongo::{
    CONSUMER, COUNTERS, Case, Contender, EFFECTS, HOT_KEYS, LILY_INBOX, RAW_INBOX, db, hot_key,
    index_of,
};

/// How many ids a failed check lists.
const SHOWN: usize = 10;

/// What was found after one run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Check {
    /// Every check below held.
    pub passed: bool,
    /// Distinct expected ids found in `effects`.
    pub effects: u64,
    /// Expected ids missing from `effects`.
    pub effects_missing: u64,
    /// Documents in `effects` that are not one of the expected ids.
    pub effects_unexpected: u64,
    /// Distinct expected ids found in the inbox.
    pub inbox: u64,
    pub inbox_missing: u64,
    pub inbox_unexpected: u64,
    /// Hot keys: sum of the counters, and whether every counter holds exactly its messages.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub counters_sum: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub counters_exact: Option<bool>,
    /// Ready messages left in the work queue.
    pub work_queue_ready: Option<u32>,
    /// Messages drained from the DLQ (all valid, so each is a failure of the contender).
    pub dead_lettered: u64,
    /// Messages drained from the parking lane.
    pub parked: u64,
    /// Messages in the retry buckets.
    pub in_retry_buckets: u64,
    /// Lily (lease): documents left in `lily_leases` and `lily_fences` after the run (each
    /// message's are deleted when it settles, so any left is a failure).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lease_documents: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fence_documents: Option<u64>,
    /// A few of the ids that failed a check, for the report.
    pub sample_ids: Vec<String>,
}

/// Checks the run of `who` over `n` messages.
///
/// # Panics
/// When the database or the broker cannot be read.
pub async fn check(
    url: &str,
    database: &Database,
    topology: &Topology,
    queue: &str,
    case: Case,
    who: Contender,
    n: u64,
) -> Check {
    let mut check = Check::default();
    let mut bad = Vec::new();

    let effects = ids(database, EFFECTS, |id| match id {
        Bson::String(s) => Some(s.clone()),
        _ => None,
    })
    .await;
    (
        check.effects,
        check.effects_missing,
        check.effects_unexpected,
    ) = tally(&effects, n, &mut bad);

    let lily_key: fn(&Bson) -> Option<String> = |id| match id {
        Bson::Document(key) if key.get_str("c").ok() == Some(CONSUMER) => {
            key.get_str("m").ok().map(str::to_owned)
        }
        _ => None,
    };
    let (inbox, key_of): (&str, fn(&Bson) -> Option<String>) = match who {
        Contender::Raw => (RAW_INBOX, |id| match id {
            Bson::String(s) => Some(s.clone()),
            _ => None,
        }),
        Contender::LilyLease | Contender::Lily => (LILY_INBOX, lily_key),
    };
    let inbox = ids(database, inbox, key_of).await;
    (check.inbox, check.inbox_missing, check.inbox_unexpected) = tally(&inbox, n, &mut bad);

    if case == Case::HotKeys {
        let (sum, exact) = counters(database, n).await;
        check.counters_sum = Some(sum);
        check.counters_exact = Some(exact);
    }

    if who == Contender::LilyLease {
        let count = |name: &'static str| async move {
            database
                .collection::<Document>(name)
                .count_documents(doc! {})
                .await
                .ok()
        };
        check.lease_documents = count("lily_leases").await;
        check.fence_documents = count("lily_fences").await;
    }

    check.work_queue_ready = depth(url, queue).await;
    let inspector = Inspector::connect(url).await;
    let drained = |ids: BTreeMap<String, usize>, bad: &mut Vec<String>| {
        bad.extend(ids.keys().cloned());
        ids.values().map(|&c| c as u64).sum::<u64>()
    };
    check.dead_lettered = drained(
        inspector.drain_ids(&topology.dead_letter_queue()).await,
        &mut bad,
    );
    check.parked = drained(
        inspector.drain_ids(&topology.parking_queue()).await,
        &mut bad,
    );
    for (bucket, _) in topology.buckets() {
        check.in_retry_buckets += u64::from(depth(url, bucket).await.unwrap_or(0));
    }

    check.passed = check.effects == n
        && check.effects_missing == 0
        && check.effects_unexpected == 0
        && check.inbox == n
        && check.inbox_missing == 0
        && check.inbox_unexpected == 0
        && check.counters_sum.is_none_or(|s| u64::try_from(s) == Ok(n))
        && check.counters_exact != Some(false)
        && check.work_queue_ready == Some(0)
        && check.dead_lettered == 0
        && check.parked == 0
        && check.in_retry_buckets == 0
        && check.lease_documents.is_none_or(|n| n == 0)
        && check.fence_documents.is_none_or(|n| n == 0);
    bad.truncate(SHOWN);
    check.sample_ids = bad;
    check
}

/// How often each key occurs in `collection`'s `_id`s (`None` keys count under `""`).
async fn ids(
    database: &Database,
    collection: &str,
    key_of: impl Fn(&Bson) -> Option<String>,
) -> BTreeMap<String, u64> {
    let mut cursor = database
        .collection::<Document>(collection)
        .find(doc! {})
        .projection(doc! { "_id": 1 })
        .await
        .unwrap_or_else(|e| panic!("read {collection}: {}", db::kind(&e)));
    let mut found = BTreeMap::new();
    while cursor
        .advance()
        .await
        .unwrap_or_else(|e| panic!("read {collection}: {}", db::kind(&e)))
    {
        let document: Document = cursor
            .deserialize_current()
            .unwrap_or_else(|_| panic!("a {collection} document does not parse"));
        let key = document.get("_id").and_then(&key_of).unwrap_or_default();
        *found.entry(key).or_insert(0) += 1;
    }
    found
}

/// (expected ids found once, expected ids missing, documents that are not an expected id or
/// repeat one).
fn tally(found: &BTreeMap<String, u64>, n: u64, bad: &mut Vec<String>) -> (u64, u64, u64) {
    let mut seen = 0;
    let mut unexpected = 0;
    for (id, &count) in found {
        match index_of(id) {
            Some(i) if i < n && count == 1 && id == &format!("m-{i}") => seen += 1,
            _ => {
                unexpected += count;
                bad.push(id.clone());
            }
        }
    }
    let missing = n.saturating_sub(seen);
    if missing > 0 {
        bad.extend(
            (0..n)
                .map(|i| format!("m-{i}"))
                .filter(|id| !found.contains_key(id))
                .take(SHOWN),
        );
    }
    (seen, missing, unexpected)
}

/// The sum of the counters, and whether counter `k` holds exactly the messages `i` with
/// `i % 5 == k`.
async fn counters(database: &Database, n: u64) -> (i64, bool) {
    let mut cursor = database
        .collection::<Document>(COUNTERS)
        .find(doc! {})
        .await
        .unwrap_or_else(|e| panic!("read counters: {}", db::kind(&e)));
    let mut sum = 0;
    let mut exact = true;
    let mut keys = 0;
    while cursor
        .advance()
        .await
        .unwrap_or_else(|e| panic!("read counters: {}", db::kind(&e)))
    {
        let document: Document = cursor.deserialize_current().expect("a counter parses");
        let (Ok(key), Ok(count)) = (document.get_i64("_id"), document.get_i64("n")) else {
            exact = false;
            continue;
        };
        keys += 1;
        sum += count;
        let expected = (0..n).filter(|&i| hot_key(i) == key).count();
        exact &= usize::try_from(count) == Ok(expected);
    }
    (sum, exact && keys == HOT_KEYS)
}
