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
//! - Every invocation of a project program that README, docs/ and the chart's README and
//!   NOTES show parses with that program's own command line, placeholders filled in.
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

/// The documents a user types commands from.
const COMMAND_DOCS: [&str; 7] = [
    "README.md",
    "docs/install.md",
    "docs/operations.md",
    "docs/architecture.md",
    "docs/providers.md",
    "charts/tandem/README.md",
    "charts/tandem/templates/NOTES.txt",
];

/// The project's programs, as a command names them (the last part of its path).
const PROGRAMS: [&str; 6] = [
    "tandem-controller",
    "tandem-nodeproxy",
    "cloud-mock",
    "tandem-lab",
    "tandem-bench",
    "tandem-k3s",
];

/// What the documents write for a value the reader fills in, with a value of its kind;
/// an empty value drops the word (a synopsis's `[FLAGS]`).
const PLACEHOLDERS: [(&str, &str); 10] = [
    ("<EXTERNAL-IP>", "198.51.100.10"),
    ("PATH", "kubeconfig"),
    ("CLIENT_IP", "203.0.113.10"),
    ("VIP:PORT", "198.51.100.10:80"),
    ("VIP:80", "198.51.100.10:80"),
    ("NAME", "eth0"),
    ("CMD", "true"),
    ("…", ""),
    ("[FLAGS]", ""),
    ("[OPTIONS]", ""),
];

/// The shell snippets of a document: each line of its fenced blocks (a trailing `\` joins
/// the next), and each inline code span of its paragraphs (which may wrap). A text file
/// (NOTES.txt) is all snippet.
fn shell_snippets(text: &str, markdown: bool) -> Vec<String> {
    let mut snippets = Vec::new();
    let mut fenced = !markdown;
    let mut continued = String::new();
    let mut paragraph = String::new();
    for line in text.lines() {
        if markdown && line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            match line.trim_end().strip_suffix('\\') {
                Some(start) => continued.push_str(start),
                None => snippets.push(std::mem::take(&mut continued) + line),
            }
        } else if line.trim().is_empty() {
            snippets.extend(code_spans(&std::mem::take(&mut paragraph)));
        } else {
            paragraph.push_str(line);
            paragraph.push(' ');
        }
    }
    snippets.extend(code_spans(&paragraph));
    snippets
}

