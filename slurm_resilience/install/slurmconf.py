"""Merge slurm-resilience's settings into a site's slurm.conf, and take them out again.

Pure functions over file texts (the caller reads and writes): :func:`load` follows
``Include`` lines through an injected reader, :func:`merge` and :func:`unmerge`
return the new texts with the edits they made, :func:`diff` renders them.

What a merge does, key by key (keys compared without case, as Slurm does; the
last definition in include order is the one Slurm keeps, so that is the one edited,
in whichever file it is):

* list keys (``PrologFlags``, ``SchedulerParameters``, ``JobSubmitPlugins``): our
  items are appended to the site's list; none is removed or reordered;
* program keys (``Prolog``, ``Epilog``, ``HealthCheckProgram``): our wrapper takes
  the key and the site's program is recorded, for the wrapper to run it too (Slurm
  22.05 takes one path or one glob pattern per key, so chaining is what works on
  every version we support);
* default keys (``HealthCheckInterval``, ``HealthCheckNodeState``): set only where
  the site has none (or, for the interval, 0, which disables the health check).

A changed line carries a trailing comment saying what was there before, which is
all :func:`unmerge` needs; keys the site lacked go into one marked block at the end
of the main file.
"""

from __future__ import annotations

import difflib
import enum
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePath

BEGIN = "# BEGIN slurm-resilience"
END = "# END slurm-resilience"
_BLOCK_NOTE = " (written by `slurm-resilience install slurm-conf`; --uninstall removes it)"
MARK_ADDED = "# slurm-resilience added: "
MARK_WAS = "# slurm-resilience was: "
EMPTY = "(empty)"
_MARK = re.compile(r"\s*# slurm-resilience (added|was): (.*)$")
_TOKEN = re.compile(r"([A-Za-z][A-Za-z0-9_.]*)=(\"[^\"]*\"|\S*)")
_INCLUDE = re.compile(r"^\s*include\s+(\S.*?)\s*$", re.IGNORECASE)
# Lines that describe one record (a node, a partition, ...): their keys are not globals.
_RECORD_KEYS = frozenset({"nodename", "partitionname", "frontendname", "nodeset",
                          "downnodes", "switchname"})
# Keys whose value is a program: the site's program stays, run by our wrapper.
PROGRAM_HOOKS = {"prolog": "prolog", "epilog": "epilog", "healthcheckprogram": "healthcheck"}


class ConfError(RuntimeError):
    """slurm.conf (or a file it includes) can't be read or merged; the message says which."""


class Kind(enum.Enum):
    LIST = "list"  # comma-separated, ours appended
    PROGRAM = "program"  # ours takes the key, the site's is chained
    DEFAULT = "default"  # set only where the site has none (or a disabling value)


@dataclass(frozen=True)
class Wanted:
    """One setting slurm-resilience needs."""

    key: str  # as written into slurm.conf
    kind: Kind
    value: str  # LIST: comma-separated items
    replaces: tuple[str, ...] = ()  # DEFAULT: site values that disable what we need


@dataclass(frozen=True)
class ConfFile:
    path: PurePath
    text: str


@dataclass(frozen=True)
class _Entry:
    """One ``key=value`` of a global setting, where it is."""

    file: int  # index into the tree's files
    first: int  # first physical line of its logical line
    last: int  # last physical line (continuations)
    key: str  # lower case
    value: str
    start: int  # span of the token in the logical line's content
    end: int


@dataclass(frozen=True)
class Tree:
    """slurm.conf and every file it includes, in the order Slurm reads them."""

    files: tuple[ConfFile, ...]
    entries: tuple[_Entry, ...]

    @property
    def main(self) -> ConfFile:
        return self.files[0]


@dataclass(frozen=True)
class Edit:
    """One line changed, added or removed, for the report."""

    path: PurePath
    key: str
    before: str  # "" when added
    after: str  # "" when removed
    why: str


@dataclass(frozen=True)
class Result:
    """The new texts (only of files that change), what changed and what our hooks chain."""

    texts: Mapping[PurePath, str]
    edits: tuple[Edit, ...]
    chained: Mapping[str, str] = field(default_factory=dict)  # hook name -> site's program

    @property
    def changed(self) -> bool:
        return bool(self.texts)


