#!/usr/bin/env bash
# scripts/cluster.sh on this machine, as root: a cluster of namespaced hosts comes and goes without
# a trace (lifecycle), strategies over two hosts equal one process (parity), and a cut link ends
# every rank with its collective's timeout line, and snapshot copies sit on the next host (cut-link),
# and a lost host's survivors resume from the snapshots they hold, resharded (lost-machine).
#
#   cluster_test.sh lifecycle|parity|cut-link|lost-machine SOURCE_DIR SHARDLM_BINARY
#
# Exit 0 passed, 1 failed, 77 skipped (not root, or no `ip netns` here). Each test holds a cluster
# of its own name, so tests run side by side, and removes it on any exit.
set -uo pipefail

TEST="$1"
SOURCE_DIR="$2"
SHARDLM="$3"
CLUSTER_SH="$SOURCE_DIR/scripts/cluster.sh"
export SHARDLM_CLUSTER="t${TEST:0:1}$$"
WORK="$(mktemp -d /tmp/shardlm_cluster_test.XXXXXX)"
FAILURES=0

skip() { echo "SKIP: $*"; exit 77; }
[[ $EUID -eq 0 ]] || skip "needs root (network namespaces)"
command -v ip >/dev/null && ip netns list >/dev/null 2>&1 || skip "ip netns is not available here"
command -v tc >/dev/null || skip "tc is not available here"

cleanup() {
  "$CLUSTER_SH" down >/dev/null 2>&1
  ip netns del "$SHARDLM_CLUSTER-h2" 2>/dev/null   # the lifecycle test's blocker, if still there
  rm -rf "$WORK"
}
trap cleanup EXIT
trap "exit 1" INT TERM   # ctest's timeout too: the EXIT trap still removes the cluster

check() {  # check DESCRIPTION COMMAND...: a failure is reported and counted, the test goes on
  local what="$1"
  shift
  if "$@"; then echo "ok: $what"; else echo "FAILED: $what"; FAILURES=$((FAILURES + 1)); return 1; fi
}

cluster() { "$CLUSTER_SH" "$@"; }

# What of this machine's network a cluster could leave behind: namespaces, links, qdiscs.
network_now() {
  ip netns list | awk '{print $1}' | sort
  ip -o link show | awk -F': ' '{print $2}' | sort
  tc qdisc show | sort
}

one_error_line() {  # one_error_line OUTPUT NEEDLE: exactly one line, a cluster.sh error holding NEEDLE
  [[ "$(printf '%s\n' "$1" | wc -l)" -eq 1 && "$1" == "cluster.sh: error: "* && "$1" == *"$2"* ]] || {
    echo "  got: $1"
    return 1
  }
}

no_namespace_of_cluster() { ! ip netns list | grep -q "^$SHARDLM_CLUSTER-"; }

# --- lifecycle ----------------------------------------------------------------------------------

