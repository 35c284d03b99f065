#!/usr/bin/env bash
# The Python package end to end: pip-installs the wheel scripts/build-wheel.sh built into a
# fresh virtualenv, offline (--no-index), and runs scripts/wheel_smoke.py there, which profiles
# and plans models through `import tessera` and checks each dict against the `tessera` binary's
# `--format json` output (built here, in the same profile).
#
# usage: scripts/build-wheel.sh [--dev] && scripts/check-wheel.sh [--dev]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
profile=release
if [ "${1:-}" = --dev ]; then profile=dev; fi
target=${CARGO_TARGET_DIR:-target}
case $target in /*) ;; *) target=$root/$target ;; esac
wheels=("$target"/wheels/tessera-*.whl)
[ -f "${wheels[0]}" ] || { echo "no wheel in $target/wheels: run scripts/build-wheel.sh first"; exit 1; }
cargo build -q --profile "$profile" --bin tessera
bin=$target/$([ "$profile" = dev ] && echo debug || echo release)/tessera
venv=$target/py-check/venv
rm -rf "$venv"
python3 -m venv "$venv"
"$venv/bin/pip" install -q --no-index "${wheels[0]}"
echo "installed ${wheels[0]##*/} into a fresh $venv"
# Outside the repository, so `import tessera` can only find the installed package.
cd "$(mktemp -d)"
"$venv/bin/python" "$root/scripts/wheel_smoke.py" "$bin" \
  "$root/crates/tessera-cli/tests/fixtures/onnx/gpt2/model.onnx"
