"""Layer 3: IP packets between the cloud and edge pools over the tunnel (issue 12).

The building blocks that do not depend on the tunnel session:

* :mod:`raven.layer3.packet` -- read an IP packet's version and addresses (pure, no copies);
* :mod:`raven.layer3.policy` -- per-pool CIDRs, anti-spoofing, longest-prefix routing, drop labels (pure);
* :mod:`raven.layer3.tun` -- the TUN device (create or reuse, address, MTU, up, remove) and its batched pump;
* :mod:`raven.layer3.routes` -- routes, Raven's routing table and rule, sysctls, reconciled and removed;
* :mod:`raven.layer3.sharedsysctls` -- forwarding shared by a namespace's Raven processes (first sets, last restores);
* :mod:`raven.layer3.config` -- the ``layer3:`` configuration sections;
* :mod:`raven.layer3.noderoutes` -- ``raven routes``, run on every non-gateway node;
* :mod:`raven.layer3.netns` -- running a system call inside a named network namespace.

See docs/layer3.md for everything Raven installs on a host and how it is removed.
"""
