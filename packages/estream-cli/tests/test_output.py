"""The command's one output writer (`estream_cli.output`): atomic replacement of regular files
and new paths only, standard output for ``-``, a one-line refusal for anything else, and the
commands that write files going through it."""

from __future__ import annotations

import ctypes
import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from estream.errors import BadRequestError
from estream_cli.main import main
from estream_cli.output import check_output, stdout_claimed, write_json, write_output
from estream_layout import pack_model, synth_model

PAYLOAD = b"new contents\n"
IS_ROOT = os.geteuid() == 0


def put(f: io.BufferedIOBase) -> None:
    f.write(PAYLOAD)


def node_state(path: Path) -> tuple[int, int, int, int]:
    """What identifies a file system node: its type bits, device, inode and device number."""
    st = os.lstat(path)
    return stat.S_IFMT(st.st_mode), st.st_dev, st.st_ino, st.st_rdev


def listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def dev_null_state() -> tuple[int, int, int, int]:
    st = os.stat("/dev/null")
    assert stat.S_ISCHR(st.st_mode)
    return node_state(Path("/dev/null"))


# ------------------------------------------------------------------------------ what it writes
def test_new_file_is_created_whole_with_the_umask_mode(tmp_path: Path) -> None:
    """A new path gets exactly the bytes written, mode 0666 less the umask, and no temporary
    file is left beside it."""
    target = tmp_path / "out.bin"
    write_output(str(target), "--out", put)
    assert target.read_bytes() == PAYLOAD
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
    assert listing(tmp_path) == ["out.bin"]


def test_regular_file_is_replaced_atomically_keeping_its_mode(tmp_path: Path) -> None:
    """An existing regular file is replaced by a rename (a new inode: a reader holding the old
    file still sees the old bytes), keeps its permission bits, and nothing else is left."""
    target = tmp_path / "out.json"
    target.write_bytes(b"old contents, longer than the new ones\n")
    target.chmod(0o640)
    before = target.stat()
    with target.open("rb") as reader:
        write_output(str(target), "--out", put)
        assert reader.read() == b"old contents, longer than the new ones\n"
    after = target.stat()
    assert target.read_bytes() == PAYLOAD
    assert after.st_ino != before.st_ino
    assert stat.S_IMODE(after.st_mode) == 0o640
    assert listing(tmp_path) == ["out.json"]


def test_a_failing_writer_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    """When producing the bytes fails half-way, the path keeps its old contents and the
    temporary file is removed."""
    target = tmp_path / "out.npy"
    target.write_bytes(b"old")

    def half(f: io.BufferedIOBase) -> None:
        f.write(b"partial")
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        write_output(str(target), "--out", half)
    assert target.read_bytes() == b"old"
    assert listing(tmp_path) == ["out.npy"]


def test_json_and_json_lines(tmp_path: Path) -> None:
    """`write_json` writes one document, or one object per line."""
    write_json(str(tmp_path / "a.json"), "--output", {"x": [1, 2]})
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": [1, 2]}
    write_json(str(tmp_path / "b.jsonl"), "--details", [{"i": 0}, {"i": 1}], lines=True)
    lines = (tmp_path / "b.jsonl").read_text().splitlines()
    assert [json.loads(s) for s in lines] == [{"i": 0}, {"i": 1}]


