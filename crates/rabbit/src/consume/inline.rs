//! The consume loop's own share of the deliveries.
//!
//! Handing a delivery to a worker costs a wake-up of another thread, and on a busy node that costs
//! more than most handlers do: one that parses the message and updates something in memory is done
//! in microseconds. So the consume loop polls each delivery once itself, and where that first poll
//! stops decides the rest:
//!
//! - **The delivery ended** (the gate settled it): nothing is left to do.
//! - **Its ACK is marked ready** (the handler succeeded without waiting for anything): it is
//!   *parked* here. Parked ACKs are written together, as one `multiple` frame when nothing below
//!   them is still being handled, once half the prefetch is parked, before the loop waits for a
//!   worker, and when nothing more is buffered and the loop's previous ACK frame has been sent.
//!   That last rule is Nagle's: a frame goes out at once when none is on its way, and while one is,
//!   the ACKs that become ready share the next. So a lone delivery is ACKed without a wait, and
//!   under load the frames grow by themselves, the way a loop that awaits each `multiple` ACK
//!   batches them, without holding an ACK for a timer (tokio's timer rounds up to whole
//!   milliseconds). Each parked delivery is then polled again, finds its result and ends (one whose
//!   ACK waits above a delivery still being handled finishes on a task of its own, see
//!   [`Session::ack`]).
//!
//!   How fast the loop catches up with lapin decides how large Nagle's frames are, and on an idle
//!   machine they carried 5 to 15 ACKs in a backlog: a frame each is a log entry on a quorum queue.
//!   So while the work queue holds a backlog (at least half the prefetch ready, as a passive
//!   declare says at the session's start and every 200 ms, see [`Session::backlogged`]) more
//!   deliveries are known to be on their way, and parked ACKs wait for half the prefetch or
//!   [`BACKLOG_HOLD`] instead.
//! - **It waits for anything else** (a handler awaiting I/O, a copy's confirm, a transaction): it
//!   goes to the worker hired for it, which finishes it.
//!
//! A handler that computes for long without waiting would keep every delivery on the loop's one
//! thread. So the loop counts its first polls that took longer than [`HEAVY`] and than
//! [`GATE_FACTOR`] times the gate (Lily's own work, at this build's speed) against those that
//! did not; while the long ones lead by [`LEAD`], deliveries go to the crew unpolled, to run in
//! parallel on every worker thread (their gate, dispatch and ledger entry, a few microseconds,
//! still run here, see [`crate::delivery::work`]), and one in [`PROBE`] is still polled here: the
//! first such probe that is short ends the spell. A count, not an average: on a busy node the
//! thread is sometimes descheduled in the middle of a poll, and one such poll must not look like a
//! heavy handler. Nor must a burst of them keep light handlers off the loop for long: a spell that
//! ended only after as many short probes as long polls began it once sent hundreds of deliveries in
//! a row to workers, whose ACKs share frames less well.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::Pin;
use std::task::Poll;
use std::time::{Duration, Instant};

use lily_mq_core::transport::BACKLOG_HOLD;
use tokio_util::task::TaskTracker;
use tracing::error;

use super::crew::Job;
use crate::channel::{Sending, Session, first_poll};
use crate::service::Revoked;

/// A first poll longer than this is worth a hand-off to another thread, at the least: a wake-up
/// of another thread costs about as much on a busy node.
const HEAVY: Duration = Duration::from_micros(50);

/// A first poll counts as heavy only when it is also this many times as long as the gate took
/// for the same delivery. The gate is Lily's own work and runs at the speed of this build and
/// this machine: an unoptimised build runs it many times slower (a first poll took 20–50 µs
/// for a handler that only records its call, in this project's tests), and a fixed 50 µs took
/// light handlers for heavy ones there. Measured against the gate, the threshold follows the
/// build without asking which one it is.
const GATE_FACTOR: u32 = 16;

