//! `libadd_path.so`: keeps a container's search paths right even when the
//! image's entrypoint rewrites them.
//!
//! Preloaded (`LD_PRELOAD` or `/etc/ld.so.preload`) into every process of the
//! container, the library does its whole job in one constructor:
//!
//! 1. ld.so maps the library and runs `init` before `main`, while the process
//!    is still single-threaded.
//! 2. For each of `PATH`, `LD_PRELOAD`, `LD_LIBRARY_PATH`, `init` reads the
//!    variable and its two sources, `TF_<VAR>` (appended) and
//!    `TF_PREPEND_<VAR>` (put first). When neither source is set it moves on
//!    without touching the variable.
//! 3. `merge`, a pure function, computes the new value: only entries not
//!    already present are added, empty entries of the sources are dropped, the
//!    existing value is kept as it is. `None` means nothing would change.
//! 4. `setenv` writes the new value into the process's real `environ`, so the
//!    program itself and every child it starts with `execve`, `posix_spawn` or
//!    `system` sees it. A child that is preloaded too runs the same constructor
//!    and finds nothing to add.
//!
//! ld.so reads `LD_LIBRARY_PATH` and `LD_PRELOAD` once, before any constructor
//! runs, so changes to those two only take effect in children, not in the
//! current process's own later `dlopen` calls.

use std::ffi::{CString, OsString};
use std::io::Write as _;
use std::os::unix::ffi::OsStrExt;

/// How ld.so and libc split one list-valued variable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ListKind {
    /// `PATH`, `LD_LIBRARY_PATH`: `:`-separated; an empty element means the
    /// current directory.
    Colon,
    /// `LD_PRELOAD`: ld.so splits at `:` and at spaces and skips empty elements
    /// (glibc `handle_preload_list`, `strcspn(p, " :")`).
    Preload,
}

impl ListKind {
    fn is_separator(self, byte: u8) -> bool {
        match self {
            ListKind::Colon => byte == b':',
            ListKind::Preload => byte == b':' || byte == b' ',
        }
    }

    /// The non-empty elements of `value`, in order.
    fn entries(self, value: &[u8]) -> impl Iterator<Item = &[u8]> {
        value
            .split(move |&byte| self.is_separator(byte))
            .filter(|entry| !entry.is_empty())
    }
}

/// One variable we maintain and the two variables that feed it.
struct Target {
    var: &'static str,
    append: &'static str,
    prepend: &'static str,
    kind: ListKind,
}

const TARGETS: [Target; 3] = [
    Target {
        var: "PATH",
        append: "TF_PATH",
        prepend: "TF_PREPEND_PATH",
        kind: ListKind::Colon,
    },
    Target {
        var: "LD_PRELOAD",
        append: "TF_LD_PRELOAD",
        prepend: "TF_PREPEND_LD_PRELOAD",
        kind: ListKind::Preload,
    },
    Target {
        var: "LD_LIBRARY_PATH",
        append: "TF_LD_LIBRARY_PATH",
        prepend: "TF_PREPEND_LD_LIBRARY_PATH",
        kind: ListKind::Colon,
    },
];

/// The new value of a list variable whose current value is `existing`
/// (`None`: unset), after adding the entries of `prepend` in front and those of
/// `append` at the end; `None` when that changes nothing.
///
/// - Entries already in `existing` are not added again, and each new entry is
///   added once; an entry in both `prepend` and `append` goes in front.
///   Entries compare as bytes (`/a` and `/a/` differ).
/// - Empty entries of `append` and `prepend` are dropped: in `PATH` they would
///   mean the current directory.
/// - `existing` is kept byte for byte, empty elements included: those are the
///   program's own choice, and rewriting them would change its search order.
///   A set but empty `existing` counts as no entries (ld.so ignores an empty
///   `LD_LIBRARY_PATH`; the result is not `:new`). For `LD_PRELOAD` only,
///   separators at either end of `existing` are trimmed: ld.so skips empty
///   elements there, so they carry no meaning, and keeping them would put an
///   empty element next to the new ones.
/// - New entries are joined with `:`, which ld.so also accepts in `LD_PRELOAD`,
///   so a space-separated `LD_PRELOAD` keeps its spaces between the existing
///   entries.
fn merge(
    existing: Option<&[u8]>,
    append: Option<&[u8]>,
    prepend: Option<&[u8]>,
    kind: ListKind,
) -> Option<Vec<u8>> {
    let existing = existing.unwrap_or_default();
    let mut present: Vec<&[u8]> = kind.entries(existing).collect();
    // Prepend first, so an entry in both sources takes its place in front.
    let front = new_entries(prepend, kind, &mut present);
    let back = new_entries(append, kind, &mut present);
    if front.is_empty() && back.is_empty() {
        return None;
    }
    let kept = match kind {
        ListKind::Colon => existing,
        ListKind::Preload => trim_separators(existing, kind),
    };
    let mut pieces = front;
    if !kept.is_empty() {
        pieces.push(kept);
    }
    pieces.extend(back);
    Some(pieces.join(&b':'))
}

