#!/usr/bin/env python3
"""Runs the workspace's test binaries, two at a time (TEST_JOBS; those in
ALONE with no other beside them), as `cargo test` would run them one
after the other: each in its package's
folder, its output printed whole once it ends, then how long each took and
the totals. Cargo runs one binary at a time, and most of a binary's time is
spent waiting on the daemons, control planes and programs its tests drive:
a second binary beside it takes the cores the first leaves idle. Run as
cargo does them, the binaries need no other build (a `cargo test -p` of a
few packages resolves other features, and builds again).

  run_test_binaries.py ARTIFACTS [--after PID] [-- BINARY ARGS...]

ARTIFACTS: what `cargo test --no-run --message-format=json-render-diagnostics`
wrote on stdout. --after PID: the binaries of the packages that run the
Kubernetes control plane (CONTROL_PLANE and the members that depend on it)
start only once process PID (its build) has ended; the others start at
once. Exits 1 when a binary failed
or could not run, after every one has run.
"""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

# The package that starts the official control plane: it and the
# workspace's packages that depend on it (directly or through another
# member) wait for its build.
CONTROL_PLANE = "kube-control-plane"
# Binaries that take minutes, started first among their group so that no
# core idles at the end: (package, target).
LONG = [("system-tests", "it"), ("cuda-limiter", "it"), ("hypervisor", "it"), ("kube-fakes", "it")]
# Binaries that run with no other test binary beside them: the limiter's
# time launches and the monitor's wake-ups, which another binary's load
# on 2 cores skews. A build beside them at a lower priority is fine.
ALONE = {("cuda-limiter", "it")}
WAIT = object()


class Binary:
    def __init__(self, package, name, kind, executable, folder, late):
        self.package = package
        self.is_late = late
        self.name = name
        self.kind = kind
        self.executable = executable
        self.folder = folder
        self.seconds = 0.0
        self.code = None
        self.output = ""

    def label(self):
        what = "unittests" if self.kind == "lib" else f"{self.kind} {self.name}"
        return f"{self.package} ({what})"

    def late(self):
        return self.is_late

    def alone(self):
        return (self.package, self.name) in ALONE


def binaries(artifacts, names, late):
    """The test executables cargo built, in the order it listed them;
    `names`: the workspace's package names by manifest path; `late`: the
    packages whose binaries wait for the control plane."""
    found = []
    for line in Path(artifacts).read_text().splitlines():
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            continue
        if message.get("reason") != "compiler-artifact":
            continue
        if not message.get("profile", {}).get("test") or not message.get("executable"):
            continue
        target, manifest = message["target"], message["manifest_path"]
        package = names.get(manifest) or Path(manifest).parent.name
        found.append(
            Binary(
                package=package,
                name=target["name"],
                kind=target["kind"][0],
                executable=message["executable"],
                folder=str(Path(manifest).parent),
                late=package in late,
            )
        )
    return found


def workspace(folder):
    """The workspace's package names by manifest path, and the members
    whose tests may start CONTROL_PLANE, by `cargo metadata` run in
    `folder`: it, the members that use it in their code (through other
    members' code too), and those whose tests use any of these."""
    meta = json.loads(subprocess.run(
        ["cargo", "metadata", "--format-version", "1", "--no-deps", "--locked", "--offline"],
        capture_output=True, text=True, check=True, cwd=folder,
    ).stdout)
    names = {p["manifest_path"]: p["name"] for p in meta["packages"]}
    # A dependency's own dev-dependencies do not come with it.
    code = {p["name"]: {d["name"] for d in p["dependencies"] if d["kind"] != "dev"} for p in meta["packages"]}
    tests = {p["name"]: {d["name"] for d in p["dependencies"]} for p in meta["packages"]}
    users = {CONTROL_PLANE}
    while True:
        more = {name for name, deps in code.items() if deps & users} - users
        if not more:
            break
        users |= more
    return names, users | {name for name, deps in tests.items() if deps & users}


