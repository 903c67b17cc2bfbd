"""What the docs state as fact and the code decides: a test holds each number to the code, so that a change to one
fails until the other follows.

- one ConfigMap's capacity in names (``raven.dns.shards.typical_capacity``) wherever the docs, the examples and
  the ``hosts.shards`` setting's description quote it;
- docs/protocol.md's HELLO and WELCOME examples are what this release sends, and its version lists are
  ``SUPPORTED_VERSIONS``;
- the README names every Debian package scripts/system-deps.sh installs for the test command;
- deploy/README.md's short way (issue 33): at most 5 commands and 1,500 words to read, its ``raven`` commands
  parse with this release's command line, and its screen is a whole ``raven check`` run.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from raven.config import GatewayConfig
from raven.dns.shards import TYPICAL_NAME_LENGTH, typical_capacity
from raven.protocol import wire
from raven.version import RELEASE
from tests.support.paths import ROOT

# "about 37,000 (edge) names (of 14 characters) with one IPv4 ...", "17,000 with IPv4 and IPv6"
ONE_V4 = re.compile(r"about ([\d,]+) (?:edge )?names(?: of (\d+) characters)? with one IPv4")
DUAL = re.compile(r"([\d,]+) with IPv4 and IPv6")
CAPACITY_QUOTED = ("README.md", "deploy/coredns/README.md", "deploy/examples/gateway.yaml")


def _prose(path: Path) -> str:
    """A file's text as running prose: YAML comment marks dropped, lines joined."""
    return " ".join(line.strip().lstrip("#").strip() for line in path.read_text().splitlines())


def _capacity_quotes(text: str) -> tuple[list[tuple[int, int | None]], list[int]]:
    one = [(int(m[1].replace(",", "")), int(m[2]) if m[2] else None) for m in ONE_V4.finditer(text)]
    dual = [int(m[1].replace(",", "")) for m in DUAL.finditer(text)]
    return one, dual


def test_the_configmap_capacity_is_the_codes_wherever_it_is_quoted() -> None:
    v4, dual = typical_capacity()
    assert 30_000 < v4 < 40_000 and 15_000 < dual < 20_000  # the numbers a reader has met so far
    shards = GatewayConfig.model_fields["hosts"].annotation.model_fields["shards"].description  # type: ignore[union-attr]
    texts = {name: _prose(ROOT / name) for name in CAPACITY_QUOTED}
    texts["hosts.shards's description"] = shards or ""
    texts.update({str(p.relative_to(ROOT)): _prose(p) for p in sorted((ROOT / "docs").glob("*.md"))})
    quoted = set()
    for name, text in texts.items():
        one, both = _capacity_quotes(text)
        if one or both:
            quoted.add(name)
        assert all(n == v4 and length in (None, TYPICAL_NAME_LENGTH) for n, length in one), (
            f"{name} says {one}; one ConfigMap holds about {v4:,} names of {TYPICAL_NAME_LENGTH} characters")
        assert all(n == dual for n in both), f"{name} says {both}; with IPv4 and IPv6 it is about {dual:,}"
    assert quoted >= {*CAPACITY_QUOTED, "hosts.shards's description"}, f"the capacity is no longer quoted in " \
        f"{sorted({*CAPACITY_QUOTED, 'hosts.shards' + chr(39) + 's description'} - quoted)}: update this test"


def _json_after(doc: str, heading: str) -> str:
    section = doc.split(heading, 1)[1]
    return section.split("```json\n", 1)[1].split("\n```", 1)[0]


