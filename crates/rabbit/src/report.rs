//! Where the shutdown report goes: the log, JSON to stdout or a file, and a short summary to the
//! Kubernetes termination message file.

use std::io::Write;
use std::path::PathBuf;

use lily_mq_core::ShutdownReport;
use tracing::{info, warn};

/// Destinations of the shutdown report.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReportSinks {
    /// Write the JSON report here; `None` writes it to stdout.
    pub json_file: Option<PathBuf>,
    /// Also write the JSON to stdout when `json_file` is set.
    pub json_stdout: bool,
    /// The Kubernetes termination message file; written only when it exists.
    pub termination_log: PathBuf,
    /// Unresolved deliveries also logged one by one, at most this many.
    pub log_unresolved: usize,
}

impl Default for ReportSinks {
    fn default() -> Self {
        Self {
            json_file: None,
            json_stdout: true,
            termination_log: PathBuf::from("/dev/termination-log"),
            log_unresolved: 20,
        }
    }
}

impl ReportSinks {
    /// Writes the JSON report to `path` (and not to stdout).
    #[must_use]
    pub fn json_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.json_file = Some(path.into());
        self.json_stdout = false;
        self
    }

    /// Uses another termination message file.
    #[must_use]
    pub fn termination_log(mut self, path: impl Into<PathBuf>) -> Self {
        self.termination_log = path.into();
        self
    }
}

/// Writes `report` to the log, its JSON to stdout or a file, and its summary to the
/// termination message file when that file exists.
///
/// # Errors
/// Writing the JSON or the termination message failed.
pub fn emit(report: &ShutdownReport, sinks: &ReportSinks) -> std::io::Result<()> {
    let summary = report.termination_summary();
    let first_line = summary.lines().next().unwrap_or_default();
    if report.clean {
        info!(report = first_line, "shutdown report");
    } else {
        warn!(
            report = first_line,
            "shutdown report: settlement unresolved"
        );
        for d in report.unresolved.iter().take(sinks.log_unresolved) {
            warn!(
                queue = %d.queue,
                message_id = d.message_id.as_deref().unwrap_or("-"),
                delivery_tag = d.delivery_tag,
                attempt = d.attempt,
                redelivered = d.redelivered,
                last_evidence = ?d.last_evidence,
                handoff_confirmed_to = d.handoff_confirmed_to.as_deref().unwrap_or("-"),
                reason = %d.reason,
                "unresolved delivery"
            );
        }
    }
    let json = serde_json::to_vec_pretty(report).map_err(std::io::Error::other)?;
    if let Some(path) = &sinks.json_file {
        std::fs::write(path, &json)?;
    }
    if sinks.json_stdout {
        let mut out = std::io::stdout().lock();
        out.write_all(&json)?;
        out.write_all(b"\n")?;
        out.flush()?;
    }
    if sinks.termination_log.exists() {
        std::fs::write(&sinks.termination_log, summary.as_bytes())?;
    }
    Ok(())
}