/// How much of the gate's running average one new measure moves: 1/8.
const GATE_WEIGHT: u32 = 8;

/// One delivery's gate in this many is timed: a clock read is time every delivery would pay,
/// and the average moves slowly anyway.
const GATE_SAMPLE: u32 = 8;

/// How far the long first polls must lead the short ones for handlers to count as heavy.
const LEAD: u8 = 8;

/// While handlers are heavy, one delivery in this many is still polled on the loop.
const PROBE: u32 = 64;

/// Boxes kept for the next deliveries at most: a box each is allocated and freed otherwise, and
/// at 1.8 KB it is too large for the allocator's per-thread cache.
const SPARE: usize = 256;

/// The parked deliveries of one session and what the loop knows of its first polls. `F` is a
/// delivery's work (see [`crate::delivery::work`]).
pub(crate) struct Inline<'s, F> {
    parked: Vec<Pin<Box<F>>>,
    spare: Spare<F>,
    /// When the oldest parked delivery was parked.
    since: Option<Instant>,
    /// The loop's last ACK frame, until lapin's I/O loop has sent it.
    sending: Option<Sending<'s>>,
    /// Parked deliveries worth writing at once: half the prefetch, as [`Session`] counts it.
    batch: usize,
    weight: Weight,
}

/// What the loop knows of its first polls: whether handlers are heavy (see the module's text).
#[derive(Debug, Default)]
struct Weight {
    /// Long first polls minus short ones, kept within `0..=LEAD`.
    long: u8,
    /// Deliveries started, for the probe.
    started: u32,
    /// The gate's running average; zero until the first measure.
    gate: Duration,
    /// Deliveries since the gate was last timed.
    untimed: u32,
}

impl Weight {
    /// Whether the next delivery is polled on the loop: always while handlers are light, one
    /// in [`PROBE`] while they are heavy.
    fn poll_here(&mut self) -> bool {
        self.started = self.started.wrapping_add(1);
        self.long < LEAD || self.started.is_multiple_of(PROBE)
    }

    /// Whether the next delivery's gate is timed: the first, then one in [`GATE_SAMPLE`].
    fn time_gate(&mut self) -> bool {
        let due = self.untimed == 0;
        self.untimed = (self.untimed + 1) % GATE_SAMPLE;
        due
    }

    /// Notes how long a delivery's gate took: see [`GATE_FACTOR`].
    fn note_gate(&mut self, took: Duration) {
        self.gate = if self.gate.is_zero() {
            took
        } else {
            (self.gate * (GATE_WEIGHT - 1) + took) / GATE_WEIGHT
        };
    }

    /// Notes how long a first poll on the loop took.
    fn note(&mut self, took: Duration) {
        let heavy = took > HEAVY.max(self.gate * GATE_FACTOR);
        self.long = match (heavy, self.long >= LEAD) {
            (true, _) => (self.long + 1).min(LEAD),
            // A short probe: handlers are light again.
            (false, true) => 0,
            (false, false) => self.long.saturating_sub(1),
        };
    }
}

/// Boxes of deliveries that ended on the loop, for the next ones: their work is written into
/// one in place of a new allocation.
struct Spare<F>(Vec<Pin<Box<F>>>);

impl<F: Future> Spare<F> {
    /// `work` in a box, a kept one if there is one.
    fn boxed(&mut self, work: F) -> Pin<Box<F>> {
        match self.0.pop() {
            Some(mut job) => {
                job.set(work);
                job
            }
            None => Box::pin(work),
        }
    }

    /// Keeps the box of work that ended, up to [`SPARE`] of them.
    fn keep(&mut self, job: Pin<Box<F>>) {
        if self.0.len() < SPARE {
            self.0.push(job);
        }
    }
}

