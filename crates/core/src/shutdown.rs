//! Shutdown phases as a pure state machine, with time passed in.
//!
//! ```text
//! running ──trigger──▶ draining ──idle──────────────────────────────▶ closed
//!                         │ drain deadline                               ▲
//!                         ▼                                              │
//!                      cooperating ──idle────────────────────────────────┤
//!                         │ cooperate deadline, or force                 │
//!                         ▼                                              │
//!                      aborting ──joins observed─────────────────────────┘
//! ```
//!
//! A force (second signal, API call) jumps to aborting from any phase before it.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// A phase of the consumer's life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Consuming.
    Running,
    /// Consumers cancelled, readiness false; in-flight work finishes with full authority.
    Draining,
    /// Handlers' cancellation tokens fired; healthy channels still settle what finishes.
    Cooperating,
    /// Authority revoked, tasks aborted, their joins observed.
    Aborting,
    /// Acks confirmed by a round trip, channels and connection closed.
    Closed,
}

/// What started the shutdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Trigger {
    /// SIGTERM (Kubernetes pod termination).
    Sigterm,
    /// SIGINT (Ctrl-C).
    Sigint,
    /// An API call from the embedding application.
    Api,
    /// The consumer could not go on after it started: the broker refused it for good (access
    /// refused, a topology it cannot rely on). The report's `error` says what.
    Error,
}

/// How long each phase may take, measured from the trigger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShutdownBudget {
    /// The whole shutdown, trigger to exit. Keep it below the pod's
    /// `terminationGracePeriodSeconds` (default 30 s) with room for the process to exit.
    pub total: Duration,
    /// Draining ends this long after the trigger; cooperating starts.
    pub drain: Duration,
    /// Time kept at the end for aborting and closing.
    pub abort_reserve: Duration,
}

impl Default for ShutdownBudget {
    fn default() -> Self {
        Self::new(Duration::from_secs(25))
    }
}

impl ShutdownBudget {
    /// A budget of `total`: 60 % draining, then cooperating, with 10 % (at most 3 s) kept for
    /// aborting and closing.
    pub fn new(total: Duration) -> Self {
        let abort_reserve = (total / 10).min(Duration::from_secs(3));
        Self {
            total,
            drain: total * 6 / 10,
            abort_reserve,
        }
    }

    fn cooperate_end(&self) -> Duration {
        self.total
            .saturating_sub(self.abort_reserve)
            .max(self.drain)
    }
}

/// Time spent in one phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhaseTiming {
    /// The phase.
    pub phase: Phase,
    /// Milliseconds from the trigger to the start of the phase.
    pub start_ms: u64,
    /// Milliseconds spent in the phase.
    pub duration_ms: u64,
}

/// The shutdown phase machine.
#[derive(Clone, Debug)]
pub struct PhaseClock {
    budget: ShutdownBudget,
    trigger: Option<(Trigger, Instant)>,
    forced: bool,
    entered: Vec<(Phase, Instant)>,
}

impl PhaseClock {
    /// A clock in [`Phase::Running`].
    pub fn new(budget: ShutdownBudget) -> Self {
        Self {
            budget,
            trigger: None,
            forced: false,
            entered: Vec::with_capacity(5),
        }
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        self.entered.last().map_or(Phase::Running, |(p, _)| *p)
    }

    /// What started the shutdown, if anything.
    pub fn trigger(&self) -> Option<Trigger> {
        self.trigger.map(|(t, _)| t)
    }

    /// Whether the shutdown was forced.
    pub fn forced(&self) -> bool {
        self.forced
    }

    /// The budget.
    pub fn budget(&self) -> ShutdownBudget {
        self.budget
    }

    /// A graceful trigger: running → draining. Later triggers are ignored (a second signal is
    /// a [`handle_force`](Self::handle_force)).
    pub fn handle_trigger(&mut self, trigger: Trigger, now: Instant) {
        if self.phase() == Phase::Running {
            self.trigger = Some((trigger, now));
            self.enter(Phase::Draining, now);
        }
    }

    /// A force: straight to aborting from any phase before it.
    pub fn handle_force(&mut self, trigger: Trigger, now: Instant) {
        if self.trigger.is_none() {
            self.trigger = Some((trigger, now));
        }
        if self.phase() < Phase::Aborting {
            self.forced = true;
            self.enter(Phase::Aborting, now);
        }
    }

    /// Nothing is in flight any more: draining or cooperating ends early.
    pub fn handle_idle(&mut self, now: Instant) {
        if matches!(self.phase(), Phase::Draining | Phase::Cooperating) {
            self.enter(Phase::Closed, now);
        }
    }

    /// The aborted tasks' joins were observed: aborting → closed.
    pub fn handle_aborted(&mut self, now: Instant) {
        if self.phase() == Phase::Aborting {
            self.enter(Phase::Closed, now);
        }
    }

