//! Percents of SM time as users write them, and what 0, 100 and a soft
//! limit of 100 mean.

/// A whole number from 0 to 100, optional trailing `%`, surrounding whitespace allowed.
pub(super) fn parse_percent(s: &str) -> Option<u8> {
    let t = s.trim();
    let t = t.strip_suffix('%').unwrap_or(t);
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    t.parse::<u8>().ok().filter(|p| *p <= 100)
}

/// `None` for 0 and 100, which mean unlimited.
pub(super) fn limited(percent: u8) -> Option<u8> {
    (1..100).contains(&percent).then_some(percent)
}

/// The elastic ceiling as stored: 100 means the whole device.
pub(super) fn ceiling(soft: u8) -> Option<u8> {
    (soft < 100).then_some(soft)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percents() {
        let table: &[(&str, Option<u8>)] = &[
            ("0", Some(0)),
            ("1", Some(1)),
            ("050", Some(50)),
            ("99", Some(99)),
            ("100", Some(100)),
            (" 42 ", Some(42)),
            ("42%", Some(42)),
            ("101", None),
            ("256", None),
            ("-1", None),
            ("", None),
            ("%", None),
            ("4.5", None),
            ("fifty", None),
            ("99999999999999999999", None),
        ];
        for &(input, want) in table {
            assert_eq!(parse_percent(input), want, "{input:?}");
        }
    }
}
