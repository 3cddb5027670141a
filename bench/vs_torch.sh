#!/bin/sh
# shardlm vs PyTorch training speed; see bench/vs_torch.py for options. Always the Debian python
# (/usr/bin/python3), which has torch.
exec /usr/bin/python3 "$(dirname "$0")/vs_torch.py" "$@"
