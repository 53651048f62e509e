//! The settlement-latency benchmark: its cases, runs and latencies. Method: `bench/README.md`.

use serde::Serialize;

pub mod cli;
pub mod pace;
pub mod raw_batch;
pub mod run;
pub mod timer;

pub use crate::throughput::Path;

/// The target: Lily's p99 at most raw-batch's p99 plus this, in ms.
pub const P99_MARGIN_MS: f64 = 2.0;
/// The fractions of the maximum rate the runs publish at.
pub const LOADS: [f64; 2] = [0.5, 0.9];
/// A consumer kept up (a publisher reached its target) at this share of the publish (target) rate.
pub const KEPT_UP: f64 = 0.95;
/// A rate is sustained when the publisher reaches this share of it and the contender settles this
/// share of what was published (why the maximum rate must be sustained: `bench/README.md`).
pub const SUSTAINED: f64 = 0.99;
/// Each rate checked for the maximum is the one before (first: the lower rate settled under
/// overload) times this; at most [`SUSTAIN_TRIES`] rates are checked, the last used even if not
/// sustained.
pub const SUSTAIN_STEP: f64 = 0.9;
pub const SUSTAIN_TRIES: u32 = 4;

/// Who consumes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Contender {
    /// The hand-tuned raw lapin consumer of [`raw_batch`].
    RawBatch,
    /// Lily.
    Lily,
}

impl Contender {
    pub fn name(self) -> &'static str {
        match self {
            Self::RawBatch => "raw-batch",
            Self::Lily => "Lily",
        }
    }
}

/// Percentiles of a run's settlement latencies.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Latencies {
    /// Deliveries timed.
    pub samples: usize,
    pub p50_us: u32,
    pub p99_us: u32,
    pub p999_us: u32,
    pub max_us: u32,
    pub mean_us: f64,
    /// How many latencies fall at or under each bound of [`HISTOGRAM_MS`] (and above the
    /// previous one); the last count is above the last bound.
    pub histogram: [usize; HISTOGRAM_MS.len() + 1],
}

/// Upper bounds of the latency histogram, in ms.
pub const HISTOGRAM_MS: [u32; 9] = [1, 2, 5, 10, 20, 50, 100, 200, 500];

impl Latencies {
    /// Nearest-rank percentiles of `values` (µs).
    pub fn of(mut values: Vec<u32>) -> Self {
        values.sort_unstable();
        let Some(&max_us) = values.last() else {
            return Self::default();
        };
        let n = values.len();
        let rank = |q: f64| values[((q * n as f64).ceil() as usize).clamp(1, n) - 1];
        let mut histogram = [0; HISTOGRAM_MS.len() + 1];
        for &v in &values {
            let slot = HISTOGRAM_MS.iter().position(|&ms| v <= ms * 1000);
            histogram[slot.unwrap_or(HISTOGRAM_MS.len())] += 1;
        }
        Self {
            samples: n,
            p50_us: rank(0.5),
            p99_us: rank(0.99),
            p999_us: rank(0.999),
            max_us,
            mean_us: values.iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64,
            histogram,
        }
    }
}

/// One contender at one target rate.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Run {
    pub contender: Contender,
    pub target_rate: f64,
    /// Messages the paced publisher published, and how many of them were not confirmed.
    pub published: u64,
    pub unconfirmed: u64,
    /// `published / publishing seconds`.
    pub publish_rate: f64,
    /// `publish_rate ≥ KEPT_UP × target_rate`: the load was what the case names.
    pub publisher_reached_target: bool,
    /// Deliveries settled per second between the end of the warm-up and the end of publishing.
    pub settled_per_sec: f64,
    /// `settled_per_sec ≥ KEPT_UP × publish_rate`: the consumer kept up with the load.
    pub kept_up: bool,
    /// Seconds from the end of publishing until every published message was settled.
    pub drain_secs: f64,
    /// Every published message was settled.
    pub complete: bool,
    /// Deliveries that ended otherwise (raw-batch: NACKed or ACK failed; Lily: requeued,
    /// dead-lettered, parked or unresolved).
    pub failed: u64,
    pub latency: Latencies,
    /// Handoff path: each copy from its publish to its confirm. Lily: its `handoff` span, from
    /// the copy built to its verdict. raw-batch: from the copy's publish written to its confirm
    /// seen, at the flush that awaits it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub copy_confirms: Option<Latencies>,
}

