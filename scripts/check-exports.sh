#!/usr/bin/env bash
# Loads the golden export files of `tessera plan --export` (crates/tessera-cli/tests/golden/export,
# which `cargo test -p tessera-cli --test all export::` keeps equal to what the binary writes)
# with the engines' own configuration code: DeepSpeed 0.19.8's DeepSpeedConfig and torchtitan
# 0.2.2's ConfigManager and ParallelDims (the last torchtitan release that reads job TOML files).
# Needs PyPI (pip); PyTorch itself is not installed (see scripts/check_exports.py).
#
# usage: scripts/check-exports.sh          (venv and sources kept in target/check-exports/)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=target/check-exports
venv=$dir/venv
mkdir -p "$dir"
if ! [ -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q tyro pydantic packaging psutil py-cpuinfo hjson numpy msgpack \
    einops tqdm tokenizers
fi
if ! [ -d "$dir/deepspeed-0.19.8" ]; then
  "$venv/bin/pip" download -q --no-deps --no-binary :all: deepspeed==0.19.8 -d "$dir"
  tar -xzf "$dir/deepspeed-0.19.8.tar.gz" -C "$dir"
fi
if ! [ -d "$dir/torchtitan-0.2.2" ]; then
  "$venv/bin/pip" download -q --no-deps torchtitan==0.2.2 -d "$dir"
  "$venv/bin/python" -m zipfile -e "$dir/torchtitan-0.2.2-py3-none-any.whl" "$dir/torchtitan-0.2.2"
fi
"$venv/bin/python" scripts/check_exports.py crates/tessera-cli/tests/golden/export \
  "$dir/deepspeed-0.19.8" "$dir/torchtitan-0.2.2" 2>&1 | grep -v "HF assets path"
