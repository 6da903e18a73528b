/*
 * Graphs of the double (the model is in cuda.c): graphs and their nodes
 * (made by the graph API or by stream capture), graph execs, and graph
 * memory: an exec's need reserved at its first upload or launch, retained
 * after it until trimmed.
 */
#include "double_internal.h"

#define DOUBLE_MAX_EXECS 256

struct CUgraphExec_st {
    int live;
    int reserved; /* its need is charged */
    unsigned long long ns;
    unsigned long long kernels;
    unsigned long long need[DOUBLE_MAX_DEVICES]; /* its graph's alloc nodes, per GPU */
};

struct CUgraph_st g_graphs[DOUBLE_MAX_GRAPHS];
static struct CUgraphExec_st g_execs[DOUBLE_MAX_EXECS];
static unsigned g_graph_serial;

static struct CUgraph_st *graph_locked(CUgraph g) {
    long i = SLOT(g_graphs, g);
    return i >= 0 && g_graphs[i].live ? &g_graphs[i] : NULL;
}

static struct CUgraphExec_st *exec_locked(CUgraphExec e) {
    long i = SLOT(g_execs, e);
    return i >= 0 && g_execs[i].live ? &g_execs[i] : NULL;
}

/* A new empty graph on dev, or NULL when every slot is taken. */
struct CUgraph_st *graph_new_locked(int dev) {
    size_t i;
    for (i = 0; i < DOUBLE_MAX_GRAPHS; i++) {
        struct CUgraph_st *g = &g_graphs[i];
        if (!g->live) {
            memset(g, 0, sizeof *g);
            g->live = 1;
            if (++g_graph_serial == 0) {
                g_graph_serial = 1;
            }
            g->serial = g_graph_serial;
            g->device = dev;
            return g;
        }
    }
    return NULL;
}

void graph_free_locked(struct CUgraph_st *g) {
    free(g->nodes);
    memset(g, 0, sizeof *g);
}

/* A node's handle: its graph's serial and its index + 1, never dereferenced. */
static CUgraphNode node_handle(const struct CUgraph_st *g, size_t index) {
    return (CUgraphNode)(uintptr_t)((unsigned long long)g->serial << 32 | (index + 1));
}

/* The node a handle names (its graph in *graph), or NULL. */
static struct node *node_locked(CUgraphNode h, struct CUgraph_st **graph) {
    unsigned long long v = (uintptr_t)h;
    unsigned serial = (unsigned)(v >> 32);
    unsigned long long index = v & 0xffffffffULL;
    size_t i;
    if (serial == 0 || index == 0) {
        return NULL;
    }
    for (i = 0; i < DOUBLE_MAX_GRAPHS; i++) {
        struct CUgraph_st *g = &g_graphs[i];
        if (g->live && g->serial == serial) {
            if (index > g->node_len) {
                return NULL;
            }
            *graph = g;
            return &g->nodes[index - 1];
        }
    }
    return NULL;
}

