"""The process world of a distributed deployment and its tensor-parallel subgroup.

World ranks 0..tp-1 are the verifier (the target model, tensor parallel); world rank tp is the drafter.
Every rank meets at a TCP store hosted by verifier rank 0. Before the process group exists, the ranks
agree on one backend through that store: NCCL only when every rank sits on its own CUDA device, gloo
otherwise. Deciding it together matters because a rank on its own cannot know that a peer is on the CPU
or on the same GPU (NCCL refuses two ranks on one device), and disagreeing ranks would hang.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

_KEY_PREFIX = "minedraft/backend"


@dataclass(frozen=True)
class Topology:
    """How many verifier ranks there are and whether a drafter rank follows them."""

    tp_size: int
    has_drafter: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be a positive integer, got {self.tp_size!r}")

    @property
    def world_size(self) -> int:
        return self.tp_size + int(self.has_drafter)

    @property
    def drafter_rank(self) -> int:
        """The drafter's world rank: right after the verifier ranks."""
        if not self.has_drafter:
            raise ValueError(f"this topology (tp_size={self.tp_size}) has no drafter")
        return self.tp_size

    @property
    def verifier_ranks(self) -> range:
        return range(self.tp_size)

    def describe(self) -> str:
        return f"{self.tp_size} verifier rank(s)" + (" + 1 drafter" if self.has_drafter else "")


@dataclass
class WorldGroups:
    """This process's place in the world, and the groups it communicates through."""

    rank: int
    topology: Topology
    backend: str
    device: torch.device  # where communication tensors must live: the rank's GPU under NCCL, else CPU
    tp_group: dist.ProcessGroup | None  # None on the drafter, which is not part of the TP group
    _store: dist.Store | None = field(default=None, repr=False)  # keeps the rendezvous alive
    _closed: bool = field(default=False, repr=False)

    @property
    def is_drafter(self) -> bool:
        return self.topology.has_drafter and self.rank == self.topology.drafter_rank

    @property
    def is_verifier(self) -> bool:
        return self.rank in self.topology.verifier_ranks

    @property
    def tp_rank(self) -> int | None:
        """Rank inside the TP group (equal to the world rank, since verifiers come first)."""
        return self.rank if self.is_verifier else None

    def close(self) -> None:
        """Tear the process group down; safe to call more than once.

        No barrier here, so that close() also works on error paths where peers are gone. A clean
        shutdown should put a barrier before it: rank 0 hosts the store the others still talk to.
        """
        if self._closed:
            return
        self._closed = True
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None

    def __enter__(self) -> WorldGroups:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pick_backend(device: str | torch.device) -> str:
    """The backend this rank would like: NCCL for a CUDA device when NCCL is usable, else gloo."""
    if torch.device(device).type == "cuda" and torch.cuda.is_available() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def rendezvous_store(
    master_addr: str, master_port: int, *, is_master: bool, timeout_s: float, host: str | None = None
) -> dist.TCPStore:
    """The TCP store the ranks meet at. Verifier rank 0 hosts it for its whole life (`is_master`), so that
    a rank that restarts can meet the others again; every other rank connects to it for each join.
    The host's store listens on `host` only (None: on every interface, torch's default)."""
    listen_fd = _bound_socket(host, master_port) if is_master and host else None
    return dist.TCPStore(
        master_addr, master_port, None, is_master=is_master, timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False, master_listen_fd=listen_fd,
    )  # fmt: skip


