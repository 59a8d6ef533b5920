"""`doctor` run in this process, as the command line runs it: its exit code and what it printed."""

import pytest

from lightning_hetero.__main__ import main


def run_doctor(args: list, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main(["doctor", *args])
        raise SystemExit(0)
    said = capsys.readouterr()
    return exited.value.code or 0, said.out, said.err