impl<'s, F: Future<Output = ()> + Send + 'static> Inline<'s, F> {
    pub(crate) fn new(batch: usize) -> Self {
        Self {
            parked: Vec::with_capacity(batch),
            spare: Spare(Vec::new()),
            since: None,
            sending: None,
            batch,
            weight: Weight::default(),
        }
    }

    /// When the next delivery's gate begins, if it is to be timed (see [`GATE_SAMPLE`]).
    pub(crate) fn gate_clock(&mut self) -> Option<Instant> {
        self.weight.time_gate().then(Instant::now)
    }

    /// Runs `work`, the delivery of `tag` on `session`, up to where it first stops (see the
    /// module's text); returns it when a worker must finish it. `gated` is when its gate began,
    /// from [`Inline::gate_clock`].
    pub(crate) fn start(
        &mut self,
        work: F,
        session: &Session,
        tag: u64,
        gated: Option<Instant>,
    ) -> Option<Job> {
        let mut job = self.spare.boxed(work);
        let here = self.weight.poll_here();
        if !here && gated.is_none() {
            return Some(job);
        }
        let began = Instant::now();
        if let Some(gated) = gated {
            self.weight.note_gate(began - gated);
        }
        if !here {
            return Some(job);
        }
        let polled = poll(&mut job);
        self.weight.note(began.elapsed());
        match polled {
            Some(Poll::Pending) if session.ack_marked(tag) => {
                self.since.get_or_insert(began);
                self.parked.push(job);
                None
            }
            Some(Poll::Pending) => Some(job),
            Some(Poll::Ready(())) => {
                self.spare.keep(job);
                None
            }
            None => None,
        }
    }

    /// Whether the parked ACKs make a frame worth writing now.
    pub(crate) fn full(&self) -> bool {
        self.parked.len() >= self.batch
    }

    /// Whether ACKs are parked.
    pub(crate) fn parked(&self) -> bool {
        !self.parked.is_empty()
    }

    /// Until when the parked ACKs wait for others while the queue holds a backlog; `None` when
    /// nothing is parked.
    pub(crate) fn hold_until(&self) -> Option<Instant> {
        self.since.map(|since| since + BACKLOG_HOLD)
    }

    /// Completes once the loop's last ACK frame has been sent (at once if none is on its way).
    pub(crate) async fn sent(&mut self) {
        if let Some(sending) = self.sending.as_mut() {
            // An error is the channel's: the ACKs it held are settled as written, and the
            // session's confirmation round trip finds them uncertain.
            let _ = sending.await;
            self.sending = None;
        }
    }

    /// Writes every ready ACK of `session` and lets each parked delivery end with its result.
    pub(crate) fn settle(
        &mut self,
        session: &'s Session,
        revoked: &Revoked,
        tracker: &TaskTracker,
    ) {
        if self.parked.is_empty() {
            return;
        }
        self.since = None;
        if let Some(sending) = session.flush_ready(revoked) {
            self.sending = Some(sending);
        }
        for mut job in self.parked.drain(..) {
            match poll(&mut job) {
                Some(Poll::Ready(())) => self.spare.keep(job),
                // Not reached while the window writes every ready ACK at once; if it ever
                // is, the delivery still finishes, on a task of its own.
                Some(Poll::Pending) => {
                    tracker.spawn(job);
                }
                None => {}
            }
        }
    }
}

