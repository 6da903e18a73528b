//! Detours of the calls that make the driver hold device memory no
//! allocation call names, and of those that give it back. The adapters read
//! the caller's out-pointers once the driver succeeded and hand typed values
//! to the policy in `ops`.

use std::ffi::{c_char, c_int, c_uint, c_void};

use super::ops;
use crate::error::{Pass, Result};
use crate::image;
use crate::sys::{
    CUdevice, CUfunction, CUgraph, CUgraphExec, CUkernel, CUlibrary, CUlimit, CUmemoryPool,
    CUmodule, CUresult,
};

gpushare_macros::detours! {
    /// Context limits, modules and libraries, graph memory and pools.
    pub static HELD_DETOURS;

    /// The device malloc heap, the printf FIFO and the thread stacks.
    optional fn cuCtxSetLimit(limit: CUlimit, size: usize) -> CUresult => ctx_set_limit;

    /// A module from a file: its globals are allocated as it loads.
    optional fn cuModuleLoad(module: *mut CUmodule, fname: *const c_char) -> CUresult
        => module_load;
    /// A module from an image.
    optional fn cuModuleLoadData(module: *mut CUmodule, image: *const c_void) -> CUresult
        => module_load_data;
    /// A module from an image, with JIT options.
    optional fn cuModuleLoadDataEx(
        module: *mut CUmodule,
        image: *const c_void,
        num_options: c_uint,
        options: *mut c_int,
        option_values: *mut *mut c_void,
    ) -> CUresult => module_load_data_ex;
    /// A module from a fat binary.
    optional fn cuModuleLoadFatBinary(module: *mut CUmodule, fat_cubin: *const c_void) -> CUresult
        => module_load_fat_binary;
    /// Gives a module's globals back.
    optional fn cuModuleUnload(module: CUmodule) -> CUresult => module_unload;

    /// A library from an image (how the runtime registers a program's
    /// kernels). On driver 580 a library takes its globals at its first use
    /// in a context, not here: its image is kept to reserve them then.
    /// Where it takes them here (eager loading), they are measured like a
    /// module's.
    optional fn cuLibraryLoadData(
        library: *mut CUlibrary,
        code: *const c_void,
        jit_options: *mut c_int,
        jit_option_values: *mut *mut c_void,
        num_jit_options: c_uint,
        library_options: *mut c_int,
        library_option_values: *mut *mut c_void,
        num_library_options: c_uint,
    ) -> CUresult => library_load_data;
    /// A library from a file: loaded into the current context at once.
    optional fn cuLibraryLoadFromFile(
        library: *mut CUlibrary,
        file_name: *const c_char,
        jit_options: *mut c_int,
        jit_option_values: *mut *mut c_void,
        num_jit_options: c_uint,
        library_options: *mut c_int,
        library_option_values: *mut *mut c_void,
        num_library_options: c_uint,
    ) -> CUresult => library_load_from_file;
    /// A library's globals are allocated when it is first used in a context:
    /// its global looked up here.
    optional fn cuLibraryGetGlobal(
        dptr: *mut u64,
        bytes: *mut usize,
        library: CUlibrary,
        name: *const c_char,
    ) -> CUresult => library_get_global;
    /// Loads a library into the current context (a first use).
    optional fn cuLibraryGetModule(module: *mut CUmodule, library: CUlibrary) -> CUresult
        => library_get_module;
    /// A kernel's function in the current context: its library's first use there.
    optional fn cuKernelGetFunction(function: *mut CUfunction, kernel: CUkernel) -> CUresult
        => kernel_get_function;
    /// Gives a library's globals back.
    optional fn cuLibraryUnload(library: CUlibrary) -> CUresult => library_unload;

    /// A graph exec: its allocation nodes' memory is taken at upload or launch.
    optional fn cuGraphInstantiateWithFlags(exec: *mut CUgraphExec, graph: CUgraph, flags: u64) -> CUresult
        => graph_instantiate;
    /// A graph exec, with instantiation parameters.
    optional ptsz fn cuGraphInstantiateWithParams(
        exec: *mut CUgraphExec,
        graph: CUgraph,
        params: *mut c_void,
    ) -> CUresult => graph_instantiate_with_params;
    /// Ends a graph exec's charge (its memory stays with the device's graph
    /// pool until trimmed).
    optional fn cuGraphExecDestroy(exec: CUgraphExec) -> CUresult => graph_exec_destroy;
    /// Gives the device's unused graph memory back.
    optional fn cuDeviceGraphMemTrim(device: CUdevice) -> CUresult => graph_mem_trim;

    /// A pool's release threshold decides what it keeps at synchronisations.
    optional fn cuMemPoolSetAttribute(pool: CUmemoryPool, attribute: c_int, setting: *mut c_void) -> CUresult
        => mem_pool_set_attribute;
    /// Gives a pool's unused memory back.
    optional fn cuMemPoolTrimTo(pool: CUmemoryPool, min_bytes_to_keep: usize) -> CUresult
        => mem_pool_trim_to;
    /// Gives a pool's memory back.
    optional fn cuMemPoolDestroy(pool: CUmemoryPool) -> CUresult => mem_pool_destroy;
}

