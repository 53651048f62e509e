//! The Mongo scope benchmark: cases, contenders, the writes they share and the results. Method:
//! `bench/README.md`.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use mongodb::bson::{Document, doc};
use mongodb::{ClientSession, Database};
use serde::Serialize;

use crate::mongo::db::{Check, OPS, Ops};
use crate::run::Sample;
use crate::throughput::meets;
use crate::{Order, median};

pub mod cli;
pub mod db;
pub mod lily_run;
pub mod raw;

/// The database every run drops and re-creates.
pub const DATABASE: &str = "lily_bench_mongo";
/// One effect document per message: `{_id: message_id, sku, quantity}`.
pub const EFFECTS: &str = "effects";
/// The raw contender's inbox: `{_id: message_id}`.
pub const RAW_INBOX: &str = "inbox";
/// The hot-key counters: `{_id: k, n}` for `k` in `0..HOT_KEYS`.
pub const COUNTERS: &str = "counters";
/// Collections Lily's scope writes (its default prefix `lily_`), created before the clock.
pub const LILY_COLLECTIONS: [&str; 6] = [
    "lily_inbox",
    "lily_leases",
    "lily_fences",
    "lily_deferrals",
    "lily_outbox",
    "lily_outbox_relays",
];
/// The work queue.
pub const QUEUE: &str = "lily-bench-mongo";
/// The outbox case's events go to this queue, one `m-{i}.event` a message.
pub const EVENTS: &str = "lily-bench-mongo.events";
/// The consumer name in Lily's inbox keys.
pub const CONSUMER: &str = "lily-bench";
/// How many counter documents the hot-keys case shares out.
pub const HOT_KEYS: u64 = 5;
/// Target of Lily / the raw driver consumer (the scope and outbox cases, the default scope).
pub const TARGET: f64 = 0.9;

/// Which work a run does per message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Case {
    /// Inbox record + one effect insert.
    Scope,
    /// Inbox record + effect insert + `$inc` on one of [`HOT_KEYS`] counters.
    #[value(name = "hot", alias = "hot-keys")]
    HotKeys,
    /// Inbox record + effect insert + one event published with a confirm: staged in the
    /// transaction and published by the relay (Lily), or published after the commit (raw).
    Outbox,
}

impl Case {
    pub fn name(self) -> &'static str {
        match self {
            Self::Scope => "scope",
            Self::HotKeys => "hot keys",
            Self::Outbox => "outbox",
        }
    }
}

/// Who consumes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Contender {
    /// lapin + the mongodb driver, written by hand.
    Raw,
    /// The same raw consumer again: an A/A run, whose ratio to `raw` is the spread of two
    /// identical contenders in the same session.
    #[value(name = "raw-again")]
    RawAgain,
    /// Lily with `MongoConfig::new` (inbox only, the default).
    Lily,
    /// Lily with `MongoConfig::new(..).with_lease()` (inbox and per-message fenced lease).
    LilyLease,
}

impl Contender {
    pub fn name(self) -> &'static str {
        match self {
            Self::Raw => "raw driver",
            Self::RawAgain => "raw driver (A/A)",
            Self::Lily => "Lily",
            Self::LilyLease => "Lily (lease)",
        }
    }

    /// The hand-written consumer (`raw` or its A/A twin).
    pub fn is_raw(self) -> bool {
        matches!(self, Self::Raw | Self::RawAgain)
    }
}

/// What every run of a case consumes, and how.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Load {
    pub case: Case,
    #[serde(rename = "messages_per_run")]
    pub n: u64,
    pub concurrency: usize,
    pub prefetch: u16,
}

/// The index `i` of message id `m-{i}`.
pub fn index_of(message_id: &str) -> Option<u64> {
    message_id.strip_prefix("m-")?.parse().ok()
}

/// The counter document a message increments in the hot-keys case.
pub fn hot_key(index: u64) -> i64 {
    i64::try_from(index % HOT_KEYS).unwrap_or(0)
}

