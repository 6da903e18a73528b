/*
 * The node file of the double (the model is in cuda.c): fake GPUs that
 * several processes share, as real GPUs are. A process whose first cuInit
 * sees GPUSHARE_DOUBLE_NODE_FILE naming a path maps that file (creating it)
 * and from then on adds every byte it charges to a GPU to that GPU's shared
 * `used` in the file, and takes it off when the charge goes. fits()
 * (memory.c), the one check every charge passes, also reserves the growth
 * there; node_sync_locked, run by every unlock(), settles the file to what
 * the process holds (uncharges, and reservations a failed call did not use).
 *
 * The file: MAP_SHARED, little-endian, every field read and written with
 * __atomic builtins. An all-zero file is an empty node, so racing creators
 * only extend it to its size (O_CREAT without O_EXCL, then ftruncate) and
 * fill the header with compare-and-swaps (from 0; devices only grows), the
 * magic last:
 *
 *   offset  size  field
 *        0     8  magic      "GSDNODE1"
 *        8     4  version    1
 *       12     4  devices    the most fake GPUs (GPUSHARE_DOUBLE_DEVICES) of
 *                            the processes that opened the file
 *       16     8  claims     counts the table's claims: each owner's generation
 *       24    40  reserved   0
 *       64   128  used       u64[16], by GPU (its NVML index, the last byte of its
 *                            UUID): the bytes every process charges there
 *      192 36864  table      256 entries of 144 bytes, one per process:
 *                   +0    8  owner       pid | generation (31 bits) << 32; 0
 *                                        free; 1 << 63 | pid while that process
 *                                        takes a dead owner's bytes off
 *                   +8    8  start_time  the owner's /proc/<pid>/stat field 22
 *                                        (0 until written)
 *                  +16  128  bytes       u64[16], by GPU: the owner's part of used
 *    37056        end; the file is 40960 bytes long
 *
 * A charge that does not fit (used + it > GPUSHARE_DOUBLE_TOTAL: the total
 * of the process adding, as for its own GPU) first reclaims the entries of
 * dead processes (gone, zombie, or another start time: a reused pid),
 * subtracting their bytes from used, then is tried again. An exiting
 * process takes its own bytes off (a destructor) unless another of its
 * threads holds the driver's state then; a killed one is reclaimed. A
 * process that finds the table full charges without an entry, and what it
 * holds when killed stays in used. Growth is added to used before the
 * entry, shrinkage taken off the entry first: a process killed between the
 * two leaves that one change behind. A child of fork charges nothing to
 * the file.
 */
#include "double_internal.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#define NODE_SLOTS 16
#define NODE_ENTRIES 256
#define NODE_FILE_SIZE 40960
#define NODE_DRAINING (1ULL << 63)
#define NODE_PID_MASK 0xFFFFFFFFULL

struct node_entry {
    uint64_t owner;
    uint64_t start_time;
    uint64_t bytes[NODE_SLOTS];
};

struct node_file {
    uint64_t magic;
    uint32_t version;
    uint32_t devices;
    uint64_t claims;
    uint64_t reserved[5];
    uint64_t used[NODE_SLOTS];
    struct node_entry table[NODE_ENTRIES];
};

/* The layout table above, checked (the offsets readers use are in
 * double_common.h). */
_Static_assert(offsetof(struct node_file, version) == 8, "version");
_Static_assert(offsetof(struct node_file, devices) == 12, "devices");
_Static_assert(offsetof(struct node_file, claims) == 16, "claims");
_Static_assert(offsetof(struct node_file, used) == DOUBLE_NODE_USED_OFFSET, "used");
_Static_assert(offsetof(struct node_file, table) == 192, "table");
_Static_assert(sizeof(struct node_entry) == 144, "entry");
_Static_assert(sizeof(struct node_file) == 37056, "end");
_Static_assert(sizeof(struct node_file) <= NODE_FILE_SIZE, "file size");
_Static_assert(NODE_SLOTS == DOUBLE_NODE_SLOTS, "slots");
_Static_assert(DOUBLE_MAX_DEVICES <= NODE_SLOTS, "a slot per GPU");

#define LOAD(field) __atomic_load_n(&(field), __ATOMIC_ACQUIRE)
#define STORE(field, value) __atomic_store_n(&(field), (value), __ATOMIC_RELEASE)
#define CAS(field, expected, desired)                                                        \
    __atomic_compare_exchange_n(&(field), &(expected), (desired), 0, __ATOMIC_ACQ_REL,       \
                                __ATOMIC_ACQUIRE)

