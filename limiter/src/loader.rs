//! Catching the driver libraries as they are mapped, and installing the
//! detours into them.
//!
//! A program that links libcuda has it mapped before our constructor runs; one
//! that loads it late (static cudart, PyTorch, `ctypes`) does so with
//! `dlopen`. The limiter exports `dlopen` (and only that): after the real
//! `dlopen` returns, and before the caller sees the handle, any newly mapped
//! libcuda / libnvidia-ml is patched. A process that never loads them pays one
//! `RTLD_NOLOAD` probe per `dlopen`, and nothing at start.
//!
//! `dlopen` searches the *caller's* `DT_RPATH`/`DT_RUNPATH`, found from its
//! return address. Forwarding from here would make us the caller, so the
//! exported symbol is a naked thunk that passes the caller's return address
//! along, and [`open_as_caller`] searches the caller's paths the way ld.so
//! would before falling back to the system search.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use gpushare_hook::{self as hook, HookEntry};

use crate::detour;
use crate::driver::Driver;
use crate::entry::{self, State};

type DlopenFn = unsafe extern "C" fn(*const c_char, c_int) -> *mut c_void;

/// libc's `dlopen`, the next definition after ours.
fn real_dlopen() -> Option<DlopenFn> {
    static REAL: OnceLock<Option<DlopenFn>> = OnceLock::new();
    *REAL.get_or_init(|| {
        // SAFETY: RTLD_NEXT lookup of a NUL-terminated name.
        let address = unsafe { libc::dlsym(libc::RTLD_NEXT, c"dlopen".as_ptr()) };
        // SAFETY: libc's dlopen has exactly this signature.
        (!address.is_null())
            .then(|| unsafe { std::mem::transmute::<*mut c_void, DlopenFn>(address) })
    })
}

fn dlopen_raw(filename: *const c_char, flags: c_int) -> *mut c_void {
    match real_dlopen() {
        // SAFETY: the caller's arguments, unchanged.
        Some(dlopen) => unsafe { dlopen(filename, flags) },
        None => std::ptr::null_mut(),
    }
}

/// The exported `dlopen`: passes the caller's return address on.
#[cfg(all(not(test), target_arch = "x86_64"))]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub(crate) unsafe extern "C" fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void {
    core::arch::naked_asm!("mov rdx, [rsp]", "jmp {}", sym dlopen_from)
}

/// The exported `dlopen`: passes the caller's return address on.
#[cfg(all(not(test), target_arch = "aarch64"))]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void {
    core::arch::naked_asm!("mov x2, x30", "b {}", sym dlopen_from)
}

/// `dlopen` on behalf of the code at `caller`, then the driver check.
extern "C" fn dlopen_from(
    filename: *const c_char,
    flags: c_int,
    caller: *const c_void,
) -> *mut c_void {
    let opened = std::panic::catch_unwind(|| {
        let handle = open_as_caller(filename, flags, caller);
        if !handle.is_null() {
            install_if_mapped();
        }
        handle
    });
    match opened {
        Ok(handle) => handle,
        Err(_) => {
            hook::report_panic("dlopen");
            dlopen_raw(filename, flags)
        }
    }
}

/// `dlopen(filename, flags)` as if called from `caller`.
fn open_as_caller(filename: *const c_char, flags: c_int, caller: *const c_void) -> *mut c_void {
    if filename.is_null() {
        return dlopen_raw(filename, flags);
    }
    // SAFETY: dlopen's contract: a NUL-terminated file name.
    let name = unsafe { CStr::from_ptr(filename) };
    if name.to_bytes().contains(&b'/') {
        return dlopen_raw(filename, flags);
    }
    let dirs = caller_search_path(caller);
    if dirs.is_empty() {
        return dlopen_raw(filename, flags);
    }
    // ld.so first matches libraries already loaded under that name.
    let loaded = dlopen_raw(filename, flags | libc::RTLD_NOLOAD);
    if !loaded.is_null() {
        return loaded;
    }
    for dir in dirs {
        let candidate = dir.join(std::ffi::OsStr::from_bytes(name.to_bytes()));
        let Ok(path) = CString::new(candidate.as_os_str().as_bytes()) else {
            continue;
        };
        // SAFETY: a NUL-terminated path.
        if unsafe { libc::access(path.as_ptr(), libc::F_OK) } == 0 {
            return dlopen_raw(path.as_ptr(), flags);
        }
    }
    dlopen_raw(filename, flags)
}

