//! Logging for code that runs inside someone else's program.
//!
//! [`init`] installs a `tracing` subscriber that writes to stderr, quiet by
//! default (warnings and errors only), with every line tagged so it can be told
//! apart from the host program's own output:
//!
//! ```text
//! [cuda-limiter pid=4242] 2026-05-01T12:00:00.123456Z  WARN gpushare_limiter::quota: message
//! ```
//!
//! The level comes from one environment variable (the limiter reads
//! `CUDA_LIMITER_LOG`): `off`, `error`, `warn`, `info`, `debug` or `trace`,
//! case-insensitive. Unset or empty means `warn`; anything else also means
//! `warn`, with one warning naming the variable.
//!
//! The subscriber is the global default of *our* copy of `tracing`: a cdylib
//! links its own, so a Rust host program that installs its own subscriber is
//! not disturbed, and neither are we.

use std::ffi::OsStr;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};

use tracing::level_filters::LevelFilter;
use tracing::{Event, Subscriber};
use tracing_subscriber::filter::filter_fn;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::layer::{Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

/// The level when the variable is unset, empty or invalid.
pub const DEFAULT_LEVEL: LevelFilter = LevelFilter::WARN;

const LEVELS: [(&str, LevelFilter); 6] = [
    ("off", LevelFilter::OFF),
    ("error", LevelFilter::ERROR),
    ("warn", LevelFilter::WARN),
    ("info", LevelFilter::INFO),
    ("debug", LevelFilter::DEBUG),
    ("trace", LevelFilter::TRACE),
];

/// `off`, `error`, `warn`, `info`, `debug` or `trace`, case-insensitive,
/// surrounding whitespace allowed.
pub fn parse_level(s: &str) -> Option<LevelFilter> {
    let s = s.trim();
    LEVELS
        .iter()
        .find_map(|&(name, level)| name.eq_ignore_ascii_case(s).then_some(level))
}

/// Installs the stderr subscriber, its level read from the environment
/// variable `env_var`; lines are tagged with the variable's name less `_LOG`,
/// lowercased with `-` for `_` (`CUDA_LIMITER_LOG` → `[cuda-limiter pid=…]`).
///
/// Only the first call in a process does anything; it never panics.
pub fn init(env_var: &str) {
    init_quieting(env_var, &[]);
}

/// [`init`], dropping every event of the targets in `quiet` (a target and
/// its modules): a library's own reports of what its callers handle and
/// report themselves.
pub fn init_quieting(env_var: &str, quiet: &'static [&'static str]) {
    static STARTED: AtomicBool = AtomicBool::new(false);
    // Not a `Once`: it would poison and panic on the next call if the first
    // one panicked. A racing second caller returns before the subscriber is in
    // place; its early events are dropped, which is acceptable for logging.
    if STARTED.swap(true, Ordering::AcqRel) {
        return;
    }
    install(env_var, std::env::var_os(env_var).as_deref(), quiet);
}

/// Whether `target` is one of `quiet` or a module of one.
fn quieted(quiet: &[&str], target: &str) -> bool {
    quiet.iter().any(|q| {
        target
            .strip_prefix(q)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with("::"))
    })
}

fn install(env_var: &str, value: Option<&OsStr>, quiet: &'static [&'static str]) {
    let text = value.map(|v| v.to_string_lossy());
    let (level, invalid) = match text.as_deref() {
        None => (DEFAULT_LEVEL, None),
        Some(s) if s.trim().is_empty() => (DEFAULT_LEVEL, None),
        // A lossy (non-UTF-8) value never spells a level, so it lands here too.
        Some(s) => match parse_level(s) {
            Some(level) => (level, None),
            None => (DEFAULT_LEVEL, Some(s)),
        },
    };
    let lines = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .event_format(Tagged {
            tag: tag_for(env_var),
        })
        .with_filter(filter_fn(move |meta| !quieted(quiet, meta.target())))
        .with_filter(level);
    let installed = tracing_subscriber::registry().with(lines).try_init();
    match installed {
        Ok(()) => {}
        // A global subscriber of this copy of `tracing` is already set (an
        // earlier `install`, or a test harness): keep it, it already logs.
        Err(_already_set) => {}
    }
    if let Some(value) = invalid {
        tracing::warn!(
            "{env_var}={value:?} is not a log level (expected off, error, warn, info, debug or trace); logging at warn"
        );
    }
}