/// The `inline code` spans of a paragraph.
fn code_spans(paragraph: &str) -> Vec<String> {
    paragraph
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

/// The invocations of the project's programs in a shell snippet: the program's name and
/// its words, for each command (split at `&&`, `||`, `|`, `;`, comments dropped) whose
/// program is one of ours, run directly, through `sudo` or `exec`, after a command's `--`
/// (`kubectl exec … -- tandem-nodeproxy trace …`) or as a unit's `ExecStart=`. A bare name
/// with no words is a name in prose, not a command.
fn invocations(snippet: &str) -> Vec<(String, Vec<String>)> {
    let mut found = Vec::new();
    for command in snippet.split(['|', ';', '&']) {
        let command = command.split(" #").next().unwrap_or_default();
        let Some(words) = shlex::split(command) else {
            continue;
        };
        for (i, word) in words.iter().enumerate() {
            let path = word.strip_prefix("ExecStart=").unwrap_or(word);
            let name = path.rsplit('/').next().unwrap_or(path);
            let runs = i == 0
                || word.starts_with("ExecStart=")
                || ["sudo", "--"].contains(&words[i - 1].as_str())
                || i == 1 && words[0] == "exec"
                || words[i - 1].contains('=') && !words[i - 1].starts_with('-');
            if PROGRAMS.contains(&name) && runs {
                if words.len() > i + 1 {
                    found.push((name.to_owned(), words[i + 1..].to_vec()));
                }
                break;
            }
        }
    }
    found
}

/// `args` with the placeholders filled in, or the words that are placeholders no entry of
/// [`PLACEHOLDERS`] knows (`<…>`, `$…`, or all capitals).
fn filled(args: &[String]) -> Result<Vec<String>, Vec<String>> {
    let mut out = Vec::new();
    let mut unknown = Vec::new();
    for arg in args {
        match PLACEHOLDERS
            .iter()
            .find(|(placeholder, _)| placeholder == arg)
        {
            Some((_, "")) => {}
            Some((_, value)) => out.push((*value).to_owned()),
            None if arg.contains(['<', '$', '…'])
                || arg.len() > 1
                    && arg
                        .chars()
                        .all(|c| c.is_ascii_uppercase() || c == '_' || c == ':') =>
            {
                unknown.push(arg.clone())
            }
            None => out.push(arg.clone()),
        }
    }
    if unknown.is_empty() {
        Ok(out)
    } else {
        Err(unknown)
    }
}

/// Every invocation of a project program that the documents show parses with that
/// program's own command line: it runs with `--help` after the documented words (before a
/// `--` that hands the rest to another command), which checks every flag, subcommand and
/// value up to it and stops before doing anything.
#[test]
fn every_documented_invocation_parses_with_its_program() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut checked = 0;
    let mut failures = Vec::new();
    for doc in COMMAND_DOCS {
        let text = std::fs::read_to_string(root.join(doc)).unwrap();
        for snippet in shell_snippets(&text, doc.ends_with(".md")) {
            for (program, args) in invocations(&snippet) {
                let mut args = match filled(&args) {
                    Ok(args) => args,
                    Err(unknown) => {
                        failures.push(format!(
                            "{doc}: `{snippet}`: unknown placeholders {unknown:?} (add them to PLACEHOLDERS)"
                        ));
                        continue;
                    }
                };
                let help_at = args.iter().position(|a| a == "--").unwrap_or(args.len());
                args.insert(help_at, "--help".into());
                let output = Command::new(binaries::locate(&program).unwrap())
                    .args(&args)
                    .env_clear()
                    .output()
                    .unwrap();
                checked += 1;
                println!("{doc}: {program} {}", args.join(" "));
                if !output.status.success() {
                    failures.push(format!(
                        "{doc}: `{snippet}`: {program} {args:?}: {}",
                        String::from_utf8_lossy(&output.stderr).trim()
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(checked > 20, "only {checked} invocations found");
    println!("{checked} documented invocations parse");
}

#[test]
fn invocations_are_found_where_a_user_would_type_them() {
    let snippets = shell_snippets(
        "Run `sudo target/debug/tandem-lab demo --ip-family dual` or `kubectl -n x\nexec ds/tandem-nodeproxy -- tandem-nodeproxy trace --src 1.2.3.4`; `tandem-controller` alone is a name.\n\n```sh\nTANDEM_X=1 cloud-mock --data-dir /d \\\n  --token t | tee log # comment\ncargo test -p tandem-lab\n```\n",
        true,
    );
    let found: Vec<(String, Vec<String>)> = snippets.iter().flat_map(|s| invocations(s)).collect();
    let words = |w: &[&str]| w.iter().map(|w| (*w).to_owned()).collect::<Vec<_>>();
    assert_eq!(
        found,
        [
            ("tandem-lab".into(), words(&["demo", "--ip-family", "dual"])),
            (
                "tandem-nodeproxy".into(),
                words(&["trace", "--src", "1.2.3.4"])
            ),
            (
                "cloud-mock".into(),
                words(&["--data-dir", "/d", "--token", "t"])
            ),
        ]
    );
    assert_eq!(
        filled(&words(&["trace", "--dst", "<EXTERNAL-IP>", "[FLAGS]"])),
        Ok(words(&["trace", "--dst", "198.51.100.10"]))
    );
    assert_eq!(
        filled(&words(&["--src", "SOME_IP", "$VIP"])),
        Err(words(&["SOME_IP", "$VIP"]))
    );
}
