//! The ACK window of one consuming channel: which deliveries are still open there, which ACKs
//! are ready, and the fewest frames that write them.
//!
//! A `basic.ack` with `multiple` set acknowledges every unacknowledged delivery up to its tag.
//! That is one frame, and for a quorum queue one log entry, instead of one per delivery, but it
//! is safe only when nothing at or below the tag is still being handled or was left unsettled.
//! The window writes one only then. It writes every other ready ACK on its own, so a slow
//! delivery never holds back the ACKs of the ones after it.
//!
//! When to write is the caller's choice; [`AckWindow::ripe`] says when waiting for more ready
//! ACKs cannot gain anything, or has gained enough.

use std::collections::VecDeque;

use crate::decision::SettleResult;

/// What the window knows about an open delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mark {
    /// Delivered and not settled (its NACK or reject, if any, was not queued). Never covered
    /// by a `multiple` ACK.
    Open,
    /// Its ACK is decided and waits to be written.
    Ready,
    /// Its ACK was written (or refused); the result waits for its owner.
    Done(SettleResult),
}

/// The open deliveries of one channel, by delivery tag, and their ready ACKs.
///
/// Register every delivery in tag order with [`deliver`](Self::deliver). Then, per delivery,
/// either mark its ACK [`ready`](Self::ready) and later [`take`](Self::take) the result after
/// someone ran [`flush`](Self::flush), or write its NACK or reject yourself and report it with
/// [`settled`](Self::settled). Entries live only while their delivery is open, so the window
/// holds at most the channel's prefetch, plus any delivery whose owner stopped before taking
/// its result.
///
/// A refused frame means the channel is closed or authority is revoked, so once a frame is
/// refused every later one is refused without being written.
#[derive(Debug)]
pub struct AckWindow {
    /// Open deliveries, ordered by tag.
    open: VecDeque<(u64, Mark)>,
    /// The highest tag delivered.
    last: u64,
    /// False once a tag arrived out of sequence: a delivery Lily never saw may be unacknowledged
    /// below a later tag, so no `multiple` ACK is written on this channel again.
    coalesce: bool,
    /// A frame was refused: nothing more is written.
    refused: bool,
    /// Entries marked [`Mark::Open`].
    opened: usize,
    /// Entries marked [`Mark::Ready`].
    readied: usize,
}

impl Default for AckWindow {
    fn default() -> Self {
        Self::new()
    }
}

impl AckWindow {
    /// The window of a new channel, whose first delivery tag is 1.
    pub fn new() -> Self {
        Self {
            open: VecDeque::new(),
            last: 0,
            coalesce: true,
            refused: false,
            opened: 0,
            readied: 0,
        }
    }

    /// Registers a delivery. The broker numbers a channel's deliveries 1, 2, 3, …; any other
    /// sequence turns coalescing off for good.
    pub fn deliver(&mut self, tag: u64) {
        debug_assert!(tag > self.last, "delivery tag {tag} after {}", self.last);
        self.opened += 1;
        if tag == self.last + 1 {
            self.open.push_back((tag, Mark::Open));
        } else {
            self.coalesce = false;
            let at = self.open.partition_point(|&(t, _)| t < tag);
            self.open.insert(at, (tag, Mark::Open));
        }
        self.last = self.last.max(tag);
    }

    fn position(&self, tag: u64) -> Option<usize> {
        self.open.binary_search_by_key(&tag, |&(t, _)| t).ok()
    }

    /// Marks the ACK of an open delivery as decided. False when `tag` is not open (it was never
    /// delivered, or is settled already): nothing was marked.
    pub fn ready(&mut self, tag: u64) -> bool {
        match self.position(tag) {
            Some(i) if self.open[i].1 == Mark::Open => {
                self.open[i].1 = Mark::Ready;
                self.opened -= 1;
                self.readied += 1;
                true
            }
            _ => false,
        }
    }

    /// Whether the ready ACKs should be written now rather than wait for more: no delivery is
    /// open (none can become ready soon), `batch` are ready below the first open one (one
    /// `multiple` ACK covers them), or waiting gains nothing because no `multiple` ACK can be
    /// written. False when nothing is ready.
    pub fn ripe(&self, batch: usize) -> bool {
        self.readied > 0 && (self.opened == 0 || self.full(batch))
    }

