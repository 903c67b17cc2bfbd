#!/usr/bin/env python3
"""Make the runtime image's root file system from a debootstrapped Debian tree (scripts/image.sh runs this).

Only the packages that python3 needs at run time are kept: the closure of python3's (and a few named
packages') Depends and Pre-Depends, minus packages a running Python service never uses (dpkg, tar, awk:
python3-minimal and base-files name them for package maintenance). The files come from dpkg's own lists,
so nothing unowned sneaks in, plus what maintainer scripts made (the standard library's .pyc files, the
linker cache). Documentation, manuals, locales and glibc's iconv modules are left out. /var/lib/dpkg/status
keeps the stanzas of the packages kept, so image scanners see what is really there. No shell, no package
manager, no compiler: a distroless-style base.

    python3 scripts/image-rootfs.py SOURCE_ROOT DEST_ROOT
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

ROOTS = ("python3", "base-files", "netbase", "tzdata")
NOT_AT_RUN_TIME = {"dpkg", "tar", "mawk", "debconf", "perl-base"}
LEFT_OUT = (
    "usr/share/doc/", "usr/share/man/", "usr/share/info/", "usr/share/locale/", "usr/share/lintian/",
    "usr/share/bug/", "usr/lib/x86_64-linux-gnu/gconv/", "usr/lib/python3.11/pydoc_data/",
    "usr/lib/python3.11/lib2to3/", "usr/lib/python3.11/idlelib/", "usr/lib/python3.11/ensurepip/",
    "usr/lib/python3.11/test/", "usr/lib/python3.11/unittest/test/",
)
NOT_FROM_PACKAGES = ("etc/ld.so.cache", "etc/nsswitch.conf", "etc/localtime", "etc/timezone", "etc/host.conf")
USR_MERGED = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


def parse_status(text: str) -> dict[str, str]:
    """Package name → its stanza in /var/lib/dpkg/status (installed packages only)."""
    stanzas: dict[str, str] = {}
    for stanza in text.strip().split("\n\n"):
        fields = dict(re.findall(r"^([A-Za-z-]+): ?(.*)$", stanza, re.M))
        if "install ok installed" in fields.get("Status", ""):
            stanzas[fields["Package"]] = stanza
    return stanzas


def field(stanza: str, name: str) -> str:
    m = re.search(rf"^{name}: (.*(?:\n .*)*)", stanza, re.M)
    return m.group(1).replace("\n", " ") if m else ""


def closure(stanzas: dict[str, str]) -> list[str]:
    provides: dict[str, str] = {}
    for name, stanza in stanzas.items():
        for virtual in field(stanza, "Provides").split(","):
            if virtual.strip():
                provides.setdefault(virtual.split()[0].strip(), name)
    keep: set[str] = set()
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        name = name if name in stanzas else provides.get(name, name)
        if name in keep or name in NOT_AT_RUN_TIME:
            continue
        if name not in stanzas:
            raise SystemExit(f"image-rootfs: {name} is needed but not installed in the source tree")
        keep.add(name)
        for dep in (field(stanzas[name], "Pre-Depends") + "," + field(stanzas[name], "Depends")).split(","):
            alternatives = [a.split()[0].split(":")[0] for a in dep.split("|") if a.strip()]
            installed = [a for a in alternatives if a in stanzas or a in provides]
            if installed:
                todo.append(installed[0])
            elif alternatives:
                raise SystemExit(f"image-rootfs: {name} depends on {dep.strip()}, which is not installed")
    return sorted(keep)


def left_out(rel: str) -> bool:
    return any(rel.startswith(p) or rel + "/" == p for p in LEFT_OUT)


def copy_entry(src_root: Path, dst_root: Path, rel: str) -> None:
    """Copy one path (file, symlink or directory, not its contents) to the same place, through usr-merge links."""
    src = src_root / rel
    parent = Path(os.path.realpath(src.parent))
    try:
        real_rel = parent.relative_to(os.path.realpath(src_root)) / src.name
    except ValueError:  # a link out of the tree: not ours to follow
        return
    src, dst = src_root / real_rel, dst_root / real_rel
    if left_out(str(real_rel)) or (not src.is_symlink() and not src.exists()):
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_symlink():
        if not dst.is_symlink():
            os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        dst.mkdir(exist_ok=True)
        shutil.copystat(src, dst)
        cache = src / "__pycache__"  # compiled by py3compile at install: in no package's list
        if cache.is_dir() and not left_out(str(real_rel / "__pycache__") + "/"):
            shutil.copytree(cache, dst / "__pycache__", dirs_exist_ok=True)
    elif src.is_file():
        shutil.copy2(src, dst)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    src_root, dst_root = Path(argv[1]), Path(argv[2])
    info = src_root / "var/lib/dpkg/info"
    stanzas = parse_status((src_root / "var/lib/dpkg/status").read_text())
    keep = closure(stanzas)
    dst_root.mkdir(parents=True)
    for name in USR_MERGED:  # Debian's merged /usr: /bin → usr/bin and so on
        if (src_root / name).is_symlink():
            os.symlink(os.readlink(src_root / name), dst_root / name)
    for package in keep:
        lists = [p for p in (info / f"{package}.list", info / f"{package}:amd64.list") if p.is_file()]
        for path in (line.strip().lstrip("/") for lst in lists for line in lst.read_text().splitlines()):
            if path and path != ".":
                copy_entry(src_root, dst_root, path)
    for rel in NOT_FROM_PACKAGES:
        if (src_root / rel).exists() or (src_root / rel).is_symlink():
            copy_entry(src_root, dst_root, rel)
    (dst_root / "etc").mkdir(exist_ok=True)
    # Names for the two users an image needs (as distroless does); the image runs as 65532.
    (dst_root / "etc/passwd").write_text(
        "root:x:0:0:root:/root:/usr/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/usr/sbin/nologin\n")
    (dst_root / "etc/group").write_text("root:x:0:\nnonroot:x:65532:\n")
    for rel, mode in (("tmp", 0o1777), ("root", 0o700), ("home/nonroot", 0o700), ("var/lib/dpkg", 0o755)):
        (dst_root / rel).mkdir(parents=True, exist_ok=True)
        os.chmod(dst_root / rel, mode)
    os.chown(dst_root / "home/nonroot", 65532, 65532)
    (dst_root / "var/lib/dpkg/status").write_text("\n\n".join(stanzas[p] for p in keep) + "\n")
    print(f"image-rootfs: {len(keep)} packages: {' '.join(keep)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
