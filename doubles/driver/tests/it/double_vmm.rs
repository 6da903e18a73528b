//! The double's virtual memory management and pinned host memory
//! (`double/vmm.c`, `double/host_memory.c`): reserved ranges, physical
//! memory charged while it exists, mappings that hold real bytes once
//! accessible, the same address mapped again, and the failures a caller of
//! the real driver must cope with.
#![cfg(all(target_arch = "x86_64", target_os = "linux"))]

use std::ffi::{c_int, c_uint, c_void};

use crate::common;

use common::in_process::{CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_VALUE, Handle, Lib};
use common::{CUDA_SUCCESS, MIB, in_fresh_process};

const CUDA_ERROR_OUT_OF_MEMORY: c_int = 2;
const CUDA_ERROR_ILLEGAL_ADDRESS: c_int = 700;
const CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: c_int = 712;
const CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: c_int = 713;
pub(crate) const CUDA_ERROR_NOT_SUPPORTED: c_int = 801;
pub(crate) const GRANULARITY: usize = 2 << 20;
const READ: c_int = 1;
pub(crate) const READ_WRITE: c_int = 3;
const CU_POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
pub(crate) const CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
const CU_POINTER_ATTRIBUTE_RANGE_START_ADDR: c_int = 11;
const CU_POINTER_ATTRIBUTE_RANGE_SIZE: c_int = 12;
const CU_MEMORYTYPE_DEVICE: c_uint = 2;
const CU_MEMHOSTREGISTER_DEVICEMAP: c_uint = 2;

pub(crate) type DevPtr = u64;

/// `CUmemLocation` of cuda.h.
#[repr(C)]
#[derive(Clone, Copy)]
struct Location {
    kind: c_int,
    id: c_int,
}

/// `CUmemAccessDesc` of cuda.h.
#[repr(C)]
struct AccessDesc {
    location: Location,
    flags: c_int,
}

/// `CUmemAllocationProp` of cuda.h (32 bytes).
#[repr(C)]
struct AllocationProp {
    kind: c_int,
    handle_types: c_int,
    location: Location,
    win32: *mut c_void,
    flags: [u8; 8],
}

const DEVICE_0: Location = Location { kind: 1, id: 0 };

/// The entry points these tests call, with the signatures of cuda.h.
pub(crate) struct Vmm {
    init: unsafe extern "C" fn(c_uint) -> c_int,
    retain: unsafe extern "C" fn(*mut Handle, c_int) -> c_int,
    set_current: unsafe extern "C" fn(Handle) -> c_int,
    info: unsafe extern "C" fn(*mut usize, *mut usize) -> c_int,
    reserve: unsafe extern "C" fn(*mut DevPtr, usize, usize, DevPtr, u64) -> c_int,
    address_free: unsafe extern "C" fn(DevPtr, usize) -> c_int,
    create: unsafe extern "C" fn(*mut u64, usize, *const AllocationProp, u64) -> c_int,
    pub(crate) release: unsafe extern "C" fn(u64) -> c_int,
    pub(crate) retain_handle: unsafe extern "C" fn(*mut u64, *mut c_void) -> c_int,
    pub(crate) map: unsafe extern "C" fn(DevPtr, usize, usize, u64, u64) -> c_int,
    pub(crate) unmap: unsafe extern "C" fn(DevPtr, usize) -> c_int,
    set_access: unsafe extern "C" fn(DevPtr, usize, *const AccessDesc, usize) -> c_int,
    get_access: unsafe extern "C" fn(*mut u64, *const Location, DevPtr) -> c_int,
    htod: unsafe extern "C" fn(DevPtr, *const c_void, usize) -> c_int,
    dtoh: unsafe extern "C" fn(*mut c_void, DevPtr, usize) -> c_int,
    dtod: unsafe extern "C" fn(DevPtr, DevPtr, usize) -> c_int,
    dtoh_async: unsafe extern "C" fn(*mut c_void, DevPtr, usize, Handle) -> c_int,
    set_d8: unsafe extern "C" fn(DevPtr, u8, usize) -> c_int,
    set_d32: unsafe extern "C" fn(DevPtr, c_uint, usize) -> c_int,
    range: unsafe extern "C" fn(*mut DevPtr, *mut usize, DevPtr) -> c_int,
    attribute: unsafe extern "C" fn(*mut c_void, c_int, DevPtr) -> c_int,
    alloc_host: unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int,
    free_host: unsafe extern "C" fn(*mut c_void) -> c_int,
    register: unsafe extern "C" fn(*mut c_void, usize, c_uint) -> c_int,
    unregister: unsafe extern "C" fn(*mut c_void) -> c_int,
    host_device_pointer: unsafe extern "C" fn(*mut DevPtr, *mut c_void, c_uint) -> c_int,
}

