#!/usr/bin/env bash
# A real network topology on one machine, with network namespaces and veth pairs:
#
#   rv-cloud (10.200.0.1)  ── rv-wan bridge ──  rv-a-gw (10.200.0.2)   rv-b-gw (10.200.0.3)
#   gateway, Prometheus,     │                    │ LAN 10.201.1.0/24     │ LAN 10.201.2.0/24
#   dnsmasq                  │                    ├─ rv-a-n1 .11          ├─ rv-b-n1 .11
#                            │                    └─ rv-a-n2 .12          └─ rv-b-n2 .12
#                            └─ rv-c-n1 (10.200.0.21): an on-cloud GPU node, same network as the cloud
#
# The cloud has no route to the edge LANs and the edge gateways do not forward: the tunnel
# that the agents (in rv-a-gw, rv-b-gw) dial out to the cloud is the only way in. The on-cloud
# node (pool cloud-1, reach: direct) is scraped by Prometheus directly, without Raven.
# An observer link joins this host (10.199.0.1) to rv-cloud (10.199.0.2) only, so that you
# and the tests can open Prometheus at http://10.199.0.2:9090; the host gets no route to
# the WAN or the edge LANs.
#
# Usage: topology.sh up | down | status | uplink SITE up|down
#        topology.sh shape SITE RTT_MS LOSS_PCT RATE_KBIT | shape SITE off   (a slow, lossy or cut uplink: below)
#        topology.sh l3 up | down | status      (the layer-3 topology, below; independent of this one)
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
    # Two more cloud addresses: gateway replicas behind a Service at 10.200.0.1 (tests/support/servicelb.py)
    ns "$CLOUD" ip addr add 10.200.0.11/24 dev wan0
    ns "$CLOUD" ip addr add 10.200.0.12/24 dev wan0
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
    add_ns "$PREFIX-c-n1"
    link_to_bridge "$PREFIX-c-n1" eth0 10.200.0.21/24 "$WAN" br0 cloud-n1
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

# A site's uplink as it really is, both directions, in the namespaces only: each way loses LOSS_PCT % of its
# packets (iptables' statistic match in the site's gateway namespace; 100: the link is cut, packets vanish, the
# interface stays up), is limited to RATE_KBIT by a token bucket (tbf, at most 200 ms queued: on the site's wan0
# for what it sends, on the WAN bridge's port toward the site for what it receives) and, when RTT_MS > 0, goes
# to nfqueue 0 to wait half the round trip. This kernel has no sch_netem (nor nft's queue): the testbed's
# tests/support/linkdelay.py holds the queued packets that long; without it they pass at once (queue-bypass).
shape() {
    local site=$1 gw=$PREFIX-$1-gw chain dir
    ns "$gw" ip link show wan0 >/dev/null 2>&1 || { echo "testbed: no site $site (is the testbed up?)" >&2; exit 1; }
    command -v tc >/dev/null 2>&1 || { echo "testbed: tc (Debian package iproute2) is required" >&2; exit 1; }
    command -v iptables >/dev/null 2>&1 || { echo "testbed: iptables (Debian package) is required" >&2; exit 1; }
    ns "$gw" tc qdisc del dev wan0 root 2>/dev/null || true
    ns "$WAN" tc qdisc del dev "site-$site" root 2>/dev/null || true
    for chain in OUTPUT:-o INPUT:-i; do
        ns "$gw" iptables -w -D "${chain%:*}" "${chain#*:}" wan0 -j "RAVEN_LINK_${chain%:*}" 2>/dev/null || true
        ns "$gw" iptables -w -F "RAVEN_LINK_${chain%:*}" 2>/dev/null || true
        ns "$gw" iptables -w -X "RAVEN_LINK_${chain%:*}" 2>/dev/null || true
    done
    [ "${2:-}" = off ] && return
    local rtt=${2:?RTT_MS} loss=${3:?LOSS_PCT} rate=${4:?RATE_KBIT}
    [[ $rtt =~ ^[0-9]+$ && $loss =~ ^[0-9]+(\.[0-9]+)?$ && $rate =~ ^[0-9]+$ && $rate -ge 8 ]] &&
        awk -v l="$loss" 'BEGIN { exit !(l <= 100) }' ||
        { echo "testbed: shape SITE RTT_MS LOSS_PCT RATE_KBIT: whole ms, loss 0-100 %, rate >= 8 kbit/s" >&2; exit 2; }
    local burst=$(( rate * 1000 / 8 / 100 > 3200 ? rate * 1000 / 8 / 100 : 3200 ))  # 10 ms of rate, >= 2 MTUs
    ns "$gw" tc qdisc replace dev wan0 root tbf rate "${rate}kbit" burst "$burst" latency 200ms
    ns "$WAN" tc qdisc replace dev "site-$site" root tbf rate "${rate}kbit" burst "$burst" latency 200ms
    for chain in OUTPUT:-o INPUT:-i; do
        dir=RAVEN_LINK_${chain%:*}
        ns "$gw" iptables -w -N "$dir"
        if awk -v l="$loss" 'BEGIN { exit !(l >= 100) }'; then
            ns "$gw" iptables -w -A "$dir" -j DROP
        elif awk -v l="$loss" 'BEGIN { exit !(l > 0) }'; then
            ns "$gw" iptables -w -A "$dir" -m statistic --mode random \
                --probability "$(awk -v l="$loss" 'BEGIN { printf "%.6f", l / 100 }')" -j DROP
        fi
        [ "$rtt" -gt 0 ] && ns "$gw" iptables -w -A "$dir" -j NFQUEUE --queue-num 0 --queue-bypass
        ns "$gw" iptables -w -I "${chain%:*}" "${chain#*:}" wan0 -j "$dir"
    done
}

