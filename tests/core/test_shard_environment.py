"""core/shards/group.py gives each shard process its environment at its start (issue 38): the
backend's variables for that shard and the rendezvous variables reach the child, and the
parent's os.environ is never written, during the spawn or after, so no other thread of the
engine sees them. The shards' target is this module's, which imports nothing heavy."""
from __future__ import annotations

import json
import os
from collections.abc import MutableMapping
from pathlib import Path

from switchyard.core.backend_contract import ShardInfo
from switchyard.core.shards.group import ProcessShardLauncher

SEEN = ("SWITCHYARD_TEST_SHARD_VAR", "SWITCHYARD_TEST_INHERITED", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")


class _WatchedEnviron(MutableMapping):
    """os.environ as the launcher sees it: reads and writes go to the real one; writes are
    recorded."""

    def __init__(self, real):
        self.real = real
        self.writes: list[tuple[str, str]] = []

    def __getitem__(self, key):
        return self.real[key]

    def __setitem__(self, key, value):
        self.writes.append(("set", key))
        self.real[key] = value

    def __delitem__(self, key):
        self.writes.append(("delete", key))
        del self.real[key]

    def __iter__(self):
        return iter(self.real)

    def __len__(self):
        return len(self.real)

    def copy(self):
        return dict(self.real)


def _report_environment(shard: ShardInfo, out_dir: str) -> None:
    (Path(out_dir) / f"{shard.rank}.json").write_text(json.dumps({name: os.environ.get(name) for name in SEEN}))


def test_a_shard_gets_its_environment_and_the_parents_is_never_written(tmp_path, monkeypatch):
    monkeypatch.setenv("SWITCHYARD_TEST_INHERITED", "from the parent")
    monkeypatch.delenv("SWITCHYARD_TEST_SHARD_VAR", raising=False)
    before = dict(os.environ)
    watched = _WatchedEnviron(os.environ)
    monkeypatch.setattr(os, "environ", watched)
    shards = [ShardInfo(rank, 3, rank, "127.0.0.1", 29999, 3) for rank in (1, 2)]
    launcher = ProcessShardLauncher(env_for=lambda shard: {"SWITCHYARD_TEST_SHARD_VAR": f"shard {shard.rank}"})
    group = launcher.start(shards, _report_environment, (str(tmp_path),))
    try:
        assert watched.writes == []  # not even set and restored around the spawn
        assert group.wait(120) and group.failure() is None
    finally:
        group.stop()
    assert watched.writes == [] and dict(watched.real) == before
    for rank in (1, 2):
        seen = json.loads((tmp_path / f"{rank}.json").read_text())
        assert seen == {"SWITCHYARD_TEST_SHARD_VAR": f"shard {rank}", "SWITCHYARD_TEST_INHERITED": "from the parent",
                        "RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank), "MASTER_PORT": "29999"}
