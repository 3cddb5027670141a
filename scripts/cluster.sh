#!/usr/bin/env bash
# A cluster on one machine, to rehearse multi-node jobs: each host is a network namespace with its
# own hostname and /dev/shm, joined to a bridge by a veth pair whose two ends are shaped with a
# token bucket (tc tbf). Addresses come from the benchmarking range only (198.18.0.0/15, RFC 2544),
# and the bridge lives in a namespace of its own, so the machine's own network is never touched.
#
#   cluster.sh up --hosts H [--link RATE] [--ranks-per-host K]
#   cluster.sh run -- mpirun ...      the command on host 1, with the launch agent, --host and the
#                                     interface selection added after `mpirun`
#   cluster.sh on HOST -- CMD ...     a command on one host
#   cluster.sh link HOST RATE|down|up
#   cluster.sh lose HOST              every process of HOST killed, its /dev/shm emptied
#   cluster.sh hosts
#   cluster.sh down
#
# SHARDLM_CLUSTER names the cluster (default "shardlm"; letters and digits, at most 10), so that
# tests can hold clusters of their own side by side. Everything `up` makes is written to a log in
# the state directory (/run/shardlm-cluster/NAME) as it is made, and `down` removes exactly that,
# whether `up` finished or not.
set -euo pipefail

SCRIPT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
CLUSTER="${SHARDLM_CLUSTER:-shardlm}"
STATE_ROOT="${SHARDLM_CLUSTER_STATE_ROOT:-/run/shardlm-cluster}"
STATE="$STATE_ROOT/$CLUSTER"
SUBNET_PREFIX="198.18.0"   # host i is 198.18.0.i/24
SUBNET="$SUBNET_PREFIX.0/24"
SWITCH_NS="$CLUSTER-sw"
MAX_HOSTS=64

UP_STARTED=0  # set once `up` has begun making things: its failures then say how to undo them

fail() {
  echo "cluster.sh: error: $*$( ((UP_STARTED)) && echo "; cluster.sh down removes what up made")" >&2
  exit 2
}

usage_line() {
  fail "usage: cluster.sh up --hosts H [--link RATE] [--ranks-per-host K] | run -- mpirun ... | on HOST -- CMD ... | link HOST RATE|down|up | lose HOST | hosts | down"
}

[[ "$CLUSTER" =~ ^[a-z][a-z0-9]{0,9}$ ]] || fail "SHARDLM_CLUSTER=$CLUSTER: a name of a lowercase letter then at most 9 letters or digits"

# --- state --------------------------------------------------------------------------------------

# Appends what was just made to the log `down` replays.
record() { echo "$*" >>"$STATE/made"; }

require_cluster() {
  [[ -f "$STATE/hosts" ]] || fail "no cluster '$CLUSTER' is up (cluster.sh up --hosts H makes one)"
}

# The hosts file: one line per host, "INDEX HOSTNAME ADDRESS NAMESPACE HOLDER_PID".
host_count() { wc -l <"$STATE/hosts"; }

# The line of HOST, given as h<i>, its hostname or its address.
host_line() {
  local want="$1" line
  while read -r line; do
    set -- $line
    if [[ "$want" == "h$1" || "$want" == "$2" || "$want" == "$3" ]]; then
      echo "$line"
      return 0
    fi
  done <"$STATE/hosts"
  fail "no host '$want' in cluster '$CLUSTER' (cluster.sh hosts lists them)"
}

# Field N (1-based, as in the hosts file) of HOST's line.
host_field() {
  local line field="$2"
  line="$(host_line "$1")"
  set -- $line
  echo "${!field}"
}

# --- rates --------------------------------------------------------------------------------------

# RATE in bits per second, or a failure naming the flag.
rate_bits() {
  local rate="$1" flag="$2" n unit
  [[ "$rate" =~ ^([0-9]+)(bit|kbit|mbit|gbit)$ ]] || fail "$flag $rate: a rate is a whole number and a unit, bit, kbit, mbit or gbit (e.g. 1gbit)"
  n="${BASH_REMATCH[1]}"
  unit="${BASH_REMATCH[2]}"
  ((n > 0)) || fail "$flag $rate: the rate must be above zero"
  case "$unit" in
    bit) echo "$n" ;;
    kbit) echo $((n * 1000)) ;;
    mbit) echo $((n * 1000000)) ;;
    gbit) echo $((n * 1000000000)) ;;
  esac
}

