/*
 * What the double's driver answers about itself, before cuInit too:
 * cuGetProcAddress(_v2), which maps a base name to an exported entry point
 * as the measured driver does, and cuGetErrorString/cuGetErrorName.
 */
#include "double_internal.h"

/* The exported entry points, by name. */
static const char *const exported_names[] = {
#define CU_ENTRY(name) #name,
#include "cuda_entries.def"
#undef CU_ENTRY
};

/* ---------------------------------------------------------------- errors */

static const struct {
    CUresult code;
    const char *name;
    const char *text;
} g_errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_UNSUPPORTED_LIMIT, "CUDA_ERROR_UNSUPPORTED_LIMIT", "limit is not supported"},
    {CUDA_ERROR_FILE_NOT_FOUND, "CUDA_ERROR_FILE_NOT_FOUND", "file not found"},
    {CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM",
     "OS call failed or operation not supported on this OS"},
    {CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {CUDA_ERROR_ILLEGAL_STATE, "CUDA_ERROR_ILLEGAL_STATE",
     "the operation cannot be performed in the present state"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
     "part or all of the requested memory range is already mapped"},
    {CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
     "pointer does not correspond to a registered memory region"},
    {CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS",
     "an illegal memory access was encountered"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
     "operation not permitted when stream is capturing"},
    {CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
     "operation failed due to a previous error during capture"},
    {CUDA_ERROR_TIMEOUT, "CUDA_ERROR_TIMEOUT", "wait operation timed out"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

static CUresult describe(CUresult error, const char **pStr, int want_name) {
    size_t i;
    if (pStr == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (i = 0; i < sizeof g_errors / sizeof g_errors[0]; i++) {
        if (g_errors[i].code == error) {
            *pStr = want_name ? g_errors[i].name : g_errors[i].text;
            return CUDA_SUCCESS;
        }
    }
    *pStr = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult impl_cuGetErrorString(CUresult error, const char **pStr) {
    return describe(error, pStr, 0);
}

CUresult impl_cuGetErrorName(CUresult error, const char **pStr) {
    return describe(error, pStr, 1);
}

/* ---------------------------------------------------------------- cuGetProcAddress */

/* Base name → exported symbol, as the measured driver maps them. */
static const struct {
    const char *base;
    const char *exported; /* cudaVersion >= since, default stream */
    const char *ptsz;     /* with CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM */
    const char *older;    /* cudaVersion < since, where the older version is exported */
    int since;
} g_proc_map[] = {
    {"cuMemAlloc", "cuMemAlloc_v2", NULL, NULL, 0},
    {"cuMemGetInfo", "cuMemGetInfo_v2", NULL, "cuMemGetInfo", 3020},
    {"cuMemFree", "cuMemFree_v2", NULL, NULL, 0},
    {"cuDeviceTotalMem", "cuDeviceTotalMem_v2", NULL, "cuDeviceTotalMem", 3020},
    {"cuCtxCreate", "cuCtxCreate_v2", NULL, NULL, 0},
    {"cuCtxDestroy", "cuCtxDestroy_v2", NULL, NULL, 0},
    {"cuDevicePrimaryCtxRelease", "cuDevicePrimaryCtxRelease_v2", NULL, NULL, 0},
    {"cuMemAllocPitch", "cuMemAllocPitch_v2", NULL, NULL, 0},
    {"cuArrayCreate", "cuArrayCreate_v2", NULL, NULL, 0},
    {"cuArray3DCreate", "cuArray3DCreate_v2", NULL, NULL, 0},
    {"cuMemGetAddressRange", "cuMemGetAddressRange_v2", NULL, NULL, 0},
    {"cuMemAllocHost", "cuMemAllocHost_v2", NULL, NULL, 0},
    {"cuMemHostRegister", "cuMemHostRegister_v2", NULL, NULL, 0},
    {"cuGetProcAddress", "cuGetProcAddress_v2", NULL, NULL, 0},
    {"cuDeviceGetUuid", "cuDeviceGetUuid_v2", NULL, NULL, 0},
    {"cuMemAllocAsync", "cuMemAllocAsync", "cuMemAllocAsync_ptsz", NULL, 0},
    {"cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync", "cuMemAllocFromPoolAsync_ptsz", NULL, 0},
    {"cuMemFreeAsync", "cuMemFreeAsync", "cuMemFreeAsync_ptsz", NULL, 0},
    {"cuLaunchKernel", "cuLaunchKernel", "cuLaunchKernel_ptsz", NULL, 0},
    {"cuLaunchKernelEx", "cuLaunchKernelEx", "cuLaunchKernelEx_ptsz", NULL, 0},
    {"cuLaunchCooperativeKernel", "cuLaunchCooperativeKernel", "cuLaunchCooperativeKernel_ptsz",
     NULL, 0},
    {"cuGraphLaunch", "cuGraphLaunch", "cuGraphLaunch_ptsz", NULL, 0},
    {"cuGraphInstantiate", "cuGraphInstantiateWithFlags", NULL, NULL, 0},
    {"cuGraphUpload", "cuGraphUpload", "cuGraphUpload_ptsz", NULL, 0},
    {"cuModuleGetGlobal", "cuModuleGetGlobal_v2", NULL, NULL, 0},
    {"cuStreamBeginCapture", "cuStreamBeginCapture_v2", "cuStreamBeginCapture_v2_ptsz", NULL, 0},
    {"cuStreamEndCapture", "cuStreamEndCapture", "cuStreamEndCapture_ptsz", NULL, 0},
    {"cuStreamIsCapturing", "cuStreamIsCapturing", "cuStreamIsCapturing_ptsz", NULL, 0},
    {"cuStreamSynchronize", "cuStreamSynchronize", "cuStreamSynchronize_ptsz", NULL, 0},
    {"cuStreamQuery", "cuStreamQuery", "cuStreamQuery_ptsz", NULL, 0},
    {"cuStreamGetCtx", "cuStreamGetCtx", "cuStreamGetCtx_ptsz", NULL, 0},
    {"cuStreamDestroy", "cuStreamDestroy_v2", NULL, NULL, 0},
    {"cuEventRecord", "cuEventRecord", "cuEventRecord_ptsz", NULL, 0},
    {"cuStreamWaitEvent", "cuStreamWaitEvent", "cuStreamWaitEvent_ptsz", NULL, 0},
    /* Synchronous copies and sets take the per-thread stream as _ptds. */
    {"cuMemcpy", "cuMemcpy", "cuMemcpy_ptds", NULL, 0},
    {"cuMemcpyAsync", "cuMemcpyAsync", "cuMemcpyAsync_ptsz", NULL, 0},
    {"cuMemcpyHtoD", "cuMemcpyHtoD_v2", "cuMemcpyHtoD_v2_ptds", NULL, 0},
    {"cuMemcpyHtoDAsync", "cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync_v2_ptsz", NULL, 0},
    {"cuMemcpyDtoH", "cuMemcpyDtoH_v2", "cuMemcpyDtoH_v2_ptds", NULL, 0},
    {"cuMemcpyDtoHAsync", "cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync_v2_ptsz", NULL, 0},
    {"cuMemcpyDtoD", "cuMemcpyDtoD_v2", "cuMemcpyDtoD_v2_ptds", NULL, 0},
    {"cuMemcpyDtoDAsync", "cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync_v2_ptsz", NULL, 0},
    {"cuMemsetD8", "cuMemsetD8_v2", "cuMemsetD8_v2_ptds", NULL, 0},
    {"cuMemsetD32", "cuMemsetD32_v2", "cuMemsetD32_v2_ptds", NULL, 0},
    {"cuMemsetD8Async", "cuMemsetD8Async", "cuMemsetD8Async_ptsz", NULL, 0},
    {"cuMemsetD32Async", "cuMemsetD32Async", "cuMemsetD32Async_ptsz", NULL, 0},
    {"cuEventDestroy", "cuEventDestroy_v2", NULL, NULL, 0},
    {"cuEventElapsedTime", "cuEventElapsedTime_v2", NULL, "cuEventElapsedTime", 12080},
    {"cuIpcOpenMemHandle", "cuIpcOpenMemHandle_v2", NULL, "cuIpcOpenMemHandle", 11000},
};

static void *g_self;

static void open_self(void) {
    Dl_info info;
    /* The double's own handle, however it was loaded (path, soname, preload). */
    if (dladdr((void *)&impl_cuInit, &info) != 0 && info.dli_fname != NULL) {
        g_self = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    }
}

static void *own_handle(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, open_self);
    return g_self;
}

static const char *resolve_name(const char *symbol, int cudaVersion, cuuint64_t flags) {
    size_t i;
    for (i = 0; i < sizeof g_proc_map / sizeof g_proc_map[0]; i++) {
        if (strcmp(symbol, g_proc_map[i].base) != 0) {
            continue;
        }
        if (cudaVersion < g_proc_map[i].since && g_proc_map[i].older != NULL) {
            return g_proc_map[i].older;
        }
        if ((flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) && g_proc_map[i].ptsz != NULL) {
            return g_proc_map[i].ptsz;
        }
        return g_proc_map[i].exported;
    }
    /* Any other exported name that is itself a base name (no _v2 / _ptsz / _ptds). */
    for (i = 0; i < sizeof exported_names / sizeof exported_names[0]; i++) {
        if (strcmp(symbol, exported_names[i]) == 0) {
            size_t n = strlen(symbol);
            if ((n > 3 && strcmp(symbol + n - 3, "_v2") == 0) ||
                (n > 5 && strcmp(symbol + n - 5, "_ptsz") == 0) ||
                (n > 5 && strcmp(symbol + n - 5, "_ptds") == 0)) {
                return NULL;
            }
            return exported_names[i];
        }
    }
    return NULL;
}

CUresult impl_cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                  cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus) {
    const char *name;
    void *address = NULL;
    if (symbol == NULL || pfn == NULL || (flags & ~(cuuint64_t)3) != 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    *pfn = NULL;
    name = resolve_name(symbol, cudaVersion, flags);
    if (name != NULL) {
        void *self = own_handle();
        if (self != NULL) {
            address = dlsym(self, name);
        }
    }
    if (symbolStatus != NULL) {
        *symbolStatus =
            address != NULL ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    }
    if (address == NULL) {
        return CUDA_ERROR_NOT_FOUND;
    }
    *pfn = address;
    return CUDA_SUCCESS;
}

CUresult impl_cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags) {
    return impl_cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, NULL);
}
