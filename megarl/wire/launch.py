"""What an engine's server process is started with beyond SGLang's own arguments, read by both the
launcher (:mod:`megarl.engines.server`) and the process (:mod:`megarl.engine_process.sglang_main`)."""

# The server's API key travels in this environment variable (readable by its user alone, unlike a
# command line, which every user of the node sees in ps); the server process hands it to SGLang.
API_KEY_ENV = "MEGARL_ENGINE_API_KEY"
# SGLang's flag that starts a server without its tokenizer; such a server gets the tokenizer's stop ids
# (megarl.engine_process.tokenizer_stops).
SKIP_TOKENIZER_FLAG = "--skip-tokenizer-init"
