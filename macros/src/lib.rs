//! Proc-macros that generate the limiter's detours.
//!
//! One declaration per intercepted symbol, inside one table per API family:
//!
//! ```ignore
//! gpushare_macros::detours! {
//!     /// The memory family.
//!     pub static MEMORY_DETOURS;
//!
//!     /// Allocation through the classic entry point.
//!     required fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult
//!         => ops::mem_alloc;
//! }
//! ```
//!
//! For each declaration this generates a module named after the symbol with:
//! - `Signature`, the typed `unsafe extern "C"` function pointer;
//! - `ORIGINAL`, the slot the installer fills with the trampoline;
//! - `detour`, the `extern "C"` function the driver's prologue jumps to. It
//!   forwards to the original when the limiter is off or the thread is
//!   already inside a detour (the limiter's own driver calls), otherwise runs
//!   the handler `ops::mem_alloc(original, dptr, bytesize)` under
//!   `catch_unwind`, and turns its `Err` into a return value or a call of the
//!   original through `gpushare_hook::IntoReturn`; a panic falls back
//!   to the original, reported once. The handler's `original` is a forwarder
//!   that remembers the result: a handler that fails after calling it gets
//!   that result returned, so no call reaches the driver twice;
//! - `ENTRY`, the install entry; and the table `MEMORY_DETOURS: &[HookEntry]`.
//!
//! The return type must implement `gpushare_hook::Unavailable`, the
//! value returned in the one case no original exists (never, once installed),
//! and `gpushare_hook::thread_local::ZeroInit` (the remembered result is an
//! initial-exec thread-local: see `gpushare_hook::thread_local`).
//!
//! A declaration marked `ptsz` (`required ptsz fn cuLaunchKernel(...) -> CUresult
//! => ops::launch_kernel;`) also declares the driver's per-thread-default-stream
//! twin `cuLaunchKernel_ptsz` with the same signature, always optional (older
//! drivers lack it), with its own original: the handler runs as
//! `ops::launch_kernel::<false>` for the first and `ops::launch_kernel::<true>`
//! for the twin, so it takes a `const PER_THREAD: bool`.
//!
//! A declaration whose handler is marked `around` (`=> around ops::launch;`)
//! leaves the call of the original to the detour: the handler, called
//! without `original`, decides before the call and returns a value of
//! `gpushare_hook::AfterCall`; the detour then calls the original with
//! the caller's arguments and hands its result to that value, and the caller
//! gets the original's result. Why: the driver runs from the detour's frame,
//! not from under the handler's; the H100 machine's kernel launch call took
//! 130–140 ns longer when called five frames deeper, under the handler.
//! Errors and panics are handled as above; a panic after the call
//! still returns the original's result. `=> around ops::launch, again
//! ops::again;` also has the detour ask `ops::again(result, tries)` after
//! the original returned (admitted or bypassed) whether to call it once
//! more: a launch the GPU had no room for is tried again once room was
//! made.

use proc_macro::TokenStream;
use proc_macro2::TokenStream as TokenStream2;
use quote::quote;
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::{Attribute, FnArg, Ident, Pat, Path, Token, Type, Visibility, parenthesized};

mod kw {
    syn::custom_keyword!(required);
    syn::custom_keyword!(optional);
    syn::custom_keyword!(ptsz);
    syn::custom_keyword!(around);
    syn::custom_keyword!(again);
}

struct Table {
    attrs: Vec<Attribute>,
    vis: Visibility,
    name: Ident,
    entries: Vec<Entry>,
}

/// One declaration as written.
struct Entry {
    attrs: Vec<Attribute>,
    required: bool,
    /// Also declares `<symbol>_ptsz`, the per-thread-default-stream twin.
    ptsz: bool,
    symbol: Ident,
    signature: Signature,
    handler: Path,
    /// The handler decides before the call; the detour calls the original.
    around: bool,
    /// For an `around` handler: asked, with the original's result and the
    /// tries so far, whether to call the original once more.
    again: Option<Path>,
}

