/*
 * The checkpoint API of the double (the model is in cuda.c), across
 * processes. A target process (GPUSHARE_DOUBLE_CHECKPOINT_DIR set at its
 * first cuInit) creates its control block, the file <dir>/<pid>, and one
 * service thread; a caller (cuCheckpointProcess*, in another process whose
 * GPUSHARE_DOUBLE_CHECKPOINT_DIR names the same folder) maps the file,
 * writes a request into it and waits for the reply.
 *
 * The control block: a MAP_SHARED page, little-endian, every field read and
 * written with __atomic builtins. Tests read the first part; its offsets
 * stay as they are (a change bumps the version):
 *
 *   offset size  field
 *        0    8  magic         "GSDCKPT1" (written last, once the service runs,
 *                              before cuInit returns)
 *        8    4  version       1
 *       12    4  state         CUprocessState: 0 running, 1 locked, 2 checkpointed
 *       16    8  host_bytes    bytes the last checkpoint moved to the host, until restored
 *       24  128  device_bytes  u64[16], by CUDA ordinal: what the process holds on
 *                              the device now (contexts, allocations, driver-held;
 *                              0 while checkpointed)
 *      152   64  gpu           u32[16], by CUDA ordinal: the fake GPU it runs on (the
 *                              last byte of its UUID, its NVML index); ~0 past the
 *                              process's devices
 *      216    4  pid           the target
 *      220    4  restore_tid   its service thread (cuCheckpointProcessGetRestoreThreadId)
 *      224    8  start_time    its start, /proc/<pid>/stat field 22: a reused pid differs
 *      232  128  moved_bytes   u64[16], by ordinal: what the last checkpoint moved off it
 *                              (0 again once restored)
 *      360    4  devices       the process's CUDA device count
 *
 * Then the request slot, the protocol between caller and service thread:
 *
 *      368    4  caller        thread id of the caller holding the slot, 0 free
 *      372    4  request       futex word: 0 idle, 1 posted, 2 taken, 3 done
 *      376    4  op            1 lock, 2 checkpoint, 3 restore, 4 unlock
 *      380    4  result        the CUresult of a done request
 *      384    8  deadline_ns   CLOCK_MONOTONIC; a lock taken later times out (0: none)
 *      392    4  pair_count    restore: the gpu pairs that follow
 *      400  512  pairs         16 x {old UUID, new UUID}
 *
 * A caller takes the slot (compare-and-swap of `caller`; a dead holder's is
 * taken over), writes op and arguments, sets request to posted and wakes
 * the futex; the service thread swaps posted for taken, serves, writes the
 * result and sets done; the caller reads it, sets idle and frees the slot.
 * A caller whose deadline passes while its request is still posted swaps it
 * back to idle: the request never ran. Waits are futex waits of at most
 * 10 ms, between which the caller checks that the target still lives.
 */
#include "double_internal.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define CKPT_DIR_VAR "GPUSHARE_DOUBLE_CHECKPOINT_DIR"
#define CKPT_MAGIC 0x3154504b43445347ULL /* "GSDCKPT1" */
#define CKPT_VERSION 1U
#define CKPT_FILE_SIZE 4096
#define CKPT_SLOTS 16
#define CKPT_MAX_PAIRS 16
#define CKPT_NO_GPU 0xFFFFFFFFU
/* How long a caller waits without a lock timeout, and then for a request
 * the target has taken. */
#define CKPT_WAIT_NS (30ULL * 1000000000ULL)
#define CKPT_POLL_NS 10000000ULL

enum ckpt_op { OP_LOCK = 1, OP_CHECKPOINT = 2, OP_RESTORE = 3, OP_UNLOCK = 4 };
enum ckpt_request { REQ_IDLE = 0, REQ_POSTED = 1, REQ_TAKEN = 2, REQ_DONE = 3 };

struct ckpt_pair {
    unsigned char old_uuid[16];
    unsigned char new_uuid[16];
};