#[repr(C)]
struct LinkMap {
    l_addr: usize,
    l_name: *const c_char,
    l_ld: *const Elf64Dyn,
}

#[repr(C)]
struct Elf64Dyn {
    d_tag: i64,
    d_val: u64,
}

// The leading fields of glibc's `struct link_map` (link.h), read through the
// pointer `dladdr1` returns (its later fields are never touched, so only
// offsets are checked), and `Elf64_Dyn` (elf.h, `d_un` a union of two 8-byte
// words); figures from gcc on x86_64 glibc.
const _: () = {
    assert!(std::mem::offset_of!(LinkMap, l_addr) == 0);
    assert!(std::mem::offset_of!(LinkMap, l_name) == 8);
    assert!(std::mem::offset_of!(LinkMap, l_ld) == 16);
    assert!(size_of::<Elf64Dyn>() == 16 && align_of::<Elf64Dyn>() == 8);
    assert!(std::mem::offset_of!(Elf64Dyn, d_val) == 8);
};

const DT_NULL: i64 = 0;
const DT_STRTAB: i64 = 5;
const DT_RPATH: i64 = 15;
const DT_RUNPATH: i64 = 29;
const RTLD_DL_LINKMAP: c_int = 2;

unsafe extern "C" {
    fn dladdr1(
        address: *const c_void,
        info: *mut libc::Dl_info,
        extra: *mut *mut c_void,
        flags: c_int,
    ) -> c_int;
}

/// The directories ld.so would search for a bare name on behalf of the object
/// containing `caller`, before the cache and system directories: its
/// `DT_RPATH` (when it has no `DT_RUNPATH`), `LD_LIBRARY_PATH`, its
/// `DT_RUNPATH`. Empty when the caller has neither tag: then the plain search
/// from here is already the same.
fn caller_search_path(caller: *const c_void) -> Vec<PathBuf> {
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    let mut map: *mut c_void = std::ptr::null_mut();
    // SAFETY: valid out-pointers; dladdr1 only reads `caller` as an address.
    let found = unsafe { dladdr1(caller, info.as_mut_ptr(), &mut map, RTLD_DL_LINKMAP) };
    if found == 0 || map.is_null() {
        return Vec::new();
    }
    // SAFETY: glibc returned its link_map, whose first fields are these.
    let map = unsafe { &*(map as *const LinkMap) };
    let (mut strtab, mut rpath, mut runpath) = (None, None, None);
    let mut entry = map.l_ld;
    // SAFETY: l_ld is the object's mapped dynamic section, DT_NULL-terminated.
    while !entry.is_null() && unsafe { (*entry).d_tag } != DT_NULL {
        // SAFETY: as above.
        let Elf64Dyn { d_tag, d_val } = unsafe { entry.read() };
        match d_tag {
            DT_STRTAB => strtab = Some(d_val as usize),
            DT_RPATH => rpath = Some(d_val as usize),
            DT_RUNPATH => runpath = Some(d_val as usize),
            _ => {}
        }
        // SAFETY: still inside the DT_NULL-terminated array.
        entry = unsafe { entry.add(1) };
    }
    let Some(mut strtab) = strtab else {
        return Vec::new();
    };
    // Most architectures' ld.so relocate DT_STRTAB in place; some leave it
    // relative to the load address.
    if strtab < map.l_addr {
        strtab += map.l_addr;
    }
    let string_at = |offset: usize| {
        // SAFETY: offsets from the dynamic section index its string table.
        unsafe { CStr::from_ptr((strtab + offset) as *const c_char) }
    };
    // SAFETY: l_name is a NUL-terminated path ("" for the executable).
    let object = unsafe { CStr::from_ptr(map.l_name) };
    let origin = origin_of(object);
    let mut dirs = Vec::new();
    if runpath.is_none()
        && let Some(offset) = rpath
    {
        dirs.extend(split_search_path(
            string_at(offset).to_bytes(),
            origin.as_deref(),
        ));
    }
    if rpath.is_none() && runpath.is_none() {
        return dirs;
    }
    if let Some(library_path) = std::env::var_os("LD_LIBRARY_PATH") {
        dirs.extend(split_search_path(library_path.as_bytes(), None));
    }
    if let Some(offset) = runpath {
        dirs.extend(split_search_path(
            string_at(offset).to_bytes(),
            origin.as_deref(),
        ));
    }
    dirs
}

