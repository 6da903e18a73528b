/*
 * Copies and sets of the double (the model is in cuda.c): device addresses
 * are fake, so no byte moves but those of VMM memory (vmm.c), whose mapped
 * ranges hold real contents; each call checks what the real driver would
 * refuse. The device side of a transfer must lie within one live linear
 * allocation (memory.c), mapped pinned host memory (host_memory.c), or
 * mapped VMM memory that the calling context's GPU may read (a source) or
 * write (a destination); a host side must be non-NULL; cuMemcpy(Async),
 * with unified addressing, takes either for either side, telling them apart
 * by the double's device address space.
 */
#include "double_internal.h"

/* What a side of a transfer may name. */
enum side {
    SIDE_DEVICE, /* a device pointer (mapped pinned host memory included) */
    SIDE_HOST,   /* a host pointer */
    SIDE_ANY     /* unified addressing: whichever the address is */
};

struct transfer {
    unsigned long long dst, src, bytes;
    enum side dst_side, src_side;
    int bytes_ok;         /* 0 when the element count overflows */
    CUgraphNodeType type; /* the node a capturing stream records */
    unsigned value, width; /* a set: the element and its bytes (0: a copy) */
};

static int in_device_space(unsigned long long addr) {
    return (addr >= REGION_BASE && addr - REGION_BASE < DOUBLE_MAX_DEVICES * REGION_SIZE) ||
           vmm_space(addr);
}

/* Whether [addr, addr + bytes) lies within mapped pinned host memory. */
static int mapped_host(unsigned long long addr, unsigned long long bytes) {
    unsigned long long base = 0, size = 0;
    return double_host_range(addr, &base, &size) && bytes <= size - (addr - base);
}

/* Whether [addr, addr + bytes) lies within one live linear allocation. */
static int device_range_locked(unsigned long long addr, unsigned long long bytes) {
    int dev = 0;
    struct record *r = find_locked(addr, 0, &dev);
    return r != NULL && r->kind == KIND_POINTER && bytes <= r->size - (addr - r->addr);
}

/* Where one side's bytes are: real host memory (a host pointer, mapped
 * pinned host memory), VMM memory, or nowhere (fake device memory). */
enum where { WHERE_NOWHERE, WHERE_HOST, WHERE_VMM };

/* Whether one side names memory it may (CUDA_SUCCESS, else the error), and
 * where its bytes are; `host_ok` is mapped_host's answer, asked before the
 * lock (host_memory.c has its own); `dev` the calling context's GPU. */
