/*
 * What libcuda.so.1 and libnvidia-ml.so.1 of the test double share: the
 * environment that describes the fake GPUs, the identity of each device, and
 * the snapshot NVML reads from libcuda's state.
 *
 * Environment (read once per process, by whichever library needs it first):
 *   GPUSHARE_DOUBLE_DEVICES        number of fake GPUs, 0..8 (default 1)
 *   GPUSHARE_DOUBLE_TOTAL          bytes per GPU, plain or with a binary
 *                                  k/m/g/t suffix (default 16 GiB)
 *   GPUSHARE_DOUBLE_CONTEXT_BYTES  bytes each live context on a GPU charges
 *                                  to the process, the driver's own memory
 *                                  (default 300 MiB)
 *   GPUSHARE_DOUBLE_GREEN_CONTEXT_BYTES  bytes each live green context
 *                                  charges (default 5 MiB: what one takes
 *                                  on an H100 with driver 580)
 *
 * Device i has the UUID bytes 11 22 33 44 55 66 77 88 99 aa bb cc dd ee ff i,
 * printed GPU-11223344-5566-7788-99aa-bbccddeeff0i (lower-case hex), and the
 * PCI bus id 0000:XX:00.0 (CUDA) / 00000000:XX:00.0 (NVML) with XX = 0x18 + i.
 */
#ifndef GPUSHARE_DOUBLE_COMMON_H
#define GPUSHARE_DOUBLE_COMMON_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DOUBLE_MAX_DEVICES 8
#define DOUBLE_DEFAULT_TOTAL (16ULL << 30)
#define DOUBLE_DEFAULT_CONTEXT_BYTES (300ULL << 20)
#define DOUBLE_DEFAULT_GREEN_CONTEXT_BYTES (5ULL << 20)
#define DOUBLE_UUID_STRING_LEN 40 /* "GPU-" + 36 */

/* What libnvidia-ml.so.1 learns about one fake GPU from libcuda.so.1. */
struct gpushare_double_snapshot {
    unsigned long long total;         /* bytes of the fake GPU */
    unsigned long long context_bytes; /* driver memory charged by this process's contexts */
    unsigned long long alloc_bytes;   /* live allocations of this process on the GPU */
    int has_context;                  /* this process has a live context on the GPU */
    unsigned long long driver_bytes;  /* other driver-held memory of this process: context
                                         limits, module globals, graph and pool memory */
};

/*
 * Exported by libcuda.so.1 (with the busy-time accessor below, the only
 * non-API symbols it exports). Returns the
 * number of fake GPUs; fills *out when out is not NULL and device is in range.
 */
typedef int (*gpushare_double_state_fn)(int device, struct gpushare_double_snapshot *out);
#define GPUSHARE_DOUBLE_STATE_SYMBOL "gpushare_double_state"

/*
 * Exported by libcuda.so.1: nanoseconds of [from_ns, to_ns) (CLOCK_MONOTONIC)
 * during which the simulated GPU `device` of this process ran kernels; 0 for
 * an unknown device or an empty range.
 */
typedef unsigned long long (*gpushare_double_busy_fn)(int device, unsigned long long from_ns,
                                                       unsigned long long to_ns);
#define GPUSHARE_DOUBLE_BUSY_SYMBOL "gpushare_double_busy_ns"

/*
 * The node file (layout in node.c): GPUs shared by the processes whose
 * environment names it. What readers of its header need: the magic, the
 * version, the device count (u32 at 12) and each GPU's used bytes, u64 at
 * DOUBLE_NODE_USED_OFFSET + 8 * GPU.
 */
#define DOUBLE_NODE_FILE_VAR "GPUSHARE_DOUBLE_NODE_FILE"
#define DOUBLE_NODE_MAGIC 0x3145444f4e445347ULL /* "GSDNODE1" */
#define DOUBLE_NODE_VERSION 1U
#define DOUBLE_NODE_DEVICES_OFFSET 12
#define DOUBLE_NODE_USED_OFFSET 64
#define DOUBLE_NODE_SLOTS 16

