/*
 * Contexts of the double (the model is in cuda.c): one primary context per
 * GPU, reference counted; up to DOUBLE_MAX_CREATED created ones, green ones
 * included; what a live context charges on its GPU; the current context of
 * each thread; the context limits of each GPU.
 */
#include "double_internal.h"

#define DOUBLE_MAX_CREATED 64

struct CUctx_st g_primary[DOUBLE_MAX_DEVICES];
static struct CUctx_st g_created[DOUBLE_MAX_CREATED];

/* A new context on dev (green or not): its bytes, if they fit. */
static CUresult context_up_locked(int dev, int green) {
    if (!fits(dev, green ? g_config.green_context_bytes : g_config.context_bytes)) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    g_devices[dev].live_contexts++;
    g_devices[dev].live_green += green ? 1 : 0;
    return CUDA_SUCCESS;
}

static void context_down_locked(CUcontext ctx) {
    struct device *d = &g_devices[ctx->device];
    size_t i;
    for (i = 0; i < d->len; i++) {
        if (d->records[i].live && d->records[i].ctx == ctx) {
            forget_locked(ctx->device, &d->records[i]);
        }
    }
    tidy_locked(ctx->device);
    unload_context_modules_locked(ctx);
    d->live_green -= ctx->green ? 1 : 0;
    if (--d->live_contexts == 0) {
        /* What only the driver keeps for the GPU goes with its last context. */
        reset_limits(d);
        d->graph_retained = 0;
        pools_forget_retained(ctx->device);
    }
}

CUresult impl_cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
    CUresult rc = CUDA_SUCCESS;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (pctx == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (!valid_device(dev)) {
        rc = CUDA_ERROR_INVALID_DEVICE;
    } else if (g_primary[dev].refs > 0 || (rc = context_up_locked(dev, 0)) == CUDA_SUCCESS) {
        g_primary[dev].refs++;
        *pctx = &g_primary[dev];
    }
    unlock();
    return rc;
}

CUresult impl_cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    CUresult rc = CUDA_SUCCESS;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (!valid_device(dev)) {
        rc = CUDA_ERROR_INVALID_DEVICE;
    } else if (g_primary[dev].refs == 0) {
        rc = CUDA_ERROR_INVALID_CONTEXT;
    } else if (--g_primary[dev].refs == 0) {
        context_down_locked(&g_primary[dev]);
    }
    unlock();
    return rc;
}