/// The effect of message `id` in `session`'s transaction, the same for every contender: its
/// document in [`EFFECTS`] and, in the hot-keys case, the `$inc` of its counter.
pub async fn effect(
    database: &Database,
    session: &mut ClientSession,
    id: &str,
    order: &Order,
    case: Case,
) -> mongodb::error::Result<()> {
    let effect = doc! { "_id": id, "sku": &order.sku, "quantity": i64::from(order.quantity) };
    let effects = database.collection::<Document>(EFFECTS);
    effects.insert_one(effect).session(&mut *session).await?;
    if case == Case::HotKeys {
        let counter = doc! { "_id": hot_key(index_of(id).unwrap_or(0)) };
        let counters = database.collection::<Document>(COUNTERS);
        let increment = counters.update_one(counter, doc! { "$inc": { "n": 1_i64 } });
        increment.session(session).await?;
    }
    Ok(())
}

/// What a contender observed of its own transactions (the claim, not the evidence: [`Check`]
/// reads that back from the database and the broker).
#[derive(Debug, Default, Serialize)]
pub struct Counters {
    /// Transaction attempts (raw) or handler runs (Lily: a conflict in the handler's writes
    /// runs it again; one on Lily's inbox insert does not).
    pub attempts: AtomicU64,
    /// `TransientTransactionError`s seen (raw: anywhere; Lily: in the handler's writes).
    pub conflicts: AtomicU64,
    /// Commits (raw: successful commits; Lily: `MongoConfig::on_committed` calls).
    pub commits: AtomicU64,
    /// The outbox case: each event's time from its transaction's commit to its confirm (raw)
    /// or from its staging to its sent mark (Lily), in µs.
    pub published_us: Mutex<Vec<u64>>,
}

/// Adds one to `counter`.
pub fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

/// The 50th and 99th percentiles of `us`, in ms.
#[allow(clippy::cast_precision_loss)]
pub fn percentiles_ms(us: &mut [u64]) -> Option<(f64, f64)> {
    us.sort_unstable();
    let at = |q: f64| us[((us.len() - 1) as f64 * q).round() as usize] as f64 / 1000.0;
    (!us.is_empty()).then(|| (at(0.5), at(0.99)))
}

/// One measured run and what was checked after it.
#[derive(Debug, Serialize)]
pub struct Run {
    #[serde(flatten)]
    pub sample: Sample,
    /// CPU of mongod per settled message, in µs (when `LILY_MONGO_DIR` names its directory).
    pub mongod_cpu_us_per_msg: Option<f64>,
    /// mongod's operations per message (`serverStatus.opcounters`).
    pub mongod_ops_per_msg: Option<Ops>,
    /// The outbox case: the 50th and 99th percentiles of [`Counters::published_us`], in ms.
    pub published_ms: Option<(f64, f64)>,
    pub observed: std::sync::Arc<Counters>,
    pub check: Check,
}

/// Everything one benchmark run measured.
#[derive(Debug, Serialize)]
pub struct Results {
    #[serde(flatten)]
    pub meta: crate::Meta,
    pub mongodb: String,
    pub mongodb_url: String,
    pub queue_type: &'static str,
    pub repetitions: u32,
    pub cases: Vec<CaseResult>,
}

/// One case, every contender's runs and medians.
#[derive(Debug, Serialize)]
pub struct CaseResult {
    #[serde(flatten)]
    pub load: Load,
    pub contenders: Vec<ContenderResult>,
}