struct double_config {
    int devices;
    unsigned long long total;
    unsigned long long context_bytes;
    unsigned long long green_context_bytes;
};

/* Parses "123", "4k", "16g" (binary suffixes). Returns 0 on success. */
static inline int double_parse_bytes(const char *text, unsigned long long *out) {
    char *end = NULL;
    unsigned long long value;
    unsigned shift = 0;
    if (text == NULL || *text < '0' || *text > '9') {
        return -1;
    }
    value = strtoull(text, &end, 10);
    switch (*end) {
    case '\0':
        break;
    case 'k': case 'K': shift = 10; end++; break;
    case 'm': case 'M': shift = 20; end++; break;
    case 'g': case 'G': shift = 30; end++; break;
    case 't': case 'T': shift = 40; end++; break;
    default:
        return -1;
    }
    if (*end != '\0' || (shift != 0 && value > (~0ULL >> shift))) {
        return -1;
    }
    *out = value << shift;
    return 0;
}

static inline unsigned long long double_env_bytes(const char *name, unsigned long long fallback) {
    const char *text = getenv(name);
    unsigned long long value;
    if (text == NULL || *text == '\0') {
        return fallback;
    }
    if (double_parse_bytes(text, &value) != 0) {
        fprintf(stderr, "gpushare double: ignoring %s=%s (not a byte count)\n", name, text);
        return fallback;
    }
    return value;
}

static inline struct double_config double_config_from_env(void) {
    struct double_config config;
    const char *devices = getenv("GPUSHARE_DOUBLE_DEVICES");
    config.devices = 1;
    if (devices != NULL && *devices != '\0') {
        char *end = NULL;
        long n = strtol(devices, &end, 10);
        if (*end != '\0' || n < 0 || n > DOUBLE_MAX_DEVICES) {
            fprintf(stderr, "gpushare double: ignoring GPUSHARE_DOUBLE_DEVICES=%s (0..8)\n",
                    devices);
        } else {
            config.devices = (int)n;
        }
    }
    config.total = double_env_bytes("GPUSHARE_DOUBLE_TOTAL", DOUBLE_DEFAULT_TOTAL);
    config.context_bytes =
        double_env_bytes("GPUSHARE_DOUBLE_CONTEXT_BYTES", DOUBLE_DEFAULT_CONTEXT_BYTES);
    config.green_context_bytes = double_env_bytes("GPUSHARE_DOUBLE_GREEN_CONTEXT_BYTES",
                                                  DOUBLE_DEFAULT_GREEN_CONTEXT_BYTES);
    return config;
}

static inline void double_uuid_bytes(int device, unsigned char bytes[16]) {
    int i;
    for (i = 0; i < 15; i++) {
        bytes[i] = (unsigned char)(0x11 * (i + 1));
    }
    bytes[15] = (unsigned char)device;
}

/* Writes "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"; buf holds at least 41 bytes. */
static inline void double_uuid_string(int device, char *buf) {
    unsigned char b[16];
    double_uuid_bytes(device, b);
    snprintf(buf, DOUBLE_UUID_STRING_LEN + 1,
             "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
             b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
}

static inline unsigned double_pci_bus(int device) {
    return 0x18U + (unsigned)device;
}

/* Parses "0000:18:00.0" or "00000000:18:00.0" into a device index, or -1. */
static inline int double_device_from_pci(const char *text, int devices) {
    unsigned domain, bus, dev, function;
    char tail;
    if (text == NULL ||
        sscanf(text, "%x:%x:%x.%x%c", &domain, &bus, &dev, &function, &tail) != 4) {
        return -1;
    }
    if (domain != 0 || dev != 0 || function != 0 || bus < 0x18 || bus >= 0x18U + (unsigned)devices) {
        return -1;
    }
    return (int)(bus - 0x18);
}

#endif
