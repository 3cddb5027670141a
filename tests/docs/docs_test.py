#!/usr/bin/env python3
"""The documentation keeps up with the code. One check per call:

  docs_test.py links    SRC          every relative link in README.md, BENCHMARKS.md, bench/README.md
                                     and docs/*.md resolves: the file, and a #anchor to a heading of it
  docs_test.py options  SRC SHARDLM  every option `shardlm CMD --help` lists appears in docs/ as `--flag`
  docs_test.py tracker  SRC          no tracker references ("issue 12", "item 3", "#12") in tracked files
  docs_test.py bench    SRC          bench/ tracks scripts and their READMEs only (results go to bench/out/)
  docs_test.py examples SRC SHARDLM  the README's worked examples (```sh example blocks) run as written,
                                     in a scratch directory holding build/ and data/kjv/kjv

Exit 0 when the check holds, 1 with one line per problem when it does not, 77 (skipped) when what
it needs is missing (the examples need data/kjv/kjv.txt).
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

COMMANDS = ["tokenize", "make-data shapes", "train", "eval", "generate", "explain", "simulate", "calibrate", "plan",
            "ckpt export", "ckpt import", "ckpt info", "ckpt snapshots", "report"]


def doc_files(src):
    files = [os.path.join(src, f) for f in ("README.md", "BENCHMARKS.md", os.path.join("bench", "README.md"))]
    docs = os.path.join(src, "docs")
    files += sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))
    return [f for f in files if os.path.exists(f)]


def strip_code(text):
    """The text outside fenced blocks and inline code spans (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    h = heading.strip().lower().replace("`", "")
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(path):
    text = re.sub(r"^```.*?^```", "", open(path, encoding="utf-8").read(), flags=re.S | re.M)
    seen, out = {}, set()
    for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def check_links(src):
    problems = []
    for f in doc_files(src):
        text = strip_code(open(f, encoding="utf-8").read())
        for m in re.finditer(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(f), path)) if path else f
            where = os.path.relpath(f, src)
            if not os.path.exists(dest):
                problems.append(f"{where}: link to {target}: {os.path.relpath(dest, src)} does not exist")
            elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                problems.append(f"{where}: link to {target}: no heading #{anchor} in {os.path.relpath(dest, src)}")
    return problems


def help_options(shardlm, command):
    r = subprocess.run([shardlm] + command.split() + ["--help"], capture_output=True, text=True)
    if r.returncode != 0:
        return None
    flags = set()
    for line in r.stdout.splitlines():
        m = re.match(r"^\s+(?:-\w,)?(--[a-z0-9][a-z0-9-]*)", line)
        if m and m.group(1) not in ("--help", "--help-all"):
            flags.add(m.group(1))
    return flags


def check_options(src, shardlm):
    docs = "\n".join(open(f, encoding="utf-8").read() for f in doc_files(src) if f.startswith(os.path.join(src, "docs")))
    documented = set(re.findall(r"`(?:[a-z]+ )*(--[a-z0-9][a-z0-9-]*)", docs))
    problems = []
    for command in COMMANDS:
        flags = help_options(shardlm, command)
        if flags is None:
            problems.append(f"shardlm {command} --help failed")
            continue
        if command in ("train", "simulate", "plan") and len(flags) < 10:
            problems.append(f"shardlm {command} --help lists only {len(flags)} options: is the help format parsed?")
        for flag in sorted(flags - documented):
            problems.append(f"shardlm {command}: {flag} is in --help but nowhere in docs/ (as `{flag}`)")
    return problems


# "issue 12", "issues 3 and 4", "item 3", "#12" as tracker items; an external tracker named by its
# repository ("NVIDIA/nccl issue 1469", "nccl-tests issue 212") is a citation a reader can follow.
TRACKER = re.compile(r"(?<![\w/])(?:[Ii]ssues? \d+|[Ii]tems? \d+)")
EXTERNAL = re.compile(r"(?:[\w.-]+/[\w.-]+|nccl|nccl-tests) (?:[Ii]ssues?|pull) \d+$")
HASH = re.compile(r"(?<![\w&/#])#\d{1,5}\b(?![0-9a-fA-F])")


