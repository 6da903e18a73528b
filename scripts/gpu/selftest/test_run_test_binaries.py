"""The test command's runner (scripts/run_test_binaries.py) on stand-in
test binaries: each runs in its package's folder, all run and a failure
fails the run; the binaries of the control plane's packages start only
once the given process ended; a binary that runs alone has no other
beside it."""

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
RUNNER = ROOT / "scripts" / "run_test_binaries.py"


def binary(tmp, package, name, body, kind="test"):
    """A stand-in test binary of `package`: a shell script that records
    when it started and ended, and where it ran, then runs `body`."""
    folder = tmp / package
    folder.mkdir(exist_ok=True)
    (folder / "Cargo.toml").write_text(f'[package]\nname = "{package}"\n')
    script = tmp / f"{package}-{name}.sh"
    log = tmp / "log"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "start {package}/{name} $(date +%s.%N) $PWD" >> {log}\n'
        f"{body}\n"
        "status=$?\n"
        f'echo "end {package}/{name} $(date +%s.%N)" >> {log}\n'
        'echo "test result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out"\n'
        "exit $status\n"
    )
    script.chmod(0o755)
    return json.dumps({
        "reason": "compiler-artifact",
        "package_id": f"path+file://{folder}#{package}@0.1.0",
        "manifest_path": str(folder / "Cargo.toml"),
        "target": {"name": name, "kind": [kind]},
        "profile": {"test": True},
        "executable": str(script),
    })


def run(tmp, lines, *args):
    artifacts = tmp / "artifacts.json"
    artifacts.write_text("\n".join(lines) + "\n")
    done = subprocess.run([sys.executable, str(RUNNER), str(artifacts), *args],
                          capture_output=True, text=True, timeout=60)
    events = {}
    for line in (tmp / "log").read_text().splitlines():
        what, who, at, *where = line.split()
        events[(what, who)] = (float(at), where)
    return done, events


def test_every_binary_runs_in_its_package_folder_and_a_failure_fails_the_run(tmp_path):
    lines = [binary(tmp_path, "one", "it", "true"), binary(tmp_path, "two", "it", "false"),
             binary(tmp_path, "three", "three", "true", kind="lib")]
    done, events = run(tmp_path, lines)
    assert done.returncode == 1, done.stdout
    for package, name in [("one", "it"), ("two", "it"), ("three", "three")]:
        at, where = events[("start", f"{package}/{name}")]
        assert where == [str(tmp_path / package)], where
        assert ("end", f"{package}/{name}") in events
    assert "failed: two (test it)" in done.stdout, done.stdout
    assert "3 passed" in done.stdout, done.stdout


def test_the_control_planes_binaries_wait_for_its_build_and_one_alone_runs_alone(tmp_path):
    build = subprocess.Popen(["sleep", "2"])
    try:
        lines = [binary(tmp_path, "system-tests", "it", "sleep 0.2"),
                 binary(tmp_path, "hypervisor", "it", "sleep 0.2"),
                 binary(tmp_path, "cuda-limiter", "it", "sleep 0.5"),
                 binary(tmp_path, "hypervisor-core", "it", "sleep 0.5"),
                 binary(tmp_path, "gpushare-utils", "it", "sleep 0.5")]
        started = time.time()
        done, events = run(tmp_path, lines, "--after", str(build.pid))
    finally:
        build.wait()
    assert done.returncode == 0, done.stdout
    # The build's process ends 2 s in: not before it.
    # The daemon package's tests run the control plane too (through the
    # Kubernetes doubles): they wait as well.
    for late in ["system-tests/it", "hypervisor/it"]:
        assert events[("start", late)][0] >= started + 1.9, late
    limiter = (events[("start", "cuda-limiter/it")][0], events[("end", "cuda-limiter/it")][0])
    for other in ["system-tests/it", "hypervisor-core/it", "gpushare-utils/it", "hypervisor/it"]:
        begin, end = events[("start", other)][0], events[("end", other)][0]
        assert end <= limiter[0] or begin >= limiter[1], f"{other} ran beside the limiter's binary"
    # Two at a time where none runs alone: the other two overlapped.
    a, b = events[("start", "hypervisor-core/it")][0], events[("start", "gpushare-utils/it")][0]
    assert abs(a - b) < 0.4, (a, b)
