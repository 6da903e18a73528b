/* How long a process's kernels ran on the GPU, by CUPTI's kernel records
 * (each kernel's start and end, GPU timestamps in ns): for the packing
 * bench's inference step, whose kernels leave the GPU idle between them
 * for spans no sampling reading resolves. Loaded with ctypes into the
 * process it measures (scripts/bench/packing_infer.py), before CUDA
 * starts, and built by the bench with nvcc against the CUPTI beside
 * PyTorch or the CUDA toolkit's (its header and library from one place).
 *
 *   kt_start()          kernel records on: 0, else CUPTI's error
 *   kt_now()            CUPTI's clock, the records' timebase (ns)
 *   kt_window(t0, t1)   the window that the counts below count in, from zero
 *   kt_stop()           flushes every record (the kernels must have ended), records off
 *   kt_kernels(), kt_kernel_ns(), kt_dropped()
 *   kt_gaps(counts, ns, bounds)  the gaps between kernels in the window, by length
 *   kt_write_spans(path)  the window's spans (below) to a file: 0, else -1
 *
 * kt_kernel_ns: the time inside the window in which one of the process's
 * kernels ran (records are taken in a stream's order; the inference step
 * has one). A gap: from one kernel's end to the next one's start, the
 * GPU's move from one to the next (a few microseconds where the next was
 * queued) or the host's time to launch it.
 *
 * A span: kernels that ran back to back, joined across the gaps of up to
 * 3 us between them, inside the window (so the spans' time is kernel_ns
 * and the short gaps' time). kt_write_spans writes them as pairs of
 * little-endian uint64, start and end, on CUPTI's clock, which is the
 * same in every process: the bench lays the pods' spans over each other
 * and sees where one pod's kernel went on while another's ran. */
#include <cupti.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define BUFFER_BYTES (8u << 20)

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t window_start, window_end = UINT64_MAX, last_end;
static uint64_t kernels, kernel_ns, dropped;
/* The gaps between one kernel's end and the next one's start, in the
 * window: how many and their time, by length (upper bounds, ns). */
#define GAP_BUCKETS 10
#define SHORT_GAP_NS 3000 /* the GPU's move to a kernel it had queued: spans join across it */
static const uint64_t gap_bounds[GAP_BUCKETS] = {500,  1000,  1500,  2000,  SHORT_GAP_NS,
                                                 5000, 10000, 20000, 50000, UINT64_MAX};
static uint64_t gap_count[GAP_BUCKETS], gap_ns[GAP_BUCKETS];
static uint64_t *spans; /* start, end, start, end, ... */
static size_t span_count, span_room;
static uint64_t span_lost; /* spans that found no room: none are written then */

/* Adds [from, to) to the spans, joined to the last one across a short gap. */
static void add_span(uint64_t from, uint64_t to) {
    if (span_count && from <= spans[2 * span_count - 1] + SHORT_GAP_NS) {
        if (to > spans[2 * span_count - 1])
            spans[2 * span_count - 1] = to;
        return;
    }
    if (span_count == span_room) {
        size_t room = span_room ? 2 * span_room : 4096;
        uint64_t *more = realloc(spans, room * 2 * sizeof *spans);
        if (!more) {
            span_lost++;
            return;
        }
        spans = more;
        span_room = room;
    }
    spans[2 * span_count] = from;
    spans[2 * span_count + 1] = to;
    span_count++;
}

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *buffer = aligned_alloc(ACTIVITY_RECORD_ALIGNMENT, BUFFER_BYTES);
    *size = *buffer ? BUFFER_BYTES : 0;
    *max_records = 0;
}

/* The length of [from, to) inside the window. */
static uint64_t inside(uint64_t from, uint64_t to) {
    if (from < window_start)
        from = window_start;
    if (to > window_end)
        to = window_end;
    return to > from ? to - from : 0;
}

static void count(const CUpti_ActivityKernel10 *k) {
    if (k->end <= k->start)
        return;
    uint64_t from = k->start > last_end ? k->start : last_end;
    uint64_t ran = k->end > from ? inside(from, k->end) : 0;
    if (ran) {
        kernels++;
        kernel_ns += ran;
        uint64_t a = from > window_start ? from : window_start;
        add_span(a, a + ran);
    }
    uint64_t gap = k->start > last_end && last_end ? inside(last_end, k->start) : 0;
    if (gap) {
        int b = 0;
        while (k->start - last_end > gap_bounds[b])
            b++;
        gap_count[b]++;
        gap_ns[b] += gap;
    }
    if (k->end > last_end)
        last_end = k->end;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
                                      size_t valid) {
    (void)size;
    CUpti_Activity *record = NULL;
    pthread_mutex_lock(&lock);
    while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
        if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL)
            count((const CUpti_ActivityKernel10 *)record);
    }
    size_t lost = 0;
    if (cuptiActivityGetNumDroppedRecords(ctx, stream, &lost) == CUPTI_SUCCESS)
        dropped += lost;
    pthread_mutex_unlock(&lock);
    free(buffer);
}

int kt_start(void) {
    CUptiResult rc = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
    if (rc == CUPTI_SUCCESS)
        rc = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    return (int)rc;
}

uint64_t kt_now(void) {
    uint64_t t = 0;
    return cuptiGetTimestamp(&t) == CUPTI_SUCCESS ? t : 0;
}

void kt_window(uint64_t t0, uint64_t t1) {
    pthread_mutex_lock(&lock);
    window_start = t0;
    window_end = t1;
    kernels = kernel_ns = dropped = span_lost = 0;  /* what came before counted in no window */
    span_count = 0;
    for (int b = 0; b < GAP_BUCKETS; b++)
        gap_count[b] = gap_ns[b] = 0;
    pthread_mutex_unlock(&lock);
}

int kt_stop(void) {
    CUptiResult rc = cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    CUptiResult off = cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    return (int)(rc != CUPTI_SUCCESS ? rc : off);
}

static uint64_t read_locked(const uint64_t *value) {
    pthread_mutex_lock(&lock);
    uint64_t v = *value;
    pthread_mutex_unlock(&lock);
    return v;
}

uint64_t kt_kernels(void) { return read_locked(&kernels); }
uint64_t kt_kernel_ns(void) { return read_locked(&kernel_ns); }
uint64_t kt_dropped(void) { return read_locked(&dropped); }

/* The gaps' counts and time by bucket (GAP_BUCKETS of each); the buckets. */
int kt_gaps(uint64_t *counts, uint64_t *ns, uint64_t *bounds) {
    pthread_mutex_lock(&lock);
    for (int b = 0; b < GAP_BUCKETS; b++) {
        counts[b] = gap_count[b];
        ns[b] = gap_ns[b];
        bounds[b] = gap_bounds[b];
    }
    pthread_mutex_unlock(&lock);
    return GAP_BUCKETS;
}

int kt_write_spans(const char *path) {
    pthread_mutex_lock(&lock);
    FILE *f = span_lost ? NULL : fopen(path, "wb");
    int rc = f && fwrite(spans, 2 * sizeof *spans, span_count, f) == span_count ? 0 : -1;
    if (f && fclose(f) != 0)
        rc = -1;
    pthread_mutex_unlock(&lock);
    return rc;
}
