//! Thread-locals for the launch path, in the initial-exec TLS model.
//!
//! Why: the limiter is a shared library, where `std::thread_local!` takes the
//! general-dynamic model: every access calls `__tls_get_addr`, which reads the
//! thread's DTV and the loader's TLS generation before it finds the variable.
//! A launch after a stretch of application work finds those lines cold: on
//! this repository's machine, two such accesses after 3 MB of other memory
//! traffic took ~400 cycles, against ~250 in the initial-exec model, which
//! reads the variable's offset from the GOT and adds it to the thread pointer
//! (`%fs:0`). The model marks the library `STATIC_TLS`: its whole TLS block
//! (976 bytes for the limiter, the standard library's included) gets a fixed
//! place at the thread pointer. The limiter is loaded at startup (`LD_PRELOAD`
//! or `/etc/ld.so.preload`; it must be, to interpose `dlopen`), where that
//! place is made for it; loaded by `dlopen` it would need that much of the
//! loader's spare static TLS.
//!
//! [`initial_exec_thread_local!`](crate::initial_exec_thread_local) declares
//! one such variable: a `Cell` of a [`ZeroInit`] type, zero at every thread's
//! start, without a destructor (usable at any point of a thread's life, even
//! during thread-local teardown, when the driver may still be called). On
//! other targets it is a `std::thread_local!` of the same value.

/// Types whose all-zero bytes are a valid value: the one a thread's
/// [`initial_exec_thread_local!`](crate::initial_exec_thread_local) starts
/// with (the TLS block's `.tbss` is zero-filled).
///
/// # Safety
/// Every byte of the type being zero must make a valid value.
pub unsafe trait ZeroInit {}

macro_rules! zero_init {
    ($($ty:ty),*) => {
        $(
            // SAFETY: zero is a valid value of every integer and of `bool`.
            unsafe impl ZeroInit for $ty {}
        )*
    };
}

zero_init!(bool, u8, u16, u32, u64, usize, i8, i16, i32, i64, isize);

// SAFETY: all zero is `None` (the null-pointer niche is guaranteed).
unsafe impl<T: ?Sized> ZeroInit for Option<&'static T> {}
// SAFETY: each field is valid at zero; padding has no validity.
unsafe impl<A: ZeroInit, B: ZeroInit> ZeroInit for (A, B) {}

/// The all-zero value of `T`, for the fallback on other targets.
pub const fn zeroed<T: ZeroInit>() -> T {
    // SAFETY: `T: ZeroInit`.
    unsafe { std::mem::zeroed() }
}

