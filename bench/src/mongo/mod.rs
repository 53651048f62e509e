//! The Mongo scope benchmark: cases, contenders and results. Method: `bench/README.md`.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

use crate::median;
use crate::mongo::db::Ops;
use crate::run::Sample;

pub mod cli;
pub mod db;
pub mod lily_run;
pub mod raw;
pub mod verify;

/// The database every run drops and re-creates.
pub const DATABASE: &str = "lily_bench_mongo";
/// One effect document per message: `{_id: message_id, sku, quantity}`.
pub const EFFECTS: &str = "effects";
/// The raw contender's inbox: `{_id: message_id}`.
pub const RAW_INBOX: &str = "inbox";
/// The hot-key counters: `{_id: k, n}` for `k` in `0..HOT_KEYS`.
pub const COUNTERS: &str = "counters";
/// Lily's inbox (the scope's default collection prefix `lily_`).
pub const LILY_INBOX: &str = "lily_inbox";
/// Collections Lily's scope writes, created before the clock starts for every contender.
pub const LILY_COLLECTIONS: [&str; 4] =
    ["lily_inbox", "lily_leases", "lily_fences", "lily_deferrals"];
/// The consumer name in Lily's inbox keys.
pub const CONSUMER: &str = "lily-bench";
/// How many counter documents the hot-keys case shares out.
pub const HOT_KEYS: u64 = 5;
/// Target of Lily / the raw driver consumer.
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
}

impl Case {
    pub fn name(self) -> &'static str {
        match self {
            Self::Scope => "scope",
            Self::HotKeys => "hot keys",
        }
    }
}

/// Who consumes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Contender {
    /// lapin + the mongodb driver, written by hand.
    Raw,
    /// Lily with `MongoConfig::new` (inbox only, the default).
    Lily,
    /// Lily with `MongoConfig::new(..).with_lease()` (inbox and per-message fenced lease).
    LilyLease,
}

impl Contender {
    pub fn name(self) -> &'static str {
        match self {
            Self::Raw => "raw driver",
            Self::Lily => "Lily",
            Self::LilyLease => "Lily (lease)",
        }
    }
}

/// What one run consumes, and how.
#[derive(Clone, Copy, Debug)]
pub struct Load<'a> {
    /// The broker.
    pub url: &'a str,
    /// The work queue, holding `n` messages.
    pub queue: &'a str,
    pub case: Case,
    /// Deliveries handled at once.
    pub concurrency: usize,
    pub prefetch: u16,
    pub n: u64,
}

/// The index `i` of message id `m-{i}`.
pub fn index_of(message_id: &str) -> Option<u64> {
    message_id.strip_prefix("m-")?.parse().ok()
}

/// The counter document a message increments in the hot-keys case.
pub fn hot_key(index: u64) -> i64 {
    i64::try_from(index % HOT_KEYS).unwrap_or(0)
}

/// What a contender observed of its own transactions while it ran (the claim, not the
/// evidence: [`verify`] reads the evidence back from the database and the broker).
#[derive(Debug, Default, Serialize)]
pub struct Counters {
    /// Transaction attempts (raw) or handler runs (Lily: a conflict in the handler's writes
    /// runs it again; one on Lily's inbox insert does not).
    pub attempts: AtomicU64,
    /// `TransientTransactionError`s seen (raw: anywhere; Lily: in the handler's writes).
    pub conflicts: AtomicU64,
    /// Commits retried on `UnknownTransactionCommitResult` (raw only).
    pub unknown_commits: AtomicU64,
    /// Commits (raw: successful commits; Lily: `MongoConfig::on_committed` calls).
    pub commits: AtomicU64,
    /// Deliveries NACKed with requeue after a non-transient failure (raw only).
    pub requeued: AtomicU64,
}

impl Counters {
    pub fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// The counts now, as counters of their own.
    pub fn snapshot(&self) -> Self {
        let get = |c: &AtomicU64| AtomicU64::new(c.load(Ordering::Relaxed));
        let (attempts, conflicts, unknown_commits) = (
            get(&self.attempts),
            get(&self.conflicts),
            get(&self.unknown_commits),
        );
        Self {
            attempts,
            conflicts,
            unknown_commits,
            commits: get(&self.commits),
            requeued: get(&self.requeued),
        }
    }
}

/// One measured run and what was checked after it.
#[derive(Debug, Serialize)]
pub struct Run {
    #[serde(flatten)]
    pub sample: Sample,
    /// CPU of mongod per settled message over the same window, in µs (when `LILY_MONGO_DIR`
    /// names the node's directory).
    pub mongod_cpu_us_per_msg: Option<f64>,
    /// mongod's operations per message over the same window (`serverStatus.opcounters`).
    pub mongod_ops_per_msg: Option<db::Ops>,
    pub observed: Counters,
    /// Lily's totals after its shutdown.
    pub lily_totals: Option<lily::consumer::Totals>,
    pub check: verify::Check,
}

