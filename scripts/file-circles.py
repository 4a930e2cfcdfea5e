#!/usr/bin/env python3
"""Fails when the files of a crate import each other in a circle.

A circle (a.rs uses b.rs, which uses a.rs, directly or through others) means neither file
can be read, tested or moved without the other: one concept is split over two files, or
two are tangled in one. The crates' modules form a DAG (issue 45); this keeps it so.

    python3 scripts/file-circles.py [--root DIR]

checks every crate of the workspace at DIR (default: this checkout): each root (src/lib.rs,
src/main.rs, src/bin/*, tests/*.rs) and the modules it declares. It prints each circle
with the line of every import in it and exits 1, or exits 0 when there is none. Before
that it checks itself on a made-up crate with a known circle, so that a checker broken by
a change cannot pass by finding nothing.

What counts as "file A uses file B": a path in A's code (a `use` or an inline path such as
`crate::x::Y`, `super::Y`, `self::x::Y`, or `x::Y` with `x` a module A declares) that names
an item of B or a module inside it. A path is taken to the deepest module it names that
has a file, so `crate::haproxy::Unrenderable` is haproxy/mod.rs even when that file only
re-exports it (import it from where it is defined instead). Not counted: `mod x;` (the
tree, not a use), a `pub use` whose names the file does not use itself (a re-export is
the file's facade, not its code), comments and strings, paths of other crates, and a
module's use of its ancestors (`super::X`, or `crate::X` of the crate root): the items a
parent holds for its children (a mod.rs's shared types, the crate's vocabulary in lib.rs)
are their context, which Rust shows every descendant, and the parent uses its children.
"""

import argparse
import re
import sys
import tempfile
import tomllib
from pathlib import Path

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
RAW_STRING = re.compile(r'(?:b|c)?r(#*)"')


def tokens(text):
    """The tokens of Rust source: identifiers (raw ones without `r#`), `::`, string literals
    as ("str", content), other punctuation one character each; comments, numbers, char
    literals and lifetimes dropped. Each token is (kind, value, line)."""
    out, i, line, n = [], 0, 1, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif c.isspace():
            i += 1
        elif text.startswith("//", i):
            while i < n and text[i] != "\n":
                i += 1
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    line += text[i] == "\n"
                    i += 1
        elif m := RAW_STRING.match(text, i):
            end = text.index('"' + m.group(1), m.end())
            out.append(("str", text[m.end():end], line))
            line += text.count("\n", i, end)
            i = end + 1 + len(m.group(1))
        elif c == '"' or (c in "bc" and text.startswith('"', i + 1)):
            start = i = text.index('"', i) + 1
            while text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            out.append(("str", text[start:i], line))
            line += text.count("\n", start, i)
            i += 1
        elif c == "'" or (c == "b" and text.startswith("'", i + 1)):
            i = text.index("'", i) + 1
            if text[i] == "\\":  # an escaped char literal: '\n', '\'', '\u{1F600}'
                i = text.index("'", i + 2) + 1
            elif i + 1 < n and text[i + 1] == "'":  # a plain char literal
                i += 2
            # else a lifetime or a label: its name is read as an identifier next
        elif c.isdigit():
            while i < n and (text[i].isalnum() or text[i] == "_"):
                i += 1
        elif m := IDENT.match(text, i):
            word = m.group()
            if word == "r" and text.startswith("#", m.end()):  # r#ident
                m = IDENT.match(text, m.end() + 1)
                word = m.group()
            out.append(("ident", word, line))
            i = m.end()
        elif text.startswith("::", i):
            out.append(("punct", "::", line))
            i += 2
        else:
            out.append(("punct", c, line))
            i += 1
    return out


def use_paths(toks, start):
    """The paths of the `use` tree that starts at toks[start] (after `use`), each as a list
    of segments with the name it brings in (None for a glob), and the index after `;`."""
    paths = []

    def tree(i, prefix):
        segments = list(prefix)
        while True:
            kind, value, _ = toks[i]
            if value == "{":
                i += 1
                while toks[i][1] != "}":
                    i = tree(i, segments)
                    if toks[i][1] == ",":
                        i += 1
                return i + 1
            if value == "*":
                paths.append((segments, None))
                return i + 1
            if kind != "ident":
                raise ValueError(f"line {toks[i][2]}: unexpected {value!r} in a use")
            i += 1
            if toks[i][1] == "::":
                segments = segments + [value]
                i += 1
                continue
            name = value
            if toks[i][1] == "as":
                name = toks[i + 1][1]
                i += 2
            if value == "self":  # `a::{self, ...}`: the module `a` itself
                paths.append((segments, segments[-1] if name == "self" else name))
            else:
                paths.append((segments + [value], name))
            return i

    i = start
    if toks[i][1] == "::":  # `use ::std::...`: another crate
        i += 1
    i = tree(i, [])
    while toks[i][1] != ";":
        i += 1
    return paths, i + 1


