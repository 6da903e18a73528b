//! Label and field selectors as the API server reads and checks them.
//!
//! Labels: `key`, `!key`, `key=v`, `key==v`, `key!=v`, `key in (a,b)`,
//! `key notin (a,b)`, `key>n`, `key<n`, comma-separated; keys must be
//! qualified names and values label values, or the selector is refused.
//! Fields: `path=v`, `path==v`, `path!=v` only; which paths a resource
//! supports is the server's business ([`Selector::labels`] of a field
//! selector lists them).

use serde_json::Value;

use crate::names::{qualified_part, subdomain};

/// One parsed requirement.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    Exists(String),
    Absent(String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Greater(String, i64),
    Less(String, i64),
}

/// A selector: every requirement must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector(Vec<Requirement>);

fn label_key(key: &str) -> Result<String, String> {
    let part = match key.split_once('/') {
        Some((prefix, part)) => {
            if subdomain(prefix).is_err() {
                return Err(format!(
                    "invalid label key {key:?}: prefix part must be a DNS subdomain"
                ));
            }
            part
        }
        None => key,
    };
    if qualified_part(part) {
        Ok(key.to_owned())
    } else {
        Err(format!(
            "invalid label key {key:?}: name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character"
        ))
    }
}

fn label_value(value: &str) -> Result<String, String> {
    if value.is_empty() || qualified_part(value) {
        Ok(value.to_owned())
    } else {
        Err(format!(
            "invalid label value: {value:?}: a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character"
        ))
    }
}

impl Selector {
    /// A label selector (empty: everything); `Err` is the server's words.
    pub fn labels(text: &str) -> Result<Self, String> {
        let mut requirements = Vec::new();
        for part in split_top(text) {
            let part = part.trim();
            if part.is_empty() {
                if text.trim().is_empty() {
                    continue;
                }
                return Err(format!(
                    "unable to parse requirement: found '', expected: identifier in {text:?}"
                ));
            }
            requirements.push(
                label_requirement(part)
                    .map_err(|why| format!("unable to parse requirement: {why}"))?,
            );
        }
        Ok(Self(requirements))
    }

    /// A field selector (empty: everything); `Err` is the server's words.
    pub fn fields(text: &str) -> Result<Self, String> {
        let mut requirements = Vec::new();
        for part in text.split(',') {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            let requirement = if let Some((k, v)) = part.split_once("!=") {
                Requirement::NotEquals(k.trim().to_owned(), v.trim().to_owned())
            } else if let Some((k, v)) = part.split_once("==") {
                Requirement::Equals(k.trim().to_owned(), v.trim().to_owned())
            } else if let Some((k, v)) = part.split_once('=') {
                Requirement::Equals(k.trim().to_owned(), v.trim().to_owned())
            } else {
                return Err(format!(
                    "invalid selector: '{text}'; can't understand '{part}'"
                ));
            };
            requirements.push(requirement);
        }
        Ok(Self(requirements))
    }

    /// The keys the selector names.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|r| match r {
            Requirement::Equals(k, _)
            | Requirement::NotEquals(k, _)
            | Requirement::Exists(k)
            | Requirement::Absent(k)
            | Requirement::In(k, _)
            | Requirement::NotIn(k, _)
            | Requirement::Greater(k, _)
            | Requirement::Less(k, _) => k.as_str(),
        })
    }

    /// Whether it selects everything.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `object`'s field paths (`spec.nodeName`) satisfy it; an
    /// absent field reads as "".
    pub fn matches_fields(&self, object: &Value) -> bool {
        self.0.iter().all(|r| {
            let value = |key: &str| {
                let key = if key == "source" {
                    "source.component"
                } else {
                    key
                };
                match object.pointer(&format!("/{}", key.replace('.', "/"))) {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Null) | None => String::new(),
                    Some(other) => other.to_string(),
                }
            };
            match r {
                Requirement::Equals(k, v) => value(k) == *v,
                Requirement::NotEquals(k, v) => value(k) != *v,
                _ => false,
            }
        })
    }

    /// Whether `object`'s labels satisfy it.
    pub fn matches_labels(&self, object: &Value) -> bool {
        let labels = object.pointer("/metadata/labels");
        let value = |key: &str| labels.and_then(|l| l.get(key)).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            Requirement::Equals(k, v) => value(k) == Some(v.as_str()),
            Requirement::NotEquals(k, v) => value(k) != Some(v.as_str()),
            Requirement::Exists(k) => value(k).is_some(),
            Requirement::Absent(k) => value(k).is_none(),
            Requirement::In(k, set) => value(k).is_some_and(|v| set.iter().any(|s| s == v)),
            Requirement::NotIn(k, set) => value(k).is_none_or(|v| !set.iter().any(|s| s == v)),
            Requirement::Greater(k, n) => value(k)
                .and_then(|v| v.parse::<i64>().ok())
                .is_some_and(|v| v > *n),
            Requirement::Less(k, n) => value(k)
                .and_then(|v| v.parse::<i64>().ok())
                .is_some_and(|v| v < *n),
        })
    }
}