def init_world(
    *,
    rank: int,
    topology: Topology,
    master_addr: str,
    master_port: int,
    device: str | torch.device = "cpu",
    backend: str | None = None,
    timeout_s: float = 600,
    store: dist.Store | None = None,
    epoch: int = 0,
) -> WorldGroups:
    """Join the world (every rank calls this, the drafter too) and build the TP group.

    `backend=None` lets the ranks agree on one (see the module docstring); an explicit backend must be the
    same on every rank. Errors about the arguments are raised before anything touches the network.
    `store`: a rendezvous store that outlives this world (see `rendezvous_store`); None = one of its own.
    `epoch`: which formation of the world this is; every formation meets under keys of its own, so a world
    can be formed again after a rank died, through the same store.
    """
    _check_args(rank, topology, master_addr, master_port, backend, timeout_s)
    torch_device = _resolve_device(device)
    timeout = timedelta(seconds=timeout_s)
    # Our own store (not init_method="tcp://...") so the backend can be agreed on before the group exists.
    if store is None:
        store = dist.TCPStore(master_addr, master_port, topology.world_size, is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore(f"minedraft/epoch/{epoch}/", store)
    chosen = _agree_on_backend(store, rank, topology.world_size, torch_device, backend)
    comm_device = torch_device if chosen == "nccl" else torch.device("cpu")
    if chosen == "nccl":
        torch.cuda.set_device(comm_device)
    _init_default_group(chosen, store, rank, topology.world_size, timeout)
    try:
        tp_group = _new_tp_group(topology, timeout)
    except BaseException:
        dist.destroy_process_group()
        raise
    return WorldGroups(
        rank=rank,
        topology=topology,
        backend=chosen,
        device=comm_device,
        tp_group=tp_group if rank in topology.verifier_ranks else None,
        _store=store,
    )


def _init_default_group(backend: str, store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> None:
    """torch.distributed's default group over `store`, met under keys of this formation's own.

    The default group's name, and with it the keys its ranks meet under, is torch's count of groups made in this
    process. A formation that failed inside the rendezvous (a peer hung past the timeout) leaves the count raised
    where it failed: every later formation waited on keys its peers never wrote, and the world was never formed
    again. Every formation starts the count afresh (destroying a world does).
    """
    if not dist.is_initialized():
        dist.distributed_c10d._world.group_count = 0
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _bound_socket(host: str, port: int) -> int:
    """A listening socket on host:port, as a file descriptor the TCPStore takes over (and closes).
    torch's own store server binds every interface; a socket bound here keeps it to the one asked for."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise OSError(f"the rendezvous store cannot listen on {host}:{port}: {exc}") from exc
    return sock.detach()


def _check_args(
    rank: int, topology: Topology, master_addr: str, master_port: int, backend: str | None, timeout_s: float
) -> None:
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a Topology, got {type(topology).__name__}")
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank must be an int, got {rank!r}")
    if not 0 <= rank < topology.world_size:
        raise ValueError(
            f"rank {rank} is outside the world of {topology.world_size} ({topology.describe()}): "
            f"valid ranks are 0..{topology.world_size - 1}"
        )
    if not master_addr:
        raise ValueError("master_addr is empty: give verifier rank 0's address")
    if isinstance(master_port, bool) or not isinstance(master_port, int) or not 1 <= master_port <= 65535:
        raise ValueError(f"master_port must be an int in 1..65535, got {master_port!r}")
    if backend not in (None, "nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl', 'gloo' or None (agree automatically), got {backend!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group already exists in this process; close() it first")


def _resolve_device(device: str | torch.device) -> torch.device:
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"not a device: {device!r}") from exc
    if resolved.type == "cuda" and resolved.index is None and torch.cuda.is_available():
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _device_key(device: torch.device) -> str:
    """Names the physical device so that two ranks on the same GPU are noticed; empty for non-NCCL."""
    if pick_backend(device) != "nccl":
        return ""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    return f"{socket.gethostname()}/{uuid if uuid is not None else device}"


def _agree_on_backend(
    store: dist.Store, rank: int, world_size: int, device: torch.device, requested: str | None
) -> str:
    store.set(f"{_KEY_PREFIX}/{rank}", f"{requested or ''}|{pick_backend(device)}|{_device_key(device)}")
    entries = []
    for peer in range(world_size):
        req, preferred, key = store.get(f"{_KEY_PREFIX}/{peer}").decode().split("|", 2)
        entries.append((req or None, preferred, key))
    return agree_backend(entries)


def agree_backend(entries: list[tuple[str | None, str, str]]) -> str:
    """One backend for the whole world, from every rank's (requested, preferred, device key).

    Every rank runs this on the same entries, so all of them pick the same backend or all raise.
    """
    requested = {req for req, _, _ in entries if req is not None}
    if len(requested) > 1:
        raise ValueError(f"ranks asked for different backends: {sorted(requested)}")
    cpu_ranks = [r for r, (_, preferred, _) in enumerate(entries) if preferred != "nccl"]
    keys = [key for _, _, key in entries if key]
    shared = len(set(keys)) < len(keys)
    if requested == {"nccl"}:
        if cpu_ranks:
            raise ValueError(f"backend 'nccl' needs every rank on a CUDA device; rank(s) {cpu_ranks} are not")
        if shared:
            raise ValueError("backend 'nccl' needs one GPU per rank; some ranks share a GPU (use gloo)")
        return "nccl"
    if requested == {"gloo"} or cpu_ranks or shared:
        return "gloo"
    return "nccl"


def _new_tp_group(topology: Topology, timeout: timedelta) -> dist.ProcessGroup:
    if not topology.has_drafter:
        return dist.group.WORLD  # the TP group is the whole world: no second communicator needed
    # new_group is collective over the world: the drafter must call it too, though it is no member.
    return dist.new_group(ranks=list(topology.verifier_ranks), timeout=timeout)
