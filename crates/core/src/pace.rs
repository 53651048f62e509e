//! When the ready ACKs of one consuming channel are written: the [`AckWindow`] with a clock.
//!
//! An ACK written the moment it is ready costs a frame, and on a quorum queue a log entry, per
//! delivery. Waiting a little lets the ACKs that become ready about the same time share one
//! `multiple` frame. [`AckPacer`] decides how long: the caller marks ACKs ready, asks
//! [`poll_timeout`](AckPacer::poll_timeout) when to come back, and calls
//! [`poll_flush`](AckPacer::poll_flush) then (or whenever it is woken), which writes what is due
//! through the caller's `write`. The pacer reads no clock and does no I/O: every instant is the
//! caller's, so it is tested with made-up times.
//!
//! - **Linger.** The oldest unwritten ACK waits [`ACK_LINGER`] for others, unless waiting
//!   cannot gain anything ([`AckWindow::ripe`]: nothing open, or half the prefetch ready).
//! - **Hold.** When a flush leaves ready ACKs above a delivery still being handled (a
//!   `multiple` frame must not cover it), they wait for it to settle, until the oldest has waited
//!   [`ACK_HOLD`]; then they are written one frame each.
//! - **Backlog.** While the work queue holds a backlog (at least half the prefetch ready, as
//!   the transport measures and reports with [`set_backlog`](AckPacer::set_backlog)), more
//!   deliveries are on their way even when none is open: the wait is [`BACKLOG_HOLD`], only a
//!   full batch is written early ([`AckWindow::full`]), and the hold for an open delivery starts
//!   after the backlog hold.

use std::time::{Duration, Instant};

use crate::acks::AckWindow;
use crate::decision::SettleResult;

/// How long a ready ACK waits for others to share its frame outside a backlog.
pub const ACK_LINGER: Duration = Duration::from_millis(1);

/// How long a ready ACK waits for others to share its frame while the work queue holds a
/// backlog.
pub const BACKLOG_HOLD: Duration = Duration::from_millis(3);

/// How long a ready ACK above a delivery still being handled waits for that one to settle, so
/// one `multiple` frame covers both, before it is written on its own; in a backlog, after the
/// [`BACKLOG_HOLD`].
pub const ACK_HOLD: Duration = Duration::from_millis(2);

/// The ACK window of one channel and when its ready ACKs are written (see the module's text).
#[derive(Debug)]
pub struct AckPacer {
    window: AckWindow,
    /// Ready ACKs that make a frame worth writing at once: half the prefetch.
    batch: usize,
    /// Whether the work queue held a backlog when last measured.
    backlog: bool,
    /// When the ready ACKs are next due; `None` while nothing is ready.
    due: Option<Instant>,
    /// When the oldest unwritten ready ACK was marked.
    since: Option<Instant>,
}

impl AckPacer {
    /// The pacer of a new channel whose prefetch is `prefetch`.
    pub fn new(prefetch: u16) -> Self {
        Self {
            window: AckWindow::new(),
            batch: usize::from(prefetch / 2).max(1),
            backlog: false,
            due: None,
            since: None,
        }
    }

    /// Ready ACKs worth a frame at once: half the prefetch, at least one.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Notes how many messages the work queue holds ready (`None` when unknown): at least a
    /// batch is a backlog.
    pub fn set_backlog(&mut self, ready: Option<u32>) {
        self.backlog = ready.is_some_and(|ready| ready as usize >= self.batch);
    }

    /// Whether the work queue held a backlog when last measured.
    pub fn backlogged(&self) -> bool {
        self.backlog
    }

    /// Registers a delivery; see [`AckWindow::deliver`].
    pub fn deliver(&mut self, tag: u64) {
        self.window.deliver(tag);
    }

