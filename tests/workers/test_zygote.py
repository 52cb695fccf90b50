"""The zygote's other way to start a worker, the one a GPU machine takes (where its preload started
CUDA): a fresh interpreter exec'd in the fork, with the same files and exit code as a forked child.
The forked way is what every test of ``test_collaborative.py`` uses."""

from __future__ import annotations


def test_an_execd_child_writes_to_its_files_and_exits_with_its_own_code(tmp_path, execing_zygote):
    helped = execing_zygote.fork(["--help"], stdout=tmp_path / "help.out", stderr=tmp_path / "help.err",
                                 cwd=tmp_path)
    refused = execing_zygote.fork(["no-such-command"], stdout=tmp_path / "bad.out", stderr=tmp_path / "bad.err",
                                  cwd=tmp_path)
    assert helped.wait(timeout=60) == 0
    assert (tmp_path / "help.out").read_text().startswith("usage: ")
    assert refused.wait(timeout=60) == 2  # argparse's exit code, from the exec'd interpreter
    assert "invalid choice: 'no-such-command'" in (tmp_path / "bad.err").read_text()
