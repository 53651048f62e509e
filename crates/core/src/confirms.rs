//! Whose evidence is it when many publishes are in flight on one confirm channel at once.
//!
//! A channel in confirm mode that carried one batch at a time could judge a batch once all its
//! confirms were in, but a batch waiting for the broker's next fsync kept its channel idle, and
//! copies that came meanwhile waited for a free channel and for the fsync after it. [`InFlight`]
//! judges publishes pipelined on one channel, each as soon as its own evidence is complete,
//! from what the client shows and in what order it showed it (see [`crate::handoff`] for why a
//! return's identity, not its arrival, decides).
//!
//! The client (lapin) keeps the channel's `basic.return`s in arrival order and hands the oldest
//! to each confirm it completes, whichever publish the confirm is for. RabbitMQ sends a
//! publish's return before its confirm. So:
//!
//! 1. **A confirm that brought no return proves the queue of returns was empty when it
//!    completed**: every return that arrived before it was handed to a confirm completed before
//!    it. The return of a publish `X` arrives before `X`'s confirm, so once `X`'s confirm
//!    brought nothing, `X`'s return (if any) is on a confirm that completed before `X`'s.
//! 2. **Every confirm completed before `X`'s has been seen** once the transport has handled
//!    every wake-up registered so far (a *quiet point*, [`InFlight::handle_quiet`]), provided
//!    each confirm had its waker registered before it could complete. A confirm is numbered when
//!    its publish is first polled and can be awaited only once its frames are written; a
//!    publish numbered before `X`'s confirm was seen and still being written might have been
//!    confirmed already, unseen. So `X` also waits until no such publish is still being
//!    written.
//! 3. **A confirm that brought another publish's return** proves nothing about `X`'s own: it
//!    may still be queued. A later confirm that brought nothing (rule 1 for a confirm known to
//!    complete after `X`'s was seen: it was numbered, or found pending, in a later epoch) proves
//!    it was handed out before; so does a channel with nothing in flight, since then every
//!    return has been handed to a confirm (each return has its own confirm after it).
//!
//! A return counts only against the publish whose id it carries, and proves that publish was
//! dropped whatever its confirm said. A return that carries no id, or the id of no publish in
//! flight here, means the channel's evidence is confused: every publish still unjudged fails
//! (its original is requeued; at worst the message exists twice, never zero times) and the
//! channel must not carry another publish. So must a channel that failed, or on which a
//! publish's deadline passed before its confirm came (the confirm may still come, and take
//! another publish's return, even when the publish's own return came), or that was nacked
//! (RabbitMQ may keep nacking a channel that published to a full quorum queue).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use crate::decision::HandoffResult;
use crate::handoff::{Confirm, HandoffId};

/// A publish's place on its channel, in the order publishes were numbered.
pub type Seq = u64;

/// The evidence of one confirm channel carrying many publishes at once; see the module's text.
///
/// The transport reports what it observes through `handle_*` and takes verdicts with
/// [`InFlight::poll_verdict`]. Time is counted in *epochs*: an epoch ends at each quiet point.
#[derive(Debug, Default)]
pub struct InFlight {
    epoch: u64,
    next: Seq,
    members: BTreeMap<Seq, Member>,
    by_id: HashMap<HandoffId, Seq>,
    /// Numbered publishes whose frames are not written yet.
    writing: BTreeSet<Seq>,
    /// Members whose confirm was seen and who are not judged yet.
    resolved: BTreeSet<Seq>,
    /// Members whose confirm was not seen yet.
    unseen: usize,
    /// A member seen in an epoch below this has had its return handed out (rule 3).
    proven_below: u64,
    /// Why the channel must carry no further publish, if it must not.
    retired: Option<Retired>,
    verdicts: VecDeque<(Seq, HandoffResult)>,
}

/// Why a channel must carry no further publish.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retired {
    /// A return with no id or a stranger's, a publish or confirm that failed, or one that
    /// timed out: nothing unjudged on it could be proven any more, and everything was judged
    /// at once. The channel is closed, which discards what the client still keeps for it.
    Confused,
    /// A publish was nacked: what is in flight is still judged as its evidence comes, but
    /// nothing new may join it.
    Draining,
}

