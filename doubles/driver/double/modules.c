/*
 * Modules and libraries of the double (the model is in cuda.c): module
 * loads and their globals, libraries (lazily loaded fat binaries among
 * them) and their modules in each context, functions and kernels.
 */
#include "double_internal.h"

/* Modules, and libraries' modules in each context, share the slots. */
#define DOUBLE_MAX_MODULES 256
#define DOUBLE_MAX_FUNCTIONS 8192
#define DOUBLE_MAX_KERNELS 4096

/* A loaded module, the image of a library, or a library's module in a context. */
struct CUmod_st {
    int live;
    int device;
    CUcontext ctx;                 /* a module's; NULL for a library's image */
    unsigned long long globals;    /* bytes of module globals held */
    unsigned long long globals_at; /* their first fake address */
    struct CUlib_st *library;      /* the library whose module in ctx this is, or NULL */
};

struct CUlib_st {
    struct CUmod_st image;
    int lazy;                        /* a fat binary: its globals come at first use */
    unsigned long long lazy_globals; /* what its first use in each context takes */
};

/* A library's kernel: context-independent, one per (library, name). */
struct CUkern_st {
    struct CUlib_st *library; /* NULL: free slot */
    char name[FUNCTION_NAME_MAX];
};

static struct CUmod_st g_modules[DOUBLE_MAX_MODULES];
static struct CUlib_st g_libraries[DOUBLE_MAX_MODULES];
static struct CUfunc_st g_functions[DOUBLE_MAX_FUNCTIONS];
static struct CUkern_st g_kernels[DOUBLE_MAX_KERNELS];

struct CUfunc_st *function_locked(CUfunction f) {
    long i = SLOT(g_functions, f);
    return i >= 0 && g_functions[i].module != NULL ? &g_functions[i] : NULL;
}

/* A kernel handle; launches take one where they take a function. */
struct CUkern_st *kernel_locked(const void *k) {
    long i = SLOT(g_kernels, k);
    return i >= 0 && g_kernels[i].library != NULL ? &g_kernels[i] : NULL;
}

/* Fills the free slot m on dev (for ctx; NULL for a library's image),
 * charging `globals` bytes of module globals if they fit. */
static CUresult load_locked(struct CUmod_st *m, int dev, CUcontext ctx,
                            unsigned long long globals) {
    struct device *d = &g_devices[dev];
    unsigned long long at = 0;
    if (globals > 0) {
        CUresult rc = fits(dev, globals) ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
        if (rc == CUDA_SUCCESS) {
            rc = bump_locked(&d->globals_next, region_start(dev) + REGION_SIZE, globals, &at);
        }
        if (rc != CUDA_SUCCESS) {
            return rc;
        }
    }
    *m = (struct CUmod_st){1, dev, ctx, globals, at, NULL};
    d->module_bytes += globals;
    return CUDA_SUCCESS;
}

static void unload_locked(struct CUmod_st *m) {
    size_t i;
    g_devices[m->device].module_bytes -= m->globals;
    m->live = 0;
    for (i = 0; i < DOUBLE_MAX_FUNCTIONS; i++) {
        if (g_functions[i].module == m) {
            g_functions[i].module = NULL;
        }
    }
}

/* A context's modules go with it, libraries' modules in it included. */
void unload_context_modules_locked(CUcontext ctx) {
    size_t i;
    for (i = 0; i < DOUBLE_MAX_MODULES; i++) {
        if (g_modules[i].live && g_modules[i].ctx == ctx) {
            unload_locked(&g_modules[i]);
        }
    }
}

