#!/usr/bin/env node
// Reference side of the tokenizer parity tests (tests/data/tokenizer_parity_test.cc).
//
//   node tokenizer_parity.js encode PACKAGE_DIR IN.json OUT.json
//       IN.json: a JSON array of strings; OUT.json: a JSON array of arrays of token ids, the
//       npm gpt-3-encoder's encode() of each string.
//   node tokenizer_parity.js encode-hf TOKENIZERS_DIR TOKENIZER_JSON IN.json OUT.json
//       The same with a Hugging Face tokenizer.json (LLaMA 3's) through @lenml/tokenizers
//       (transformers.js's tokenizers), no special tokens added.
//   node tokenizer_parity.js encode-llama-js PACKAGE_DIR IN.json OUT.json
//       The same with llama-tokenizer-js (LLaMA 1 and 2's SentencePiece BPE, its own data and
//       code), no <s>, the space SentencePiece puts before a text put before it; "" is [], as
//       Hugging Face's Prepend normalizer leaves an empty text empty.
//   node tokenizer_parity.js classes OUT.txt
//       One character per code point U+0000..U+10FFFF: how this JavaScript engine's regex
//       classifies it for GPT-2's pattern: L (\p{L}), N (\p{N}), S (\s), O (other;
//       surrogates too).
'use strict';
const fs = require('fs');
const path = require('path');

function usage() {
  process.stderr.write('usage: tokenizer_parity.js encode PACKAGE_DIR IN.json OUT.json | encode-hf TOKENIZERS_DIR TOKENIZER_JSON IN.json OUT.json | encode-llama-js PACKAGE_DIR IN.json OUT.json | classes OUT.txt\n');
  process.exit(2);
}

const [mode, ...args] = process.argv.slice(2);
if (mode === 'encode' && args.length === 3) {
  const encoder = require(path.resolve(args[0]));
  const inputs = JSON.parse(fs.readFileSync(args[1], 'utf8'));
  // The encoder's cost grows with the square of a string's token count (it concatenates
  // arrays), so callers send pieces of ~20 KB.
  const out = inputs.map((s) => encoder.encode(s));
  fs.writeFileSync(args[2], JSON.stringify(out));
} else if (mode === 'encode-hf' && args.length === 4) {
  const { TokenizerLoader } = require(path.resolve(args[0], 'dist/main.js'));
  const tokenizerJSON = JSON.parse(fs.readFileSync(args[1], 'utf8'));
  const tokenizer = TokenizerLoader.fromPreTrained({ tokenizerJSON, tokenizerConfig: {} });
  const inputs = JSON.parse(fs.readFileSync(args[2], 'utf8'));
  const out = inputs.map((s) => tokenizer.encode(s, { add_special_tokens: false }));
  fs.writeFileSync(args[3], JSON.stringify(out));
} else if (mode === 'encode-llama-js' && args.length === 3) {
  const url = require('url');
  import(url.pathToFileURL(path.resolve(args[0], 'llama-tokenizer.js')).href).then(({ default: llama }) => {
    const inputs = JSON.parse(fs.readFileSync(args[1], 'utf8'));
    const out = inputs.map((s) => (s === '' ? [] : llama.encode(s, false, true)));
    fs.writeFileSync(args[2], JSON.stringify(out));
  }).catch((e) => {
    process.stderr.write(String(e && e.stack || e) + '\n');
    process.exit(1);
  });
} else if (mode === 'classes' && args.length === 1) {
  const L = /^\p{L}$/u, N = /^\p{N}$/u, S = /^\s$/u;
  const cls = new Array(0x110000);
  for (let c = 0; c < 0x110000; c++) {
    if (c >= 0xd800 && c <= 0xdfff) { cls[c] = 'O'; continue; }
    const s = String.fromCodePoint(c);
    cls[c] = L.test(s) ? 'L' : N.test(s) ? 'N' : S.test(s) ? 'S' : 'O';
  }
  fs.writeFileSync(args[0], cls.join(''));
} else {
  usage();
}
