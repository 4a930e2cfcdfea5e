//! The commands the documents tell a user to type into a cluster (`kubectl`, and `curl`
//! against a node), found where a reader finds them, so that the real-node test can run
//! each one on a real cluster (`tests/node.rs`).
//!
//! A command is a line of a fenced shell block whose first word is one of [`PROGRAMS`], or
//! a code span in prose holding such a program with at least two words after it (`kubectl
//! exec` alone names the command, it is not one to type). One is an **illustration**, which
//! the tests do not run, when the text says so where the reader sees it: a fenced block
//! whose first line is a comment naming it an illustration, a line whose own comment does,
//! or, for a span, the paragraph holding it.

/// The documents whose commands are found: README, docs/ and the chart's README. The
/// chart's NOTES.txt is a template: its commands are taken from what Helm rendered
/// ([`in_plain_text`]).
pub const DOCUMENTS: [&str; 4] = [
    "README.md",
    "docs/install.md",
    "docs/operations.md",
    "charts/tandem/README.md",
];

/// The programs whose invocations are commands to run on a cluster.
pub const PROGRAMS: [&str; 2] = ["kubectl", "curl"];

const MARK: &str = "illustration";

/// One command as a document shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DocCommand {
    /// `document:line`.
    pub source: String,
    /// The shell text: continuation lines joined, the comment dropped, spaces collapsed.
    pub text: String,
    pub illustration: bool,
}

/// The commands of a Markdown document named `doc`.
pub fn in_markdown(doc: &str, markdown: &str) -> Vec<DocCommand> {
    let mut found = Vec::new();
    let mut lines = markdown.lines().enumerate().peekable();
    let mut paragraph: Vec<(usize, &str)> = Vec::new();
    while let Some((index, line)) = lines.next() {
        let Some(info) = line.trim_start().strip_prefix("```") else {
            if line.trim().is_empty() {
                prose(doc, &paragraph, &mut found);
                paragraph.clear();
            } else {
                paragraph.push((index, line));
            }
            continue;
        };
        prose(doc, &paragraph, &mut found);
        paragraph.clear();
        let shell = matches!(info.trim(), "" | "sh" | "bash" | "shell" | "console");
        let mut block_illustration = false;
        let mut first = true;
        let mut logical = String::new();
        let mut logical_start = index + 1;
        for (index, line) in lines.by_ref() {
            if line.trim_start().starts_with("```") {
                break;
            }
            if !shell {
                continue;
            }
            if logical.is_empty() {
                logical_start = index;
            }
            if let Some(head) = line.trim_end().strip_suffix('\\') {
                logical.push_str(head);
                logical.push(' ');
                continue;
            }
            logical.push_str(line);
            let whole = std::mem::take(&mut logical);
            if whole.trim().is_empty() {
                continue;
            }
            let (command, comment) = split_comment(&whole);
            if first {
                first = false;
                if command.trim().is_empty() && comment.to_lowercase().contains(MARK) {
                    block_illustration = true;
                    continue;
                }
            }
            if invokes_a_program(command) {
                found.push(DocCommand {
                    source: format!("{doc}:{}", logical_start + 1),
                    text: collapse(command),
                    illustration: block_illustration || comment.to_lowercase().contains(MARK),
                });
            }
        }
    }
    prose(doc, &paragraph, &mut found);
    found
}

/// The commands of plain text (the chart's NOTES as Helm rendered them): lines whose first
/// word is one of [`PROGRAMS`].
pub fn in_plain_text(source: &str, text: &str) -> Vec<DocCommand> {
    text.lines()
        .enumerate()
        .filter_map(|(index, line)| {
            let (command, comment) = split_comment(line);
            invokes_a_program(command).then(|| DocCommand {
                source: format!("{source}:{}", index + 1),
                text: collapse(command),
                illustration: comment.to_lowercase().contains(MARK),
            })
        })
        .collect()
}

/// What the documents' placeholders stand for on a cluster.
#[derive(Debug, Clone, Copy)]
pub struct Placeholders<'a> {
    /// `NAME`: a LoadBalancer Service of the user's Namespace.
    pub service: &'a str,
    /// `NAMESPACE`: the release's Namespace.
    pub namespace: &'a str,
    /// `LEASE_NAME`: the controller's Lease.
    pub lease: &'a str,
    /// `NODE_IP`: a node's address.
    pub node_ip: &'a str,
    /// `VIP` and `<EXTERNAL-IP>`: that Service's ingress address.
    pub vip: &'a str,
}

