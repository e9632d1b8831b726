"""Driving mpo's command lines in tests as a user would, and reading what they print."""

from __future__ import annotations


def run_main(capsys, module: str, *args: str) -> tuple[int, str]:
    """`python -m MODULE ARGS`'s `main(argv)` in this process (what `python -m` calls; an escaping exception fails the
    test, as a traceback would): (exit status, stderr). Starting an interpreter per case cost ~10 s on the CI box."""
    from checkpoints_tools.cli import main as converter_main
    from mpo.cli import main as mpo_main

    main = {"checkpoints_tools": converter_main, "mpo.cli": mpo_main}[module]
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    return code, capsys.readouterr().err


def one_line(stderr: str) -> str:
    """The one non-empty line of `stderr`, which holds no traceback (asserted)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr
    return lines[0]
