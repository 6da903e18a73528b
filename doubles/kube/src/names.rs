//! The grammar of Kubernetes names as the API server checks it: RFC 1123
//! labels and subdomains, qualified names (label and annotation keys,
//! finalizers) and label values. The server's validation
//! ([`apiserver`](crate::apiserver)) and its selectors
//! ([`selector`](crate::selector)) both read names by these rules.

const SUBDOMAIN: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";
const QUALIFIED: &str = "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')";

/// RFC 1123 label: lower case alphanumerics and `-`, at most 63.
pub(crate) fn label_ok(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// RFC 1123 subdomain; `Err` is the server's words.
pub(crate) fn subdomain(s: &str) -> Result<(), String> {
    if s.len() > 253 {
        return Err("must be no more than 253 characters".to_owned());
    }
    if s.split('.').all(|part| {
        let b = part.as_bytes();
        !b.is_empty()
            && b.iter()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
            && b[0] != b'-'
            && b[b.len() - 1] != b'-'
    }) {
        Ok(())
    } else {
        Err(SUBDOMAIN.to_owned())
    }
}

/// The name part of a qualified name (a label key without its prefix).
pub(crate) fn qualified_part(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// A label or annotation key (`prefix/name`).
pub(crate) fn qualified_name(s: &str) -> Result<(), String> {
    let (prefix, part) = match s.split_once('/') {
        Some((prefix, part)) => (Some(prefix), part),
        None => (None, s),
    };
    if let Some(prefix) = prefix {
        subdomain(prefix).map_err(|e| format!("prefix part {e}"))?;
    }
    if qualified_part(part) {
        Ok(())
    } else {
        Err(QUALIFIED.to_owned())
    }
}

/// A label value: empty, or a qualified name part.
pub(crate) fn label_value(s: &str) -> bool {
    s.is_empty() || qualified_part(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_grammar() {
        assert!(subdomain("a.b-c").is_ok());
        for bad in ["A", "-a", "a-", "a..b", "a_b", ""] {
            assert!(subdomain(bad).is_err(), "{bad}");
        }
        assert!(label_ok("a-1") && !label_ok("a.b") && !label_ok("A"));
        assert!(qualified_name("example.com/a_b.c").is_ok());
        assert!(qualified_name("Example.com/x").is_err());
        assert!(qualified_name("a b").is_err());
        assert!(label_value("") && !label_value("x y"));
    }
}
