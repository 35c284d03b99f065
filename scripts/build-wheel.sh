#!/usr/bin/env bash
# Builds the `tessera` Python wheel (crates/tessera-py: PyO3 + maturin, abi3 for CPython ≥ 3.9)
# into target/wheels/. Needs PyPI once, for a pinned maturin in target/py-build/venv; the build
# itself is Cargo's, offline once the crates are fetched.
#
# usage: scripts/build-wheel.sh [--dev]   (--dev: Cargo's dev profile, as `make test` builds it;
#                                          the default is --release)
set -euo pipefail
cd "$(dirname "$0")/.."
maturin_version=1.16.0
profile=--release
if [ "${1:-}" = --dev ]; then profile="--profile dev"; fi
target=${CARGO_TARGET_DIR:-target}
venv=$target/py-build/venv
if ! [ -x "$venv/bin/maturin" ] || [ "$("$venv/bin/maturin" --version)" != "maturin $maturin_version" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "maturin==$maturin_version"
fi
rm -f "$target"/wheels/tessera-*.whl
# maturin packs what python/ holds: no bytecode of a local run.
find crates/tessera-py/python -name __pycache__ -type d -prune -exec rm -rf {} +
# The wheel is for this machine's pip (`linux` tag): no manylinux audit.
# shellcheck disable=SC2086
"$venv/bin/maturin" build $profile -m crates/tessera-py/Cargo.toml -o "$target/wheels" \
  --interpreter python3 --compatibility linux
ls "$target"/wheels/tessera-*.whl
