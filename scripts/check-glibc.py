#!/usr/bin/env python3
"""Fails when a shared library needs a glibc newer than the baseline.

Reads both what the dynamic loader checks when it loads the library (the
version references, `objdump -p`: one missing version and the load fails)
and every dynamic symbol's version (`objdump -T`), and prints the newest
GLIBC_x.y of each with the symbols that need more than the baseline. A
strong undefined symbol with no version fails too: linked against an old
glibc's stubs, a function that glibc lacks is left unversioned, and the
loader refuses the library where it is missing (only weak ones, which the
code checks for null, may be unversioned).

Usage: python3 scripts/check-glibc.py LIBRARY.so [--max 2.17]
Exit status: 0 within the baseline, 1 newer, 2 objdump missing or unreadable.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys

# scripts/build-limiter.sh's GLIBC_BASELINE.
DEFAULT_MAX = "2.17"
GLIBC = re.compile(r"GLIBC_([0-9]+(?:\.[0-9]+)+)")
# Any version (GLIBC_x.y, GCC_3.0, ...) as objdump -T shows it.
VERSIONED = re.compile(r"\([A-Za-z_][A-Za-z0-9_.]*\)")


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def objdump(flag: str, library: str) -> str:
    out = subprocess.run(["objdump", flag, library], capture_output=True, text=True)
    if out.returncode != 0:
        raise OSError(out.stderr.strip() or f"objdump {flag} {library} failed")
    return out.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("library")
    parser.add_argument("--max", default=DEFAULT_MAX, help="newest glibc allowed (default %(default)s)")
    args = parser.parse_args()
    if shutil.which("objdump") is None:
        print("check-glibc: objdump is not installed (apt-get install binutils)", file=sys.stderr)
        return 2
    try:
        symbols = objdump("-T", args.library)
        private = objdump("-p", args.library)
    except OSError as e:
        print(f"check-glibc: {e}", file=sys.stderr)
        return 2
    limit = version(args.max)
    references = sorted({m.group(1) for m in GLIBC.finditer(private.split("Version References:", 1)[-1])}, key=version)
    needs: dict[str, list[str]] = {}
    for line in symbols.splitlines():
        found = GLIBC.search(line)
        if found:
            needs.setdefault(found.group(1), []).append(line.split()[-1])
    unversioned = []
    for line in symbols.splitlines():
        fields = line.split()
        if "*UND*" in fields and not VERSIONED.search(line):
            weak = len(fields) > 1 and fields[1] == "w"
            if not weak:
                unversioned.append(fields[-1])
    if not references and not needs:
        print(f"check-glibc: {args.library} needs no glibc symbol version: not a glibc-linked library?", file=sys.stderr)
        return 2
    newest = max(list(needs) + references, key=version)
    too_new = {v: sorted(set(s)) for v, s in needs.items() if version(v) > limit}
    too_new_refs = [v for v in references if version(v) > limit]
    print(f"{args.library}: needs GLIBC_{newest} at most (baseline {args.max}); "
          f"version references: {', '.join('GLIBC_' + v for v in references)}")
    failed = False
    if too_new or too_new_refs:
        for v in sorted(set(too_new) | set(too_new_refs), key=version):
            print(f"  GLIBC_{v} > {args.max}: {', '.join(too_new.get(v, ['(version reference)']))}")
        failed = True
    if unversioned:
        print(f"  strong undefined symbols with no version: {', '.join(sorted(unversioned))}")
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
