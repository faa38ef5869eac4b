"""The key's memo of file contents (``opbuilder.jit.fingerprint.FileMemo``): a warm key reads no file, and
the memo never gives a wrong key -- an edit that keeps the size and restores the mtime, an entry too young
to be sure of, a damaged memo, and a memo that someone else could have written all mean reading again."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from opbuilder import OpBuilder, paths
from opbuilder.jit import fingerprint

HEADER = "#pragma once\nconstexpr float kScale = {scale};\n"
SOURCE = '#include <opbuilder/stable.h>\n#include "scale.h"\n// add_scale\n'

#: Trust every entry however young (the racy-entry margin off): what is left to catch an edit is the
#: file's status alone, which is what these tests check.
TRUST_YOUNG = -(10**18)


def make_builder(root: Path) -> type[OpBuilder]:
    class MemoOp(OpBuilder):
        NAME = "memo_op"

        def source_root(self) -> Path:
            return root

        def sources(self) -> list[str]:
            return ["csrc/memo_op.cpp"]

        def include_paths(self) -> list[str]:
            return ["csrc"]

    return MemoOp


@pytest.fixture
def project(tmp_path: Path, fresh_cache: Path) -> tuple[type[OpBuilder], Path]:
    root = tmp_path / "proj"
    (root / "csrc").mkdir(parents=True)
    (root / "csrc" / "scale.h").write_text(HEADER.format(scale="2.0"))
    (root / "csrc" / "memo_op.cpp").write_text(SOURCE)
    paths.op_dir("memo_op").mkdir(parents=True, mode=0o700)  # the memo is kept once the op has a folder
    time.sleep(0.05)  # the files' ctime a clock tick before anything reads them
    return make_builder(root), root


def reads(cls: type[OpBuilder]) -> tuple[str, int]:
    """(key, files read) of a new builder object, as a new process would work it out."""
    builder = cls()
    return builder.key, builder._file_memo.reads


def test_warm_key_reads_no_file_and_keeps_the_key(project, monkeypatch: pytest.MonkeyPatch) -> None:
    cls, _ = project
    key, first = reads(cls)
    assert first >= 2, "the first key reads the source and its header"
    assert paths.key_memo("memo_op").is_file()
    monkeypatch.setattr(fingerprint.FileMemo, "MARGIN_NS", TRUST_YOUNG)
    assert reads(cls) == (key, 0)


def test_young_entries_are_read_again(project) -> None:
    """Entries whose file changed less than MARGIN_NS before the memo was written are not trusted: an
    edit in the same clock tick as the read could leave the status unchanged."""
    cls, _ = project
    key, _ = reads(cls)
    assert reads(cls)[1] >= 2


def test_edit_keeping_size_and_mtime_changes_the_key(project, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fingerprint.FileMemo, "MARGIN_NS", TRUST_YOUNG)
    cls, root = project
    header = root / "csrc" / "scale.h"
    key, _ = reads(cls)
    assert reads(cls) == (key, 0)
    before = header.stat()
    time.sleep(0.05)
    header.write_text(HEADER.format(scale="3.0"))  # same size
    os.utime(header, ns=(before.st_atime_ns, before.st_mtime_ns))  # as `touch -d` would put it back
    assert header.stat().st_size == before.st_size and header.stat().st_mtime_ns == before.st_mtime_ns
    edited, again = reads(cls)
    assert edited != key and again == 1
    header.write_text(HEADER.format(scale="2.0"))
    assert reads(cls)[0] == key


def test_replaced_file_changes_the_key(project, monkeypatch: pytest.MonkeyPatch) -> None:
    """An editor's save (a new file renamed over the old one, same size and mtime): a new inode."""
    monkeypatch.setattr(fingerprint.FileMemo, "MARGIN_NS", TRUST_YOUNG)
    cls, root = project
    source = root / "csrc" / "memo_op.cpp"
    key, _ = reads(cls)
    before = source.stat()
    new = source.with_name("new.cpp")
    new.write_text(SOURCE.replace("add_scale", "add_scal2"))
    os.utime(new, ns=(before.st_atime_ns, before.st_mtime_ns))
    os.replace(new, source)
    assert reads(cls)[0] != key


def _forged(cls: type[OpBuilder]) -> str:
    """Writes a memo whose entries match the files' status but hold wrong hashes; returns the true key."""
    key, _ = reads(cls)
    memo = paths.key_memo("memo_op")
    data = json.loads(memo.read_text())
    for entry in data["files"].values():
        entry[5] = "0" * 64
    memo.write_text(json.dumps(data))
    return key


def test_a_forged_memo_of_this_user_is_believed(project, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control for the two tests below: the memo file is what the key believes."""
    monkeypatch.setattr(fingerprint.FileMemo, "MARGIN_NS", TRUST_YOUNG)
    cls, _ = project
    key = _forged(cls)
    assert reads(cls) != (key, 0) and reads(cls)[1] == 0


@pytest.mark.parametrize("how", ["group-writable", "other-writable", "symbolic link"])
def test_memo_others_could_write_is_ignored(project, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    monkeypatch.setattr(fingerprint.FileMemo, "MARGIN_NS", TRUST_YOUNG)
    cls, root = project
    key = _forged(cls)
    memo = paths.key_memo("memo_op")
    if how == "symbolic link":
        target = root / "elsewhere.json"
        os.replace(memo, target)
        memo.symlink_to(target)
    else:
        memo.chmod(0o620 if how == "group-writable" else 0o602)
    assert reads(cls)[0] == key


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_memo_of_another_user_is_ignored(project, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fingerprint.FileMemo, "MARGIN_NS", TRUST_YOUNG)
    cls, _ = project
    key = _forged(cls)
    os.chown(paths.key_memo("memo_op"), 65534, 65534)
    assert reads(cls)[0] == key


@pytest.mark.parametrize("damage", ["truncated", "not json", "wrong version", "bad entries", "empty"])
def test_damaged_memo_means_reading_again(project, monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    monkeypatch.setattr(fingerprint.FileMemo, "MARGIN_NS", TRUST_YOUNG)
    cls, _ = project
    key, _ = reads(cls)
    memo = paths.key_memo("memo_op")
    text = memo.read_text()
    data = json.loads(text)
    if damage == "truncated":
        memo.write_text(text[: len(text) // 2])
    elif damage == "not json":
        memo.write_bytes(b"\x00\xff garbage")
    elif damage == "wrong version":
        memo.write_text(json.dumps({**data, "version": 99}))
    elif damage == "bad entries":
        for path, entry in data["files"].items():
            data["files"][path] = entry[:5] + ["not a hash", "x", [99]]
        memo.write_text(json.dumps(data))
    else:
        memo.write_text("")
    again, read = reads(cls)
    assert again == key and read >= 2
    assert reads(cls) == (key, 0), "the memo is written whole again"


def test_no_memo_is_written_without_the_op_folder(tmp_path: Path, fresh_cache: Path) -> None:
    """Working out a key creates nothing in the cache."""
    root = tmp_path / "proj"
    (root / "csrc").mkdir(parents=True)
    (root / "csrc" / "scale.h").write_text(HEADER.format(scale="2.0"))
    (root / "csrc" / "memo_op.cpp").write_text(SOURCE)
    make_builder(root)().key
    assert not fresh_cache.exists() or not any(fresh_cache.rglob("*"))