impl Run {
    /// Whether the publisher reached the target and the contender settled what it published,
    /// both within [`SUSTAINED`].
    pub fn sustained(&self) -> bool {
        self.publish_rate >= SUSTAINED * self.target_rate
            && self.settled_per_sec >= SUSTAINED * self.publish_rate
            && self.complete
    }
}

/// The maximum rate a case's target is a fraction of.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct MaxRate {
    /// Lily's drain rate (msgs/s) with nothing publishing, when measured.
    pub lily: Option<f64>,
    /// raw-batch's drain rate with nothing publishing, when measured.
    pub raw_batch: Option<f64>,
    /// The load offered while the rates under load were measured: the higher drain rate.
    pub offered: Option<f64>,
    /// What Lily settled per second with the publisher offering [`Self::offered`].
    pub lily_loaded: Option<f64>,
    /// What raw-batch settled per second with the publisher offering [`Self::offered`].
    pub raw_batch_loaded: Option<f64>,
    /// The lower of the two rates under load, where the search for a sustained rate starts.
    pub under_load: Option<f64>,
    /// Rates checked: from [`Self::under_load`] times [`SUSTAIN_STEP`] down by that factor
    /// until both contenders sustained one ([`SUSTAINED`]), at most [`SUSTAIN_TRIES`].
    pub tries: Option<u32>,
    /// Whether both contenders sustained [`Self::used`] (false: the tries ran out first).
    pub sustained: Option<bool>,
    /// The rate used: the last rate checked, or `--max-rate`.
    pub used: f64,
}

/// One path × prefetch × load: both contenders at the same target rate.
#[derive(Clone, Debug, Serialize)]
pub struct Case {
    pub path: Path,
    pub queue_type: &'static str,
    pub prefetch: u16,
    /// Fraction of the maximum rate.
    pub load: f64,
    pub max_rate: MaxRate,
    pub target_rate: f64,
    pub raw_batch: Run,
    pub lily: Run,
    /// Lily's p99 minus raw-batch's, in ms; with repetitions, the median round's.
    pub p99_diff_ms: f64,
    /// Lily's p99 minus raw-batch's in every round, in the order they ran.
    pub rounds_p99_diff_ms: Vec<f64>,
    /// [`P99_MARGIN_MS`].
    pub p99_margin_ms: f64,
    /// `p99_diff_ms ≤ p99_margin_ms`.
    pub met: bool,
}

impl Case {
    pub fn new(
        path: Path,
        prefetch: u16,
        load: f64,
        max_rate: MaxRate,
        raw_batch: Run,
        lily: Run,
    ) -> Self {
        let p99_diff_ms =
            (f64::from(lily.latency.p99_us) - f64::from(raw_batch.latency.p99_us)) / 1000.0;
        Self {
            path,
            queue_type: "classic",
            prefetch,
            load,
            max_rate,
            target_rate: lily.target_rate,
            raw_batch,
            lily,
            p99_diff_ms,
            rounds_p99_diff_ms: vec![p99_diff_ms],
            p99_margin_ms: P99_MARGIN_MS,
            met: p99_diff_ms <= P99_MARGIN_MS,
        }
    }

    /// The round whose p99 difference is the median (the lower one of an even count), with
    /// every round's difference: a stall of tens of milliseconds lands in whichever
    /// contender's run it falls, so one round cannot decide a 2 ms bar.
    ///
    /// # Panics
    /// When `rounds` is empty.
    pub fn median(mut rounds: Vec<Self>) -> Self {
        let diffs = rounds.iter().map(|case| case.p99_diff_ms).collect();
        rounds.sort_by(|a, b| a.p99_diff_ms.total_cmp(&b.p99_diff_ms));
        let mut case = rounds.swap_remove((rounds.len() - 1) / 2);
        case.rounds_p99_diff_ms = diffs;
        case
    }
}

/// Everything one benchmark run measured.
#[derive(Debug, Serialize)]
pub struct Results {
    /// The run's conditions.
    #[serde(flatten)]
    pub meta: crate::Meta,
    /// Messages each drain-rate measurement published (0 with `--max-rate`).
    pub max_rate_messages: u64,
    /// Publishing time of a paced run, and the warm-up excluded from its latencies.
    pub run_secs: f64,
    pub warmup_secs: f64,
    pub cases: Vec<Case>,
}