/// The non-empty entries of `source` not yet in `present`, each once, in order;
/// records them in `present`.
fn new_entries<'a>(
    source: Option<&'a [u8]>,
    kind: ListKind,
    present: &mut Vec<&'a [u8]>,
) -> Vec<&'a [u8]> {
    let mut added = Vec::new();
    for entry in kind.entries(source.unwrap_or_default()) {
        if !present.contains(&entry) {
            present.push(entry);
            added.push(entry);
        }
    }
    added
}

/// `value` without separators at either end.
fn trim_separators(value: &[u8], kind: ListKind) -> &[u8] {
    let start = value
        .iter()
        .position(|&byte| !kind.is_separator(byte))
        .unwrap_or(value.len());
    let end = value
        .iter()
        .rposition(|&byte| !kind.is_separator(byte))
        .map_or(start, |last| last + 1);
    &value[start..end]
}

/// Runs once, when ld.so initialises the library.
///
/// Why `setenv` here is race-free: ld.so runs initialisers one at a time on a
/// single thread (at startup, the initial thread before `main`; in `dlopen`,
/// under its load lock), and for a preloaded library no other thread of the
/// program exists yet, so nothing calls `getenv` or `setenv` concurrently.
/// Two ways around that argument, both outside the intended use: loading this
/// library with `dlopen` into a program that already runs threads, or a
/// constructor that ran before ours and started a thread that reads the
/// environment.
///
/// What it cannot guarantee: ld.so initialises a preloaded library after the
/// program's other shared libraries (all but the library's own dependencies),
/// so their constructors run first and see the old values. Measured with
/// glibc 2.36: a constructor in a `DT_NEEDED` library of the program printed
/// the old `PATH`; the program's own constructor, its `main`, and every child
/// saw the new one.
// `unsafe` acknowledges code before `main`: this body only reads the
// environment, calls `setenv` and may write to stderr, none of which needs
// anything `main` would have set up.
#[ctor::ctor(unsafe)]
fn init() {
    // A panic must not unwind into ld.so; the panic hook has already printed
    // its message.
    if std::panic::catch_unwind(update_all).is_err() {
        report(format_args!(
            "internal error, search paths may be only partly updated"
        ));
    }
}

/// Applies [`merge`] to every variable in [`TARGETS`].
fn update_all() {
    for target in &TARGETS {
        let append = std::env::var_os(target.append);
        let prepend = std::env::var_os(target.prepend);
        if append.is_none() && prepend.is_none() {
            continue;
        }
        let existing = std::env::var_os(target.var);
        let merged = merge(
            as_bytes(&existing),
            as_bytes(&append),
            as_bytes(&prepend),
            target.kind,
        );
        if let Some(value) = merged
            && let Err(error) = set_env(target.var, value)
        {
            report(format_args!("could not set {}: {error}", target.var));
        }
    }
}

fn as_bytes(value: &Option<OsString>) -> Option<&[u8]> {
    value.as_deref().map(OsStrExt::as_bytes)
}

