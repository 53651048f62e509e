//! Shared pieces of Lily's fuzz targets (`src/bin/*.rs`): turning fuzz bytes into structured
//! input, a reference walk of header tables to check the gate against, and the runner.
//!
//! - [`delivery`]: a delivery as the broker sends it (exchange, routing key, AMQP properties in
//!   wire form, body), parsed with amq-protocol's own parser, plus gate limits; and [`wire`],
//!   the encoder the seed generator writes such inputs with.
//! - [`walk`]: counts, depth and bytes of a header table, computed independently of the gate.
//! - [`script`]: a policy, an arrival and an endless sequence of choices for the settlement
//!   machine.
//! - [`run`]: under `cargo afl build`, the AFL++ persistent loop; in a plain build, a replayer
//!   of files and directories.

pub mod delivery;
pub mod script;
pub mod walk;
pub mod wire;

/// Runs `check` on every input: the AFL++ loop under `cargo afl build` (`--cfg fuzzing`).
#[cfg(fuzzing)]
pub fn run(check: fn(&[u8])) {
    afl::fuzz!(|data: &[u8]| check(data));
}

/// Runs `check` on every input: in a plain build, on each file named on the command line (a
/// directory stands for the files in it), or on standard input when none is named. Prints one
/// line per file, never its content; a failed check panics.
#[cfg(not(fuzzing))]
pub fn run(check: fn(&[u8])) {
    use std::io::Read;
    use std::path::PathBuf;

    let mut paths = Vec::new();
    for arg in std::env::args_os().skip(1) {
        let path = PathBuf::from(arg);
        match std::fs::read_dir(&path) {
            Ok(dir) => {
                let mut files: Vec<_> = dir.filter_map(|e| Some(e.ok()?.path())).collect();
                files.sort();
                // AFL++ leaves a README.txt in its crashes directory.
                let input = |p: &PathBuf| p.is_file() && !p.ends_with("README.txt");
                paths.extend(files.into_iter().filter(input));
            }
            Err(_) => paths.push(path),
        }
    }
    if paths.is_empty() {
        let mut data = Vec::new();
        std::io::stdin()
            .read_to_end(&mut data)
            .expect("read standard input");
        check(&data);
        println!("ok: standard input ({} bytes)", data.len());
        return;
    }
    for path in paths {
        let data =
            std::fs::read(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        check(&data);
        println!("ok: {} ({} bytes)", path.display(), data.len());
    }
}
