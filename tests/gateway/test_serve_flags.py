"""`switchyard serve` flags: TGI's names, environment variables and defaults, mapped
onto EngineConfig and ServerSettings."""
from __future__ import annotations

import pytest

from switchyard.core.config import GrammarConfig
from switchyard.core.params import ValidationError
from switchyard.gateway.cli import build_parser
from switchyard.gateway.serve import engine_config, server_settings


def _parse(argv=(), environ=None):
    return build_parser(environ or {}).parse_args(["serve", *argv])


def test_defaults_are_tgis_where_they_apply():
    args = _parse()
    settings = server_settings(args)
    assert (settings.hostname, settings.port) == ("127.0.0.1", 8080)
    assert (settings.max_concurrent_requests, settings.max_best_of, settings.max_stop_sequences,
            settings.max_top_n_tokens, settings.max_client_batch_size, settings.payload_limit) == (
        128, 2, 4, 5, 4, 2_000_000)
    config = engine_config(args)
    assert config.model.model is None and config.graph_batch_sizes is None
    assert config.compile_decode  # a server compiles its decode steps; the library default is eager
    assert config.cache.memory_fraction is None  # the backend's own default


def test_environment_variables_are_flag_defaults_and_flags_win():
    environ = {"MODEL_ID": "/models/x", "PORT": "9000", "MAX_CONCURRENT_REQUESTS": "7", "MAX_INPUT_LENGTH": "100",
               "MAX_TOTAL_TOKENS": "200", "API_KEY": "k", "JSON_OUTPUT": "true", "CUDA_GRAPHS": "0",
               "CORS_ALLOW_ORIGIN": "http://a,http://b", "HOSTNAME": "container-name"}
    args = _parse(["--port", "9100"], environ)
    settings = server_settings(args)
    assert settings.port == 9100 and settings.max_concurrent_requests == 7
    assert (settings.max_input_tokens, settings.max_total_tokens) == (100, 200)
    assert settings.api_key == "k" and settings.json_output and settings.cors_allow_origin == ("http://a", "http://b")
    assert settings.hostname == "127.0.0.1"  # HOSTNAME is the machine's name in shells and containers
    config = engine_config(args)
    assert config.model.model == "/models/x" and config.model.max_model_len == 200
    assert config.graph_batch_sizes == ()


def test_batch_flags_map_onto_the_scheduler_and_the_kv_cache():
    args = _parse(["--max-batch-total-tokens", "1000", "--max-batch-prefill-tokens", "512",
                   "--max-batch-size", "8", "--cuda-memory-fraction", "0.8", "--cuda-graphs", "1,2,4,8"])
    config = engine_config(args)
    assert config.cache.num_blocks == 1000 // 16 + 1  # whole blocks within 1000 tokens + the reserved block
    assert config.scheduler.max_num_batched_tokens == 512 and config.scheduler.max_num_seqs == 8
    assert config.cache.memory_fraction == 0.8 and config.graph_batch_sizes == (1, 2, 4, 8)


def test_enforce_eager_turns_off_every_kind_of_decode_graph():
    config = engine_config(_parse(["--enforce-eager", "--cuda-graphs", "1,2"]))
    assert not config.compile_decode and config.graph_batch_sizes == ()
    assert not engine_config(_parse([], {"ENFORCE_EAGER": "1"})).compile_decode


def test_dtype_defaults_to_the_backends_choice_and_quantize_reaches_the_engine():
    config = engine_config(_parse(["--quantize", "int8"]))
    assert config.model.dtype == "auto" and config.model.quantize == "int8"  # checked by capabilities.py


