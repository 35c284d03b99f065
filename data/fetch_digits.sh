#!/usr/bin/env bash
# Installs data/digits.csv, the image data set ViT trains on (`tessera train --model
# vit-tiny`): the 1,797 8×8 handwritten digits of the UCI "Optical Recognition of Handwritten
# Digits" test set, as scikit-learn ships them. Called by scripts/setup.sh; see data/README.md.
#
# usage: data/fetch_digits.sh [output-file]      (default: data/digits.csv)
#
# Source, first that works: Debian's package python3-sklearn 1.2.1+dfsg-1 (`apt-get download`,
# no root needed, nothing installed), else PyPI's scikit-learn 1.2.1 wheel (`pip download`).
# Both carry sklearn/datasets/data/digits.csv.gz; the CSV's SHA-256 is checked, so either way
# the file is byte for byte the same. Rows: 64 pixel values in 0..16 (row-major), then the
# digit.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here/digits.csv}"
sha256="6ebb3d2fee246a4e99363262ddf8a00a3c41bee6014c373ed9d9216ba7f651b8"
member="sklearn/datasets/data/digits.csv.gz"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
gz=""
if command -v apt-get >/dev/null 2>&1 && command -v dpkg-deb >/dev/null 2>&1 &&
  (cd "$tmp" && apt-get download -qq python3-sklearn=1.2.1+dfsg-1 >/dev/null 2>&1); then
  dpkg-deb -x "$tmp"/python3-sklearn_*.deb "$tmp/deb"
  gz="$tmp/deb/usr/lib/python3/dist-packages/$member"
elif python3 -m pip download -q --no-deps --only-binary :all: --python-version 3.11 \
  --platform manylinux2014_x86_64 -d "$tmp" scikit-learn==1.2.1 >/dev/null 2>&1; then
  python3 - "$tmp" "$member" <<'PY'
import glob, sys, zipfile
tmp, member = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(glob.glob(f"{tmp}/scikit_learn-*.whl")[0]) as z:
    open(f"{tmp}/digits.csv.gz", "wb").write(z.read(member))
PY
  gz="$tmp/digits.csv.gz"
else
  echo "fetch_digits: could not download python3-sklearn (Debian) or scikit-learn (PyPI);" \
    "check the network, or copy digits.csv from a machine that has it to $out" >&2
  exit 1
fi

gzip -dc "$gz" >"$tmp/digits.csv"
got="$(sha256sum "$tmp/digits.csv" | cut -d' ' -f1)"
if [ "$got" != "$sha256" ]; then
  echo "fetch_digits: digits.csv has SHA-256 $got, expected $sha256; not installing it" >&2
  exit 1
fi
mv "$tmp/digits.csv" "$out.tmp.$$"
mv "$out.tmp.$$" "$out"
echo "fetch_digits: wrote $out (1797 images)" >&2