def wanted(hooks_dir: PurePath, health_check_interval: int) -> tuple[Wanted, ...]:
    """What slurm-resilience needs in slurm.conf, with its hooks in ``hooks_dir``."""
    return (
        Wanted("Prolog", Kind.PROGRAM, str(hooks_dir / "prolog")),
        Wanted("Epilog", Kind.PROGRAM, str(hooks_dir / "epilog")),
        Wanted("PrologFlags", Kind.LIST, "Alloc"),
        Wanted("HealthCheckProgram", Kind.PROGRAM, str(hooks_dir / "healthcheck")),
        Wanted("HealthCheckInterval", Kind.DEFAULT, str(health_check_interval), ("0",)),
        Wanted("HealthCheckNodeState", Kind.DEFAULT, "ANY"),
        Wanted("SchedulerParameters", Kind.LIST, "nohold_on_prolog_fail"),
        Wanted("JobSubmitPlugins", Kind.LIST, "lua"),
    )


# -- parsing -----------------------------------------------------------------------------

def _logical(lines: Sequence[str]) -> list[tuple[int, int, str]]:
    """(first, last, content) of each logical line: a trailing backslash continues it."""
    out: list[tuple[int, int, str]] = []
    i = 0
    while i < len(lines):
        first, content = i, ""
        while True:
            raw = lines[i]
            code = raw.split("#", 1)[0]
            if code.rstrip().endswith("\\") and "#" not in raw and i + 1 < len(lines):
                content += code.rstrip()[:-1]
                i += 1
                continue
            content += raw
            break
        out.append((first, i, content))
        i += 1
    return out


def _code(content: str) -> str:
    return content.split("#", 1)[0]


def load(main: PurePath, read: Callable[[PurePath], str],
         expand: Callable[[PurePath], list[PurePath]]) -> Tree:
    """Read ``main`` and its ``Include`` files depth first, as slurmd does.

    ``read`` returns a file's text (raising OSError); ``expand`` turns an include
    pattern into the sorted paths it names (a plain path gives itself).
    """
    files: list[ConfFile] = []
    entries: list[_Entry] = []

    def visit(path: PurePath, chain: tuple[PurePath, ...]) -> None:
        if path in chain:
            raise ConfError(f"slurm.conf: {path} includes itself (through "
                            f"{' -> '.join(map(str, chain))})")
        try:
            text = read(path)
        except OSError as exc:
            via = f" (included from {chain[-1]})" if chain else ""
            raise ConfError(f"slurm.conf: couldn't read {path}{via}: {exc}") from exc
        index = len(files)
        files.append(ConfFile(path, text))
        for first, last, content in _logical(text.splitlines()):
            code = _code(content)
            inc = _INCLUDE.match(code)
            if inc:
                target = PurePath(inc.group(1).strip('"'))
                if "%" in str(target):
                    raise ConfError(f"slurm.conf: {path}:{first + 1}: can't follow "
                                    f"'Include {target}' (%-modifiers expand at run time); "
                                    "merge that file by hand")
                if not target.is_absolute():
                    target = path.parent / target
                names = expand(target)
                if not names:
                    raise ConfError(f"slurm.conf: {path}:{first + 1}: Include {target} "
                                    "names no file")
                for name in names:
                    visit(name, (*chain, path))
                continue
            tokens = list(_TOKEN.finditer(code))
            if not tokens or tokens[0].group(1).lower() in _RECORD_KEYS:
                continue
            for tok in tokens:
                value = tok.group(2)
                if len(value) >= 2 and value[0] == value[-1] == '"':
                    value = value[1:-1]
                entries.append(_Entry(index, first, last, tok.group(1).lower(), value,
                                      tok.start(), tok.end()))

    visit(main, ())
    return Tree(tuple(files), tuple(entries))


def effective(tree: Tree, key: str) -> str | None:
    """The value Slurm uses for ``key`` (the last definition), None when unset."""
    found = [e for e in tree.entries if e.key == key.lower()]
    return found[-1].value if found else None


# -- merging -----------------------------------------------------------------------------

def _items(value: str) -> list[str]:
    return [i.strip() for i in value.split(",") if i.strip()]


