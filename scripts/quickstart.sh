#!/usr/bin/env bash
# The first README command: set up a fresh machine, tokenize the King James Bible with GPT-2's
# BPE and train the default model on it, ending with a validation loss and a generated sample.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
SHARDLM_SETUP_FOR=run bash scripts/setup.sh
if [[ ! -s data/kjv/kjv_train.bin || ! -s data/kjv/kjv_val.bin ]]; then
  build/shardlm tokenize --in data/kjv/kjv.txt --out data/kjv/kjv --tokenizer gpt2
fi
# The trace lets the run's report (runs/quickstart/report.html, printed at the end) break a typical
# step down by op and stream. It is named here, not in the TOML: a run of that config with another
# --out (the demo test's) would otherwise write into runs/quickstart/.
mkdir -p runs/quickstart
exec build/shardlm train --config configs/quickstart.toml --trace runs/quickstart/trace.json "$@"
