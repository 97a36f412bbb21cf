"""Runs in the HTTP server's process (or on an ``Engine``'s private asyncio loop): the
TokenizerManager, the user-facing request before tokenization (``generate_request``), its
tokenization and bounds (``request_tokenizer``, ``request_values``) and what is kept while it runs
(``request_state``, ``logprob_meta``). Nothing here imports the scheduler's side."""
