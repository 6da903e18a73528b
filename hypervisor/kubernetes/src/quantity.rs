//! Kubernetes quantities (`4Gi`, `30`, `1.5G`, `500m`) as integers.

/// `text` as an integer count of units, rounded up (a claim never gets less
/// than it asked); `None` when it is no quantity or does not fit in a u64.
pub fn parse(text: &str) -> Option<u64> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(split);
    let (int, frac) = number.split_once('.').unwrap_or((number, ""));
    let int = int.strip_prefix('+').unwrap_or(int);
    if int.is_empty() && frac.is_empty()
        || !int.bytes().all(|b| b.is_ascii_digit())
        || !frac.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    // (multiplier, divisor) of the suffix.
    let (mul, div): (u128, u128) = match suffix {
        "" => (1, 1),
        "m" => (1, 1000),
        "k" => (1_000, 1),
        "M" => (1_000_000, 1),
        "G" => (1_000_000_000, 1),
        "T" => (1_000_000_000_000, 1),
        "P" => (1_000_000_000_000_000, 1),
        "E" => (1_000_000_000_000_000_000, 1),
        "Ki" => (1 << 10, 1),
        "Mi" => (1 << 20, 1),
        "Gi" => (1 << 30, 1),
        "Ti" => (1 << 40, 1),
        "Pi" => (1 << 50, 1),
        "Ei" => (1 << 60, 1),
        _ => {
            let exp: u32 = suffix
                .strip_prefix(['e', 'E'])?
                .strip_prefix('+')
                .unwrap_or(suffix.get(1..)?)
                .parse()
                .ok()?;
            (10u128.checked_pow(exp)?, 1)
        }
    };
    let frac = &frac[..frac.len().min(18)];
    let scale = 10u128.pow(frac.len() as u32);
    let whole: u128 = if int.is_empty() { 0 } else { int.parse().ok()? };
    let part: u128 = if frac.is_empty() {
        0
    } else {
        frac.parse().ok()?
    };
    let numerator = whole
        .checked_mul(scale)?
        .checked_add(part)?
        .checked_mul(mul)?;
    let denominator = scale * div;
    u64::try_from(numerator.div_ceil(denominator)).ok()
}

/// `bytes` as a quantity, in the largest binary unit that divides it.
pub fn format_bytes(bytes: u64) -> String {
    for (shift, unit) in [(40, "Ti"), (30, "Gi"), (20, "Mi"), (10, "Ki")] {
        if bytes != 0 && bytes.is_multiple_of(1u64 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    #[test]
    fn table() {
        let cases = [
            ("4Gi", Some(4u64 << 30)),
            ("30", Some(30)),
            ("1.5Gi", Some(3 << 29)),
            ("500m", Some(1)),
            ("2k", Some(2000)),
            ("1e3", Some(1000)),
            ("80000000000", Some(80_000_000_000)),
            ("0.5", Some(1)),
            ("", None),
            ("Gi", None),
            ("4GB", None),
            ("-1", None),
            ("99999Ei", None),
        ];
        for (text, want) in cases {
            assert_eq!(super::parse(text), want, "{text:?}");
        }
        assert_eq!(super::format_bytes(4 << 30), "4Gi");
        assert_eq!(super::format_bytes(80 * (1 << 30) + 1), "85899345921");
        assert_eq!(
            super::parse(&super::format_bytes(81_559_347_200)),
            Some(81_559_347_200)
        );
    }
}
