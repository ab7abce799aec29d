#!/usr/bin/env bash
# devcluster.sh: a real multi-node Slurm cluster on this one machine.
#
#   slurm/devcluster.sh up [--nodes N] [--cpus C]   start it (N=2, C=4 by default)
#   slurm/devcluster.sh down [--keep-logs]          stop it and undo everything `up` did
#   slurm/devcluster.sh status                      up (exit 0), down (exit 3), broken (exit 1)
#   slurm/devcluster.sh exec CMD [ARG...]           run CMD on the login node ("head")
#   slurm/devcluster.sh env                         print `export` lines that put the shims on PATH
#
# Layout (see slurm/README.md):
#   - network namespace slurm-head: bridge br0 10.99.0.1/24, hostname "head";
#     slurmctld, slurmdbd and MariaDB (unix socket only) run here; it is the login node.
#   - network namespace slurm-nX, X=1..N: veth eth0 10.99.0.1X/24 on br0, hostname "nodeX"; one slurmd.
#   - munged in the root namespace (its socket is a file, reachable from every namespace).
#   - a blackhole route for 10.99.0.0/24 in the root namespace: no cluster packet leaves the machine.
# All state (configs, logs, spool, pid files, MariaDB data, munge key) lives in one state dir,
# $HPC_TRAIN_DEVCLUSTER_DIR (default /tmp/hpc_train-devcluster). `up` wipes it and starts fresh,
# so job ids start again at 1 on every new cluster.
set -euo pipefail

# `exec` must hand CMD the caller's environment unchanged: keep what we alter below.
ORIG_UMASK="$(umask)"
ORIG_PATH_SET="${PATH+1}"
ORIG_PATH="${PATH-}"
CALLER_SLURM_CONF="${SLURM_CONF:-}"
# MariaDB (user mysql) and munge clients must traverse the state dir, whatever the caller's umask.
umask 022

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
SCRIPT="$SCRIPT_DIR/$(basename "${BASH_SOURCE[0]}")"
SHIM_DIR="$SCRIPT_DIR/shims"
CONF_TEMPLATES="$SCRIPT_DIR/conf"

STATE_DIR="${HPC_TRAIN_DEVCLUSTER_DIR:-/tmp/hpc_train-devcluster}"
STATE_DIR="${STATE_DIR%/}"
TIMEOUT="${HPC_TRAIN_DEVCLUSTER_TIMEOUT:-60}"   # seconds to wait for each daemon and for idle nodes

CLUSTER=devcluster
NET=10.99.0                     # the cluster's /24; head is .1, nodeX is .1X
HEAD_NS=slurm-head
NODE_NS_PREFIX=slurm-n          # slurm-n1, slurm-n2, ...
MAX_NODES=9                     # addresses 10.99.0.11 .. 10.99.0.19

ETC="$STATE_DIR/etc"
LOG="$STATE_DIR/log"
RECORD="$STATE_DIR/record"      # what `up` created, one item a line; `down` undoes exactly this
MARKER="$STATE_DIR/.hpc_train-devcluster"   # proves a dir is ours before we rm -rf it
CONF="$ETC/slurm.conf"
HOSTS="$ETC/hosts"
MUNGE_SOCKET="$STATE_DIR/munge/munge.socket"
DB_SOCKET="$STATE_DIR/db/mysqld.sock"

# The script calls the real Slurm binaries. If the caller put our shims first on PATH,
# drop them: a shim would re-enter this script for every call.
clean_path=""
IFS=: read -r -a _path_parts <<<"${PATH:-}"
for _p in "${_path_parts[@]}"; do
    [[ -z "$_p" || "$_p" == "$SHIM_DIR" ]] && continue
    clean_path="${clean_path:+$clean_path:}$_p"
done
export PATH="${clean_path:+$clean_path:}/usr/sbin:/usr/bin:/sbin:/bin"
unset clean_path _path_parts _p

PACKAGES=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server iproute2 util-linux)
REQUIRED_BINS=(slurmctld slurmd slurmstepd slurmdbd sbatch srun squeue sacct sacctmgr scontrol sinfo
    munged munge mariadbd mariadb-install-db ip nsenter unshare setsid flock mountpoint)

# ---------------------------------------------------------------------------------------------
# small helpers

die() { # die EXIT_CODE MESSAGE...
    local code="$1"; shift
    printf 'devcluster: error: %s\n' "$*" >&2
    exit "$code"
}
say() { printf 'devcluster: %s\n' "$*" >&2; }