    /// Marks the ACK of `tag` ready and starts its linger. `now` is called only when no linger
    /// runs yet: on a busy channel one does, and a clock read is time every delivery pays.
    /// False when `tag` is not open: nothing was marked.
    pub fn ready(&mut self, tag: u64, now: impl FnOnce() -> Instant) -> bool {
        if !self.window.ready(tag) {
            return false;
        }
        if self.since.is_none() || self.due.is_none() {
            let now = now();
            self.since.get_or_insert(now);
            self.due.get_or_insert(now + self.linger());
        }
        true
    }

    /// When [`poll_flush`](Self::poll_flush) next has something to write, unless more ACKs
    /// become ready first; `None` while nothing is ready.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.due
    }

    /// Writes the ready ACKs through `write(tag, multiple)` if they are due at `now` or waiting
    /// gains nothing; true when it wrote. The ACKs above a delivery still being handled are
    /// written one frame each only once the hold ran out; until then they stay ready.
    pub fn poll_flush(
        &mut self,
        now: Instant,
        write: impl FnMut(u64, bool) -> SettleResult,
    ) -> bool {
        let ripe = if self.backlog {
            self.window.full(self.batch)
        } else {
            self.window.ripe(self.batch)
        };
        match self.due {
            Some(due) if now < due && !ripe => false,
            _ => {
                self.flush(now, write);
                true
            }
        }
    }

    /// Writes the ready ACKs now, as [`poll_flush`](Self::poll_flush) does once they are due.
    pub fn flush(&mut self, now: Instant, write: impl FnMut(u64, bool) -> SettleResult) {
        let held = self.since.is_some_and(|since| now >= since + self.hold());
        if held || !self.window.coalescing() {
            self.window.flush(write);
        } else {
            self.window.flush_covered(write);
        }
        if self.window.has_ready() {
            // The rest wait for the deliveries below them, until the hold runs out.
            self.due = Some(
                self.since
                    .map_or(now, |since| (now + self.linger()).min(since + self.hold())),
            );
        } else {
            self.due = None;
            self.since = None;
        }
    }

    /// The result of a written ACK; see [`AckWindow::take`].
    pub fn take(&mut self, tag: u64) -> Option<SettleResult> {
        self.window.take(tag)
    }

    /// Whether the ACK of `tag` is marked ready or written; see [`AckWindow::marked`].
    pub fn marked(&self, tag: u64) -> bool {
        self.window.marked(tag)
    }

    /// Whether an ACK is ready and not written.
    pub fn has_ready(&self) -> bool {
        self.window.has_ready()
    }

    /// The delivery's NACK or reject was queued; see [`AckWindow::settled`].
    pub fn settled(&mut self, tag: u64) {
        self.window.settled(tag);
    }

    fn linger(&self) -> Duration {
        if self.backlog {
            BACKLOG_HOLD
        } else {
            ACK_LINGER
        }
    }

    fn hold(&self) -> Duration {
        if self.backlog {
            BACKLOG_HOLD + ACK_HOLD
        } else {
            ACK_HOLD
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// Flushes at `now` and returns the frames written, as `(tag, multiple)`.
    fn flush_at(pacer: &mut AckPacer, now: Instant) -> Vec<(u64, bool)> {
        let mut frames = Vec::new();
        pacer.flush(now, |tag, multiple| {
            frames.push((tag, multiple));
            SettleResult::Written
        });
        frames
    }

    /// A pacer with deliveries `1..=open` and the ACKs of `ready` marked at `at`.
    fn pacer(backlog: bool, open: u64, ready: &[u64], at: Instant) -> AckPacer {
        let mut pacer = AckPacer::new(100);
        pacer.set_backlog(Some(if backlog { 1_000 } else { 0 }));
        for tag in 1..=open {
            pacer.deliver(tag);
        }
        for &tag in ready {
            assert!(pacer.ready(tag, || at));
        }
        pacer
    }

    #[test]
    fn a_ready_ack_lingers_for_others_unless_nothing_is_open() {
        let t = Instant::now();
        // Delivery 2 is still open: the ACK of 1 lingers.
        let mut p = pacer(false, 2, &[1], t);
        assert_eq!(p.poll_timeout(), Some(t + ACK_LINGER));
        let never = |_, _| -> SettleResult { panic!("written before it was due") };
        assert!(!p.poll_flush(t, never));
        // Nothing open: waiting gains nothing.
        let mut p = pacer(false, 1, &[1], t);
        assert!(p.poll_flush(t, |tag, multiple| {
            assert_eq!((tag, multiple), (1, true));
            SettleResult::Written
        }));
        assert_eq!(p.take(1), Some(SettleResult::Written));
        assert_eq!(p.poll_timeout(), None);
    }

    #[test]
    fn the_clock_is_read_only_to_start_a_linger() {
        let t = Instant::now();
        let mut p = pacer(false, 3, &[1], t);
        assert!(p.ready(2, || panic!("the clock was read with a linger running")));
        assert!(!p.ready(2, || t), "an ACK marked twice");
        assert!(!p.ready(9, || t), "a tag never delivered");
    }

    #[test]
    fn outside_a_backlog_acks_above_an_open_delivery_wait_the_hold_for_it() {
        let t = Instant::now();
        // 1 open, 2 ready: no frame may cover 1.
        let mut p = pacer(false, 2, &[2], t);
        // The linger ran out: nothing one frame covers, and 2 waits for the hold.
        assert_eq!(flush_at(&mut p, t + ACK_LINGER), vec![]);
        assert_eq!(p.poll_timeout(), Some(t + ACK_HOLD));
        assert_eq!(flush_at(&mut p, t + ACK_HOLD), vec![(2, false)]);
    }

    #[test]
    fn in_a_backlog_the_hold_for_an_open_delivery_starts_after_the_backlog_hold() {
        let t = Instant::now();
        let mut p = pacer(true, 3, &[1, 3], t);
        assert_eq!(p.poll_timeout(), Some(t + BACKLOG_HOLD));
        // The batch's wait ran out: what one frame covers is written, and the ACK above the
        // open delivery 2 is not written on its own yet.
        assert_eq!(flush_at(&mut p, t + BACKLOG_HOLD), vec![(1, true)]);
        assert_eq!(p.poll_timeout(), Some(t + BACKLOG_HOLD + ACK_HOLD));
        assert_eq!(flush_at(&mut p, t + BACKLOG_HOLD + ACK_HOLD - MS), vec![]);
        assert_eq!(
            flush_at(&mut p, t + BACKLOG_HOLD + ACK_HOLD),
            vec![(3, false)]
        );
    }

    #[test]
    fn in_a_backlog_only_a_full_batch_is_written_early() {
        let t = Instant::now();
        let mut p = pacer(true, 60, &[], t);
        for tag in 1..=49 {
            assert!(p.ready(tag, || t));
        }
        // Nothing else is open but more deliveries are coming: 49 of a batch of 50 wait.
        let never = |_, _| -> SettleResult { panic!("written before the batch was full") };
        assert!(!p.poll_flush(t, never));
        assert!(p.ready(50, || t));
        let mut frames = Vec::new();
        assert!(p.poll_flush(t, |tag, multiple| {
            frames.push((tag, multiple));
            SettleResult::Written
        }));
        assert_eq!(frames, vec![(50, true)]);
        // Written early, the next ones wait a backlog hold from their own mark.
        assert!(p.ready(51, || t + MS));
        assert_eq!(p.poll_timeout(), Some(t + MS + BACKLOG_HOLD));
    }

    #[test]
    fn a_backlog_is_half_the_prefetch_ready() {
        let mut p = AckPacer::new(100);
        p.set_backlog(Some(49));
        assert!(!p.backlogged());
        p.set_backlog(Some(50));
        assert!(p.backlogged());
        p.set_backlog(None);
        assert!(!p.backlogged());
        assert_eq!(AckPacer::new(1).batch(), 1);
    }
}
