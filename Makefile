# The two commands of the README. Both run the project's setup script first.
.PHONY: demo test setup

setup:
	@scripts/setup.sh

# The main job on its embedded default.
demo: setup
	cargo run --release -q --bin tessera -- profile --model gpt2 --batch 8 --seq 1024

# Every test of the workspace.
test: setup
	cargo test --workspace
