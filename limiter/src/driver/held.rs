//! What the driver reports about memory it holds for the process outside
//! allocations: context limits, the allocation nodes of a graph, what
//! memory pools reserve, and the real free memory of the current device.

use std::ffi::{c_int, c_void};

use super::{DriverError, symbol};
use crate::sys::{
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT, CU_GRAPH_NODE_TYPE_GRAPH, CU_GRAPH_NODE_TYPE_MEM_ALLOC,
    CU_MEM_LOCATION_TYPE_DEVICE, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, CUDA_MEM_ALLOC_NODE_PARAMS,
    CUcontext, CUdevice, CUgraph, CUgraphNode, CUkernel, CUlibrary, CUlimit, CUmemoryPool,
    CUmodule, CuCtxGetCurrent, CuCtxGetLimit, CuDeviceGetAttribute, CuDeviceGetGraphMemAttribute,
    CuDeviceGetMemPool, CuGraphChildGraphNodeGetGraph, CuGraphGetNodes,
    CuGraphMemAllocNodeGetParams, CuGraphNodeGetType, CuKernelGetLibrary, CuLibraryGetModule,
    CuMemPoolGetAttribute,
};

/// How deep child graphs are followed; deeper ones count as refused.
const MAX_GRAPH_DEPTH: usize = 16;

/// Queries about driver-held memory; each part is absent from drivers that
/// lack it.
pub(crate) struct Held {
    ctx_get_limit: Option<CuCtxGetLimit>,
    device_attribute: Option<CuDeviceGetAttribute>,
    graph_mem_attribute: Option<CuDeviceGetGraphMemAttribute>,
    library_get_module: Option<CuLibraryGetModule>,
    kernel_get_library: Option<CuKernelGetLibrary>,
    ctx_get_current: Option<CuCtxGetCurrent>,
    pool_attribute: Option<CuMemPoolGetAttribute>,
    device_pool: Option<CuDeviceGetMemPool>,
    graph: Option<GraphQueries>,
}

struct GraphQueries {
    get_nodes: CuGraphGetNodes,
    node_type: CuGraphNodeGetType,
    alloc_params: CuGraphMemAllocNodeGetParams,
    child: Option<CuGraphChildGraphNodeGetGraph>,
}

/// The device memory a graph's allocation nodes take when it runs.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct GraphAllocations {
    /// Bytes by the device the nodes name; `None`: the node names none.
    pub by_device: Vec<(Option<CUdevice>, u64)>,
}

impl GraphAllocations {
    fn add(&mut self, device: Option<CUdevice>, bytes: u64) {
        match self.by_device.iter_mut().find(|(d, _)| *d == device) {
            Some((_, total)) => *total = total.saturating_add(bytes),
            None => self.by_device.push((device, bytes)),
        }
    }
}

impl Held {
    /// # Safety
    ///
    /// `handle` is a loaded libcuda.
    pub(super) unsafe fn load(handle: *mut c_void) -> Self {
        // SAFETY: the types are the driver's signatures for these symbols.
        unsafe {
            let graph = match (
                symbol(handle, c"cuGraphGetNodes"),
                symbol(handle, c"cuGraphNodeGetType"),
                symbol(handle, c"cuGraphMemAllocNodeGetParams"),
            ) {
                (Some(get_nodes), Some(node_type), Some(alloc_params)) => Some(GraphQueries {
                    get_nodes,
                    node_type,
                    alloc_params,
                    child: symbol(handle, c"cuGraphChildGraphNodeGetGraph"),
                }),
                _ => None,
            };
            Self {
                ctx_get_limit: symbol(handle, c"cuCtxGetLimit"),
                device_attribute: symbol(handle, c"cuDeviceGetAttribute"),
                graph_mem_attribute: symbol(handle, c"cuDeviceGetGraphMemAttribute"),
                library_get_module: symbol(handle, c"cuLibraryGetModule"),
                kernel_get_library: symbol(handle, c"cuKernelGetLibrary"),
                ctx_get_current: symbol(handle, c"cuCtxGetCurrent"),
                pool_attribute: symbol(handle, c"cuMemPoolGetAttribute"),
                device_pool: symbol(handle, c"cuDeviceGetMemPool"),
                graph,
            }
        }
    }

    /// The current context's value of `limit`.
    pub(crate) fn limit(&self, limit: CUlimit) -> Result<usize, DriverError> {
        let get = self.ctx_get_limit.ok_or(DriverError::NOT_FOUND)?;
        let mut value = 0usize;
        // SAFETY: a valid out-pointer.
        unsafe { get(&mut value, limit) }.result()?;
        Ok(value)
    }