fn ctx_set_limit(
    original: cuCtxSetLimit::Signature,
    limit: CUlimit,
    size: usize,
) -> Result<CUresult> {
    // SAFETY: the caller's limit, at the size asked or the one it had.
    ops::held()?.set_limit(limit, size, |size| unsafe { original(limit, size) })
}

/// Loads a module through `load`; past the quota, unloads it again.
fn loaded_module(module: *mut CUmodule, load: impl FnOnce() -> CUresult) -> Result<CUresult> {
    if module.is_null() {
        return Err(crate::error::LimiterError::Bypass(Pass::NullOutPointer));
    }
    let unload = || {
        // SAFETY: `module` was checked non-null and holds the module just loaded.
        let loaded = unsafe { module.read() };
        if let Some(unload) = cuModuleUnload::ORIGINAL.get() {
            // SAFETY: unloads the module this call loaded, through the original.
            let _ = unsafe { unload(loaded) };
        }
    };
    ops::held()?.load_module(load, unload)
}

/// Adapters whose original loads a module into `module`: each runs it
/// through [`loaded_module`] with the caller's own arguments.
macro_rules! module_loads {
    ($($adapter:ident: $api:ident($($arg:ident: $ty:ty),*);)*) => {$(
        fn $adapter(
            original: $api::Signature,
            module: *mut CUmodule,
            $($arg: $ty),*
        ) -> Result<CUresult> {
            // SAFETY: the caller's own arguments.
            loaded_module(module, || unsafe { original(module, $($arg),*) })
        }
    )*};
}

module_loads! {
    module_load: cuModuleLoad(fname: *const c_char);
    module_load_data: cuModuleLoadData(image: *const c_void);
    module_load_data_ex: cuModuleLoadDataEx(
        image: *const c_void,
        num_options: c_uint,
        options: *mut c_int,
        option_values: *mut *mut c_void
    );
    module_load_fat_binary: cuModuleLoadFatBinary(fat_cubin: *const c_void);
}

fn module_unload(original: cuModuleUnload::Signature, module: CUmodule) -> Result<CUresult> {
    // SAFETY: the caller's own argument.
    ops::held()?.unload_module(|| unsafe { original(module) })
}

/// How a library is loaded.
enum LibraryFrom {
    /// From a file: at once into the current context.
    File,
    /// From the caller's image, at this address.
    Image(*const c_void),
}

/// Loads a library through `load`; past the quota, unloads it again.
fn loaded_library(
    library: *mut CUlibrary,
    from: LibraryFrom,
    load: impl FnOnce() -> CUresult,
) -> Result<CUresult> {
    if library.is_null() {
        return Err(crate::error::LimiterError::Bypass(Pass::NullOutPointer));
    }
    // SAFETY: `library` is non-null and holds the library once loaded.
    let loaded = || unsafe { library.read() };
    let unload = || {
        if let Some(unload) = cuLibraryUnload::ORIGINAL.get() {
            // SAFETY: unloads the library this call loaded, through the original.
            let _ = unsafe { unload(loaded()) };
        }
    };
    let held = ops::held()?;
    match from {
        LibraryFrom::File => held.load_library_file(load, loaded, unload),
        LibraryFrom::Image(code) => {
            let code = code.cast::<u8>();
            // SAFETY: the caller's image, which the driver is about to read
            // as one of the formats `extent` reads; it stays valid while
            // the library is loaded when it lies in a loaded object.
            let image =
                unsafe { image::extent(code) }.map(|bytes| (bytes, image::in_loaded_object(code)));
            held.load_library_data(image, load, loaded, unload)
        }
    }
}

/// Adapters whose original loads a library into `library` from `$source`
/// (with the JIT and library options): each runs it through
/// [`loaded_library`] with the caller's own arguments.
macro_rules! library_loads {
    ($($adapter:ident: $api:ident($source:ident: $source_ty:ty) from $from:expr;)*) => {$(
        #[allow(clippy::too_many_arguments)]
        fn $adapter(
            original: $api::Signature,
            library: *mut CUlibrary,
            $source: $source_ty,
            jit_options: *mut c_int,
            jit_option_values: *mut *mut c_void,
            num_jit_options: c_uint,
            library_options: *mut c_int,
            library_option_values: *mut *mut c_void,
            num_library_options: c_uint,
        ) -> Result<CUresult> {
            // SAFETY: the caller's own arguments.
            loaded_library(library, $from, || unsafe {
                original(
                    library,
                    $source,
                    jit_options,
                    jit_option_values,
                    num_jit_options,
                    library_options,
                    library_option_values,
                    num_library_options,
                )
            })
        }
    )*};
}

