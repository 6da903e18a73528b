/*
 * Stream-ordered memory and memory pools of the double (the model is in
 * cuda.c): one default pool per GPU and those cuMemPoolCreate makes, each
 * with its release threshold and the bytes it retains (driver-held),
 * allocations and frees on a stream, captured ones as graph nodes.
 */
#include "double_internal.h"

struct CUmemPoolHandle_st g_pools[DOUBLE_MAX_POOLS];

/* What dev's pools retain. */
unsigned long long pools_retained(int dev) {
    unsigned long long retained = 0;
    int i;
    for (i = 0; i < DOUBLE_MAX_POOLS; i++) {
        if (g_pools[i].live && g_pools[i].device == dev) {
            retained = add_sat(retained, g_pools[i].retained);
        }
    }
    return retained;
}

/* dev's last context is gone: its pools keep nothing. */
void pools_forget_retained(int dev) {
    int i;
    for (i = 0; i < DOUBLE_MAX_POOLS; i++) {
        if (g_pools[i].device == dev) {
            g_pools[i].retained = 0;
        }
    }
}

/* Releases the pool's retained bytes until reserved <= max(keep, used). */
static void pool_release_locked(struct CUmemPoolHandle_st *p, unsigned long long keep) {
    unsigned long long reserved = p->used + p->retained;
    if (keep < p->used) {
        keep = p->used;
    }
    if (reserved > keep) {
        p->retained -= reserved - keep < p->retained ? reserved - keep : p->retained;
    }
}

/* A synchronize on dev: its pools give back what is above their thresholds. */
void pool_settle_locked(int dev) {
    int i;
    for (i = 0; i < DOUBLE_MAX_POOLS; i++) {
        if (g_pools[i].live && g_pools[i].device == dev) {
            pool_release_locked(&g_pools[i], g_pools[i].threshold);
        }
    }
}

/* The pool a call names; NULL is the current GPU's default pool. */
static CUresult pool_locked(CUmemoryPool pool, struct CUmemPoolHandle_st **out) {
    CUdevice dev = 0;
    long i;
    if (pool == NULL) {
        CUresult rc = current_device_locked(&dev);
        if (rc == CUDA_SUCCESS) {
            *out = &g_pools[dev];
        }
        return rc;
    }
    if (!g_initialized) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    i = SLOT(g_pools, pool);
    if (i < 0 || (i < DOUBLE_MAX_DEVICES ? i >= g_config.devices : !g_pools[i].live)) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *out = &g_pools[i];
    return CUDA_SUCCESS;
}

/*
 * From `pool` (NULL: the default pool of the stream's GPU). On a capturing
 * stream, an alloc node of the capture's graph; else served by the pool's
 * retained bytes when there are enough, and charged as an allocation.
 */
static CUresult pool_alloc(CUdeviceptr *dptr, size_t size, CUmemoryPool pool, CUstream h,
                           int ptsz) {
    struct CUstream_st *s = NULL;
    struct CUmemPoolHandle_st *p = NULL;
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = stream_locked(h, ptsz, &s, &dev);
    if (rc == CUDA_SUCCESS && pool != NULL) {
        rc = pool_locked(pool, &p);
    } else if (rc == CUDA_SUCCESS) {
        p = &g_pools[dev];
    }
    if (rc == CUDA_SUCCESS && dptr == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS && s != NULL && s->capture != NULL) {
        rc = s->capture->invalidated
                 ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
                 : graph_alloc_node_locked(s->capture, p->device, size, dptr, NULL);
    } else if (rc == CUDA_SUCCESS) {
        struct device *d = &g_devices[p->device];
        CUcontext ctx = s != NULL && s->ctx != NULL ? s->ctx : t_current;
        unsigned long long reuse = size > 0 && p->retained >= size ? size : 0;
        p->retained -= reuse;
        rc = alloc_locked(p->device, ctx, size, KIND_POINTER, dptr);
        if (rc == CUDA_SUCCESS) {
            d->records[d->len - 1].pool = (unsigned char)(p - g_pools + 1);
            p->used += size;
        } else {
            p->retained += reuse;
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return pool_alloc(dptr, bytesize, NULL, hStream, 0);
}

CUresult impl_cuMemAllocAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUstream hStream) {
    return pool_alloc(dptr, bytesize, NULL, hStream, 1);
}

CUresult impl_cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                      CUstream hStream) {
    return pool_alloc(dptr, bytesize, pool, hStream, 0);
}

CUresult impl_cuMemAllocFromPoolAsync_ptsz(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool,
                                           CUstream hStream) {
    return pool_alloc(dptr, bytesize, pool, hStream, 1);
}

/*
 * On a capturing stream, a free node of a graph allocation; else the end of
 * an allocation's charge. A pool allocation's bytes stay with its pool
 * (retained) unless the pool's release threshold is 0.
 */
