"""Work spread over a Ray cluster's nodes: one job pinned to each node, their results gathered as they come.

Ray is optional (`pip install 'specdecode[ray]'`) and imported here only, when a command is given
`--ray ADDRESS`; without it that option is a one-line error. The commands that use it:
`bench.ray_shards` (the benchmark's tasks) and `training.ray_answers` (the trained drafters' data).

A node is a machine of the cluster with at least one CPU that Ray may schedule on (a head node started
with `--num-cpus 0` takes no work). Every node runs the same installed specdecode and loads the models
itself, by the names the driver was given.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from specdecode.errors import UserError

INSTALL = "pip install 'specdecode[ray]'"


@dataclass(frozen=True)
class Node:
    id: str  # Ray's node id (hex)
    host: str
    cpus: int

    @property
    def name(self) -> str:
        """How records name the node: its host and the start of its id (several nodes may share a host)."""
        return f"{self.host}/{self.id[:8]}"


def import_ray():
    """The `ray` module, or a UserError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise UserError(f"--ray needs Ray, an optional dependency: {INSTALL}") from None
    return ray


def connect(address: str):
    """Ray, connected to the cluster at `address` as `ray.init` takes it ("auto": the cluster this machine
    belongs to, "ray://host:port", "host:port"; "local": a new one on this machine). Already connected
    (a test's own cluster): as it is."""
    ray = import_ray()
    if not ray.is_initialized():
        extra = {"include_dashboard": False} if address == "local" else {}
        try:
            ray.init(address=address, **extra)
        except (ConnectionError, ValueError, RuntimeError) as error:
            raise UserError(f"cannot reach a Ray cluster at {address!r}: {str(error).splitlines()[0]}") from None
    return ray


def nodes(ray) -> list[Node]:
    """The cluster's live nodes with a CPU for work, in a fixed order (host, then id)."""
    found = [Node(n["NodeID"], n.get("NodeManagerHostname") or socket.gethostname(), int(n["Resources"].get("CPU", 0)))
             for n in ray.nodes() if n["Alive"]]
    usable = sorted((n for n in found if n.cpus >= 1), key=lambda n: (n.host, n.id))
    if not usable:
        raise UserError("the Ray cluster has no live node with a CPU for work")
    return usable


def pinned(remote, node: Node, cpus: int):
    """`remote` (a Ray remote function or actor class) to run on `node` and nowhere else, holding `cpus`
    of its CPUs."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return remote.options(num_cpus=min(cpus, node.cpus),
                          scheduling_strategy=NodeAffinitySchedulingStrategy(node.id, soft=False))


def gather(ray, streams: dict[str, Any], then: Callable[[str], Any | None] = lambda key: None,
           ) -> Iterator[tuple[str, Any]]:
    """(key, item) for the items of every stream (a Ray generator's), whichever yields first; when a
    stream ends, `then(key)` may give the next stream for that key. A UserError raised on a node (a model
    that is not there, say) is raised here as one; other failures as Ray's."""
    pending = dict(streams)
    while pending:
        ready, _ = ray.wait(list(pending.values()), num_returns=1)
        key = next(k for k, stream in pending.items() if stream is ready[0])
        try:
            item = ray.get(next(pending[key]))
        except StopIteration:
            following = then(key)
            if following is None:
                del pending[key]
            else:
                pending[key] = following
            continue
        except ray.exceptions.RayTaskError as error:
            raise user_error(error, key) from None
        yield key, item


def user_error(error, node: str) -> Exception:
    """A Ray task's failure as it should reach the command line: a UserError raised on the node as one
    line naming the node, anything else as Ray reported it."""
    if isinstance(getattr(error, "cause", None), UserError):
        return UserError(f"on the Ray node {node}: {error.cause}")
    return error