test_lifecycle() {
  local before out
  before="$(network_now)"
  out="$(cluster up --hosts 0 2>&1)"
  check "--hosts 0 refused naming the flag" one_error_line "$out" "--hosts"
  out="$(cluster up --hosts 2 --link fast 2>&1)"
  check "--link fast refused naming the flag" one_error_line "$out" "--link fast"
  check "a refused up made nothing" [ "$(network_now)" == "$before" ]

  check "up --hosts 3 --link 1gbit" cluster up --hosts 3 --link 1gbit
  out="$(cluster up --hosts 2 2>&1)"
  check "a second up is refused with one line" one_error_line "$out" "exists"
  check "hosts lists three hosts at 198.18.0.1-3" \
    [ "$(cluster hosts | awk 'NR > 1 {print $3}' | tr '\n' ' ')" == "198.18.0.1 198.18.0.2 198.18.0.3 " ]
  check "each host has its own hostname" [ "$(cluster on h2 -- hostname)" == "$SHARDLM_CLUSTER-h2" ]
  # A closed port answers with a reset ("refused") only where the host is reachable.
  check "host h1 reaches h3 over the bridge" bash -c "'$CLUSTER_SH' on h1 -- timeout 5 bash -c 'exec 3<>/dev/tcp/198.18.0.3/9' 2>&1 | grep -q refused"
  cluster on h1 -- sh -c 'echo kept >/dev/shm/shardlm_cluster_probe'
  check "a host's /dev/shm outlives the process that wrote it" [ "$(cluster on h1 -- cat /dev/shm/shardlm_cluster_probe)" == kept ]
  check "another host does not see it" cluster on h2 -- test ! -e /dev/shm/shardlm_cluster_probe
  check "nor does this machine" test ! -e /dev/shm/shardlm_cluster_probe
  check "link h2 100mbit reshapes it" bash -c "'$CLUSTER_SH' link h2 100mbit >/dev/null && '$CLUSTER_SH' hosts | grep -q '^h2 .*100Mbit'"
  check "link h2 down takes it down" bash -c "'$CLUSTER_SH' link h2 down >/dev/null && '$CLUSTER_SH' hosts | grep -q '^h2 .*DOWN'"
  cluster on h1 -- sh -c 'sleep 300 & echo again >/dev/shm/shardlm_cluster_probe'
  check "lose h1" cluster lose h1
  check "lose killed every process of h1 but its holder" [ "$(ip netns pids "$SHARDLM_CLUSTER-h1" | wc -l)" -eq 1 ]
  check "lose emptied h1's /dev/shm" cluster on h1 -- test ! -e /dev/shm/shardlm_cluster_probe
  check "down" cluster down
  check "down left no namespace, link or qdisc behind" [ "$(network_now)" == "$before" ]
  check "down removed the state directory" test ! -e "/run/shardlm-cluster/$SHARDLM_CLUSTER"

  # An up that fails half-way (host h2's namespace name is taken): one line, then down removes
  # what it made and nothing else.
  ip netns add "$SHARDLM_CLUSTER-h2"
  out="$(cluster up --hosts 3 2>&1)"
  check "an up that fails half-way says so in one line" one_error_line "$out" "cluster.sh down removes what up made"
  check "it had made host h1" bash -c "ip netns list | grep -q '^$SHARDLM_CLUSTER-h1'"
  check "down after it" cluster down
  check "the blocking namespace is left alone" bash -c "ip netns list | grep -q '^$SHARDLM_CLUSTER-h2'"
  ip netns del "$SHARDLM_CLUSTER-h2"
  check "down after a failed up left nothing behind" [ "$(network_now)" == "$before" ]
  check "nor its state directory" test ! -e "/run/shardlm-cluster/$SHARDLM_CLUSTER"
}

# --- runs over two hosts ------------------------------------------------------------------------

# A small byte-level corpus (the one tests/run/test_util.h's make_corpus writes).
make_corpus() {
  for i in $(seq 0 399); do echo "And God said, Let there be light: and there was light. $((i * 7))"; done >"$WORK/corpus.txt"
  "$SHARDLM" tokenize --tokenizer bytes --in "$WORK/corpus.txt" --out "$WORK/tok" >/dev/null
}

# `train` of the tiny model into WORK/RUN: 5 steps of BATCH sequences a rank (the flags of
# tests/run/distributed_test.cc's parity runs).
train_args() {
  echo "train --model tiny --data $WORK/tok --out $WORK/$1 --steps ${STEPS:-5} --batch $2 --seq 32 --threads 1 --seed 11" \
    "--warmup 2 --eval-every 0 --eval-windows 2 --sample-tokens 0 --peak-gflops 100 --lr 3e-3 --eps 1e-6 --overwrite"
}

# Open MPI's session directory of this test's own (tests/run/test_util.h's MpiSession says why).
export OMPI_MCA_orte_tmpdir_base="$WORK/ompi"
mkdir -p "$OMPI_MCA_orte_tmpdir_base"

# Losses of runs A and B, step by step, within 1e-5 (relative).
same_losses() {
  python3 - "$WORK/$1/metrics.jsonl" "$WORK/$2/metrics.jsonl" <<'EOF'
import json, sys
def losses(path):
    return [r["loss"] for r in map(json.loads, open(path)) if "loss" in r]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
ok = len(a) == len(b) == 5 and all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(a, b))
if not ok: print("  losses", a, "against", b)
sys.exit(0 if ok else 1)
EOF
}

