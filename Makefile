# The two commands of the README. Both run the project's setup script first.
.PHONY: demo test setup

setup:
	@scripts/setup.sh

# The main job on its embedded default: train gpt2-tiny on the shipped corpus (~1 min).
demo: setup
	cargo run --release -q --bin tessera -- train

# Every test of the workspace, then the Python package end to end: the wheel built, installed
# offline into a fresh virtualenv, and checked against the binary (scripts/check-wheel.sh).
# Non-incremental: CI builds once, and incremental state would add ~1.6 GB.
test: setup
	CARGO_INCREMENTAL=0 cargo test --workspace --features tessera-cli/mpi,tessera-cli/cuda
	CARGO_INCREMENTAL=0 scripts/build-wheel.sh --dev
	CARGO_INCREMENTAL=0 scripts/check-wheel.sh --dev
