/*
 * Streams of the double (the model is in cuda.c): the stream a call names
 * (the legacy and per-thread default streams, created ones), stream capture
 * into a graph and the rules that break a capture, synchronize and query.
 */
#include "double_internal.h"

#define DOUBLE_MAX_STREAMS 256

static struct CUstream_st g_streams[DOUBLE_MAX_STREAMS];
/* The per-thread default stream of this thread (its capture state). */
static __thread struct CUstream_st t_per_thread = {1, 0, NULL, NULL};
/* This thread's capture interaction mode (cuThreadExchangeStreamCaptureMode). */
static __thread CUstreamCaptureMode t_capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL;
/* Its address identifies this thread as the owner of a capture. */
static __thread char t_thread_token;

static struct CUstream_st *created_stream_locked(CUstream s) {
    long i = SLOT(g_streams, s);
    return i >= 0 && g_streams[i].live ? &g_streams[i] : NULL;
}

/*
 * The stream a call names and the device it runs on. *out is NULL for the
 * legacy default stream (NULL without _ptsz, or CU_STREAM_LEGACY), this
 * thread's per-thread stream for NULL with _ptsz or CU_STREAM_PER_THREAD.
 * Needs an initialised driver and a current context.
 */
CUresult stream_locked(CUstream h, int ptsz, struct CUstream_st **out, CUdevice *dev) {
    CUresult rc = current_device_locked(dev);
    if (rc != CUDA_SUCCESS) {
        return rc;
    }
    if (h == NULL) {
        *out = ptsz ? &t_per_thread : NULL;
    } else if (h == CU_STREAM_LEGACY) {
        *out = NULL;
    } else if (h == CU_STREAM_PER_THREAD) {
        *out = &t_per_thread;
    } else {
        *out = created_stream_locked(h);
        if (*out == NULL) {
            return CUDA_ERROR_INVALID_HANDLE;
        }
        *dev = (*out)->device;
    }
    return CUDA_SUCCESS;
}

/*
 * The capture rules measured on driver 580 (CUDA 13): a potentially unsafe
 * call (event query/synchronize, stream query/synchronize) from this thread
 * is prohibited, unless the thread's interaction mode is RELAXED, while this
 * thread has a capture begun in another mode than RELAXED or another thread
 * one begun in GLOBAL mode. A prohibited call fails with
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and invalidates those captures.
 */
CUresult unsafe_call_locked(void) {
    CUresult rc = CUDA_SUCCESS;
    size_t i;
    if (t_capture_mode == CU_STREAM_CAPTURE_MODE_RELAXED) {
        return rc;
    }
    for (i = 0; i < DOUBLE_MAX_GRAPHS; i++) {
        struct CUgraph_st *g = &g_graphs[i];
        int own = g->owner == &t_thread_token;
        if (g->live && g->capturing &&
            ((own && g->mode != CU_STREAM_CAPTURE_MODE_RELAXED) ||
             (!own && g->mode == CU_STREAM_CAPTURE_MODE_GLOBAL))) {
            g->invalidated = 1;
            rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
        }
    }
    return rc;
}

/* Whatever the modes: synchronizing a context invalidates its captures. */
CUresult context_sync_locked(int dev) {
    CUresult rc = CUDA_SUCCESS;
    size_t i;
    for (i = 0; i < DOUBLE_MAX_GRAPHS; i++) {
        if (g_graphs[i].live && g_graphs[i].capturing && g_graphs[i].device == dev) {
            g_graphs[i].invalidated = 1;
            rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
        }
    }
    return rc;
}

/* ---------------------------------------------------------------- stream capture */