struct ckpt_block {
    uint64_t magic;
    uint32_t version;
    uint32_t state;
    uint64_t host_bytes;
    uint64_t device_bytes[CKPT_SLOTS];
    uint32_t gpu[CKPT_SLOTS];
    int32_t pid;
    int32_t restore_tid;
    uint64_t start_time;
    uint64_t moved_bytes[CKPT_SLOTS];
    uint32_t devices;
    uint32_t reserved0;
    uint32_t caller;
    uint32_t request;
    uint32_t op;
    int32_t result;
    uint64_t deadline_ns;
    uint32_t pair_count;
    uint32_t reserved1;
    struct ckpt_pair pairs[CKPT_MAX_PAIRS];
};

/* The layout table above, checked. */
_Static_assert(offsetof(struct ckpt_block, version) == 8, "version");
_Static_assert(offsetof(struct ckpt_block, state) == 12, "state");
_Static_assert(offsetof(struct ckpt_block, host_bytes) == 16, "host_bytes");
_Static_assert(offsetof(struct ckpt_block, device_bytes) == 24, "device_bytes");
_Static_assert(offsetof(struct ckpt_block, gpu) == 152, "gpu");
_Static_assert(offsetof(struct ckpt_block, pid) == 216, "pid");
_Static_assert(offsetof(struct ckpt_block, restore_tid) == 220, "restore_tid");
_Static_assert(offsetof(struct ckpt_block, start_time) == 224, "start_time");
_Static_assert(offsetof(struct ckpt_block, moved_bytes) == 232, "moved_bytes");
_Static_assert(offsetof(struct ckpt_block, devices) == 360, "devices");
_Static_assert(offsetof(struct ckpt_block, caller) == 368, "caller");
_Static_assert(offsetof(struct ckpt_block, request) == 372, "request");
_Static_assert(offsetof(struct ckpt_block, op) == 376, "op");
_Static_assert(offsetof(struct ckpt_block, result) == 380, "result");
_Static_assert(offsetof(struct ckpt_block, deadline_ns) == 384, "deadline_ns");
_Static_assert(offsetof(struct ckpt_block, pair_count) == 392, "pair_count");
_Static_assert(offsetof(struct ckpt_block, pairs) == 400, "pairs");
_Static_assert(sizeof(struct ckpt_block) <= CKPT_FILE_SIZE, "one page");
_Static_assert(DOUBLE_MAX_DEVICES <= CKPT_SLOTS, "a slot per ordinal");

#define LOAD(field) __atomic_load_n(&(field), __ATOMIC_ACQUIRE)
#define STORE(field, value) __atomic_store_n(&(field), (value), __ATOMIC_RELEASE)

static long futex(uint32_t *word, int op, uint32_t value, const struct timespec *timeout) {
    return syscall(SYS_futex, word, op, value, timeout, NULL, 0);
}

/* Sleeps while *word == value, at most ns. */
static void futex_wait(uint32_t *word, uint32_t value, unsigned long long ns) {
    struct timespec timeout = {(time_t)(ns / 1000000000ULL), (long)(ns % 1000000000ULL)};
    futex(word, FUTEX_WAIT, value, &timeout);
}

static void futex_wake(uint32_t *word) {
    futex(word, FUTEX_WAKE, INT_MAX, NULL);
}

static uint32_t thread_id(void) {
    return (uint32_t)syscall(SYS_gettid);
}

/*
 * What /proc/<pid>/stat says of a process: 1 alive (its start time in
 * *start), 0 gone or a zombie, -1 unreadable.
 */
int proc_stat(int pid, unsigned long long *start) {
    char path[64], text[1024], *field;
    ssize_t len;
    int fd, i;
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return errno == ENOENT ? 0 : -1;
    }
    len = read(fd, text, sizeof text - 1);
    close(fd);
    if (len <= 0) {
        return -1;
    }
    text[len] = '\0';
    field = strrchr(text, ')'); /* the name may hold anything */
    if (field == NULL || field[1] != ' ') {
        return -1;
    }
    field += 2; /* field 3: the state */
    if (*field == 'Z' || *field == 'X' || *field == 'x') {
        return 0;
    }
    for (i = 3; i < 22 && field != NULL; i++) {
        field = strchr(field, ' ');
        field = field != NULL ? field + 1 : NULL;
    }
    *start = field != NULL ? strtoull(field, NULL, 10) : 0;
    return 1;
}

