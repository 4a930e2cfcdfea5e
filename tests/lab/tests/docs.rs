#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The documents in docs/ stay true to the code:
//!
//! - docs/operations.md lists every flag of the controller and the node proxy as their
//!   `--help` prints it. The tables are rendered from the built binaries' `--help`, and the
//!   test fails when the document differs, so a flag cannot be added, renamed or
//!   re-defaulted without the document following. `TANDEM_UPDATE_DOCS=1` rewrites them.
//! - Every relative link of the documents that point into the code (architecture,
//!   providers) names a file or folder that exists, so a moved module breaks a test, not
//!   the reader's trust.
//!
//! Needs the binaries: `cargo build --workspace --bins`.

use std::path::PathBuf;
use std::process::Command;

use tandem_lab::binaries;

/// The documented commands: marker name, binary, arguments before `--help`.
const COMMANDS: [(&str, &str, &[&str]); 3] = [
    ("tandem-controller", "tandem-controller", &[]),
    ("tandem-nodeproxy", "tandem-nodeproxy", &[]),
    ("tandem-nodeproxy trace", "tandem-nodeproxy", &["trace"]),
];

#[derive(Debug, PartialEq)]
struct Flag {
    name: String,
    value: Option<String>,
    env: Option<String>,
    default: Option<String>,
    values: Vec<String>,
    help: String,
}

/// `      --flag <VALUE>` or `  -h, --help`; descriptions and `- value` lists are indented
/// further.
fn is_option_line(line: &str) -> bool {
    let trimmed = line.trim_start();
    let indent = line.len() - trimmed.len();
    let short_and_long = trimmed
        .get(2..)
        .is_some_and(|rest| rest.starts_with(", --"));
    indent < 8 && (trimmed.starts_with("--") || (trimmed.starts_with('-') && short_and_long))
}

/// The options of one `--help` text, in the order printed (`--help`/`--version` left out).
fn parse_help(text: &str) -> Vec<Flag> {
    let mut blocks: Vec<Vec<&str>> = Vec::new();
    let mut in_options = false;
    for line in text.lines() {
        if !line.starts_with(' ') && !line.is_empty() {
            in_options = line.trim_end() == "Options:";
            continue;
        }
        if !in_options {
            continue;
        }
        if is_option_line(line) {
            blocks.push(vec![line]);
        } else if let Some(block) = blocks.last_mut() {
            block.push(line);
        }
    }
    blocks
        .into_iter()
        .filter_map(|block| parse_block(&block))
        .collect()
}

fn parse_block(block: &[&str]) -> Option<Flag> {
    let head = block[0].trim();
    // `-h, --help`: the long name is the one documented.
    let head = match head.get(2..) {
        Some(rest) if !head.starts_with("--") && rest.starts_with(", ") => &rest[2..],
        _ => head,
    };
    let (spec, first_help) = match head.find("  ") {
        Some(at) => (&head[..at], head[at..].trim()),
        None => (head, ""),
    };
    let mut words = spec.split_whitespace();
    let name = words.next()?.to_string();
    if name == "--help" || name == "--version" {
        return None;
    }
    let value = words.next().map(str::to_string);
    let mut values = Vec::new();
    let mut text = vec![first_help.to_string()];
    for line in &block[1..] {
        let line = line.trim();
        if let Some(item) = line.strip_prefix("- ") {
            let value = item.split(':').next().unwrap_or(item).trim();
            values.push(value.to_string());
        } else if line != "Possible values:" {
            text.push(line.to_string());
        }
    }
    let mut help = text.join(" ");
    let mut take = |key: &str| -> Option<String> {
        let open = format!("[{key}: ");
        let start = help.find(&open)?;
        let end = start + help[start..].find(']')?;
        let inner = help[start + open.len()..end].to_string();
        help.replace_range(start..=end, "");
        Some(inner)
    };
    let env = take("env").map(|e| e.trim_end_matches('=').to_string());
    let default = take("default");
    if let Some(possible) = take("possible values") {
        values = possible.split(", ").map(str::to_string).collect();
    }
    let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
    Some(Flag {
        name,
        value,
        env,
        default,
        values,
        help,
    })
}

fn code(text: &str) -> String {
    format!("`{}`", text.replace('|', "\\|"))
}

/// The Markdown table of one command's flags.
fn render(flags: &[Flag]) -> String {
    let mut out =
        String::from("| flag | environment | default | what it does |\n|---|---|---|---|\n");
    for flag in flags {
        let name = match &flag.value {
            Some(value) => code(&format!("{} {value}", flag.name)),
            None => code(&flag.name),
        };
        let env = flag.env.as_deref().map(code).unwrap_or_default();
        let default = flag.default.as_deref().map(code).unwrap_or_default();
        let mut help = flag.help.replace('|', "\\|");
        if !flag.values.is_empty() {
            let values: Vec<String> = flag.values.iter().map(|v| code(v)).collect();
            if !help.is_empty() {
                help.push_str("; ");
            }
            help.push_str(&format!("one of {}", values.join(", ")));
        }
        out.push_str(&format!("| {name} | {env} | {default} | {help} |\n"));
    }
    out
}