#[derive(Debug)]
struct Member {
    id: HandoffId,
    /// The latest epoch in which its confirm was known not to have completed.
    floor: u64,
    returned: bool,
    seen: Option<Seen>,
}

#[derive(Clone, Copy, Debug)]
struct Seen {
    confirm: Confirm,
    /// Its confirm brought no return.
    brought_none: bool,
    epoch: u64,
    /// Every publish numbered before it was seen is below this.
    horizon: Seq,
}

impl InFlight {
    /// A channel with nothing in flight.
    pub fn new() -> Self {
        Self::default()
    }

    /// A publish carrying `id` was numbered on the channel (its first poll queued its frames).
    pub fn handle_published(&mut self, id: HandoffId) -> Seq {
        let seq = self.next;
        self.next += 1;
        self.members.insert(
            seq,
            Member {
                id,
                floor: self.epoch,
                returned: false,
                seen: None,
            },
        );
        self.by_id.insert(id, seq);
        self.writing.insert(seq);
        self.unseen += 1;
        seq
    }

    /// The frames of `seq` are written: its confirm now has a waker, or has been seen.
    pub fn handle_written(&mut self, seq: Seq) {
        self.writing.remove(&seq);
    }

    /// The confirm of `seq` was polled and had not completed.
    pub fn handle_pending(&mut self, seq: Seq) {
        if let Some(member) = self.members.get_mut(&seq) {
            member.floor = self.epoch;
        }
    }

    /// The confirm of `seq` completed with `confirm` (an ACK or a NACK), and the client handed
    /// it `brought`: `None` when no return came with it, `Some(id)` the id that return carries
    /// (`Some(None)`: a return without one).
    pub fn handle_confirm(
        &mut self,
        seq: Seq,
        confirm: Confirm,
        brought: Option<Option<HandoffId>>,
    ) {
        self.writing.remove(&seq);
        if let Some(returned) = brought {
            self.handle_returned(returned);
        }
        let (epoch, horizon) = (self.epoch, self.next);
        let Some(member) = self.members.get_mut(&seq) else {
            return;
        };
        if member.seen.is_none() {
            self.unseen -= 1;
        }
        member.seen = Some(Seen {
            confirm,
            brought_none: brought.is_none(),
            epoch,
            horizon,
        });
        self.resolved.insert(seq);
        if confirm == Confirm::Nack {
            self.retire(Retired::Draining);
        }
    }

    /// The publish of `seq`, or its confirm, failed on the channel: it has no confirm, and
    /// nothing else on the channel can be proven any more.
    pub fn handle_failed(&mut self, seq: Seq) {
        self.judge(seq, HandoffResult::Failed);
        self.confuse();
    }

    /// The deadlines of `expired` passed. A member whose confirm was seen but not proven
    /// fails; one whose confirm never came timed out (or was returned, if its return came). A
    /// confirm that never came may still come and take another publish's return unseen, so
    /// then nothing else on the channel can be proven any more.
    pub fn handle_expired(&mut self, expired: &[Seq]) {
        let mut unseen = false;
        for &seq in expired {
            let Some(member) = self.members.get(&seq) else {
                continue;
            };
            unseen |= member.seen.is_none();
            let result = match member.seen {
                _ if member.returned => HandoffResult::Returned,
                Some(seen) if seen.confirm == Confirm::Nack => HandoffResult::Nacked,
                Some(_) => HandoffResult::Failed,
                None => HandoffResult::TimedOut,
            };
            self.judge(seq, result);
        }
        if unseen {
            self.confuse();
        }
    }