/* Whether the process pid that started at start_time (0: any) still runs,
 * not a zombie nor a reused pid; node.c judges its table's owners so too. */
int process_alive(int pid, unsigned long long start_time) {
    unsigned long long start = 0;
    switch (proc_stat(pid, &start)) {
    case 1:
        return start_time == 0 || start == start_time;
    case 0:
        return 0;
    default:
        return kill(pid, 0) == 0 || errno == EPERM;
    }
}

/* ================================================================ the target */

static struct ckpt_block *g_block; /* under g_lock; NULL: checkpointing is off */
/* The service thread's own (only it serves requests). */
static unsigned long long g_us_per_gib;
static unsigned long long g_fail_restores;
static int g_held[DOUBLE_MAX_DEVICES]; /* ordinals the last checkpoint took */

void checkpoint_publish_locked(void) {
    struct ckpt_block *b = g_block;
    int dev;
    if (b == NULL) {
        return;
    }
    for (dev = 0; dev < g_config.devices; dev++) {
        STORE(b->device_bytes[dev], g_devices[dev].parked ? 0 : used_bytes(dev));
        STORE(b->gpu[dev], (uint32_t)device_gpu(dev));
    }
}

/* The service thread sleeps this long per GiB it moves. */
static void pause_for(unsigned long long bytes) {
    if (g_us_per_gib > 0 && bytes > 0) {
        double ns = (double)bytes / (double)(1ULL << 30) * (double)g_us_per_gib * 1000.0;
        sleep_until(now_ns() + (unsigned long long)ns);
    }
}