static CUresult begin_capture(CUstream h, CUstreamCaptureMode mode, int ptsz) {
    struct CUstream_st *s = NULL;
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = stream_locked(h, ptsz, &s, &dev);
    if (rc == CUDA_SUCCESS && mode != CU_STREAM_CAPTURE_MODE_GLOBAL &&
        mode != CU_STREAM_CAPTURE_MODE_THREAD_LOCAL && mode != CU_STREAM_CAPTURE_MODE_RELAXED) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS && s == NULL) {
        rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; /* the legacy stream cannot capture */
    } else if (rc == CUDA_SUCCESS && s->capture != NULL) {
        rc = CUDA_ERROR_ILLEGAL_STATE;
    } else if (rc == CUDA_SUCCESS) {
        struct CUgraph_st *g = graph_new_locked(dev);
        if (g == NULL) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            g->capturing = 1;
            g->mode = mode;
            g->owner = &t_thread_token;
            s->capture = g;
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuStreamBeginCapture_v2(CUstream hStream, CUstreamCaptureMode mode) {
    return begin_capture(hStream, mode, 0);
}

CUresult impl_cuStreamBeginCapture_v2_ptsz(CUstream hStream, CUstreamCaptureMode mode) {
    return begin_capture(hStream, mode, 1);
}

static CUresult end_capture(CUstream h, CUgraph *phGraph, int ptsz) {
    struct CUstream_st *s = NULL;
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = stream_locked(h, ptsz, &s, &dev);
    if (rc == CUDA_SUCCESS && phGraph == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS && (s == NULL || s->capture == NULL)) {
        rc = CUDA_ERROR_ILLEGAL_STATE; /* not capturing */
    } else if (rc == CUDA_SUCCESS && s->capture->invalidated) {
        graph_free_locked(s->capture); /* no graph comes out of a broken capture */
        s->capture = NULL;
        *phGraph = NULL;
        rc = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    } else if (rc == CUDA_SUCCESS) {
        s->capture->capturing = 0;
        *phGraph = s->capture;
        s->capture = NULL;
    }
    unlock();
    return rc;
}

CUresult impl_cuStreamEndCapture(CUstream hStream, CUgraph *phGraph) {
    return end_capture(hStream, phGraph, 0);
}

CUresult impl_cuStreamEndCapture_ptsz(CUstream hStream, CUgraph *phGraph) {
    return end_capture(hStream, phGraph, 1);
}

static CUresult is_capturing(CUstream h, CUstreamCaptureStatus *status, int ptsz) {
    struct CUstream_st *s = NULL;
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = stream_locked(h, ptsz, &s, &dev);
    if (rc == CUDA_SUCCESS && status == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS) {
        *status = s == NULL || s->capture == NULL ? CU_STREAM_CAPTURE_STATUS_NONE
                  : s->capture->invalidated       ? CU_STREAM_CAPTURE_STATUS_INVALIDATED
                                                  : CU_STREAM_CAPTURE_STATUS_ACTIVE;
    }
    unlock();
    return rc;
}

CUresult impl_cuThreadExchangeStreamCaptureMode(CUstreamCaptureMode *mode) {
    CUstreamCaptureMode old;
    if (mode == NULL) {
        return CUDA_ERROR_INVALID_VALUE; /* any value is taken, as by driver 580 */
    }
    old = t_capture_mode;
    t_capture_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

CUresult impl_cuStreamIsCapturing(CUstream hStream, CUstreamCaptureStatus *captureStatus) {
    return is_capturing(hStream, captureStatus, 0);
}

CUresult impl_cuStreamIsCapturing_ptsz(CUstream hStream, CUstreamCaptureStatus *captureStatus) {
    return is_capturing(hStream, captureStatus, 1);
}

/* ---------------------------------------------------------------- streams */

CUresult impl_cuStreamCreate(CUstream *phStream, unsigned int Flags) {
    CUdevice dev = 0;
    CUresult rc;
    size_t i;
    lock();
    rc = current_device_locked(&dev);
    if (rc == CUDA_SUCCESS && (phStream == NULL || (Flags & ~(unsigned)CU_STREAM_NON_BLOCKING))) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        for (i = 0; i < DOUBLE_MAX_STREAMS; i++) {
            if (!g_streams[i].live) {
                g_streams[i] = (struct CUstream_st){1, dev, NULL, t_current};
                *phStream = &g_streams[i];
                rc = CUDA_SUCCESS;
                break;
            }
        }
    }
    unlock();
    return rc;
}

/* A created stream's context; the current one for the default streams. */
static CUresult stream_get_ctx(CUstream h, CUcontext *pctx, int ptsz) {
    struct CUstream_st *s = NULL;
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = stream_locked(h, ptsz, &s, &dev);
    if (rc == CUDA_SUCCESS && pctx == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS) {
        *pctx = s != NULL && s->ctx != NULL ? s->ctx : t_current;
    }
    unlock();
    return rc;
}

CUresult impl_cuStreamGetCtx(CUstream hStream, CUcontext *pctx) {
    return stream_get_ctx(hStream, pctx, 0);
}

CUresult impl_cuStreamGetCtx_ptsz(CUstream hStream, CUcontext *pctx) {
    return stream_get_ctx(hStream, pctx, 1);
}

CUresult impl_cuStreamDestroy_v2(CUstream hStream) {
    CUresult rc = CUDA_SUCCESS;
    struct CUstream_st *s;
    lock();
    s = created_stream_locked(hStream);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (s == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        if (s->capture != NULL) {
            graph_free_locked(s->capture); /* the capture is abandoned */
        }
        s->live = 0;
        s->capture = NULL;
    }
    unlock();
    return rc;
}

/*
 * When the work submitted so far on the stream h completes (one timeline per
 * device: all of the device's work). Waiting for a capturing stream breaks
 * its capture, in any mode; for another, the capture rules apply. A
 * synchronize (settle) lets the device's pool release what it holds over
 * its threshold.
 */
static CUresult stream_done_at(CUstream h, int ptsz, unsigned long long *at, int settle) {
    struct CUstream_st *s = NULL;
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = stream_locked(h, ptsz, &s, &dev);
    if (rc == CUDA_SUCCESS && s != NULL && s->capture != NULL) {
        s->capture->invalidated = 1;
        rc = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    } else if (rc == CUDA_SUCCESS) {
        rc = unsafe_call_locked();
    }
    if (rc == CUDA_SUCCESS) {
        *at = device_busy_until(dev);
        if (settle) {
            pool_settle_locked(dev);
        }
    }
    unlock();
    return rc;
}

static CUresult stream_synchronize(CUstream h, int ptsz) {
    unsigned long long at = 0;
    CUresult rc = stream_done_at(h, ptsz, &at, 1);
    if (rc == CUDA_SUCCESS && at > now_ns()) {
        sleep_until(at);
    }
    return rc;
}

static CUresult stream_query(CUstream h, int ptsz) {
    unsigned long long at = 0;
    CUresult rc = stream_done_at(h, ptsz, &at, 0);
    if (rc == CUDA_SUCCESS && at > now_ns()) {
        rc = CUDA_ERROR_NOT_READY;
    }
    return rc;
}

CUresult impl_cuStreamSynchronize(CUstream hStream) {
    return stream_synchronize(hStream, 0);
}

CUresult impl_cuStreamSynchronize_ptsz(CUstream hStream) {
    return stream_synchronize(hStream, 1);
}

CUresult impl_cuStreamQuery(CUstream hStream) {
    return stream_query(hStream, 0);
}

CUresult impl_cuStreamQuery_ptsz(CUstream hStream) {
    return stream_query(hStream, 1);
}
