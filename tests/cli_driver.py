"""Running the `moe-offload` command line in-process, as the tests of its answers and refusals do."""

from __future__ import annotations

from moe_offload.cli.main import main


def run(capsys, *argv) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``moe-offload ARGV``; argparse's own errors exit, and count."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_refused(code: int, err: str, *fragments) -> None:
    """A refusal: exit code 2 and one line that names each of ``fragments``, never a traceback."""
    assert code == 2, err
    assert err.startswith("moe-offload") and err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert str(fragment) in err, err
