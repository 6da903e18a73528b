//! Field and label selectors as the API server reads them, on JSON objects:
//! `a.b=v`, `a.b==v`, `a.b!=v` for fields; those plus `key`, `!key`,
//! `key in (a,b)`, `key notin (a,b)` for labels.

use serde_json::Value;

/// One parsed requirement.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    Exists(String),
    Absent(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
}

/// A selector: every requirement must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector(Vec<Requirement>);

impl Selector {
    /// Parses `text` (empty: matches everything); `None` when malformed.
    pub fn parse(text: &str) -> Option<Self> {
        let mut requirements = Vec::new();
        for part in split_top(text) {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            let requirement = if let Some((key, rest)) = part.split_once(" notin ") {
                Requirement::NotIn(key.trim().to_owned(), set(rest)?)
            } else if let Some((key, rest)) = part.split_once(" in ") {
                Requirement::In(key.trim().to_owned(), set(rest)?)
            } else if let Some((key, value)) = part.split_once("!=") {
                Requirement::NotEquals(key.trim().to_owned(), value.trim().to_owned())
            } else if let Some((key, value)) = part.split_once("==") {
                Requirement::Equals(key.trim().to_owned(), value.trim().to_owned())
            } else if let Some((key, value)) = part.split_once('=') {
                Requirement::Equals(key.trim().to_owned(), value.trim().to_owned())
            } else if let Some(key) = part.strip_prefix('!') {
                Requirement::Absent(key.trim().to_owned())
            } else {
                Requirement::Exists(part.to_owned())
            };
            requirements.push(requirement);
        }
        Some(Self(requirements))
    }

    /// Whether `object`'s field paths (`spec.nodeName`) satisfy it.
    pub fn matches_fields(&self, object: &Value) -> bool {
        self.matches(|key| {
            let pointer = format!("/{}", key.replace('.', "/"));
            match object.pointer(&pointer) {
                Some(Value::String(s)) => Some(s.clone()),
                Some(Value::Null) | None => None,
                Some(other) => Some(other.to_string()),
            }
        })
    }

    /// Whether `object`'s labels satisfy it.
    pub fn matches_labels(&self, object: &Value) -> bool {
        let labels = object.pointer("/metadata/labels");
        self.matches(|key| {
            labels
                .and_then(|l| l.get(key))
                .and_then(Value::as_str)
                .map(str::to_owned)
        })
    }

    fn matches(&self, value: impl Fn(&str) -> Option<String>) -> bool {
        self.0.iter().all(|r| match r {
            // Fields that are absent compare as "" (as the API server does).
            Requirement::Equals(k, v) => value(k).unwrap_or_default() == *v,
            Requirement::NotEquals(k, v) => value(k).unwrap_or_default() != *v,
            Requirement::Exists(k) => value(k).is_some(),
            Requirement::Absent(k) => value(k).is_none(),
            Requirement::In(k, set) => value(k).is_some_and(|v| set.contains(&v)),
            Requirement::NotIn(k, set) => value(k).is_none_or(|v| !set.contains(&v)),
        })
    }
}

/// Splits on commas outside parentheses.
fn split_top(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&text[start..]);
    parts
}

fn set(text: &str) -> Option<Vec<String>> {
    let inner = text.trim().strip_prefix('(')?.strip_suffix(')')?;
    Some(inner.split(',').map(|s| s.trim().to_owned()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn table() {
        let pod = json!({"metadata": {"name": "p", "labels": {"app": "x", "tier": "gpu"}}, "spec": {"nodeName": "n1"}});
        let cases = [
            ("spec.nodeName=n1", true, true),
            ("spec.nodeName==n2", true, false),
            ("spec.nodeName!=n2", true, true),
            ("spec.nodeName=n1,metadata.name=p", true, true),
            ("spec.missing=", true, true),
            ("app=x", false, true),
            ("app in (y, x)", false, true),
            ("app notin (x)", false, false),
            ("tier,!gone", false, true),
            ("gone", false, false),
            ("", true, true),
        ];
        for (text, fields, want) in cases {
            let s = Selector::parse(text).unwrap();
            let got = if fields {
                s.matches_fields(&pod)
            } else {
                s.matches_labels(&pod)
            };
            assert_eq!(got, want, "{text}");
        }
        assert!(Selector::parse("app in x").is_none());
    }
}
