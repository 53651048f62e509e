//! The CPU regression gate's parts: a scripted AMQP peer that serves a fixed backlog the same
//! way on every run, and the two consumers it measures. The gate itself is the `lily-regress`
//! binary.

pub mod consume;
pub mod peer;

/// The instructions valgrind's callgrind collected over a child's run, from its stderr.
///
/// # Errors
/// No `Collected` line in it.
pub fn collected(stderr: &str) -> Result<f64, String> {
    let total = stderr
        .lines()
        .find_map(|l| l.split("Collected :").nth(1)?.trim().parse().ok());
    total.ok_or_else(|| "no `Collected` line in valgrind's output".into())
}