require_root() {
    [[ "$(id -u)" == 0 ]] || die 2 "must run as root (it creates network namespaces, a route and" \
        "starts daemons); try: sudo $0 ${SUBCOMMAND:-}"
}

node_addr() { printf '%s.1%s' "$NET" "$1"; }
node_ns() { printf '%s%s' "$NODE_NS_PREFIX" "$1"; }

# The kernel's identity of a network namespace: device and inode of its nsfs file.
ns_id() { stat -L -c '%d:%i' "$1" 2>/dev/null; }

# True when this process already runs inside one of the cluster's network namespaces
# (a job on a node, or a command on the login node). /proc/1/ns/net is not always
# readable, so compare our namespace with the ones bound under /run/netns instead.
in_cluster_ns() {
    local self f
    self="$(ns_id /proc/self/ns/net)" || return 1
    for f in /run/netns/"$HEAD_NS" /run/netns/"$NODE_NS_PREFIX"*; do
        [[ -e "$f" ]] || continue
        [[ "$(ns_id "$f")" == "$self" ]] && return 0
    done
    return 1
}

# The command prefix that runs something "on" a cluster host: its network namespace,
# plus a private UTS namespace (hostname) and mount namespace (/etc/hosts bind mount).
# Do NOT use `ip netns exec`: it remounts /sys, and slurmd then fails with
# "No filesystem mounted on /sys/fs/cgroup". nsenter (without --pid) and unshare
# (without --fork) exec rather than fork, so the pid of the whole chain is the pid of
# the final command: that is what lets us record daemon pids with $!.
# Tools are named by absolute path: `exec` runs the chain under the caller's PATH.
host_prefix() { # host_prefix NETNS HOSTNAME -> sets the array HOST_PREFIX
    # shellcheck disable=SC2016  # the inner sh expands $1.., not us
    HOST_PREFIX=("$(command -v nsenter)" --net="/run/netns/$1"
        "$(command -v unshare)" --uts --mount --propagation private
        /bin/sh -c '"$1" --bind "$2" /etc/hosts && "$3" "$4" && shift 4 && exec "$@"'
        sh "$(command -v mount)" "$HOSTS" "$(command -v hostname)" "$2")
}

# Run a client command on the login node and wait for it.
on_head() {
    host_prefix "$HEAD_NS" head
    SLURM_CONF="$CONF" "${HOST_PREFIX[@]}" "$@"
}

# A process's start time (clock ticks since boot): pid plus start time names one process
# for good, so `down` never signals a recycled pid. A zombie counts as gone: nobody may
# reap the daemons once `up` has exited and they were reparented.
proc_start() { # proc_start PID [any]: start time; fails for a zombie unless "any"
    local stat fields
    stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
    stat="${stat##*) }"                  # drop "pid (comm) ", comm may hold spaces
    read -r -a fields <<<"$stat"
    [[ "${fields[0]}" != Z || "${2:-}" == any ]] || return 1
    printf '%s' "${fields[19]}"          # field 22 of /proc/PID/stat
}
pid_alive() { # pid_alive PID START
    [[ "$(proc_start "$1" 2>/dev/null || true)" == "$2" ]]
}
# pid_exists PID START: alive or a zombie not yet reaped.
pid_exists() {
    [[ "$(proc_start "$1" any 2>/dev/null || true)" == "$2" ]]
}

record() { printf '%s\n' "$*" >>"$RECORD"; }

show_logs() {
    local f
    [[ -d "$LOG" ]] || return 0
    for f in "$LOG"/*; do
        [[ -s "$f" && "$f" != */mariadb-install.log ]] || continue
        printf '\n===== %s (last 25 lines) =====\n' "$f" >&2
        tail -n 25 "$f" >&2 || true
    done
}

# ---------------------------------------------------------------------------------------------
# install

