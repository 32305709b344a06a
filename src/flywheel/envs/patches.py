"""Unified diffs for code_repair: parse, apply (confined to the workspace, never through a
symlink) and make."""

from __future__ import annotations

import difflib
import io
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from flywheel.envs.repo import CodeRepairError, Instance, PatchError, _through_link, checkout, resolve_repo

def split_lines(text: str, python: bool = False) -> list[str]:
    """Lines with their endings, as diff, patch and git count them (split after each \\n only), or with
    python=True as Python's tokenizer does (\\r\\n, \\r, \\n). Never str.splitlines, which also splits
    at \\f, \\x1c, \\u2028 and others."""
    return io.StringIO(text, newline="" if python else "\n").readlines()


@dataclass
class FilePatch:
    old: str | None  # None: the file is created
    new: str | None  # None: the file is deleted
    hunks: list[tuple[int, int, list[tuple[str, str]]]]  # (old_start, old_len, [(" "|"-"|"+", line)])

    @property
    def path(self) -> str:
        return self.new or self.old


def _patch_path(raw: str) -> str | None:
    raw = raw.split("\t")[0].strip()
    if raw == "/dev/null":
        return None
    if raw.startswith(("a/", "b/")):
        raw = raw[2:]
    p = PurePosixPath(raw)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise PatchError(f"unsafe path in patch: {raw!r}")
    return str(p)


