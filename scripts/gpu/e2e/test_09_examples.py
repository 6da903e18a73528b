"""Check 43: the examples of examples/ that need a GPU, run by their own
run.sh as a user runs them (examples/README.md): 43a the local-mode CUDA
program under its 2 GiB quota and 30% share, on the real driver; 43b the
PyTorch training step and inference loop as two pods of the daemon (the
bundle's hypervisor). The examples' other parts run without a GPU, in
system-tests/tests/it/examples.rs."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from harness.checks import AtMost, Equal, Why, num, q
from harness.parse import fields
from harness.proc import env_for, run

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
SHARE = AtMost(33)  # the 30% limit, 3 points of tolerance


def line(text: str, prefix: str) -> str:
    """The first line of `text` that starts with `prefix`, else ""."""
    return next((x for x in text.splitlines() if x.startswith(prefix)), "")


@pytest.mark.check("43")
def test_local_quota(check):
    """43a: quota.c sees 2048 MiB, is refused past them with error 2, and its
    kernels get at most 30% (+3) of the GPU's wall time."""
    row = check.row("43a. examples/local-quota/run.sh: quota.c under 2 GiB and 30% (local mode)",
                    f"total=2048MiB, refused=2 with <=2048MiB granted, share {SHARE}%")
    if not os.path.isfile(check.s.lib):
        return row.fail(f"no {check.s.lib}")
    env = env_for(check.s, "base")
    env.update(LIMITER=check.s.lib, CUDA_LIMITER_POD="e2e-example-quota", CUDA_LIMITER_LOG=check.s.limiter_log)
    r = run(check.s, "base", "e2e-example-quota", check.log / "43-local-quota.log", 180,
            ["bash", str(EXAMPLES / "local-quota" / "run.sh")], env=env)
    text = r.text()
    memory = re.search(r"^device memory: ([0-9]+) MiB total", text, re.MULTILINE)
    refused = re.search(r"^allocations of ([0-9]+) MiB: ([0-9]+) granted, then CUDA error ([0-9]+)", text,
                        re.MULTILINE)
    share = re.search(r"^kernels: .*: ([0-9]+)% of the GPU's time", text, re.MULTILINE)
    total = memory.group(1) if memory else None
    granted = int(refused.group(1)) * int(refused.group(2)) if refused else None
    why = Why()
    why.add(r.exit_why("run"))
    why.need(Equal(2048).holds(total), "total!=2048")
    why.need(refused is not None and refused.group(3) == "2", "not-refused-with-2")
    why.need(granted is not None and granted <= 2048, "granted>2048")
    why.need(SHARE.holds(share.group(1) if share else None), "share")
    row.done("-", f"total={q(total)}MiB granted={q(granted)}MiB error={q(refused and refused.group(3))} "
                  f"share={q(share and share.group(1))}%", why)


@pytest.mark.check("43")
def test_pytorch(check):
    """43b: train_step.py and infer_loop.py at once under the daemon: each
    sees its pod's quota (8192 and 4096 MiB), the loss falls, every request
    is answered."""
    row = check.row("43b. examples/pytorch/run.sh: train_step.py (pod train, 8 GiB, cap 60%) and "
                    "infer_loop.py (pod infer, 4 GiB, latency) under the daemon",
                    "train: gpu_total_mib=8192, loss falls; infer: gpu_total_mib=4096, requests=200")
    s = check.s
    if not s.hypervisor or not os.path.isfile(s.lib):
        return row.fail("no hypervisor binary" if not s.hypervisor else f"no {s.lib}")
    env = env_for(s, "base")
    env.update(LIMITER=s.lib, HYPERVISOR=s.hypervisor, PYTHON=s.python, CUDA_LIMITER_LOG=s.limiter_log,
               HYPERVISOR_LOG=s.hv_log)
    if s.hv_simulate:
        env["HYPERVISOR_ARGS"] = f"--simulate-gpus {s.hv_simulate}"
    r = run(s, "base", "-", check.log / "43-pytorch.log", 300, ["bash", str(EXAMPLES / "pytorch" / "run.sh")],
            env=env)
    text = r.text()
    train, infer = fields(line(text, "train: ")), fields(line(text, "infer: "))
    first, last = num(train.get("loss_first")), num(train.get("loss_last"))
    why = Why()
    why.add(r.exit_why("run"))
    why.need(Equal(8192).holds(train.get("gpu_total_mib")), "train-total!=8192")
    why.need(first is not None and last is not None and last < first, "loss-did-not-fall")
    why.need(Equal(4096).holds(infer.get("gpu_total_mib")), "infer-total!=4096")
    why.need(Equal(200).holds(infer.get("requests")), "requests!=200")
    row.done("-", f"train: total={q(train.get('gpu_total_mib'))}MiB loss {q(first)}->{q(last)}; "
                  f"infer: total={q(infer.get('gpu_total_mib'))}MiB requests={q(infer.get('requests'))} "
                  f"p99={q(infer.get('p99_ms'))}ms", why)
