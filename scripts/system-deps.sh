#!/usr/bin/env bash
# Install the Debian packages the tests start for real: dnsmasq (DNS from a hosts file, as
# CoreDNS's hosts plugin), Prometheus (scrapes edge nodes through the gateway), Debian's
# node-exporter (a real exporter behind the edge), iproute2 (network namespaces), Chromium (the
# status page, loaded headless), ping and iperf3 (layer 3 across network namespaces), and nftables (the
# layer-3 testbed's edge routers masquerade their sites behind NAT), Node.js with npm (the Prometheus
# Operator's and cert-manager's schema validators for the manifests, scripts/validators.sh), and podman, buildah,
# runc and debootstrap (tests/e2e/test_image.py builds the container image with scripts/image.sh and runs it), and
# gcc, libc6-dev and python3-dev (the compiled build the tests run on, scripts/setup.sh).
# Does nothing when they are already there. Needs root (CI runs as root) or sudo.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"
need=()
command -v dnsmasq >/dev/null 2>&1 || need+=(dnsmasq-base)
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v prometheus-node-exporter >/dev/null 2>&1 || need+=(prometheus-node-exporter)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v chromium >/dev/null 2>&1 || need+=(chromium)  # the status page is tested in a real browser
command -v ping >/dev/null 2>&1 || need+=(iputils-ping)  # layer 3: ping across TUN devices
command -v iperf3 >/dev/null 2>&1 || need+=(iperf3)  # layer 3: throughput of the packet pump
command -v nft >/dev/null 2>&1 || need+=(nftables)  # layer-3 testbed: NAT routers in front of the edge sites
command -v iptables >/dev/null 2>&1 || need+=(iptables)  # testbed: loss and nfqueue delay on shaped uplinks
command -v node >/dev/null 2>&1 || need+=(nodejs)  # manifests: CRD schema validators (tests/support/validators)
command -v npm >/dev/null 2>&1 || need+=(npm)
command -v podman >/dev/null 2>&1 || need+=(podman)  # the image: built and run (scripts/image.sh)
command -v buildah >/dev/null 2>&1 || need+=(buildah)
command -v runc >/dev/null 2>&1 || need+=(runc)  # crun refuses hosts with hybrid cgroups; runc does not
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)  # the image's base, from Debian packages
# The compiled build (scripts/setup.sh, mypyc): a C compiler, the C library's headers, and the headers of the
# Python the venv is made from (Debian's package for that version: python3.11-dev for python3.11).
command -v gcc >/dev/null 2>&1 || need+=(gcc)
[ -f /usr/include/stdio.h ] || need+=(libc6-dev)
"${PYTHON:-python3}" -c 'import os, sys, sysconfig
sys.exit(not os.path.isfile(os.path.join(sysconfig.get_path("include"), "Python.h")))' 2>/dev/null ||
    need+=("python$("${PYTHON:-python3}" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-dev")
if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi
echo "system-deps: installing Debian packages: ${need[*]}"
SUDO=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
        echo "system-deps: need root to install ${need[*]} (apt-get install ${need[*]})" >&2
        exit 1
    fi
fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
