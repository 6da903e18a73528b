//! The engine on the prologue shapes measured on the H100 driver (DESIGN.md),
//! installed while other threads call the functions in a tight loop.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a helper fails its test by panicking, as the test itself does"
)]
#![cfg(target_arch = "x86_64")]

use std::ffi::{CStr, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use gpushare_hook::{HookEntry, Original, install_tables};

type Unary = unsafe extern "C" fn(u64) -> u64;

macro_rules! shaped {
    ($($cu:ident / $nvml:ident = $index:literal),* $(,)?) => {
        $(
            // The `cu*` prologue: push rbp; mov rbp,rsp; push r12; sub rsp,8;
            // cmp dword [rip+disp32], imm32; then returns x + index.
            core::arch::global_asm!(
                concat!(".globl ", stringify!($cu)),
                concat!(".type ", stringify!($cu), ",@function"),
                concat!(stringify!($cu), ":"),
                "push rbp",
                "mov rbp, rsp",
                "push r12",
                "sub rsp, 8",
                "cmp dword ptr [rip + {flag}], 0x321cba00",
                "lea rax, [rdi + {index}]",
                "add rsp, 8",
                "pop r12",
                "pop rbp",
                "ret",
                // NVML's prologue: push rbp; mov rbp,rsp; push r14; mov r14,rsi;
                // push r13; mov r13,rdi; then returns x + 1000 + index.
                concat!(".globl ", stringify!($nvml)),
                concat!(".type ", stringify!($nvml), ",@function"),
                concat!(stringify!($nvml), ":"),
                "push rbp",
                "mov rbp, rsp",
                "push r14",
                "mov r14, rsi",
                "push r13",
                "mov r13, rdi",
                "lea rax, [rdi + {index} + 1000]",
                "pop r13",
                "pop r14",
                "pop rbp",
                "ret",
                flag = sym SHAPE_FLAG,
                index = const $index,
            );
        )*
        unsafe extern "C" {
            $(fn $cu(x: u64) -> u64; fn $nvml(x: u64) -> u64;)*
        }
        const SHAPED: &[(&str, Unary, u64)] = &[
            $((stringify!($cu), $cu as Unary, $index), (stringify!($nvml), $nvml as Unary, 1000 + $index),)*
        ];
    };
}

#[unsafe(no_mangle)]
static SHAPE_FLAG: AtomicU64 = AtomicU64::new(0);

shaped!(
    shape_cu_0 / shape_nvml_0 = 0,
    shape_cu_1 / shape_nvml_1 = 1,
    shape_cu_2 / shape_nvml_2 = 2,
    shape_cu_3 / shape_nvml_3 = 3,
    shape_cu_4 / shape_nvml_4 = 4,
    shape_cu_5 / shape_nvml_5 = 5,
    shape_cu_6 / shape_nvml_6 = 6,
    shape_cu_7 / shape_nvml_7 = 7,
);

// nvmlInit_v2's shape: `xor edi,edi; jmp rel32`, directly followed by another
// function, so the 5-byte patch must not spill into the neighbour.
core::arch::global_asm!(
    ".globl shape_init",
    ".type shape_init,@function",
    "shape_init:",
    "xor edi, edi",
    ".byte 0xe9",
    ".long shape_init_with_flags - . - 4",
    ".globl shape_neighbour",
    ".type shape_neighbour,@function",
    "shape_neighbour:",
    "lea rax, [rdi + 77]",
    "ret",
    ".globl shape_init_with_flags",
    ".type shape_init_with_flags,@function",
    "shape_init_with_flags:",
    "lea rax, [rdi + 5]",
    "ret",
);

unsafe extern "C" {
    fn shape_init(x: u64) -> u64;
    fn shape_neighbour(x: u64) -> u64;
}

const SLOTS: usize = 17;
static ORIGINALS: [Original<Unary>; SLOTS] = [const { Original::new() }; SLOTS];

extern "C" fn detour<const I: usize>(x: u64) -> u64 {
    match ORIGINALS[I].get() {
        // SAFETY: the trampoline of a function of this signature.
        Some(original) => (unsafe { original(x) }) + 1_000_000,
        None => u64::MAX,
    }
}

const DETOURS: [fn() -> *const (); SLOTS] = [
    || detour::<0> as *const (),
    || detour::<1> as *const (),
    || detour::<2> as *const (),
    || detour::<3> as *const (),
    || detour::<4> as *const (),
    || detour::<5> as *const (),
    || detour::<6> as *const (),
    || detour::<7> as *const (),
    || detour::<8> as *const (),
    || detour::<9> as *const (),
    || detour::<10> as *const (),
    || detour::<11> as *const (),
    || detour::<12> as *const (),
    || detour::<13> as *const (),
    || detour::<14> as *const (),
    || detour::<15> as *const (),
    || detour::<16> as *const (),
];

#[test]
fn driver_prologues_patch_correctly_under_concurrent_calls() {
    let mut targets: Vec<(&str, Unary, u64)> = SHAPED.to_vec();
    targets.push(("shape_init", shape_init as Unary, 5));
    assert_eq!(targets.len(), SLOTS);

    let stop = Arc::new(AtomicBool::new(false));
    let calls = Arc::new(AtomicU64::new(0));
    let callers: Vec<_> = (0..3)
        .map(|thread| {
            let stop = Arc::clone(&stop);
            let calls = Arc::clone(&calls);
            let targets = targets.clone();
            std::thread::spawn(move || {
                let mut x = thread as u64;
                while !stop.load(Ordering::Relaxed) {
                    for (name, function, offset) in &targets {
                        // SAFETY: the functions above take and return a u64.
                        let got = unsafe { std::hint::black_box(*function)(x) };
                        let expected = if *name == "shape_init" { 0 } else { x } + offset;
                        assert!(
                            got == expected || got == expected + 1_000_000,
                            "{name}({x}) = {got}"
                        );
                    }
                    // SAFETY: as above.
                    assert_eq!(unsafe { std::hint::black_box(shape_neighbour)(x) }, x + 77);
                    calls.fetch_add(1, Ordering::Relaxed);
                    x += 1;
                }
            })
        })
        .collect();

    // One transaction per function: many installations while the calls run.
    for (slot, (name, function, _)) in targets.iter().enumerate() {
        let symbol = std::ffi::CString::new(*name).expect("name");
        let symbol: &'static CStr = Box::leak(symbol.into_boxed_c_str());
        let entry = HookEntry {
            symbol,
            detour: DETOURS[slot],
            original: ORIGINALS[slot].raw(),
            required: true,
        };
        let before = calls.load(Ordering::Relaxed);
        let target = *function as *const c_void;
        // SAFETY: every detour has the signature of every target.
        unsafe { install_tables(&[std::slice::from_ref(&entry)], |_| Some(target)) }
            .unwrap_or_else(|error| panic!("{name}: {error}"));
        while calls.load(Ordering::Relaxed) < before + 200 {
            std::thread::yield_now();
        }
    }
    stop.store(true, Ordering::Relaxed);
    for caller in callers {
        caller.join().expect("a caller thread failed");
    }
    assert!(calls.load(Ordering::Relaxed) > 1000);
    for (name, function, offset) in &targets {
        // SAFETY: as above.
        let got = unsafe { (*function)(7) };
        let base = if *name == "shape_init" { 0 } else { 7 };
        assert_eq!(got, base + offset + 1_000_000, "{name} not detoured");
    }
    // SAFETY: as above.
    assert_eq!(unsafe { shape_neighbour(1) }, 78);
}