test_parity() {
  make_corpus || { echo "FAILED: tokenize"; return; }
  cluster up --hosts 2 --ranks-per-host 2 >/dev/null || { echo "FAILED: up"; return; }
  "$SHARDLM" $(train_args single 8) >"$WORK/single.log" 2>&1 || { echo "FAILED: the one-process run"; cat "$WORK/single.log"; return; }
  local s out
  for s in ddp zero2 fsdp hybrid; do
    out="$(cluster run -- mpirun "$SHARDLM" $(train_args "$s" 2) --strategy "$s" 2>&1)"
    check "$s on 2 hosts x 2 ranks ran" [ $? -eq 0 ] || { echo "$out" | tail -20; continue; }
    check "$s: the header names 2 machines of 2 ranks" grep -q "4 rank(s) on 2 machines of 2 x" <<<"$out"
    check "$s: the losses equal one process with the global batch" same_losses single "$s"
  done
  check "hybrid shards inside a host by default" grep -q "strategy hybrid (shard group 2)" <<<"$out"
}

# --- a cut link ---------------------------------------------------------------------------------

# Names of the shardlm processes left on the cluster's hosts.
ranks_left() {
  local h p
  for h in h1 h2; do
    for p in $(ip netns pids "$SHARDLM_CLUSTER-$h" 2>/dev/null); do
      [[ "$(cat "/proc/$p/comm" 2>/dev/null)" == shardlm ]] && echo "$h:$p"
    done
  done
}

# partner_copy_on HOST HOLDER OWNER: HOST's /dev/shm has rank HOLDER's copy of rank OWNER's snapshot.
partner_copy_on() {
  cluster on "$1" -- sh -c "ls /dev/shm | grep -q -- '-rank$2-copy$3-'"
}

test_cut_link() {
  local timeout_s=10 grace_s=30 cut_at deadline r f
  make_corpus || { echo "FAILED: tokenize"; return; }
  cluster up --hosts 2 --ranks-per-host 2 >/dev/null || { echo "FAILED: up"; return; }
  # Each rank's output is written by the daemon of its own host (--output-filename), so the
  # lines of the cut host's ranks reach a file even though they cannot reach mpirun.
  local STEPS=1000000  # train_args reads it: a run that only the cut ends
  cluster run -- mpirun --output-filename "$WORK/ranks" "$SHARDLM" $(train_args cut 2) --strategy fsdp \
    --timeout "$timeout_s" --snapshot-every 2 >"$WORK/mpirun.log" 2>&1 &
  for _ in $(seq 600); do  # the run is stepping
    [[ -f "$WORK/cut/metrics.jsonl" && "$(grep -c '"loss"' "$WORK/cut/metrics.jsonl")" -ge 3 ]] && break
    sleep 0.1
  done
  check "the run is stepping before the cut" [ -f "$WORK/cut/metrics.jsonl" ]
  # In-memory snapshots: each rank's partner copy is held by the rank with its index on the next
  # machine (ranks 0, 1 on h1; 2, 3 on h2), in that host's own /dev/shm.
  check "rank 0's snapshot copy is in h2's /dev/shm" partner_copy_on h2 2 0
  check "rank 3's snapshot copy is in h1's /dev/shm" partner_copy_on h1 1 3
  cluster link h2 down >/dev/null
  cut_at=$SECONDS
  deadline=$((cut_at + timeout_s + grace_s))
  while [[ -n "$(ranks_left)" && $SECONDS -lt $deadline ]]; do sleep 1; done
  check "every rank exited within the timeout + ${grace_s} s (left: $(ranks_left | tr '\n' ' '))" [ -z "$(ranks_left)" ]
  for r in 0 1 2 3; do
    f="$WORK/ranks/1/rank.$r/stderr"
    check "rank $r ended with its collective's timeout line" \
      grep -Eq "rank $r: comm timeout: (all_gather|reduce_scatter|all_reduce|broadcast|barrier|all_to_all) \".*\" on rank $r of 4" "$f"
  done
  ((FAILURES == 0)) || { echo "mpirun output:"; tail -5 "$WORK/mpirun.log"; }
  # mpirun itself waits on the daemon of the cut host (Open MPI's TCP gives up after minutes);
  # cleanup's down kills it with everything else on the hosts.
}

# --- a lost machine -----------------------------------------------------------------------------

# Training rows (step >= FROM) of run directory RUN's metrics.jsonl, one "step loss" a line, the
# loss as the file writes it (so equal lines are bitwise equal losses).
losses_from() {
  python3 - "$WORK/$1/metrics.jsonl" "$2" <<'EOF2'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line, parse_float=str)
    if "loss" in r and "val_loss" not in r and r["step"] >= int(sys.argv[2]):
        print(r["step"], r["loss"])
EOF2
}