# ------------------------------------------------------------------ the layer-3 topology (issue 12)
# A separate set of namespaces (prefix r3-, its own addresses), so that it can run beside the one above:
#
#   host r3-obs 10.229.0.1/30 ── obs0 10.229.0.2 ┐
#   r3-pod 10.212.0.10 ── pod0 10.212.0.1 ─ r3-cloud (gateway; its TUN raven0 10.212.255.1/32)
#                                            │ wan0 10.230.0.1
#                                      r3-wan bridge ("the internet", 10.230.0.0/24)
#                      ┌─────────────────────┴──────────────────────┐
#   r3-a-rtr wan0 10.230.0.2 (NAT)               r3-b-rtr wan0 10.230.0.3 (NAT)
#      │ lan 10.220.1.1/24                          │ lan 10.221.1.1/24
#      ├─ r3-a-gw  10.220.1.2  (agents: raven0, raven1)   └─ r3-b-gw 10.221.1.2 (agent: raven0)
#      ├─ r3-a-gw2 10.220.1.3  (a second gateway node: agent raven0, started by the tests that use it)
#      └─ r3-a-n1  10.220.1.11 (raven routes via 10.220.1.100, site a's floating address: the active agent's node)
#
# Cloud CIDR 10.212.0.0/16; site a's CIDR 10.220.0.0/16, site b's 10.221.0.0/16 (agents' TUN addresses
# 10.22x.255.y/32 lie in them). Each site router masquerades its LAN behind its WAN address (nftables) and
# forwards nothing from the WAN into the LAN that the LAN did not start; it has no route to the cloud's CIDR,
# and the cloud none to the sites' LANs: between the cloud pod and the edge nodes, only the tunnel routes.
# Forwarding stays off on r3-cloud and on the gateway nodes: Raven's gateway and agents turn it on.
L3=r3
L3_CLOUD=$L3-cloud
L3_SITES=(a b)

l3_down() {
    local n
    for n in $(ip netns list 2>/dev/null | awk '{print $1}' | grep "^$L3-" || true); do
        ip netns pids "$n" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns delete "$n" 2>/dev/null || true
    done
    ip link delete "$L3-obs" 2>/dev/null || true
}