/// Sets `name` to `value` in the process's `environ`, overwriting.
fn set_env(name: &str, value: Vec<u8>) -> std::io::Result<()> {
    let name = CString::new(name)?;
    let value = CString::new(value)?;
    // SAFETY: both pointers are NUL-terminated strings that outlive the call
    // (setenv copies them). setenv is not thread-safe; the only caller is
    // `init`, which runs before any other thread exists (see there).
    let rc = unsafe { libc::setenv(name.as_ptr(), value.as_ptr(), 1) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// One line on stderr; a failed write is ignored, there is nowhere else to say it.
fn report(message: std::fmt::Arguments<'_>) {
    let line = format!("libadd_path: {message}\n");
    std::io::stderr().write_all(line.as_bytes()).ok();
}

#[cfg(test)]
mod tests {
    use super::{ListKind, merge};
    use ListKind::{Colon, Preload};

    /// `(name, existing, append, prepend, kind, expected)`; `expected` `None`:
    /// the variable is left alone.
    type Case = (
        &'static str,
        Option<&'static str>,
        Option<&'static str>,
        Option<&'static str>,
        ListKind,
        Option<&'static str>,
    );

    #[rustfmt::skip]
    const CASES: &[Case] = &[
        // Nothing to do.
        ("no sources", Some("/a:/b"), None, None, Colon, None),
        ("no sources, unset", None, None, None, Colon, None),
        ("empty sources", Some("/a"), Some(""), Some(""), Colon, None),
        ("only separators", Some("/a"), Some("::"), Some(":"), Colon, None),
        ("all present", Some("/a:/b"), Some("/b"), Some("/a"), Colon, None),
        ("present, odd existing", Some(":/a::"), Some("/a"), None, Colon, None),
        // Append.
        ("append", Some("/a:/b"), Some("/c"), None, Colon, Some("/a:/b:/c")),
        ("append several", Some("/a"), Some("/c:/d"), None, Colon, Some("/a:/c:/d")),
        ("append to unset", None, Some("/c:/d"), None, Colon, Some("/c:/d")),
        ("append to empty", Some(""), Some("/c"), None, Colon, Some("/c")),
        ("append skips present", Some("/a:/b"), Some("/b:/c:/a"), None, Colon, Some("/a:/b:/c")),
        ("append collapses own duplicates", Some("/a"), Some("/c:/c:/d:/c"), None, Colon, Some("/a:/c:/d")),
        ("append drops empty inside", Some("/a"), Some("/c::/d"), None, Colon, Some("/a:/c:/d")),
        ("append drops empty at ends", Some("/a"), Some(":/c:"), None, Colon, Some("/a:/c")),
        // Prepend.
        ("prepend", Some("/a:/b"), None, Some("/c"), Colon, Some("/c:/a:/b")),
        ("prepend several", Some("/a"), None, Some("/c:/d"), Colon, Some("/c:/d:/a")),
        ("prepend to unset", None, None, Some("/c"), Colon, Some("/c")),
        ("prepend to empty", Some(""), None, Some("/c"), Colon, Some("/c")),
        ("prepend keeps present in place", Some("/a:/b"), None, Some("/b:/c"), Colon, Some("/c:/a:/b")),
        ("prepend collapses own duplicates", Some("/a"), None, Some("/c:/d:/c"), Colon, Some("/c:/d:/a")),
        ("prepend drops empty", Some("/a"), None, Some(":/c::/d:"), Colon, Some("/c:/d:/a")),
        // Both.
        ("both", Some("/a"), Some("/z"), Some("/p"), Colon, Some("/p:/a:/z")),
        ("both to unset", None, Some("/z"), Some("/p"), Colon, Some("/p:/z")),
        ("both, prepend wins", Some("/a"), Some("/x:/z:/y"), Some("/y:/p:/x"), Colon, Some("/y:/p:/x:/a:/z")),
        ("both, present wins", Some("/a"), Some("/a:/z"), Some("/a:/p"), Colon, Some("/p:/a:/z")),
        // The existing value is kept as it is.
        ("existing empty elements kept", Some("/a::/b:"), Some("/c"), Some("/p"), Colon, Some("/p:/a::/b::/c")),
        ("existing leading empty kept", Some(":/a"), Some("/c"), None, Colon, Some(":/a:/c")),
        ("existing duplicates kept", Some("/a:/b:/a"), Some("/c"), None, Colon, Some("/a:/b:/a:/c")),
        ("colon list keeps spaces", Some("/my dir"), Some("/x y:/z"), None, Colon, Some("/my dir:/x y:/z")),
        ("no normalisation", Some("/a/"), Some("/a"), None, Colon, Some("/a/:/a")),
        // LD_PRELOAD.
        ("preload append", Some("a.so"), Some("b.so"), None, Preload, Some("a.so:b.so")),
        ("preload spaces kept", Some("a.so b.so"), Some("c.so"), None, Preload, Some("a.so b.so:c.so")),
        ("preload prepend to spaces", Some("a.so b.so"), None, Some("c.so"), Preload, Some("c.so:a.so b.so")),
        ("preload present via spaces", Some("a.so b.so"), Some("b.so"), Some("a.so"), Preload, None),
        ("preload source split at spaces", Some("a.so"), Some("b.so  c.so a.so"), None, Preload, Some("a.so:b.so:c.so")),
        ("preload mixed source", Some("a.so"), Some(" b.so: :c.so "), Some("p.so p.so"), Preload, Some("p.so:a.so:b.so:c.so")),
        ("preload trims existing ends", Some(" a.so b.so: "), Some("c.so"), None, Preload, Some("a.so b.so:c.so")),
        ("preload blank existing", Some(" : "), Some("c.so"), None, Preload, Some("c.so")),
        ("preload to unset", None, Some("b.so"), Some("a.so"), Preload, Some("a.so:b.so")),
        ("preload only separators", Some("a.so"), Some(" : "), None, Preload, None),
    ];

    #[test]
    fn merge_table() {
        let mut failures = Vec::new();
        for &(name, existing, append, prepend, kind, expected) in CASES {
            let got = merge(
                existing.map(str::as_bytes),
                append.map(str::as_bytes),
                prepend.map(str::as_bytes),
                kind,
            );
            let got = got.map(|value| String::from_utf8_lossy(&value).into_owned());
            if got.as_deref() != expected {
                failures.push(format!("{name}: expected {expected:?}, got {got:?}"));
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    #[test]
    fn merge_is_idempotent() {
        for &(name, _, append, prepend, kind, expected) in CASES {
            if let Some(once) = expected {
                let again = merge(
                    Some(once.as_bytes()),
                    append.map(str::as_bytes),
                    prepend.map(str::as_bytes),
                    kind,
                );
                assert_eq!(again, None, "{name}: second run changed {once:?}");
            }
        }
    }

    #[test]
    fn merge_is_byte_exact() {
        let existing: &[u8] = b"/a\xff";
        let got = merge(Some(existing), Some(b"/b\xfe"), None, Colon);
        assert_eq!(got.as_deref(), Some(&b"/a\xff:/b\xfe"[..]));
    }
}
