/*
 * Events of the double (the model is in cuda.c): a record stamps the time
 * all work submitted so far on the device completes; queries, synchronize
 * and elapsed time read that stamp against the simulated clock; a stream's
 * wait for an event checks its handles only.
 */
#include "double_internal.h"

#define DOUBLE_MAX_EVENTS 4096

struct CUevent_st {
    int live;
    int recorded;
    unsigned flags;
    int device;            /* where it was created, then last recorded */
    unsigned long long at; /* when the work captured by the last record completes */
};

static struct CUevent_st g_events[DOUBLE_MAX_EVENTS];

static struct CUevent_st *event_locked(CUevent e) {
    long i = SLOT(g_events, e);
    return i >= 0 && g_events[i].live ? &g_events[i] : NULL;
}

CUresult impl_cuEventCreate(CUevent *phEvent, unsigned int Flags) {
    const unsigned known = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
    CUdevice dev = 0;
    CUresult rc;
    size_t i;
    lock();
    rc = current_device_locked(&dev);
    if (rc == CUDA_SUCCESS &&
        (phEvent == NULL || (Flags & ~known) != 0 ||
         ((Flags & CU_EVENT_INTERPROCESS) && !(Flags & CU_EVENT_DISABLE_TIMING)))) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        for (i = 0; i < DOUBLE_MAX_EVENTS; i++) {
            if (!g_events[i].live) {
                g_events[i] = (struct CUevent_st){1, 0, Flags, dev, 0};
                *phEvent = &g_events[i];
                rc = CUDA_SUCCESS;
                break;
            }
        }
    }
    unlock();
    return rc;
}

/* Records the completion time of all work submitted so far on the device. */
static CUresult event_record(CUevent hEvent, CUstream h, int ptsz) {
    struct CUstream_st *s = NULL;
    struct CUevent_st *e;
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = stream_locked(h, ptsz, &s, &dev);
    e = event_locked(hEvent);
    if (rc == CUDA_SUCCESS && e == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if (rc == CUDA_SUCCESS && s != NULL && s->capture != NULL) {
        /* Into a capturing stream: a node of the graph; the event is left as it was. */
        if (s->capture->invalidated) {
            rc = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
        }
    } else if (rc == CUDA_SUCCESS) {
        e->recorded = 1;
        e->device = dev;
        e->at = drained_at_locked(dev, now_ns());
        event_recorded_locked(dev);
    }
    unlock();
    return rc;
}

CUresult impl_cuEventRecord(CUevent hEvent, CUstream hStream) {
    return event_record(hEvent, hStream, 0);
}

CUresult impl_cuEventRecord_ptsz(CUevent hEvent, CUstream hStream) {
    return event_record(hEvent, hStream, 1);
}

/* One timeline per device already orders all of a device's work, so a wait
 * only checks its handles; into a capturing stream it adds no node. */
static CUresult stream_wait_event(CUstream h, CUevent hEvent, unsigned Flags, int ptsz) {
    struct CUstream_st *s = NULL;
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = stream_locked(h, ptsz, &s, &dev);
    if (rc == CUDA_SUCCESS && event_locked(hEvent) == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if (rc == CUDA_SUCCESS && (Flags & ~(unsigned)CU_EVENT_WAIT_EXTERNAL) != 0) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS && s != NULL && s->capture != NULL &&
               s->capture->invalidated) {
        rc = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    }
    unlock();
    return rc;
}

CUresult impl_cuStreamWaitEvent(CUstream hStream, CUevent hEvent, unsigned int Flags) {
    return stream_wait_event(hStream, hEvent, Flags, 0);
}

CUresult impl_cuStreamWaitEvent_ptsz(CUstream hStream, CUevent hEvent, unsigned int Flags) {
    return stream_wait_event(hStream, hEvent, Flags, 1);
}

/* The completion time of the event's last record; 0 when never recorded. A
 * synchronize (settle) lets the event's device's pool release what it holds
 * over its threshold. */
static CUresult event_at(CUevent hEvent, unsigned long long *at, int settle) {
    struct CUevent_st *e;
    CUresult rc = CUDA_SUCCESS;
    lock();
    e = event_locked(hEvent);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (e == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if ((rc = unsafe_call_locked()) == CUDA_SUCCESS) {
        *at = e->recorded ? e->at : 0;
        if (settle) {
            pool_settle_locked(e->device);
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuEventQuery(CUevent hEvent) {
    unsigned long long at = 0;
    CUresult rc = event_at(hEvent, &at, 0);
    if (rc == CUDA_SUCCESS && at > now_ns()) {
        rc = CUDA_ERROR_NOT_READY;
    }
    return rc;
}

CUresult impl_cuEventSynchronize(CUevent hEvent) {
    unsigned long long at = 0;
    CUresult rc = event_at(hEvent, &at, 1);
    if (rc == CUDA_SUCCESS && at > now_ns()) {
        sleep_until(at);
    }
    return rc;
}

CUresult impl_cuEventElapsedTime_v2(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
    struct CUevent_st *start, *end;
    CUresult rc = CUDA_SUCCESS;
    unsigned long long now = now_ns();
    lock();
    start = event_locked(hStart);
    end = event_locked(hEnd);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (pMilliseconds == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (start == NULL || end == NULL || !start->recorded || !end->recorded ||
               ((start->flags | end->flags) & CU_EVENT_DISABLE_TIMING)) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if (start->at > now || end->at > now) {
        rc = CUDA_ERROR_NOT_READY;
    } else {
        *pMilliseconds = (float)((double)((long long)(end->at - start->at)) / 1e6);
    }
    unlock();
    return rc;
}

CUresult impl_cuEventElapsedTime(float *pMilliseconds, CUevent hStart, CUevent hEnd) {
    return impl_cuEventElapsedTime_v2(pMilliseconds, hStart, hEnd);
}

CUresult impl_cuEventDestroy_v2(CUevent hEvent) {
    struct CUevent_st *e;
    CUresult rc = CUDA_SUCCESS;
    lock();
    e = event_locked(hEvent);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (e == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        e->live = 0;
    }
    unlock();
    return rc;
}