l3_up() {
    l3_down
    trap 'echo "testbed: layer-3 setup failed, tearing down" >&2; l3_down' ERR
    command -v nft >/dev/null 2>&1 || { echo "testbed: nft (Debian package nftables) is required" >&2; exit 1; }
    add_ns "$L3-wan"
    ns "$L3-wan" ip link add br0 type bridge
    ns "$L3-wan" ip link set br0 up
    add_ns "$L3_CLOUD"
    link_to_bridge "$L3_CLOUD" wan0 10.230.0.1/24 "$L3-wan" br0 cloud
    ip link add "$L3-obs" type veth peer name obs0 netns "$L3_CLOUD"
    ip addr add 10.229.0.1/30 dev "$L3-obs"
    ip link set "$L3-obs" up
    ns "$L3_CLOUD" ip addr add 10.229.0.2/30 dev obs0
    ns "$L3_CLOUD" ip link set obs0 up
    add_ns "$L3-pod"
    ip link add eth0 netns "$L3-pod" type veth peer name pod0 netns "$L3_CLOUD"
    ns "$L3-pod" ip addr add 10.212.0.10/24 dev eth0
    ns "$L3-pod" ip link set eth0 up
    ns "$L3-pod" ip route add default via 10.212.0.1
    ns "$L3_CLOUD" ip addr add 10.212.0.1/24 dev pod0
    ns "$L3_CLOUD" ip link set pod0 up
    local i=1 s
    for s in "${L3_SITES[@]}"; do
        local rtr=$L3-$s-rtr gw=$L3-$s-gw lan=10.$((219 + i)).1
        add_ns "$rtr"
        link_to_bridge "$rtr" wan0 "10.230.0.$((i + 1))/24" "$L3-wan" br0 "site-$s"
        ns "$rtr" ip link add lan type bridge
        ns "$rtr" ip addr add "$lan.1/24" dev lan
        ns "$rtr" ip link set lan up
        ns "$rtr" sysctl -qw net.ipv4.ip_forward=1
        printf '%s\n' "table ip raven_testbed {" \
            " chain postrouting { type nat hook postrouting priority srcnat; policy accept; oifname \"wan0\" masquerade; }" \
            " chain forwarding { type filter hook forward priority filter; policy accept;" \
            "  ct state established,related accept; iifname \"wan0\" drop; }" \
            "}" | ns "$rtr" nft -f -
        add_ns "$gw"
        link_to_bridge "$gw" eth0 "$lan.2/24" "$rtr" lan gw
        ns "$gw" ip route add default via "$lan.1"
        if [ "$s" = a ]; then
            add_ns "$L3-$s-gw2"
            link_to_bridge "$L3-$s-gw2" eth0 "$lan.3/24" "$rtr" lan gw2
            ns "$L3-$s-gw2" ip route add default via "$lan.1"
            add_ns "$L3-$s-n1"
            link_to_bridge "$L3-$s-n1" eth0 "$lan.11/24" "$rtr" lan n1
            ns "$L3-$s-n1" ip route add default via "$lan.1"
        fi
        i=$((i + 1))
    done
    trap - ERR
    echo "testbed: layer-3 topology up (namespaces: $(ip netns list | awk '{print $1}' | grep -c "^$L3-"))"
}

l3() {
    case "${1:-}" in
        up) l3_up ;;
        down) l3_down; echo "testbed: layer-3 topology down" ;;
        status) ip netns list | grep "^$L3-" || echo "testbed: layer-3 topology down" ;;
        *) echo "usage: $0 l3 up | down | status" >&2; exit 2 ;;
    esac
}

need_root
case "${1:-}" in
    up) up ;;
    down) down; echo "testbed: down" ;;
    status) status ;;
    uplink) uplink "${2:?site}" "${3:?up|down}" ;;
    shape) shape "${2:?site}" "${@:3}" ;;
    l3) l3 "${2:-}" ;;
    *) echo "usage: $0 up | down | status | uplink SITE up|down | shape SITE RTT_MS LOSS_PCT RATE_KBIT|off" \
            "| l3 up|down|status" >&2; exit 2 ;;
esac
