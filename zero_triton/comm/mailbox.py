"""Requests to a rank's shard server (``zero_triton.comm.serve``): pushed by any rank, read
by that rank's server alone, on a store connection of the server's own, so that its
blocked read holds no connection the main thread uses. No polling either way.

Two forms, by what the rendezvous store offers:

- ``Queues`` (torch 2.8 and later: ``Store.queue_push``, ``queue_pop`` and ``clone``): one
  queue per rank. A request costs one push per peer; a read is one blocked pop.
- ``Numbered`` (torch 2.7, whose stores have no queues, over a TCPStore): entry n for
  rank r is the key ``inbox/r/n``; ``add`` numbers them, the server waits for its next
  key (``Store.wait``, blocked), reads it and deletes it. A request costs two operations
  per peer, a read three. The server's connection is a new TCPStore client to the same
  server (host and port).

Any other store (a FileStore, a HashStore) has neither: ``open`` raises
``MailboxError`` with the reason, and one-rank ``state_dict()`` says it.
"""
from __future__ import annotations

import datetime

import torch.distributed as dist

IDLE_WAIT = datetime.timedelta(hours=1)  # a blocked read, renewed when it ends


class MailboxError(RuntimeError):
    """No mailbox can be had over this rendezvous store."""


class _Mailbox:
    """``store``: the connection every push goes through; ``own``: the server's, which
    its blocked read holds; ``rank``: whose mailbox ``pop`` reads."""

    def __init__(self, store, own, rank: int):
        self.store, self.own, self.rank = store, own, rank


class Queues(_Mailbox):
    """One store queue per rank (torch 2.8 and later)."""

    def push(self, rank: int, entry: bytes) -> None:
        self.store.queue_push(f"inbox/{rank}", entry)

    def pop(self) -> bytes:
        """The next entry for this rank (blocks; raises on the store's timeout)."""
        return self.own.queue_pop(f"inbox/{self.rank}")


class Numbered(_Mailbox):
    """Numbered keys per rank and a blocked ``wait`` for the next (stores without queues)."""

    next = 1  # the next entry to read: ``add`` counts from 1

    def push(self, rank: int, entry: bytes) -> None:
        n = self.store.add(f"inbox/{rank}/n", 1)
        self.store.set(f"inbox/{rank}/{n}", entry)

    def pop(self) -> bytes:
        key = f"inbox/{self.rank}/{self.next}"
        self.own.wait([key], IDLE_WAIT)
        entry = self.own.get(key)
        self.own.delete_key(key)
        self.next += 1
        return entry


def open_mailbox(base, prefix: str, rank: int, queues: bool = True):
    """This rank's mailbox under ``prefix`` of ``base`` (the default store), with the
    server's own connection; ``MailboxError`` says why there is none. ``queues=False``
    takes the numbered keys even where the store has queues (the tests do, to run the
    form torch 2.7 gets on any torch)."""
    store = dist.PrefixStore(prefix, base)
    try:
        if not queues:
            raise RuntimeError("queues not wanted")
        own = store.clone()
        own.queue_len(f"inbox/{rank}")
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        no_queues = str(exc)  # not the exception: its traceback would hold the stores
    else:
        own.set_timeout(IDLE_WAIT)
        return Queues(store, own, rank)
    raw = base
    while isinstance(raw, dist.PrefixStore):
        raw = raw.underlying_store
    if not isinstance(raw, dist.TCPStore):
        raise MailboxError(f"the rendezvous store ({type(raw).__name__}) has no queues "
                           f"({no_queues}) and is no TCPStore; use a TCP store (torchrun, "
                           "env:// or tcp:// init_method)")
    try:  # the keys live in the TCP server itself, under our prefix: the same for every rank
        own = dist.TCPStore(raw.host, raw.port, is_master=False, timeout=IDLE_WAIT,
                            wait_for_workers=False)
    except (RuntimeError, ValueError) as exc:
        raise MailboxError(f"a connection of its own to the rendezvous store "
                           f"({raw.host}:{raw.port}) failed: {exc}") from exc
    return Numbered(dist.PrefixStore(prefix, raw), dist.PrefixStore(prefix, own), rank)
