//! The log filter every Lily service should start with (handlers and extractors: tracing).

/// Installs a `tracing` subscriber on stderr that never shows lapin's returned messages.
///
/// # Errors
/// `RUST_LOG` holds a directive that does not parse.
pub fn init() -> Result<(), Box<dyn std::error::Error>> {
    // ANCHOR: filter
    // INFO and above unless RUST_LOG says otherwise; lapin's returned messages never, as they
    // carry bodies.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"))
        .add_directive(lily::logging::NO_BODY_LOGS.parse()?);
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    // ANCHOR_END: filter
    Ok(())
}