    /// How many threads `device` keeps a stack for: every resident one.
    pub(crate) fn resident_threads(&self, device: CUdevice) -> Option<u64> {
        let positive = |which| self.attribute(device, which).filter(|&value| value > 0);
        Some(
            positive(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
                * positive(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR)?,
        )
    }

    /// `device`'s attribute `which`, when the driver answers it.
    fn attribute(&self, device: CUdevice, which: c_int) -> Option<u64> {
        let attribute = self.device_attribute?;
        let mut value = 0;
        // SAFETY: a valid out-pointer.
        let result = unsafe { attribute(&mut value, which, device) };
        (result.is_success() && value >= 0).then_some(value as u64)
    }

    /// What `device`'s graph memory pool holds for this process.
    pub(crate) fn graph_reserved(&self, device: CUdevice) -> Option<u64> {
        let attribute = self.graph_mem_attribute?;
        let mut value = 0u64;
        // SAFETY: the attribute is a cuuint64_t written through the pointer.
        let result = unsafe {
            attribute(
                device,
                CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT,
                (&raw mut value).cast(),
            )
        };
        result.is_success().then_some(value)
    }

    /// What `pool` reserves on its device, freed memory it keeps included.
    pub(crate) fn pool_reserved(&self, pool: CUmemoryPool) -> Option<u64> {
        let attribute = self.pool_attribute?;
        let mut value = 0u64;
        // SAFETY: the attribute is a cuuint64_t written through the pointer;
        // an invalid pool is refused.
        let result = unsafe {
            attribute(
                pool,
                CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                (&raw mut value).cast(),
            )
        };
        result.is_success().then_some(value)
    }

    /// The pool `cuMemAllocAsync` takes from on `device`: its current one.
    pub(crate) fn current_pool(&self, device: CUdevice) -> Option<CUmemoryPool> {
        let get = self.device_pool?;
        let mut pool: CUmemoryPool = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; an invalid device is refused.
        let result = unsafe { get(&mut pool, device) };
        (result.is_success() && !pool.is_null()).then_some(pool)
    }

    /// Loads `library` into the current context now, its globals with it,
    /// where lazy loading would at its first use there.
    pub(crate) fn load_into_context(&self, library: CUlibrary) -> Result<(), DriverError> {
        let get = self.library_get_module.ok_or(DriverError::NOT_FOUND)?;
        let mut module: CUmodule = std::ptr::null_mut();
        // SAFETY: a library just loaded and a valid out-pointer.
        unsafe { get(&mut module, library) }.result()
    }

    /// The library of `kernel`, when it is a library's kernel (the
    /// runtime's launches); a module's function is not.
    /// A null library from a call that succeeded is `NOT_FOUND`.
    pub(crate) fn kernel_library(&self, kernel: CUkernel) -> Result<CUlibrary, DriverError> {
        let get = self.kernel_get_library.ok_or(DriverError::NOT_FOUND)?;
        let mut library: CUlibrary = std::ptr::null_mut();
        // SAFETY: any handle value is accepted (an invalid one is refused)
        // and a valid out-pointer.
        unsafe { get(&mut library, kernel) }.result()?;
        if library.is_null() {
            return Err(DriverError::NOT_FOUND);
        }
        Ok(library)
    }

    /// The calling thread's current context (null: none).
    pub(crate) fn current_context(&self) -> Result<CUcontext, DriverError> {
        let get = self.ctx_get_current.ok_or(DriverError::NOT_FOUND)?;
        let mut context: CUcontext = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        unsafe { get(&mut context) }.result()?;
        Ok(context)
    }

    /// `device`'s compute capability as major × 10 + minor (90: sm_90).
    pub(crate) fn compute_capability(&self, device: CUdevice) -> Option<u32> {
        let major = self.attribute(device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = self.attribute(device, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        u32::try_from(major * 10 + minor).ok()
    }

    /// What `graph`'s allocation nodes (its child graphs' included) take.
    pub(crate) fn graph_allocations(
        &self,
        graph: CUgraph,
    ) -> Result<GraphAllocations, DriverError> {
        let queries = self.graph.as_ref().ok_or(DriverError::NOT_FOUND)?;
        let mut found = GraphAllocations::default();
        queries.walk(graph, 0, &mut found)?;
        Ok(found)
    }
}

impl GraphQueries {
    fn walk(
        &self,
        graph: CUgraph,
        depth: usize,
        found: &mut GraphAllocations,
    ) -> Result<(), DriverError> {
        if depth > MAX_GRAPH_DEPTH {
            return Err(DriverError::INVALID_VALUE);
        }
        let mut count = 0usize;
        // SAFETY: a null array asks for the count alone.
        unsafe { (self.get_nodes)(graph, std::ptr::null_mut(), &mut count) }.result()?;
        let mut nodes: Vec<CUgraphNode> = vec![std::ptr::null_mut(); count];
        // SAFETY: room for `count` nodes; the driver writes at most that many.
        unsafe { (self.get_nodes)(graph, nodes.as_mut_ptr(), &mut count) }.result()?;
        nodes.truncate(count);
        for node in nodes {
            let mut kind = 0;
            // SAFETY: a node of the graph and a valid out-pointer.
            unsafe { (self.node_type)(node, &mut kind) }.result()?;
            if kind == CU_GRAPH_NODE_TYPE_MEM_ALLOC {
                let mut params = CUDA_MEM_ALLOC_NODE_PARAMS::default();
                // SAFETY: an allocation node and a valid out-pointer of its type.
                unsafe { (self.alloc_params)(node, &mut params) }.result()?;
                let location = params.pool_props.location;
                let device = (location.type_ == CU_MEM_LOCATION_TYPE_DEVICE).then_some(location.id);
                found.add(device, params.bytesize as u64);
            } else if kind == CU_GRAPH_NODE_TYPE_GRAPH
                && let Some(child) = self.child
            {
                let mut inner: CUgraph = std::ptr::null_mut();
                // SAFETY: a child-graph node and a valid out-pointer.
                unsafe { child(node, &mut inner) }.result()?;
                self.walk(inner, depth + 1, found)?;
            }
        }
        Ok(())
    }
}