def test_dash_writes_to_standard_output() -> None:
    """``-`` sends the bytes, unchanged (binary included), to standard output."""
    code = (
        "from estream_cli.output import write_output\n"
        "write_output('-', '--out', lambda f: f.write(bytes(range(256))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True)
    assert out.stdout == bytes(range(256))


def test_at_most_one_output_on_standard_output() -> None:
    """Two outputs cannot both be ``-``; one can."""
    assert stdout_claimed([("--a", "-"), ("--b", "x"), ("--c", None)]) is True
    assert stdout_claimed([("--a", "f"), ("--b", None)]) is False
    with pytest.raises(BadRequestError, match="only one output can be -"):
        stdout_claimed([("--a", "-"), ("--b", "-")])


def test_symlink_to_a_regular_file_replaces_the_target_and_keeps_the_link(tmp_path: Path) -> None:
    """A symbolic link to a regular file is followed: the file it names gets the new bytes and
    the link stays a link to it."""
    real = tmp_path / "real.json"
    real.write_bytes(b"old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_output(str(link), "--out", put)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_bytes() == PAYLOAD
    assert listing(tmp_path) == ["link.json", "real.json"]


# ------------------------------------------------------------------------------ what it refuses
def refused(path: Path | str, match: str) -> None:
    """Both the up-front check and the writer refuse `path` with one line, writing nothing."""
    with pytest.raises(BadRequestError, match=match) as exc:
        check_output(str(path), "--out")
    assert "\n" not in str(exc.value) and str(exc.value).startswith(f"--out {path}")
    with pytest.raises(BadRequestError, match=match):
        write_output(str(path), "--out", put)


def test_directory_is_refused(tmp_path: Path) -> None:
    """A directory at the path is neither replaced nor written into."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "keep").write_text("k")
    state = node_state(d)
    refused(d, "is a directory, not a regular file")
    assert node_state(d) == state and listing(d) == ["keep"] and listing(tmp_path) == ["d"]


def test_a_path_ending_in_a_slash_is_refused(tmp_path: Path) -> None:
    """``out.npy/`` names a directory: refused whether or not something is there, and no file
    ``out.npy`` appears (the slash is not dropped)."""
    refused(str(tmp_path / "out.npy") + "/", "ends in a slash")
    (tmp_path / "f").write_text("k")
    refused(str(tmp_path / "f") + "/", "ends in a slash")
    assert listing(tmp_path) == ["f"] and (tmp_path / "f").read_text() == "k"


def test_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    """A FIFO is refused (never opened: that would block with no reader) and stays a FIFO."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    state = node_state(fifo)
    refused(fifo, "is a FIFO")
    assert node_state(fifo) == state and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert listing(tmp_path) == ["pipe"]


def test_device_node_is_refused(tmp_path: Path) -> None:
    """A character device is refused and keeps its type and device number. As root the node is
    a private copy of /dev/null (same device number) that a bug could replace harmlessly;
    otherwise /dev/null itself, which a non-root user could not replace anyway."""
    if IS_ROOT:
        dev = tmp_path / "null"
        os.mknod(dev, stat.S_IFCHR | 0o666, os.stat("/dev/null").st_rdev)
    else:
        dev = Path("/dev/null")
    state = node_state(dev)
    refused(dev, "is a character device")
    assert node_state(dev) == state and stat.S_ISCHR(os.lstat(dev).st_mode)
    if IS_ROOT:
        assert listing(tmp_path) == ["null"]


def test_symlink_to_dev_null_is_refused(tmp_path: Path) -> None:
    """A link to /dev/null is refused: neither the link nor /dev/null is replaced."""
    null_before = dev_null_state()
    link = tmp_path / "logits.npy"
    link.symlink_to("/dev/null")
    refused(link, r"is a character device \(through the link to /dev/null\)")
    assert link.is_symlink() and os.readlink(link) == "/dev/null"
    assert dev_null_state() == null_before
    assert listing(tmp_path) == ["logits.npy"]


def test_dangling_or_looping_links_and_missing_directories_are_refused(tmp_path: Path) -> None:
    """A link into a missing directory, a link loop and a path in a missing directory are each
    one clear error; nothing is created."""
    (tmp_path / "dangle").symlink_to(tmp_path / "nowhere" / "x")
    refused(tmp_path / "dangle", "ends nowhere writable")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    refused(tmp_path / "loop", "ends nowhere writable")
    refused(tmp_path / "missing" / "o.json", "does not exist")
    assert listing(tmp_path) == ["dangle", "loop"]


READ_ONLY_PROBE = """
import os, sys
from estream.errors import BadRequestError
from estream_cli.output import write_output
for name in ("new.json", "old.json"):
    try:
        write_output(os.path.join(sys.argv[1], name), "--out", lambda f: f.write(b"x"))
    except BadRequestError as exc:
        print(exc)
    else:
        print("written")
"""


def _drop_dac_override() -> None:
    """In the child, before exec: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the
    bounding set, so root's program obeys file permissions like any user's."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_read_only_directory_is_one_error_per_path(tmp_path: Path) -> None:
    """In a directory the user cannot write, a new path and an existing file are each one
    "cannot write" error, and the directory is unchanged. As root (whom permissions do not
    stop) the writer runs in a child process without the capability to override them."""
    d = tmp_path / "ro"
    d.mkdir()
    (d / "old.json").write_bytes(b"old")
    d.chmod(0o555)
    try:
        out = subprocess.run(
            [sys.executable, "-c", READ_ONLY_PROBE, str(d)],
            capture_output=True,
            text=True,
            check=True,
            preexec_fn=_drop_dac_override if IS_ROOT else None,
        )
    finally:
        d.chmod(0o755)
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out
    assert lines[0] == f"--out {d}/new.json: cannot write (Permission denied)"
    assert lines[1] == f"--out {d}/old.json: cannot write (Permission denied)"
    assert listing(d) == ["old.json"] and (d / "old.json").read_bytes() == b"old"


# ------------------------------------------------------------------------------ the commands
@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("out")
    synth_model("olmoe", "tiny", d / "m.gguf", seed=3)
    pack_model(d / "m.gguf", d / "m.estream", progress=False)
    return d / "m.estream"


def test_prefill_refuses_dev_null_link_and_fifo_before_loading(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`estream prefill --all-logits LINK-TO-/dev/null` and `--trace FIFO` are one error line,
    exit 2, nothing on stdout, /dev/null and the FIFO untouched."""
    null_before = dev_null_state()
    link = tmp_path / "l.npy"
    link.symlink_to("/dev/null")
    fifo = tmp_path / "t.json"
    os.mkfifo(fifo)
    for option, path, kind in (
        ("--all-logits", link, "character device"),
        ("--trace", fifo, "FIFO"),
        ("--all-logits", "/dev/null", "character device"),
    ):
        rc = main(["prefill", str(model), "--tokens", "1,2", option, str(path)])
        out, err = capsys.readouterr()
        assert rc == 2 and out == "", (option, path)
        assert err.count("\n") == 1 and f"{option} {path}" in err and kind in err
        assert "Traceback" not in err
    assert dev_null_state() == null_before
    assert link.is_symlink() and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert listing(tmp_path) == ["l.npy", "t.json"]


def test_prefill_all_logits_to_standard_output(model: Path) -> None:
    """`--all-logits -` puts the .npy bytes alone on stdout and moves the report to stderr."""
    cmd = [sys.executable, "-m", "estream_cli.main", "prefill", str(model), "--tokens", "5,6,7"]
    out = subprocess.run([*cmd, "--all-logits", "-", "--json"], capture_output=True, check=True)
    logits = np.load(io.BytesIO(out.stdout))
    assert logits.dtype == np.float32 and logits.shape[0] == 3
    report = json.loads(out.stderr[out.stderr.index(b"{") :])
    assert report["top_k"][0]["id"] == int(np.argmax(logits[-1]))
    both = subprocess.run([*cmd, "--all-logits", "-", "--trace", "-"], capture_output=True)
    assert both.returncode == 2 and b"only one output can be -" in both.stderr


def test_eval_and_config_outputs_go_through_the_writer(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`estream eval ... --output FIFO`, `--details DIR` and `estream config --plot DIR` are
    refused with one line before any work."""
    text = tmp_path / "t.txt"
    text.write_text("hello world " * 20)
    fifo = tmp_path / "o.json"
    os.mkfifo(fifo)
    ev = ["eval", "perplexity", str(model), "--text-file", str(text), "--ctx", "8"]
    rc = main([*ev, "--output", str(fifo)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and f"--output {fifo}: is a FIFO" in err
    rc = main(["eval", "cloze", str(model), "--text-file", str(text), "--details", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and f"--details {tmp_path}: is a directory" in err
    rc = main(["config", str(model), "--budget", "1GiB", "--plot", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and f"--plot {tmp_path}: is a directory" in err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def _interrupt_on_making(monkeypatch: pytest.MonkeyPatch, call: str, part: str) -> list[str]:
    """`os.<call>` (open or mkdir) raises KeyboardInterrupt right after it made a path whose
    name holds `part`, as a Ctrl-C landing just as the call returns would; the paths made."""
    real = getattr(os, call)
    made: list[str] = []

    def interrupted(path, *args, **kwargs):
        result = real(path, *args, **kwargs)
        if part in os.path.basename(os.fspath(path)):
            made.append(os.fspath(path))
            if call == "open":
                os.close(result)
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(os, call, interrupted)
    return made


def test_an_interrupt_as_the_temporary_is_made_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C the moment the output's temporary file is made: the temporary is removed and
    the target is as it was (the Parquet output's directory: tests_ray)."""
    target = tmp_path / "out.json"
    target.write_bytes(b"old\n")
    made = _interrupt_on_making(monkeypatch, "open", ".tmp")
    with pytest.raises(KeyboardInterrupt):
        write_output(str(target), "--output", put)
    assert len(made) == 1
    assert listing(tmp_path) == ["out.json"] and target.read_bytes() == b"old\n"


def test_a_demo_interrupted_as_its_directory_is_made_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`estream demo` without --dir works in a directory of its own under the temporary
    directory: a Ctrl-C the moment it is made ends the command (status 130) and removes it."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = _interrupt_on_making(monkeypatch, "mkdir", "estream-demo-")
    rc = main(["demo", "--tokens", "16"])
    capsys.readouterr()
    assert rc == 130 and len(made) == 1
    assert listing(tmp_path) == []