fn help_text(binary: &str, args: &[&str]) -> String {
    let path = binaries::locate(binary).unwrap();
    // No environment: a set KUBECONFIG or NODE_NAME would show up in the help text.
    let output = Command::new(path)
        .args(args)
        .arg("--help")
        .env_clear()
        .output()
        .unwrap();
    assert!(output.status.success(), "{binary} {args:?} --help failed");
    String::from_utf8(output.stdout).unwrap()
}

fn docs_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs")
}

/// The targets of the relative Markdown links `[text](target)` in `text`, without anchors.
fn relative_links(text: &str) -> Vec<&str> {
    text.split("](")
        .skip(1)
        .filter_map(|rest| rest.split(')').next())
        .map(|target| target.split('#').next().unwrap_or(target))
        .filter(|target| !target.is_empty() && !target.contains("://"))
        .collect()
}

#[test]
fn links_into_the_code_name_files_that_exist() {
    for doc in ["architecture.md", "providers.md"] {
        let text = std::fs::read_to_string(docs_dir().join(doc)).unwrap();
        let links = relative_links(&text);
        assert!(links.len() > 5, "{doc}: too few links found: {links:?}");
        let missing: Vec<&str> = links
            .into_iter()
            .filter(|target| !docs_dir().join(target).exists())
            .collect();
        assert!(
            missing.is_empty(),
            "docs/{doc} links to missing files: {missing:?}"
        );
    }
}

#[test]
fn relative_links_are_found() {
    let text = "see [a](../a.rs), [b](b.md#part), [web](https://x.io/y) and [c](c/)";
    assert_eq!(relative_links(text), ["../a.rs", "b.md", "c/"]);
}

/// Replaces the text between the begin and end markers of `name` with `table`.
fn with_table(doc: &str, name: &str, table: &str) -> Option<String> {
    let begin = format!("<!-- BEGIN FLAGS {name} -->\n");
    let end = format!("<!-- END FLAGS {name} -->");
    let start = doc.find(&begin)? + begin.len();
    let stop = start + doc[start..].find(&end)?;
    Some(format!("{}{table}{}", &doc[..start], &doc[stop..]))
}

#[test]
fn operations_doc_lists_every_flag_as_help_prints_it() {
    let path = docs_dir().join("operations.md");
    let original = std::fs::read_to_string(&path).unwrap();
    let mut expected = original.clone();
    for (name, binary, args) in COMMANDS {
        let flags = parse_help(&help_text(binary, args));
        assert!(
            flags.len() > 3,
            "too few flags parsed for {name}: {flags:?}"
        );
        expected = with_table(&expected, name, &render(&flags))
            .unwrap_or_else(|| panic!("docs/operations.md has no FLAGS markers for {name}"));
    }
    if std::env::var_os("TANDEM_UPDATE_DOCS").is_some() {
        std::fs::write(&path, &expected).unwrap();
        return;
    }
    assert!(
        original == expected,
        "docs/operations.md does not list the flags as --help prints them; \
         run `TANDEM_UPDATE_DOCS=1 cargo test -p tandem-lab --test docs` and review the diff"
    );
}

#[test]
fn help_texts_of_both_layouts_parse() {
    let two_lines = "Options:
      --cloud-url <CLOUD_URL>
          Base URL of the cloud API [env: TANDEM_CLOUD_URL=]
      --iptables-backend <IPTABLES_BACKEND>
          Possible values:
          - auto:   Detect from the rules
          - nft

          [env: IPTABLES_BACKEND=]
          [default: auto]

  -h, --help
          Print help
";
    let one_line = "Usage: x

Options:
      --protocol <PROTOCOL>          [env: TRACE_PROTOCOL=] [default: tcp] [possible values: tcp, udp]
      --from-node                    Generated on the node [env: TRACE_FROM_NODE=]
  -h, --help                         Print help
";
    assert_eq!(
        parse_help(two_lines),
        [
            Flag {
                name: "--cloud-url".into(),
                value: Some("<CLOUD_URL>".into()),
                env: Some("TANDEM_CLOUD_URL".into()),
                default: None,
                values: vec![],
                help: "Base URL of the cloud API".into(),
            },
            Flag {
                name: "--iptables-backend".into(),
                value: Some("<IPTABLES_BACKEND>".into()),
                env: Some("IPTABLES_BACKEND".into()),
                default: Some("auto".into()),
                values: vec!["auto".into(), "nft".into()],
                help: String::new(),
            },
        ]
    );
    let flags = parse_help(one_line);
    assert_eq!(flags.len(), 2);
    assert_eq!(flags[0].values, ["tcp", "udp"]);
    assert_eq!(flags[0].default.as_deref(), Some("tcp"));
    assert_eq!(
        (flags[1].value.as_deref(), flags[1].help.as_str()),
        (None, "Generated on the node")
    );
    assert!(
        render(&flags).contains("| `--from-node` | `TRACE_FROM_NODE` |  | Generated on the node |")
    );
}