    /// A quiet point: the transport handled every wake-up registered until now. Members whose
    /// evidence is complete are judged, and a new epoch begins.
    pub fn handle_quiet(&mut self) {
        let oldest_writing = self.writing.first().copied();
        let written_below = |horizon: Seq| oldest_writing.is_none_or(|w| w >= horizon);
        // Rule 1 and 2: a confirm that brought nothing proves every return before it was seen.
        for &seq in &self.resolved {
            let member = &self.members[&seq];
            let Some(seen) = member.seen else { continue };
            if seen.brought_none && written_below(seen.horizon) {
                self.proven_below = self.proven_below.max(member.floor);
            }
        }
        // Rule 3's empty channel: every confirm ever asked for has come and been seen.
        let settled = self.writing.is_empty() && self.unseen == 0;
        let ready: Vec<Seq> = self
            .resolved
            .iter()
            .copied()
            .filter(|seq| {
                let member = &self.members[seq];
                let Some(seen) = member.seen else {
                    return false;
                };
                member.returned
                    || settled
                    || (written_below(seen.horizon)
                        && (seen.brought_none || seen.epoch < self.proven_below))
            })
            .collect();
        self.judge_each(ready, HandoffResult::Confirmed);
        self.epoch += 1;
    }

    /// The next verdict: a member and its result, once.
    pub fn poll_verdict(&mut self) -> Option<(Seq, HandoffResult)> {
        self.verdicts.pop_front()
    }

    /// Why the channel must carry no further publish, if it must not.
    pub fn retired(&self) -> Option<Retired> {
        self.retired
    }

