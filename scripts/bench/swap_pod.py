#!/usr/bin/env python3
"""The swap bench's pod program (scripts/bench/swap.py; its harness,
swap_bench.py, starts it, under the limiter but for `bandwidth`). It
answers on stdout with one line `REPLY {json}` when ready and one per
command read on stdin; anything else it prints is chatter.

  swap_pod.py bandwidth BYTES   pinned host->device and device->host copies of
                                BYTES, GiB/s of 5 each; one reply, then it exits
  swap_pod.py hold BYTES        BYTES of seeded random float32 in 1 GiB tensors;
                                its digests in the ready reply; then:
      check                     the digests again, computed on the GPU
      alloc N                   one more tensor of N bytes: alloc=ok or oom
      release                   those tensors dropped, the cache emptied
      device                    the UUID the driver gives its CUDA device 0
  swap_pod.py infer BYTES       a stack of 4096x4096 fp16 linear layers (tanh
                                between them) of about BYTES of weights, warmed up:
      infer                     a batch of 8 through every layer: its time and
                                the output's digest
  swap_pod.py serve BYTES SEED INPUTS
                                the serve bench's model: a stack of 8192x8192 fp16
                                linear layers of about BYTES of weights made from
                                SEED, and INPUTS batches of 8 (input i made from
                                seed i, the same in every pod); its answer to each
                                input in the ready reply (resident, before any swap):
      infer REQ I               input I through the model: the answer, tagged
                                req=REQ (ok=false and why, oom=true for an
                                out-of-memory error), its time and digest
  swap_pod.py work BYTES SEED   holds nothing until the first:
      work                      BYTES of tensors (seeded by SEED) allocated and
                                filled the first time; a matmul over two of them;
                                the digests
  every mode: exit

Digests are exact: sums of the tensors' 32-bit words in int64 and a
position-weighted sum of a strided sample, hashed on the host. No managed
memory, no expandable segments: the driver's checkpoint cannot take them.
"""
import hashlib
import json
import math
import os
import sys
import time

import torch

GIB = 1 << 30
CHUNK = GIB
# Elements per partial sum: its int64 copy is 128 MiB at most.
SLICE = 16 << 20
SAMPLE_STRIDE = 4099
SAMPLE = 1 << 16
DIM = 4096
SERVE_DIM = 8192
BATCH = 8


def reply(**fields):
    print("REPLY " + json.dumps(fields), flush=True)


def word_sums(t):
    """Two int64 scalars on the GPU: the sum of t's words and a weighted
    sum of a strided sample (order matters there)."""
    flat = t.reshape(-1)
    flat = flat.view(torch.int32) if flat.numel() * flat.element_size() % 4 == 0 else flat.view(torch.int16)
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, flat.numel(), SLICE):
        total += flat[start:start + SLICE].sum(dtype=torch.int64)
    sample = flat[::SAMPLE_STRIDE][:SAMPLE].to(torch.int64)
    weights = torch.arange(1, sample.numel() + 1, dtype=torch.int64, device=t.device)
    return total, (sample * weights).sum()


def digest(tensors):
    """A hex digest of the tensors' word sums (one transfer to the host)."""
    sums = [s for t in tensors for s in word_sums(t)]
    values = torch.stack(sums).tolist()
    return hashlib.sha256(json.dumps(values).encode()).hexdigest()[:24]