# The token bucket on DEV in namespace NS: 2 ms of the rate as its burst (at least 256 KiB, so a
# veth's 64 KiB segmentation-offload packets always fit), packets waiting at most 10 ms. A link
# without a rate has no qdisc of ours.
shape() {
  local ns="$1" dev="$2" rate="$3" bits burst
  ip -n "$ns" link set dev "$dev" up
  tc -n "$ns" qdisc del dev "$dev" root 2>/dev/null || true
  [[ "$rate" == none ]] && return 0
  bits="$(rate_bits "$rate" --link)"
  burst=$((bits / 8 / 500))
  ((burst >= 262144)) || burst=262144
  tc -n "$ns" qdisc add dev "$dev" root tbf rate "$rate" burst "$burst" latency 10ms
}

# --- up -----------------------------------------------------------------------------------------

# A holder process for host INDEX: in the host's network namespace, in UTS and mount namespaces of
# its own where the hostname is set and the host's directory is bind-mounted over /dev/shm. Every
# command on the host joins these three namespaces (nsenter), so it sees the host's name and
# shared memory; what is in /dev/shm stays while the host is up, as on a machine.
start_holder() {
  local i="$1" hostname="$2" ns="$3" shm="$STATE/shm/h$i" ready="$STATE/h$i.ready" pid
  mkdir -p "$shm"
  # Without job control the background child leads no process group, so setsid runs in place
  # and $! is the holder's own pid (ip netns exec, unshare and sh each exec the next).
  setsid ip netns exec "$ns" unshare --uts --mount --propagation private -- \
    sh -c 'hostname "$1" && mount --bind "$2" /dev/shm && : >"$3" && exec sleep infinity' holder "$hostname" "$shm" "$ready" \
    </dev/null >/dev/null 2>"$STATE/h$i.err" &
  pid=$!
  record "holder $pid $ns"
  for _ in $(seq 100); do
    [[ -f "$ready" ]] && { echo "$pid"; return 0; }
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  fail "host h$i: its holder process did not start: $(tr '\n' ' ' <"$STATE/h$i.err")"
}

add_host() {
  local i="$1" rate="$2" ns="$CLUSTER-h$i" hostname="$CLUSTER-h$i" address="$SUBNET_PREFIX.$i" pid
  ip netns add "$ns" 2>/dev/null || fail "host h$i: ip netns add $ns failed (a namespace of that name exists?)"
  record "netns $ns"
  # One veth pair: eth0 inside the host, h<i> on the switch's bridge; the bridge side belongs to
  # the switch namespace, so it goes when that namespace does.
  ip -n "$SWITCH_NS" link add "h$i" type veth peer name eth0 netns "$ns"
  ip -n "$SWITCH_NS" link set "h$i" master br0
  ip -n "$ns" link set lo up
  ip -n "$ns" addr add "$address/24" dev eth0
  shape "$ns" eth0 "$rate"        # host -> switch
  shape "$SWITCH_NS" "h$i" "$rate"  # switch -> host
  pid="$(start_holder "$i" "$hostname" "$ns")"
  echo "$i $hostname $address $ns $pid" >>"$STATE/hosts"
}

