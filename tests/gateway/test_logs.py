"""The gateway's log handler writes to the sys.stderr of the moment, so replacing sys.stderr
(a test's capture, a redirect) never leaves logging writing to a closed file."""
import io
import logging
import sys

from switchyard.gateway.logs import configure_logging


def test_logs_follow_sys_stderr_when_it_is_replaced(monkeypatch):
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    first, second = io.StringIO(), io.StringIO()
    try:
        monkeypatch.setattr(sys, "stderr", first)
        configure_logging(json_output=False)
        logging.getLogger("switchyard.test").info("one")
        first.close()  # as a finished capture closes its stream
        monkeypatch.setattr(sys, "stderr", second)
        logging.getLogger("switchyard.test").info("two")
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    assert "switchyard.test: two" in second.getvalue() and "Logging error" not in second.getvalue()
