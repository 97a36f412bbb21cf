"""The processes of a launch, grouped by the process each file runs in.

``managers/`` itself holds what every process shares, and the processes that are one file each:

- ``io_struct`` (every message that crosses a process boundary, and its codec), ``ipc`` (the ZMQ
  endpoints of a launch), ``dispatcher`` (message type → handler), ``request_checks`` (what a
  request must satisfy, checked by the TokenizerManager and again by the scheduler);
- ``launcher`` (parent side: spawn the children, wait until ready, watch and stop them) and
  ``child_process`` (child side: report ready or failed, exit with the parent);
- ``detokenizer_manager`` (the detokenizer process) and ``data_parallel_controller`` (the
  process in front of data-parallel replicas).

``tokenizer/`` runs in the HTTP server's process (or an ``Engine``'s thread): the
TokenizerManager and the request it turns into messages. ``scheduler/`` runs in each scheduler
process: the loop, batches, policy, the model worker and the control handlers.
See docs/architecture.md §1-2.
"""