    /// When the current phase times out, if it can.
    pub fn poll_deadline(&self) -> Option<Instant> {
        let (_, t0) = self.trigger?;
        match self.phase() {
            Phase::Draining => Some(t0 + self.budget.drain),
            Phase::Cooperating => Some(t0 + self.budget.cooperate_end()),
            Phase::Aborting => Some(t0 + self.budget.total),
            Phase::Running | Phase::Closed => None,
        }
    }

    /// Moves on when the current phase's deadline has passed at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        let Some(deadline) = self.poll_deadline() else {
            return;
        };
        if now < deadline {
            return;
        }
        match self.phase() {
            Phase::Draining => self.enter(Phase::Cooperating, now),
            Phase::Cooperating => self.enter(Phase::Aborting, now),
            Phase::Aborting => self.enter(Phase::Closed, now),
            Phase::Running | Phase::Closed => {}
        }
    }

    /// Timings of the phases entered since the trigger, the last one ending at `now`.
    pub fn timings(&self, now: Instant) -> Vec<PhaseTiming> {
        let Some((_, t0)) = self.trigger else {
            return Vec::new();
        };
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        self.entered
            .iter()
            .enumerate()
            .map(|(i, (phase, start))| {
                let end = self.entered.get(i + 1).map_or(now, |(_, e)| *e);
                PhaseTiming {
                    phase: *phase,
                    start_ms: ms(start.saturating_duration_since(t0)),
                    duration_ms: ms(end.saturating_duration_since(*start)),
                }
            })
            .collect()
    }

    /// Time from the trigger to `now`.
    pub fn used(&self, now: Instant) -> Duration {
        self.trigger
            .map_or(Duration::ZERO, |(_, t0)| now.saturating_duration_since(t0))
    }

    fn enter(&mut self, phase: Phase, now: Instant) {
        self.entered.push((phase, now));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn default_budget_fits_the_kubernetes_grace_period() {
        let b = ShutdownBudget::default();
        assert!(b.total < secs(30));
        assert_eq!(
            (b.drain, b.abort_reserve),
            (secs(15), Duration::from_millis(2500))
        );
    }

    #[test]
    fn idle_during_draining_closes_without_cooperating() {
        let t0 = Instant::now();
        let mut c = PhaseClock::new(ShutdownBudget::default());
        c.handle_trigger(Trigger::Sigterm, t0);
        assert_eq!(c.phase(), Phase::Draining);
        c.handle_idle(t0 + secs(2));
        assert_eq!(c.phase(), Phase::Closed);
        let phases: Vec<_> = c.timings(t0 + secs(3)).iter().map(|t| t.phase).collect();
        assert_eq!(phases, [Phase::Draining, Phase::Closed]);
        assert!(!c.forced());
    }

    #[test]
    fn deadlines_walk_through_every_phase() {
        let t0 = Instant::now();
        let mut c = PhaseClock::new(ShutdownBudget::new(secs(10)));
        c.handle_trigger(Trigger::Sigterm, t0);
        assert_eq!(c.poll_deadline(), Some(t0 + secs(6)));
        c.handle_timeout(t0 + secs(5));
        assert_eq!(c.phase(), Phase::Draining);
        c.handle_timeout(t0 + secs(6));
        assert_eq!(c.phase(), Phase::Cooperating);
        assert_eq!(c.poll_deadline(), Some(t0 + secs(9)));
        c.handle_timeout(t0 + secs(9));
        assert_eq!(c.phase(), Phase::Aborting);
        c.handle_aborted(t0 + Duration::from_millis(9200));
        assert_eq!(c.phase(), Phase::Closed);
        let timings = c.timings(t0 + Duration::from_millis(9300));
        let starts: Vec<_> = timings.iter().map(|t| (t.phase, t.start_ms)).collect();
        assert_eq!(
            starts,
            [
                (Phase::Draining, 0),
                (Phase::Cooperating, 6000),
                (Phase::Aborting, 9000),
                (Phase::Closed, 9200)
            ]
        );
        assert_eq!(timings[0].duration_ms, 6000);
    }

    #[test]
    fn force_jumps_to_aborting_and_a_second_trigger_does_not_restart() {
        let t0 = Instant::now();
        let mut c = PhaseClock::new(ShutdownBudget::default());
        c.handle_trigger(Trigger::Sigterm, t0);
        c.handle_trigger(Trigger::Sigint, t0 + secs(1));
        assert_eq!(c.phase(), Phase::Draining);
        c.handle_force(Trigger::Sigterm, t0 + secs(1));
        assert_eq!(c.phase(), Phase::Aborting);
        assert!(c.forced());
        assert_eq!(c.trigger(), Some(Trigger::Sigterm));
        c.handle_idle(t0 + secs(2));
        assert_eq!(
            c.phase(),
            Phase::Aborting,
            "idle does not skip the abort's joins"
        );
    }

    #[test]
    fn force_from_running_records_its_trigger() {
        let t0 = Instant::now();
        let mut c = PhaseClock::new(ShutdownBudget::default());
        c.handle_force(Trigger::Api, t0);
        assert_eq!(
            (c.phase(), c.trigger()),
            (Phase::Aborting, Some(Trigger::Api))
        );
    }
}