static CUresult side_ok_locked(unsigned long long addr, enum side side, unsigned long long bytes,
                               int host_ok, int dev, int write, enum where *where) {
    if (side == SIDE_ANY) {
        side = in_device_space(addr) ? SIDE_DEVICE : SIDE_HOST;
    }
    if (side == SIDE_HOST) {
        *where = WHERE_HOST;
        return addr != 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    }
    if (vmm_space(addr)) {
        *where = WHERE_VMM;
        return vmm_check_locked(addr, bytes, dev, write);
    }
    *where = host_ok ? WHERE_HOST : WHERE_NOWHERE;
    return device_range_locked(addr, bytes) || host_ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* Moves the bytes of a checked transfer where VMM memory holds one side. */
static CUresult move_locked(const struct transfer *t, enum where dst, enum where src) {
    if (dst == WHERE_VMM && t->width != 0) {
        vmm_fill_locked(t->dst, t->value, t->width, t->bytes);
    } else if (dst == WHERE_VMM && src == WHERE_HOST) {
        vmm_move_locked(t->dst, (void *)(uintptr_t)t->src, t->bytes, 1);
    } else if (dst == WHERE_HOST && src == WHERE_VMM && t->width == 0) {
        vmm_move_locked(t->src, (void *)(uintptr_t)t->dst, t->bytes, 0);
    } else if (dst == WHERE_VMM && src == WHERE_VMM) {
        unsigned long long done = 0, chunk = t->bytes < (1ULL << 20) ? t->bytes : 1ULL << 20;
        unsigned char *buffer = malloc(chunk);
        if (buffer == NULL) {
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        while (done < t->bytes) {
            unsigned long long n = t->bytes - done < chunk ? t->bytes - done : chunk;
            vmm_move_locked(t->src + done, buffer, n, 0);
            vmm_move_locked(t->dst + done, buffer, n, 1);
            done += n;
        }
        free(buffer);
    }
    return CUDA_SUCCESS;
}

/*
 * The checks of every copy and set, in the real driver's order: init, the
 * context (and the stream, async == 1), then the arguments. Zero bytes
 * succeed without looking at the pointers. On a capturing stream the
 * transfer is a node of the graph; otherwise it is done at once.
 */
static CUresult transfer(const struct transfer *t, CUstream h, int async, int ptsz) {
    int dst_host = t->bytes > 0 && t->dst_side != SIDE_HOST && mapped_host(t->dst, t->bytes);
    int src_host = t->bytes > 0 && t->src_side != SIDE_HOST && mapped_host(t->src, t->bytes);
    enum where dst = WHERE_NOWHERE, src = WHERE_NOWHERE;
    struct CUstream_st *s = NULL;
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = async ? stream_locked(h, ptsz, &s, &dev) : current_device_locked(&dev);
    if (rc == CUDA_SUCCESS && !t->bytes_ok) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS && t->bytes > 0) {
        rc = side_ok_locked(t->dst, t->dst_side, t->bytes, dst_host, dev, 1, &dst);
        if (rc == CUDA_SUCCESS) {
            rc = side_ok_locked(t->src, t->src_side, t->bytes, src_host, dev, t->width != 0,
                                &src);
        }
    }
    if (rc == CUDA_SUCCESS && s != NULL && s->capture != NULL) {
        struct node n = {t->type, dev, 0, 0};
        rc = s->capture->invalidated ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
                                     : graph_add_locked(s->capture, n, NULL);
    } else if (rc == CUDA_SUCCESS && t->bytes > 0) {
        rc = move_locked(t, dst, src);
    }
    unlock();
    return rc;
}

static CUresult copy(CUdeviceptr dst, enum side dst_side, CUdeviceptr src, enum side src_side,
                     size_t bytes, CUstream h, int async, int ptsz) {
    struct transfer t = {dst, src, bytes, dst_side, src_side, 1, CU_GRAPH_NODE_TYPE_MEMCPY, 0, 0};
    return transfer(&t, h, async, ptsz);
}

/* A set of `count` elements of `width` bytes to `value` (its source, for
 * the checks, is its destination). */
static CUresult set(CUdeviceptr dst, unsigned value, size_t count, unsigned width, CUstream h,
                    int async, int ptsz) {
    unsigned long long bytes = (unsigned long long)count * width;
    struct transfer t = {dst,   dst,   bytes, SIDE_DEVICE, SIDE_DEVICE, bytes / width == count,
                         CU_GRAPH_NODE_TYPE_MEMSET, value, width};
    return transfer(&t, h, async, ptsz);
}

static unsigned long long host_addr(const void *p) {
    return (unsigned long long)(uintptr_t)p;
}

/* ---------------------------------------------------------------- copies */

CUresult impl_cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount) {
    return copy(dst, SIDE_ANY, src, SIDE_ANY, ByteCount, NULL, 0, 0);
}

CUresult impl_cuMemcpy_ptds(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount) {
    return copy(dst, SIDE_ANY, src, SIDE_ANY, ByteCount, NULL, 0, 1);
}

CUresult impl_cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount,
                            CUstream hStream) {
    return copy(dst, SIDE_ANY, src, SIDE_ANY, ByteCount, hStream, 1, 0);
}

CUresult impl_cuMemcpyAsync_ptsz(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount,
                                 CUstream hStream) {
    return copy(dst, SIDE_ANY, src, SIDE_ANY, ByteCount, hStream, 1, 1);
}

CUresult impl_cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount) {
    return copy(dstDevice, SIDE_DEVICE, host_addr(srcHost), SIDE_HOST, ByteCount, NULL, 0, 0);
}

CUresult impl_cuMemcpyHtoD_v2_ptds(CUdeviceptr dstDevice, const void *srcHost,
                                   size_t ByteCount) {
    return copy(dstDevice, SIDE_DEVICE, host_addr(srcHost), SIDE_HOST, ByteCount, NULL, 0, 1);
}