def visibility_before(toks, i):
    """Whether the item whose keyword is toks[i] is `pub` or `pub(...)`."""
    if i >= 1 and toks[i - 1][1] == "pub":
        return True
    if i >= 1 and toks[i - 1][1] == ")":
        j = i - 1
        while j >= 0 and toks[j][1] != "(":
            j -= 1
        return j >= 1 and toks[j - 1][1] == "pub"
    return False


class File:
    """One source file: the modules it declares (with their files) and the paths it uses."""

    def __init__(self, path, module):
        self.path, self.module = path, module
        self.toks = tokens(path.read_text())
        # (module path of the inline scope, segments, name or None, line, is_reexport)
        self.uses = []
        # (module path of the inline scope, segments, line)
        self.inline_paths = []
        # (module path, `#[path]` or None) of each `mod x;`, and the inline modules
        self.declared, self.inline_modules = [], []
        self.scan()

    def scan(self):
        toks, scope, stack, i = self.toks, list(self.module), [], 0
        in_use = set()
        while i < len(toks):
            kind, value, line = toks[i]
            if value == "mod" and kind == "ident" and i + 2 < len(toks) and toks[i + 1][0] == "ident":
                name, after = toks[i + 1][1], toks[i + 2][1]
                if after == ";":
                    self.declared.append((scope + [name], self.path_attribute(i)))
                elif after == "{":
                    self.inline_modules.append(scope + [name])
                    stack.append(("mod", name))
                    scope = scope + [name]
                    i += 3
                    continue
            # A `use` item starts a statement or an item; `impl Trait + use<'a>` is no import.
            starts_item = i == 0 or toks[i - 1][1] in (";", "{", "}", "]", ")", "pub")
            if value == "use" and kind == "ident" and starts_item:
                paths, end = use_paths(toks, i + 1)
                reexport = visibility_before(toks, i)
                for segments, name in paths:
                    self.uses.append((list(scope), segments, name, line, reexport))
                in_use.update(range(i, end))
                i = end
                continue
            if value == "{":
                stack.append(("block", None))
            elif value == "}" and stack:
                if stack.pop()[0] == "mod":
                    scope = scope[:-1]
            elif (kind == "ident" and i + 1 < len(toks) and toks[i + 1][1] == "::"
                  and (i == 0 or toks[i - 1][1] != "::")):
                segments, j = [value], i + 1
                while j + 1 < len(toks) and toks[j][1] == "::" and toks[j + 1][0] == "ident":
                    segments.append(toks[j + 1][1])
                    j += 2
                self.inline_paths.append((list(scope), segments, line))
                i = j
                continue
            i += 1
        self.code_idents = {v for n, (k, v, _) in enumerate(toks) if k == "ident" and n not in in_use}

    def path_attribute(self, i):
        """The file a `#[path = "..."]` right before the `mod` at toks[i] names, if any."""
        toks, j = self.toks, i - 1
        if toks[j][1] == ")":  # pub(crate), pub(super)
            while toks[j][1] != "(":
                j -= 1
            j -= 1
        if toks[j][1] == "pub":
            j -= 1
        # `# [ path = "file" ]`, ending at toks[j]
        if j >= 5 and [t[1] for t in toks[j - 5:j - 1]] == ["#", "[", "path", "="] \
                and toks[j - 1][0] == "str" and toks[j][1] == "]":
            return toks[j - 1][1]
        return None


class Crate:
    """The module tree of one crate root, and its files' uses of each other."""

    def __init__(self, root_file):
        self.root = root_file
        self.files = {}  # Path -> File
        self.module_file = {}  # tuple(module path) -> Path
        self.load(root_file, [], root=True)

    def load(self, path, module, root=False):
        path = path.resolve()
        try:
            file = File(path, module)
        except (ValueError, IndexError) as error:
            sys.exit(f"file-circles.py cannot read {path}: {error!r}")
        self.files[path] = file
        self.module_file[tuple(module)] = path
        for inline in file.inline_modules:
            self.module_file[tuple(inline)] = path
        # Children of lib.rs, main.rs, mod.rs (and a crate root) sit beside it; those of
        # a.rs in a/.
        own_dir = path.parent if root or path.name == "mod.rs" else path.parent / path.stem
        for child, attribute in file.declared:
            inline_part = child[len(module):-1]
            base = own_dir.joinpath(*inline_part)
            if attribute is not None:
                candidates = [(path.parent if not inline_part else base) / attribute]
            else:
                candidates = [base / f"{child[-1]}.rs", base / child[-1] / "mod.rs"]
            found = next((c for c in candidates if c.is_file()), None)
            if found is None:
                raise FileNotFoundError(f"{path}: mod {child[-1]}: none of {candidates}")
            self.load(found, child)

    def resolve(self, scope, segments):
        """The file of the deepest module `segments`, used in `scope`, names; None for a
        path that leaves the crate."""
        first, rest = segments[0], segments[1:]
        if first == "crate":
            absolute = rest
        elif first == "self":
            absolute = scope + rest
        elif first == "super":
            absolute = list(scope)
            while segments and segments[0] == "super":
                absolute, segments = absolute[:-1], segments[1:]
            absolute += segments
        elif tuple(scope + [first]) in self.module_file:
            absolute = scope + segments
        else:
            return None
        for length in range(len(absolute), -1, -1):
            found = self.module_file.get(tuple(absolute[:length]))
            if found is not None:
                return found
        return None

    def edges(self):
        """file -> {file it uses: (line, the path as written)}."""
        graph = {path: {} for path in self.files}
        for path, file in self.files.items():
            found = [(s, seg, line) for s, seg, name, line, reexport in file.uses
                     if not reexport or (name is not None and name in file.code_idents)]
            found += file.inline_paths
            for scope, segments, line in found:
                if not segments:
                    continue
                target = self.resolve(scope, segments)
                # A module may use its ancestors (see the module comment).
                if target is not None and not is_prefix(self.files[target].module, file.module):
                    graph[path].setdefault(target, (line, "::".join(segments)))
        return graph


