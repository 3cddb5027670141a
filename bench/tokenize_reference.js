#!/usr/bin/env node
// The reference side of BENCHMARKS.md's LLaMA 3 tokenize comparison: encodes a text file with
// transformers.js's tokenizers (@lenml/tokenizers) from a Hugging Face tokenizer.json, in 20 KB
// pieces, and prints the token count (writes nothing).
//
//   node bench/tokenize_reference.js TOKENIZERS_DIR TOKENIZER_JSON TEXT_FILE
'use strict';
const fs = require('fs');
const path = require('path');

const [tokenizers, tokenizerFile, textFile] = process.argv.slice(2);
if (!textFile) {
  process.stderr.write('usage: tokenize_reference.js TOKENIZERS_DIR TOKENIZER_JSON TEXT_FILE\n');
  process.exit(2);
}
const { TokenizerLoader } = require(path.resolve(tokenizers, 'dist/main.js'));
const tokenizerJSON = JSON.parse(fs.readFileSync(tokenizerFile, 'utf8'));
const tokenizer = TokenizerLoader.fromPreTrained({ tokenizerJSON, tokenizerConfig: {} });
const text = fs.readFileSync(textFile, 'utf8');
let count = 0;
for (let i = 0; i < text.length; i += 20000) count += tokenizer.encode(text.slice(i, i + 20000), { add_special_tokens: false }).length;
console.log(count);