/// One contender in one case: medians, the ratio to raw (`over_raw_range`: the lowest and
/// highest of each repetition's ratio to the raw run of the same repetition) and the checks of
/// every run.
#[derive(Debug, Serialize)]
pub struct ContenderResult {
    pub contender: Contender,
    pub median_msgs_per_sec: f64,
    pub over_raw: Option<f64>,
    pub over_raw_range: Option<(f64, f64)>,
    pub over_raw_target: Option<f64>,
    pub over_raw_met: Option<bool>,
    /// Medians a message: transaction attempts (raw) or handler runs (Lily), conflicts.
    pub attempts_per_msg: f64,
    pub conflicts_per_msg: f64,
    /// Valid messages found in the DLQ or the parking lane, all runs together (must be 0).
    pub dead_lettered_or_parked: u64,
    pub all_verified: bool,
    /// Median CPU µs a message: this process, the broker's VM, mongod; mongod's operations.
    pub client_cpu_us_per_msg: Option<f64>,
    pub broker_cpu_us_per_msg: Option<f64>,
    pub mongod_cpu_us_per_msg: Option<f64>,
    pub mongod_ops_per_msg: Option<Ops>,
    /// The outbox case: medians of the runs' percentiles, commit (raw) or staging (Lily) to
    /// published, in ms.
    pub published_p50_ms: Option<f64>,
    pub published_p99_ms: Option<f64>,
    pub runs: Vec<Run>,
}

impl ContenderResult {
    /// The medians of `runs`, and their ratios to `raw`, the raw contender's rates repetition
    /// by repetition (empty when it did not run, ignored for raw itself). The target is the
    /// default scope's in the scope and outbox cases (the lease guards effects outside the
    /// database; raw does not).
    #[allow(clippy::cast_precision_loss)]
    pub fn new(case: Case, contender: Contender, runs: Vec<Run>, raw: &[f64]) -> Self {
        let med = |f: &dyn Fn(&Run) -> Option<f64>| {
            let mut v: Vec<f64> = runs.iter().filter_map(f).collect();
            (!v.is_empty()).then(|| median(&mut v))
        };
        let per = |f: fn(&Counters) -> &AtomicU64| {
            let n = |r: &Run| r.sample.expected.max(1) as f64;
            med(&|r| Some(f(&r.observed).load(Ordering::Relaxed) as f64 / n(r))).unwrap_or(f64::NAN)
        };
        let median_msgs_per_sec = med(&|r| Some(r.sample.msgs_per_sec)).unwrap_or(f64::NAN);
        let raw = if contender == Contender::Raw {
            &[]
        } else {
            raw
        };
        let over_raw = (!raw.is_empty()).then(|| median_msgs_per_sec / median(&mut raw.to_vec()));
        let ratios: Vec<f64> = runs
            .iter()
            .zip(raw)
            .map(|(r, raw)| r.sample.msgs_per_sec / raw)
            .collect();
        let range = ratios.iter().copied();
        let over_raw_range = range.clone().reduce(f64::min).zip(range.reduce(f64::max));
        let judged = case != Case::HotKeys && contender == Contender::Lily;
        let over_raw_target = over_raw.filter(|_| judged).map(|_| TARGET);
        // By the throughput benchmark's rule (`None` with fewer than five repetitions).
        let over_raw_met = over_raw
            .zip(over_raw_target)
            .and_then(|(over, target)| meets(over, &ratios, target, true));
        let ops = |name| med(&|r| r.mongod_ops_per_msg.as_ref()?.get(name).copied());
        Self {
            contender,
            median_msgs_per_sec,
            over_raw,
            over_raw_range,
            over_raw_target,
            over_raw_met,
            attempts_per_msg: per(|c| &c.attempts),
            conflicts_per_msg: per(|c| &c.conflicts),
            dead_lettered_or_parked: runs
                .iter()
                .map(|r| r.check.dead_lettered + r.check.parked)
                .sum(),
            all_verified: runs.iter().all(|r| r.check.passed),
            client_cpu_us_per_msg: med(&|r| r.sample.client_cpu_us_per_msg),
            broker_cpu_us_per_msg: med(&|r| r.sample.broker_cpu_us_per_msg),
            mongod_cpu_us_per_msg: med(&|r| r.mongod_cpu_us_per_msg),
            // Every run's counters have every name, or the run has none.
            mongod_ops_per_msg: OPS
                .into_iter()
                .map(|name| Some((name, ops(name)?)))
                .collect(),
            published_p50_ms: med(&|r| r.published_ms.map(|p| p.0)),
            published_p99_ms: med(&|r| r.published_ms.map(|p| p.1)),
            runs,
        }
    }
}
