//! The log set-up every Lily service should start with (handlers and extractors: tracing).

/// Installs a `tracing` subscriber on stderr that never shows lapin's returned messages.
pub fn init() {
    // ANCHOR: init
    // INFO and above unless RUST_LOG says otherwise; lapin's returned messages never, as they
    // carry bodies.
    lily::logging::init("info");
    // ANCHOR_END: init
}

/// The same filter for a subscriber of one's own.
///
/// # Errors
/// Never in practice: the filter is built from `RUST_LOG` or the default given.
pub fn own_subscriber() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    // ANCHOR: filter
    let filter = lily::logging::filter("info");
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init()?;
    // ANCHOR_END: filter
    Ok(())
}