cmd_up() {
  local hosts="" rate=none per_host=1
  while (($#)); do
    case "$1" in
      --hosts) hosts="${2:-}"; shift 2 || fail "--hosts: give a number of hosts" ;;
      --link) rate="${2:-}"; shift 2 || fail "--link: give a rate (e.g. 1gbit)" ;;
      --ranks-per-host) per_host="${2:-}"; shift 2 || fail "--ranks-per-host: give a number" ;;
      *) fail "up: unknown flag '$1' (up --hosts H [--link RATE] [--ranks-per-host K])" ;;
    esac
  done
  [[ "$hosts" =~ ^[0-9]+$ ]] && ((hosts >= 1 && hosts <= MAX_HOSTS)) || fail "--hosts '$hosts': a number of hosts from 1 to $MAX_HOSTS"
  [[ "$per_host" =~ ^[0-9]+$ ]] && ((per_host >= 1 && per_host <= 64)) || fail "--ranks-per-host '$per_host': a number from 1 to 64"
  [[ "$rate" == none ]] || rate_bits "$rate" --link >/dev/null
  [[ $EUID -eq 0 ]] || fail "up needs root (network namespaces, veth pairs, tc)"
  command -v unshare >/dev/null && command -v nsenter >/dev/null || fail "up needs unshare and nsenter (util-linux)"
  [[ -e "$STATE" ]] && fail "cluster '$CLUSTER' exists (state in $STATE): cluster.sh down removes it first"

  mkdir -p "$STATE_ROOT"
  mkdir "$STATE" || fail "cannot make the state directory $STATE"
  UP_STARTED=1
  : >"$STATE/made"
  echo "$per_host" >"$STATE/ranks-per-host"
  ip netns add "$SWITCH_NS" 2>/dev/null || fail "ip netns add $SWITCH_NS failed (a namespace of that name exists?)"
  record "netns $SWITCH_NS"
  ip -n "$SWITCH_NS" link add br0 type bridge
  ip -n "$SWITCH_NS" link set br0 up
  : >"$STATE/hosts"
  for i in $(seq "$hosts"); do add_host "$i" "$rate"; done
  write_agent
  echo "$rate" >"$STATE/link-rate"
  echo "cluster '$CLUSTER' up: $hosts host(s) on $SUBNET, link ${rate/none/unshaped}, $per_host rank(s) a host"
}

# The launch agent Open MPI runs in place of ssh: `agent [ssh flags] ADDRESS COMMAND...`. It runs
# COMMAND, a shell command line as ssh would pass it, on the host that holds ADDRESS.
write_agent() {
  cat >"$STATE/agent" <<EOF
#!/usr/bin/env bash
SHARDLM_CLUSTER='$CLUSTER' SHARDLM_CLUSTER_STATE_ROOT='$STATE_ROOT' exec '$SCRIPT' agent "\$@"
EOF
  chmod +x "$STATE/agent"
}

# --- commands on hosts --------------------------------------------------------------------------

# Runs CMD... in HOST's network, UTS and mount namespaces, in the current directory.
on_host() {
  local host="$1" pid
  shift
  pid="$(host_field "$host" 5)"
  kill -0 "$pid" 2>/dev/null || fail "host $host: its holder process $pid is gone (cluster.sh down, then up)"
  exec nsenter -t "$pid" -n -u -m --wd="$PWD" -- "$@"
}

