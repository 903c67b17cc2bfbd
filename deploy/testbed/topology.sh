#!/usr/bin/env bash
# A real network topology on one machine, with network namespaces and veth pairs:
#
#   rv-cloud (10.200.0.1)  ── rv-wan bridge ──  rv-a-gw (10.200.0.2)   rv-b-gw (10.200.0.3)
#   gateway, Prometheus,                          │ LAN 10.201.1.0/24     │ LAN 10.201.2.0/24
#   dnsmasq                                       ├─ rv-a-n1 .11          ├─ rv-b-n1 .11
#                                                 └─ rv-a-n2 .12          └─ rv-b-n2 .12
#
# The cloud has no route to the edge LANs and the edge gateways do not forward: the tunnel
# that the agents (in rv-a-gw, rv-b-gw) dial out to the cloud is the only way in.
# An observer link joins this host (10.199.0.1) to rv-cloud (10.199.0.2) only, so that you
# and the tests can open Prometheus at http://10.199.0.2:9090; the host gets no route to
# the WAN or the edge LANs.
#
# Usage: topology.sh up | down | status | uplink SITE up|down
set -eEuo pipefail  # -E: the ERR trap below also fires inside functions

PREFIX=rv  # tests/support/testbed.py uses the same names
CLOUD=$PREFIX-cloud
WAN=$PREFIX-wan
SITES=(a b)

need_root() {
    if [ "$(id -u)" != 0 ]; then
        echo "testbed: network namespaces need root: run as root (or with sudo)" >&2
        exit 1
    fi
    if ! command -v ip >/dev/null 2>&1; then
        echo "testbed: the 'ip' command (Debian package iproute2) is required" >&2
        exit 1
    fi
}

ns() { ip netns exec "$1" "${@:2}"; }

down() {
    local n
    for n in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$PREFIX-" || true); do
        ip netns pids "$n" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns delete "$n" 2>/dev/null || true
    done
    ip link delete "$PREFIX-obs" 2>/dev/null || true
    rm -rf "/etc/netns/$CLOUD"
}

add_ns() {
    ip netns add "$1"
    ns "$1" ip link set lo up
    ns "$1" sysctl -qw net.ipv4.ip_forward=0
}

# veth between namespace $1 (interface $2, address $3) and bridge $5 in namespace $4
link_to_bridge() {
    local a=$1 ifname=$2 addr=$3 bridge_ns=$4 bridge=$5 peer=$6
    ip link add "$ifname" netns "$a" type veth peer name "$peer" netns "$bridge_ns"
    ns "$a" ip addr add "$addr" dev "$ifname"
    ns "$a" ip link set "$ifname" up
    ns "$bridge_ns" ip link set "$peer" master "$bridge"
    ns "$bridge_ns" ip link set "$peer" up
}

up() {
    down
    trap 'echo "testbed: setup failed, tearing down" >&2; down' ERR
    add_ns "$WAN"
    ns "$WAN" ip link add br0 type bridge
    ns "$WAN" ip link set br0 up
    add_ns "$CLOUD"
    link_to_bridge "$CLOUD" wan0 10.200.0.1/24 "$WAN" br0 cloud
    ip link add "$PREFIX-obs" type veth peer name obs0 netns "$CLOUD"
    ip addr add 10.199.0.1/30 dev "$PREFIX-obs"
    ip link set "$PREFIX-obs" up
    ns "$CLOUD" ip addr add 10.199.0.2/30 dev obs0
    ns "$CLOUD" ip link set obs0 up
    local i=2 s n
    for s in "${SITES[@]}"; do
        local gw=$PREFIX-$s-gw
        add_ns "$gw"
        link_to_bridge "$gw" wan0 "10.200.0.$i/24" "$WAN" br0 "site-$s"
        ns "$gw" ip link add lan type bridge
        ns "$gw" ip addr add "10.201.$((i - 1)).1/24" dev lan
        ns "$gw" ip link set lan up
        for n in 1 2; do
            local node=$PREFIX-$s-n$n
            add_ns "$node"
            link_to_bridge "$node" eth0 "10.201.$((i - 1)).1$n/24" "$gw" lan "n$n"
        done
        i=$((i + 1))
    done
    # Programs run in the cloud namespace resolve names with the testbed's DNS server.
    mkdir -p "/etc/netns/$CLOUD"
    echo "nameserver 127.0.0.1" > "/etc/netns/$CLOUD/resolv.conf"
    trap - ERR
    echo "testbed: up (namespaces: $(ip netns list | awk '{print $1}' | grep -c "^$PREFIX-"))"
}

status() {
    ip netns list | grep "^$PREFIX-" || echo "testbed: down"
}

uplink() {
    local site=$1 state=$2
    ns "$PREFIX-$site-gw" ip link set wan0 "$state"
}

need_root
case "${1:-}" in
    up) up ;;
    down) down; echo "testbed: down" ;;
    status) status ;;
    uplink) uplink "${2:?site}" "${3:?up|down}" ;;
    *) echo "usage: $0 up | down | status | uplink SITE up|down" >&2; exit 2 ;;
esac
