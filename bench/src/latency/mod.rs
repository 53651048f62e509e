//! The settlement-latency benchmark: its cases, runs and latencies. Method: `bench/README.md`.

use serde::Serialize;

pub mod cli;
pub mod raw_batch;
pub mod run;
pub mod timer;

pub use crate::throughput::Path;

/// The work queue every run uses (re-created each time).
pub const QUEUE: &str = "lily-bench-latency";
/// The target: Lily's p99 at most raw-batch's p99 plus this, in ms.
pub const P99_MARGIN_MS: f64 = 2.0;
/// The fractions of the maximum rate the runs publish at.
pub const LOADS: [f64; 2] = [0.5, 0.9];
/// A consumer kept up (a publisher reached its target) at this share of the publish (target) rate.
pub const KEPT_UP: f64 = 0.95;
/// A rate is sustained when the publisher reaches this share of it and the contender settles this
/// share of what was published.
pub const SUSTAINED: f64 = 0.99;
/// The search for the maximum rate: each rate this times the one before, at most this many.
pub const SUSTAIN_STEP: f64 = 0.9;
pub const SUSTAIN_TRIES: u32 = 4;

/// Who consumes: the hand-tuned raw lapin consumer of [`raw_batch`], or Lily.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Contender {
    RawBatch,
    Lily,
}

impl Contender {
    pub fn name(self) -> &'static str {
        if self == Self::Lily {
            "Lily"
        } else {
            "raw-batch"
        }
    }
}

/// Percentiles of a run's settlement latencies (`samples`: deliveries timed).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Latencies {
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
    /// Messages the paced publisher published, and how many of them were not confirmed;
    /// `published / publishing seconds`.
    pub published: u64,
    pub unconfirmed: u64,
    pub publish_rate: f64,
    /// `publish_rate ≥ KEPT_UP × target_rate`: the load was what the case names.
    pub publisher_reached_target: bool,
    /// Deliveries settled per second between the end of the warm-up and the end of publishing.
    pub settled_per_sec: f64,
    /// `settled_per_sec ≥ KEPT_UP × publish_rate`: the consumer kept up with the load.
    pub kept_up: bool,
    /// Seconds from the end of publishing until every published message was settled, and
    /// whether every one was.
    pub drain_secs: f64,
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

/// The maximum rate a case's target is a fraction of (msg/s; how it is searched: `cli`'s
/// `max_rate`): each contender's drain rate with nothing publishing, the load then `offered`,
/// what each settled under it, the lower of the two (`under_load`), the rates checked from
/// there (`tries`), whether both sustained the last, and the rate `used` (or `--max-rate`).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct MaxRate {
    pub lily: Option<f64>,
    pub raw_batch: Option<f64>,
    pub offered: Option<f64>,
    pub lily_loaded: Option<f64>,
    pub raw_batch_loaded: Option<f64>,
    pub under_load: Option<f64>,
    pub tries: Option<u32>,
    pub sustained: Option<bool>,
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
    /// Lily's p99 minus raw-batch's, in ms: the median round's, and every round's in the order
    /// they ran; met when at most [`P99_MARGIN_MS`].
    pub p99_diff_ms: f64,
    pub rounds_p99_diff_ms: Vec<f64>,
    pub p99_margin_ms: f64,
    pub met: bool,
}

impl Case {
    /// The case of `rounds` (raw-batch's run and Lily's in each): the round whose p99
    /// difference is the median (the lower one of an even count), with every round's
    /// difference: a stall of tens of milliseconds lands in whichever contender's run it falls,
    /// so one round cannot decide a 2 ms bar.
    ///
    /// # Panics
    /// When `rounds` is empty.
    pub fn median(
        path: Path,
        prefetch: u16,
        load: f64,
        max_rate: MaxRate,
        mut rounds: Vec<[Run; 2]>,
    ) -> Self {
        let diff = |[raw_batch, lily]: &[Run; 2]| {
            (f64::from(lily.latency.p99_us) - f64::from(raw_batch.latency.p99_us)) / 1000.0
        };
        let rounds_p99_diff_ms = rounds.iter().map(diff).collect();
        rounds.sort_by(|a, b| diff(a).total_cmp(&diff(b)));
        let median = rounds[(rounds.len() - 1) / 2];
        let [raw_batch, lily] = median;
        let p99_diff_ms = diff(&median);
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
            rounds_p99_diff_ms,
            p99_margin_ms: P99_MARGIN_MS,
            met: p99_diff_ms <= P99_MARGIN_MS,
        }
    }
}

/// Everything one benchmark run measured.
#[derive(Debug, Serialize)]
pub struct Results {
    #[serde(flatten)]
    pub meta: crate::Meta,
    /// Messages each drain-rate measurement published (0 with `--max-rate`).
    pub max_rate_messages: u64,
    /// Publishing time of a paced run, and the warm-up excluded from its latencies.
    pub run_secs: f64,
    pub warmup_secs: f64,
    pub cases: Vec<Case>,
}