static CUresult pool_free(CUdeviceptr dptr, CUstream h, int ptsz) {
    struct CUstream_st *s = NULL;
    struct record *r;
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = stream_locked(h, ptsz, &s, &dev);
    if (rc == CUDA_SUCCESS && s != NULL && s->capture != NULL) {
        rc = s->capture->invalidated ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
                                     : graph_free_node_locked(s->capture, dptr, NULL);
        unlock();
        return rc;
    }
    unlock();
    if (rc != CUDA_SUCCESS) {
        return rc;
    }
    if (free_fails()) {
        return CUDA_ERROR_ILLEGAL_ADDRESS;
    }
    lock();
    r = find_locked(dptr, 1, &dev);
    if (r == NULL || !(r->kind & KIND_POINTER)) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        struct CUmemPoolHandle_st *p = r->pool ? &g_pools[r->pool - 1] : NULL;
        unsigned long long size = r->size;
        forget_locked(dev, r);
        tidy_locked(dev);
        if (p != NULL && p->live && p->threshold > 0) {
            p->retained += size;
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuMemFreeAsync(CUdeviceptr dptr, CUstream hStream) {
    return pool_free(dptr, hStream, 0);
}

CUresult impl_cuMemFreeAsync_ptsz(CUdeviceptr dptr, CUstream hStream) {
    return pool_free(dptr, hStream, 1);
}

CUresult impl_cuDeviceGetDefaultMemPool(CUmemoryPool *pool_out, CUdevice dev) {
    CUresult rc = check_device(dev);
    if (rc != CUDA_SUCCESS) {
        return rc;
    }
    if (pool_out == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *pool_out = &g_pools[dev];
    return CUDA_SUCCESS;
}

/* No cuDeviceSetMemPool: the current pool is the default one. */
CUresult impl_cuDeviceGetMemPool(CUmemoryPool *pool, CUdevice dev) {
    return impl_cuDeviceGetDefaultMemPool(pool, dev);
}

/* The release threshold (cuuint64_t) and the reuse flags (int, no effect). */
CUresult impl_cuMemPoolSetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
    struct CUmemPoolHandle_st *p = NULL;
    CUresult rc;
    lock();
    rc = pool_locked(pool, &p);
    if (rc == CUDA_SUCCESS && value == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS) {
        switch (attr) {
        case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
            p->threshold = *(const cuuint64_t *)value;
            break;
        case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
            p->reuse[attr - CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES] =
                *(const int *)value;
            break;
        default:
            rc = CUDA_ERROR_INVALID_VALUE;
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuMemPoolGetAttribute(CUmemoryPool pool, CUmemPool_attribute attr, void *value) {
    struct CUmemPoolHandle_st *p = NULL;
    CUresult rc;
    lock();
    rc = pool_locked(pool, &p);
    if (rc == CUDA_SUCCESS && value == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS) {
        switch (attr) {
        case CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
            *(cuuint64_t *)value = p->threshold;
            break;
        case CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT:
            *(cuuint64_t *)value = p->used + p->retained;
            break;
        case CU_MEMPOOL_ATTR_USED_MEM_CURRENT:
            *(cuuint64_t *)value = p->used;
            break;
        case CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES:
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC:
        case CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES:
            *(int *)value = p->reuse[attr - CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES];
            break;
        default:
            rc = CUDA_ERROR_INVALID_VALUE;
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuMemPoolTrimTo(CUmemoryPool pool, size_t minBytesToKeep) {
    struct CUmemPoolHandle_st *p = NULL;
    CUresult rc;
    lock();
    rc = pool_locked(pool, &p);
    if (rc == CUDA_SUCCESS) {
        pool_release_locked(p, minBytesToKeep);
    }
    unlock();
    return rc;
}

/* A pool on the device props names, with the default pool's settings. */
CUresult impl_cuMemPoolCreate(CUmemoryPool *pool, const CUmemPoolProps *props) {
    CUresult rc = CUDA_SUCCESS;
    int i;
    if (pool == NULL || props == NULL || props->location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (props->location.id < 0 || props->location.id >= g_config.devices) {
        rc = CUDA_ERROR_INVALID_DEVICE;
    } else {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        for (i = DOUBLE_MAX_DEVICES; i < DOUBLE_MAX_POOLS; i++) {
            struct CUmemPoolHandle_st *p = &g_pools[i];
            if (!p->live && p->used == 0) {
                memset(p, 0, sizeof *p);
                p->live = 1;
                p->device = props->location.id;
                p->reuse[0] = p->reuse[1] = p->reuse[2] = 1;
                *pool = p;
                rc = CUDA_SUCCESS;
                break;
            }
        }
    }
    unlock();
    return rc;
}

/* Gives a made pool's retained bytes back; its live allocations stay until
 * freed. A default pool cannot be destroyed. */
CUresult impl_cuMemPoolDestroy(CUmemoryPool pool) {
    struct CUmemPoolHandle_st *p = NULL;
    CUresult rc;
    lock();
    rc = pool_locked(pool, &p);
    if (rc == CUDA_SUCCESS && p - g_pools < DOUBLE_MAX_DEVICES) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS) {
        p->live = 0;
        p->retained = 0;
    }
    unlock();
    return rc;
}