def test_the_engine_process_runs_tuned_unless_plain_is_asked():
    assert engine_config(_parse()).runtime == "tuned"
    assert engine_config(_parse(["--runtime", "plain"])).runtime == "plain"
    with pytest.raises(SystemExit) as exit_info:  # argparse: one usage line, exit 2
        _parse(["--runtime", "fast"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize("argv", [["--num-shard", "0"], ["--sharded"], ["--cuda-graphs", "one,two"]])
def test_what_cannot_be_honoured_is_refused(argv):
    with pytest.raises(ValidationError):
        engine_config(_parse(argv))


def test_max_batch_total_tokens_is_never_exceeded():
    for total in (16, 1000, 1024):
        config = engine_config(_parse(["--max-batch-total-tokens", str(total)]))
        capacity = (config.cache.num_blocks - 1) * config.cache.block_size
        assert total - config.cache.block_size < capacity <= total
    with pytest.raises(ValidationError):
        engine_config(_parse(["--max-batch-total-tokens", "15"]))  # not one block


def test_prefix_caching_is_on_unless_disabled():
    assert engine_config(_parse()).cache.enable_prefix_caching
    assert not engine_config(_parse(["--disable-prefix-caching"])).cache.enable_prefix_caching
    assert not engine_config(_parse(environ={"DISABLE_PREFIX_CACHING": "1"})).cache.enable_prefix_caching


def test_waiting_served_ratio_and_max_waiting_tokens_reach_the_scheduler():
    scheduler = engine_config(_parse()).scheduler
    assert (scheduler.waiting_served_ratio, scheduler.max_waiting_tokens) == (0.3, 20)  # TGI's defaults
    scheduler = engine_config(_parse(["--waiting-served-ratio", "1.2"], {"MAX_WAITING_TOKENS": "5"})).scheduler
    assert (scheduler.waiting_served_ratio, scheduler.max_waiting_tokens) == (1.2, 5)


def test_grammar_backend_reaches_the_engine_config():
    assert engine_config(_parse()).grammar.backend == "xgrammar"
    assert engine_config(_parse(["--grammar-backend", "outlines"])).grammar.backend == "outlines"
    assert engine_config(_parse(environ={"GRAMMAR_BACKEND": "outlines"})).grammar.backend == "outlines"
    with pytest.raises(ValidationError):
        engine_config(_parse(["--grammar-backend", "lark"]))


def test_grammar_limits_reach_the_engine_config():
    assert engine_config(_parse()).grammar == GrammarConfig()
    grammar = engine_config(_parse(["--grammar-max-spec-bytes", "1000", "--grammar-compile-timeout", "2.5",
                                    "--grammar-cache-bytes", "9000000", "--grammar-workers", "2"],
                                   {"GRAMMAR_MAX_COMPILED_BYTES": "4000000"})).grammar
    assert (grammar.max_spec_bytes, grammar.compile_timeout_s, grammar.cache_bytes, grammar.num_compile_workers,
            grammar.max_grammar_bytes) == (1000, 2.5, 9_000_000, 2, 4_000_000)


def test_shard_flags_and_the_rendezvous_environment_reach_the_parallel_config():
    parallel = engine_config(_parse(["--num-shard", "4", "--sharded", "--nnodes", "2", "--node-rank", "1",
                                     "--master-addr", "10.0.0.7", "--master-port", "29600"])).parallel
    assert (parallel.tensor_parallel_size, parallel.nnodes, parallel.node_rank) == (4, 2, 1)
    assert (parallel.master_addr, parallel.master_port) == ("10.0.0.7", 29600)
    env = {"NUM_SHARD": "2", "WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "1234"}
    parallel = engine_config(_parse(environ=env)).parallel
    assert (parallel.tensor_parallel_size, parallel.nnodes, parallel.node_rank) == (2, 2, 1)
    assert (parallel.master_addr, parallel.master_port) == ("node0", 1234)
    parallel = engine_config(_parse(environ=dict(env, NNODES="1", NODE_RANK="0"))).parallel
    assert (parallel.nnodes, parallel.node_rank) == (1, 0)  # NNODES / NODE_RANK win
    assert engine_config(_parse()).parallel.tensor_parallel_size == 1


def test_seed_reaches_the_sampler_of_unseeded_requests():
    assert engine_config(_parse()).sampling_seed is None  # a random seed at each start
    assert engine_config(_parse(["--seed", "7"])).sampling_seed == 7
    assert engine_config(_parse([], {"SEED": "9"})).sampling_seed == 9
