//! Label and field selectors, parsed from query strings and matched against JSON objects.

use serde_json::Value;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unable to parse selector {selector:?}: {reason}")]
pub struct SelectorError {
    pub selector: String,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum LabelRequirement {
    Equals(String, String),
    NotEquals(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    DoesNotExist(String),
}

/// `a=b,c!=d,e in (x,y),f notin (z),g,!h`
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector(Vec<LabelRequirement>);

/// Splits on commas that are not inside parentheses.
fn split_terms(selector: &str) -> Vec<&str> {
    let mut terms = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in selector.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                terms.push(&selector[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    terms.push(&selector[start..]);
    terms
        .into_iter()
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect()
}

fn valid_key(key: &str) -> bool {
    !key.is_empty()
        && key.len() <= 317
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
}

fn valid_value(value: &str) -> bool {
    value.len() <= 63
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

impl LabelSelector {
    pub fn parse(selector: &str) -> Result<Self, SelectorError> {
        let error = |reason: &str| SelectorError {
            selector: selector.to_string(),
            reason: reason.to_string(),
        };
        let mut requirements = Vec::new();
        for term in split_terms(selector) {
            let requirement = if let Some((key, rest)) = split_set_operator(term, " notin ") {
                LabelRequirement::NotIn(key, parse_set(rest).ok_or_else(|| error("bad value set"))?)
            } else if let Some((key, rest)) = split_set_operator(term, " in ") {
                LabelRequirement::In(key, parse_set(rest).ok_or_else(|| error("bad value set"))?)
            } else if let Some((key, value)) = term.split_once("!=") {
                LabelRequirement::NotEquals(key.trim().to_string(), value.trim().to_string())
            } else if let Some((key, value)) = term.split_once("==") {
                LabelRequirement::Equals(key.trim().to_string(), value.trim().to_string())
            } else if let Some((key, value)) = term.split_once('=') {
                LabelRequirement::Equals(key.trim().to_string(), value.trim().to_string())
            } else if let Some(key) = term.strip_prefix('!') {
                LabelRequirement::DoesNotExist(key.trim().to_string())
            } else {
                LabelRequirement::Exists(term.to_string())
            };
            let (key, values): (&str, Vec<&str>) = match &requirement {
                LabelRequirement::Equals(k, v) | LabelRequirement::NotEquals(k, v) => {
                    (k, vec![v.as_str()])
                }
                LabelRequirement::In(k, vs) | LabelRequirement::NotIn(k, vs) => {
                    (k, vs.iter().map(String::as_str).collect())
                }
                LabelRequirement::Exists(k) | LabelRequirement::DoesNotExist(k) => (k, vec![]),
            };
            if !valid_key(key) {
                return Err(error(&format!("invalid label key {key:?}")));
            }
            if let Some(bad) = values.iter().find(|v| !valid_value(v)) {
                return Err(error(&format!("invalid label value {bad:?}")));
            }
            requirements.push(requirement);
        }
        Ok(Self(requirements))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether an object's `metadata.labels` satisfy every requirement.
    pub fn matches(&self, object: &Value) -> bool {
        let labels = &object["metadata"]["labels"];
        let get = |key: &str| labels.get(key).and_then(Value::as_str);
        self.0.iter().all(|requirement| match requirement {
            LabelRequirement::Equals(k, v) => get(k) == Some(v.as_str()),
            LabelRequirement::NotEquals(k, v) => get(k) != Some(v.as_str()),
            LabelRequirement::In(k, vs) => get(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            LabelRequirement::NotIn(k, vs) => get(k).is_none_or(|l| vs.iter().all(|v| v != l)),
            LabelRequirement::Exists(k) => get(k).is_some(),
            LabelRequirement::DoesNotExist(k) => get(k).is_none(),
        })
    }
}

fn split_set_operator(term: &str, operator: &str) -> Option<(String, String)> {
    let (key, rest) = term.split_once(operator)?;
    Some((key.trim().to_string(), rest.trim().to_string()))
}

fn parse_set(set: String) -> Option<Vec<String>> {
    let inner = set.strip_prefix('(')?.strip_suffix(')')?;
    Some(
        inner
            .split(',')
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
            .collect(),
    )
}

/// `metadata.name=x,metadata.namespace!=y` over any dotted field path (`spec.type`,
/// `involvedObject.name`); a missing field reads as the empty string.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    pub fn parse(selector: &str) -> Result<Self, SelectorError> {
        let mut requirements = Vec::new();
        for term in split_terms(selector) {
            let (path, equals, value) = if let Some((p, v)) = term.split_once("!=") {
                (p, false, v)
            } else if let Some((p, v)) = term.split_once("==") {
                (p, true, v)
            } else if let Some((p, v)) = term.split_once('=') {
                (p, true, v)
            } else {
                return Err(SelectorError {
                    selector: selector.to_string(),
                    reason: format!("invalid field selector term {term:?}"),
                });
            };
            requirements.push((path.trim().to_string(), equals, value.trim().to_string()));
        }
        Ok(Self(requirements))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn matches(&self, object: &Value) -> bool {
        self.0.iter().all(|(path, equals, value)| {
            let field = path.split('.').try_fold(object, |v, key| v.get(key));
            let text = match field {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Null) | None => String::new(),
                Some(other) => other.to_string(),
            };
            (text == *value) == *equals
        })
    }
}

/// Both selectors of a request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selectors {
    pub labels: LabelSelector,
    pub fields: FieldSelector,
}

impl Selectors {
    /// No requirement at all: everything matches.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty() && self.fields.is_empty()
    }

    pub fn matches(&self, object: &Value) -> bool {
        self.labels.matches(object) && self.fields.matches(object)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn obj(labels: Value) -> Value {
        json!({"metadata": {"name": "web", "namespace": "prod", "labels": labels}, "spec": {"type": "LoadBalancer", "port": 80}})
    }

    #[test]
    fn label_selector_operators() {
        let o = obj(json!({"app": "web", "tier": "front"}));
        for (selector, expected) in [
            ("app=web", true),
            ("app==web", true),
            ("app!=web", false),
            ("app in (web, api)", true),
            ("app notin (web)", false),
            ("missing notin (web)", true),
            ("tier", true),
            ("!tier", false),
            ("!missing", true),
            ("app=web,tier in (front,back),!missing", true),
            ("app=web,tier=back", false),
            ("", true),
        ] {
            assert_eq!(
                LabelSelector::parse(selector).unwrap().matches(&o),
                expected,
                "{selector}"
            );
        }
    }

    #[test]
    fn label_selector_rejects_junk() {
        assert!(LabelSelector::parse("app in web").is_err());
        assert!(LabelSelector::parse("a b=c").is_err());
        assert!(LabelSelector::parse("a=b c").is_err());
    }

    #[test]
    fn field_selector_reads_dotted_paths() {
        let o = obj(json!({}));
        for (selector, expected) in [
            ("metadata.name=web", true),
            ("metadata.name!=web", false),
            ("metadata.namespace=prod,metadata.name=web", true),
            ("spec.type=LoadBalancer", true),
            ("spec.port=80", true),
            ("spec.missing=", true),
            ("spec.missing=x", false),
        ] {
            assert_eq!(
                FieldSelector::parse(selector).unwrap().matches(&o),
                expected,
                "{selector}"
            );
        }
        assert!(FieldSelector::parse("metadata.name").is_err());
    }

    proptest! {
        #[test]
        fn equality_selector_matches_exactly_its_value(key in "[a-z]{1,8}", value in "[a-z0-9]{1,8}", other in "[a-z0-9]{1,8}") {
            let selector = LabelSelector::parse(&format!("{key}={value}")).unwrap();
            let same = obj(json!({key.clone(): value.clone()}));
            let different = obj(json!({key.clone(): other.clone()}));
            prop_assert!(selector.matches(&same));
            prop_assert_eq!(selector.matches(&different), other == value);
            let negated = LabelSelector::parse(&format!("{key}!={value}")).unwrap();
            prop_assert_eq!(negated.matches(&different), other != value);
        }
    }
}
