//! Reads the operations (path + method) out of the OpenAPI document, so a test can
//! compare them with the route table.

use std::collections::BTreeSet;

const METHODS: [&str; 8] = [
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

/// `(path, METHOD)` of every operation under the top-level `paths:` key. Expects the
/// block style the document is written in: paths indented two spaces, methods four.
pub fn operations(yaml: &str) -> BTreeSet<(String, String)> {
    let mut operations = BTreeSet::new();
    let mut in_paths = false;
    let mut current_path: Option<String> = None;
    for line in yaml.lines() {
        if line.trim().is_empty() || line.trim_start().starts_with('#') {
            continue;
        }
        let indent = line.len() - line.trim_start().len();
        let key = line
            .trim()
            .strip_suffix(':')
            .map(|key| key.trim_matches(['"', '\'']));
        if indent == 0 {
            in_paths = line.trim_end() == "paths:";
            current_path = None;
            continue;
        }
        if !in_paths {
            continue;
        }
        match (indent, key) {
            (2, Some(path)) if path.starts_with('/') => current_path = Some(path.to_owned()),
            (4, Some(method)) if METHODS.contains(&method) => {
                if let Some(path) = &current_path {
                    operations.insert((path.clone(), method.to_ascii_uppercase()));
                }
            }
            _ => {}
        }
    }
    operations
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_operations_only_under_paths() {
        let yaml = "openapi: 3.0.3\npaths:\n  /a:\n    get:\n      summary: x\n    parameters: []\n    post:\n      responses: {}\n  \"/b/{id}\":\n    delete:\n      x: 1\ncomponents:\n  schemas:\n    get:\n      type: object\n";
        let found = operations(yaml);
        let expected: BTreeSet<(String, String)> =
            [("/a", "GET"), ("/a", "POST"), ("/b/{id}", "DELETE")]
                .into_iter()
                .map(|(p, m)| (p.to_owned(), m.to_owned()))
                .collect();
        assert_eq!(found, expected);
    }
}