/// The directory of the object at `path` (the executable's when empty).
fn origin_of(path: &CStr) -> Option<PathBuf> {
    let path = if path.to_bytes().is_empty() {
        std::fs::read_link("/proc/self/exe").ok()?
    } else {
        PathBuf::from(std::ffi::OsStr::from_bytes(path.to_bytes()))
    };
    path.parent().map(Path::to_path_buf)
}

/// Splits a `:`/`;` search path, expanding `$ORIGIN`; entries with other
/// dynamic-string tokens (`$LIB`, `$PLATFORM`) are skipped.
fn split_search_path(list: &[u8], origin: Option<&Path>) -> Vec<PathBuf> {
    list.split(|byte| *byte == b':' || *byte == b';')
        .filter(|entry| !entry.is_empty())
        .filter_map(|entry| {
            let text = std::str::from_utf8(entry).ok()?;
            let expanded = if text.contains('$') {
                let origin = origin?.to_str()?;
                let expanded = text.replace("${ORIGIN}", origin).replace("$ORIGIN", origin);
                if expanded.contains('$') {
                    return None;
                }
                expanded
            } else {
                text.to_owned()
            };
            Some(PathBuf::from(expanded))
        })
        .collect()
}

/// Which driver libraries have been patched.
struct Installed {
    cuda: bool,
    nvml: bool,
}

static INSTALLED: Mutex<Installed> = Mutex::new(Installed {
    cuda: false,
    nvml: false,
});

/// Patches libcuda and libnvidia-ml if they are mapped and not yet patched.
/// Once libcuda is patched under limits, libnvidia-ml is mapped too (the
/// quota measures the driver's own memory through it) and patched here,
/// never later from inside a detour.
pub(crate) fn install_if_mapped() {
    let Some(state) = entry::state() else {
        return;
    };
    let limiter = entry::limiter();
    if matches!(state, State::Off) {
        return;
    }
    let Ok(mut installed) = INSTALLED.lock() else {
        return;
    };
    if installed.cuda && installed.nvml {
        return;
    }
    // The limiter's own driver calls during installation go to the originals.
    let Some(_guard) = hook::DetourGuard::enter_always() else {
        return;
    };
    if !installed.cuda
        && let Some(handle) = mapped(c"libcuda.so.1")
    {
        installed.cuda = true;
        // `cuInit` is always patched: it is where CUDA is refused when the
        // limits cannot be had (broken config, no grant, unpatchable driver).
        // The pointer queries and CUDA IPC only where the limiter backs
        // memory itself: other processes keep the driver's answers,
        // uninterposed.
        let backs = limiter.is_some_and(|limiter| limiter.backing.enabled());
        // Launches are patched wherever limits apply: a compute limit admits
        // them, and a first launch may load a library's globals. The driver's
        // family comes first (alone where CUDA is refused), the pointer
        // queries and IPC last (only where the limiter backs memory).
        const LIMITED: [&[HookEntry]; 8] = [
            &detour::driver::DRIVER_DETOURS,
            &detour::memory::MEMORY_DETOURS,
            &detour::context::CONTEXT_DETOURS,
            &detour::held::HELD_DETOURS,
            &detour::launch::LAUNCH_DETOURS,
            &detour::gate::GATE_DETOURS,
            &detour::pointer::POINTER_DETOURS,
            &detour::ipc::IPC_DETOURS,
        ];
        let tables: &[&[HookEntry]] = match state {
            State::Refusing(_) => &LIMITED[..1],
            _ if backs => &LIMITED,
            _ => &LIMITED[..LIMITED.len() - 2],
        };
        let resolved = match limiter {
            Some(limiter) => limiter.context.load_driver(handle).is_some(),
            None => Driver::load(handle).is_some(),
        };
        if !resolved {
            unpatchable(
                handle,
                "libcuda lacks cuCtxGetDevice or cuDeviceGetUuid, so allocations cannot be accounted",
            );
        } else if let Err(error) = install(handle, "libcuda.so.1", tables) {
            unpatchable(handle, &format!("cannot patch libcuda.so.1: {error}"));
        } else if let Some(limiter) = limiter {
            // A CUDA process: time to meet the hypervisor, and to map NVML.
            limiter.start_link();
            let nvml = dlopen_raw(c"libnvidia-ml.so.1".as_ptr(), libc::RTLD_NOW);
            limiter
                .context
                .found_nvml((!nvml.is_null()).then_some(nvml));
        }
    }
    if !installed.nvml
        && let Some(limiter) = limiter
        && let Some(handle) = mapped(c"libnvidia-ml.so.1")
    {
        installed.nvml = true;
        limiter.context.found_nvml(Some(handle));
        // NVML only reports: unpatched, its numbers are the device's, and no
        // limit is lost.
        if let Err(error) = install(handle, "libnvidia-ml.so.1", &[&detour::nvml::NVML_DETOURS]) {
            eprintln!(
                "cuda-limiter: cannot patch libnvidia-ml.so.1: {error}; its reports show the whole GPU"
            );
        }
    }
}

