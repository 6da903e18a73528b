//! Sizes and switches as users write them, in the limiter's environment and
//! in the hypervisor's configuration and claims alike.

use std::fmt;

use crate::quote::quoted;

const SIZE_SYNTAX: &str = "bytes or a number with k, m, g or t, e.g. 4g, 1024m, 1048576k";

/// Why a string is not a size; see [`parse_size`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SizeErrorKind {
    /// Nothing but whitespace.
    Empty,
    /// Not a whole number with an optional known unit.
    Invalid,
    /// A number with a minus sign.
    Negative,
    /// A number with a fractional part.
    Fractional,
    /// More than `u64::MAX` bytes.
    Overflow,
}

impl fmt::Display for SizeErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => write!(f, "is empty (expected {SIZE_SYNTAX})"),
            Self::Invalid => write!(f, "is not a size (expected {SIZE_SYNTAX})"),
            Self::Negative => write!(f, "is negative (expected {SIZE_SYNTAX})"),
            Self::Fractional => write!(f, "is not a whole number (expected {SIZE_SYNTAX})"),
            Self::Overflow => write!(f, "is too large (at most {} bytes)", u64::MAX),
        }
    }
}

/// A string that is not a size, e.g. `"4x" is not a size (expected …)`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} {kind}", quoted(.input))]
pub struct SizeError {
    input: String,
    kind: SizeErrorKind,
}

impl SizeError {
    /// Why the string is not a size.
    pub fn kind(&self) -> SizeErrorKind {
        self.kind
    }

    /// The string as given.
    pub fn input(&self) -> &str {
        &self.input
    }
}

/// Binary units, matched case-insensitively; the number is the power of 1024.
const UNITS: [(&str, u32); 18] = [
    ("", 0),
    ("b", 0),
    ("k", 1),
    ("kb", 1),
    ("ki", 1),
    ("kib", 1),
    ("m", 2),
    ("mb", 2),
    ("mi", 2),
    ("mib", 2),
    ("g", 3),
    ("gb", 3),
    ("gi", 3),
    ("gib", 3),
    ("t", 4),
    ("tb", 4),
    ("ti", 4),
    ("tib", 4),
];

/// Parses a size in bytes: a whole number, optionally followed by a binary
/// unit (`k`, `m`, `g`, `t`, also written `kb`/`kib`/`ki` and so on, any case;
/// `b` for bytes), with optional surrounding whitespace.
///
/// `"4g"` is 4 GiB, `"1024m"` 1 GiB, `"1048576"` 1 MiB.
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let fail = |kind| {
        Err(SizeError {
            input: s.to_owned(),
            kind,
        })
    };
    let t = s.trim();
    if t.is_empty() {
        return fail(SizeErrorKind::Empty);
    }
    let digits = t.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = t.split_at(digits);
    let starts_numeric = |r: &str| r.starts_with(|c: char| c.is_ascii_digit() || c == '.');
    if number.is_empty() {
        return match t.strip_prefix('-') {
            Some(rest) if starts_numeric(rest) => fail(SizeErrorKind::Negative),
            _ if t.starts_with('.') && starts_numeric(&t[1..]) => fail(SizeErrorKind::Fractional),
            _ => fail(SizeErrorKind::Invalid),
        };
    }
    if unit.starts_with('.') {
        return fail(SizeErrorKind::Fractional);
    }
    let Some(&(_, power)) = UNITS.iter().find(|(u, _)| u.eq_ignore_ascii_case(unit)) else {
        return fail(SizeErrorKind::Invalid);
    };
    // All ASCII digits, so parsing can only fail by overflow.
    let Ok(n) = number.parse::<u64>() else {
        return fail(SizeErrorKind::Overflow);
    };
    match n.checked_mul(1u64 << (10 * power)) {
        Some(bytes) => Ok(bytes),
        None => fail(SizeErrorKind::Overflow),
    }
}