/* A created context on dev in *pctx, made current when `current`. */
/* A created context on dev; a green one is not made current. */
static CUresult create_context(CUcontext *pctx, CUdevice dev, int green) {
    CUresult rc = CUDA_ERROR_OUT_OF_MEMORY;
    int i;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (pctx == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (!valid_device(dev)) {
        rc = CUDA_ERROR_INVALID_DEVICE;
    } else {
        for (i = 0; i < DOUBLE_MAX_CREATED; i++) {
            if (g_created[i].refs == 0) {
                rc = context_up_locked(dev, green);
                if (rc == CUDA_SUCCESS) {
                    g_created[i].device = dev;
                    g_created[i].primary = 0;
                    g_created[i].green = green;
                    g_created[i].refs = 1;
                    *pctx = &g_created[i];
                    if (!green) {
                        t_current = &g_created[i];
                    }
                }
                break;
            }
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev) {
    (void)flags;
    return create_context(pctx, dev, 0);
}

/*
 * A green context is a created context that is not made current; any
 * resource descriptor is accepted (the double has no SM partitions).
 */
CUresult impl_cuGreenCtxCreate(CUgreenCtx *phCtx, CUdevResourceDesc desc, CUdevice dev,
                               unsigned int flags) {
    (void)desc;
    (void)flags;
    return create_context((CUcontext *)phCtx, dev, 1);
}

static int is_created_context(CUcontext ctx) {
    uintptr_t p = (uintptr_t)ctx;
    uintptr_t base = (uintptr_t)&g_created[0];
    return p >= base && p < (uintptr_t)&g_created[DOUBLE_MAX_CREATED] &&
           (p - base) % sizeof g_created[0] == 0;
}

static int is_primary_context(CUcontext ctx) {
    uintptr_t p = (uintptr_t)ctx;
    uintptr_t base = (uintptr_t)&g_primary[0];
    return p >= base && p < (uintptr_t)&g_primary[DOUBLE_MAX_DEVICES] &&
           (p - base) % sizeof g_primary[0] == 0;
}

CUresult impl_cuCtxDestroy_v2(CUcontext ctx) {
    CUresult rc = CUDA_SUCCESS;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (!is_created_context(ctx) || ctx->refs == 0) {
        rc = CUDA_ERROR_INVALID_CONTEXT; /* primary contexts are released, not destroyed */
    } else {
        ctx->refs = 0;
        context_down_locked(ctx);
        if (t_current == ctx) {
            t_current = NULL;
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuGreenCtxDestroy(CUgreenCtx hCtx) {
    return impl_cuCtxDestroy_v2((CUcontext)hCtx);
}

CUresult impl_cuCtxSetCurrent(CUcontext ctx) {
    CUresult rc = CUDA_SUCCESS;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (ctx != NULL && !((is_primary_context(ctx) || is_created_context(ctx)) &&
                                context_alive(ctx))) {
        rc = CUDA_ERROR_INVALID_CONTEXT;
    } else {
        t_current = ctx;
    }
    unlock();
    return rc;
}

CUresult impl_cuCtxGetCurrent(CUcontext *pctx) {
    CUresult rc = CUDA_SUCCESS;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (pctx == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        *pctx = t_current;
    }
    unlock();
    return rc;
}

CUresult impl_cuCtxGetDevice(CUdevice *device) {
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = current_device_locked(&dev);
    unlock();
    if (rc == CUDA_SUCCESS) {
        if (device == NULL) {
            return CUDA_ERROR_INVALID_VALUE;
        }
        *device = dev;
    }
    return rc;
}

/* Sleeps until the device's simulated timeline has drained. */
CUresult impl_cuCtxSynchronize(void) {
    CUdevice dev = 0;
    CUresult rc;
    unsigned long long at = 0;
    lock();
    rc = current_device_locked(&dev);
    if (rc == CUDA_SUCCESS) {
        rc = context_sync_locked(dev);
    }
    if (rc == CUDA_SUCCESS) {
        at = device_busy_until(dev);
        pool_settle_locked(dev);
    }
    unlock();
    if (at > now_ns()) {
        sleep_until(at);
    }
    return rc;
}

/* Limits of the current context's GPU; those with a cost hold it while set. */
CUresult impl_cuCtxSetLimit(CUlimit limit, size_t value) {
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = current_device_locked(&dev);
    if (rc == CUDA_SUCCESS && (unsigned)limit >= CU_LIMIT_MAX) {
        rc = CUDA_ERROR_UNSUPPORTED_LIMIT;
    } else if (rc == CUDA_SUCCESS) {
        struct device *d = &g_devices[dev];
        size_t old = d->limits[limit];
        unsigned long long before = limit_bytes(d->limits), after;
        d->limits[limit] = value;
        after = limit_bytes(d->limits);
        d->limits[limit] = old;
        /* The check runs with the old limit charged, so it asks only for the growth. */
        if (after > before && !fits(dev, after - before)) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            d->limits[limit] = value;
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuCtxGetLimit(size_t *pvalue, CUlimit limit) {
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = current_device_locked(&dev);
    if (rc == CUDA_SUCCESS && pvalue == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS && (unsigned)limit >= CU_LIMIT_MAX) {
        rc = CUDA_ERROR_UNSUPPORTED_LIMIT;
    } else if (rc == CUDA_SUCCESS) {
        *pvalue = g_devices[dev].limits[limit];
    }
    unlock();
    return rc;
}