impl Vmm {
    /// The double's libcuda in this process, initialised, with GPU 0's
    /// primary context current.
    pub(crate) fn open() -> Vmm {
        let lib = Lib::open("libcuda.so.1");
        // SAFETY: each field's type is the signature of the export in cuda.h.
        let vmm = unsafe {
            Vmm {
                init: lib.function("cuInit"),
                retain: lib.function("cuDevicePrimaryCtxRetain"),
                set_current: lib.function("cuCtxSetCurrent"),
                info: lib.function("cuMemGetInfo_v2"),
                reserve: lib.function("cuMemAddressReserve"),
                address_free: lib.function("cuMemAddressFree"),
                create: lib.function("cuMemCreate"),
                release: lib.function("cuMemRelease"),
                retain_handle: lib.function("cuMemRetainAllocationHandle"),
                map: lib.function("cuMemMap"),
                unmap: lib.function("cuMemUnmap"),
                set_access: lib.function("cuMemSetAccess"),
                get_access: lib.function("cuMemGetAccess"),
                htod: lib.function("cuMemcpyHtoD_v2"),
                dtoh: lib.function("cuMemcpyDtoH_v2"),
                dtod: lib.function("cuMemcpyDtoD_v2"),
                dtoh_async: lib.function("cuMemcpyDtoHAsync_v2"),
                set_d8: lib.function("cuMemsetD8_v2"),
                set_d32: lib.function("cuMemsetD32_v2"),
                range: lib.function("cuMemGetAddressRange_v2"),
                attribute: lib.function("cuPointerGetAttribute"),
                alloc_host: lib.function("cuMemAllocHost_v2"),
                free_host: lib.function("cuMemFreeHost"),
                register: lib.function("cuMemHostRegister_v2"),
                unregister: lib.function("cuMemHostUnregister"),
                host_device_pointer: lib.function("cuMemHostGetDevicePointer_v2"),
            }
        };
        let mut ctx = std::ptr::null_mut();
        // SAFETY: valid out-pointers.
        unsafe {
            assert_eq!((vmm.init)(0), CUDA_SUCCESS);
            assert_eq!((vmm.retain)(&mut ctx, 0), CUDA_SUCCESS);
            assert_eq!((vmm.set_current)(ctx), CUDA_SUCCESS);
        }
        vmm
    }

    pub(crate) fn free(&self) -> usize {
        let (mut free, mut total) = (0, 0);
        // SAFETY: valid out-pointers.
        assert_eq!(unsafe { (self.info)(&mut free, &mut total) }, CUDA_SUCCESS);
        free
    }

    pub(crate) fn reserve(&self, size: usize, hint: DevPtr) -> DevPtr {
        let mut va = 0;
        // SAFETY: a valid out-pointer.
        let rc = unsafe { (self.reserve)(&mut va, size, 0, hint, 0) };
        assert_eq!(rc, CUDA_SUCCESS);
        va
    }

    pub(crate) fn create(&self, size: usize) -> Result<u64, c_int> {
        self.create_with(size, 0)
    }

    /// cuMemCreate of `size` bytes on GPU 0 with these requested handle types.
    pub(crate) fn create_with(&self, size: usize, handle_types: c_int) -> Result<u64, c_int> {
        let prop = AllocationProp {
            kind: 1,
            handle_types,
            location: DEVICE_0,
            win32: std::ptr::null_mut(),
            flags: [0; 8],
        };
        let mut handle = 0;
        // SAFETY: valid pointers.
        match unsafe { (self.create)(&mut handle, size, &prop, 0) } {
            CUDA_SUCCESS => Ok(handle),
            rc => Err(rc),
        }
    }

    pub(crate) fn access(&self, va: DevPtr, size: usize, flags: c_int) -> c_int {
        let desc = AccessDesc {
            location: DEVICE_0,
            flags,
        };
        // SAFETY: one valid descriptor.
        unsafe { (self.set_access)(va, size, &desc, 1) }
    }

    pub(crate) fn write(&self, va: DevPtr, bytes: &[u8]) -> c_int {
        // SAFETY: a host buffer of bytes.len() bytes.
        unsafe { (self.htod)(va, bytes.as_ptr().cast(), bytes.len()) }
    }