/// The driver cannot be limited: CUDA is refused (`cuInit` alone is patched
/// for that), unless the user opted out with `CUDA_LIMITER_ALLOW_UNPATCHED=1`.
fn unpatchable(handle: *mut c_void, reason: &str) {
    if entry::limiter().is_some_and(super::entry::Limiter::allow_unpatched) {
        eprintln!(
            "cuda-limiter: {reason}; running WITHOUT limits because {}=1",
            entry::ALLOW_UNPATCHED_VARIABLE
        );
        return;
    }
    entry::refuse(format!(
        "cuda-limiter: {reason}; CUDA refuses to initialise (set {}=1 to run without limits)",
        entry::ALLOW_UNPATCHED_VARIABLE
    ));
    if let Err(error) = install(handle, "libcuda.so.1", &[&detour::driver::DRIVER_DETOURS]) {
        // Not even cuInit: nothing can stop CUDA from here.
        eprintln!("cuda-limiter: cannot patch cuInit either ({error}); CUDA runs WITHOUT limits");
    }
}

/// The handle of `soname` if it is already mapped (without loading it).
fn mapped(soname: &CStr) -> Option<*mut c_void> {
    let handle = dlopen_raw(soname.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
    (!handle.is_null()).then_some(handle)
}

fn install(
    handle: *mut c_void,
    library: &str,
    tables: &[&[HookEntry]],
) -> Result<(), hook::HookError> {
    let started = std::time::Instant::now();
    let resolve = |symbol: &CStr| {
        // SAFETY: a live handle and a NUL-terminated name.
        let address = unsafe { libc::dlsym(handle, symbol.as_ptr()) };
        (!address.is_null()).then_some(address.cast_const())
    };
    // SAFETY: each table was declared with the driver's signature of its symbol.
    match unsafe { hook::install_tables(tables, resolve) } {
        Ok(report) => {
            hook::set_enabled(true);
            tracing::info!(
                library,
                patched = report.patched.len(),
                missing_optional = ?report.missing_optional,
                elapsed_us = started.elapsed().as_micros() as u64,
                "detours installed"
            );
            Ok(())
        }
        Err(error) => {
            tracing::error!(library, %error, "installation failed");
            Err(error)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn search_path_expands_origin_and_skips_other_tokens() {
        let dirs = split_search_path(
            b"$ORIGIN/../lib:${ORIGIN}/x::/opt/a;$LIB/y",
            Some(Path::new("/pkg/bin")),
        );
        assert_eq!(
            dirs,
            vec![
                PathBuf::from("/pkg/bin/../lib"),
                PathBuf::from("/pkg/bin/x"),
                PathBuf::from("/opt/a"),
            ]
        );
        assert_eq!(
            split_search_path(b"$ORIGIN/lib", None),
            Vec::<PathBuf>::new()
        );
    }
}