    /// Whether nothing on the channel is left to judge.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The current epoch (ends at the next quiet point).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    fn handle_returned(&mut self, returned: Option<HandoffId>) {
        match returned.and_then(|id| self.by_id.get(&id).copied()) {
            Some(seq) => {
                let member = self.members.get_mut(&seq).expect("indexed member");
                member.returned = true;
                // Judged as returned at the next quiet point, or now if it was waiting.
                if member.seen.is_some() {
                    self.resolved.insert(seq);
                }
            }
            None => self.confuse(),
        }
    }

    /// Judges every member still unjudged from what is known of it now (an ACK not proven, or
    /// no confirm yet, fails: the copy may exist), and retires the channel.
    fn confuse(&mut self) {
        self.retire(Retired::Confused);
        let left: Vec<Seq> = self.members.keys().copied().collect();
        self.judge_each(left, HandoffResult::Failed);
        self.writing.clear();
    }

    /// Judges each of `seqs`: returned, nacked, or else `otherwise`.
    fn judge_each(&mut self, seqs: Vec<Seq>, otherwise: HandoffResult) {
        for seq in seqs {
            let member = &self.members[&seq];
            let result = match member.seen.map(|s| s.confirm) {
                _ if member.returned => HandoffResult::Returned,
                Some(Confirm::Nack) => HandoffResult::Nacked,
                _ => otherwise,
            };
            self.judge(seq, result);
        }
    }

    fn retire(&mut self, why: Retired) {
        if self.retired != Some(Retired::Confused) {
            self.retired = Some(why);
        }
    }

    fn judge(&mut self, seq: Seq, result: HandoffResult) {
        if let Some(member) = self.members.remove(&seq) {
            if member.seen.is_none() {
                self.unseen -= 1;
            }
            self.by_id.remove(&member.id);
            self.resolved.remove(&seq);
            self.verdicts.push_back((seq, result));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use HandoffResult::*;

    fn id(n: u64) -> HandoffId {
        HandoffId::new(n)
    }

    /// Publishes `n` copies with ids 0..n, each written.
    fn written(n: u64) -> InFlight {
        let mut channel = InFlight::new();
        for i in 0..n {
            let seq = channel.handle_published(id(i));
            channel.handle_written(seq);
            channel.handle_pending(seq);
        }
        channel
    }

    fn verdicts(channel: &mut InFlight) -> Vec<(Seq, HandoffResult)> {
        std::iter::from_fn(|| channel.poll_verdict()).collect()
    }

    #[test]
    fn a_confirm_that_brought_nothing_is_judged_at_the_next_quiet_point() {
        let mut channel = written(3);
        channel.handle_confirm(1, Confirm::Ack, None);
        assert_eq!(verdicts(&mut channel), []);
        channel.handle_quiet();
        assert_eq!(verdicts(&mut channel), [(1, Confirmed)]);
        assert_eq!(channel.retired(), None);
    }

    #[test]
    fn a_return_counts_against_the_publish_whose_id_it_carries() {
        let mut channel = written(3);
        // lapin handed 2's return to 0's confirm.
        channel.handle_confirm(0, Confirm::Ack, Some(Some(id(2))));
        channel.handle_confirm(2, Confirm::Ack, None);
        channel.handle_quiet();
        assert_eq!(verdicts(&mut channel), [(2, Returned)]);
        // 0's own return could still be queued: it waits for a later confirm that brings
        // nothing, or for the channel to empty.
        channel.handle_confirm(1, Confirm::Ack, None);
        channel.handle_quiet();
        assert_eq!(verdicts(&mut channel), [(0, Confirmed), (1, Confirmed)]);
        assert!(channel.is_empty());
    }

    #[test]
    fn a_confirm_that_brought_another_return_waits_for_one_known_to_come_later() {
        let mut channel = written(2);
        channel.handle_confirm(0, Confirm::Ack, Some(Some(id(1))));
        channel.handle_quiet();
        // 1 is returned but its own confirm has not come: it is not judged before it does.
        assert_eq!(verdicts(&mut channel), []);
        // A publish numbered after 0 was seen, whose confirm brought nothing.
        let later = channel.handle_published(id(5));
        channel.handle_written(later);
        channel.handle_pending(later);
        channel.handle_confirm(later, Confirm::Ack, None);
        channel.handle_quiet();
        assert_eq!(verdicts(&mut channel), [(0, Confirmed), (later, Confirmed)]);
        channel.handle_confirm(1, Confirm::Ack, None);
        channel.handle_quiet();
        assert_eq!(verdicts(&mut channel), [(1, Returned)]);
    }

    #[test]
    fn a_publish_still_being_written_holds_back_the_confirms_seen_after_it_was_numbered() {
        let mut channel = InFlight::new();
        let slow = channel.handle_published(id(0));
        let fast = channel.handle_published(id(1));
        channel.handle_written(fast);
        channel.handle_confirm(fast, Confirm::Ack, None);
        channel.handle_quiet();
        // `slow`'s confirm may have completed unseen and taken `fast`'s return.
        assert_eq!(verdicts(&mut channel), []);
        channel.handle_confirm(slow, Confirm::Ack, Some(Some(id(1))));
        channel.handle_quiet();
        assert_eq!(verdicts(&mut channel), [(0, Confirmed), (1, Returned)]);
    }

    #[test]
    fn a_stray_or_anonymous_return_fails_every_unproven_publish_and_retires_the_channel() {
        for stray in [Some(id(99)), None] {
            let mut channel = written(3);
            channel.handle_confirm(0, Confirm::Ack, Some(Some(id(1))));
            channel.handle_confirm(2, Confirm::Nack, None);
            channel.handle_confirm(1, Confirm::Ack, Some(stray));
            assert_eq!(channel.retired(), Some(Retired::Confused));
            assert_eq!(
                verdicts(&mut channel),
                [(0, Failed), (1, Returned), (2, Nacked)]
            );
            assert!(channel.is_empty());
        }
    }

    #[test]
    fn a_timed_out_confirm_fails_the_rest_and_a_nack_drains_the_channel() {
        let mut channel = written(3);
        channel.handle_confirm(0, Confirm::Ack, Some(Some(id(2))));
        channel.handle_expired(&[1]);
        assert_eq!(channel.retired(), Some(Retired::Confused));
        assert_eq!(
            verdicts(&mut channel),
            [(1, TimedOut), (0, Failed), (2, Returned)]
        );

        let mut channel = written(2);
        channel.handle_confirm(0, Confirm::Nack, None);
        assert_eq!(channel.retired(), Some(Retired::Draining));
        channel.handle_quiet();
        channel.handle_confirm(1, Confirm::Ack, None);
        channel.handle_quiet();
        assert_eq!(verdicts(&mut channel), [(0, Nacked), (1, Confirmed)]);
    }

    #[test]
    fn a_returned_copy_whose_confirm_never_came_leaves_the_channel_unproven() {
        let mut channel = written(3);
        channel.handle_confirm(0, Confirm::Ack, None);
        // 2's confirm brought 1's return; 1's own confirm has not come, and may bring 2's.
        channel.handle_confirm(2, Confirm::Ack, Some(Some(id(1))));
        channel.handle_quiet();
        assert_eq!(verdicts(&mut channel), [(0, Confirmed)]);
        channel.handle_expired(&[1]);
        channel.handle_quiet();
        // 1 was returned; 2 cannot be proven (its return may be waiting for 1's confirm).
        assert_eq!(verdicts(&mut channel), [(1, Returned), (2, Failed)]);
        assert_eq!(channel.retired(), Some(Retired::Confused));
    }

    /// The client and the transport, modelled: publishes are numbered, written and confirmed
    /// in any interleaving RabbitMQ and lapin allow (a return before its own confirm, `multiple`
    /// confirms completing their tags in any order, lapin handing the oldest waiting return to
    /// each confirm it completes, a write noticed after its confirm came), and the transport
    /// polls what woke, in any order, between any two events.
    struct Model {
        returned: Vec<bool>,
        nacked: Vec<bool>,
        /// lapin's queue of returns waiting for a confirm.
        waiting: VecDeque<usize>,
        /// Whether each publish's return has arrived.
        sent_return: Vec<bool>,
        /// Each publish's completed confirm and the return lapin handed it.
        confirm: Vec<Option<Option<usize>>>,
        written: Vec<bool>,
        /// The transport's view: None unnumbered, then Writing, Awaiting, Done.
        stage: Vec<Stage>,
        /// Wake-ups not handled yet.
        woken: Vec<usize>,
        numbered: usize,
        channel: InFlight,
        results: Vec<Option<HandoffResult>>,
    }

    #[derive(Clone, Copy, PartialEq)]
    enum Stage {
        Unnumbered,
        Writing,
        Awaiting,
        Done,
    }

    impl Model {
        fn new(returned: Vec<bool>, nacked: Vec<bool>) -> Self {
            let n = returned.len();
            Self {
                returned,
                nacked,
                waiting: VecDeque::new(),
                sent_return: vec![false; n],
                confirm: vec![None; n],
                written: vec![false; n],
                stage: vec![Stage::Unnumbered; n],
                woken: Vec::new(),
                numbered: 0,
                channel: InFlight::new(),
                results: vec![None; n],
            }
        }

        fn n(&self) -> usize {
            self.returned.len()
        }

        /// One step chosen by `pick`; false when nothing is left to do.
        fn step(&mut self, pick: &mut impl FnMut(usize) -> usize, expire: bool) -> bool {
            let n = self.n();
            let mut options: Vec<u8> = Vec::new();
            if self.numbered < n {
                options.push(0);
            }
            let writable: Vec<usize> = (0..self.numbered).filter(|&i| !self.written[i]).collect();
            if !writable.is_empty() {
                options.push(1);
            }
            let returnable: Vec<usize> = (0..self.numbered)
                .filter(|&i| self.returned[i] && !self.sent_return[i])
                .collect();
            if !returnable.is_empty() {
                options.push(2);
            }
            let confirmable: Vec<usize> = (0..self.numbered)
                .filter(|&i| {
                    self.confirm[i].is_none() && (!self.returned[i] || self.sent_return[i])
                })
                .collect();
            if !confirmable.is_empty() {
                options.push(3);
            }
            if !self.woken.is_empty() {
                options.push(4);
            }
            if self.woken.is_empty() && !self.channel.is_empty() {
                options.push(5);
            }
            if expire && !self.channel.is_empty() {
                options.push(6);
            }
            if options.is_empty() || self.channel.retired() == Some(Retired::Confused) {
                return false;
            }
            match options[pick(options.len())] {
                0 => {
                    let i = self.numbered;
                    self.numbered += 1;
                    let seq = self.channel.handle_published(id(i as u64));
                    assert_eq!(seq, i as u64);
                    self.stage[i] = Stage::Writing;
                }
                1 => {
                    let i = writable[pick(writable.len())];
                    self.written[i] = true;
                    if self.stage[i] == Stage::Writing {
                        self.woken.push(i);
                    }
                }
                2 => {
                    let i = returnable[pick(returnable.len())];
                    self.sent_return[i] = true;
                    self.waiting.push_back(i);
                }
                3 => {
                    // A `multiple` confirm: a few tags, completed in any order.
                    let mut tags = vec![confirmable[pick(confirmable.len())]];
                    for &other in &confirmable {
                        if !tags.contains(&other) && pick(3) == 0 {
                            tags.push(other);
                        }
                    }
                    for i in (1..tags.len()).rev() {
                        tags.swap(i, pick(i + 1));
                    }
                    for i in tags {
                        self.confirm[i] = Some(self.waiting.pop_front());
                        if self.stage[i] == Stage::Awaiting {
                            self.woken.push(i);
                        }
                    }
                }
                4 => {
                    let i = self.woken.remove(pick(self.woken.len()));
                    self.poll(i);
                }
                5 => self.channel.handle_quiet(),
                _ => {
                    let open: Vec<Seq> = (0..self.numbered as u64)
                        .filter(|&s| self.results[s as usize].is_none())
                        .collect();
                    if let Some(&seq) = open.get(pick(open.len().max(1))) {
                        self.channel.handle_expired(&[seq]);
                    }
                }
            }
            while let Some((seq, result)) = self.channel.poll_verdict() {
                assert!(
                    self.results[seq as usize].replace(result).is_none(),
                    "judged twice"
                );
            }
            true
        }

        fn poll(&mut self, i: usize) {
            if self.stage[i] == Stage::Writing {
                if !self.written[i] {
                    return;
                }
                self.channel.handle_written(i as u64);
                self.stage[i] = Stage::Awaiting;
            }
            if self.stage[i] != Stage::Awaiting {
                return;
            }
            match self.confirm[i] {
                Some(brought) => {
                    let confirm = if self.nacked[i] {
                        Confirm::Nack
                    } else {
                        Confirm::Ack
                    };
                    self.channel.handle_confirm(
                        i as u64,
                        confirm,
                        brought.map(|r| Some(id(r as u64))),
                    );
                    self.stage[i] = Stage::Done;
                }
                None => self.channel.handle_pending(i as u64),
            }
        }
    }

    fn rng(seed: u64) -> impl FnMut(usize) -> usize {
        let mut state = seed | 1;
        move |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(2000))]

        #[test]
        fn no_returned_copy_is_ever_confirmed_and_every_copy_is_judged_once(
            returned in proptest::collection::vec(proptest::bool::weighted(0.3), 1..30),
            nacks in proptest::collection::vec(proptest::bool::weighted(0.05), 30),
            seed in proptest::num::u64::ANY,
            expire in proptest::bool::weighted(0.2),
        ) {
            let nacked = nacks[..returned.len()].to_vec();
            let mut model = Model::new(returned.clone(), nacked.clone());
            let mut pick = rng(seed);
            // An expiry is offered only now and then, as deadlines are far apart.
            let mut steps = 0u32;
            while model.step(&mut pick, expire && steps % 17 == 16) {
                steps += 1;
                proptest::prop_assert!(steps < 100_000, "the model does not end");
            }
            let confused = model.channel.retired() == Some(Retired::Confused);
            for (i, result) in model.results.iter().enumerate() {
                if confused && result.is_none() {
                    // Judged at once on confusion: only possible for the unnumbered.
                    proptest::prop_assert!(model.stage[i] == Stage::Unnumbered);
                    continue;
                }
                let result = result.expect("every numbered copy is judged");
                if returned[i] {
                    proptest::prop_assert_ne!(result, Confirmed);
                }
                if nacked[i] {
                    proptest::prop_assert_ne!(result, Confirmed);
                }
                if !expire && !confused {
                    let exact = match (returned[i], nacked[i]) {
                        (true, _) => Returned,
                        (false, true) => Nacked,
                        (false, false) => Confirmed,
                    };
                    proptest::prop_assert_eq!(result, exact);
                }
            }
        }
    }
}