cmd_agent() {
  while [[ "${1:-}" == -* ]]; do shift; done   # ssh's own flags, should Open MPI pass any
  (($# >= 2)) || fail "agent: expected ADDRESS COMMAND"
  local address="$1"
  shift
  require_cluster
  on_host "$address" sh -c "$*"
}

cmd_on() {
  (($# >= 3)) && [[ "$2" == -- ]] || fail "usage: cluster.sh on HOST -- CMD ..."
  require_cluster
  local host="$1"
  shift 2
  on_host "$host" "$@"
}

# The Open MPI flags that make a single-host mpirun span the cluster.
mpirun_flags() {
  local per_host hosts="" line
  per_host="$(cat "$STATE/ranks-per-host")"
  while read -r line; do
    set -- $line
    hosts+="${hosts:+,}$3:$per_host"
  done <"$STATE/hosts"
  echo "--mca plm_rsh_agent $STATE/agent --mca plm_rsh_no_tree_spawn 1 --host $hosts" \
    "--mca btl tcp,self,vader --mca btl_tcp_if_include $SUBNET --mca oob_tcp_if_include $SUBNET"
}

cmd_run() {
  [[ "${1:-}" == -- ]] || fail "usage: cluster.sh run -- mpirun ARGS..."
  shift
  [[ "$(basename "${1:-}")" == mpirun || "$(basename "${1:-}")" == mpiexec ]] || fail "run: the command after -- must be mpirun (or mpiexec), got '${1:-}'"
  require_cluster
  local mpirun="$1"
  shift
  # As root Open MPI refuses to start without these; only root can have made the cluster.
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  # shellcheck disable=SC2046
  on_host h1 "$mpirun" $(mpirun_flags) "$@"
}

# --- faults -------------------------------------------------------------------------------------

cmd_link() {
  (($# == 2)) || fail "usage: cluster.sh link HOST RATE|down|up"
  require_cluster
  local i ns
  i="$(host_field "$1" 1)"
  ns="$(host_field "$1" 4)"
  case "$2" in
    down | up)
      ip -n "$ns" link set dev eth0 "$2"
      ip -n "$SWITCH_NS" link set dev "h$i" "$2"
      ;;
    *)
      rate_bits "$2" "link $1" >/dev/null
      shape "$ns" eth0 "$2"
      shape "$SWITCH_NS" "h$i" "$2"
      ;;
  esac
  echo "host h$i: link $2"
}

# Kills every process of namespace NS but PID `spare` (0: none), and waits for them to go.
kill_namespace() {
  local ns="$1" spare="$2" pids p
  for _ in $(seq 50); do
    pids="$(ip netns pids "$ns" 2>/dev/null | grep -vx "$spare" || true)"
    [[ -z "$pids" ]] && return 0
    for p in $pids; do kill -9 "$p" 2>/dev/null || true; done
    sleep 0.1
  done
  fail "namespace $ns: processes $pids outlived SIGKILL for 5 s"
}

cmd_lose() {
  (($# == 1)) || fail "usage: cluster.sh lose HOST"
  require_cluster
  local i ns pid
  i="$(host_field "$1" 1)"
  ns="$(host_field "$1" 4)"
  pid="$(host_field "$1" 5)"
  kill_namespace "$ns" "$pid"
  find "$STATE/shm/h$i" -mindepth 1 -delete
  echo "host h$i: every process killed, /dev/shm emptied"
}

cmd_hosts() {
  require_cluster
  local line state rate
  printf '%-5s %-16s %-14s %-6s %s\n' host hostname address link rate
  while read -r line; do
    set -- $line
    state="$(ip -n "$4" -br link show dev eth0 2>/dev/null | awk '{print $2}')"
    rate="$(tc -n "$4" qdisc show dev eth0 2>/dev/null | sed -n 's/.* rate \([^ ]*\) .*/\1/p')"
    printf '%-5s %-16s %-14s %-6s %s\n' "h$1" "$2" "$3" "${state:-?}" "${rate:-unshaped}"
  done <"$STATE/hosts"
}

# --- down ---------------------------------------------------------------------------------------

# Replays the log of what `up` made, newest first. A holder is killed only while it still sits in
# its host's namespace (its pid not reused); a namespace is emptied of processes, then deleted,
# which takes its veth ends, the bridge and their qdiscs with it.
cmd_down() {
  [[ -d "$STATE" ]] || { echo "no cluster '$CLUSTER' is up"; return 0; }
  local kind a b
  if [[ -f "$STATE/made" ]]; then
    while read -r kind a b; do
      case "$kind" in
        holder) [[ "$(ip netns identify "$a" 2>/dev/null)" == "$b" ]] && kill -9 "$a" 2>/dev/null || true ;;
        netns)
          if ip netns list | awk '{print $1}' | grep -qx "$a"; then
            kill_namespace "$a" 0
            ip netns del "$a"
          fi
          ;;
      esac
    done < <(tac "$STATE/made")
  fi
  rm -rf "$STATE"
  rmdir "$STATE_ROOT" 2>/dev/null || true
  echo "cluster '$CLUSTER' down"
}

main() {
  (($#)) || usage_line
  local cmd="$1"
  shift
  case "$cmd" in
    up) cmd_up "$@" ;;
    down) cmd_down ;;
    run) cmd_run "$@" ;;
    on) cmd_on "$@" ;;
    agent) cmd_agent "$@" ;;
    link) cmd_link "$@" ;;
    lose) cmd_lose "$@" ;;
    hosts) cmd_hosts ;;
    *) usage_line ;;
  esac
}

main "$@"
