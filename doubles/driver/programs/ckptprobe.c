/*
 * ckptprobe: a CUDA process for the checkpoint tests, linked with the
 * double (-lcuda, found through its rpath).
 *
 * Usage: ckptprobe SIZE
 * Start: cuInit(0), the primary context of device 0 made current,
 * cuMemAlloc_v2(SIZE) (digits with an optional binary k/m/g/t suffix), then
 * "ready pid=N" on stdout. A failure there prints "ckptprobe: <step>
 * failed: <CUresult>" on stderr and exits 1. Then one command per stdin line,
 * each answered by one line on stdout (flushed), RESULT the numeric CUresult;
 * EOF ends the program (status 0):
 *
 *   info          -> "info RESULT free=F total=T"   cuMemGetInfo_v2
 *   alloc SIZE    -> "alloc RESULT"                 cuMemAlloc_v2, kept
 *   managed SIZE  -> "managed RESULT"               cuMemAllocManaged (global), kept
 *   freemanaged   -> "freemanaged RESULT"           cuMemFree_v2 of the last managed one
 *   copy          -> "copy RESULT"                  cuMemcpyHtoD_v2 of 4 KiB into the
 *                                                   first allocation
 *   launch        -> "launch RESULT"                cuLaunchKernel of a loaded module's
 *                                                   function (1x1x1, its default time)
 *   sync          -> "sync RESULT"                  cuCtxSynchronize
 *   uuid ORDINAL  -> "uuid RESULT HEX"              cuDeviceGetUuid_v2, 32 hex digits
 *   pci ORDINAL   -> "pci RESULT BUSID"             cuDeviceGetPCIBusId
 *   nvml GPU      -> "nvml context=C bytes=B"       the double's NVML view of fake
 *                                                   GPU GPU (gpushare_double_state):
 *                                                   C 0/1, B everything it charges
 * Anything else: "unknown LINE".
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_min.h"
#include "double_common.h"

/* Exported by the double's libcuda.so.1 (double_common.h). */
int gpushare_double_state(int device, struct gpushare_double_snapshot *out);

static void check(const char *step, CUresult rc) {
    if (rc != CUDA_SUCCESS) {
        fprintf(stderr, "ckptprobe: %s failed: %d\n", step, (int)rc);
        exit(1);
    }
}

static size_t size_arg(const char *text) {
    unsigned long long value = 0;
    if (text == NULL || double_parse_bytes(text, &value) != 0) {
        fprintf(stderr, "ckptprobe: bad size '%s'\n", text != NULL ? text : "");
        exit(2);
    }
    return (size_t)value;
}

int main(int argc, char **argv) {
    static unsigned char host[4096];
    CUdeviceptr first = 0, managed = 0;
    CUcontext ctx = NULL;
    CUmodule module = NULL;
    CUfunction function = NULL;
    char line[256];
    if (argc != 2) {
        fprintf(stderr, "usage: ckptprobe SIZE\n");
        return 2;
    }
    check("cuInit", cuInit(0));
    check("cuDevicePrimaryCtxRetain", cuDevicePrimaryCtxRetain(&ctx, 0));
    check("cuCtxSetCurrent", cuCtxSetCurrent(ctx));
    check("cuMemAlloc_v2", cuMemAlloc_v2(&first, size_arg(argv[1])));
    printf("ready pid=%d\n", (int)getpid());
    fflush(stdout);

    while (fgets(line, sizeof line, stdin) != NULL) {
        char *cmd = strtok(line, " \t\r\n");
        char *arg = strtok(NULL, " \t\r\n");
        if (cmd == NULL) {
            continue;
        }
        if (strcmp(cmd, "info") == 0) {
            size_t free = 0, total = 0;
            CUresult rc = cuMemGetInfo_v2(&free, &total);
            printf("info %d free=%zu total=%zu\n", (int)rc, free, total);
        } else if (strcmp(cmd, "alloc") == 0) {
            CUdeviceptr d = 0;
            printf("alloc %d\n", (int)cuMemAlloc_v2(&d, size_arg(arg)));
        } else if (strcmp(cmd, "managed") == 0) {
            printf("managed %d\n",
                   (int)cuMemAllocManaged(&managed, size_arg(arg), CU_MEM_ATTACH_GLOBAL));
        } else if (strcmp(cmd, "freemanaged") == 0) {
            printf("freemanaged %d\n", (int)cuMemFree_v2(managed));
        } else if (strcmp(cmd, "copy") == 0) {
            printf("copy %d\n", (int)cuMemcpyHtoD_v2(first, host, sizeof host));
        } else if (strcmp(cmd, "launch") == 0) {
            CUresult rc = module != NULL ? CUDA_SUCCESS : cuModuleLoadData(&module, "any image");
            if (rc == CUDA_SUCCESS && function == NULL) {
                rc = cuModuleGetFunction(&function, module, "gpushare_spin");
            }
            if (rc == CUDA_SUCCESS) {
                rc = cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
            }
            printf("launch %d\n", (int)rc);
        } else if (strcmp(cmd, "sync") == 0) {
            printf("sync %d\n", (int)cuCtxSynchronize());
        } else if (strcmp(cmd, "uuid") == 0) {
            CUuuid uuid;
            CUresult rc;
            int i;
            memset(&uuid, 0, sizeof uuid);
            rc = cuDeviceGetUuid_v2(&uuid, arg != NULL ? atoi(arg) : 0);
            printf("uuid %d ", (int)rc);
            for (i = 0; i < 16; i++) {
                printf("%02x", (unsigned char)uuid.bytes[i]);
            }
            printf("\n");
        } else if (strcmp(cmd, "pci") == 0) {
            char bus[32] = "";
            CUresult rc = cuDeviceGetPCIBusId(bus, (int)sizeof bus, arg != NULL ? atoi(arg) : 0);
            printf("pci %d %s\n", (int)rc, bus);
        } else if (strcmp(cmd, "nvml") == 0) {
            struct gpushare_double_snapshot snap;
            memset(&snap, 0, sizeof snap);
            gpushare_double_state(arg != NULL ? atoi(arg) : 0, &snap);
            printf("nvml context=%d bytes=%llu\n", snap.has_context,
                   snap.context_bytes + snap.alloc_bytes + snap.driver_bytes);
        } else {
            printf("unknown %s\n", cmd);
        }
        fflush(stdout);
    }
    return 0;
}
