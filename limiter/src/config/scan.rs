//! The environment scan: collect the variables we know (last value of a name
//! wins); parsing happens afterwards, in [`resolve`](super::resolve), each
//! parsed value kept with its variable as a [`Val`].

use std::ffi::OsStr;

use super::ConfigError;
use super::vars::{Kind, NameProblem, Scope, classify};

pub(super) struct RawVar {
    pub(super) kind: Kind,
    pub(super) scope: Scope,
    pub(super) name: String,
    pub(super) value: String,
}

/// A parsed value with the variable it came from, for error messages.
#[derive(Clone, Copy)]
pub(super) struct Val<'a, T> {
    pub(super) name: &'a str,
    pub(super) raw: &'a str,
    pub(super) parsed: T,
}

impl<'a, T> Val<'a, T> {
    pub(super) fn new(var: &'a RawVar, parsed: T) -> Self {
        Self {
            name: &var.name,
            raw: &var.value,
            parsed,
        }
    }
}

#[derive(Default)]
pub(super) struct RawVars {
    pub(super) vars: Vec<RawVar>,
}

impl RawVars {
    pub(super) fn add(
        &mut self,
        name: &str,
        value: Result<&str, &OsStr>,
    ) -> Result<(), ConfigError> {
        let (kind, scope) = match classify(name) {
            Ok(Some(found)) => found,
            Ok(None) => return Ok(()),
            Err(problem) => {
                // The name itself is wrong here; keep the message on one line.
                let var = if name.contains(char::is_control) {
                    name.escape_debug().to_string()
                } else {
                    name.to_owned()
                };
                let value = match value {
                    Ok(v) => v.to_owned(),
                    Err(os) => os.to_string_lossy().into_owned(),
                };
                return Err(match problem {
                    NameProblem::BadSuffix { base, suffix } => ConfigError::BadSuffix {
                        var,
                        value,
                        base,
                        suffix,
                    },
                    NameProblem::OutOfRange { index } => {
                        ConfigError::IndexOutOfRange { var, value, index }
                    }
                });
            }
        };
        let value = value.map_err(|os| ConfigError::NotUnicode {
            var: name.to_owned(),
            lossy: os.to_string_lossy().into_owned(),
        })?;
        let var = RawVar {
            kind,
            scope,
            name: name.to_owned(),
            value: value.to_owned(),
        };
        match self
            .vars
            .iter_mut()
            .find(|v| v.kind == kind && v.scope == scope)
        {
            Some(old) => *old = var,
            None => self.vars.push(var),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_support::*;
    use crate::config::*;

    #[test]
    fn non_utf8_values() {
        use std::os::unix::ffi::OsStrExt;
        let bad = OsStr::from_bytes(b"4\xffg");
        // Ours: an error.
        let mut raw = RawVars::default();
        let e = raw.add("CUDA_DEVICE_MEMORY_LIMIT_1", Err(bad)).err();
        assert_eq!(
            e.map(|e| e.to_string()).as_deref(),
            Some("CUDA_DEVICE_MEMORY_LIMIT_1=\"4\u{fffd}g\" is not valid UTF-8")
        );
        // Someone else's: ignored.
        let mut raw = RawVars::default();
        assert_eq!(raw.add("LS_COLORS", Err(bad)), Ok(()));
        assert_eq!(raw.add("CUDA_LIMITER_LOG", Err(bad)), Ok(()));
        assert_eq!(raw.add("CUDA_LIMITER_MEMORY_LIMIT", Ok("1g")), Ok(()));
        let c = raw.finish();
        assert_eq!(c.map(|c| c.memory.resolve(0, None)), Ok(Some(GIB)));
    }

    #[test]
    fn later_values_win_and_unrelated_are_ignored() {
        let c = ok(&[
            ("PATH", "/usr/bin"),
            ("CUDA_VISIBLE_DEVICES", "1,2"),
            ("CUDA_DEVICE_MEMORY_LIMIT_0", "4x"),
            ("CUDA_DEVICE_MEMORY_LIMIT_0", "4g"),
            ("TENSOR_FUSION_OTHER", "{"),
        ]);
        assert_eq!(c.memory.resolve(0, None), Some(4 * GIB));
        assert!(c.compute.is_empty());
    }

    #[test]
    fn errors_do_not_depend_on_environment_order() {
        let a = ("CUDA_DEVICE_SM_LIMIT", "bad");
        let b = ("CUDA_LIMITER_MEMORY_LIMIT", "bad");
        assert_eq!(err(&[a, b]), err(&[b, a]));
        assert!(matches!(err(&[a, b]), ConfigError::Size { .. }));
    }

    #[test]
    fn from_env_matches_from_vars() {
        let vars = std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)));
        assert_eq!(LimiterConfig::from_env(), LimiterConfig::from_vars(vars));
    }
}