def _strip_block(text: str) -> tuple[str, list[str]]:
    """``text`` without our block (and the block's lines, for the report)."""
    out: list[str] = []
    block: list[str] = []
    inside = False
    for line in text.splitlines(keepends=True):
        if not inside and line.startswith(BEGIN):
            inside = True
            continue
        if inside:
            if line.startswith(END):
                inside = False
            else:
                block.append(line.rstrip("\n"))
            continue
        out.append(line)
    if inside:
        raise ConfError(f"slurm.conf: '{BEGIN}' without '{END}'; fix the block by hand")
    body = "".join(out)
    return body, block


def _split_mark(content: str) -> tuple[str, str | None, str | None]:
    """(content without our marker, marker kind, marker text)."""
    m = _MARK.search(content)
    if m is None:
        return content, None, None
    return content[:m.start()], m.group(1), m.group(2)


def _rewrite(texts: Mapping[PurePath, str], tree: Tree, entry: _Entry, value: str,
             mark: str | None) -> tuple[str, list[str]]:
    """The file of ``entry`` with its value replaced (and what its lines were, then are).

    The logical line becomes one physical line; a line with other settings keeps them
    and the edited one moves to a line of its own just below, so that each line carries
    at most one marker.
    """
    f = tree.files[entry.file]
    lines = texts[f.path].splitlines()
    old = lines[entry.first:entry.last + 1]
    content = "".join((ln.split("#", 1)[0].rstrip()[:-1] if i < len(old) - 1 else ln)
                      for i, ln in enumerate(old))
    body, _, _ = _split_mark(content)
    key = body[entry.start:body.index("=", entry.start)]
    quoted = f'"{value}"' if " " in value else value
    before, after = body[:entry.start].rstrip(), body[entry.end:].strip()
    rest = (before + " " + after).strip()
    code = _code(rest).strip()
    comment = "" if code else rest  # the site's own comment stays on the line
    mine = " ".join(p for p in (f"{key}={quoted}", comment, mark) if p)
    new = [rest, mine] if code else [mine]
    lines[entry.first:entry.last + 1] = new
    text = "\n".join(lines) + ("\n" if texts[f.path].endswith("\n") else "")
    return text, new


def _marker_of(tree: Tree, entry: _Entry) -> tuple[str | None, str | None]:
    lines = tree.files[entry.file].text.splitlines()
    _, kind, text = _split_mark(lines[entry.last])
    return kind, text


def _old_lines(tree: Tree, entry: _Entry) -> str:
    return "\n".join(tree.files[entry.file].text.splitlines()[entry.first:entry.last + 1])


def merge(tree: Tree, want: Sequence[Wanted]) -> Result:
    """Our settings merged into ``tree`` (see the module's docstring for the rules)."""
    body, old_block = _strip_block(tree.main.text)
    texts = {f.path: f.text for f in tree.files}
    texts[tree.main.path] = body
    block: list[str] = []
    edits: list[Edit] = []
    chained: dict[str, str] = {}
    for w in want:
        cur = _reparse(tree, texts)
        found = [e for e in cur.entries if e.key == w.key.lower()]
        if not found:
            block.append(f"{w.key}={w.value}")
            continue
        last = found[-1]
        kind, mark_text = _marker_of(cur, last)
        if w.kind is Kind.LIST:
            have = _items(last.value)
            lower = {i.lower() for i in have}
            add = [i for i in _items(w.value) if i.lower() not in lower]
            if not add:
                continue
            earlier = _items(mark_text or "") if kind == "added" else []
            value, mark = ",".join([*have, *add]), MARK_ADDED + ",".join([*earlier, *add])
            why = f"added {','.join(add)} to the site's {w.key}"
        else:
            if last.value == w.value:
                if w.kind is Kind.PROGRAM and kind == "was" and mark_text not in (None, EMPTY):
                    chained[PROGRAM_HOOKS[w.key.lower()]] = str(mark_text)
                continue
            if w.kind is Kind.DEFAULT and last.value.lower() not in {r.lower() for r in
                                                                      w.replaces}:
                continue  # the site's own value stays
            was = last.value
            value, mark = w.value, MARK_WAS + (was or EMPTY)
            if w.kind is Kind.PROGRAM and was:
                chained[PROGRAM_HOOKS[w.key.lower()]] = was
                why = f"our {w.key} runs the site's {was} too"
            else:
                why = f"{w.key}={was or EMPTY} replaced"
        path = cur.files[last.file].path
        texts[path], new = _rewrite(texts, cur, last, value, mark)
        edits.append(Edit(path, w.key, _old_lines(cur, last), "\n".join(new), why))
    main_text = texts[tree.main.path]
    if block:
        if main_text and not main_text.endswith("\n"):
            main_text += "\n"
        main_text += "\n".join([BEGIN + _BLOCK_NOTE, *block, END]) + "\n"
    texts[tree.main.path] = main_text
    for line in block:
        if line not in old_block:
            edits.append(Edit(tree.main.path, line.split("=", 1)[0], "", line,
                              "not set by the site"))
    for line in old_block:
        if line not in block:
            edits.append(Edit(tree.main.path, line.split("=", 1)[0], line, "",
                              "no longer needed in our block"))
    changed = {p: t for p, t in texts.items() if t != _original(tree, p)}
    return Result(changed, tuple(edits), chained)