CUresult impl_cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                   CUstream hStream) {
    return copy(dstDevice, SIDE_DEVICE, host_addr(srcHost), SIDE_HOST, ByteCount, hStream, 1,
                0);
}

CUresult impl_cuMemcpyHtoDAsync_v2_ptsz(CUdeviceptr dstDevice, const void *srcHost,
                                        size_t ByteCount, CUstream hStream) {
    return copy(dstDevice, SIDE_DEVICE, host_addr(srcHost), SIDE_HOST, ByteCount, hStream, 1,
                1);
}

CUresult impl_cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
    return copy(host_addr(dstHost), SIDE_HOST, srcDevice, SIDE_DEVICE, ByteCount, NULL, 0, 0);
}

CUresult impl_cuMemcpyDtoH_v2_ptds(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
    return copy(host_addr(dstHost), SIDE_HOST, srcDevice, SIDE_DEVICE, ByteCount, NULL, 0, 1);
}

CUresult impl_cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                   CUstream hStream) {
    return copy(host_addr(dstHost), SIDE_HOST, srcDevice, SIDE_DEVICE, ByteCount, hStream, 1,
                0);
}

CUresult impl_cuMemcpyDtoHAsync_v2_ptsz(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount,
                                        CUstream hStream) {
    return copy(host_addr(dstHost), SIDE_HOST, srcDevice, SIDE_DEVICE, ByteCount, hStream, 1,
                1);
}

CUresult impl_cuMemcpyDtoD_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice, size_t ByteCount) {
    return copy(dstDevice, SIDE_DEVICE, srcDevice, SIDE_DEVICE, ByteCount, NULL, 0, 0);
}

CUresult impl_cuMemcpyDtoD_v2_ptds(CUdeviceptr dstDevice, CUdeviceptr srcDevice,
                                   size_t ByteCount) {
    return copy(dstDevice, SIDE_DEVICE, srcDevice, SIDE_DEVICE, ByteCount, NULL, 0, 1);
}

CUresult impl_cuMemcpyDtoDAsync_v2(CUdeviceptr dstDevice, CUdeviceptr srcDevice,
                                   size_t ByteCount, CUstream hStream) {
    return copy(dstDevice, SIDE_DEVICE, srcDevice, SIDE_DEVICE, ByteCount, hStream, 1, 0);
}

CUresult impl_cuMemcpyDtoDAsync_v2_ptsz(CUdeviceptr dstDevice, CUdeviceptr srcDevice,
                                        size_t ByteCount, CUstream hStream) {
    return copy(dstDevice, SIDE_DEVICE, srcDevice, SIDE_DEVICE, ByteCount, hStream, 1, 1);
}

/* ---------------------------------------------------------------- sets */

CUresult impl_cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N) {
    return set(dstDevice, uc, N, 1, NULL, 0, 0);
}

CUresult impl_cuMemsetD8_v2_ptds(CUdeviceptr dstDevice, unsigned char uc, size_t N) {
    return set(dstDevice, uc, N, 1, NULL, 0, 1);
}

CUresult impl_cuMemsetD32_v2(CUdeviceptr dstDevice, unsigned int ui, size_t N) {
    return set(dstDevice, ui, N, 4, NULL, 0, 0);
}

CUresult impl_cuMemsetD32_v2_ptds(CUdeviceptr dstDevice, unsigned int ui, size_t N) {
    return set(dstDevice, ui, N, 4, NULL, 0, 1);
}

CUresult impl_cuMemsetD8Async(CUdeviceptr dstDevice, unsigned char uc, size_t N,
                              CUstream hStream) {
    return set(dstDevice, uc, N, 1, hStream, 1, 0);
}

CUresult impl_cuMemsetD8Async_ptsz(CUdeviceptr dstDevice, unsigned char uc, size_t N,
                                   CUstream hStream) {
    return set(dstDevice, uc, N, 1, hStream, 1, 1);
}

CUresult impl_cuMemsetD32Async(CUdeviceptr dstDevice, unsigned int ui, size_t N,
                               CUstream hStream) {
    return set(dstDevice, ui, N, 4, hStream, 1, 0);
}

CUresult impl_cuMemsetD32Async_ptsz(CUdeviceptr dstDevice, unsigned int ui, size_t N,
                                    CUstream hStream) {
    return set(dstDevice, ui, N, 4, hStream, 1, 1);
}