def alive(pid):
    """Whether process `pid` runs: it exists and has not exited (a zombie
    its parent has not waited for yet has)."""
    if pid is None:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def run(binary, args):
    started = time.monotonic()
    try:
        done = subprocess.run(
            [binary.executable, *args],
            cwd=binary.folder,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        binary.code, binary.output = done.returncode, done.stdout
    except OSError as error:
        binary.code, binary.output = 127, f"cannot run {binary.executable}: {error}\n"
    binary.seconds = time.monotonic() - started


def main():
    argv = sys.argv[1:]
    args = []
    if "--" in argv:
        at = argv.index("--")
        argv, args = argv[:at], argv[at + 1 :]
    after = None
    if len(argv) >= 3 and argv[1] == "--after":
        after = int(argv[2])
        argv = argv[:1]
    if len(argv) != 1:
        sys.exit(__doc__)
    names, late = workspace(Path(__file__).resolve().parent.parent)
    todo = binaries(argv[0], names, late)
    todo.sort(key=lambda b: LONG.index((b.package, b.name)) if (b.package, b.name) in LONG else len(LONG))
    if not todo:
        sys.exit(f"no test binary listed in {argv[0]}")
    jobs = max(1, int(os.environ.get("TEST_JOBS", "2")))
    # As cargo runs tests: CARGO set (some run cargo themselves), and the
    # toolchain's libraries on the loader's path (a proc-macro crate's
    # tests link Rust's std as a shared library).
    os.environ.setdefault("CARGO", "cargo")
    sysroot = subprocess.run(
        ["rustc", "--print", "sysroot"], capture_output=True, text=True, check=True
    ).stdout.strip()
    host = subprocess.run(["rustc", "--print", "host-tuple"], capture_output=True, text=True, check=True).stdout.strip()
    paths = [f"{sysroot}/lib/rustlib/{host}/lib", f"{sysroot}/lib", os.environ.get("LD_LIBRARY_PATH", "")]
    os.environ["LD_LIBRARY_PATH"] = ":".join(p for p in paths if p)
    lock = threading.Lock()
    pending = list(todo)
    finished = []

    running = []

    def take():
        """The next binary to run; WAIT while only late ones are left and
        their control plane is still being built, or while one that runs
        alone runs or waits for the others to end; None once all ran."""
        with lock:
            if not pending:
                return None
            if any(b.alone() for b in running):
                return WAIT
            ready = not alive(after)
            choices = [b for b in pending if b.late() == ready] or (pending if ready else [])
            if running:
                choices = [b for b in choices if not b.alone()]
            if not choices:
                return WAIT
            chosen = choices[0]
            pending.remove(chosen)
            running.append(chosen)
            return chosen

    def worker():
        while True:
            binary = take()
            if binary is None:
                return
            if binary is WAIT:
                time.sleep(0.2)
                continue
            try:
                run(binary, args)
            except Exception as error:  # reported as the binary's failure
                binary.code, binary.output = 1, f"the runner failed: {error!r}\n"
            with lock:
                running.remove(binary)
                finished.append(binary)
                mark = "ok" if binary.code == 0 else f"FAILED (exit {binary.code})"
                print(f"     Ran {binary.label()} in {binary.seconds:.0f} s: {mark}", flush=True)
                print(f"       {binary.executable}", flush=True)
                sys.stdout.write(binary.output)
                sys.stdout.flush()

    threads = [threading.Thread(target=worker) for _ in range(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    report(finished)
    if len(finished) != len(todo):
        sys.exit(f"== {len(todo) - len(finished)} test binaries never ran")


def report(finished):
    totals = {"passed": 0, "failed": 0, "ignored": 0}
    for binary in finished:
        for line in binary.output.splitlines():
            if line.startswith("test result:"):
                for part in line.split(";"):
                    words = part.split()
                    if len(words) >= 2 and words[-1] in totals:
                        totals[words[-1]] += int(words[-2])
    print("== test binaries, longest first")
    for binary in sorted(finished, key=lambda b: -b.seconds):
        if binary.seconds >= 1:
            print(f"   {binary.seconds:6.0f} s  {binary.label()}")
    failed = [b for b in finished if b.code != 0]
    print(
        f"== {totals['passed']} passed, {totals['failed']} failed, {totals['ignored']} ignored"
        f" in {len(finished)} test binaries"
    )
    if failed:
        print("== failed: " + ", ".join(b.label() for b in failed))
        sys.exit(1)


if __name__ == "__main__":
    main()
