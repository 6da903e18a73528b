#!/usr/bin/env python3
"""The swap bench's framework pod (part `frameworks` of scripts/bench/swap.py):
one framework's work under the limiter, its results' digest taken before a
swap and again after, to show the framework runs unchanged across it. The
protocol is swap_pod.py's: one `REPLY {json}` line when ready, then one per
command read on stdin (`check`, `exit`).

  swap_fw_pod.py WORKLOAD BYTES

WORKLOAD (BYTES of data, about, in 256 MiB pieces):
  torch-graph       PyTorch's caching allocator; a CUDA graph (a matmul and a
                    tanh over one piece) captured before the swap and
                    replayed after it
  torch-expandable  the same allocator with expandable_segments (it maps its
                    own memory with the driver's VMM API)
  torch-async       PyTorch's cudaMallocAsync backend (stream-ordered pools)
  jax               JAX (its allocator preallocates a share of the memory)
  cupy              CuPy's memory pool
  triton            a Triton kernel over PyTorch tensors, run again after
  torch-ipc         torch-graph's tensors, one of them shared by CUDA IPC
                    (torch.multiprocessing) with a second process of the
                    pod, which adds 1 to it in place and holds it
  cupy-managed      CuPy's memory pool over managed memory (cudaMallocManaged)
  torch-nccl        torch-graph's tensors, and an NCCL communicator of one
                    rank that all-reduces one of them at each check

The digest is a SHA-256 of the results' bytes, copied to the host.
"""
import hashlib
import json
import os
import sys

PIECE = 256 << 20


def reply(**fields):
    print("REPLY " + json.dumps(fields), flush=True)


def sha(chunks):
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()


class Torch:
    def __init__(self, nbytes, graph=False, triton=False):
        import torch

        self.torch = torch
        g = torch.Generator(device="cuda")
        g.manual_seed(1234)
        n = max(1, nbytes // PIECE)
        self.pieces = [torch.rand(PIECE // 4, device="cuda", generator=g) for _ in range(n)]
        self.a = torch.rand(2048, 2048, device="cuda", generator=g)
        self.graph = None
        if graph:
            self.out = torch.empty_like(self.a)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                self.out.copy_(torch.tanh(self.a @ self.a))
            torch.cuda.current_stream().wait_stream(s)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out.copy_(torch.tanh(self.a @ self.a))
        self.kernel = triton_add() if triton else None

    def digest(self):
        torch = self.torch
        results = [torch.tanh(self.a @ self.a)]
        if self.graph is not None:
            self.graph.replay()
            results.append(self.out)
        if self.kernel is not None:
            results.append(self.kernel(self.pieces[0], self.pieces[-1]))
        torch.cuda.synchronize()
        data = [p.cpu().numpy().tobytes() for p in self.pieces]
        return sha(data + [r.cpu().numpy().tobytes() for r in results])


def triton_add():
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def add(x, y, out, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(out + offsets, tl.load(x + offsets, mask=mask) + tl.load(y + offsets, mask=mask), mask=mask)

    def run(x, y):
        out = torch.empty_like(x)
        add[(triton.cdiv(x.numel(), 1024),)](x, y, out, x.numel(), BLOCK=1024)
        return out

    return run


class Jax:
    def __init__(self, nbytes):
        import jax
        import jax.numpy as jnp

        self.jnp = jnp
        key = jax.random.PRNGKey(1234)
        n = max(1, nbytes // PIECE)
        self.pieces = [jax.random.uniform(jax.random.fold_in(key, i), (PIECE // 4,)) for i in range(n)]
        self.a = jax.random.uniform(key, (2048, 2048))

    def digest(self):
        import numpy as np

        results = [self.jnp.tanh(self.a @ self.a)]
        return sha([np.asarray(x).tobytes() for x in self.pieces + results])


class Cupy:
    def __init__(self, nbytes, managed=False):
        import cupy as cp

        self.cp = cp
        if managed:
            cp.cuda.set_allocator(cp.cuda.MemoryPool(cp.cuda.malloc_managed).malloc)
        rng = cp.random.default_rng(1234)
        n = max(1, nbytes // PIECE)
        self.pieces = [rng.random(PIECE // 4, dtype=cp.float32) for _ in range(n)]
        self.a = rng.random((2048, 2048), dtype=cp.float32)

    def digest(self):
        results = [self.cp.tanh(self.a @ self.a)]
        return sha([self.cp.asnumpy(x).tobytes() for x in self.pieces + results])


class TorchNccl(Torch):
    """torch-graph's tensors, and an NCCL communicator of one rank (its
    own buffers, which NCCL maps with the driver's VMM API) that
    all-reduces one of them at each check."""

    def __init__(self, nbytes):
        super().__init__(nbytes, graph=True)
        import socket

        import torch.distributed as dist

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.dist = dist
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                device_id=self.torch.device("cuda", 0))
        self.reduced = self.pieces[0].clone()

    def digest(self):
        self.reduced.copy_(self.pieces[0])
        self.dist.all_reduce(self.reduced)
        self.torch.cuda.synchronize()
        return sha([super().digest().encode(), self.reduced.cpu().numpy().tobytes()])


class TorchIpc(Torch):
    def __init__(self, nbytes):
        super().__init__(nbytes, graph=True)
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")
        self.jobs, self.done = context.Queue(), context.Queue()
        self.child = context.Process(target=ipc_child, args=(self.jobs, self.done), daemon=True)
        self.child.start()
        self.jobs.put(self.pieces[0])
        answer = self.done.get(timeout=600)
        if answer != "added":
            raise RuntimeError(f"the IPC child: {answer}")

    def digest(self):
        # The child reads the shared tensor through its own mapping: the
        # same sum as the parent's, before a swap and after.
        self.jobs.put("sum")
        seen = self.done.get(timeout=300)
        if seen != self.pieces[0].sum().item():
            raise RuntimeError(f"the IPC child sees a sum of {seen}, not {self.pieces[0].sum().item()}")
        return super().digest()


def ipc_child(jobs, done):
    """A second process of the pod: adds 1 to the shared tensor in place,
    then holds it (its mapping), answering its sum on "sum", until the
    parent exits."""
    try:
        import torch

        shared = jobs.get()
        shared.add_(1.0)
        torch.cuda.synchronize()
        done.put("added")
        while jobs.get() == "sum":
            done.put(shared.sum().item())
    except EOFError:  # the parent exited
        return
    except Exception as e:  # the parent reports it
        done.put(f"{type(e).__name__}: {str(e)[:300]}")


WORKLOADS = {
    "torch-graph": lambda n: Torch(n, graph=True),
    "torch-expandable": Torch,
    "torch-async": Torch,
    "jax": Jax,
    "cupy": Cupy,
    "triton": lambda n: Torch(n, triton=True),
    "torch-ipc": TorchIpc,
    "cupy-managed": lambda n: Cupy(n, managed=True),
    "torch-nccl": TorchNccl,
}


def main(argv):
    workload, nbytes = argv[0], int(argv[1])
    server = WORKLOADS[workload](nbytes)
    reply(ready=True, pid=os.getpid(), digest=server.digest())
    for line in iter(sys.stdin.readline, ""):
        command = line.strip()
        if command == "exit":
            reply(bye=True)
            return 0
        if command == "check":
            try:
                reply(ok=True, digest=server.digest())
            except Exception as e:  # the answer says why; the bench reports it
                reply(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        elif command:
            reply(ok=False, error=f"unknown command {command!r}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Exception as e:
        reply(ok=False, ready=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        raise
