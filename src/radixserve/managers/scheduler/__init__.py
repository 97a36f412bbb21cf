"""Runs in each scheduler process (one per rank of each replica): the process entry
(``scheduler_process``), the loop (``scheduler``) and the parts it composes: where a step's
messages come from (``request_receiver``), request and batch state (``schedule_batch``),
admission (``schedule_policy``), retraction, output processing, the grammar queue, the memory
check, statistics, the watchdog, the control handlers, and the model worker (``tp_worker``;
``overlap_worker`` for the overlap schedule). Nothing here imports the tokenizer's side."""
