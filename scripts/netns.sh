#!/usr/bin/env bash
# Two or more network namespaces on one host, joined by a bridge, for
# multi-host runs of the benchmarks (needs root):
#
#   scripts/netns.sh up [N]     creates odcns0..odcns{N-1} (default N=2) on
#                               10.239.0.0/24 (namespace i: 10.239.0.{i+2},
#                               the bridge odcbr0 in this namespace: .1) and
#                               prints the --netns argument for the perf binaries
#   scripts/netns.sh down       removes them
#
# Only addresses inside 10.239.0.0/24 are used; nothing is routed outside.
set -euo pipefail
cmd=${1:-}
n=${2:-2}
BR=odcbr0
NET=10.239.0

down() {
    for ns in $(ip netns list | awk '{print $1}' | grep -E '^odcns[0-9]+$' || true); do
        ip netns del "$ns" 2>/dev/null || true
    done
    for l in $(ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E '^odcv[0-9]+$' || true); do
        ip link del "$l" 2>/dev/null || true
    done
    ip link del "$BR" 2>/dev/null || true
}

case "$cmd" in
up)
    down
    ip link add "$BR" type bridge
    ip addr add "$NET.1/24" dev "$BR"
    ip link set "$BR" up
    arg=""
    for ((i = 0; i < n; i++)); do
        ns=odcns$i
        ip netns add "$ns"
        ip link add "odcv$i" type veth peer name eth0 netns "$ns"
        ip link set "odcv$i" master "$BR" up
        ip -n "$ns" addr add "$NET.$((i + 2))/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        arg+="${arg:+,}$ns=$NET.$((i + 2))"
    done
    echo "--netns $arg"
    ;;
down) down ;;
*)
    echo "usage: $0 up [N] | down" >&2
    exit 2
    ;;
esac