def tracked_files(src):
    r = subprocess.run(["git", "-C", src, "ls-files"], capture_output=True, text=True)
    if r.returncode == 0 and r.stdout.strip():
        return [os.path.join(src, f) for f in r.stdout.splitlines()]
    out = []
    for root, dirs, files in os.walk(src):
        dirs[:] = [d for d in dirs if not d.startswith((".", "build")) and d not in ("data", "runs", "third_party")]
        out += [os.path.join(root, f) for f in files]
    return out


def check_tracker(src):
    problems = []
    for f in tracked_files(src):
        if os.path.islink(f) or not os.path.isfile(f) or f.endswith(".png") or f == os.path.abspath(__file__):
            continue
        try:
            lines = open(f, encoding="utf-8").read().splitlines()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(lines, 1):
            for m in TRACKER.finditer(line):
                if not EXTERNAL.search(line[: m.end()]):
                    problems.append(f"{os.path.relpath(f, src)}:{n}: tracker reference '{m.group(0)}'")
            if f.endswith(".md"):
                for m in HASH.finditer(strip_code(line)):
                    problems.append(f"{os.path.relpath(f, src)}:{n}: tracker reference '{m.group(0)}'")
    return problems


SCRIPT = re.compile(r"\.(py|sh|cc|h|js|mjs)$|(^|/)README\.md$")


def check_bench(src):
    r = subprocess.run(["git", "-C", src, "ls-files", "bench"], capture_output=True, text=True)
    if r.returncode != 0:
        print("skipped: not a git checkout")
        sys.exit(77)
    return [f"{f}: a result, not a script, is tracked under bench/ (write it under bench/out/)"
            for f in r.stdout.splitlines() if not SCRIPT.search(f)]


def examples(readme):
    text = open(readme, encoding="utf-8").read()
    return re.findall(r"^```sh example\n(.*?)^```", text, flags=re.S | re.M)


def check_examples(src, shardlm):
    blocks = examples(os.path.join(src, "README.md"))
    if len(blocks) < 6:
        return [f"README.md: {len(blocks)} ```sh example blocks, expected the six worked examples"]
    kjv = os.path.join(src, "data", "kjv", "kjv.txt")
    if not os.path.exists(kjv):
        print(f"skipped: {kjv} is missing (scripts/fetch_data.sh fetches it)")
        sys.exit(77)
    work = tempfile.mkdtemp(prefix="shardlm-docs-")
    problems = []
    try:
        os.makedirs(os.path.join(work, "build"))
        os.symlink(shardlm, os.path.join(work, "build", "shardlm"))
        os.symlink(os.path.join(src, "configs"), os.path.join(work, "configs"))
        os.makedirs(os.path.join(work, "data", "kjv"))
        for d in os.listdir(os.path.join(src, "data")):
            if d != "kjv":
                os.symlink(os.path.join(src, "data", d), os.path.join(work, "data", d))
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   SHARDLM_DATA_DIR=os.path.join(work, "data"))
        # What the quick start leaves behind: the KJV in GPT-2 tokens at data/kjv/kjv.
        subprocess.run([shardlm, "tokenize", "--in", kjv, "--out", os.path.join(work, "data", "kjv", "kjv")],
                       cwd=work, env=env, check=True, capture_output=True)
        for i, block in enumerate(blocks, 1):
            r = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=work, env=env,
                               capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                tail = "\n".join((r.stdout + r.stderr).splitlines()[-15:])
                problems.append(f"README.md worked example {i} exited {r.returncode}:\n{block}\n{tail}")
            else:
                print(f"worked example {i}: ok")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return problems


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    check, src = sys.argv[1], os.path.abspath(sys.argv[2])
    if check == "links":
        problems = check_links(src)
    elif check == "options":
        problems = check_options(src, os.path.abspath(sys.argv[3]))
    elif check == "tracker":
        problems = check_tracker(src)
    elif check == "bench":
        problems = check_bench(src)
    elif check == "examples":
        problems = check_examples(src, os.path.abspath(sys.argv[3]))
    else:
        print(f"unknown check {check}")
        return 2
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
