//! A report as read from one input.

use lily_mq_core::ShutdownReport;

/// A report and the name it was read from.
pub(crate) struct Loaded {
    /// The path as given, or `<stdin>`.
    pub(crate) name: String,
    /// The parsed report.
    pub(crate) report: ShutdownReport,
}
