"""Structured logs: `key=value` text on a terminal, one JSON object per line with
--json-output (TGI's flag), for uvicorn's loggers too."""
from __future__ import annotations

import json
import logging
import sys
import time


class StderrHandler(logging.StreamHandler):
    """A StreamHandler that writes to whatever sys.stderr is when a record is emitted (as
    logging's own last-resort handler does), not to the stream sys.stderr was when the handler
    was made: a process that replaces sys.stderr (a test's capture, a daemon's redirect) never
    leaves the handler writing to a closed file."""

    def __init__(self, level: int = logging.NOTSET):
        logging.Handler.__init__(self, level)

    @property
    def stream(self):
        return sys.stderr


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "target": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _formatter(json_output: bool) -> dict:
    if json_output:
        return {"()": "switchyard.gateway.logs.JsonFormatter"}
    return {"format": TEXT_FORMAT}


def configure_logging(json_output: bool, level: int = logging.INFO) -> None:
    handler = StderrHandler()
    handler.setFormatter(JsonFormatter() if json_output else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def uvicorn_log_config(json_output: bool) -> dict:
    """uvicorn's loggers through the same formatter."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"default": _formatter(json_output)},
        "handlers": {"default": {"class": "switchyard.gateway.logs.StderrHandler", "formatter": "default"}},
        "loggers": {
            "uvicorn": {"handlers": ["default"], "level": "INFO", "propagate": False},
            "uvicorn.error": {"level": "INFO"},
            "uvicorn.access": {"handlers": ["default"], "level": "INFO", "propagate": False},
        },
    }
