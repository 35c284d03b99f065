#!/usr/bin/env bash
# Installs what the project needs beyond a Rust toolchain, only where it is missing.
# Called by `make demo` and `make test`; safe to run repeatedly, as root or through sudo.
set -euo pipefail

# System packages, in one place: cmake, g++ and libclang-dev build HiGHS (the planner's ILP
# solver) and rsmpi's bindings; libopenmpi-dev and openmpi-bin are the MPI library and its
# `mpirun`, for tessera-comm's MPI backend (feature `mpi`) and its tests.
PACKAGES=(cmake g++ libclang-dev libopenmpi-dev openmpi-bin)

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

# The image data set ViT trains on (data/README.md): from a package registry, checked by hash.
root="$(cd "$(dirname "$0")/.." && pwd)"
[ -f "$root/data/digits.csv" ] || "$root/data/fetch_digits.sh"
