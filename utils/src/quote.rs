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
}
