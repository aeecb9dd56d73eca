"""The example controllers' SessionDriver.expect, over a real pipe: a failed expect says why it
gave up (the attachment's output ended, or the time ran out), so a lost prompt in a report
tells the two apart."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples/controller/context"))
import reploy_driver  # noqa: E402


def reading(driver: reploy_driver.SessionDriver) -> int:
    """A pipe whose read end the driver reads as its terminal; the write end."""
    read_fd, write_fd = os.pipe()
    threading.Thread(target=driver._read_output, args=(read_fd,), daemon=True).start()
    return write_fd


def test_an_expect_matches_output_as_it_comes() -> None:
    driver = reploy_driver.SessionDriver()
    write_fd = reading(driver)
    os.write(write_fd, b"one $ ")
    assert driver.expect(rb"\$ ").group() == b"$ "
    os.close(write_fd)


def test_an_expect_that_meets_the_end_of_output_says_so() -> None:
    driver = reploy_driver.SessionDriver(timeout_s=3600)
    write_fd = reading(driver)
    os.write(write_fd, b"killall httpd\r\n")
    os.close(write_fd)
    with pytest.raises(reploy_driver.SessionFailed, match=r"\(the attachment's output ended\); "
                                                          r"last bytes: b'killall httpd\\r\\n'"):
        driver.expect(rb"rec\$ ")


def test_an_expect_that_runs_out_of_time_says_so() -> None:
    driver = reploy_driver.SessionDriver()
    write_fd = reading(driver)
    os.write(write_fd, b"no prompt")
    with pytest.raises(reploy_driver.SessionFailed, match=r"\(not within 0.2 s\)"):
        driver.expect(rb"rec\$ ", timeout_s=0.2)
    os.close(write_fd)