def test_the_protocol_docs_hello_and_welcome_are_what_this_release_sends() -> None:
    doc = (ROOT / "docs" / "protocol.md").read_text()
    hello_text = _json_after(doc, "### HELLO")
    hello = json.loads(hello_text)
    sent = wire.encode(wire.Hello(agent=hello["agent"], session=hello["session"], window=hello["window"],
                                  max_streams=hello["max_streams"], release=RELEASE))
    assert hello_text.encode() == sent[wire.HEADER_SIZE:], "docs/protocol.md's HELLO is not what an agent sends"

    welcome_text = _json_after(doc, "### WELCOME")
    welcome = json.loads(welcome_text)
    # A gateway answers an agent that offers every version with the newest, PROTOCOL_VERSION.
    answered = wire.encode(wire.Welcome(
        version=wire.PROTOCOL_VERSION, replica=welcome["replica"], replicas=welcome["replicas"],
        heartbeat_interval=welcome["heartbeat_interval"], heartbeat_timeout=welcome["heartbeat_timeout"],
        window=welcome["window"], max_streams=welcome["max_streams"], release=RELEASE))
    assert welcome_text.encode() == answered[wire.HEADER_SIZE:], "docs/protocol.md's WELCOME is not a gateway's"

    # Every version list in the document is this release's.
    supported = list(wire.SUPPORTED_VERSIONS)
    offered = [json.loads(m) for m in re.findall(r'"versions":(\[[\d,]*\])', doc)]
    assert offered and all(v == supported for v in offered), offered
    for line in doc.splitlines():
        if line.startswith("| `versions` |") or line.startswith("**Versions.**"):
            assert f"`{supported}`" in line, line
    assert (f"`PROTOCOL_VERSION = {wire.PROTOCOL_VERSION}` and `SUPPORTED_VERSIONS = {wire.SUPPORTED_VERSIONS}`"
            in doc)
    words = ", ".join(str(v) for v in supported[:-1]) + f" and {supported[-1]}"
    assert doc.splitlines()[0] == f"# Raven tunnel protocol, versions {words}"


def test_the_readme_names_every_package_the_test_command_installs() -> None:
    script = (ROOT / "scripts" / "system-deps.sh").read_text()
    packages = re.findall(r"need\+=\(([a-z0-9.+-]+)\)", script)
    assert len(packages) >= 10, packages
    readme = " ".join((ROOT / "README.md").read_text().split())
    said = readme.split("The test command also installs", 1)[1].split("and needs root", 1)[0]
    missing = [p for p in packages if not re.search(rf"(?<![\w-]){re.escape(p)}(?![\w-])", said)]
    assert not missing, f"README.md's list of what the test command installs leaves out {missing}"


# ---------------------------------------------------------------- deploy/README.md's short way (issue 33)

SHORT_WAY_END = "## The long way, by hand"
MAX_COMMANDS, MAX_WORDS = 5, 1500


def short_way() -> str:
    """What a user must read to install: deploy/README.md up to the long form (prose, commands and the screen)."""
    text = (ROOT / "deploy" / "README.md").read_text()
    return text[:text.index(SHORT_WAY_END)]


def short_way_commands() -> list[str]:
    """The shell commands of the short way's sh blocks, a backslash-continued line joined to the next."""
    commands: list[str] = []
    for block in re.findall(r"```sh\n(.*?)```", short_way(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(line.strip())
    return commands


def test_the_short_way_is_five_commands_and_under_1500_words() -> None:
    words = len(short_way().split())  # whitespace-separated words, as wc -w counts them (code and screen too)
    commands = short_way_commands()
    assert words <= MAX_WORDS, f"deploy/README.md's short way is {words} words (at most {MAX_WORDS})"
    assert 0 < len(commands) <= MAX_COMMANDS, commands


def test_the_short_ways_raven_commands_parse() -> None:
    """Every ``raven`` invocation in the short way (the install pipeline's middle, the check pod's args) is
    accepted by this release's command line: a renamed or dropped flag fails here."""
    from raven.cli.commands import build_parser

    parser = build_parser()
    seen = []
    for command in short_way_commands():
        for part in command.split(" | "):
            words = shlex.split(part)
            if words and words[0].endswith("bin/raven"):
                seen.append(words[1])
                parser.parse_args(words[1:])
            elif "-- check" in part:
                seen.append("check")
                parser.parse_args(words[words.index("--") + 1:])
    assert seen == ["install", "check"], seen
    assert "--coredns -" in " ".join(short_way_commands())  # CoreDNS's change is in the one kubectl apply


def test_the_short_ways_screen_is_a_whole_passing_run() -> None:
    screen = re.search(r"```\n(✔.*?)```", short_way(), re.S)
    assert screen is not None
    lines = screen[1].splitlines()
    names = [line.split()[1] for line in lines if line.startswith("✔")]
    assert lines[-1] == f"{len(names)} of {len(names)} checks passed"
    for check in ("gateway-pods", "coredns-corefile", "dns-sample", "release-skew", "clock-skew", "prometheus",
                  "descriptors"):
        assert check in names, check