    /// Whether `batch` ready ACKs are below the first open delivery (one `multiple` ACK covers
    /// them), or no `multiple` ACK can be written, so waiting for more gains nothing. Unlike
    /// [`ripe`](Self::ripe), false while fewer are ready and nothing is open: for a caller that
    /// knows more deliveries are coming. False when nothing is ready.
    pub fn full(&self, batch: usize) -> bool {
        if self.readied == 0 {
            return false;
        }
        if !self.coalescing() {
            return true;
        }
        let covered = self
            .open
            .iter()
            .take_while(|&&(_, mark)| mark != Mark::Open)
            .filter(|&&(_, mark)| mark == Mark::Ready)
            .take(batch)
            .count();
        covered >= batch
    }

    /// Writes every ready ACK through `write(tag, multiple)`, in tag order and in as few frames
    /// as the rule allows: one `multiple` ACK for the ready deliveries below the first open one,
    /// then one frame for each other ready delivery. The result of each frame is kept for
    /// [`take`](Self::take).
    pub fn flush(&mut self, write: impl FnMut(u64, bool) -> SettleResult) {
        let mut write = refusing(&mut self.refused, write);
        self.readied -= cover(&mut self.open, self.coalesce, &mut write);
        for (tag, mark) in &mut self.open {
            if *mark == Mark::Ready {
                *mark = Mark::Done(write(*tag, false));
            }
        }
        self.readied = 0;
    }

    /// Writes only the `multiple` ACK of [`flush`](Self::flush): the ready ACKs above an open
    /// delivery stay ready, to be covered once it settles. With coalescing off, writes nothing.
    pub fn flush_covered(&mut self, write: impl FnMut(u64, bool) -> SettleResult) {
        let mut write = refusing(&mut self.refused, write);
        self.readied -= cover(&mut self.open, self.coalesce, &mut write);
    }

    /// Whether an ACK is marked ready and not written.
    pub fn has_ready(&self) -> bool {
        self.readied > 0
    }

    /// Whether `multiple` ACKs can still be written on this channel: its tags came in sequence
    /// and no frame was refused.
    pub fn coalescing(&self) -> bool {
        self.coalesce && !self.refused
    }

    /// Whether the ACK of `tag` is marked ready or written: its delivery is not open.
    pub fn marked(&self, tag: u64) -> bool {
        self.position(tag)
            .is_some_and(|i| self.open[i].1 != Mark::Open)
    }

    /// The result of a written ACK, removing its delivery; `None` while it is not written.
    pub fn take(&mut self, tag: u64) -> Option<SettleResult> {
        let i = self.position(tag)?;
        let Mark::Done(result) = self.open[i].1 else {
            return None;
        };
        self.open.remove(i);
        Some(result)
    }

    /// The delivery's NACK or reject frame was queued: it is no longer open. Call it only
    /// after the frame is queued, so no `multiple` ACK written in between can cover it.
    pub fn settled(&mut self, tag: u64) {
        if let Some(i) = self.position(tag) {
            match self.open[i].1 {
                Mark::Open => self.opened -= 1,
                Mark::Ready => self.readied -= 1,
                Mark::Done(_) => {}
            }
            self.open.remove(i);
        }
    }

    /// Deliveries open in the window.
    pub fn len(&self) -> usize {
        self.open.len()
    }

    /// Whether no delivery is open.
    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }
}

/// Writes one `multiple` ACK for the ready deliveries below the first open one (if `coalesce`),
/// marks them done, and returns how many it covered.
fn cover(
    open: &mut VecDeque<(u64, Mark)>,
    coalesce: bool,
    write: &mut impl FnMut(u64, bool) -> SettleResult,
) -> usize {
    if !coalesce {
        return 0;
    }
    // Below the first open delivery, every delivery is ready, written, or settled and gone: one
    // `multiple` ACK covers exactly the ready ones.
    let barrier = open
        .iter()
        .position(|&(_, mark)| mark == Mark::Open)
        .unwrap_or(open.len());
    let Some(end) = open
        .range(..barrier)
        .rposition(|&(_, mark)| mark == Mark::Ready)
    else {
        return 0;
    };
    let result = write(open[end].0, true);
    let mut covered = 0;
    for (_, mark) in open.range_mut(..=end) {
        if *mark == Mark::Ready {
            *mark = Mark::Done(result);
            covered += 1;
        }
    }
    covered
}