def filled(nbytes, seed):
    """nbytes (rounded down to 2 MiB) of uniform float32 in 1 GiB tensors."""
    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    left = nbytes - nbytes % (2 << 20)
    chunks = []
    while left > 0:
        size = min(CHUNK, left)
        chunks.append(torch.empty(size // 4, dtype=torch.float32, device="cuda").uniform_(-1, 1, generator=g))
        left -= size
    torch.cuda.synchronize()
    return chunks


def product(chunks):
    """The digest and float64 sum of a matmul of the first and the last tensor."""
    a, b = chunks[0], chunks[-1]
    n = min(DIM, math.isqrt(min(a.numel(), b.numel())))
    c = a[:n * n].view(n, n) @ b[-n * n:].view(n, n).T
    return {"matmul": digest([c]), "matmul_sum": c.sum(dtype=torch.float64).item()}


def state(chunks):
    return {"data": digest(chunks), **product(chunks)}


def bandwidth(nbytes):
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host.fill_(7)

    def rate(dst, src):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return nbytes / GIB / (time.perf_counter() - start)

    rate(dev, host), rate(host, dev)
    h2d = [rate(dev, host) for _ in range(5)]
    d2h = [rate(host, dev) for _ in range(5)]
    free, total = torch.cuda.mem_get_info()
    reply(ready=True, bytes=nbytes, h2d=h2d, d2h=d2h, total=total, free=free,
          devices=torch.cuda.device_count(), name=torch.cuda.get_device_name(0))


class Hold:
    def __init__(self, nbytes):
        start = time.perf_counter()
        self.chunks = filled(nbytes, 1234)
        self.extra = []
        reply(ready=True, pid=os.getpid(), bytes=nbytes, fill_s=time.perf_counter() - start, **state(self.chunks))

    def check(self):
        reply(**state(self.chunks))

    def alloc(self, n):
        try:
            self.extra.append(torch.empty(int(n), dtype=torch.uint8, device="cuda"))
            torch.cuda.synchronize()
            reply(alloc="ok")
        except torch.OutOfMemoryError as e:
            reply(alloc="oom", error=str(e).splitlines()[0][:200])

    def release(self):
        self.extra.clear()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        reply(released=True)

    def device(self):
        # The driver's answer now (torch caches the one it read at start).
        import ctypes
        raw = (ctypes.c_ubyte * 16)()
        rc = ctypes.CDLL("libcuda.so.1").cuDeviceGetUuid_v2(raw, 0)
        h = bytes(raw).hex()
        reply(rc=rc, uuid=f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")


def stack(nbytes, dim, g):
    """(a model of about nbytes of dim x dim fp16 linear layers, tanh
    between them, weights drawn by g; its layer count)."""
    # Xavier-like for tanh (gain 5/3): the signal neither dies nor
    # saturates through a few hundred layers.
    bound = 5 / 3 * math.sqrt(3 / dim)
    count = max(1, nbytes // (dim * dim * 2))
    layers = []
    with torch.no_grad():
        for _ in range(count):
            layer = torch.nn.Linear(dim, dim, bias=False, device="cuda", dtype=torch.float16)
            layer.weight.uniform_(-bound, bound, generator=g)
            layers += [layer, torch.nn.Tanh()]
    return torch.nn.Sequential(*layers).eval(), count


class Infer:
    def __init__(self, nbytes):
        start = time.perf_counter()
        g = torch.Generator(device="cuda")
        g.manual_seed(4321)
        self.model, count = stack(nbytes, DIM, g)
        self.x = torch.empty(BATCH, DIM, dtype=torch.float16, device="cuda").uniform_(-1, 1, generator=g)
        for _ in range(3):
            _, output = self.run()
        reply(ready=True, pid=os.getpid(), layers=count, weight_bytes=count * DIM * DIM * 2,
              load_s=time.perf_counter() - start, **output)

    def run(self):
        """(seconds to the result, its digests): one request."""
        with torch.inference_mode():
            start = time.perf_counter()
            y = self.model(self.x)
            torch.cuda.synchronize()
            took = time.perf_counter() - start
            return took, {"digest": digest([y]), "out_sum": y.sum(dtype=torch.float64).item()}

    def infer(self):
        took, output = self.run()
        reply(s=took, **output)


class Serve:
    def __init__(self, nbytes, seed, inputs):
        start = time.perf_counter()
        g = torch.Generator(device="cuda")
        g.manual_seed(seed)
        self.model, count = stack(nbytes, SERVE_DIM, g)
        self.inputs = []
        for i in range(inputs):
            g.manual_seed(i)
            self.inputs.append(torch.empty(BATCH, SERVE_DIM, dtype=torch.float16, device="cuda")
                               .uniform_(-1, 1, generator=g))
        answers = [self.run(i)[1] for i in range(inputs)]
        reply(ready=True, pid=os.getpid(), layers=count, weight_bytes=count * SERVE_DIM * SERVE_DIM * 2,
              load_s=time.perf_counter() - start, answers=answers)

    def run(self, i):
        """(seconds to the answer, its digest): input i through the model."""
        with torch.inference_mode():
            start = time.perf_counter()
            y = self.model(self.inputs[i])
            torch.cuda.synchronize()
            took = time.perf_counter() - start
            return took, digest([y])

    def infer(self, req, i):
        # Every answer carries its request: the bench matches them by it.
        try:
            took, answer = self.run(int(i))
            reply(req=int(req), ok=True, s=took, digest=answer)
        except torch.OutOfMemoryError as e:
            reply(req=int(req), ok=False, oom=True, error=str(e).splitlines()[0][:200])
        except Exception as e:  # the answer says why; the bench counts it
            reply(req=int(req), ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")


class Work:
    def __init__(self, nbytes, seed):
        self.nbytes, self.seed = nbytes, seed
        self.chunks = None
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        reply(ready=True, pid=os.getpid(), bytes=nbytes, free=free, total=total)

    def work(self):
        start = time.perf_counter()
        first = self.chunks is None
        try:
            if first:
                self.chunks = filled(self.nbytes, self.seed)
            fill_s = time.perf_counter() - start
            result = state(self.chunks)
            reply(ok=True, first=first, s=time.perf_counter() - start, fill_s=fill_s, **result)
        except torch.OutOfMemoryError as e:
            self.chunks = None
            reply(ok=False, oom=True, error=str(e).splitlines()[0][:200])


def main(argv):
    mode, nbytes = argv[0], int(argv[1])
    if mode == "bandwidth":
        bandwidth(nbytes)
        return 0
    server = {"hold": lambda: Hold(nbytes), "infer": lambda: Infer(nbytes),
              "serve": lambda: Serve(nbytes, int(argv[2]), int(argv[3])),
              "work": lambda: Work(nbytes, int(argv[2]))}[mode]()
    for line in iter(sys.stdin.readline, ""):
        words = line.split()
        if not words:
            continue
        if words[0] == "exit":
            reply(bye=True)
            return 0
        handler = getattr(server, words[0], None)
        if handler is None or words[0].startswith("_"):
            reply(ok=False, error=f"unknown command {words[0]!r}")
            continue
        try:
            handler(*words[1:])
        except Exception as e:  # one command's failure is its answer; the pod stays
            reply(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Exception as e:
        reply(ok=False, ready=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        raise
