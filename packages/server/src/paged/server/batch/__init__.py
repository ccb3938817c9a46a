"""`paged run-batch`: OpenAI Batch files through the engine, as `vllm run-batch`.

protocol.py   the line formats: BatchRequestInput in, BatchRequestOutput out
endpoints.py  the dispatch table: url -> request model + handler (chat, completions)
runner.py     run the lines concurrently, write the outputs in input order
files.py      the input and output files: local paths or http(s) URLs
engine.py     the engine and OpenAIServing behind it (the flags of `paged serve`)
command.py    the CLI subcommand

Nothing is re-exported here: the CLI imports command.py, which must stay light.
"""
