"""The grammar compile workers' life (issue 38): on which CPUs they run and how many there are
when the engine's main thread is bound to one core (core/grammar/placement.py), a worker that
dies while idle (replaced before a request meets it, core/grammar/executors.py), a compile
timeout the server caused (a 503, not the schema's 400: service.timeout_error), and a quiet
shutdown. Real worker processes with a portable fake compiler (grammar_fakes.py): seconds."""
import asyncio
import gc
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from grammar_fakes import EchoCompiler

from switchyard.core.engine.client import ChannelEngineClient
from switchyard.core.config import GrammarConfig, default_compile_workers
from switchyard.core.engine.messages import CompileGrammar, Settled
from switchyard.core.grammar import GrammarCompileService, GrammarError, GrammarSpec, GrammarUnavailable
from switchyard.core.grammar import executors

HERE = Path(__file__).resolve().parent
CPUS = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
needs_two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="binding to one core needs two CPUs")


@pytest.fixture
def workers_import_fakes(monkeypatch):
    """Worker processes can unpickle grammar_fakes' compiler."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))


def _on_one_core(fn):
    """fn() in a thread bound to one CPU, as a CPU engine's OpenMP binds its main thread (the
    threads and processes that thread starts inherit the one-core mask)."""
    box = []

    def bound():
        os.sched_setaffinity(0, {min(CPUS)})
        try:
            box.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            box.append(exc)

    thread = threading.Thread(target=bound)
    thread.start()
    thread.join(120)
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _wait_for(condition, within_s: float = 60.0, what: str = ""):
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _process_service(**config) -> GrammarCompileService:
    config = {"num_compile_workers": 1, "spare_max_spec_bytes": 0, **config}
    return GrammarCompileService(EchoCompiler, GrammarConfig(**config))


# -- 1. the CPUs: the machine's, not the bound thread's ------------------------------------------
@needs_two_cpus
def test_the_default_worker_count_is_not_taken_from_a_thread_bound_to_one_core():
    assert _on_one_core(default_compile_workers) == min(2, len(CPUS)) == 2
    assert _on_one_core(lambda: GrammarConfig().compile_workers) == 2
    assert _on_one_core(lambda: GrammarCompileService(EchoCompiler).compile_workers) == 2  # what it starts


def test_an_engine_given_its_cpus_sizes_and_places_its_workers_on_them():
    service = GrammarCompileService(EchoCompiler, cpus=(3,))
    assert service.cpus == {3} and service.compile_workers == 1
    assert GrammarCompileService(EchoCompiler, GrammarConfig(num_compile_workers=3), cpus=(3,)).compile_workers == 3


def test_offered_cpus_are_the_cgroup_cpuset_among_the_online_cpus(tmp_path):
    from switchyard.core.grammar import placement

    def write(path, text):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)

    write("sys/devices/system/cpu/online", "0-7\n")
    write("proc/self/cgroup", "0::/machine/serve.service\n")
    assert placement.offered_cpus(str(tmp_path)) == set(range(8))  # no cpuset anywhere: the online CPUs
    write("sys/fs/cgroup/machine/cpuset.cpus.effective", "2-3,6,9\n")  # the parent's, the service has none
    assert placement.offered_cpus(str(tmp_path)) == {2, 3, 6}
    write("proc/self/cgroup", "4:cpu,cpuacct:/\n3:cpuset:/box\n0::/\n")  # cgroup v1
    write("sys/fs/cgroup/cpuset/box/cpuset.effective_cpus", "1,5\n")
    assert placement.offered_cpus(str(tmp_path)) == {1, 5}


def test_a_worker_starts_without_the_engine_s_thread_binding():
    from switchyard.core.grammar import placement

    env = placement.worker_environment({"KMP_AFFINITY": "granularity=fine,proclist=[0,1],explicit",
                                        "OMP_PROC_BIND": "close", "OMP_PLACES": "{0},{1}", "OMP_NUM_THREADS": "2",
                                        "LD_PRELOAD": "libiomp5.so", "HOME": "/root"})
    assert env == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "LD_PRELOAD": "libiomp5.so", "HOME": "/root"}


@needs_two_cpus
def test_a_worker_started_from_a_bound_thread_runs_on_every_cpu_and_openmp_does_not_warn(
        workers_import_fakes, monkeypatch, capfd):
    """As a tuned CPU engine starts it: Intel OpenMP preloaded (where the wheel is installed) and
    bound to the engine's cores, from a thread bound to the first of them."""
    from switchyard.backends.cpu.runtime import find_intel_openmp

    iomp = find_intel_openmp()
    if iomp is not None:
        monkeypatch.setenv("LD_PRELOAD", iomp.path)
    monkeypatch.setenv("KMP_AFFINITY", f"granularity=fine,proclist=[{','.join(map(str, sorted(CPUS)))}],explicit")
    service = _process_service()
    try:
        assert _on_one_core(lambda: service.compile(GrammarSpec.regex("omp")).result(120)).value == "omp"
        pid, = service.worker_pids
        assert os.sched_getaffinity(pid) == CPUS
        assert "OMP: Warning" not in capfd.readouterr().err
    finally:
        service.shutdown()


# -- 2. a worker that dies while idle -------------------------------------------------------------
def test_a_worker_that_dies_while_idle_is_replaced_before_any_request(workers_import_fakes):
    service = _process_service()
    try:
        service.compile(GrammarSpec.regex("first")).result(120)
        pid, = service.worker_pids
        os.kill(pid, signal.SIGKILL)
        _wait_for(lambda: service.worker_pids not in ([], [pid]), what="no fresh worker replaced the dead one")
        fresh, = service.worker_pids
        assert os.sched_getaffinity(fresh)  # alive
        assert service.compile(GrammarSpec.regex("second")).result(120).value == "second"
        assert service.worker_pids == [fresh]
    finally:
        service.shutdown()