/// The C signature a detour shares with its original (and its twin's).
struct Signature {
    args: Vec<(Ident, Type)>,
    output: Type,
}

/// One detour to generate: a declaration, or the `_ptsz` twin of one.
struct Detour<'a> {
    attrs: TokenStream2,
    required: bool,
    symbol: Ident,
    signature: &'a Signature,
    /// The handler call's path, with its `PER_THREAD` argument if any.
    handler: TokenStream2,
    around: bool,
    again: Option<&'a Path>,
}

impl Parse for Table {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let attrs = input.call(Attribute::parse_outer)?;
        let vis: Visibility = input.parse()?;
        input.parse::<Token![static]>()?;
        let name: Ident = input.parse()?;
        input.parse::<Token![;]>()?;
        let mut entries = Vec::new();
        while !input.is_empty() {
            entries.push(input.parse()?);
        }
        Ok(Self {
            attrs,
            vis,
            name,
            entries,
        })
    }
}

impl Parse for Entry {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let attrs = input.call(Attribute::parse_outer)?;
        let lookahead = input.lookahead1();
        let required = if lookahead.peek(kw::required) {
            input.parse::<kw::required>()?;
            true
        } else if lookahead.peek(kw::optional) {
            input.parse::<kw::optional>()?;
            false
        } else {
            return Err(lookahead.error());
        };
        let ptsz = input.peek(kw::ptsz);
        if ptsz {
            input.parse::<kw::ptsz>()?;
        }
        input.parse::<Token![fn]>()?;
        let symbol: Ident = input.parse()?;
        let content;
        parenthesized!(content in input);
        let raw_args: Punctuated<FnArg, Token![,]> =
            content.parse_terminated(FnArg::parse, Token![,])?;
        let mut args = Vec::new();
        for arg in raw_args {
            let FnArg::Typed(typed) = arg else {
                return Err(syn::Error::new_spanned(arg, "detours take no self"));
            };
            let Pat::Ident(pat) = *typed.pat else {
                return Err(syn::Error::new_spanned(typed.pat, "expected `name: Type`"));
            };
            args.push((pat.ident, *typed.ty));
        }
        input.parse::<Token![->]>()?;
        let output: Type = input.parse()?;
        input.parse::<Token![=>]>()?;
        let around = input.peek(kw::around);
        if around {
            input.parse::<kw::around>()?;
        }
        let handler: Path = input.parse()?;
        let again = if around && input.peek(Token![,]) {
            input.parse::<Token![,]>()?;
            input.parse::<kw::again>()?;
            Some(input.parse::<Path>()?)
        } else {
            None
        };
        input.parse::<Token![;]>()?;
        Ok(Self {
            attrs,
            required,
            ptsz,
            symbol,
            signature: Signature { args, output },
            handler,
            around,
            again,
        })
    }
}

