//! How a user's text appears in a one-line error: quoted or escaped, clipped
//! to [`SHOWN_CHARS`] characters; the size and pod-id errors here and the
//! limiter's configuration errors all show values this way.

use std::fmt;

/// The most characters of a user's value or key an error shows: a variable
/// can hold 128 KiB, and its error is one line of a log.
pub const SHOWN_CHARS: usize = 200;

/// The first [`SHOWN_CHARS`] characters of `s`, and how many more it has.
fn clipped(s: &str) -> (&str, usize) {
    match s.char_indices().nth(SHOWN_CHARS) {
        Some((at, _)) => (&s[..at], s[at..].chars().count()),
        None => (s, 0),
    }
}

/// Says how much of a value was left out, after what was shown of it.
fn left_out(f: &mut fmt::Formatter<'_>, more: usize) -> fmt::Result {
    if more == 0 {
        Ok(())
    } else {
        write!(f, "… ({more} more characters)")
    }
}

/// Shows a user's value in one line: `"4x"`, `'{"0": 1}'` when it holds double
/// quotes, escaped when it holds control characters; at most [`SHOWN_CHARS`]
/// characters of it.
pub struct Quoted<'a>(&'a str);

/// `s` shown as a [`Quoted`] value.
pub fn quoted(s: &str) -> Quoted<'_> {
    Quoted(s)
}

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (s, more) = clipped(self.0);
        let plain = !s.chars().any(char::is_control);
        if plain && !s.contains('"') {
            write!(f, "\"{s}\"")?;
        } else if plain && !s.contains('\'') {
            write!(f, "'{s}'")?;
        } else {
            write!(f, "{s:?}")?;
        }
        left_out(f, more)
    }
}

/// Shows text (compact JSON, a device index) as it is, at most
/// [`SHOWN_CHARS`] characters of it.
pub struct Clipped<'a>(pub &'a str);

impl fmt::Display for Clipped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (s, more) = clipped(self.0);
        f.write_str(s)?;
        left_out(f, more)
    }
}

/// Shows a user's key or name as a Rust string literal, at most
/// [`SHOWN_CHARS`] characters of it.
pub struct Escaped<'a>(&'a str);

/// `s` shown as an [`Escaped`] string literal.
pub fn escaped(s: &str) -> Escaped<'_> {
    Escaped(s)
}

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (s, more) = clipped(self.0);
        write!(f, "{s:?}")?;
        left_out(f, more)
    }
}

/// Shows a path as it is (lossily, when it is not UTF-8), at most
/// [`SHOWN_CHARS`] characters of it.
pub struct ClippedPath<'a>(pub &'a std::path::Path);

impl fmt::Display for ClippedPath<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        Clipped(&self.0.to_string_lossy()).fmt(f)
    }
}

/// Shows a message someone else wrote (a parser's error), each of its runs
/// between backticks or double quotes, where parsers put the user's text, at
/// most [`SHOWN_CHARS`] characters long.
pub struct ClippedRuns<'a>(pub &'a str);

impl fmt::Display for ClippedRuns<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rest = self.0;
        while let Some(open) = rest.find(['`', '"']) {
            let delimiter = rest.as_bytes()[open];
            f.write_str(&rest[..=open])?;
            let body = &rest[open + 1..];
            let close = closing(body, delimiter);
            let (run, more) = clipped(&body[..close.unwrap_or(body.len())]);
            f.write_str(run)?;
            match close {
                Some(at) => {
                    f.write_str(&body[at..=at])?;
                    rest = &body[at + 1..];
                }
                None => rest = "",
            }
            left_out(f, more)?;
        }
        f.write_str(rest)
    }
}

/// Where the run in `body` that `delimiter` opened ends; a double-quoted
/// run skips escaped characters (`\"`).
fn closing(body: &str, delimiter: u8) -> Option<usize> {
    let mut escaped = false;
    for (at, byte) in body.bytes().enumerate() {
        match byte {
            _ if escaped => escaped = false,
            b'\\' if delimiter == b'"' => escaped = true,
            _ if byte == delimiter => return Some(at),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_picks_the_form_that_stays_one_line() {
        assert_eq!(quoted("4x").to_string(), "\"4x\"");
        assert_eq!(quoted(r#"{"0": 1}"#).to_string(), r#"'{"0": 1}'"#);
        assert_eq!(quoted("a\nb").to_string(), r#""a\nb""#);
        assert_eq!(escaped("x\ny").to_string(), r#""x\ny""#);
        assert_eq!(Clipped("16").to_string(), "16");
    }

    #[test]
    fn long_text_is_clipped_and_says_how_much_is_left_out() {
        let long = "é".repeat(SHOWN_CHARS + 5);
        let shown = quoted(&long).to_string();
        assert!(shown.ends_with("\"… (5 more characters)"), "{shown}");
        assert_eq!(shown.chars().filter(|c| *c == 'é').count(), SHOWN_CHARS);
        assert!(
            Clipped(&long)
                .to_string()
                .ends_with("é… (5 more characters)")
        );
    }

    #[test]
    fn runs_of_a_parsers_message_are_clipped_one_by_one() {
        let long = "x".repeat(SHOWN_CHARS + 7);
        let message = format!("unknown field `{long}`, expected `listen`");
        assert_eq!(
            ClippedRuns(&message).to_string(),
            format!(
                "unknown field `{}`… (7 more characters), expected `listen`",
                &long[..SHOWN_CHARS]
            )
        );
        let escaped = format!("invalid type: string \"a\\\"{long}\", expected a boolean");
        let out = ClippedRuns(&escaped).to_string();
        assert!(
            out.ends_with("\"… (10 more characters), expected a boolean"),
            "{out}"
        );
        let open = format!("unterminated `{long}");
        assert!(
            ClippedRuns(&open)
                .to_string()
                .ends_with("x… (7 more characters)")
        );
        assert_eq!(
            ClippedRuns("plain `a` \"b\"").to_string(),
            "plain `a` \"b\""
        );
        assert_eq!(
            ClippedPath(std::path::Path::new(&long)).to_string(),
            Clipped(&long).to_string()
        );
    }
}