def parse_patch(text: str) -> list[FilePatch]:
    """Unified diff (git or diff -u style, a/ b/ prefixes or none) -> file patches."""
    lines, files, i = split_lines(text), [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(("Binary files", "GIT binary patch")):
            raise PatchError("binary patches are not supported")
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            files.append(FilePatch(_patch_path(line[4:]), _patch_path(lines[i + 1][4:]), []))
            i += 2
            continue
        if not line.startswith("@@"):
            i += 1
            continue
        if not files:
            raise PatchError(f"line {i + 1}: hunk before any '---'/'+++' file header")
        try:
            head = line.split("@@")[1].split()
            (o_start, o_len), (_, n_len) = [tuple(map(int, (h[1:] + ",1").split(",")[:2])) for h in head[:2]]
        except (IndexError, ValueError):
            raise PatchError(f"line {i + 1}: bad hunk header {line.strip()!r}") from None
        body, n_old, n_new, i = [], 0, 0, i + 1
        while i < len(lines):
            raw = lines[i]
            if raw.startswith("\\"):  # "\ No newline at end of file": the line before has none
                if body:
                    body[-1] = (body[-1][0], body[-1][1].rstrip("\r\n"))
                i += 1
                continue
            if n_old >= o_len and n_new >= n_len:
                break
            tag, rest = (" ", raw) if raw in ("\n", "\r\n") else (raw[:1], raw[1:])  # blank context, space stripped
            if tag not in (" ", "-", "+"):
                break
            body.append((tag, rest))
            n_old += tag in " -"
            n_new += tag in " +"
            i += 1
        if n_old != o_len or n_new != n_len:
            raise PatchError(f"{files[-1].path}: hunk {line.strip()!r} is truncated or malformed "
                             f"(expected {o_len} old / {n_len} new lines, found {n_old} / {n_new})")
        files[-1].hunks.append((o_start, o_len, body))
    if not files:
        raise PatchError("no file changes found in the patch (expected a unified diff)")
    return files


def _apply_hunks(path: str, text: str, hunks) -> str:
    lines, out, pos, offset = split_lines(text), [], 0, 0
    for n, (o_start, o_len, body) in enumerate(hunks, 1):
        old = [t for tag, t in body if tag != "+"]
        new = [t for tag, t in body if tag != "-"]
        want = max((o_start if o_len == 0 else o_start - 1) + offset, pos)
        at = next((c for d in range(len(lines) + 1) for c in (want - d, want + d)
                   if pos <= c <= len(lines) - len(old) and lines[c:c + len(old)] == old), None)
        if at is None:
            first = next((t.rstrip() for tag, t in body if tag != "+"), "")
            raise PatchError(f"{path}: hunk {n} (@@ -{o_start},{o_len}) does not apply: its context/removed lines "
                             f"(starting {first!r}) are not in the file")
        out += lines[pos:at] + new
        pos, offset = at + len(old), at - (o_start - 1)
    return "".join(out + lines[pos:])


def apply_patch(root: Path, patch: str) -> list[str]:
    """Apply a unified diff under root (all files or none); returns the paths changed."""
    root, staged = Path(root), {}
    for fp in parse_patch(patch):
        for rel in {fp.old, fp.new} - {None}:
            if _through_link(root, rel):
                raise PatchError(f"{rel}: refusing to patch through a symbolic link")
        src = fp.old or fp.new
        if fp.old is None:
            if (root / fp.new).exists() or staged.get(fp.new) is not None:
                raise PatchError(f"{fp.new}: the patch creates it but it already exists")
            text = ""
        elif staged.get(fp.old) is not None:
            text = staged[fp.old]
        elif fp.old not in staged and (root / fp.old).is_file():
            text = (root / fp.old).read_bytes().decode("utf-8", errors="surrogateescape")
        else:
            raise PatchError(f"{fp.old}: the patch changes it but it does not exist")
        new_text = _apply_hunks(src, text, fp.hunks)
        if fp.new is None and new_text:
            raise PatchError(f"{fp.old}: the patch deletes it but its content differs")
        if fp.old is not None and fp.new is not None and fp.old != fp.new:  # a rename
            staged[fp.old] = None
        staged[fp.new or fp.old] = None if fp.new is None else new_text
    for rel, text in staged.items():
        target = root / rel
        if text is None:
            target.unlink(missing_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            _replace_file(target, text.encode("utf-8", errors="surrogateescape"))
    return list(staged)


def _replace_file(target: Path, data: bytes) -> None:
    """Write `target` as a new file renamed into place (keeping its mode): never in place, so a
    file hard-linked from a shared base tree (envs/swe/workspace.py) is left as it was."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}.patch-tmp")
    tmp.write_bytes(data)
    if target.exists():
        os.chmod(tmp, target.stat().st_mode & 0o7777)
    os.replace(tmp, target)


def make_diff(rel: str, old: str | None, new: str | None, context: int = 3) -> str:
    """git-style unified diff of one file (old/new None: created/deleted), `patch -p1`-able."""
    a, b = split_lines(old or ""), split_lines(new or "")
    if a == b and (old is None) == (new is None):
        return ""
    head = f"diff --git a/{rel} b/{rel}\n"
    head += "new file mode 100644\n" if old is None else "deleted file mode 100644\n" if new is None else ""
    head += f"--- {'/dev/null' if old is None else 'a/' + rel}\n+++ {'/dev/null' if new is None else 'b/' + rel}\n"

    def span(start, n):
        return f"{start + 1 if n else start},{n}" if n != 1 else f"{start + 1}"

    def emit(tag, line):
        return tag + line + ("" if line.endswith("\n") else "\n\\ No newline at end of file\n")

    out = [head]
    for group in difflib.SequenceMatcher(None, a, b, autojunk=False).get_grouped_opcodes(context):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        out.append(f"@@ -{span(i1, i2 - i1)} +{span(j1, j2 - j1)} @@\n")
        for op, x1, x2, y1, y2 in group:
            out += [emit(" ", s) for s in a[x1:x2]] if op == "equal" else []
            out += [emit("-", s) for s in a[x1:x2]] if op in ("replace", "delete") else []
            out += [emit("+", s) for s in b[y1:y2]] if op in ("replace", "insert") else []
    return "".join(out)


def _read_text(p: Path | None) -> str | None:
    if p is None:
        return None
    if p.is_symlink():
        return f"(symlink to {os.readlink(p)})\n"
    return p.read_bytes().decode("utf-8", errors="surrogateescape")


def _same(a: Path | None, b: Path | None) -> bool:
    if a is None or b is None:
        return a is b
    if a.is_symlink() or b.is_symlink():
        return a.is_symlink() and b.is_symlink() and os.readlink(a) == os.readlink(b)
    return a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()


# ---------------------------------------------------------------- running tests


def materialize(inst: Instance, dest: Path) -> None:
    """The buggy state of an instance in `dest`: repo at base_commit, then bug_patch."""
    checkout(inst.repo_path or resolve_repo(inst.repo), inst.base_commit, dest, inst.instance_id)
    if inst.bug_patch:
        try:
            apply_patch(dest, inst.bug_patch)
        except PatchError as e:
            raise CodeRepairError(f"{inst.instance_id}: bug_patch: {e}") from None
