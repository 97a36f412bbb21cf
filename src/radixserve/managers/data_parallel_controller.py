"""DataParallelController: one process in front of ``dp_size`` scheduler replicas.

    TokenizerManager ──▶ controller ──▶ replica i's rank 0 ──▶ (its ranks, see RequestReceiver)
                             ▲                    │ LoadReport (when its load changes)
                             └────────────────────┘
    replica outputs go straight to the detokenizer, replies straight to the TokenizerManager

The controller binds the endpoint the TokenizerManager sends to (``PortArgs.scheduler_input``);
replica ``i`` listens on ``PortArgs.replica_input(i)``. Where a message goes:

    generate request of a session   the replica that holds the session (session affinity: a
                                    session's tree or streaming slot lives in one replica)
    other generate request with     that replica (SGLang's field; the TokenizerManager checked
    ``data_parallel_rank``          that it exists)
    other generate or embedding     the replica the policy picks
    request
    OpenSessionReqInput             the replica the policy picks, remembered for the session id
                                    (the TokenizerManager always names the id); a duplicate id
                                    goes to the replica holding it, which refuses it
    CloseSessionReqInput            the session's replica, then forgotten
    anything else (abort, flush,    every replica; the TokenizerManager waits for one reply per
    internal state, ...)            replica

Policies (``--load-balance-method``): ``round_robin``, and ``shortest_queue``: the fewest
requests, from the replicas' last ``LoadReport`` plus the requests sent to them since (a report
counts the requests its replica had received, so none is counted twice or missed).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import zmq

from radixserve.managers import io_struct, ipc
from radixserve.managers.child_process import install_exit_handlers, report_ready
from radixserve.managers.io_struct import (
    CloseSessionReqInput,
    LoadReport,
    OpenSessionReqInput,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)


class DataParallelController:
    """The routing decisions, over ``send(replica, msg)``; no sockets of its own."""

    def __init__(self, dp_size: int, method: str, send: Any) -> None:
        self.dp_size = dp_size
        self.method = method
        self.send = send
        self.session_replica: dict[str, int] = {}
        self.sent = [0] * dp_size  # generate and embedding requests sent to each replica
        self.reports: list[LoadReport | None] = [None] * dp_size
        self._next = 0  # round robin, and the tie-break of shortest_queue

    def handle(self, msg: io_struct.Message) -> None:
        if isinstance(msg, LoadReport):
            self.reports[msg.dp_rank] = msg
        elif isinstance(msg, TokenizedGenerateReqInput):
            session = msg.session_params.id if msg.session_params is not None else None
            replica = self.session_replica.get(session) if session is not None else None
            if replica is None:
                replica = msg.data_parallel_rank
            self._send_generate(self.pick() if replica is None else replica, msg)
        elif isinstance(msg, TokenizedEmbeddingReqInput):
            self._send_generate(self.pick(), msg)
        elif isinstance(msg, OpenSessionReqInput):
            assert msg.session_id is not None, "the TokenizerManager names every session"
            replica = self.session_replica.setdefault(msg.session_id, self.pick())
            self.send(replica, msg)
        elif isinstance(msg, CloseSessionReqInput):
            replica = self.session_replica.pop(msg.session_id, None)
            for i in range(self.dp_size) if replica is None else (replica,):
                self.send(i, msg)
        else:
            for i in range(self.dp_size):
                self.send(i, msg)

    def _send_generate(
        self, replica: int, msg: TokenizedGenerateReqInput | TokenizedEmbeddingReqInput
    ) -> None:
        self.sent[replica] += 1
        self.send(replica, msg)

    def load(self, replica: int) -> int:
        """Requests running or waiting on ``replica``, as far as the controller knows."""
        report = self.reports[replica]
        if report is None:
            return self.sent[replica]
        return report.num_reqs + self.sent[replica] - report.num_received

    def pick(self) -> int:
        """The replica for a request without a session (or opening one)."""
        order = [(self._next + i) % self.dp_size for i in range(self.dp_size)]
        if self.method == "shortest_queue":
            choice = min(order, key=self.load)  # ties: the first in round-robin order
        else:
            choice = order[0]
        self._next = (choice + 1) % self.dp_size
        return choice


def run_data_parallel_controller_process(
    server_args_json: str, port_args_json: str, ready_conn: Any
) -> None:
    """Entry point of the spawned controller process (arguments arrive as JSON)."""
    install_exit_handlers()
    server_args = ServerArgs(**json.loads(server_args_json))
    logging.basicConfig(
        level=server_args.log_level.upper(),
        format="%(asctime)s dp-controller %(levelname)s %(name)s: %(message)s",
    )
    ctx = zmq.Context()
    try:
        port_args = ipc.PortArgs(**json.loads(port_args_json))
        recv = ipc.pull_socket(ctx, port_args.scheduler_input)
        replicas = [
            ipc.push_socket(ctx, port_args.replica_input(i, server_args.dp_size))
            for i in range(server_args.dp_size)
        ]
        controller = DataParallelController(
            server_args.dp_size,
            server_args.load_balance_method,
            lambda replica, msg: ipc.send(replicas[replica], msg),
        )
        report_ready(ready_conn)
        while True:
            controller.handle(io_struct.decode(recv.recv()))
    finally:
        ctx.destroy(linger=0)