    pub(crate) fn read(&self, va: DevPtr, len: usize) -> Result<Vec<u8>, c_int> {
        let mut out = vec![0u8; len];
        // SAFETY: a host buffer of len bytes.
        match unsafe { (self.dtoh)(out.as_mut_ptr().cast(), va, len) } {
            CUDA_SUCCESS => Ok(out),
            rc => Err(rc),
        }
    }

    pub(crate) fn attribute(&self, which: c_int, va: DevPtr) -> u64 {
        let mut value = 0u64;
        // SAFETY: 8 bytes hold every attribute asked here.
        let rc = unsafe { (self.attribute)((&raw mut value).cast(), which, va) };
        assert_eq!(rc, CUDA_SUCCESS, "attribute {which}");
        value
    }
}

/// A pattern that differs from byte to byte and from one `seed` to another.
pub(crate) fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn mapped_memory_holds_its_bytes_and_is_charged_while_it_exists() {
    if !in_fresh_process(
        "mapped_memory_holds_its_bytes_and_is_charged_while_it_exists",
        &[],
    ) {
        return;
    }
    let vmm = Vmm::open();
    let size = 2 * GRANULARITY;
    let before = vmm.free();
    let va = vmm.reserve(size, 0);
    assert_eq!(vmm.free(), before, "a reservation takes no memory");
    let handle = vmm.create(size).unwrap();
    assert_eq!(vmm.free(), before - size, "created memory is charged");
    let data = pattern(size, 7);
    assert_eq!(vmm.write(va, &data), CUDA_ERROR_INVALID_VALUE, "not mapped");

    // SAFETY: the double's entry points, with valid arguments.
    unsafe {
        assert_eq!((vmm.map)(va, size, 0, handle, 0), CUDA_SUCCESS);
        assert_eq!(
            vmm.write(va, &data),
            CUDA_ERROR_ILLEGAL_ADDRESS,
            "no access yet"
        );
        assert_eq!(vmm.access(va, size, READ), CUDA_SUCCESS);
        let mut flags = 0;
        assert_eq!(
            (vmm.get_access)(&mut flags, &DEVICE_0, va + 5),
            CUDA_SUCCESS
        );
        assert_eq!(flags, READ as u64);
        assert_eq!(
            vmm.write(va, &data),
            CUDA_ERROR_ILLEGAL_ADDRESS,
            "read only"
        );
        assert_eq!(vmm.read(va, 16), Ok(vec![0; 16]), "fresh memory reads zero");
        assert_eq!(vmm.access(va, size, READ_WRITE), CUDA_SUCCESS);
        assert_eq!(vmm.write(va, &data), CUDA_SUCCESS);
        assert_eq!(vmm.read(va, size), Ok(data.clone()), "the bytes come back");
        assert_eq!(vmm.read(va + 1000, 24), Ok(data[1000..1024].to_vec()));
        let mut tail = vec![0u8; 64];
        let rc = (vmm.dtoh_async)(tail.as_mut_ptr().cast(), va + 64, 64, std::ptr::null_mut());
        assert_eq!(rc, CUDA_SUCCESS);
        assert_eq!(tail, data[64..128]);

        // Sets, and a copy within the mapping.
        assert_eq!((vmm.set_d8)(va + 10, 0xab, 6), CUDA_SUCCESS);
        assert_eq!(
            vmm.read(va + 9, 8),
            Ok(vec![data[9], 0xab, 0xab, 0xab, 0xab, 0xab, 0xab, data[16]])
        );
        assert_eq!((vmm.set_d32)(va + 4096, 0x0102_0304, 2), CUDA_SUCCESS);
        assert_eq!(vmm.read(va + 4096, 8), Ok(vec![4, 3, 2, 1, 4, 3, 2, 1]));
        assert_eq!(
            (vmm.dtod)(va + GRANULARITY as u64, va + 4096, 8),
            CUDA_SUCCESS
        );
        assert_eq!(
            vmm.read(va + GRANULARITY as u64, 8),
            Ok(vec![4, 3, 2, 1, 4, 3, 2, 1])
        );

        // The pod's view of the pointer: the mapping, on GPU 0.
        let (mut base, mut len) = (0, 0);
        assert_eq!((vmm.range)(&mut base, &mut len, va + 77), CUDA_SUCCESS);
        assert_eq!((base, len), (va, size));
        assert_eq!(
            vmm.attribute(CU_POINTER_ATTRIBUTE_MEMORY_TYPE, va) as c_uint,
            CU_MEMORYTYPE_DEVICE
        );
        assert_eq!(
            vmm.attribute(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, va + 9),
            va
        );
        assert_eq!(
            vmm.attribute(CU_POINTER_ATTRIBUTE_RANGE_SIZE, va),
            size as u64
        );
        assert_eq!(
            vmm.attribute(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, va) as c_int,
            0
        );

        // Unmapped: its bytes are out of reach, and the reservation stays.
        assert_eq!((vmm.unmap)(va, size), CUDA_SUCCESS);
        assert_eq!(vmm.read(va, 16), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(
            (vmm.range)(&mut base, &mut len, va),
            500,
            "CUDA_ERROR_NOT_FOUND"
        );
        assert_eq!(vmm.free(), before - size, "still created");
        assert_eq!((vmm.release)(handle), CUDA_SUCCESS);
        assert_eq!(vmm.free(), before, "released memory is given back");
        assert_eq!((vmm.release)(handle), CUDA_ERROR_INVALID_VALUE, "once");

        // The same address, new memory: mapped again, fresh contents.
        let again = vmm.create(size).unwrap();
        assert_eq!((vmm.map)(va, size, 0, again, 0), CUDA_SUCCESS);
        assert_eq!(vmm.access(va, size, READ_WRITE), CUDA_SUCCESS);
        assert_eq!(vmm.read(va, 8), Ok(vec![0; 8]));
        assert_eq!(vmm.write(va, &data[..8]), CUDA_SUCCESS);
        assert_eq!(vmm.read(va, 8), Ok(data[..8].to_vec()));
        assert_eq!(
            (vmm.address_free)(va, size),
            CUDA_ERROR_INVALID_VALUE,
            "mapped"
        );
        assert_eq!((vmm.unmap)(va, size), CUDA_SUCCESS);
        assert_eq!((vmm.release)(again), CUDA_SUCCESS);
        assert_eq!((vmm.address_free)(va, size), CUDA_SUCCESS);
        assert_eq!(
            (vmm.address_free)(va, size),
            CUDA_ERROR_INVALID_VALUE,
            "once"
        );
        assert_eq!(vmm.reserve(size, va), va, "the freed range is free again");
    }
}

#[test]
fn released_memory_lives_while_it_is_mapped_or_retained() {
    if !in_fresh_process("released_memory_lives_while_it_is_mapped_or_retained", &[]) {
        return;
    }
    let vmm = Vmm::open();
    let size = GRANULARITY;
    let before = vmm.free();
    let va = vmm.reserve(2 * size, 0);
    let handle = vmm.create(size).unwrap();
    // SAFETY: the double's entry points, with valid arguments.
    unsafe {
        // One memory mapped twice: both addresses see the same bytes.
        assert_eq!((vmm.map)(va, size, 0, handle, 0), CUDA_SUCCESS);
        assert_eq!(
            (vmm.map)(va + size as u64, size, 0, handle, 0),
            CUDA_SUCCESS
        );
        assert_eq!(vmm.access(va, 2 * size, READ_WRITE), CUDA_SUCCESS);
        assert_eq!(vmm.write(va, &[1, 2, 3]), CUDA_SUCCESS);
        assert_eq!(vmm.read(va + size as u64, 3), Ok(vec![1, 2, 3]));
        let mut retained = 0;
        assert_eq!(
            (vmm.retain_handle)(&mut retained, (va + 5) as *mut c_void),
            CUDA_SUCCESS
        );
        assert_eq!(retained, handle);
        assert_eq!((vmm.release)(handle), CUDA_SUCCESS);
        assert_eq!(
            (vmm.release)(handle),
            CUDA_SUCCESS,
            "the retained reference"
        );
        assert_eq!(vmm.free(), before - size, "still mapped: still held");
        assert_eq!(vmm.read(va, 3), Ok(vec![1, 2, 3]));
        assert_eq!((vmm.unmap)(va, size), CUDA_SUCCESS);
        assert_eq!(vmm.free(), before - size, "one mapping left");
        assert_eq!((vmm.unmap)(va + size as u64, size), CUDA_SUCCESS);
        assert_eq!(vmm.free(), before, "the last mapping gave it back");
        assert_eq!(
            (vmm.map)(va, size, 0, handle, 0),
            CUDA_ERROR_INVALID_HANDLE,
            "gone"
        );
    }
}

#[test]
fn vmm_calls_refuse_what_the_driver_refuses() {
    if !in_fresh_process("vmm_calls_refuse_what_the_driver_refuses", &[]) {
        return;
    }
    let vmm = Vmm::open();
    let g = GRANULARITY;
    let gu = g as u64;
    assert_eq!(
        vmm.create(g + 1),
        Err(CUDA_ERROR_INVALID_VALUE),
        "not granular"
    );
    let va = vmm.reserve(4 * g, 0);
    let other = vmm.reserve(g, 0);
    assert!(
        other >= va + 4 * gu || other + gu <= va,
        "ranges never overlap"
    );
    let one = vmm.create(g).unwrap();
    let two = vmm.create(2 * g).unwrap();
    // SAFETY: the double's entry points; the pointers are valid or NULL on purpose.
    unsafe {
        let mut ptr = 0;
        assert_eq!(
            (vmm.reserve)(&mut ptr, g + 1, 0, 0, 0),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(
            (vmm.reserve)(&mut ptr, g, 3, 0, 0),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(
            (vmm.reserve)(std::ptr::null_mut(), g, 0, 0, 0),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!((vmm.reserve)(&mut ptr, g, 0, va, 0), CUDA_SUCCESS);
        assert_ne!(ptr, va, "a hint that is taken is not given");
        assert_eq!((vmm.address_free)(ptr, g), CUDA_SUCCESS);
        assert_eq!(
            (vmm.address_free)(va, g),
            CUDA_ERROR_INVALID_VALUE,
            "not the whole range"
        );

        assert_eq!(
            (vmm.map)(va + 1, g, 0, one, 0),
            CUDA_ERROR_INVALID_VALUE,
            "unaligned"
        );
        assert_eq!((vmm.map)(va, g, 0, 12345, 0), CUDA_ERROR_INVALID_HANDLE);
        assert_eq!(
            (vmm.map)(va, 2 * g, 0, one, 0),
            CUDA_ERROR_INVALID_VALUE,
            "past the memory"
        );
        assert_eq!((vmm.map)(va, g, g, two, 0), CUDA_SUCCESS, "at an offset");
        assert_eq!(
            (vmm.map)(va, g, 0, one, 0),
            CUDA_ERROR_INVALID_VALUE,
            "already mapped"
        );
        assert_eq!(
            (vmm.map)(va + 3 * gu, 2 * g, 0, two, 0),
            CUDA_ERROR_INVALID_VALUE,
            "past the range"
        );
        assert_eq!((vmm.map)(va + gu, 2 * g, 0, two, 0), CUDA_SUCCESS);

        // Access and unmapping take whole mappings.
        assert_eq!(vmm.access(va, g / 2, READ_WRITE), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(
            vmm.access(va, 4 * g, READ_WRITE),
            CUDA_ERROR_INVALID_VALUE,
            "unmapped tail"
        );
        assert_eq!(
            vmm.access(va, 3 * g, 2),
            CUDA_ERROR_INVALID_VALUE,
            "no such flags"
        );
        assert_eq!(vmm.access(va, 3 * g, READ_WRITE), CUDA_SUCCESS);
        // A copy across two mappings of two memories.
        let data = pattern(2 * g, 3);
        assert_eq!(vmm.write(va + gu / 2, &data), CUDA_SUCCESS);
        assert_eq!(vmm.read(va + gu / 2, 2 * g), Ok(data));
        assert_eq!(
            vmm.read(va + 2 * gu, 2 * g),
            Err(CUDA_ERROR_INVALID_VALUE),
            "runs off the end"
        );
        assert_eq!((vmm.unmap)(va, g / 2), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(
            (vmm.unmap)(va, 2 * g),
            CUDA_ERROR_INVALID_VALUE,
            "cuts a mapping"
        );
        assert_eq!((vmm.unmap)(va, 3 * g), CUDA_SUCCESS);
        assert_eq!(
            (vmm.unmap)(va, g),
            CUDA_ERROR_INVALID_VALUE,
            "nothing mapped"
        );
        assert_eq!((vmm.release)(one), CUDA_SUCCESS);
        assert_eq!((vmm.release)(two), CUDA_SUCCESS);
        assert_eq!((vmm.address_free)(va, 4 * g), CUDA_SUCCESS);
        assert_eq!((vmm.address_free)(other, g), CUDA_SUCCESS);
    }
}

#[test]
fn named_vmm_calls_fail_on_demand() {
    if !in_fresh_process(
        "named_vmm_calls_fail_on_demand",
        &[(
            "GPUSHARE_DOUBLE_FAIL_VMM",
            "cuMemMap@2,cuMemCreate@3,cuMemSetAccess",
        )],
    ) {
        return;
    }
    let vmm = Vmm::open();
    let g = GRANULARITY;
    let va = vmm.reserve(2 * g, 0);
    let before = vmm.free();
    let handle = vmm.create(g).unwrap();
    let second = vmm.create(g).unwrap();
    assert_eq!(
        vmm.create(g),
        Err(CUDA_ERROR_OUT_OF_MEMORY),
        "the third create"
    );
    assert_eq!(
        vmm.free(),
        before - 2 * g,
        "a failed create charges nothing"
    );
    // SAFETY: the double's entry points, with valid arguments.
    unsafe {
        assert_eq!((vmm.map)(va, g, 0, handle, 0), CUDA_SUCCESS);
        assert_eq!(
            (vmm.map)(va + g as u64, g, 0, second, 0),
            CUDA_ERROR_NOT_SUPPORTED,
            "the second map"
        );
        assert_eq!(
            (vmm.map)(va + g as u64, g, 0, second, 0),
            CUDA_SUCCESS,
            "the third"
        );
        assert_eq!(
            vmm.access(va, g, READ_WRITE),
            CUDA_ERROR_NOT_SUPPORTED,
            "every one"
        );
        assert_eq!(vmm.write(va, &[1]), CUDA_ERROR_ILLEGAL_ADDRESS);
    }
}

#[test]
fn pinned_host_memory_is_allocated_or_registered() {
    if !in_fresh_process("pinned_host_memory_is_allocated_or_registered", &[]) {
        return;
    }
    let vmm = Vmm::open();
    let g = GRANULARITY;
    let va = vmm.reserve(g, 0);
    let handle = vmm.create(g).unwrap();
    let data = pattern(g, 11);
    // SAFETY: the double's entry points; host buffers outlive their use.
    unsafe {
        assert_eq!((vmm.map)(va, g, 0, handle, 0), CUDA_SUCCESS);
        assert_eq!(vmm.access(va, g, READ_WRITE), CUDA_SUCCESS);
        assert_eq!(vmm.write(va, &data), CUDA_SUCCESS);

        let mut pinned = std::ptr::null_mut();
        assert_eq!((vmm.alloc_host)(&mut pinned, g), CUDA_SUCCESS);
        let mut device = 0;
        assert_eq!(
            (vmm.host_device_pointer)(&mut device, pinned, 0),
            CUDA_SUCCESS
        );
        assert_eq!(device, pinned as DevPtr, "mapped, at its host address");
        assert_eq!((vmm.dtoh)(pinned, va, g), CUDA_SUCCESS);
        assert_eq!(
            std::slice::from_raw_parts(pinned.cast::<u8>(), g),
            &data[..]
        );
        assert_eq!(
            (vmm.unregister)(pinned),
            CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
        );
        assert_eq!((vmm.free_host)(pinned), CUDA_SUCCESS);

        let mut own = vec![0u8; g + MIB as usize];
        let start = own.as_mut_ptr().cast::<c_void>();
        assert_eq!(
            (vmm.register)(start, g, 16),
            CUDA_ERROR_INVALID_VALUE,
            "no such flag"
        );
        assert_eq!(
            (vmm.register)(start, g, CU_MEMHOSTREGISTER_DEVICEMAP),
            CUDA_SUCCESS
        );
        let inside = start.cast::<u8>().add(MIB as usize).cast::<c_void>();
        assert_eq!(
            (vmm.register)(inside, g, 0),
            CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
        );
        assert_eq!(
            (vmm.host_device_pointer)(&mut device, start, 0),
            CUDA_SUCCESS
        );
        assert_eq!((vmm.dtoh)(start, va, g), CUDA_SUCCESS);
        assert_eq!(&own[..g], &data[..]);
        assert_eq!(
            (vmm.free_host)(own.as_mut_ptr().cast()),
            CUDA_ERROR_INVALID_VALUE,
            "not ours"
        );
        assert_eq!(
            (vmm.unregister)(inside),
            CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
        );
        assert_eq!((vmm.unregister)(own.as_mut_ptr().cast()), CUDA_SUCCESS);
        assert_eq!(
            (vmm.unregister)(own.as_mut_ptr().cast()),
            CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
        );
        own[0] = 1; // still the owner's
    }
}