/// `true`/`1`/`yes`/`on` or `false`/`0`/`no`/`off`, case-insensitive,
/// surrounding whitespace allowed.
pub fn parse_switch(s: &str) -> Option<bool> {
    let s = s.trim();
    let is = |words: [&str; 4]| words.iter().any(|w| w.eq_ignore_ascii_case(s));
    if is(["true", "1", "yes", "on"]) {
        Some(true)
    } else if is(["false", "0", "no", "off"]) {
        Some(false)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    #[test]
    fn sizes_accepted() {
        let table: &[(&str, u64)] = &[
            ("0", 0),
            ("1", 1),
            ("1048576", MIB),
            ("18446744073709551615", u64::MAX),
            ("007", 7),
            ("  4g  ", 4 * GIB),
            ("\t4g\n", 4 * GIB),
            ("4g", 4 * GIB),
            ("4G", 4 * GIB),
            ("4gb", 4 * GIB),
            ("4GB", 4 * GIB),
            ("4gib", 4 * GIB),
            ("4GiB", 4 * GIB),
            ("4Gi", 4 * GIB),
            ("1024m", GIB),
            ("1024M", GIB),
            ("1024mb", GIB),
            ("1024MiB", GIB),
            ("1024mi", GIB),
            ("1048576k", GIB),
            ("1048576K", GIB),
            ("1048576kb", GIB),
            ("1048576KiB", GIB),
            ("1048576ki", GIB),
            ("2t", 2 << 40),
            ("2T", 2 << 40),
            ("2tb", 2 << 40),
            ("2TiB", 2 << 40),
            ("2ti", 2 << 40),
            ("512b", 512),
            ("512B", 512),
            ("0g", 0),
            ("16777215t", 16_777_215 << 40),
        ];
        for &(input, want) in table {
            assert_eq!(parse_size(input), Ok(want), "{input:?}");
        }
    }

    #[test]
    fn sizes_rejected() {
        use SizeErrorKind::*;
        let table: &[(&str, SizeErrorKind)] = &[
            ("", Empty),
            ("   ", Empty),
            ("4x", Invalid),
            ("g", Invalid),
            ("4 g", Invalid),
            ("4gg", Invalid),
            ("4p", Invalid),
            ("+4g", Invalid),
            ("0x10", Invalid),
            ("1e9", Invalid),
            ("4g4", Invalid),
            ("four", Invalid),
            ("-", Invalid),
            ("４g", Invalid),
            ("-1", Negative),
            ("-4g", Negative),
            ("-0.5g", Negative),
            ("1.5g", Fractional),
            ("1.0", Fractional),
            ("1.", Fractional),
            (".5g", Fractional),
            ("18446744073709551616", Overflow),
            ("99999999999999999999999", Overflow),
            ("16777216t", Overflow),
            ("17179869184g", Overflow),
        ];
        for &(input, kind) in table {
            match parse_size(input) {
                Ok(v) => panic!("{input:?} parsed as {v}"),
                Err(e) => {
                    assert_eq!(e.kind(), kind, "{input:?}");
                    assert_eq!(e.input(), input);
                }
            }
        }
    }

    #[test]
    fn size_error_text() {
        let table: &[(&str, &str)] = &[
            (
                "4x",
                "\"4x\" is not a size (expected bytes or a number with k, m, g or t, e.g. 4g, 1024m, 1048576k)",
            ),
            (
                "",
                "\"\" is empty (expected bytes or a number with k, m, g or t, e.g. 4g, 1024m, 1048576k)",
            ),
            (
                "-1g",
                "\"-1g\" is negative (expected bytes or a number with k, m, g or t, e.g. 4g, 1024m, 1048576k)",
            ),
            (
                "1.5g",
                "\"1.5g\" is not a whole number (expected bytes or a number with k, m, g or t, e.g. 4g, 1024m, 1048576k)",
            ),
            (
                "99999999999999999999",
                "\"99999999999999999999\" is too large (at most 18446744073709551615 bytes)",
            ),
        ];
        for &(input, want) in table {
            let e = parse_size(input).err().map(|e| e.to_string());
            assert_eq!(e.as_deref(), Some(want), "{input:?}");
        }
    }

    #[test]
    fn switches() {
        let table: &[(&str, Option<bool>)] = &[
            ("true", Some(true)),
            (" ON ", Some(true)),
            ("Yes", Some(true)),
            ("1", Some(true)),
            ("false", Some(false)),
            ("off", Some(false)),
            ("NO", Some(false)),
            ("0", Some(false)),
            ("", None),
            ("maybe", None),
            ("2", None),
        ];
        for &(input, want) in table {
            assert_eq!(parse_switch(input), want, "{input:?}");
        }
    }
}
