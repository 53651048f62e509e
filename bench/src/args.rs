//! What the programs' command lines share: `--quick` and `--out`, and the value parsers.

use lily::prelude::QueueKind;

/// What every program takes: `--quick` and where the results go.
#[derive(clap::Args, Debug)]
pub struct Common {
    /// A shorter run (each program's flags say what it changes).
    #[arg(long)]
    pub quick: bool,
    /// Where the results go.
    #[arg(long, default_value = "target/bench")]
    pub out: std::path::PathBuf,
}

/// A count above zero; `_` separators allowed.
pub fn count<T: std::str::FromStr + PartialOrd + Default>(text: &str) -> Result<T, String> {
    match text.replace('_', "").parse() {
        Ok(n) if n > T::default() => Ok(n),
        _ => Err(format!("not a count above zero: {text}")),
    }
}

/// A positive, finite number; `_` separators allowed.
pub fn positive(text: &str) -> Result<f64, String> {
    match text.replace('_', "").parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("not a positive number: {text}")),
    }
}

/// `classic` or `quorum`.
pub fn queue_kind(text: &str) -> Result<QueueKind, String> {
    match text {
        "classic" => Ok(QueueKind::Classic),
        "quorum" => Ok(QueueKind::Quorum),
        other => Err(format!("unknown queue type {other}")),
    }
}