/// `CUDA_LIMITER_LOG` → `cuda-limiter`.
fn tag_for(env_var: &str) -> String {
    let base = env_var.strip_suffix("_LOG").unwrap_or(env_var);
    let tag: String = base
        .chars()
        .map(|c| match c {
            '_' => '-',
            c => c.to_ascii_lowercase(),
        })
        .filter(|c| !c.is_control() && !c.is_whitespace() && *c != ']')
        .collect();
    if tag.is_empty() {
        "gpushare".to_owned()
    } else {
        tag
    }
}

/// `[tag pid=N] time LEVEL target: span{fields}: message fields`.
struct Tagged {
    tag: String,
}

impl<S, N> FormatEvent<S, N> for Tagged
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        // Per event, not cached: a forked child must show its own pid.
        write!(writer, "[{} pid={}] ", self.tag, std::process::id())?;
        SystemTime.format_time(&mut writer)?;
        let meta = event.metadata();
        write!(writer, " {:>5} {}: ", meta.level(), meta.target())?;
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                writer.write_str(span.name())?;
                let extensions = span.extensions();
                if let Some(fields) = extensions.get::<FormattedFields<N>>()
                    && !fields.is_empty()
                {
                    write!(writer, "{{{fields}}}")?;
                }
                writer.write_str(": ")?;
            }
        }
        ctx.format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

