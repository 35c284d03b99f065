# The two commands of the README. Both run the project's setup script first.
.PHONY: demo test setup

setup:
	@scripts/setup.sh

# The main job on its embedded default: train gpt2-tiny on the shipped corpus (~1 min).
demo: setup
	cargo run --release -q --bin tessera -- train

# Every test of the workspace.
test: setup
	cargo test --workspace --features tessera-cli/mpi
