//! `lily-bench`: Lily's benchmark programs as subcommands (`lily-bench --help`).

fn main() -> std::process::ExitCode {
    lily_mq_bench::cli::main(false)
}