/* All under g_lock. g_node NULL: no node file. */
static struct node_file *g_node;
static struct node_entry *g_entry; /* ours; NULL when the table was full */
static uint64_t g_owner;           /* our owner word */
/* By ordinal: the bytes the file holds for it, on its GPU (device_gpu). */
static unsigned long long g_charged[DOUBLE_MAX_DEVICES];
/* By ordinal: what a restore reserved for it while it is still parked. */
static unsigned long long g_parked_charge[DOUBLE_MAX_DEVICES];

/* Adds bytes to gpu's used (checked: only within the total), then to our entry. */
static int node_add(int gpu, unsigned long long bytes, int checked) {
    uint64_t used = LOAD(g_node->used[gpu]);
    do {
        if (checked && (bytes > g_config.total || used > g_config.total - bytes)) {
            return 0;
        }
    } while (!CAS(g_node->used[gpu], used, used + bytes));
    if (g_entry != NULL) {
        __atomic_add_fetch(&g_entry->bytes[gpu], bytes, __ATOMIC_ACQ_REL);
    }
    return 1;
}

static void node_sub(int gpu, unsigned long long bytes) {
    if (g_entry != NULL) {
        __atomic_sub_fetch(&g_entry->bytes[gpu], bytes, __ATOMIC_ACQ_REL);
    }
    __atomic_sub_fetch(&g_node->used[gpu], bytes, __ATOMIC_ACQ_REL);
}

/* Takes a dead owner's bytes off used and frees its entry; `owner` is the
 * word we saw, replaced by our draining mark (a drainer that dies is dead
 * in turn, and its successor drains the rest). */
static void drain(struct node_entry *e, uint64_t owner, uint64_t mark) {
    int gpu;
    if (!CAS(e->owner, owner, mark)) {
        return; /* another process got there first */
    }
    for (gpu = 0; gpu < NODE_SLOTS; gpu++) {
        uint64_t bytes = __atomic_exchange_n(&e->bytes[gpu], 0, __ATOMIC_ACQ_REL);
        if (bytes > 0) {
            __atomic_sub_fetch(&g_node->used[gpu], bytes, __ATOMIC_ACQ_REL);
        }
    }
    STORE(e->start_time, 0);
    CAS(e->owner, mark, 0);
}

/* Reclaims the entries of dead processes; whether any was. */
static int node_reclaim(void) {
    uint64_t mark = NODE_DRAINING | (uint64_t)getpid();
    int i, any = 0;
    for (i = 0; i < NODE_ENTRIES; i++) {
        struct node_entry *e = &g_node->table[i];
        uint64_t owner = LOAD(e->owner);
        unsigned long long start;
        int pid = (int)(owner & NODE_PID_MASK);
        if (owner == 0 || owner == g_owner || owner == mark) {
            continue;
        }
        /* A drainer is judged by its pid alone: its start_time is not its own. */
        start = owner & NODE_DRAINING ? 0 : LOAD(e->start_time);
        if (process_alive(pid, start)) {
            continue;
        }
        drain(e, owner, mark);
        any = 1;
    }
    return any;
}

/* A free entry of the table for us, or NULL. */
static struct node_entry *claim(unsigned long long start) {
    uint64_t generation = __atomic_add_fetch(&g_node->claims, 1, __ATOMIC_ACQ_REL);
    uint64_t owner = (uint64_t)getpid() | ((generation & 0x7FFFFFFFULL) << 32);
    int i;
    for (i = 0; i < NODE_ENTRIES; i++) {
        struct node_entry *e = &g_node->table[i];
        uint64_t free_word = 0;
        if (CAS(e->owner, free_word, owner)) {
            STORE(e->start_time, start);
            g_owner = owner;
            return e;
        }
    }
    return NULL;
}

/* A child of fork charges nothing to the file: its parent's charges stay
 * the parent's. */
static void forget_node(void) {
    g_node = NULL;
    g_entry = NULL;
    g_owner = 0;
    memset(g_charged, 0, sizeof g_charged);
    memset(g_parked_charge, 0, sizeof g_parked_charge);
}