fn label_requirement(part: &str) -> Result<Requirement, String> {
    if let Some(key) = part.strip_prefix('!') {
        return Ok(Requirement::Absent(label_key(key.trim())?));
    }
    let end = part
        .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/')))
        .unwrap_or(part.len());
    let (key, rest) = part.split_at(end);
    if key.is_empty() {
        return Err(format!("found '{part}', expected: identifier"));
    }
    let key = label_key(key)?;
    let rest = rest.trim_start();
    let set = |text: &str| -> Result<Vec<String>, String> {
        let inner = text
            .trim()
            .strip_prefix('(')
            .and_then(|t| t.strip_suffix(')'))
            .ok_or_else(|| format!("found '{text}', expected: '('"))?;
        let values: Vec<String> = inner
            .split(',')
            .map(|v| label_value(v.trim()))
            .collect::<Result<_, _>>()?;
        if inner.trim().is_empty() {
            return Err("for 'in', 'notin' operators, values set can't be empty".to_owned());
        }
        Ok(values)
    };
    let number = |text: &str| -> Result<i64, String> {
        text.trim().parse().map_err(|_| {
            format!("for 'Gt', 'Lt' operators, the value must be an integer: {text:?}")
        })
    };
    Ok(if rest.is_empty() {
        Requirement::Exists(key)
    } else if let Some(v) = rest.strip_prefix("!=") {
        Requirement::NotEquals(key, label_value(v.trim())?)
    } else if let Some(v) = rest.strip_prefix("==") {
        Requirement::Equals(key, label_value(v.trim())?)
    } else if let Some(v) = rest.strip_prefix('=') {
        Requirement::Equals(key, label_value(v.trim())?)
    } else if let Some(v) = rest.strip_prefix('>') {
        Requirement::Greater(key, number(v)?)
    } else if let Some(v) = rest.strip_prefix('<') {
        Requirement::Less(key, number(v)?)
    } else if let Some(v) = rest.strip_prefix("notin") {
        Requirement::NotIn(key, set(v)?)
    } else if let Some(v) = rest.strip_prefix("in") {
        Requirement::In(key, set(v)?)
    } else {
        return Err(format!(
            "found '{rest}', expected: in, notin, =, ==, !=, gt, lt"
        ));
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn table() {
        let pod = json!({"metadata": {"name": "p", "labels": {"app": "x", "tier": "gpu", "n": "3"}}, "spec": {"nodeName": "n1"}});
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
            ("gone!=x", false, true),
            ("n>2,n<4", false, true),
            ("example.com/app=x", false, false),
            ("", true, true),
            ("", false, true),
        ];
        for (text, fields, want) in cases {
            let got = if fields {
                Selector::fields(text).unwrap().matches_fields(&pod)
            } else {
                Selector::labels(text).unwrap().matches_labels(&pod)
            };
            assert_eq!(got, want, "{text}");
        }
        for bad in [
            "app in x",
            "app=x y",
            "app in ()",
            "-app",
            "a,,b",
            "n>x",
            "app ~ x",
        ] {
            assert!(Selector::labels(bad).is_err(), "{bad}");
        }
        assert!(Selector::fields("spec.nodeName in (a)").is_err());
    }
}