/* A module of the current context. */
static CUresult module_load(CUmodule *module, const void *image) {
    CUdevice dev = 0;
    CUresult rc;
    size_t i;
    lock();
    rc = current_device_locked(&dev);
    if (rc == CUDA_SUCCESS && (module == NULL || image == NULL)) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        for (i = 0; i < DOUBLE_MAX_MODULES; i++) {
            if (!g_modules[i].live) {
                rc = load_locked(&g_modules[i], dev, t_current, image_globals(image));
                if (rc == CUDA_SUCCESS) {
                    *module = &g_modules[i];
                }
                break;
            }
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuModuleLoadData(CUmodule *module, const void *image) {
    return module_load(module, image);
}

CUresult impl_cuModuleLoadDataEx(CUmodule *module, const void *image, unsigned int numOptions,
                                 CUjit_option *options, void **optionValues) {
    (void)numOptions;
    (void)options;
    (void)optionValues;
    return module_load(module, image);
}

CUresult impl_cuModuleLoadFatBinary(CUmodule *module, const void *fatCubin) {
    return module_load(module, fatCubin);
}

CUresult impl_cuModuleLoad(CUmodule *module, const char *fname) {
    char image[128];
    CUresult rc;
    if (!double_initialized()) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    rc = read_image(fname, image, sizeof image);
    return rc == CUDA_SUCCESS ? module_load(module, image) : rc;
}

static struct CUmod_st *module_locked(CUmodule m) {
    long i = SLOT(g_modules, m);
    return i >= 0 && g_modules[i].live ? &g_modules[i] : NULL;
}

/* A library's module in a context goes with the library or the context only. */
CUresult impl_cuModuleUnload(CUmodule hmod) {
    struct CUmod_st *m;
    CUresult rc = CUDA_SUCCESS;
    lock();
    m = module_locked(hmod);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (m == NULL || m->library != NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        unload_locked(m);
    }
    unlock();
    return rc;
}

/* Every name is a global of a module with globals: all of them. */
static CUresult global_locked(const struct CUmod_st *m, const char *name, CUdeviceptr *dptr,
                              size_t *bytes) {
    if (name == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (m->globals == 0) {
        return CUDA_ERROR_NOT_FOUND;
    }
    if (dptr != NULL) {
        *dptr = m->globals_at;
    }
    if (bytes != NULL) {
        *bytes = (size_t)m->globals;
    }
    return CUDA_SUCCESS;
}

CUresult impl_cuModuleGetGlobal_v2(CUdeviceptr *dptr, size_t *bytes, CUmodule hmod,
                                   const char *name) {
    struct CUmod_st *m;
    CUresult rc;
    lock();
    m = module_locked(hmod);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (m == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        rc = global_locked(m, name, dptr, bytes);
    }
    unlock();
    return rc;
}

/* ---------------------------------------------------------------- libraries */

/*
 * A library: context-independent. A text image's globals are charged to the
 * current context's GPU at once; a fat binary (when fat is set) takes
 * nothing, and needs no current context.
 */
static CUresult library_load(CUlibrary *library, const void *code, int fat) {
    unsigned long long globals = 0;
    int lazy = fat && code != NULL && fatbin_globals(code, &globals);
    CUdevice dev = 0;
    CUresult rc;
    size_t i;
    lock();
    rc = current_device_locked(&dev);
    if (rc == CUDA_ERROR_INVALID_CONTEXT && lazy) {
        rc = CUDA_SUCCESS;
        dev = 0; /* the image holds nothing on any GPU */
    }
    if (rc == CUDA_SUCCESS && (library == NULL || code == NULL)) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (rc == CUDA_SUCCESS) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
        for (i = 0; i < DOUBLE_MAX_MODULES; i++) {
            struct CUlib_st *lib = &g_libraries[i];
            if (!lib->image.live) {
                rc = load_locked(&lib->image, dev, NULL, lazy ? 0 : image_globals(code));
                if (rc == CUDA_SUCCESS) {
                    lib->lazy = lazy;
                    lib->lazy_globals = globals;
                    *library = lib;
                }
                break;
            }
        }
    }
    unlock();
    return rc;
}

static struct CUlib_st *library_locked(CUlibrary library) {
    long i = SLOT(g_libraries, library);
    return i >= 0 && g_libraries[i].image.live ? &g_libraries[i] : NULL;
}

/* Its modules in every context and its kernels go with it. */
static void library_unload_locked(struct CUlib_st *lib) {
    size_t i;
    for (i = 0; i < DOUBLE_MAX_MODULES; i++) {
        if (g_modules[i].live && g_modules[i].library == lib) {
            unload_locked(&g_modules[i]);
        }
    }
    for (i = 0; i < DOUBLE_MAX_KERNELS; i++) {
        if (g_kernels[i].library == lib) {
            g_kernels[i].library = NULL;
        }
    }
    unload_locked(&lib->image);
}

/*
 * The library's module in ctx, made at its first use there: that takes a
 * fat binary's globals on ctx's GPU, or fails with CUDA_ERROR_OUT_OF_MEMORY
 * and takes nothing. A text image's globals stay with the library's image.
 */
static CUresult library_module_locked(struct CUlib_st *lib, CUcontext ctx,
                                      struct CUmod_st **out) {
    size_t i, free_slot = DOUBLE_MAX_MODULES;
    CUresult rc;
    if (!context_alive(ctx)) {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    for (i = 0; i < DOUBLE_MAX_MODULES; i++) {
        if (g_modules[i].live && g_modules[i].library == lib && g_modules[i].ctx == ctx) {
            *out = &g_modules[i];
            return CUDA_SUCCESS;
        }
        if (!g_modules[i].live && free_slot == DOUBLE_MAX_MODULES) {
            free_slot = i;
        }
    }
    if (free_slot == DOUBLE_MAX_MODULES) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    rc = load_locked(&g_modules[free_slot], ctx->device, ctx, lib->lazy ? lib->lazy_globals : 0);
    if (rc == CUDA_SUCCESS) {
        g_modules[free_slot].library = lib;
        *out = &g_modules[free_slot];
    }
    return rc;
}

/* Every name is a function of m; the same name gives the same handle. */
static CUresult function_get_locked(struct CUmod_st *m, const char *name, CUfunction *out) {
    size_t i, free_slot = DOUBLE_MAX_FUNCTIONS;
    if (*name == '\0' || strlen(name) >= FUNCTION_NAME_MAX) {
        return CUDA_ERROR_NOT_FOUND;
    }
    for (i = 0; i < DOUBLE_MAX_FUNCTIONS; i++) {
        if (g_functions[i].module == m && strcmp(g_functions[i].name, name) == 0) {
            *out = &g_functions[i];
            return CUDA_SUCCESS;
        }
        if (g_functions[i].module == NULL && free_slot == DOUBLE_MAX_FUNCTIONS) {
            free_slot = i;
        }
    }
    if (free_slot == DOUBLE_MAX_FUNCTIONS) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    g_functions[free_slot].module = m;
    g_functions[free_slot].launched = 0;
    snprintf(g_functions[free_slot].name, FUNCTION_NAME_MAX, "%s", name);
    *out = &g_functions[free_slot];
    return CUDA_SUCCESS;
}

/* The function of kernel k in ctx, after its library's first use there. */
static CUresult kernel_function_locked(const struct CUkern_st *k, CUcontext ctx,
                                       CUfunction *out) {
    struct CUmod_st *m = NULL;
    CUresult rc = library_module_locked(k->library, ctx, &m);
    return rc == CUDA_SUCCESS ? function_get_locked(m, k->name, out) : rc;
}

/* A kernel handle launched on h becomes its function in the stream's context
 * (the current one for the default streams). Anything else, a bad stream
 * included, is left for the launch to report. */
CUresult kernel_launch_function(CUfunction *f, CUstream h, int ptsz) {
    struct CUstream_st *s = NULL;
    const struct CUkern_st *k;
    CUdevice dev = 0;
    CUresult rc = CUDA_SUCCESS;
    lock();
    k = kernel_locked(*f);
    if (k != NULL && stream_locked(h, ptsz, &s, &dev) == CUDA_SUCCESS) {
        rc = kernel_function_locked(k, s != NULL && s->ctx != NULL ? s->ctx : t_current, f);
    }
    unlock();
    return rc;
}

CUresult impl_cuLibraryLoadData(CUlibrary *library, const void *code, CUjit_option *jitOptions,
                                void **jitOptionsValues, unsigned int numJitOptions,
                                CUlibraryOption *libraryOptions, void **libraryOptionValues,
                                unsigned int numLibraryOptions) {
    (void)jitOptions;
    (void)jitOptionsValues;
    (void)numJitOptions;
    (void)libraryOptions;
    (void)libraryOptionValues;
    (void)numLibraryOptions;
    return library_load(library, code, 1);
}

/* Only the file's first bytes are read: a text image's header. */
CUresult impl_cuLibraryLoadFromFile(CUlibrary *library, const char *fileName,
                                    CUjit_option *jitOptions, void **jitOptionsValues,
                                    unsigned int numJitOptions, CUlibraryOption *libraryOptions,
                                    void **libraryOptionValues, unsigned int numLibraryOptions) {
    char image[128];
    CUresult rc;
    (void)jitOptions;
    (void)jitOptionsValues;
    (void)numJitOptions;
    (void)libraryOptions;
    (void)libraryOptionValues;
    (void)numLibraryOptions;
    if (!double_initialized()) {
        return CUDA_ERROR_NOT_INITIALIZED;
    }
    rc = read_image(fileName, image, sizeof image);
    return rc == CUDA_SUCCESS ? library_load(library, image, 0) : rc;
}

CUresult impl_cuLibraryUnload(CUlibrary library) {
    struct CUlib_st *lib;
    CUresult rc = CUDA_SUCCESS;
    lock();
    lib = library_locked(library);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (lib == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        library_unload_locked(lib);
    }
    unlock();
    return rc;
}

/* Every name is a kernel of every library; the same name gives the same handle. */
CUresult impl_cuLibraryGetKernel(CUkernel *pKernel, CUlibrary library, const char *name) {
    struct CUlib_st *lib;
    CUresult rc = CUDA_ERROR_OUT_OF_MEMORY;
    size_t i, free_slot = DOUBLE_MAX_KERNELS;
    lock();
    lib = library_locked(library);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (pKernel == NULL || name == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (lib == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if (*name == '\0' || strlen(name) >= FUNCTION_NAME_MAX) {
        rc = CUDA_ERROR_NOT_FOUND;
    } else {
        for (i = 0; i < DOUBLE_MAX_KERNELS; i++) {
            if (g_kernels[i].library == lib && strcmp(g_kernels[i].name, name) == 0) {
                free_slot = i;
                break;
            }
            if (g_kernels[i].library == NULL && free_slot == DOUBLE_MAX_KERNELS) {
                free_slot = i;
            }
        }
        if (free_slot < DOUBLE_MAX_KERNELS) {
            g_kernels[free_slot].library = lib;
            snprintf(g_kernels[free_slot].name, FUNCTION_NAME_MAX, "%s", name);
            *pKernel = &g_kernels[free_slot];
            rc = CUDA_SUCCESS;
        }
    }
    unlock();
    return rc;
}

/* The library's module in the current context: its first use there. */
CUresult impl_cuLibraryGetModule(CUmodule *pMod, CUlibrary library) {
    struct CUlib_st *lib;
    struct CUmod_st *m = NULL;
    CUresult rc;
    lock();
    lib = library_locked(library);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (pMod == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (lib == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if ((rc = library_module_locked(lib, t_current, &m)) == CUDA_SUCCESS) {
        *pMod = m;
    }
    unlock();
    return rc;
}

/* As cuModuleGetGlobal_v2, after the library's first use in the current
 * context: a fat binary's globals there, a text image's with the library. */
CUresult impl_cuLibraryGetGlobal(CUdeviceptr *dptr, size_t *bytes, CUlibrary library,
                                 const char *name) {
    struct CUlib_st *lib;
    struct CUmod_st *m = NULL;
    CUresult rc;
    lock();
    lib = library_locked(library);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (lib == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if (name == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if ((rc = library_module_locked(lib, t_current, &m)) == CUDA_SUCCESS) {
        rc = global_locked(lib->lazy ? m : &lib->image, name, dptr, bytes);
    }
    unlock();
    return rc;
}

/* A kernel's library; anything else, a module's function included, is not a kernel. */
CUresult impl_cuKernelGetLibrary(CUlibrary *pLib, CUkernel kernel) {
    const struct CUkern_st *k;
    CUresult rc = CUDA_SUCCESS;
    lock();
    k = kernel_locked(kernel);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (pLib == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (k == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        *pLib = k->library;
    }
    unlock();
    return rc;
}

/* The kernel's function in the current context: its library's first use there. */
CUresult impl_cuKernelGetFunction(CUfunction *pFunc, CUkernel kernel) {
    const struct CUkern_st *k;
    CUresult rc;
    lock();
    k = kernel_locked(kernel);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (pFunc == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (k == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        rc = kernel_function_locked(k, t_current, pFunc);
    }
    unlock();
    return rc;
}

CUresult impl_cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
    struct CUmod_st *m;
    CUresult rc;
    lock();
    m = module_locked(hmod);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (hfunc == NULL || name == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (m == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        rc = function_get_locked(m, name, hfunc);
    }
    unlock();
    return rc;
}