/// Everything one benchmark run measured.
#[derive(Debug, Serialize)]
pub struct Results {
    /// The run's conditions.
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
    pub case: Case,
    pub messages_per_run: u64,
    pub concurrency: usize,
    pub prefetch: u16,
    pub contenders: Vec<ContenderResult>,
}

/// One contender in one case.
#[derive(Debug, Serialize)]
pub struct ContenderResult {
    pub contender: Contender,
    pub median_msgs_per_sec: f64,
    /// This contender's median over the raw contender's (Lily only).
    pub over_raw: Option<f64>,
    /// The target of `over_raw` (the scope case only).
    pub over_raw_target: Option<f64>,
    pub over_raw_met: Option<bool>,
    /// Median transaction attempts (raw) or handler runs (Lily) per message.
    pub attempts_per_msg: f64,
    /// Median transient transaction errors seen per message.
    pub conflicts_per_msg: f64,
    /// Valid messages found in the DLQ or the parking lane, all runs together (must be 0).
    pub dead_lettered_or_parked: u64,
    /// Every run passed its checks by message id.
    pub all_verified: bool,
    /// Every run settled all its messages within the limit.
    pub all_complete: bool,
    /// Median CPU µs per message: this process, the broker's VM, mongod.
    pub client_cpu_us_per_msg: Option<f64>,
    pub broker_cpu_us_per_msg: Option<f64>,
    pub mongod_cpu_us_per_msg: Option<f64>,
    /// Median mongod operations per message, by kind.
    pub mongod_ops_per_msg: Option<Ops>,
    pub runs: Vec<Run>,
}

impl ContenderResult {
    pub fn new(contender: Contender, runs: Vec<Run>) -> Self {
        let med = |f: &dyn Fn(&Run) -> Option<f64>| {
            let mut v: Vec<f64> = runs.iter().filter_map(f).collect();
            (!v.is_empty()).then(|| median(&mut v))
        };
        #[allow(clippy::cast_precision_loss)]
        let per_msg = |count: &AtomicU64, run: &Run| {
            count.load(Ordering::Relaxed) as f64 / run.sample.expected.max(1) as f64
        };
        Self {
            contender,
            median_msgs_per_sec: med(&|r| Some(r.sample.msgs_per_sec)).unwrap_or(f64::NAN),
            over_raw: None,
            over_raw_target: None,
            over_raw_met: None,
            attempts_per_msg: med(&|r| Some(per_msg(&r.observed.attempts, r))).unwrap_or(f64::NAN),
            conflicts_per_msg: med(&|r| Some(per_msg(&r.observed.conflicts, r)))
                .unwrap_or(f64::NAN),
            dead_lettered_or_parked: runs
                .iter()
                .map(|r| r.check.dead_lettered + r.check.parked)
                .sum(),
            all_verified: runs.iter().all(|r| r.check.passed),
            all_complete: runs.iter().all(|r| r.sample.complete),
            client_cpu_us_per_msg: med(&|r| r.sample.client_cpu_us_per_msg),
            broker_cpu_us_per_msg: med(&|r| r.sample.broker_cpu_us_per_msg),
            mongod_cpu_us_per_msg: med(&|r| r.mongod_cpu_us_per_msg),
            mongod_ops_per_msg: med(&|r| r.mongod_ops_per_msg.map(|o| o.insert)).map(|insert| {
                let m = |f: fn(&Ops) -> f64| med(&|r| r.mongod_ops_per_msg.as_ref().map(f));
                Ops {
                    insert,
                    query: m(|o| o.query).unwrap_or(f64::NAN),
                    update: m(|o| o.update).unwrap_or(f64::NAN),
                    delete: m(|o| o.delete).unwrap_or(f64::NAN),
                    getmore: m(|o| o.getmore).unwrap_or(f64::NAN),
                    command: m(|o| o.command).unwrap_or(f64::NAN),
                }
            }),
            runs,
        }
    }
}

impl CaseResult {
    /// Computes the ratios to the raw contender, when it ran.
    pub fn new(
        case: Case,
        messages_per_run: u64,
        concurrency: usize,
        prefetch: u16,
        mut contenders: Vec<ContenderResult>,
    ) -> Self {
        let raw = contenders
            .iter()
            .find(|c| c.contender == Contender::Raw)
            .map(|c| c.median_msgs_per_sec);
        for c in contenders
            .iter_mut()
            .filter(|c| c.contender != Contender::Raw)
        {
            c.over_raw = raw.map(|r| c.median_msgs_per_sec / r);
            // The target is the default scope's, the like-for-like one: the lease is an
            // opt-in for effects outside the database, which the raw contender does not guard.
            if case == Case::Scope && c.contender == Contender::Lily {
                c.over_raw_target = c.over_raw.map(|_| TARGET);
                c.over_raw_met = c.over_raw.map(|r| r >= TARGET);
            }
        }
        Self {
            case,
            messages_per_run,
            concurrency,
            prefetch,
            contenders,
        }
    }
}