def is_prefix(ancestor, module):
    """Whether `ancestor` is `module` or one of the modules that contain it."""
    return module[:len(ancestor)] == ancestor


def circles(graph):
    """Each strongly connected set of more than one file, as one circle through it."""
    index, low, on_stack, stack, sets, counter = {}, {}, set(), [], [], [0]

    def connect(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1:
                sets.append(set(members))

    sys.setrecursionlimit(10000)
    for node in sorted(graph):
        if node not in index:
            connect(node)
    found = []
    for members in sets:
        start = min(members)
        # The shortest way back to `start` inside the set (breadth first).
        previous, frontier, done = {start: None}, [start], None
        while frontier and done is None:
            following = []
            for node in frontier:
                for succ in sorted(graph[node]):
                    if succ not in members:
                        continue
                    if succ == start:
                        done = node
                        break
                    if succ not in previous:
                        previous[succ] = node
                        following.append(succ)
                if done is not None:
                    break
            frontier = following
        path, node = [start], done
        while node is not None and node != start:
            path.insert(1, node)
            node = previous[node]
        found.append(path)
    return found


def workspace_roots(root):
    """Every crate root of the workspace's members."""
    members = tomllib.loads((root / "Cargo.toml").read_text())["workspace"]["members"]
    for member in members:
        crate = root / member
        candidates = [crate / "src/lib.rs", crate / "src/main.rs"]
        candidates += sorted((crate / "src/bin").glob("*.rs"))
        candidates += sorted((crate / "src/bin").glob("*/main.rs"))
        candidates += sorted((crate / "tests").glob("*.rs"))
        for candidate in candidates:
            if candidate.is_file():
                yield member, candidate


def check(root):
    """The circles of every crate under `root`, as lines to print."""
    report = []
    for member, crate_root in workspace_roots(root):
        crate = Crate(crate_root)
        graph = crate.edges()
        for circle in circles(graph):
            shown = lambda p: str(p.relative_to(root.resolve()))
            steps = []
            for a, b in zip(circle, circle[1:] + circle[:1]):
                line, used = graph[a][b]
                steps.append(f"    {shown(a)}:{line} uses {shown(b)} (`{used}`)")
            names = " -> ".join(shown(p) for p in circle + circle[:1])
            report.append(f"{member} ({crate_root.name}): {names}\n" + "\n".join(steps))
    return report


def self_test():
    """The checker finds a made-up circle through a re-exporting mod.rs and `super`, and
    none where a `pub use` is only a facade or a test module uses its own file."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "Cargo.toml").write_text('[workspace]\nmembers = ["a"]\n')
        src = root / "a/src"
        (src / "plan").mkdir(parents=True)
        files = {
            "lib.rs": "mod error;\nmod plan;\nmod facade;\npub use error::Error;\npub struct Shared;\n",
            "error.rs": '/// Not a use: crate::facade::Nothing\nuse crate::plan::Failure;\nconst S: &str = "crate::facade";\npub struct Error(Failure);\n',
            "plan/mod.rs": "mod render;\npub use render::Failure;\npub fn failed() -> Failure {\n    Failure\n}\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n",
            "plan/render.rs": "pub struct Failure;\nfn f() { let _ = super::super::error::Error; }\n",
            "facade.rs": "pub use crate::error::Error;\nuse crate::Shared;\n",
        }
        for name, text in files.items():
            (src / name).write_text(text)
        found = check(root)
        expected = "a (lib.rs): a/src/error.rs -> a/src/plan/mod.rs -> a/src/plan/render.rs -> a/src/error.rs"
        if len(found) != 1 or not found[0].startswith(expected):
            sys.exit("file-circles.py is broken: on its own example it found\n" + "\n".join(found))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = parser.parse_args()
    self_test()
    report = check(args.root)
    if report:
        print(f"{len(report)} circle(s) of files that import each other:", file=sys.stderr)
        print("\n".join(report), file=sys.stderr)
        sys.exit(1)
    print("no circles of files")


if __name__ == "__main__":
    main()
