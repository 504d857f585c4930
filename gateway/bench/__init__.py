"""`switchyard bench serve`: a side-by-side benchmark of OpenAI-compatible servers.

Streaming `/v1/chat/completions` clients at a list of concurrencies, a forced output
length and a fixed prompt set, so that runs against different servers (ours, llama.cpp's
llama-server, vLLM) compare. Imports no torch: it runs in the gateway's layer.

- workload.py: the fixed prompts, the servers to drive and the request bodies
- loadgen.py: the async streaming client (one record per request)
- figures.py: percentiles and one run's figures (RunResult)
- progress.py: a tqdm bar, or a plain line without tqdm
- memory.py: a local server's peak RSS (VmHWM of its process tree, from /proc)
- report.py: the comparison table and the JSON-lines results file
- plot.py: PNGs with matplotlib (the `bench` extra)
- command.py: the command line and the order of runs
"""