impl Placeholders<'_> {
    /// For commands without placeholders: any left is reported by [`fill`].
    pub const NONE: Placeholders<'static> = Placeholders {
        service: "NAME",
        namespace: "NAMESPACE",
        lease: "LEASE_NAME",
        node_ip: "NODE_IP",
        vip: "VIP",
    };

    #[cfg(test)]
    const EXAMPLE: Placeholders<'static> = Placeholders {
        service: "echo",
        namespace: "tandem-system",
        lease: "tandem-controller",
        node_ip: "198.18.0.11",
        vip: "198.51.100.1",
    };

    pub fn values(&self) -> [(&str, &str); 6] {
        [
            ("NAME", self.service),
            ("NAMESPACE", self.namespace),
            ("LEASE_NAME", self.lease),
            ("NODE_IP", self.node_ip),
            ("VIP", self.vip),
            ("<EXTERNAL-IP>", self.vip),
        ]
    }
}

/// `text` with each placeholder replaced where it stands as a whole word (`NAME` is not
/// replaced inside `NAMESPACE`); the placeholders left are reported.
pub fn fill(text: &str, values: &[(&str, &str)]) -> Result<String, Vec<String>> {
    let mut filled = String::with_capacity(text.len());
    let mut rest = text;
    'scan: while !rest.is_empty() {
        let at_boundary = !filled.chars().next_back().is_some_and(is_word_char);
        if at_boundary {
            for (placeholder, value) in values {
                if let Some(after) = rest.strip_prefix(placeholder)
                    && !after.chars().next().is_some_and(is_word_char)
                {
                    filled.push_str(value);
                    rest = after;
                    continue 'scan;
                }
            }
        }
        let mut chars = rest.chars();
        if let Some(c) = chars.next() {
            filled.push(c);
        }
        rest = chars.as_str();
    }
    let left: Vec<String> = filled
        .split(|c: char| !(is_word_char(c) || c == '-'))
        .filter(|word| {
            word.len() > 1
                && word.chars().any(|c| c.is_ascii_uppercase())
                && word
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c == '_' || c == '-')
        })
        .map(str::to_owned)
        .collect();
    if left.is_empty() {
        Ok(filled)
    } else {
        Err(left)
    }
}

fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The code spans of one prose paragraph that hold commands.
fn prose(doc: &str, paragraph: &[(usize, &str)], found: &mut Vec<DocCommand>) {
    let text = paragraph
        .iter()
        .map(|(_, line)| *line)
        .collect::<Vec<_>>()
        .join(" ");
    let illustration = text.to_lowercase().contains(MARK);
    // The line each span begins on: the paragraph's lines are joined by one space.
    let line_at = |offset: usize| {
        let mut start = 0;
        for (index, line) in paragraph {
            start += line.len() + 1;
            if offset < start {
                return index + 1;
            }
        }
        paragraph.last().map_or(0, |(index, _)| index + 1)
    };
    let mut offset = 0;
    for (n, piece) in text.split('`').enumerate() {
        let span_start = offset;
        offset += piece.len() + 1;
        if n % 2 == 0 {
            continue;
        }
        let words: Vec<&str> = piece.split_whitespace().collect();
        if words.len() >= 3 && PROGRAMS.contains(&words[0]) {
            found.push(DocCommand {
                source: format!("{doc}:{}", line_at(span_start)),
                text: words.join(" "),
                illustration,
            });
        }
    }
}

fn invokes_a_program(command: &str) -> bool {
    command
        .split_whitespace()
        .next()
        .is_some_and(|word| PROGRAMS.contains(&word))
}

/// The command and its shell comment: the first `#` outside quotes that starts a word.
fn split_comment(line: &str) -> (&str, &str) {
    let mut quote = None;
    let mut previous = ' ';
    for (at, c) in line.char_indices() {
        match (quote, c) {
            (None, '\'' | '"') => quote = Some(c),
            (Some(open), _) if c == open => quote = None,
            (None, '#') if previous.is_whitespace() => return (&line[..at], &line[at + 1..]),
            _ => {}
        }
        previous = c;
    }
    (line, "")
}