void node_start_locked(void) {
    const char *path = getenv(DOUBLE_NODE_FILE_VAR);
    unsigned long long start = 0;
    struct node_file *n;
    struct stat st;
    uint32_t zero32 = 0, devices;
    uint64_t zero64 = 0;
    int fd;
    if (path == NULL || *path == '\0' || g_node != NULL) {
        return;
    }
    fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0 || fstat(fd, &st) != 0 ||
        (st.st_size < NODE_FILE_SIZE && ftruncate(fd, NODE_FILE_SIZE) != 0)) {
        fprintf(stderr, "gpushare double: cannot open %s (%s); no node file\n", path,
                strerror(errno));
        if (fd >= 0) {
            close(fd);
        }
        return;
    }
    n = mmap(NULL, NODE_FILE_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (n == MAP_FAILED) {
        fprintf(stderr, "gpushare double: cannot map %s; no node file\n", path);
        return;
    }
    CAS(n->version, zero32, DOUBLE_NODE_VERSION);
    devices = LOAD(n->devices);
    while (devices < (uint32_t)physical_devices() &&
           !CAS(n->devices, devices, (uint32_t)physical_devices())) {
    }
    CAS(n->magic, zero64, DOUBLE_NODE_MAGIC);
    if (LOAD(n->magic) != DOUBLE_NODE_MAGIC || LOAD(n->version) != DOUBLE_NODE_VERSION) {
        fprintf(stderr, "gpushare double: %s is not a node file of version %u; no node file\n",
                path, DOUBLE_NODE_VERSION);
        munmap(n, NODE_FILE_SIZE);
        return;
    }
    g_node = n;
    proc_stat((int)getpid(), &start);
    g_entry = claim(start);
    if (g_entry == NULL && node_reclaim()) {
        g_entry = claim(start);
    }
    if (g_entry == NULL) {
        fprintf(stderr, "gpushare double: the process table of %s is full; "
                        "this process's charges stay if it is killed\n", path);
    }
    pthread_atfork(NULL, NULL, forget_node);
}

/* Reserves in the file the growth of dev's charge to `need` bytes. */
int node_reserve_locked(int dev, unsigned long long need) {
    int gpu = device_gpu(dev);
    if (g_node == NULL || g_devices[dev].parked || need <= g_charged[dev]) {
        return 1;
    }
    if (!node_add(gpu, need - g_charged[dev], 1) &&
        (!node_reclaim() || !node_add(gpu, need - g_charged[dev], 1))) {
        return 0;
    }
    g_charged[dev] = need;
    return 1;
}

void node_sync_locked(void) {
    int dev;
    if (g_node == NULL) {
        return;
    }
    for (dev = 0; dev < g_config.devices; dev++) {
        unsigned long long target = g_devices[dev].parked ? g_parked_charge[dev] : used_bytes(dev);
        if (target < g_charged[dev]) {
            node_sub(device_gpu(dev), g_charged[dev] - target);
        } else if (target > g_charged[dev]) {
            node_add(device_gpu(dev), target - g_charged[dev], 0); /* fits() reserved it */
        }
        g_charged[dev] = target;
        if (!g_devices[dev].parked) {
            g_parked_charge[dev] = 0;
        }
    }
}

/* Adds what each parked ordinal holds onto gpu[ordinal], all or nothing. */
static int restore_add(const int *gpu) {
    unsigned long long need[NODE_SLOTS] = {0};
    int dev, g, added;
    for (dev = 0; dev < g_config.devices; dev++) {
        need[gpu[dev]] = add_sat(need[gpu[dev]], used_bytes(dev));
    }
    for (added = 0; added < NODE_SLOTS; added++) {
        if (need[added] > 0 && !node_add(added, need[added], 1)) {
            break;
        }
    }
    if (added == NODE_SLOTS) {
        return 1;
    }
    for (g = 0; g < added; g++) {
        if (need[g] > 0) {
            node_sub(g, need[g]);
        }
    }
    return 0;
}

CUresult node_restore_locked(const int *gpu) {
    int dev;
    if (g_node == NULL) {
        return CUDA_SUCCESS;
    }
    if (!restore_add(gpu) && (!node_reclaim() || !restore_add(gpu))) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    for (dev = 0; dev < g_config.devices; dev++) {
        g_charged[dev] = g_parked_charge[dev] = used_bytes(dev);
    }
    return CUDA_SUCCESS;
}

/* At exit: our charges leave the file, and our entry the table. */
__attribute__((destructor)) static void node_exit(void) {
    int dev;
    if (__atomic_load_n(&g_node, __ATOMIC_ACQUIRE) == NULL || !lock_try()) {
        return; /* another thread is in the driver: reclaimed once we are gone */
    }
    if (g_node != NULL) {
        for (dev = 0; dev < g_config.devices; dev++) {
            if (g_charged[dev] > 0) {
                node_sub(device_gpu(dev), g_charged[dev]);
            }
        }
        if (g_entry != NULL) {
            uint64_t owner = g_owner;
            STORE(g_entry->start_time, 0);
            CAS(g_entry->owner, owner, 0);
        }
        munmap(g_node, NODE_FILE_SIZE);
        forget_node();
    }
    unlock();
}
