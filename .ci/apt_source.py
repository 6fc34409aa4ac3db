"""Print an apt source (deb822) for another suite of the machine's own Debian archive.

    python3 .ci/apt_source.py trixie > /etc/apt/sources.list.d/potluck-ci-trixie.sources

The entry that serves this machine's release (VERSION_CODENAME in /etc/os-release, e.g.
bookworm) is found among the configured sources, deb822 (*.sources) or one-line (sources.list,
*.list), and copied with the given suite instead: same URIs (a mirror or a proxy stays in use),
same keyring. So CI names no package registry itself. Exits 1, saying why, where there is none.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

APT = Path("/etc/apt")


def codename(os_release: str) -> str:
    m = re.search(r"^VERSION_CODENAME=\"?([\w-]+)\"?$", os_release, re.M)
    if not m:
        raise SystemExit("apt_source: /etc/os-release names no VERSION_CODENAME")
    return m.group(1)


def entries(apt: Path) -> list[dict[str, str]]:
    """Every enabled `deb` entry: {"URIs", "Suites", "Components", "Signed-By"?} as deb822 has
    them (space-separated lists)."""
    out: list[dict[str, str]] = []
    for f in sorted((apt / "sources.list.d").glob("*.sources")):
        for stanza in re.split(r"\n\s*\n", f.read_text()):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if line.startswith("#") or ":" not in line or line[0].isspace():
                    continue
                key, value = line.split(":", 1)
                fields[key.strip()] = value.strip()
            if "deb" in fields.get("Types", "").split() and fields.get("Enabled", "yes") != "no":
                out.append(fields)
    lists = [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*.list"))]
    for f in [f for f in lists if f.is_file()]:
        for line in f.read_text().splitlines():
            m = re.match(r"^\s*deb\s+(?:\[([^\]]*)\]\s+)?(\S+)\s+(\S+)\s+(.*)$", line)
            if not m:
                continue
            options = dict(o.split("=", 1) for o in (m.group(1) or "").split() if "=" in o)
            fields = {"URIs": m.group(2), "Suites": m.group(3), "Components": m.group(4)}
            if "signed-by" in options:
                fields["Signed-By"] = options["signed-by"]
            out.append(fields)
    return out


def source_for(suite: str, apt: Path = APT, os_release: str | None = None) -> str:
    release = codename(
        os_release if os_release is not None else Path("/etc/os-release").read_text()
    )
    for e in entries(apt):
        if release in e.get("Suites", "").split() and "main" in e.get("Components", "").split():
            lines = ["Types: deb", f"URIs: {e['URIs']}", f"Suites: {suite}", "Components: main"]
            if "Signed-By" in e:
                lines.append(f"Signed-By: {e['Signed-By']}")
            return "\n".join(lines) + "\n"
    raise SystemExit(f"apt_source: no configured apt source serves {release} main")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: apt_source.py SUITE")
    sys.stdout.write(source_for(sys.argv[1]))