static CUresult serve_lock(struct ckpt_block *b) {
    unsigned long long deadline = LOAD(b->deadline_ns);
    if (LOAD(b->state) != CU_PROCESS_STATE_RUNNING) {
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    if (deadline != 0 && now_ns() >= deadline) {
        return CUDA_ERROR_TIMEOUT; /* left running, as the driver does */
    }
    /* Calls under way finish first: they hold g_lock; later ones wait in lock(). */
    lock_raw();
    freeze_locked(1);
    STORE(b->state, CU_PROCESS_STATE_LOCKED);
    unlock();
    return CUDA_SUCCESS;
}

static CUresult serve_unlock(struct ckpt_block *b) {
    if (LOAD(b->state) != CU_PROCESS_STATE_LOCKED) {
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    lock_raw();
    freeze_locked(0);
    STORE(b->state, CU_PROCESS_STATE_RUNNING);
    unlock();
    return CUDA_SUCCESS;
}

/* Device by device: each one's charges go to the host, its figures to 0. */
static CUresult serve_checkpoint(struct ckpt_block *b) {
    int dev, managed;
    if (LOAD(b->state) != CU_PROCESS_STATE_LOCKED) {
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    lock_raw();
    managed = managed_live_locked();
    unlock();
    if (managed) {
        return CUDA_ERROR_NOT_SUPPORTED; /* and it stays locked */
    }
    for (dev = 0; dev < g_config.devices; dev++) {
        unsigned long long bytes;
        lock_raw();
        bytes = used_bytes(dev);
        g_held[dev] = bytes > 0 || g_devices[dev].live_contexts > 0;
        unlock();
        pause_for(bytes);
        lock_raw();
        g_devices[dev].parked = 1;
        STORE(b->moved_bytes[dev], bytes);
        STORE(b->host_bytes, LOAD(b->host_bytes) + bytes);
        unlock();
    }
    STORE(b->state, CU_PROCESS_STATE_CHECKPOINTED);
    return CUDA_SUCCESS;
}

static int uuid_is(int gpu, const unsigned char uuid[16]) {
    unsigned char bytes[16];
    double_uuid_bytes(gpu, bytes);
    return memcmp(bytes, uuid, sizeof bytes) == 0;
}

/*
 * The GPU each ordinal runs on after a restore with these pairs, which map
 * GPUs (by UUID) to GPUs of the machine, as the driver takes them: each
 * GPU named once as old and once as new (a permutation: the driver refuses
 * one GPU onto another alone, and takes the two exchanged, whether or not
 * the process sees both), every GPU a checkpointed ordinal ran on among
 * them.
 */
static CUresult plan_locked(const struct ckpt_pair *pairs, unsigned count, int *gpu) {
    int old_gpu[CKPT_MAX_PAIRS], new_gpu[CKPT_MAX_PAIRS];
    int dev, g;
    unsigned i, j;
    for (i = 0; i < count; i++) {
        old_gpu[i] = new_gpu[i] = -1;
        for (g = 0; g < physical_devices(); g++) {
            if (uuid_is(g, pairs[i].old_uuid)) {
                old_gpu[i] = g;
            }
            if (uuid_is(g, pairs[i].new_uuid)) {
                new_gpu[i] = g;
            }
        }
        if (old_gpu[i] < 0 || new_gpu[i] < 0) {
            return CUDA_ERROR_INVALID_VALUE;
        }
        for (j = 0; j < i; j++) {
            if (old_gpu[j] == old_gpu[i] || new_gpu[j] == new_gpu[i]) {
                return CUDA_ERROR_INVALID_VALUE;
            }
        }
    }
    /* Every new GPU is an old one too. */
    for (i = 0; i < count; i++) {
        int found = 0;
        for (j = 0; j < count; j++) {
            found |= old_gpu[j] == new_gpu[i];
        }
        if (!found) {
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    for (dev = 0; dev < g_config.devices; dev++) {
        int named = count == 0;
        gpu[dev] = device_gpu(dev);
        for (i = 0; i < count; i++) {
            if (old_gpu[i] == gpu[dev]) {
                gpu[dev] = new_gpu[i];
                named = 1;
                break;
            }
        }
        if (g_held[dev] && !named) {
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    return CUDA_SUCCESS;
}

static CUresult serve_restore(struct ckpt_block *b) {
    struct ckpt_pair pairs[CKPT_MAX_PAIRS];
    unsigned count = LOAD(b->pair_count);
    int gpu[DOUBLE_MAX_DEVICES];
    int dev;
    CUresult rc;
    if (LOAD(b->state) != CU_PROCESS_STATE_CHECKPOINTED) {
        return CUDA_ERROR_ILLEGAL_STATE;
    }
    if (count > CKPT_MAX_PAIRS) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    memcpy(pairs, b->pairs, count * sizeof pairs[0]);
    lock_raw();
    rc = plan_locked(pairs, count, gpu);
    unlock();
    if (rc != CUDA_SUCCESS) {
        return rc;
    }
    if (g_fail_restores > 0) {
        g_fail_restores--;
        return CUDA_ERROR_UNKNOWN; /* GPUSHARE_DOUBLE_CHECKPOINT_FAIL_RESTORES */
    }
    lock_raw();
    /* With the node file, the charges must fit the shared GPUs first. */
    rc = node_restore_locked(gpu);
    for (dev = 0; rc == CUDA_SUCCESS && dev < g_config.devices; dev++) {
        set_device_gpu(dev, gpu[dev]);
    }
    unlock();
    if (rc != CUDA_SUCCESS) {
        return rc; /* still checkpointed */
    }
    for (dev = 0; dev < g_config.devices; dev++) {
        unsigned long long bytes = LOAD(b->moved_bytes[dev]);
        pause_for(bytes);
        lock_raw();
        g_devices[dev].parked = 0;
        STORE(b->moved_bytes[dev], 0);
        STORE(b->host_bytes, LOAD(b->host_bytes) - bytes);
        unlock();
    }
    STORE(b->state, CU_PROCESS_STATE_LOCKED);
    return CUDA_SUCCESS;
}

static CUresult serve(struct ckpt_block *b, uint32_t op) {
    switch (op) {
    case OP_LOCK:
        return serve_lock(b);
    case OP_CHECKPOINT:
        return serve_checkpoint(b);
    case OP_RESTORE:
        return serve_restore(b);
    case OP_UNLOCK:
        return serve_unlock(b);
    default:
        return CUDA_ERROR_INVALID_VALUE;
    }
}

/* The service thread: asleep on the futex until a request is posted. */
static void *service(void *arg) {
    struct ckpt_block *b = arg;
    STORE(b->restore_tid, (int32_t)thread_id());
    futex_wake((uint32_t *)&b->restore_tid);
    for (;;) {
        uint32_t seen = LOAD(b->request);
        if (seen != REQ_POSTED) {
            futex_wait(&b->request, seen, CKPT_WAIT_NS);
            continue;
        }
        if (!__atomic_compare_exchange_n(&b->request, &seen, REQ_TAKEN, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE)) {
            continue; /* the caller gave up on it */
        }
        STORE(b->result, (int32_t)serve(b, LOAD(b->op)));
        STORE(b->request, REQ_DONE);
        futex_wake(&b->request);
    }
    return NULL;
}

/* A child of fork has no service thread: its figures are not the block's. */
static void forget_block(void) {
    g_block = NULL;
}

void checkpoint_start_locked(void) {
    const char *dir = getenv(CKPT_DIR_VAR);
    unsigned long long start = 0;
    struct ckpt_block *b;
    sigset_t all, old;
    pthread_t thread;
    char path[PATH_MAX];
    int fd, dev, rc;
    if (dir == NULL || *dir == '\0' || g_block != NULL) {
        return;
    }
    if (snprintf(path, sizeof path, "%s/%d", dir, (int)getpid()) >= (int)sizeof path) {
        fprintf(stderr, "gpushare double: %s too long; no checkpoints\n", CKPT_DIR_VAR);
        return;
    }
    fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0 || ftruncate(fd, CKPT_FILE_SIZE) != 0) {
        fprintf(stderr, "gpushare double: cannot create %s (%s); no checkpoints\n", path,
                strerror(errno));
        if (fd >= 0) {
            close(fd);
        }
        return;
    }
    b = mmap(NULL, CKPT_FILE_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (b == MAP_FAILED) {
        unlink(path);
        return;
    }
    g_us_per_gib = env_count("GPUSHARE_DOUBLE_CHECKPOINT_US_PER_GIB", 0, 0, 3600000000ULL);
    g_fail_restores = env_count("GPUSHARE_DOUBLE_CHECKPOINT_FAIL_RESTORES", 0, 0, ~0ULL);
    proc_stat((int)getpid(), &start);
    STORE(b->version, CKPT_VERSION);
    STORE(b->state, CU_PROCESS_STATE_RUNNING);
    STORE(b->pid, (int32_t)getpid());
    STORE(b->start_time, start);
    STORE(b->devices, (uint32_t)g_config.devices);
    for (dev = 0; dev < CKPT_SLOTS; dev++) {
        STORE(b->gpu[dev], CKPT_NO_GPU);
    }
    g_block = b;
    checkpoint_publish_locked();
    /* The thread takes no signal of the application's. */
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    rc = pthread_create(&thread, NULL, service, b);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        fprintf(stderr, "gpushare double: no checkpoint service thread (%s)\n", strerror(rc));
        g_block = NULL;
        munmap(b, CKPT_FILE_SIZE);
        unlink(path);
        return;
    }
    pthread_detach(thread);
    /* Callers find the block once its thread runs: before cuInit returns. */
    while (LOAD(b->restore_tid) == 0) {
        futex_wait((uint32_t *)&b->restore_tid, 0, CKPT_POLL_NS);
    }
    STORE(b->magic, CKPT_MAGIC);
    pthread_atfork(NULL, NULL, forget_block);
}

/* ================================================================ the caller */

/* The block of the CUDA process pid, mapped; CUDA_ERROR_INVALID_VALUE when
 * pid names none (no such process, not a CUDA process, a stale file). */
static CUresult attach(int pid, struct ckpt_block **out) {
    static int warned;
    const char *dir = getenv(CKPT_DIR_VAR);
    struct ckpt_block *b;
    struct stat st;
    char path[PATH_MAX];
    int fd;
    if (dir == NULL || *dir == '\0') {
        if (!__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED)) {
            fprintf(stderr, "gpushare double: %s unset: no process can be checkpointed\n",
                    CKPT_DIR_VAR);
        }
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (pid <= 0 || snprintf(path, sizeof path, "%s/%d", dir, pid) >= (int)sizeof path) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (fstat(fd, &st) != 0 || st.st_size < CKPT_FILE_SIZE) {
        close(fd);
        return CUDA_ERROR_INVALID_VALUE;
    }
    b = mmap(NULL, CKPT_FILE_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (b == MAP_FAILED) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (LOAD(b->magic) != CKPT_MAGIC || LOAD(b->version) != CKPT_VERSION ||
        LOAD(b->pid) != pid || !process_alive(pid, LOAD(b->start_time))) {
        munmap(b, CKPT_FILE_SIZE);
        return CUDA_ERROR_INVALID_VALUE;
    }
    *out = b;
    return CUDA_SUCCESS;
}

static void detach(struct ckpt_block *b) {
    munmap(b, CKPT_FILE_SIZE);
}

static void nap(unsigned long long *ns) {
    sleep_until(now_ns() + *ns);
    *ns = *ns * 2 > 1000000ULL ? 1000000ULL : *ns * 2;
}

/* The request slot for this thread; a dead holder's is taken over. */
static CUresult take_slot(struct ckpt_block *b, uint32_t me, unsigned long long deadline) {
    unsigned long long backoff = 50000ULL;
    for (;;) {
        uint32_t holder = 0;
        if (__atomic_compare_exchange_n(&b->caller, &holder, me, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            return CUDA_SUCCESS;
        }
        if (kill((pid_t)holder, 0) != 0 && errno == ESRCH &&
            __atomic_compare_exchange_n(&b->caller, &holder, me, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE)) {
            return CUDA_SUCCESS;
        }
        if (!process_alive(LOAD(b->pid), LOAD(b->start_time))) {
            return CUDA_ERROR_INVALID_VALUE;
        }
        if (now_ns() >= deadline) {
            return CUDA_ERROR_TIMEOUT;
        }
        nap(&backoff);
    }
}

/* Sleeps while the request word reads `seen`, at most until `until` and
 * CKPT_POLL_NS. */
static void wait_change(struct ckpt_block *b, uint32_t seen, unsigned long long now,
                        unsigned long long until) {
    futex_wait(&b->request, seen, until - now < CKPT_POLL_NS ? until - now : CKPT_POLL_NS);
}

/*
 * Frees the slot's request word of what an earlier caller left behind: one
 * that died or gave up left a posted request (withdrawn: it never ran), a
 * taken one (waited for, until `deadline`) or a done one (dropped).
 */
static CUresult settle(struct ckpt_block *b, unsigned long long deadline) {
    for (;;) {
        uint32_t seen = LOAD(b->request);
        unsigned long long now = now_ns();
        if (seen == REQ_IDLE) {
            return CUDA_SUCCESS;
        }
        if (seen != REQ_TAKEN) {
            __atomic_compare_exchange_n(&b->request, &seen, REQ_IDLE, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE);
            continue;
        }
        if (!process_alive(LOAD(b->pid), LOAD(b->start_time))) {
            return CUDA_ERROR_INVALID_VALUE;
        }
        if (now >= deadline) {
            return CUDA_ERROR_TIMEOUT;
        }
        wait_change(b, seen, now, deadline);
    }
}

/*
 * Waits for our request to be done and takes its result. A request still
 * posted at `deadline` is withdrawn (CUDA_ERROR_TIMEOUT: it never ran); one
 * the target took is waited for until `hard`.
 */
static CUresult await_done(struct ckpt_block *b, unsigned long long deadline,
                           unsigned long long hard) {
    for (;;) {
        uint32_t seen = LOAD(b->request);
        unsigned long long now = now_ns();
        if (seen == REQ_DONE) {
            CUresult rc = (CUresult)LOAD(b->result);
            STORE(b->request, REQ_IDLE);
            futex_wake(&b->request);
            return rc;
        }
        if (seen == REQ_IDLE) {
            return CUDA_ERROR_UNKNOWN; /* withdrawn by another caller: never expected */
        }
        if (!process_alive(LOAD(b->pid), LOAD(b->start_time))) {
            return CUDA_ERROR_INVALID_VALUE;
        }
        if (seen == REQ_POSTED && now >= deadline) {
            if (__atomic_compare_exchange_n(&b->request, &seen, REQ_IDLE, 0, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE)) {
                return CUDA_ERROR_TIMEOUT;
            }
            continue;
        }
        if (now >= hard) {
            return CUDA_ERROR_TIMEOUT; /* left taken: the next caller waits for it */
        }
        wait_change(b, seen, now, seen == REQ_POSTED ? deadline : hard);
    }
}

/* One request to the target pid: op with its arguments, waited for. */
static CUresult request(int pid, enum ckpt_op op, unsigned timeout_ms,
                        const CUcheckpointGpuPair *pairs, unsigned count) {
    unsigned long long deadline =
        now_ns() + (timeout_ms > 0 ? (unsigned long long)timeout_ms * 1000000ULL : CKPT_WAIT_NS);
    uint32_t me = thread_id();
    struct ckpt_block *b = NULL;
    CUresult rc = attach(pid, &b);
    unsigned i;
    if (rc != CUDA_SUCCESS) {
        return rc;
    }
    rc = take_slot(b, me, deadline);
    if (rc != CUDA_SUCCESS) {
        detach(b);
        return rc;
    }
    rc = settle(b, deadline);
    if (rc == CUDA_SUCCESS) {
        STORE(b->op, (uint32_t)op);
        STORE(b->deadline_ns, op == OP_LOCK && timeout_ms > 0 ? deadline : 0ULL);
        for (i = 0; i < count; i++) {
            memcpy(b->pairs[i].old_uuid, pairs[i].oldUuid.bytes, 16);
            memcpy(b->pairs[i].new_uuid, pairs[i].newUuid.bytes, 16);
        }
        STORE(b->pair_count, count);
        STORE(b->request, REQ_POSTED);
        futex_wake(&b->request);
        rc = await_done(b, deadline, deadline + CKPT_WAIT_NS);
    }
    STORE(b->caller, 0);
    detach(b);
    return rc;
}

static int all_zero(const void *p, size_t size) {
    const unsigned char *bytes = p;
    size_t i;
    for (i = 0; i < size; i++) {
        if (bytes[i] != 0) {
            return 0;
        }
    }
    return 1;
}

CUresult impl_cuCheckpointProcessGetState(int pid, CUprocessState *state) {
    struct ckpt_block *b = NULL;
    CUresult rc;
    if (state == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    rc = attach(pid, &b);
    if (rc == CUDA_SUCCESS) {
        *state = (CUprocessState)LOAD(b->state);
        detach(b);
    }
    return rc;
}

CUresult impl_cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) {
    struct ckpt_block *b = NULL;
    CUresult rc;
    if (tid == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    rc = attach(pid, &b);
    if (rc == CUDA_SUCCESS) {
        *tid = (int)LOAD(b->restore_tid);
        detach(b);
    }
    return rc;
}

CUresult impl_cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args) {
    if (args != NULL &&
        (args->reserved0 != 0 || !all_zero(args->reserved1, sizeof args->reserved1))) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    return request(pid, OP_LOCK, args != NULL ? args->timeoutMs : 0, NULL, 0);
}

CUresult impl_cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args) {
    if (args != NULL && !all_zero(args, sizeof *args)) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    return request(pid, OP_CHECKPOINT, 0, NULL, 0);
}

CUresult impl_cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args) {
    unsigned count = args != NULL ? args->gpuPairsCount : 0;
    if (args != NULL && (!all_zero(args->reserved, sizeof args->reserved) ||
                         args->reserved1 != 0 || (count > 0 && args->gpuPairs == NULL) ||
                         count > CKPT_MAX_PAIRS)) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    return request(pid, OP_RESTORE, 0, count > 0 ? args->gpuPairs : NULL, count);
}

CUresult impl_cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args) {
    if (args != NULL && !all_zero(args, sizeof *args)) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    return request(pid, OP_UNLOCK, 0, NULL, 0);
}
