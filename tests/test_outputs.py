"""Outputs: refused before any work when they cannot be written, written atomically, never over an input."""

from __future__ import annotations

import os

import pytest

from moe_offload.errors import ConfigError
from moe_offload.outputs import atomic_directory, atomic_output, check_output, write_atomically


def test_a_failed_write_leaves_the_old_file_as_it_was(tmp_path):
    target = tmp_path / "result.json"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_output(target) as temporary:
            temporary.write_text("half of the new")
            raise RuntimeError("disk full")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]  # no partial file left behind


def test_a_successful_write_replaces_the_file_in_one_step(tmp_path):
    target = tmp_path / "deep" / "result.json"
    write_atomically(target, "new")
    assert target.read_text() == "new"
    assert [p.name for p in target.parent.iterdir()] == ["result.json"]


def test_a_directory_is_staged_and_renamed_only_when_complete(tmp_path):
    target = tmp_path / "packed"
    with pytest.raises(KeyboardInterrupt):
        with atomic_directory(target) as staging:
            (staging / "half").write_text("x")
            raise KeyboardInterrupt
    assert not target.exists() and list(tmp_path.iterdir()) == []
    with atomic_directory(target) as staging:
        (staging / "whole").write_text("x")
    assert [p.name for p in target.iterdir()] == ["whole"]


@pytest.mark.parametrize("make, kwargs, message", [
    (lambda d: d / "folder", {}, "is a directory"),
    (lambda d: d / "plot.txt", {"suffixes": (".png", ".svg")}, "must end in .png or .svg"),
    (lambda d: d / "input.parquet", {"inputs": ["input.parquet"]}, "is also an input"),
    (lambda d: d / "a-file" / "out.json", {}, "cannot be created"),
    (lambda d: d / "nonempty", {"directory": True}, "not empty"),
])
def test_outputs_that_cannot_be_written_are_refused_in_one_line(tmp_path, make, kwargs, message):
    (tmp_path / "folder").mkdir()
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "input.parquet").write_text("x")
    (tmp_path / "nonempty").mkdir()
    (tmp_path / "nonempty" / "x").write_text("x")
    if "inputs" in kwargs:
        kwargs = {"inputs": [tmp_path / name for name in kwargs["inputs"]]}
    with pytest.raises(ConfigError, match=message) as error:
        check_output(make(tmp_path), **kwargs)
    assert "\n" not in str(error.value)


def test_the_same_file_under_another_name_is_an_input(tmp_path):
    source = tmp_path / "trace.parquet"
    source.write_text("x")
    os.symlink(source, tmp_path / "alias.parquet")
    with pytest.raises(ConfigError, match="also an input"):
        check_output(tmp_path / "alias.parquet", inputs=[source])


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a read-only folder")
def test_a_read_only_folder_is_refused(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="not writable"):
            check_output(folder / "out.json")
    finally:
        folder.chmod(0o700)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_folder_where_no_file_can_be_made_is_refused_even_for_root():
    with pytest.raises(ConfigError, match="/proc.*not writable"):
        check_output("/proc/result.json")


def test_a_write_through_a_symlink_replaces_the_file_it_points_to(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    os.symlink(real, link)
    write_atomically(link, "new")
    assert link.is_symlink() and real.read_text() == "new"


def test_an_atomic_write_never_replaces_what_is_not_a_regular_file(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        write_atomically(fifo, "x")
    assert fifo.exists() and not fifo.is_file()


def test_an_atomic_write_keeps_the_mode_of_the_file_it_replaces(tmp_path):
    target = tmp_path / "shared.json"
    target.write_text("old")
    target.chmod(0o640)
    write_atomically(target, "new")
    assert target.stat().st_mode & 0o777 == 0o640
    fresh = write_atomically(tmp_path / "fresh.json", "x")
    umask = os.umask(0)
    os.umask(umask)
    assert fresh.stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_dangling_symlink_into_a_missing_folder_makes_no_folder(tmp_path):
    """Issue 33: ``-o d.html`` with ``d.html -> MISSING/dir/x.html`` made MISSING/dir and wrote there."""
    missing = tmp_path / "nonexistent" / "dir"
    link = tmp_path / "d.html"
    link.symlink_to(missing / "x.html")
    for attempt in (lambda: check_output(link), lambda: write_atomically(link, "x")):
        with pytest.raises(ConfigError, match="symlink to .*whose folder does not exist") as refused:
            attempt()
        assert "\n" not in str(refused.value)
    assert not (tmp_path / "nonexistent").exists() and link.is_symlink()


def test_a_dangling_symlink_into_an_existing_folder_writes_the_file_it_names(tmp_path):
    (tmp_path / "there").mkdir()
    link = tmp_path / "d.json"
    link.symlink_to(tmp_path / "there" / "x.json")
    assert check_output(link) == link
    write_atomically(link, "new")
    assert link.is_symlink() and (tmp_path / "there" / "x.json").read_text() == "new"


def test_trace_synth_through_a_dangling_symlink_is_refused_before_work(tmp_path, capsys):
    from cli_driver import assert_refused, run

    link = tmp_path / "t.parquet"
    link.symlink_to(tmp_path / "nonexistent" / "dir" / "x.parquet")
    code, _, err = run(capsys, "trace", "synth", "zipf", "--layers", "2", "--length", "10", "-o", link)
    assert_refused(code, err, "t.parquet", "does not exist")
    assert not (tmp_path / "nonexistent").exists()
