"""One process of the health-registry tests (tests/test_registry.py), talking to a real TCPStore.

Roles:
- ``writer``: rewrites its node's two-key state in a tight loop, sleeping ``--gap-seconds``
  between the two keys of every write. Write ``i`` puts ``reason = "w<i>"`` and a status that
  follows the parity of ``i`` in the status key, and ``mem_used_bytes = i`` in the info key, so a
  state mixing two writes is visible in the state itself.
- ``reader``: reads every writer's node until all writers are done; counts reads, torn states
  and states older than one it already saw.
- ``hold``: publishes once, then dies (the test SIGKILLs it) in the middle of its second write,
  with its bit set and only the status key written.

Writers and readers go through two phases, separated by barriers so that no read of one phase
overlaps a write of the other: ``guarded`` (``--seconds``, the protocol as shipped, extended up
to ``--max-seconds`` until every reader has ``--min-reads``: readers only get through while no
bit is set, so on a loaded machine they need longer) and
``control`` (``--control-seconds``, writers ignore the protocol: no bit, no new version, like a
buggy writer), which proves that the readers' torn-state check does fire. The first barrier also
keeps the import of torch (seconds on a small machine) out of the measured window.
Every role prints one JSON line with its counts as the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import time

from ckptpilot.tiers.peer.registry import HealthRegistry, NodeState, connect_store
from ckptpilot.tiers.peer.storeclient import StoreClient

PHASES = ("guarded", "control")


def expected_status(i: int) -> str:
    return "up" if i % 2 == 0 else "draining"


def torn(state: NodeState) -> bool:
    """True if the status key and the info key of ``state`` come from different writes."""
    i = state.mem_used_bytes
    return state.reason != f"w{i}" or state.status != expected_status(i)


def open_store(args: argparse.Namespace):
    """torch's store client, or the torch-free one the daemons use (``--client python``)."""
    if args.client == "python":
        return StoreClient("127.0.0.1", args.port)
    return connect_store("127.0.0.1", args.port)


def barrier(store, name: str, parties: int) -> None:
    key = f"test/barrier/{name}"
    store.add(key, 1)
    while int(store.add(key, 0)) < parties:
        time.sleep(0.005)


def writer(args: argparse.Namespace) -> dict:
    store = open_store(args)
    reg = HealthRegistry(store, node=args.node, num_nodes=args.num_nodes)

    def state(i: int) -> NodeState:
        return NodeState(node=args.node, status=expected_status(i),
                         endpoint=f"127.0.0.1:{9000 + args.node}", mem_used_bytes=i,
                         mem_limit_bytes=1 << 30, reason=f"w{i}")

    reg.publish(state(0))
    reg._between_keys = lambda: time.sleep(args.gap_seconds)
    i = 0
    writes = {}
    readers = [f"test/reads/{node}" for node in range(args.writers, args.parties)]

    def enough_reads() -> bool:
        return all(int(store.add(key, 0)) >= args.min_reads for key in readers)

    for phase, seconds in zip(PHASES, (args.seconds, args.control_seconds), strict=True):
        reg._guarded = phase == "guarded"
        barrier(store, f"{phase}/start", args.parties)
        start = i
        began = time.monotonic()
        while True:
            elapsed = time.monotonic() - began
            if elapsed >= seconds and (phase == "control" or elapsed >= args.max_seconds
                                       or (i % 50 == 0 and enough_reads())):
                break
            i += 1
            reg.publish(state(i))
        writes[phase] = i - start
        store.add(f"test/{phase}/writers_done", 1)
    return writes


def reader(args: argparse.Namespace) -> dict:
    store = open_store(args)
    reg = HealthRegistry(store, node=args.node, num_nodes=args.num_nodes)
    nodes = list(range(args.writers))
    last_seq = dict.fromkeys(nodes, 0)
    last_i = dict.fromkeys(nodes, 0)
    results = {}
    for phase in PHASES:
        barrier(store, f"{phase}/start", args.parties)
        reads = torn_reads = regressions = 0
        examples: list[str] = []
        while int(store.add(f"test/{phase}/writers_done", 0)) < args.writers:
            for node in nodes:
                state = reg.read(node)
                assert state is not None, f"node {node} published before the barrier"
                reads += 1
                if phase == "guarded":
                    store.add(f"test/reads/{args.node}", 1)
                if torn(state):
                    torn_reads += 1
                    if len(examples) < 2:
                        examples.append(state.to_json())
                if state.seq < last_seq[node] or state.mem_used_bytes < last_i[node]:
                    regressions += 1
                last_seq[node] = max(last_seq[node], state.seq)
                last_i[node] = max(last_i[node], state.mem_used_bytes)
        results[phase] = {"reads": reads, "torn": torn_reads, "regressions": regressions,
                          "examples": examples}
    return results


def hold(args: argparse.Namespace) -> dict:
    store = open_store(args)
    reg = HealthRegistry(store, node=args.node, num_nodes=args.num_nodes)
    reg.publish(NodeState(node=args.node, status="up", endpoint=f"127.0.0.1:{9000 + args.node}",
                          reason="w0"))

    def wait_for_the_kill() -> None:
        print("holding", flush=True)
        time.sleep(120)

    reg._between_keys = wait_for_the_kill
    reg.publish(NodeState(node=args.node, status="draining", reason="never finished"))
    return {"error": "the second publish returned although it should have been killed"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["writer", "reader", "hold"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--node", type=int, required=True)
    parser.add_argument("--num-nodes", type=int, required=True)
    parser.add_argument("--writers", type=int, default=0)
    parser.add_argument("--parties", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--max-seconds", type=float, default=15.0)
    parser.add_argument("--min-reads", type=int, default=20)
    parser.add_argument("--control-seconds", type=float, default=0.5)
    parser.add_argument("--gap-seconds", type=float, default=0.001)
    parser.add_argument("--client", choices=["torch", "python"], default="torch")
    args = parser.parse_args()
    result = {"writer": writer, "reader": reader, "hold": hold}[args.role](args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