/// `write`, except that after a refusal nothing more is written.
fn refusing(
    refused: &mut bool,
    mut write: impl FnMut(u64, bool) -> SettleResult,
) -> impl FnMut(u64, bool) -> SettleResult {
    move |tag, multiple| {
        if *refused {
            return SettleResult::Refused;
        }
        let result = write(tag, multiple);
        *refused = result == SettleResult::Refused;
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Flushes and returns the frames written, each as (tag, multiple).
    fn flush(window: &mut AckWindow) -> Vec<(u64, bool)> {
        let mut frames = Vec::new();
        window.flush(|tag, multiple| {
            frames.push((tag, multiple));
            SettleResult::Written
        });
        frames
    }

    fn delivered(n: u64) -> AckWindow {
        let mut window = AckWindow::new();
        for tag in 1..=n {
            window.deliver(tag);
        }
        window
    }

    #[test]
    fn a_ready_run_from_the_front_is_one_multiple_ack() {
        let mut window = delivered(5);
        for tag in 1..=4 {
            assert!(window.ready(tag));
        }
        assert_eq!(flush(&mut window), vec![(4, true)]);
        for tag in 1..=4 {
            assert_eq!(window.take(tag), Some(SettleResult::Written));
        }
        assert_eq!(window.take(5), None);
        assert_eq!(window.len(), 1);
        assert!(!window.marked(5), "still open");
        window.ready(5);
        assert!(window.marked(5));
        flush(&mut window);
        assert!(window.marked(5), "written, its result not taken");
        window.take(5);
        assert!(!window.marked(5), "gone");
    }

    #[test]
    fn an_open_delivery_is_never_covered_and_holds_nothing_back() {
        let mut window = delivered(6);
        for tag in [1, 2, 4, 6] {
            window.ready(tag);
        }
        // 3 and 5 are still being handled: 1–2 together, then 4 and 6 one by one.
        assert_eq!(flush(&mut window), vec![(2, true), (4, false), (6, false)]);
        assert_eq!(flush(&mut window), vec![]);
    }

    #[test]
    fn settled_and_written_deliveries_do_not_break_a_run() {
        let mut window = delivered(5);
        window.ready(1);
        assert_eq!(flush(&mut window), vec![(1, true)]);
        // 2 was NACKed (its frame queued first), 1's result is not taken yet.
        window.settled(2);
        window.ready(3);
        window.ready(4);
        assert_eq!(flush(&mut window), vec![(4, true)]);
        assert_eq!(window.take(1), Some(SettleResult::Written));
        assert_eq!(window.take(4), Some(SettleResult::Written));
    }

    #[test]
    fn ready_acks_ripen_when_nothing_is_open_or_a_batch_is_ready() {
        let mut window = delivered(4);
        assert!(!window.ripe(2), "nothing is ready");
        window.ready(2);
        assert!(!window.ripe(2), "1, 3 and 4 may become ready soon");
        window.ready(4);
        assert!(
            !window.ripe(2),
            "2 and 4 need two frames while 1 and 3 are open"
        );
        window.ready(1);
        assert!(window.ripe(2), "one frame covers 1 and 2");
        assert!(!window.ripe(3));
        window.settled(3);
        assert!(window.ripe(10), "nothing is open: waiting gains nothing");
        flush(&mut window);
        assert!(!window.ripe(1), "everything ready was written");
        // Without coalescing a wait would save no frame.
        let mut window = AckWindow::new();
        window.deliver(1);
        window.deliver(3);
        window.ready(3);
        assert!(window.ripe(10));
    }

    #[test]
    fn a_covered_flush_leaves_the_acks_above_an_open_delivery_ready() {
        let mut window = delivered(5);
        for tag in [1, 2, 4] {
            window.ready(tag);
        }
        let mut frames = Vec::new();
        window.flush_covered(|tag, multiple| {
            frames.push((tag, multiple));
            SettleResult::Written
        });
        assert_eq!(frames, vec![(2, true)]);
        assert!(window.has_ready(), "4 waits for 3");
        window.ready(3);
        assert_eq!(flush(&mut window), vec![(4, true)]);
        assert!(!window.has_ready());
        assert_eq!(window.take(4), Some(SettleResult::Written));
    }

    #[test]
    fn after_a_refused_frame_nothing_more_is_written() {
        let mut window = delivered(3);
        window.ready(1);
        window.flush(|_, _| SettleResult::Refused);
        assert_eq!(window.take(1), Some(SettleResult::Refused));
        window.ready(2);
        window.ready(3);
        // Delivery 1 is unacknowledged at the broker: no later ACK may cover it.
        assert_eq!(flush(&mut window), vec![]);
        assert_eq!(window.take(2), Some(SettleResult::Refused));
        assert_eq!(window.take(3), Some(SettleResult::Refused));
    }

    #[test]
    fn a_gap_in_the_tags_turns_coalescing_off() {
        let mut window = AckWindow::new();
        window.deliver(1);
        window.deliver(3); // 2 never reached Lily: it may be unacknowledged.
        window.ready(1);
        window.ready(3);
        assert_eq!(flush(&mut window), vec![(1, false), (3, false)]);
        // A first tag other than 1 is a gap as well.
        let mut window = AckWindow::new();
        window.deliver(2);
        window.ready(2);
        assert_eq!(flush(&mut window), vec![(2, false)]);
    }

    #[test]
    fn unknown_or_repeated_acks_are_not_marked() {
        let mut window = delivered(2);
        assert!(!window.ready(7));
        assert!(window.ready(1));
        assert!(!window.ready(1));
        window.settled(2);
        assert!(!window.ready(2));
    }

    /// Random interleavings: every frame covers only deliveries whose ACK was ready, every ready
    /// ACK is written exactly once, and the window empties.
    #[test]
    fn random_interleavings_never_ack_an_undecided_delivery() {
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _ in 0..200 {
            let total = 1 + next(60);
            let mut window = AckWindow::new();
            // Per tag: 0 not yet delivered, 1 open, 2 ready, 3 nacked, 4 acked at the broker.
            let mut state = vec![0u8; total as usize + 1];
            let mut delivered = 0;
            let mut steps = 0;
            while state[1..].iter().any(|&s| s < 3) {
                steps += 1;
                assert!(steps < 100_000, "no progress");
                match next(4) {
                    0 if delivered < total => {
                        delivered += 1;
                        window.deliver(delivered);
                        state[delivered as usize] = 1;
                    }
                    1 => {
                        let tag = 1 + next(total);
                        if state[tag as usize] == 1 {
                            if next(4) == 0 {
                                state[tag as usize] = 3;
                                window.settled(tag);
                            } else {
                                assert!(window.ready(tag));
                                state[tag as usize] = 2;
                            }
                        }
                    }
                    _ => {
                        let mut frames = Vec::new();
                        window.flush(|tag, multiple| {
                            frames.push((tag, multiple));
                            SettleResult::Written
                        });
                        for (tag, multiple) in frames {
                            assert_eq!(state[tag as usize], 2, "wrote tag {tag} twice or early");
                            let low = if multiple { 1 } else { tag };
                            for t in low..=tag {
                                match state[t as usize] {
                                    2 => state[t as usize] = 4,
                                    3 | 4 => {}
                                    s => panic!("multiple ACK {tag} covered tag {t} in state {s}"),
                                }
                            }
                        }
                        for tag in 1..=delivered {
                            if state[tag as usize] == 4 && window.take(tag).is_some() {
                                assert!(window.take(tag).is_none());
                            }
                        }
                    }
                }
            }
            assert!(window.is_empty(), "{window:?}");
        }
    }

    #[test]
    fn full_waits_for_a_batch_even_when_nothing_is_open() {
        let mut window = AckWindow::new();
        for tag in 1..=3 {
            window.deliver(tag);
            assert!(window.ready(tag));
        }
        assert!(
            window.ripe(4),
            "nothing open: nothing more can become ready soon"
        );
        assert!(
            !window.full(4),
            "more may be delivered: the batch is not full"
        );
        window.deliver(4);
        assert!(window.ready(4));
        assert!(window.full(4));
    }
}