/// Declares a thread-local `Cell<$ty>` in the initial-exec TLS model, zero at
/// each thread's start; read through `NAME.with(|cell| ...)`, like
/// `std::thread_local!`. `$ty` must be [`ZeroInit`] and `Copy` (nothing is
/// dropped when a thread ends). An item: declared at a
/// module's level, not inside a function (the variable is assembly there).
///
/// ```
/// gpushare_hook::initial_exec_thread_local! {
///     /// Launches this thread made.
///     static LAUNCHES: u64;
/// }
///
/// fn main() {
///     LAUNCHES.with(|count| count.set(count.get() + 1));
///     assert_eq!(LAUNCHES.with(|count| count.get()), 1);
/// }
/// ```
#[macro_export]
macro_rules! initial_exec_thread_local {
    ($(#[$attr:meta])* $vis:vis static $name:ident: $ty:ty;) => {
        $(#[$attr])*
        #[allow(non_camel_case_types, clippy::upper_case_acronyms)]
        $vis struct $name;

        // Zero at each thread's start, and never dropped: plain data only.
        const _: () = {
            const fn zero_init<T: $crate::thread_local::ZeroInit + Copy>() {}
            zero_init::<$ty>()
        };

        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        ::core::arch::global_asm!(
            ".pushsection .tbss.gpushare,\"awT\",@nobits",
            ".balign {align}",
            concat!(".globl ", $crate::__initial_exec_symbol!($name)),
            concat!(".hidden ", $crate::__initial_exec_symbol!($name)),
            concat!(".type ", $crate::__initial_exec_symbol!($name), ",@object"),
            concat!(".size ", $crate::__initial_exec_symbol!($name), ", {size}"),
            concat!($crate::__initial_exec_symbol!($name), ":"),
            ".zero {size}",
            ".popsection",
            align = const ::core::mem::align_of::<::core::cell::Cell<$ty>>(),
            size = const ::core::mem::size_of::<::core::cell::Cell<$ty>>(),
        );

        impl $name {
            /// Runs `f` on the calling thread's cell.
            #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
            #[inline(always)]
            #[allow(dead_code)]
            $vis fn with<R>(&self, f: impl FnOnce(&::core::cell::Cell<$ty>) -> R) -> R {
                let cell: *const ::core::cell::Cell<$ty>;
                // SAFETY: `%fs:0` holds the thread pointer, and the GOT entry
                // the variable's offset from it (an R_X86_64_TPOFF64 the
                // loader fills): their sum is this thread's copy, zero-filled
                // at the thread's start, which `$ty: ZeroInit` makes valid.
                // It lives as long as the thread, which outlives `f`, and a
                // `Cell` is `!Sync`: only this thread gets the reference.
                unsafe {
                    ::core::arch::asm!(
                        "mov {cell}, qword ptr fs:[0]",
                        concat!(
                            "add {cell}, qword ptr [rip + ",
                            $crate::__initial_exec_symbol!($name),
                            "@GOTTPOFF]"
                        ),
                        cell = out(reg) cell,
                        options(nostack, pure, readonly),
                    );
                    f(&*cell)
                }
            }

            /// Runs `f` on the calling thread's cell.
            #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
            #[inline(always)]
            #[allow(dead_code)]
            $vis fn with<R>(&self, f: impl FnOnce(&::core::cell::Cell<$ty>) -> R) -> R {
                ::std::thread_local! {
                    static CELL: ::core::cell::Cell<$ty> =
                        const { ::core::cell::Cell::new($crate::thread_local::zeroed::<$ty>()) };
                }
                CELL.with(f)
            }
        }
    };
}

/// The quoted assembly name of the variable `$name` declared in the calling
/// module: its path, so that one name in two modules makes two variables.
#[doc(hidden)]
#[macro_export]
macro_rules! __initial_exec_symbol {
    ($name:ident) => {
        concat!("\"", module_path!(), "::", stringify!($name), "\"")
    };
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    crate::initial_exec_thread_local! {
        static COUNT: u64;
    }

    mod other {
        crate::initial_exec_thread_local! {
            /// The same name in another module: another variable.
            pub(super) static COUNT: u64;
        }
    }

    crate::initial_exec_thread_local! {
        static PAIR: (bool, i32);
    }

    fn bump(cell: &Cell<u64>, by: u64) -> u64 {
        cell.set(cell.get() + by);
        cell.get()
    }

    #[test]
    fn each_thread_starts_at_zero_and_keeps_its_own() {
        assert_eq!(COUNT.with(|count| bump(count, 1)), 1);
        assert_eq!(COUNT.with(|count| bump(count, 1)), 2);
        std::thread::spawn(|| {
            assert_eq!(COUNT.with(Cell::get), 0);
            assert_eq!(COUNT.with(|count| bump(count, 5)), 5);
        })
        .join()
        .unwrap();
        assert_eq!(COUNT.with(Cell::get), 2);
    }

    #[test]
    fn variables_of_one_name_in_two_modules_are_distinct() {
        COUNT.with(|count| count.set(7));
        other::COUNT.with(|count| count.set(11));
        assert_eq!(COUNT.with(Cell::get), 7);
        assert_eq!(other::COUNT.with(Cell::get), 11);
    }

    #[test]
    fn a_pair_starts_as_zeros_and_takes_any_value() {
        assert_eq!(PAIR.with(Cell::get), (false, 0));
        PAIR.with(|pair| pair.set((true, -3)));
        assert_eq!(PAIR.with(Cell::take), (true, -3));
        assert_eq!(PAIR.with(Cell::get), (false, 0));
    }
}