test_lost_machine() {
  local every=5 out mp start lost_at saved_step resumed
  make_corpus || { echo "FAILED: tokenize"; return; }
  cluster up --hosts 2 --ranks-per-host 2 >/dev/null || { echo "FAILED: up"; return; }
  # 4 ranks (2 a host) with snapshots every 5 steps, and checkpoints every 5 steps that only the
  # reference reads: they are moved out of the run directory before the survivors resume.
  local STEPS=40  # train_args reads it
  cluster run -- mpirun "$SHARDLM" $(train_args lost 2) --strategy fsdp --timeout 10 \
    --snapshot-every "$every" --save-every "$every" >"$WORK/lost.log" 2>&1 &
  mp=$!
  for _ in $(seq 600); do  # past the first snapshot, before the run's end
    [[ -f "$WORK/lost/metrics.jsonl" && "$(grep -c '"loss"' "$WORK/lost/metrics.jsonl")" -ge 7 ]] && break
    sleep 0.05
  done
  cluster lose h2 >/dev/null
  start=$SECONDS
  wait "$mp"
  check "the job ended within 60 s of the lost host" [ $((SECONDS - start)) -le 60 ]
  check "one line names the lost host" grep -q "$SHARDLM_CLUSTER-h2\\|198.18.0.2" "$WORK/lost.log"
  lost_at="$(losses_from lost 0 | tail -1 | cut -d' ' -f1)"
  check "the host was lost before the run's end (last step $lost_at)" [ "${lost_at:-99}" -lt $((STEPS - 1)) ]
  mv "$WORK/lost/ckpt" "$WORK/saved"
  # The survivors: host h1's 2 ranks, the same global batch (2 x 4), --resume auto.
  out="$(cluster on h1 -- mpirun --allow-run-as-root --oversubscribe -np 2 "$SHARDLM" $(train_args lost 4) --strategy fsdp --timeout 10 \
    --snapshot-every "$every" --resume auto 2>&1)"
  check "the survivors' run completed" [ $? -eq 0 ] || echo "$out" | tail -20
  resumed="$(grep -o 'resumed from the in-memory snapshot of step [0-9]* (4 ranks -> 2 ranks[^)]*).* [0-9]* step(s) lost' <<<"$out")"
  echo "  $resumed"
  check "the header says: resumed from the in-memory snapshot, 4 ranks -> 2 ranks, steps lost" [ -n "$resumed" ] ||
    echo "$out" | grep -i "resume\|snapshot"
  saved_step="$(sed -n 's/.*of step \([0-9]*\) .*/\1/p' <<<"$resumed")"
  check "it resumed from the newest snapshot before the loss (step $saved_step)" \
    [ -n "$saved_step" ] && [ "$saved_step" -le $((lost_at + 1)) ] && [ $((lost_at + 1 - saved_step)) -le "$every" ]
  check "it names the lost host and its ranks" grep -q ", host $SHARDLM_CLUSTER-h2 (ranks 2-3 of 4) lost" <<<"$resumed"
  check "it says how many steps were lost" grep -q ", $((lost_at + 1 - saved_step)) step(s) lost" <<<"$resumed"
  check "it read no disk checkpoint (the run directory holds none)" [ ! -e "$WORK/lost/ckpt" ]
  # The reference: an uninterrupted 2-rank run from the 4-rank run's checkpoint of that step.
  out="$(OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe -np 2 "$SHARDLM" \
    $(train_args reference 4) --strategy fsdp --timeout 10 --resume "$WORK/saved/step_$saved_step" 2>&1)"
  check "the reference run from the checkpoint completed" [ $? -eq 0 ] || echo "$out" | tail -20
  check "the survivors' losses equal the reference's, bitwise, from step $saved_step" \
    [ "$(losses_from lost "$saved_step")" == "$(losses_from reference "$saved_step")" ]
  [ "$(losses_from reference "$saved_step" | wc -l)" -eq $((STEPS - saved_step)) ] ||
    check "the reference ran every step from $saved_step" false
}

case "$TEST" in
  lifecycle) test_lifecycle ;;
  parity) test_parity ;;
  cut-link) test_cut_link ;;
  lost-machine) test_lost_machine ;;
  *) echo "unknown test '$TEST'"; exit 2 ;;
esac
((FAILURES == 0)) || { echo "$FAILURES check(s) failed"; exit 1; }
echo "all checks passed"
