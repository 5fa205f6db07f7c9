//! The `tilearn` command-line tool. Errors print as one line and exit with status 1.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = tilearn_llm::cli::Cli::parse();
    match tilearn_llm::cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(tilearn_llm::LlmError::Reported) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
