#!/usr/bin/env bash
# Installs what the project needs beyond a Rust toolchain, only where it is missing.
# Called by `make demo` and `make test`; safe to run repeatedly, as root or through sudo.
set -euo pipefail

# System packages by issue: none yet for the IR/profiler; later issues add cmake, libclang-dev
# (HiGHS) and OpenMPI. Keep the list here, in one place.
PACKAGES=(cmake g++ libclang-dev)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

if ! command -v cargo >/dev/null 2>&1; then
  echo "setup: cargo not found. Install a Rust toolchain (https://rustup.rs) and re-run." >&2
  exit 1
fi
