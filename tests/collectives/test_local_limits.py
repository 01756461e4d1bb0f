"""A local launch this machine's limits cannot hold is refused before any rank starts, in one line (exit 2 on the
command line); an interrupted start leaves no AssertionError behind.

Found by asking ``moonep bench collectives --world-size 100000``: it started processes for minutes, and the
SIGTERM that ended it surfaced as ``AssertionError: can only join a started process`` from the clean-up.
"""

from __future__ import annotations

import multiprocessing
import resource
from contextlib import contextmanager

import pytest

from collectives import cli
from collectives.launch_spawn import _terminate, check_local_limits
from moonep_base import UsageError, build_parser, run


@contextmanager
def open_files_limit(soft: int):
    """This process's soft RLIMIT_NOFILE lowered to ``soft`` (no file is opened meanwhile), then restored."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


def test_more_ranks_than_open_files_are_refused_naming_the_limit():
    """gloo connects every pair: each rank holds a socket per peer, so 300 ranks under a 256-file limit cannot
    rendezvous; 100 can (and nothing here starts them)."""
    with open_files_limit(256):
        with pytest.raises(UsageError, match=r"world_size 300: .* open files per process, more than .* 256"):
            check_local_limits(300)
        check_local_limits(100)


def test_the_command_line_says_it_in_one_line_and_starts_nothing(capsys):
    """The refusal comes before the first rank is started (an unmarked test that starts one fails: conftest)."""
    with open_files_limit(256):
        rc = run(build_parser([cli.register], "collectives"), ["bench", "collectives", "--world-size", "300"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("error: world_size 300: ") and "`ulimit -n`" in err


def test_ranks_never_started_are_skipped_by_the_clean_up():
    """A start loop cut short (SIGTERM while starting 100,000 ranks) leaves unstarted processes to clean up."""
    unstarted = [multiprocessing.get_context("spawn").Process(target=print) for _ in range(3)]
    _terminate(unstarted, grace_s=0.1)
    assert all(p.pid is None and p.exitcode is None for p in unstarted)
