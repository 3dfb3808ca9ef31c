"""stack.durable: the directory exchange, and a full disk turned into one line that says what was kept."""

import errno
import os

import pytest

from stack.durable import DiskFull, disk_full, exchange


@pytest.mark.parametrize("code, says", [(errno.ENOSPC, "the file system is full"),
                                        (errno.EDQUOT, "the disk quota is used up"),
                                        (errno.EFBIG, "a file reached the size limit for files (ulimit -f)")])
def test_no_room_to_write_is_one_line_naming_the_folder_the_file_and_what_was_kept(tmp_path, code, says):
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "half.bin").write_bytes(b"x")
    with pytest.raises(DiskFull) as raised:
        with disk_full(tmp_path, "The previous output is as it was", remove=partial):
            raise OSError(code, os.strerror(code), str(partial / "half.bin"))
    message = str(raised.value)
    assert message.startswith(f"no room to write under '{tmp_path}' ({partial / 'half.bin'}): {says}, ")
    assert "MiB free there. The previous output is as it was. Free some space" in message
    assert not partial.exists() and raised.value.exit_code == 2


def test_other_errors_pass_through_and_keep_the_output(tmp_path):
    with pytest.raises(PermissionError):
        with disk_full(tmp_path, "kept", remove=tmp_path):
            raise PermissionError(errno.EACCES, "denied")
    assert tmp_path.is_dir()


def test_exchange_swaps_two_folders_in_one_step(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "from-a").write_text("a")
    (tmp_path / "b" / "from-b").write_text("b")
    if not exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip("this file system or C library has no RENAME_EXCHANGE (the callers fall back to renames)")
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["from-b"]
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["from-a"]


def test_write_durably_makes_a_new_file_and_never_writes_through_a_second_link(tmp_path):
    """A staging folder holds second links of the user's files: a file written where one of them sits replaces the
    link and leaves the user's file as it was."""
    from stack.durable import write_durably

    (tmp_path / "yours").write_text("mine")
    os.link(tmp_path / "yours", tmp_path / "link")
    write_durably(tmp_path / "link", b"ours")
    assert (tmp_path / "yours").read_text() == "mine" and (tmp_path / "link").read_bytes() == b"ours"


def _dead_pid() -> int:
    """The PID of a process that has exited (and been reaped)."""
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


def test_a_killed_writers_temp_file_is_removed_by_the_next_write_and_no_one_elses_is(tmp_path):
    """A SIGKILL between a temp file's write and its rename leaves `.NAME.HOST.PID.tmp`; the next write of NAME
    removes it when its host is this one and its writer is gone. A live writer's, another host's (a shared file
    system), another file's and a link are left as they are."""
    from stack.durable import _host, write_atomic

    target = tmp_path / "report.json"
    dead = tmp_path / f".report.json.{_host()}.{_dead_pid()}.tmp"
    live = tmp_path / f".report.json.{_host()}.{os.getppid()}.tmp"  # the process that started this one: alive
    remote = tmp_path / f".report.json.other-host.{_dead_pid()}.tmp"
    other_file = tmp_path / f".summary.json.{_host()}.{_dead_pid()}.tmp"
    link = tmp_path / f".report.json.{_host()}.{_dead_pid() + 1_000_000}.tmp"
    for path in (dead, live, remote, other_file):
        path.write_bytes(b"half")
    link.symlink_to(other_file)
    write_atomic(target, b"{}")
    assert target.read_bytes() == b"{}" and not dead.exists()
    assert live.exists() and remote.exists() and other_file.exists() and link.is_symlink()


def test_a_file_name_with_glob_characters_clears_only_its_own_leftovers(tmp_path):
    from stack.durable import _host, write_atomic

    pid = _dead_pid()
    own = tmp_path / f".run[1]*.json.{_host()}.{pid}.tmp"
    lookalike = tmp_path / f".run1x.json.{_host()}.{pid}.tmp"
    own.write_bytes(b"half")
    lookalike.write_bytes(b"half")
    write_atomic(tmp_path / "run[1]*.json", b"{}")
    assert not own.exists() and lookalike.exists()