/// Polls `job` once on the loop. A panic outside the handler's guard (which catches the
/// handler's own) is a bug in Lily: it is logged and the delivery is dropped where it is, as a
/// worker's would be; its ledger entry stays open and is reported.
fn poll<F: Future<Output = ()>>(job: &mut Pin<Box<F>>) -> Option<Poll<()>> {
    match catch_unwind(AssertUnwindSafe(|| first_poll(job.as_mut()))) {
        Ok(poll) => Some(poll),
        Err(_) => {
            error!("a delivery panicked outside its handler's guard; it stays unresolved");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LONG: Duration = Duration::from_millis(3);
    const SHORT: Duration = Duration::from_micros(5);

    /// Notes `polls` first polls of `took`, each only when the delivery was polled here;
    /// returns how many were.
    fn run(weight: &mut Weight, polls: u32, took: Duration) -> u32 {
        let mut here = 0;
        for _ in 0..polls {
            if weight.poll_here() {
                weight.note(took);
                here += 1;
            }
        }
        here
    }

    #[test]
    fn the_next_delivery_takes_a_kept_box() {
        let mut spare = Spare(Vec::new());
        let first = spare.boxed(std::future::ready(()));
        let at: *const _ = &*first;
        spare.keep(first);
        let second = spare.boxed(std::future::ready(()));
        assert!(std::ptr::eq(at, &*second), "a new box was allocated");
        // Up to SPARE are kept, no more.
        for _ in 0..SPARE + 8 {
            spare.keep(Box::pin(std::future::ready(())));
        }
        assert_eq!(spare.0.len(), SPARE);
    }

    #[test]
    fn long_first_polls_send_deliveries_to_the_crew_but_one_in_probe() {
        let mut weight = Weight::default();
        assert_eq!(run(&mut weight, u32::from(LEAD), LONG), u32::from(LEAD));
        assert_eq!(run(&mut weight, 10 * PROBE, LONG), 10);
    }

    #[test]
    fn a_few_long_first_polls_among_short_ones_keep_handlers_light() {
        let mut weight = Weight::default();
        for _ in 0..100 {
            run(&mut weight, 1, LONG);
            run(&mut weight, 1, SHORT);
        }
        assert_eq!(
            run(&mut weight, u32::from(LEAD) - 1, LONG),
            u32::from(LEAD) - 1
        );
        assert!(
            weight.poll_here(),
            "seven long polls in a row are not a lead of eight"
        );
    }

    #[test]
    fn a_slow_gate_raises_the_bar_for_a_heavy_handler() {
        let mut weight = Weight::default();
        // An unoptimised build: the gate takes 30 µs, a light handler's first poll 200 µs.
        for _ in 0..64 {
            weight.note_gate(Duration::from_micros(30));
        }
        let light = Duration::from_micros(200);
        assert_eq!(run(&mut weight, 10 * PROBE, light), 10 * PROBE);
        // Long against the gate too: heavy.
        let heavy = Duration::from_micros(30 * u64::from(GATE_FACTOR) + 100);
        assert_eq!(run(&mut weight, u32::from(LEAD), heavy), u32::from(LEAD));
        assert_eq!(run(&mut weight, PROBE, heavy), 1, "one probe in PROBE");
    }

    #[test]
    fn the_first_gate_and_then_one_in_gate_sample_are_timed() {
        let mut weight = Weight::default();
        let timed: Vec<bool> = (0..2 * GATE_SAMPLE).map(|_| weight.time_gate()).collect();
        assert_eq!(timed.iter().filter(|t| **t).count(), 2);
        assert!(timed[0] && timed[GATE_SAMPLE as usize]);
        // The first measure is the average; later ones move it by 1/GATE_WEIGHT.
        weight.note_gate(Duration::from_micros(80));
        assert_eq!(weight.gate, Duration::from_micros(80));
        weight.note_gate(Duration::from_micros(0));
        assert_eq!(weight.gate, Duration::from_micros(70));
    }

    #[test]
    fn the_first_short_probe_ends_a_heavy_spell() {
        let mut weight = Weight::default();
        // However long the spell lasted.
        run(&mut weight, 100 * PROBE, LONG);
        // Deliveries until the probe go to the crew; the probe is short.
        assert_eq!(run(&mut weight, PROBE, SHORT), 1);
        // Light again, and a new spell needs a new lead of LEAD long polls.
        let below = u32::from(LEAD) - 1;
        assert_eq!(run(&mut weight, below, LONG), below);
        assert_eq!(run(&mut weight, PROBE, SHORT), PROBE);
    }
}