def unmerge(tree: Tree, want: Sequence[Wanted]) -> Result:
    """``tree`` with our block gone and every line we changed back to the site's value.

    A key whose value is no longer ours (changed by hand since) keeps that value and
    loses only our marker.
    """
    body, old_block = _strip_block(tree.main.text)
    texts = {f.path: f.text for f in tree.files}
    texts[tree.main.path] = body
    ours = {w.key.lower(): w.value for w in want}
    edits = [Edit(tree.main.path, line.split("=", 1)[0], line, "", "our block removed")
             for line in old_block]
    while True:
        cur = _reparse(tree, texts)
        marked = [(e, *_marker_of(cur, e)) for e in cur.entries]
        todo = next(((e, k, t) for e, k, t in marked
                     if k is not None and t is not None and e.key in ours), None)
        if todo is None:
            break
        entry, kind, text = todo
        if kind == "added":
            mine = {i.lower() for i in _items(str(text))}
            value = ",".join(i for i in _items(entry.value) if i.lower() not in mine)
        elif entry.value == ours[entry.key]:
            value = "" if text == EMPTY else str(text)
        else:
            value = entry.value
        path = cur.files[entry.file].path
        texts[path], new = _rewrite(texts, cur, entry, value, None)
        edits.append(Edit(path, entry.key, _old_lines(cur, entry), "\n".join(new),
                          "the site's value restored"))
    changed = {p: t for p, t in texts.items() if t != _original(tree, p)}
    return Result(changed, tuple(edits))


def still_ours(tree: Tree, result: Result, want: Sequence[Wanted]) -> list[str]:
    """Program keys that would still name our hooks after ``result`` (lines set by hand,
    without our markers): taking the hooks away would then fail every job."""
    after = _reparse(tree, {**{f.path: f.text for f in tree.files}, **result.texts})
    return [f"{w.key}={w.value}" for w in want
            if w.kind is Kind.PROGRAM and effective(after, w.key) == w.value]


def _original(tree: Tree, path: PurePath) -> str:
    return next(f.text for f in tree.files if f.path == path)


def _reparse(tree: Tree, texts: Mapping[PurePath, str]) -> Tree:
    """``tree`` read again from ``texts`` (the same files, in the same include order)."""
    paths = [f.path for f in tree.files]

    def read(p: PurePath) -> str:
        return texts[p]

    def expand(p: PurePath) -> list[PurePath]:
        return sorted(q for q in paths if q == p or _glob_match(q, p))

    return load(tree.main.path, read, expand)


def _glob_match(path: PurePath, pattern: PurePath) -> bool:
    return any(c in str(pattern) for c in "*?[") and path.match(str(pattern))


def diff(tree: Tree, result: Result) -> str:
    """A unified diff of every file ``result`` changes."""
    chunks: list[str] = []
    for path, after in result.texts.items():
        before = _original(tree, path)
        chunks.extend(difflib.unified_diff(before.splitlines(keepends=True),
                                           after.splitlines(keepends=True),
                                           f"{path} (before)", f"{path} (after)"))
    return "".join(chunks)


def read_file(path: PurePath) -> str:
    return Path(path).read_text()


def expand_glob(pattern: PurePath) -> list[PurePath]:
    if not any(c in str(pattern) for c in "*?["):
        return [pattern]
    parent = Path(pattern).parent
    return sorted(PurePath(p) for p in parent.glob(Path(pattern).name))