impl Entry {
    /// The detours this declaration stands for: itself, and its twin.
    fn detours(&self) -> Vec<Detour<'_>> {
        let (attrs, handler) = (&self.attrs, &self.handler);
        let declared = quote!(#(#attrs)*);
        if !self.ptsz {
            return vec![Detour {
                attrs: declared,
                required: self.required,
                symbol: self.symbol.clone(),
                signature: &self.signature,
                handler: quote!(#handler),
                around: self.around,
                again: self.again.as_ref(),
            }];
        }
        let twin = Ident::new(&format!("{}_ptsz", self.symbol), self.symbol.span());
        let twin_doc = format!(
            " The `_ptsz` twin of `{}`: per-thread default stream.",
            self.symbol
        );
        vec![
            Detour {
                attrs: declared.clone(),
                required: self.required,
                symbol: self.symbol.clone(),
                signature: &self.signature,
                handler: quote!(#handler::<false>),
                around: self.around,
                again: self.again.as_ref(),
            },
            Detour {
                attrs: quote!(#declared #[doc = ""] #[doc = #twin_doc]),
                required: false,
                symbol: twin,
                signature: &self.signature,
                handler: quote!(#handler::<true>),
                around: self.around,
                again: self.again.as_ref(),
            },
        ]
    }
}

/// What the generated code of one detour is made of.
struct Parts<'a> {
    names: Vec<&'a Ident>,
    types: Vec<&'a Type>,
    output: &'a Type,
    handler: &'a TokenStream2,
    symbol_str: String,
    hook: TokenStream2,
}

fn expand_detour(detour: &Detour<'_>) -> TokenStream2 {
    let Detour {
        attrs,
        required,
        symbol,
        signature: Signature { args, output },
        handler,
        around,
        again,
    } = detour;
    let parts = Parts {
        names: args.iter().map(|(name, _)| name).collect(),
        types: args.iter().map(|(_, ty)| ty).collect(),
        output,
        handler,
        symbol_str: symbol.to_string(),
        hook: quote!(::gpushare_hook),
    };
    let symbol_cstr = syn::LitCStr::new(
        &std::ffi::CString::new(parts.symbol_str.clone()).unwrap_or_default(),
        symbol.span(),
    );
    let (support, body) = if *around {
        (TokenStream2::new(), around_body(&parts, *again))
    } else {
        forwarding_parts(&parts)
    };
    let Parts {
        names, types, hook, ..
    } = &parts;
    let module_doc = format!("`{symbol}`: the original, the detour and the install entry.");
    quote! {
        #[doc = #module_doc]
        #[allow(non_snake_case)]
        pub mod #symbol {
            #[allow(unused_imports)]
            use super::*;

            /// The driver's signature for this entry point.
            pub type Signature = unsafe extern "C" fn(#(#types),*) -> #output;

            /// The trampoline to the original, filled at installation.
            pub static ORIGINAL: #hook::Original<Signature> = #hook::Original::new();

            #support

            #attrs
            pub unsafe extern "C" fn detour(#(#names: #types),*) -> #output {
                let Some(original) = ORIGINAL.get() else {
                    return <#output as #hook::Unavailable>::UNAVAILABLE;
                };
                let Some(_guard) = #hook::DetourGuard::enter() else {
                    // SAFETY: the caller's arguments go unchanged to the
                    // original of the same signature.
                    return unsafe { original(#(#names),*) };
                };
                #body
            }

            /// How the installer finds and fills this detour.
            pub const ENTRY: #hook::HookEntry = #hook::HookEntry {
                symbol: #symbol_cstr,
                detour: || detour as *const (),
                original: ORIGINAL.raw(),
                required: #required,
            };
        }
    }
}

/// A handler that calls the original itself, through the forwarder that
/// remembers its result: the forwarder and its thread-local (`support`), and
/// the detour's body once the guard is held.
fn forwarding_parts(parts: &Parts<'_>) -> (TokenStream2, TokenStream2) {
    let Parts {
        names,
        types,
        output,
        handler,
        symbol_str,
        hook,
    } = parts;
    let support = quote! {
        ::gpushare_hook::initial_exec_thread_local! {
            /// What the original returned inside the current detour call,
            /// once the handler called it (`true` and the value).
            static FORWARDED: (bool, #output);
        }

        /// The original as the handler sees it: calls it and remembers
        /// the result, so that a handler failing after the call returns
        /// that result instead of running the driver a second time (a
        /// double launch, or an allocation the caller never sees).
        unsafe extern "C" fn forward(#(#names: #types),*) -> #output {
            let Some(original) = ORIGINAL.get() else {
                return <#output as #hook::Unavailable>::UNAVAILABLE;
            };
            // SAFETY: the handler passes the caller's arguments (or
            // values it vetted) to the original of the same signature.
            let value = unsafe { original(#(#names),*) };
            FORWARDED.with(|slot| slot.set((true, value)));
            value
        }
    };
    let body = quote! {
        FORWARDED.with(|slot| slot.set(::gpushare_hook::thread_local::zeroed()));
        let outcome = ::std::panic::catch_unwind(::std::panic::AssertUnwindSafe(|| {
            #handler(forward, #(#names),*)
        }));
        let (called, value) = FORWARDED
            .with(|slot| slot.replace(::gpushare_hook::thread_local::zeroed()));
        let forwarded = called.then_some(value);
        match outcome {
            Ok(Ok(value)) => value,
            Ok(Err(error)) => match #hook::IntoReturn::<#output>::into_return(error) {
                #hook::Disposition::Return(value) => value,
                // SAFETY: as above, the caller's own arguments; only
                // if the handler has not run the original already.
                #hook::Disposition::CallOriginal => {
                    forwarded.unwrap_or_else(|| unsafe { original(#(#names),*) })
                }
            },
            Err(_) => {
                #hook::report_panic(#symbol_str);
                // SAFETY: as above.
                forwarded.unwrap_or_else(|| unsafe { original(#(#names),*) })
            }
        }
    };
    (support, body)
}

/// The body of an `around` handler's detour once the guard is held: the
/// handler decides, the detour calls the original from its own frame and
/// hands the result back.
fn around_body(parts: &Parts<'_>, again: Option<&Path>) -> TokenStream2 {
    let Parts {
        names,
        output,
        handler,
        symbol_str,
        hook,
        ..
    } = parts;
    // The original's call; with `again`, called once more while `again`
    // asks (a panic there asks nothing more).
    let call = match again {
        Some(again) => quote! {{
            // SAFETY: as above.
            let mut value = unsafe { original(#(#names),*) };
            let mut tries = 0u32;
            while ::std::panic::catch_unwind(::std::panic::AssertUnwindSafe(|| {
                #again(value, tries)
            }))
            .unwrap_or(false)
            {
                tries += 1;
                // SAFETY: as above.
                value = unsafe { original(#(#names),*) };
            }
            value
        }},
        // SAFETY: as above.
        None => quote! { unsafe { original(#(#names),*) } },
    };
    quote! {
        let outcome = ::std::panic::catch_unwind(::std::panic::AssertUnwindSafe(|| {
            #handler(#(#names),*)
        }));
        match outcome {
            Ok(Ok(after)) => {
                let value = #call;
                let done = ::std::panic::catch_unwind(::std::panic::AssertUnwindSafe(|| {
                    #hook::AfterCall::<#output>::after(after, value)
                }));
                if done.is_err() {
                    #hook::report_panic(#symbol_str);
                }
                value
            }
            Ok(Err(error)) => match #hook::IntoReturn::<#output>::into_return(error) {
                #hook::Disposition::Return(value) => value,
                #hook::Disposition::CallOriginal => #call,
            },
            Err(_) => {
                #hook::report_panic(#symbol_str);
                // SAFETY: as above; the handler cannot call the original.
                unsafe { original(#(#names),*) }
            }
        }
    }
}

/// Declares one API family's detours and its install table. See the crate docs.
#[proc_macro]
pub fn detours(input: TokenStream) -> TokenStream {
    let table = syn::parse_macro_input!(input as Table);
    let Table {
        attrs,
        vis,
        name,
        entries,
    } = &table;
    let detours: Vec<Detour<'_>> = entries.iter().flat_map(Entry::detours).collect();
    let modules = detours.iter().map(expand_detour);
    let symbols: Vec<&Ident> = detours.iter().map(|detour| &detour.symbol).collect();
    let count = detours.len();
    quote! {
        #(#modules)*

        #(#attrs)*
        #vis static #name: [::gpushare_hook::HookEntry; #count] = [#(#symbols::ENTRY),*];
    }
    .into()
}