/// `error` and its sources on one line, each said once (a message that
/// already quotes its source is not followed by it again), line breaks
/// made spaces: what a log line, a kubelet or a terminal shows.
pub fn one_line(error: &(dyn std::error::Error + 'static)) -> String {
    let mut line = String::new();
    let mut cause = Some(error);
    while let Some(current) = cause {
        let text = current.to_string().replace(['\n', '\r'], " ");
        if !line.contains(&text) {
            if !line.is_empty() {
                line.push_str(": ");
            }
            line.push_str(&text);
        }
        cause = current.source();
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;
    use std::sync::{Arc, Mutex};
    use tracing_subscriber::fmt::MakeWriter;

    #[test]
    fn levels() {
        let table: &[(&str, Option<LevelFilter>)] = &[
            ("off", Some(LevelFilter::OFF)),
            ("OFF", Some(LevelFilter::OFF)),
            ("error", Some(LevelFilter::ERROR)),
            ("Error", Some(LevelFilter::ERROR)),
            ("warn", Some(LevelFilter::WARN)),
            ("WARN", Some(LevelFilter::WARN)),
            ("info", Some(LevelFilter::INFO)),
            (" info\n", Some(LevelFilter::INFO)),
            ("debug", Some(LevelFilter::DEBUG)),
            ("DeBuG", Some(LevelFilter::DEBUG)),
            ("trace", Some(LevelFilter::TRACE)),
            ("TRACE", Some(LevelFilter::TRACE)),
            ("", None),
            ("warning", None),
            ("verbose", None),
            ("3", None),
            ("info,debug", None),
            ("cuda_limiter=debug", None),
            ("tracé", None),
        ];
        for &(input, want) in table {
            assert_eq!(parse_level(input), want, "{input:?}");
        }
    }

    #[test]
    fn tags() {
        let table: &[(&str, &str)] = &[
            ("CUDA_LIMITER_LOG", "cuda-limiter"),
            ("HYPERVISOR_LOG", "hypervisor"),
            ("ADD_PATH_LOG", "add-path"),
            ("MY_DEBUG", "my-debug"),
            ("_LOG", "gpushare"),
            ("", "gpushare"),
            ("A B]\n_LOG", "ab"),
        ];
        for &(var, want) in table {
            assert_eq!(tag_for(var), want, "{var:?}");
        }
    }

    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Capture {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Capture {
        type Writer = Capture;
        fn make_writer(&'a self) -> Self::Writer {
            self.clone()
        }
    }

    fn captured(level: LevelFilter, emit: impl FnOnce()) -> String {
        let out = Capture::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(out.clone())
            .with_max_level(level)
            .event_format(Tagged {
                tag: tag_for("CUDA_LIMITER_LOG"),
            })
            .finish();
        tracing::subscriber::with_default(subscriber, emit);
        String::from_utf8(out.0.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn lines_are_tagged() {
        let text = captured(LevelFilter::WARN, || {
            let span = tracing::warn_span!("install", hooks = 3);
            let _entered = span.enter();
            tracing::warn!(symbol = "cuMemAlloc_v2", "hook failed");
            tracing::info!("not shown at warn");
        });
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 1, "{text:?}");
        let line = lines[0];
        let prefix = format!("[cuda-limiter pid={}] ", std::process::id());
        assert!(line.starts_with(&prefix), "{line}");
        assert!(
            line.contains("  WARN gpushare_utils::logging::tests: "),
            "{line}"
        );
        assert!(
            line.ends_with("install{hooks=3}: hook failed symbol=\"cuMemAlloc_v2\""),
            "{line}"
        );
        assert!(text.ends_with('\n'));
    }

    #[test]
    fn levels_filter() {
        let emit_all = || {
            tracing::error!("e");
            tracing::warn!("w");
            tracing::info!("i");
            tracing::debug!("d");
            tracing::trace!("t");
        };
        let table: &[(LevelFilter, usize)] = &[
            (LevelFilter::OFF, 0),
            (LevelFilter::ERROR, 1),
            (LevelFilter::WARN, 2),
            (LevelFilter::INFO, 3),
            (LevelFilter::DEBUG, 4),
            (LevelFilter::TRACE, 5),
        ];
        for &(level, lines) in table {
            assert_eq!(captured(level, emit_all).lines().count(), lines, "{level}");
        }
    }

    #[test]
    fn a_quieted_target_and_its_modules_are_dropped_and_no_other() {
        let quiet = ["kube_client::client::builder"];
        assert!(quieted(&quiet, "kube_client::client::builder"));
        assert!(quieted(&quiet, "kube_client::client::builder::inner"));
        assert!(!quieted(&quiet, "kube_client::client::builderx"));
        assert!(!quieted(&quiet, "kube_client::client"));
        assert!(!quieted(&[], "kube_client::client::builder"));
    }

    #[test]
    fn init_twice_does_not_panic() {
        // The only test that touches the global subscriber; `off` keeps other
        // tests' output clean.
        install("GPUSHARE_UTILS_TEST_LOG", Some(OsStr::new("off")), &[]);
        install("GPUSHARE_UTILS_TEST_LOG", Some(OsStr::new("bogus")), &[]);
        init("GPUSHARE_UTILS_TEST_LOG");
        init("GPUSHARE_UTILS_TEST_LOG");
    }

    #[test]
    fn an_error_and_its_sources_are_one_line_each_said_once() {
        #[derive(Debug, thiserror::Error)]
        enum Outer {
            #[error("cannot prepare")]
            Quiet(#[source] std::io::Error),
            #[error("cannot read: {0}")]
            Quoting(#[source] std::io::Error),
        }
        let io = || std::io::Error::other("no such\nfile");
        assert_eq!(
            one_line(&Outer::Quiet(io())),
            "cannot prepare: no such file"
        );
        assert_eq!(one_line(&Outer::Quoting(io())), "cannot read: no such file");
    }
}
