//! `tessera`: the command-line front end ([`tessera_cli::main`]), under an allocator that counts
//! heap bytes so `train` can compare the real heap with the predicted peak.

#[global_allocator]
static ALLOC: tessera_runtime::alloc::CountingAlloc = tessera_runtime::alloc::CountingAlloc;

fn main() -> std::process::ExitCode {
    tessera_cli::main()
}