fn collapse(command: &str) -> String {
    command.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = r#"# Title

Run `kubectl get svc NAME -o jsonpath='{.spec.loadBalancerClass}'` to see it, or
`kubectl exec` into the pod (a mention).

```sh
kubectl -n x get pods                 # the pods
kubectl create deployment web \
  --image=nginx && kubectl expose deployment web --port=80
curl http://NODE_IP:10256/healthz     # on a node
helm install tandem charts/tandem     # not ours
kubectl annotate namespace team-blue a=b   # an illustration: your Namespace
```

```sh
# An illustration: the edge's own secrets.
kubectl create secret generic creds --from-literal=token=...
```

```yaml
kubectl: not a command
```

An illustration: `kubectl -n kube-system delete daemonset kube-proxy`, on kubeadm.
"#;

    fn texts(found: &[DocCommand], illustration: bool) -> Vec<&str> {
        found
            .iter()
            .filter(|c| c.illustration == illustration)
            .map(|c| c.text.as_str())
            .collect()
    }

    #[test]
    fn commands_are_found_where_a_reader_finds_them() {
        let found = in_markdown("doc.md", DOC);
        assert_eq!(
            texts(&found, false),
            [
                "kubectl get svc NAME -o jsonpath='{.spec.loadBalancerClass}'",
                "kubectl -n x get pods",
                "kubectl create deployment web --image=nginx && kubectl expose deployment web --port=80",
                "curl http://NODE_IP:10256/healthz",
            ]
        );
        assert_eq!(
            texts(&found, true),
            [
                "kubectl annotate namespace team-blue a=b",
                "kubectl create secret generic creds --from-literal=token=...",
                "kubectl -n kube-system delete daemonset kube-proxy",
            ]
        );
        let sources: Vec<&str> = found.iter().map(|c| c.source.as_str()).collect();
        assert_eq!(
            sources,
            [
                "doc.md:3",
                "doc.md:7",
                "doc.md:8",
                "doc.md:10",
                "doc.md:12",
                "doc.md:17",
                "doc.md:24"
            ]
        );
    }

    #[test]
    fn rendered_notes_give_their_command_lines() {
        let notes =
            "Try it:\n  kubectl get service echo --watch   # appears\nif `kubectl get sc` shows\n";
        let found = in_plain_text("NOTES", notes);
        assert_eq!(texts(&found, false), ["kubectl get service echo --watch"]);
        assert_eq!(found[0].source, "NOTES:2");
    }

    #[test]
    fn a_hash_inside_quotes_is_no_comment() {
        assert_eq!(
            split_comment("kubectl get svc -o 'jsonpath={# x}' # why"),
            ("kubectl get svc -o 'jsonpath={# x}' ", " why")
        );
    }

    #[test]
    fn placeholders_are_filled_as_whole_words_and_the_rest_reported() {
        let values = [
            ("NAME", "echo"),
            ("NAMESPACE", "tandem-system"),
            ("<EXTERNAL-IP>", "198.51.100.1"),
        ];
        assert_eq!(
            fill(
                "kubectl -n NAMESPACE get svc NAME --dst <EXTERNAL-IP> x=NAME",
                &values
            ),
            Ok("kubectl -n tandem-system get svc echo --dst 198.51.100.1 x=echo".to_owned())
        );
        assert_eq!(
            fill("kubectl get lease LEASE_NAME -o NAME", &values),
            Err(vec!["LEASE_NAME".to_owned()])
        );
        // Flags and Kubernetes' own capitalised words are no placeholders.
        assert!(fill("kubectl get svc --field-selector type=Warning", &values).is_ok());
    }
}

#[cfg(test)]
mod the_documents {
    use super::*;

    /// Every command a document shows is found, and each one the real-node test runs has
    /// a value for each of its placeholders there.
    #[test]
    fn every_command_to_run_has_its_placeholders_filled() {
        let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut run = 0;
        let mut problems = Vec::new();
        for doc in DOCUMENTS {
            let text = std::fs::read_to_string(repo.join(doc)).unwrap_or_default();
            for command in in_markdown(doc, &text)
                .into_iter()
                .filter(|c| !c.illustration)
            {
                run += 1;
                if let Err(left) = fill(&command.text, &Placeholders::EXAMPLE.values()) {
                    problems.push(format!("{}: `{}`: {left:?}", command.source, command.text));
                }
            }
        }
        assert!(
            problems.is_empty(),
            "no value for:\n{}",
            problems.join("\n")
        );
        assert!(run >= 15, "only {run} commands found in {DOCUMENTS:?}");
    }
}