install_packages() {
    local missing=() b
    for b in "${REQUIRED_BINS[@]}"; do
        command -v "$b" >/dev/null 2>&1 || missing+=("$b")
    done
    ((${#missing[@]} == 0)) && return 0
    command -v apt-get >/dev/null 2>&1 || die 1 "missing ${missing[*]} and no apt-get to install them"
    say "installing Debian packages (missing: ${missing[*]})"
    # Hazard: on a machine without /usr/sbin/policy-rc.d, the packages' postinst would start
    # the system's own munge and mariadb daemons, which we did not ask for and would not stop.
    # A temporary policy-rc.d that says "101: action forbidden" prevents that.
    local made_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        made_policy=1
    fi
    local rc=0 t0=$SECONDS
    {
        DEBIAN_FRONTEND=noninteractive apt-get update -q &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}"
    } >&2 || rc=$?
    ((made_policy)) && rm -f /usr/sbin/policy-rc.d
    ((rc == 0)) || die 1 "apt-get failed (exit $rc)"
    for b in "${missing[@]}"; do
        command -v "$b" >/dev/null 2>&1 || die 1 "'$b' is still missing after installing ${PACKAGES[*]}"
    done
    say "installed in $((SECONDS - t0))s"
}

# ---------------------------------------------------------------------------------------------
# network

check_subnet_free() {
    # Refuse to shadow a real network: our blackhole /24 would win over any wider route.
    local routes
    routes="$(ip -4 route show match "$NET.0/24" | grep -v '^default' || true)"
    [[ -z "$routes" ]] || die 1 "the machine already routes $NET.0/24 (ip route: $routes);" \
        "refusing to take it over (leftover from a crashed run? see 'ip route', 'ip netns list')"
    if ip -4 -o addr show | grep -q " inet $NET\."; then
        die 1 "an interface of this machine already has an address in $NET.0/24"
    fi
    local ns
    for ns in "$HEAD_NS" $(seq -f "$NODE_NS_PREFIX%g" 1 "$MAX_NODES"); do
        [[ ! -e "/run/netns/$ns" ]] || die 1 "network namespace $ns exists but this state dir" \
            "($STATE_DIR) did not record it: another devcluster with another" \
            "HPC_TRAIN_DEVCLUSTER_DIR, or a leftover (remove with: ip netns del $ns)"
    done
}

make_network() {
    local nodes="$1" x ns
    # `ip netns add` bind-mounts /run/netns onto itself (to make it a shared mount) the first
    # time; that mount outlives the namespaces, so remember whether we caused it.
    [[ -d /run/netns ]] || record "netns-dir /run/netns"
    mountpoint -q /run/netns 2>/dev/null || record "netns-mount /run/netns"

    ip netns add "$HEAD_NS"
    record "netns $HEAD_NS"
    ip -n "$HEAD_NS" link set lo up
    ip -n "$HEAD_NS" link add br0 type bridge
    ip -n "$HEAD_NS" addr add "$NET.1/24" dev br0
    ip -n "$HEAD_NS" link set br0 up
    for x in $(seq 1 "$nodes"); do
        ns="$(node_ns "$x")"
        ip netns add "$ns"
        record "netns $ns"
        ip -n "$ns" link set lo up
        # The veth is created inside the namespaces, never in the root namespace, so
        # deleting the namespaces deletes it. No default route: nothing can leave the /24.
        ip -n "$HEAD_NS" link add "veth$x" type veth peer name eth0 netns "$ns"
        ip -n "$HEAD_NS" link set "veth$x" master br0 up
        ip -n "$ns" addr add "$(node_addr "$x")/24" dev eth0
        ip -n "$ns" link set eth0 up
    done
    # The root namespace has no link to the bridge, but without this route a process in the
    # root namespace that dials 10.99.0.x would send it to the default gateway.
    ip route add blackhole "$NET.0/24"
    record "route $NET.0/24"
}

# ---------------------------------------------------------------------------------------------
# daemons

# start_daemon NAME NETNS|- HOSTNAME COMMAND...: start a daemon in the foreground mode
# of its own, detached (setsid, stdio to a log file, so a caller that captures our
# output does not wait for the daemon), with a clean environment, and record its pid.
start_daemon() {
    local name="$1" ns="$2" host="$3"; shift 3
    local envs=(env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin SLURM_CONF="$CONF" MYSQL_UNIX_PORT="$DB_SOCKET")
    if [[ "$ns" == - ]]; then
        HOST_PREFIX=()
    else
        host_prefix "$ns" "$host"
    fi
    # Hazard: a daemon keeps every fd it inherits. Our lock (fd 9) would then live as long as
    # the daemon (a second `up` or `down` would wait for ever), and a pipe inherited from whoever called us would never see EOF (a test
    # that captures our output would hang). So the subshell closes every fd above 2 and
    # execs: $! stays the daemon's pid.
    (
        for fd in "/proc/$BASHPID/fd/"*; do
            fd="${fd##*/}"
            ((fd > 2)) && exec {fd}>&-
        done
        exec setsid "${envs[@]}" "${HOST_PREFIX[@]}" "$@"
    ) </dev/null >>"$LOG/$name.out" 2>&1 &
    local pid=$!
    local start
    start="$(proc_start "$pid")" || { wait "$pid" || true; die 1 "$name exited at once"; }
    record "pid $name $pid $start"
}

daemon_running() { # daemon_running NAME: is the recorded process alive?
    local kind name pid start
    while read -r kind name pid start; do
        [[ "$kind" == pid && "$name" == "$1" ]] || continue
        pid_alive "$pid" "$start" && return 0
    done <"$RECORD"
    return 1
}

# wait_daemon NAME DESCRIPTION CHECK...: wait for CHECK, failing early if NAME died.
wait_daemon() {
    local name="$1" desc="$2"; shift 2
    local deadline=$((SECONDS + TIMEOUT))
    until "$@" >/dev/null 2>&1; do
        daemon_running "$name" || { say "$name died while starting"; return 1; }
        ((SECONDS < deadline)) || { say "timed out after ${TIMEOUT}s waiting for $desc"; return 1; }
        sleep 0.1
    done
}

render() { # render TEMPLATE > FILE
    sed -e "s|@STATE@|$STATE_DIR|g" -e "s|@CLUSTER@|$CLUSTER|g" \
        -e "s|@HEAD_ADDR@|$NET.1|g" -e "s|@MUNGE_SOCKET@|$MUNGE_SOCKET|g" "$1"
}

write_configs() {
    local nodes="$1" cpus="$2" x
    {
        printf '127.0.0.1\tlocalhost\n%s.1\thead\n' "$NET"
        for x in $(seq 1 "$nodes"); do printf '%s\tnode%s\n' "$(node_addr "$x")" "$x"; done
    } >"$HOSTS"
    {
        render "$CONF_TEMPLATES/slurm.conf.in"
        for x in $(seq 1 "$nodes"); do
            printf 'NodeName=node%s NodeAddr=%s CPUs=%s RealMemory=4000 State=UNKNOWN\n' \
                "$x" "$(node_addr "$x")" "$cpus"
        done
        printf 'PartitionName=low Nodes=node[1-%s] Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime=10 MaxTime=INFINITE State=UP\n' "$nodes"
        printf 'PartitionName=high Nodes=node[1-%s] PriorityTier=10 PreemptMode=OFF MaxTime=INFINITE State=UP\n' "$nodes"
    } >"$CONF"
    (umask 077 && render "$CONF_TEMPLATES/slurmdbd.conf.in" >"$ETC/slurmdbd.conf")
}

start_munge() {
    mkdir -p "$STATE_DIR/munge"
    # munged insists: the socket dir must be searchable by all, the key readable only by its owner.
    chmod 755 "$STATE_DIR/munge"
    (umask 077 && head -c 1024 /dev/urandom >"$STATE_DIR/munge/munge.key")
    chmod 400 "$STATE_DIR/munge/munge.key"
    start_daemon munged - - munged --foreground --socket="$MUNGE_SOCKET" \
        --key-file="$STATE_DIR/munge/munge.key" --pid-file="$STATE_DIR/run/munged.pid" \
        --seed-file="$STATE_DIR/munge/munged.seed" --log-file="$LOG/munged.log"
    wait_daemon munged "munged" munge --socket="$MUNGE_SOCKET" --no-input
}

start_mariadb() {
    # mariadbd runs as user mysql, so its dir belongs to mysql. --no-defaults: ignore the
    # machine's /etc/mysql (it names the system socket /run/mysqld/mysqld.sock).
    # Small InnoDB log and buffer pool: this database holds a handful of rows.
    mkdir -p "$STATE_DIR/db"
    : >"$LOG/mariadb.log"
    chown mysql:mysql "$STATE_DIR/db" "$LOG/mariadb.log"
    local opts=(--no-defaults --user=mysql --datadir="$STATE_DIR/db/data"
        --innodb-log-file-size=8M --innodb-buffer-pool-size=32M)
    mariadb-install-db "${opts[@]}" --auth-root-authentication-method=socket --skip-test-db \
        >>"$LOG/mariadb-install.log" 2>&1 ||
        { say "mariadb-install-db failed:"; tail -n 25 "$LOG/mariadb-install.log" >&2; return 1; }
    start_daemon mariadbd "$HEAD_NS" head mariadbd "${opts[@]}" --skip-networking \
        --socket="$DB_SOCKET" --pid-file="$STATE_DIR/db/mariadbd.pid" --log-error="$LOG/mariadb.log"
    wait_daemon mariadbd "MariaDB's socket" test -S "$DB_SOCKET"
}

start_slurm() {
    local nodes="$1" x
    mkdir -p "$STATE_DIR/spool/slurmctld"
    for x in $(seq 1 "$nodes"); do mkdir -p "$STATE_DIR/spool/slurmd-node$x"; done
    start_daemon slurmdbd "$HEAD_NS" head slurmdbd -D
    # slurmdbd creates its tables on first start; sacctmgr answers once that is done.
    wait_daemon slurmdbd "slurmdbd" on_head sacctmgr -n list cluster
    on_head sacctmgr -i add cluster "$CLUSTER" >>"$LOG/sacctmgr.log" 2>&1 ||
        { say "sacctmgr add cluster failed"; return 1; }
    start_daemon slurmctld "$HEAD_NS" head slurmctld -D
    wait_daemon slurmctld "slurmctld" on_head scontrol ping
    for x in $(seq 1 "$nodes"); do
        start_daemon "slurmd-node$x" "$(node_ns "$x")" "node$x" slurmd -D -N "node$x"
    done
}

all_idle() { # all_idle N: every node reports idle
    local out
    out="$(on_head sinfo -h -N -o '%N %T' 2>/dev/null)" || return 1
    [[ "$(printf '%s\n' "$out" | awk '$2 == "idle" {print $1}' | sort -u | wc -l)" == "$1" ]]
}

# ---------------------------------------------------------------------------------------------
# health

recorded_nodes() { awk '$1 == "nodes" {print $2}' "$RECORD" 2>/dev/null || true; }

# healthy: every recorded daemon is alive and slurmctld answers.
healthy() {
    [[ -f "$RECORD" ]] || return 1
    local kind name pid start n=0
    while read -r kind name pid start; do
        [[ "$kind" == pid ]] || continue
        pid_alive "$pid" "$start" || return 1
        n=$((n + 1))
    done <"$RECORD"
    # munged, mariadbd, slurmdbd, slurmctld and one slurmd per node
    (( n == 4 + $(recorded_nodes) )) || return 1
    on_head scontrol ping >/dev/null 2>&1
}

# ---------------------------------------------------------------------------------------------
# down

# The pids of this process and its ancestors: never signal those (a caller might run
# `down` from a process that lives in a cluster namespace).
own_lineage() {
    local p=$$
    while [[ -n "$p" && "$p" != 0 ]]; do
        printf '%s\n' "$p"
        p="$(awk '/^PPid:/ {print $2}' "/proc/$p/status" 2>/dev/null || true)"
    done
}

# wait_gone SECONDS PID:START...: wait until none of the processes is alive.
wait_gone() {
    local deadline=$((SECONDS + $1)) item any; shift
    while :; do
        any=0
        for item in "$@"; do
            pid_alive "${item%%:*}" "${item#*:}" && { any=1; break; }
        done
        ((any)) || return 0
        ((SECONDS < deadline)) || return 1
        sleep 0.1
    done
}

# term_procs PID:START...: send SIGTERM to those still alive.
term_procs() {
    local item
    for item in "$@"; do
        pid_alive "${item%%:*}" "${item#*:}" && kill -TERM "${item%%:*}" 2>/dev/null
    done
    return 0
}

# finish_procs GRACE PID:START...: wait up to GRACE s for them to exit, then SIGKILL and
# wait up to 5 s more.
finish_procs() {
    local grace="$1" item
    shift
    (($#)) || return 0
    wait_gone "$grace" "$@" && return 0
    for item in "$@"; do
        pid_alive "${item%%:*}" "${item#*:}" && kill -KILL "${item%%:*}" 2>/dev/null
    done
    wait_gone 5 "$@" || say "warning: could not stop pids $*"
}

# stop_procs GRACE PID:START...: SIGTERM, then finish_procs.
stop_procs() {
    local grace="$1"
    shift
    term_procs "$@"
    finish_procs "$grace" "$@"
}

# Hazard: the daemons are orphans (their parent, `up`, has exited), so once stopped they
# stay zombies until PID 1 reaps them. The init of the CI VMs reaps only about once a
# second, and `pgrep` lists zombies, so wait (briefly) for the kernel to drop them.
wait_reaped() { # wait_reaped PID:START...
    local deadline=$((SECONDS + 5)) item left
    while :; do
        left=0
        for item in "$@"; do
            pid_exists "${item%%:*}" "${item#*:}" && left=1
        done
        ((left)) || return 0
        ((SECONDS < deadline)) || { say "note: some stopped daemons are zombies not yet reaped by PID 1"; return 0; }
        sleep 0.1
    done
}

# Every process inside a node namespace: slurmstepd and the jobs' processes.
namespace_procs() { # namespace_procs NETNS -> PID:START lines
    local pid start lineage
    lineage="$(own_lineage)"
    for pid in $(ip netns pids "$1" 2>/dev/null || true); do
        grep -qx "$pid" <<<"$lineage" && continue
        start="$(proc_start "$pid")" || continue
        printf '%s:%s\n' "$pid" "$start"
    done
}

do_down() { # do_down KEEP_LOGS(0|1)
    local keep_logs="$1"
    if [[ ! -f "$RECORD" ]]; then
        local ns
        for ns in "$HEAD_NS" $(seq -f "$NODE_NS_PREFIX%g" 1 "$MAX_NODES"); do
            [[ -e "/run/netns/$ns" ]] && say "warning: namespace $ns exists but $STATE_DIR has no" \
                "record of it; not touching it (remove by hand: ip netns del $ns)"
        done
        say "nothing recorded in $STATE_DIR: nothing to stop"
        # What a failed `up` kept for a post-mortem (logs, configs) goes now.
        if ((!keep_logs)) && [[ -e "$MARKER" ]]; then rm -rf "$STATE_DIR"; fi
        return 0
    fi
    local kind a b c
    declare -A pids=()
    local netns=() routes=() netns_mount=0 netns_dir=0
    while read -r kind a b c; do
        case "$kind" in
            pid) pids[$a]="$b:$c" ;;
            netns) netns+=("$a") ;;
            route) routes+=("$a") ;;
            netns-mount) netns_mount=1 ;;
            netns-dir) netns_dir=1 ;;
        esac
    done <"$RECORD"

    # Order matters: the controller and the slurmds are told first (so the controller does
    # not react to nodes vanishing one by one), then whatever still runs on the nodes is
    # stopped, then accounting, and last its database and munge, which slurmdbd needs while
    # it stops. slurmctld takes about 2 s to exit on SIGTERM: we wait for it last, so that
    # the rest happens meanwhile.
    local name ns slurmds=()
    for name in "${!pids[@]}"; do
        [[ "$name" == slurmd-* ]] && slurmds+=("${pids[$name]}")
    done
    [[ -n "${pids[slurmctld]:-}" ]] && term_procs "${pids[slurmctld]}"
    ((${#slurmds[@]})) && stop_procs 10 "${slurmds[@]}"
    # slurmd leaves slurmstepd and the jobs running when it stops (by design: slurmd may
    # be restarted under running jobs). They get 2 s, then SIGKILL.
    local leftovers=()
    for ns in "${netns[@]+"${netns[@]}"}"; do
        [[ "$ns" == "$HEAD_NS" ]] && continue
        mapfile -t -O "${#leftovers[@]}" leftovers < <(namespace_procs "$ns")
    done
    ((${#leftovers[@]})) && stop_procs 2 "${leftovers[@]}"
    [[ -n "${pids[slurmdbd]:-}" ]] && stop_procs 10 "${pids[slurmdbd]}"
    local last=()
    for name in mariadbd munged; do
        [[ -n "${pids[$name]:-}" ]] && last+=("${pids[$name]}")
    done
    ((${#last[@]})) && stop_procs 10 "${last[@]}"
    [[ -n "${pids[slurmctld]:-}" ]] && finish_procs 10 "${pids[slurmctld]}"
    wait_reaped "${pids[@]}" "${leftovers[@]+"${leftovers[@]}"}"

    # Client processes started on the login node by `exec` or the shims are the caller's,
    # not ours: they are left alone (they fail once slurmctld is gone). Deleting a namespace
    # only removes its name; the kernel frees it when its last process exits.
    for ns in "${netns[@]+"${netns[@]}"}"; do
        [[ -e "/run/netns/$ns" ]] && ip netns del "$ns"
    done
    local r
    for r in "${routes[@]+"${routes[@]}"}"; do
        ip route del blackhole "$r" 2>/dev/null || true
    done
    if ((netns_mount)) && mountpoint -q /run/netns && [[ -z "$(ls -A /run/netns)" ]]; then
        umount /run/netns || say "warning: could not unmount /run/netns"
    fi
    if ((netns_dir)) && [[ -d /run/netns && -z "$(ls -A /run/netns)" ]] && ! mountpoint -q /run/netns; then
        rmdir /run/netns || true
    fi

    if ((keep_logs)); then
        # Keep only the logs and the configs, for a post-mortem.
        find "$STATE_DIR" -mindepth 1 -maxdepth 1 ! -name log ! -name etc ! -name "$(basename "$MARKER")" \
            -exec rm -rf {} +
        say "down; logs kept in $LOG"
    else
        rm -rf "$STATE_DIR"
        say "down"
    fi
}

# ---------------------------------------------------------------------------------------------
# subcommands

check_state_dir() {
    # The state dir lands in slurm.conf (no spaces allowed) and in unix socket paths
    # (at most 107 bytes), and `up` deletes it: be strict.
    [[ "$STATE_DIR" == /* ]] || die 1 "HPC_TRAIN_DEVCLUSTER_DIR must be an absolute path: $STATE_DIR"
    [[ "$STATE_DIR" =~ ^[A-Za-z0-9._/+-]+$ ]] || die 1 "HPC_TRAIN_DEVCLUSTER_DIR may hold only" \
        "letters, digits and . _ / + -: $STATE_DIR"
    ((${#STATE_DIR} <= 80)) || die 1 "HPC_TRAIN_DEVCLUSTER_DIR is too long for unix sockets (max 80)"
    if [[ -e "$STATE_DIR" && ! -e "$MARKER" ]]; then
        [[ -d "$STATE_DIR" && -z "$(ls -A "$STATE_DIR")" ]] || die 1 "$STATE_DIR exists and is not a" \
            "devcluster state dir (no $(basename "$MARKER")); refusing to delete it"
    fi
}

take_lock() {
    # Two `up`s or `down`s at once (say, two test sessions) must not interleave. The lock is
    # this script file itself: no lock file to leave behind, and since the namespace names
    # are fixed there is one cluster per machine anyway, whatever the state dir.
    exec 9<"$SCRIPT"
    flock -w 300 9 || die 1 "another devcluster.sh up/down is still running (lock on $SCRIPT)"
}

UP_IN_PROGRESS=0
up_failed() {
    local rc=$?
    ((UP_IN_PROGRESS)) || return 0
    UP_IN_PROGRESS=0
    say "up failed (exit $rc); daemon logs follow, then everything started is torn down"
    show_logs
    do_down 1 || true
    exit "$((rc == 0 ? 1 : rc))"
}

cmd_up() {
    local nodes=2 cpus=4
    while (($#)); do
        case "$1" in
            --nodes) nodes="${2:-}"; shift 2 || die 1 "--nodes needs a value" ;;
            --nodes=*) nodes="${1#*=}"; shift ;;
            --cpus) cpus="${2:-}"; shift 2 || die 1 "--cpus needs a value" ;;
            --cpus=*) cpus="${1#*=}"; shift ;;
            *) die 1 "up: unknown option '$1' (valid: --nodes N, --cpus C)" ;;
        esac
    done
    [[ "$nodes" =~ ^[1-9]$ ]] || die 1 "--nodes must be 1..$MAX_NODES, got '$nodes'"
    [[ "$cpus" =~ ^[1-9][0-9]*$ ]] || die 1 "--cpus must be a positive integer, got '$cpus'"
    [[ "$TIMEOUT" =~ ^[0-9]+$ ]] || die 1 "HPC_TRAIN_DEVCLUSTER_TIMEOUT must be whole seconds, got '$TIMEOUT'"
    require_root
    in_cluster_ns && die 1 "run 'up' from the root network namespace, not from inside the cluster"
    check_state_dir
    take_lock
    install_packages

    if [[ -f "$RECORD" ]]; then
        if healthy; then
            local have
            have="$(recorded_nodes)"
            [[ "$have" == "$nodes" ]] || die 1 "a cluster with $have nodes is already up;" \
                "run '$0 down' first to get $nodes"
            say "already up ($have nodes)"
            return 0
        fi
        say "found a broken cluster in $STATE_DIR; tearing it down first"
        do_down 0
    fi

    local t0
    t0="$(date +%s.%N)"
    check_subnet_free
    # Fresh state every time: wiping StateSaveLocation and the database means job ids
    # start again at 1. Anything keyed on a job id must use a fresh folder per cluster.
    rm -rf "$STATE_DIR"
    mkdir -p "$STATE_DIR" "$ETC" "$LOG" "$STATE_DIR/run" "$STATE_DIR/spool"
    : >"$MARKER"
    record "nodes $nodes"
    write_configs "$nodes" "$cpus"

    # From here on any failure (set -e, die, Ctrl-C) tears down whatever was started,
    # keeping the logs for a post-mortem.
    UP_IN_PROGRESS=1
    trap up_failed EXIT
    trap 'exit 130' INT TERM
    make_network "$nodes"
    start_munge
    start_mariadb
    start_slurm "$nodes"
    wait_daemon slurmctld "$nodes idle nodes" all_idle "$nodes"
    UP_IN_PROGRESS=0
    trap - EXIT INT TERM

    say "up: $nodes nodes in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')s;" \
        "state in $STATE_DIR"
    on_head sinfo >&2
}

cmd_down() {
    local keep_logs=0
    while (($#)); do
        case "$1" in
            --keep-logs) keep_logs=1; shift ;;
            *) die 1 "down: unknown option '$1' (valid: --keep-logs)" ;;
        esac
    done
    require_root
    in_cluster_ns && die 1 "run 'down' from the root network namespace, not from inside the cluster"
    check_state_dir
    take_lock
    do_down "$keep_logs"
}

cmd_status() {
    require_root
    if [[ ! -f "$RECORD" ]]; then
        echo "devcluster: down"
        return 3
    fi
    if ! healthy; then
        echo "devcluster: broken (some daemon is not running; logs in $LOG; run '$0 down')"
        return 1
    fi
    echo "devcluster: up ($(recorded_nodes) nodes, state dir $STATE_DIR)"
    on_head sinfo
}

# Give CMD the caller's PATH and umask back (jobs inherit both through sbatch's
# --export=ALL, so the shims stay on PATH inside jobs).
restore_caller_env() {
    umask "$ORIG_UMASK"
    if [[ -n "$ORIG_PATH_SET" ]]; then export PATH="$ORIG_PATH"; else unset PATH; fi
}

cmd_exec() {
    (($#)) || die 1 "usage: $0 exec CMD [ARG...]"
    export SLURM_CONF="$CONF"
    # Already on a cluster host (a job on a node, or a login-node shell): run it right here,
    # with the SLURM_CONF the job inherited from its submitter if there is one.
    if in_cluster_ns; then
        export SLURM_CONF="${CALLER_SLURM_CONF:-$CONF}"
        restore_caller_env
        exec "$@"
    fi
    [[ "$(id -u)" == 0 ]] || die 2 "exec must run as root (it enters the cluster's namespaces)"
    [[ -e "/run/netns/$HEAD_NS" && -f "$HOSTS" ]] ||
        die 125 "the devcluster is not up (no /run/netns/$HEAD_NS or $HOSTS); run: $0 up"
    host_prefix "$HEAD_NS" head
    restore_caller_env
    # The chain execs all the way down: exit status, signals, stdin and cwd are CMD's own.
    exec "${HOST_PREFIX[@]}" "$@"
}

cmd_env() {
    # shellcheck disable=SC2016  # "$PATH" is for the caller's eval to expand
    printf 'export PATH=%q:"$PATH";\n' "$SHIM_DIR"
    printf 'export SLURM_CONF=%q;\n' "$CONF"
    printf 'export HPC_TRAIN_DEVCLUSTER_DIR=%q;\n' "$STATE_DIR"
}

usage() {
    sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

SUBCOMMAND="${1:-}"
(($#)) && shift
case "$SUBCOMMAND" in
    up) cmd_up "$@" ;;
    down) cmd_down "$@" ;;
    status) cmd_status "$@" ;;
    exec) cmd_exec "$@" ;;
    env) cmd_env "$@" ;;
    -h | --help | help) usage ;;
    *) usage >&2; exit 1 ;;
esac