library_loads! {
    library_load_data: cuLibraryLoadData(code: *const c_void) from LibraryFrom::Image(code);
    library_load_from_file: cuLibraryLoadFromFile(file_name: *const c_char) from LibraryFrom::File;
}

fn library_get_global(
    original: cuLibraryGetGlobal::Signature,
    dptr: *mut u64,
    bytes: *mut usize,
    library: CUlibrary,
    name: *const c_char,
) -> Result<CUresult> {
    // SAFETY: the caller's own arguments.
    ops::held()?.first_use(library, || unsafe { original(dptr, bytes, library, name) })
}

fn library_get_module(
    original: cuLibraryGetModule::Signature,
    module: *mut CUmodule,
    library: CUlibrary,
) -> Result<CUresult> {
    // SAFETY: the caller's own arguments.
    ops::held()?.first_use(library, || unsafe { original(module, library) })
}

fn kernel_get_function(
    original: cuKernelGetFunction::Signature,
    function: *mut CUfunction,
    kernel: CUkernel,
) -> Result<CUresult> {
    // SAFETY: the caller's own arguments.
    ops::held()?.kernel_function(kernel, || unsafe { original(function, kernel) })
}

fn library_unload(original: cuLibraryUnload::Signature, library: CUlibrary) -> Result<CUresult> {
    // SAFETY: the caller's own argument.
    ops::held()?.unload_library(library, || unsafe { original(library) })
}

/// Instantiates through `instantiate`, charging the graph's allocation nodes.
fn instantiated(
    exec: *mut CUgraphExec,
    graph: CUgraph,
    instantiate: impl FnOnce() -> CUresult,
) -> Result<CUresult> {
    if exec.is_null() {
        return Err(crate::error::LimiterError::Bypass(Pass::NullOutPointer));
    }
    // SAFETY: exec is non-null, and written by the call that succeeded.
    let made = || unsafe { exec.read() } as usize;
    ops::held()?.instantiate(graph, instantiate, made)
}

fn graph_instantiate(
    original: cuGraphInstantiateWithFlags::Signature,
    exec: *mut CUgraphExec,
    graph: CUgraph,
    flags: u64,
) -> Result<CUresult> {
    // SAFETY: the caller's own arguments.
    instantiated(exec, graph, || unsafe { original(exec, graph, flags) })
}

fn graph_instantiate_with_params<const PER_THREAD: bool>(
    original: cuGraphInstantiateWithParams::Signature,
    exec: *mut CUgraphExec,
    graph: CUgraph,
    params: *mut c_void,
) -> Result<CUresult> {
    // SAFETY: the caller's own arguments.
    instantiated(exec, graph, || unsafe { original(exec, graph, params) })
}

fn graph_exec_destroy(
    original: cuGraphExecDestroy::Signature,
    exec: CUgraphExec,
) -> Result<CUresult> {
    // SAFETY: the caller's own argument.
    ops::held()?.destroy_exec(exec as usize, || unsafe { original(exec) })
}

fn graph_mem_trim(original: cuDeviceGraphMemTrim::Signature, device: CUdevice) -> Result<CUresult> {
    // SAFETY: the caller's own argument.
    ops::held()?.release(|| unsafe { original(device) })
}

fn mem_pool_set_attribute(
    original: cuMemPoolSetAttribute::Signature,
    pool: CUmemoryPool,
    attribute: c_int,
    setting: *mut c_void,
) -> Result<CUresult> {
    // SAFETY: the caller's own arguments.
    ops::held()?.pool_changed(pool, || unsafe { original(pool, attribute, setting) })
}

fn mem_pool_trim_to(
    original: cuMemPoolTrimTo::Signature,
    pool: CUmemoryPool,
    min_bytes_to_keep: usize,
) -> Result<CUresult> {
    // SAFETY: the caller's own arguments.
    ops::held()?.pool_changed(pool, || unsafe { original(pool, min_bytes_to_keep) })
}

fn mem_pool_destroy(original: cuMemPoolDestroy::Signature, pool: CUmemoryPool) -> Result<CUresult> {
    // SAFETY: the caller's own argument.
    ops::held()?.destroy_pool(pool, || unsafe { original(pool) })
}

/// Gives back what `pool` keeps unused (`cuMemPoolTrimTo(pool, 0)`, the
/// original), for an allocation from it that the quota refuses.
pub(crate) fn trim_unused(pool: CUmemoryPool) {
    if let Some(trim) = cuMemPoolTrimTo::ORIGINAL.get() {
        // SAFETY: a pool the caller allocates from; keeping nothing unused.
        let result = unsafe { trim(pool, 0) };
        if !result.is_success() {
            tracing::debug!(?result, "a pool could not be trimmed");
        }
    }
}
