#!/usr/bin/env node
// The reference side of BENCHMARKS.md's tokenize comparisons: encodes a text file in 20 KB pieces
// (or, with SHARDLM_BENCH_LINES=1, a line at a time: SentencePiece's references merge a piece
// whole, in time that grows faster than its length) and prints the token count (writes nothing),
// with transformers.js's tokenizers
// (@lenml/tokenizers) from a Hugging Face tokenizer.json (LLaMA 3's, Mistral's), or with
// llama-tokenizer-js (LLaMA 2's; no <s>, a space before each piece as SentencePiece puts one).
//
//   node bench/tokenize_reference.js TOKENIZERS_DIR TOKENIZER_JSON TEXT_FILE
//   node bench/tokenize_reference.js --llama-js PACKAGE_DIR TEXT_FILE
'use strict';
const fs = require('fs');
const path = require('path');
const url = require('url');

const args = process.argv.slice(2);
if (args.length !== 3) {
  process.stderr.write('usage: tokenize_reference.js TOKENIZERS_DIR TOKENIZER_JSON TEXT_FILE | --llama-js PACKAGE_DIR TEXT_FILE\n');
  process.exit(2);
}

function count(text, encode) {
  let n = 0;
  if (process.env.SHARDLM_BENCH_LINES === '1') {
    for (const line of text.split('\n')) n += encode(line).length;
  } else {
    for (let i = 0; i < text.length; i += 20000) n += encode(text.slice(i, i + 20000)).length;
  }
  console.log(n);
}

if (args[0] === '--llama-js') {
  import(url.pathToFileURL(path.resolve(args[1], 'llama-tokenizer.js')).href).then(({ default: llama }) => {
    count(fs.readFileSync(args[2], 'utf8'), (s) => llama.encode(s, false, true));
  });
} else {
  const { TokenizerLoader } = require(path.resolve(args[0], 'dist/main.js'));
  const tokenizerJSON = JSON.parse(fs.readFileSync(args[1], 'utf8'));
  const tokenizer = TokenizerLoader.fromPreTrained({ tokenizerJSON, tokenizerConfig: {} });
  count(fs.readFileSync(args[2], 'utf8'), (s) => tokenizer.encode(s, { add_special_tokens: false }));
}