/* Appends n to g; its handle in *out unless out is NULL. */
CUresult graph_add_locked(struct CUgraph_st *g, struct node n, CUgraphNode *out) {
    if (g->node_len == g->node_cap) {
        size_t cap = g->node_cap ? g->node_cap * 2 : 16;
        struct node *grown = realloc(g->nodes, cap * sizeof *grown);
        if (grown == NULL) {
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        g->nodes = grown;
        g->node_cap = cap;
    }
    g->nodes[g->node_len++] = n;
    if (out != NULL) {
        *out = node_handle(g, g->node_len - 1);
    }
    return CUDA_SUCCESS;
}

/* An alloc node of `size` bytes on dev: a fixed address, nothing charged. */
CUresult graph_alloc_node_locked(struct CUgraph_st *g, int dev, unsigned long long size,
                                 unsigned long long *addr, CUgraphNode *out) {
    struct node n = {CU_GRAPH_NODE_TYPE_MEM_ALLOC, dev, size, 0};
    CUresult rc;
    if (size == 0) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    rc = bump_locked(&g_devices[dev].graph_next, region_start(dev) + GLOBALS_OFFSET, size,
                     &n.addr);
    if (rc == CUDA_SUCCESS) {
        rc = graph_add_locked(g, n, out);
    }
    if (rc == CUDA_SUCCESS) {
        *addr = n.addr;
    }
    return rc;
}

/* A free node of addr, which must come from an alloc node. */
CUresult graph_free_node_locked(struct CUgraph_st *g, unsigned long long addr,
                                CUgraphNode *out) {
    struct node n = {CU_GRAPH_NODE_TYPE_MEM_FREE, 0, 0, addr};
    int dev;
    if (addr < REGION_BASE) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    dev = (int)((addr - REGION_BASE) / REGION_SIZE);
    if (dev >= g_config.devices || addr < region_start(dev) + GRAPH_OFFSET ||
        addr >= g_devices[dev].graph_next) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    n.device = dev;
    return graph_add_locked(g, n, out);
}

/* Charges an exec's need at its first upload or launch, if it fits. */
static CUresult exec_reserve_locked(struct CUgraphExec_st *e) {
    int dev;
    if (e->reserved) {
        return CUDA_SUCCESS;
    }
    for (dev = 0; dev < g_config.devices; dev++) {
        unsigned long long retained = g_devices[dev].graph_retained;
        unsigned long long reuse = retained < e->need[dev] ? retained : e->need[dev];
        if (e->need[dev] > 0 && !fits(dev, e->need[dev] - reuse)) {
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    for (dev = 0; dev < g_config.devices; dev++) {
        struct device *d = &g_devices[dev];
        d->graph_retained -= d->graph_retained < e->need[dev] ? d->graph_retained : e->need[dev];
        d->graph_bytes += e->need[dev];
    }
    e->reserved = 1;
    return CUDA_SUCCESS;
}

static CUresult check_exec(const void *e) {
    return exec_locked((CUgraphExec)(uintptr_t)e) != NULL ? CUDA_SUCCESS
                                                         : CUDA_ERROR_INVALID_HANDLE;
}

/*
 * Before an exec first runs on the stream h, its need is reserved (not when
 * its launch is captured into another graph). Bad handles are left for the
 * launch to report.
 */
static CUresult exec_prepare(CUgraphExec e, CUstream h, int ptsz) {
    struct CUstream_st *s = NULL;
    struct CUgraphExec_st *x;
    CUdevice dev = 0;
    CUresult rc = CUDA_SUCCESS;
    lock();
    x = exec_locked(e);
    if (x != NULL && stream_locked(h, ptsz, &s, &dev) == CUDA_SUCCESS &&
        (s == NULL || s->capture == NULL)) {
        rc = exec_reserve_locked(x);
    }
    unlock();
    return rc;
}

static CUresult graph_launch(CUgraphExec e, CUstream h, int ptsz) {
    unsigned long long ns = 0, kernels = 0;
    CUresult rc = exec_prepare(e, h, ptsz);
    if (rc != CUDA_SUCCESS) {
        return rc;
    }
    lock();
    if (exec_locked(e) != NULL) {
        ns = e->ns;
        kernels = e->kernels;
    }
    unlock();
    return enqueue(h, ptsz, ns, kernels, CU_GRAPH_NODE_TYPE_GRAPH, check_exec, (const void *)e, 1);
}

CUresult impl_cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) {
    return graph_launch(hGraphExec, hStream, 0);
}

CUresult impl_cuGraphLaunch_ptsz(CUgraphExec hGraphExec, CUstream hStream) {
    return graph_launch(hGraphExec, hStream, 1);
}

/* An upload runs nothing: it reserves the exec's graph memory. */
static CUresult graph_upload(CUgraphExec e, CUstream h, int ptsz) {
    struct CUstream_st *s = NULL;
    CUdevice dev = 0;
    CUresult rc;
    lock();
    rc = stream_locked(h, ptsz, &s, &dev);
    if (rc == CUDA_SUCCESS && exec_locked(e) == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if (rc == CUDA_SUCCESS) {
        rc = exec_reserve_locked(e);
    }
    unlock();
    return rc;
}

CUresult impl_cuGraphUpload(CUgraphExec hGraphExec, CUstream hStream) {
    return graph_upload(hGraphExec, hStream, 0);
}

CUresult impl_cuGraphUpload_ptsz(CUgraphExec hGraphExec, CUstream hStream) {
    return graph_upload(hGraphExec, hStream, 1);
}

/* A new exec of g: its kernels, and the need of its alloc nodes per GPU. */
static CUresult instantiate_locked(CUgraphExec *out, const struct CUgraph_st *g) {
    size_t i, k;
    for (i = 0; i < DOUBLE_MAX_EXECS; i++) {
        struct CUgraphExec_st *e = &g_execs[i];
        if (!e->live) {
            memset(e, 0, sizeof *e);
            e->live = 1;
            e->ns = g->ns;
            e->kernels = g->kernels;
            for (k = 0; k < g->node_len; k++) {
                const struct node *n = &g->nodes[k];
                if (n->type == CU_GRAPH_NODE_TYPE_MEM_ALLOC) {
                    e->need[n->device] = add_sat(e->need[n->device], n->bytes);
                }
            }
            *out = e;
            return CUDA_SUCCESS;
        }
    }
    return CUDA_ERROR_OUT_OF_MEMORY;
}

CUresult impl_cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph,
                                          unsigned long long flags) {
    CUresult rc;
    struct CUgraph_st *g;
    lock();
    g = graph_locked(hGraph);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (phGraphExec == NULL || (flags & ~0xfULL) != 0) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (g == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        rc = instantiate_locked(phGraphExec, g);
    }
    unlock();
    return rc;
}

/* With CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD the exec's need is reserved at
 * once; when it does not fit, no exec is made. */
CUresult impl_cuGraphInstantiateWithParams(CUgraphExec *phGraphExec, CUgraph hGraph,
                                           CUDA_GRAPH_INSTANTIATE_PARAMS *instantiateParams) {
    CUDA_GRAPH_INSTANTIATE_PARAMS *params = instantiateParams;
    CUresult rc;
    struct CUgraph_st *g;
    lock();
    g = graph_locked(hGraph);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (phGraphExec == NULL || params == NULL || (params->flags & ~0xfULL) != 0) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (g == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        rc = instantiate_locked(phGraphExec, g);
        if (rc == CUDA_SUCCESS && (params->flags & CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD)) {
            rc = exec_reserve_locked(*phGraphExec);
            if (rc != CUDA_SUCCESS) {
                (*phGraphExec)->live = 0;
                *phGraphExec = NULL;
            }
        }
        params->hErrNode_out = NULL;
        params->result_out =
            rc == CUDA_SUCCESS ? CUDA_GRAPH_INSTANTIATE_SUCCESS : CUDA_GRAPH_INSTANTIATE_ERROR;
    }
    unlock();
    return rc;
}

/* A reserved exec's graph memory stays with its GPU, retained for reuse. */
CUresult impl_cuGraphExecDestroy(CUgraphExec hGraphExec) {
    CUresult rc = CUDA_SUCCESS;
    struct CUgraphExec_st *e;
    int dev;
    lock();
    e = exec_locked(hGraphExec);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (e == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        for (dev = 0; e->reserved && dev < g_config.devices; dev++) {
            g_devices[dev].graph_bytes -= e->need[dev];
            g_devices[dev].graph_retained += e->need[dev];
        }
        e->live = 0;
    }
    unlock();
    return rc;
}

CUresult impl_cuGraphDestroy(CUgraph hGraph) {
    CUresult rc = CUDA_SUCCESS;
    struct CUgraph_st *g;
    lock();
    g = graph_locked(hGraph);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (g == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else {
        graph_free_locked(g);
    }
    unlock();
    return rc;
}

CUresult impl_cuGraphCreate(CUgraph *phGraph, unsigned int flags) {
    CUresult rc = CUDA_SUCCESS;
    struct CUgraph_st *g;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (phGraph == NULL || flags != 0) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if ((g = graph_new_locked(context_alive(t_current) ? t_current->device : 0)) == NULL) {
        rc = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        *phGraph = g;
    }
    unlock();
    return rc;
}

/* A node's dependencies must be nodes of its graph. */
static CUresult dependencies_locked(const struct CUgraph_st *g, const CUgraphNode *deps,
                                    size_t count) {
    struct CUgraph_st *owner = NULL;
    size_t i;
    if (count > 0 && deps == NULL) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (i = 0; i < count; i++) {
        if (node_locked(deps[i], &owner) == NULL || owner != g) {
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    return CUDA_SUCCESS;
}

CUresult impl_cuGraphAddMemAllocNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                     const CUgraphNode *dependencies, size_t numDependencies,
                                     CUDA_MEM_ALLOC_NODE_PARAMS *nodeParams) {
    CUDA_MEM_ALLOC_NODE_PARAMS *p = nodeParams;
    CUresult rc;
    struct CUgraph_st *g;
    unsigned long long addr = 0;
    lock();
    g = graph_locked(hGraph);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (phGraphNode == NULL || p == NULL ||
               p->poolProps.allocType != CU_MEM_ALLOCATION_TYPE_PINNED ||
               p->poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (g == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if (!valid_device(p->poolProps.location.id)) {
        rc = CUDA_ERROR_INVALID_DEVICE;
    } else if ((rc = dependencies_locked(g, dependencies, numDependencies)) == CUDA_SUCCESS) {
        rc = graph_alloc_node_locked(g, p->poolProps.location.id, p->bytesize, &addr,
                                     phGraphNode);
        if (rc == CUDA_SUCCESS) {
            p->dptr = addr;
        }
    }
    unlock();
    return rc;
}

CUresult impl_cuGraphAddMemFreeNode(CUgraphNode *phGraphNode, CUgraph hGraph,
                                    const CUgraphNode *dependencies, size_t numDependencies,
                                    CUdeviceptr dptr) {
    CUresult rc;
    struct CUgraph_st *g;
    lock();
    g = graph_locked(hGraph);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (phGraphNode == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (g == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if ((rc = dependencies_locked(g, dependencies, numDependencies)) == CUDA_SUCCESS) {
        rc = graph_free_node_locked(g, dptr, phGraphNode);
    }
    unlock();
    return rc;
}

/* In the order they were added; past the graph's nodes, NULL entries. */
CUresult impl_cuGraphGetNodes(CUgraph hGraph, CUgraphNode *nodes, size_t *numNodes) {
    CUresult rc = CUDA_SUCCESS;
    struct CUgraph_st *g;
    size_t i, n;
    lock();
    g = graph_locked(hGraph);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (numNodes == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (g == NULL) {
        rc = CUDA_ERROR_INVALID_HANDLE;
    } else if (nodes == NULL) {
        *numNodes = g->node_len;
    } else {
        n = *numNodes < g->node_len ? *numNodes : g->node_len;
        for (i = 0; i < *numNodes; i++) {
            nodes[i] = i < n ? node_handle(g, i) : NULL;
        }
        *numNodes = n;
    }
    unlock();
    return rc;
}

CUresult impl_cuGraphNodeGetType(CUgraphNode hNode, CUgraphNodeType *type) {
    CUresult rc = CUDA_SUCCESS;
    struct CUgraph_st *g = NULL;
    struct node *n;
    lock();
    n = node_locked(hNode, &g);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (type == NULL || n == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        *type = n->type;
    }
    unlock();
    return rc;
}

CUresult impl_cuGraphMemAllocNodeGetParams(CUgraphNode hNode,
                                           CUDA_MEM_ALLOC_NODE_PARAMS *params_out) {
    CUresult rc = CUDA_SUCCESS;
    struct CUgraph_st *g = NULL;
    struct node *n;
    lock();
    n = node_locked(hNode, &g);
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (params_out == NULL || n == NULL || n->type != CU_GRAPH_NODE_TYPE_MEM_ALLOC) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else {
        memset(params_out, 0, sizeof *params_out);
        params_out->poolProps.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
        params_out->poolProps.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        params_out->poolProps.location.id = n->device;
        params_out->bytesize = (size_t)n->bytes;
        params_out->dptr = n->addr;
    }
    unlock();
    return rc;
}

/* Gives back the GPU's retained graph memory; reservations stay. */
CUresult impl_cuDeviceGraphMemTrim(CUdevice device) {
    CUresult rc = CUDA_SUCCESS;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (!valid_device(device)) {
        rc = CUDA_ERROR_INVALID_DEVICE;
    } else {
        g_devices[device].graph_retained = 0;
    }
    unlock();
    return rc;
}

/*
 * CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT (0) and RESERVED_MEM_CURRENT (2): what
 * live execs reserved, and that plus what destroyed ones left until trimmed
 * (a cuuint64_t through value). The high watermarks are not kept.
 */
CUresult impl_cuDeviceGetGraphMemAttribute(CUdevice device, CUgraphMem_attribute attr, void *value) {
    CUresult rc = CUDA_SUCCESS;
    lock();
    if (!g_initialized) {
        rc = CUDA_ERROR_NOT_INITIALIZED;
    } else if (!valid_device(device)) {
        rc = CUDA_ERROR_INVALID_DEVICE;
    } else if (value == NULL) {
        rc = CUDA_ERROR_INVALID_VALUE;
    } else if (attr == CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT) {
        *(unsigned long long *)value = g_devices[device].graph_bytes;
    } else if (attr == CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT) {
        *(unsigned long long *)value =
            add_sat(g_devices[device].graph_bytes, g_devices[device].graph_retained);
    } else {
        rc = CUDA_ERROR_INVALID_VALUE;
    }
    unlock();
    return rc;
}
