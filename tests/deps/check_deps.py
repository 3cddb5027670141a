#!/usr/bin/env python3
"""The parts of src/ may include only the parts the table below lets them use (and what those use),
and only cli/ reads the process's environment (no hidden inputs in the core).

  check_deps.py SRC_DIR     exits 1 naming each file and line that breaks a rule
"""
import os
import re
import sys

# part -> parts it may use directly (docs/ARCHITECTURE.md, "Parts").
ALLOWED = {
    "files": [],
    "tensor": [],
    "kernels": ["tensor"],
    "model": ["tensor"],
    "layers": ["model", "kernels"],
    "comm": ["tensor"],
    "plan": ["model"],
    "trace": ["plan", "files"],
    "run": ["model", "plan", "trace", "comm", "layers", "kernels"],
    "sim": ["model", "plan", "trace"],
    "ckpt": ["files", "tensor", "model", "comm"],
    "data": ["files"],
    "report": ["files"],
    "train": ["files", "report", "run", "layers", "data", "ckpt", "comm", "plan", "model", "kernels", "trace", "tensor"],
    "cli": ["files", "train", "sim", "report"],
}
# Kernels are reached through the backend interface only from these parts.
BACKEND_ONLY = {"layers", "run"}
# Only cli/ reads the environment; these files still do until their settings become options.
GETENV_PARTS = {"cli"}
GETENV_EXCEPTIONS = {"kernels/cuda_backend.cu", "kernels/cuda_attention_gemm.cu"}


def closure(part):
    seen, todo = set(), [part]
    while todo:
        for dep in ALLOWED[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen | {part}


def main():
    src = sys.argv[1]
    bad = []
    for part in sorted(os.listdir(src)):
        if part not in ALLOWED:
            bad.append(f"src/{part}: a part the table does not name")
            continue
        ok = closure(part)
        for name in sorted(os.listdir(os.path.join(src, part))):
            path = os.path.join(src, part, name)
            with open(path, encoding="utf-8") as f:
                for line_no, line in enumerate(f, 1):
                    if ("getenv" in line and part not in GETENV_PARTS
                            and f"{part}/{name}" not in GETENV_EXCEPTIONS):
                        bad.append(f"src/{part}/{name}:{line_no}: reads the environment; only cli/ may (pass the value in)")
                    m = re.match(r'\s*#include "([a-z_]+)/([^"]+)"', line)
                    if not m:
                        continue
                    dep, header = m.groups()
                    if dep not in ok:
                        bad.append(f"src/{part}/{name}:{line_no}: includes {dep}/{header}; {part} may use {sorted(ok - {part})}")
                    elif dep == "kernels" and part in BACKEND_ONLY and header != "backend.h":
                        bad.append(f"src/{part}/{name}:{line_no}: includes kernels/{header}; {part} reaches kernels through kernels/backend.h")
    for b in bad:
        print(b)
    print(f"{len(bad)} violation(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