def test_a_request_that_meets_a_dead_worker_is_compiled_on_a_fresh_one(workers_import_fakes, monkeypatch):
    """Its watcher not (yet) having replaced it: the request must not see the broken pipe."""
    monkeypatch.setattr(executors.ProcessExecutor, "_watch", lambda self, process: None, raising=False)
    service = _process_service()
    try:
        service.compile(GrammarSpec.regex("first")).result(120)
        pid, = service.worker_pids
        os.kill(pid, signal.SIGKILL)
        _wait_for(lambda: not _running(pid), what="the killed worker did not end")
        assert service.compile(GrammarSpec.regex("second")).result(120).value == "second"
        assert service.worker_pids not in ([], [pid])
    finally:
        service.shutdown()


def test_a_worker_that_ends_between_the_check_and_the_send_is_replaced_too(workers_import_fakes, monkeypatch):
    monkeypatch.setattr(executors.ProcessExecutor, "_watch", lambda self, process: None, raising=False)
    executor = executors.ProcessExecutor(EchoCompiler(), GrammarConfig(), CPUS)
    try:
        executor.prestart()
        pid = executor.pid
        os.kill(pid, signal.SIGKILL)
        _wait_for(lambda: not _running(pid), what="the killed worker did not end")
        monkeypatch.setattr(executors, "_alive", lambda process, conn: process.pid == pid)  # seen alive
        assert executor.run(GrammarSpec.regex("x"), 60).value == "x" and executor.pid != pid
    finally:
        executor.shutdown()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# -- 4. a timeout the server caused --------------------------------------------------------------
def test_a_compile_the_busy_server_starved_past_its_limit_is_the_server_s_503(workers_import_fakes):
    """The worker waits (a compile that gets no CPU, as a niced worker behind the engine's
    steps): killed at the limit, it is GrammarUnavailable (503), not the schema's 400."""
    service = _process_service(compile_timeout_s=0.5)
    try:
        service.compile(GrammarSpec.regex("up")).result(120)
        with pytest.raises(GrammarUnavailable, match="took longer than 0.5 s, this server being too busy") as info:
            service.compile(GrammarSpec.regex("sleep:30")).result(60)
        assert info.value.param == "grammar" and GrammarSpec.regex("sleep:30") not in service
    finally:
        service.shutdown()


def test_the_timeout_s_blame_is_decided_by_the_cpu_the_compile_had():
    from switchyard.core.grammar.service import timeout_error

    spec = GrammarSpec.json_schema({"type": "object"})
    heavy = timeout_error(spec, 30.0, 29.0)  # a core all along: the schema is too heavy
    assert isinstance(heavy, GrammarError) and not isinstance(heavy, GrammarUnavailable)
    assert heavy.param == "response_format" and "took longer than 30 s" in str(heavy)
    assert not isinstance(timeout_error(spec, 30.0, 15.0), GrammarUnavailable)
    assert isinstance(timeout_error(spec, 30.0, 14.9), GrammarUnavailable)  # less than half a core: the server's
    assert isinstance(timeout_error(spec, 30.0, 0.0), GrammarUnavailable)
    assert not isinstance(timeout_error(spec, 30.0, None), GrammarUnavailable)  # unknown: as before, the schema's


def test_a_thread_compile_that_had_the_cpu_stays_the_schema_s_error(monkeypatch):
    class Slow(EchoCompiler):
        portable = False  # compiled in a thread of this process

    monkeypatch.setattr(executors, "cpu_seconds", lambda path: 9.0)  # it had the CPU all along
    service = GrammarCompileService(Slow, GrammarConfig(compile_timeout_s=0.2, num_compile_workers=1))
    try:
        error = service.compile(GrammarSpec.regex("sleep:1")).exception(10)
        assert isinstance(error, GrammarError) and not isinstance(error, GrammarUnavailable)
        assert "took longer than 0.2 s" in str(error)
    finally:
        service.shutdown()


# -- 5. a quiet shutdown --------------------------------------------------------------------------
class _Channel:
    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)


class _Client(ChannelEngineClient):
    def _open(self):
        return _Channel()

    def _ended(self, wait_s=0.0):
        return None

    def _close(self, timeout):
        pass


def test_a_compile_whose_caller_left_fails_at_shutdown_without_a_never_retrieved_log():
    """A request that went away (a client gone, a drain's deadline) while its grammar waited;
    then the engine stops and the compile fails with GrammarUnavailable."""
    async def main():
        loop = asyncio.get_running_loop()
        logged = []
        loop.set_exception_handler(lambda loop, context: logged.append(context["message"]))
        client = _Client()
        client._channel = _Channel()
        client._ready.set()
        caller = asyncio.create_task(client.compile_grammar(GrammarSpec.regex("[a-z]+")))
        await asyncio.sleep(0)
        caller.cancel()
        await asyncio.gather(caller, return_exceptions=True)
        command, = client._channel.sent
        assert isinstance(command, CompileGrammar)
        client._handle(Settled(command.token, GrammarUnavailable("the grammar compiler was shut down", "grammar")))
        await asyncio.sleep(0.05)  # the settle, then its callbacks
        gc.collect()
        return logged

    assert asyncio.run(main()) == []
